"""Arguments shared by subcommands; defaults come from EngineConfig/SamplingParams."""

from __future__ import annotations

import argparse
import sys

from kvtool.config import EngineConfig, SamplingParams
from kvtool.models.loading import WEIGHTS

ENGINE = EngineConfig()
SAMPLING = SamplingParams()


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"hub id, HF folder or .gguf file (default: {ENGINE.model} if available, "
                        "else the embedded SmolLM2)")
    p.add_argument("--device", default=ENGINE.device, help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default=ENGINE.dtype, help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16")
    p.add_argument("--weights", default=ENGINE.weights, choices=WEIGHTS,
                   help="int4: 4-bit projections and a bf16 output head for about 2x CPU decode "
                        "(CPU only; prefill unchanged)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=SAMPLING.temperature, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=SAMPLING.top_p)
    p.add_argument("--top-k", type=int, default=SAMPLING.top_k)
    p.add_argument("--min-p", type=float, default=SAMPLING.min_p)
    p.add_argument("--repetition-penalty", type=float, default=SAMPLING.repetition_penalty)
    p.add_argument("--presence-penalty", type=float, default=SAMPLING.presence_penalty)
    p.add_argument("--frequency-penalty", type=float, default=SAMPLING.frequency_penalty)
    p.add_argument("--seed", type=int, default=SAMPLING.seed)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(args) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=list(args.stop),
    ).validate()


def load_from_args(args):
    from kvtool.models.loading import load
    from kvtool.models.resolve import resolve_model_arg

    model = resolve_model_arg(args.model, announce=lambda s: print(s, file=sys.stderr))
    return load(model, device=args.device, dtype=args.dtype, weights=args.weights)
