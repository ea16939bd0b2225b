"""Tiny random Qwen3 / Qwen2 / Llama / Gemma 3 checkpoints for fast tests, with transformers as oracle."""

from __future__ import annotations

from pathlib import Path

import torch

from kvtool.models.tiny import qwen3_0_6b_config, random_checkpoint

__all__ = ["TINY_COMMON", "qwen3_0_6b_config", "random_checkpoint", "tiny_checkpoint", "tiny_config", "tiny_runner"]

TINY_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rms_norm_eps=1e-6)


def tiny_config(family: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family == "qwen3":
        return Qwen3Config(**TINY_COMMON, head_dim=32, rope_theta=1e6, tie_word_embeddings=True)
    if family == "qwen2":
        return Qwen2Config(**TINY_COMMON, rope_theta=1e6, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**TINY_COMMON, rope_theta=1e5, tie_word_embeddings=True)
    if family == "gemma3":  # window 8 and layers local, local, global, local: prompts of ~40 tokens cross it
        from transformers import Gemma3TextConfig

        kinds = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        return Gemma3TextConfig(**{**TINY_COMMON, "num_hidden_layers": 4}, head_dim=16, query_pre_attn_scalar=24,
                                sliding_window=8, layer_types=kinds, tie_word_embeddings=True,
                                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    raise ValueError(family)


def tiny_checkpoint(family: str, folder: Path, seed: int = 0):
    """Save a random HF model of `family` to `folder`; return the transformers model (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0; perturb so they are tested
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf.eval()
    hf.save_pretrained(str(folder))
    return hf


def tiny_runner(family: str, folder: Path, weights: str = "dense", forward: str = "auto", dense_copies: bool = False):
    from transformers import AutoConfig

    from kvtool.models.loading import build_runner
    from kvtool.models.spec import ModelSpec

    cfg = AutoConfig.from_pretrained(str(folder))
    return build_runner(ModelSpec.from_hf_config(cfg), cfg, folder, torch.device("cpu"), torch.float32,
                        progress=False, weights=weights, forward=forward, dense_copies=dense_copies)
