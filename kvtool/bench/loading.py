"""The model a benchmark runs: a real checkpoint (--model) or random weights in a named shape (--shape).

`kvtool bench all` loads one BenchModel and hands it to every benchmark; the transformers
baseline of the same weights is loaded once, on first use.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtool.errors import InvalidParameterError, ModelLoadError
from kvtool.models.loading import LoadedModel


def _qwen3_0_6b():
    from kvtool.models.tiny import qwen3_0_6b_config

    return qwen3_0_6b_config()


SHAPES = {"qwen3-0.6b": _qwen3_0_6b}  # --shape name -> transformers config of the random checkpoint
MODEL_ALIASES = ("smollm2", "qwen25", "gemma3")  # offline test models (kvtool.models.offline.<alias>_gguf)


class IdTokenizer:
    """Stands in for the tokenizer of a checkpoint that has none: token i reads "<i>"; no chat template."""

    chat_template = None
    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(f"<{int(i)}>" for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise ModelLoadError("this checkpoint has random weights and no tokenizer; benchmarks that render chat "
                             "prompts need --model (or the embedded SmolLM2 installed for its tokenizer)")

    def get_vocab(self) -> dict:
        return {}


@dataclass
class BenchModel:
    name: str
    model: LoadedModel  # what Engine and the in-process TTFT backend need
    random_weights: bool = False
    temp_folder: Path | None = None  # a random checkpoint written for this run; removed by close()
    _hf: object = field(default=None, repr=False)

    @property
    def runner(self):
        return self.model.runner

    @property
    def device(self) -> torch.device:
        return self.model.runner.device

    @property
    def dtype(self) -> str:
        return self.model.runner.precision

    def hf(self):
        """The transformers model of the same weights, dtype and device (loaded once)."""
        if self._hf is None:
            from transformers import AutoModelForCausalLM

            self._hf = AutoModelForCausalLM.from_pretrained(str(self.model.folder), dtype=self.runner.dtype)
            self._hf = self._hf.to(self.device).eval()
        return self._hf

    def close(self) -> None:
        self._hf = None
        if self.temp_folder is not None:
            shutil.rmtree(self.temp_folder, ignore_errors=True)

    def __enter__(self) -> "BenchModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def from_checkpoint(folder: Path, name: str, device: str = "auto", dtype: str = "auto", tokenizer=None,
                    temporary: bool = False, weights: str = "dense") -> BenchModel:
    """A BenchModel over an HF folder without a tokenizer (random or tiny test checkpoints)."""
    from transformers import AutoConfig

    from kvtool.models.loading import build_runner, pick_device, pick_dtype
    from kvtool.models.spec import ModelSpec

    dev = pick_device(device)
    cfg = AutoConfig.from_pretrained(str(folder))
    runner = build_runner(ModelSpec.from_hf_config(cfg), cfg, Path(folder), dev, pick_dtype(dtype, dev),
                          progress=False, weights=weights)
    info = {"device": str(dev), "dtype": str(runner.dtype).replace("torch.", ""), "weights": weights}
    model = LoadedModel(name=name, folder=Path(folder), runner=runner, tokenizer=tokenizer or IdTokenizer(),
                        hf_config=cfg, source=str(folder), info=info)
    return BenchModel(name, model, random_weights=True, temp_folder=Path(folder) if temporary else None)


def _embedded_tokenizer():
    """SmolLM2's tokenizer if the embedded model is installed (ids < 49152 fit any shape here), else None."""
    from transformers import AutoTokenizer

    from kvtool.models import gguf
    from kvtool.models.embedded import smollm2_path

    try:
        return AutoTokenizer.from_pretrained(str(gguf.converted_folder(smollm2_path())))
    except ModelLoadError:
        return None


def folder_tokenizer(path: str, vocab_size: int):
    """The tokenizer (and chat template) in HF folder `path`, checked to fit a model of vocab_size ids."""
    from transformers import AutoTokenizer

    folder = Path(path)
    if not folder.is_dir():
        raise InvalidParameterError(f"--tokenizer {path}: no such folder (give a Hugging Face tokenizer folder)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:
        raise InvalidParameterError(f"--tokenizer {path}: could not load a tokenizer there: "
                                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    if len(tokenizer) > vocab_size:
        raise InvalidParameterError(f"--tokenizer {path} has {len(tokenizer)} tokens; the model's vocabulary has "
                                    f"only {vocab_size}")
    return tokenizer


def load_bench_model(model_arg: str | None = None, shape: str | None = None, device: str = "auto",
                     dtype: str = "auto", announce=print, weights: str = "dense",
                     tokenizer: str | None = None) -> BenchModel:
    """--shape: random weights in that shape, prompts tokenized by the --tokenizer folder (default: SmolLM2's
    tokenizer when installed); else --model: a hub id, HF folder, GGUF file or an alias in MODEL_ALIASES
    (default: kvtool's default model)."""
    from kvtool.models.loading import load

    if shape is None and tokenizer is not None:
        raise InvalidParameterError("--tokenizer goes with --shape (a --model brings its own tokenizer)")
    if shape is not None:
        if shape not in SHAPES:
            raise InvalidParameterError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
        if model_arg:
            raise InvalidParameterError("give either --model or --shape, not both")
        from kvtool.models.tiny import random_checkpoint

        config = SHAPES[shape]()
        if tokenizer is not None:
            tok, label = folder_tokenizer(tokenizer, config.vocab_size), f"tokenizer from {tokenizer}"
        else:
            tok, label = _embedded_tokenizer(), "SmolLM2 tokenizer"
        folder = random_checkpoint(config, Path(tempfile.mkdtemp(prefix="kvtool-bench-")))
        name = f"{shape} shape (random weights{', ' + label if tok else ''})"
        return from_checkpoint(folder, name, device, dtype, tok, temporary=True, weights=weights)
    model = load(model_path(model_arg, announce), device=device, dtype=dtype, progress=False, weights=weights)
    return BenchModel(model.name, model)


def model_path(model_arg: str | None, announce=print) -> str:
    """What a benchmark's --model names: an alias in MODEL_ALIASES (the offline test models), else a hub id,
    HF folder or GGUF file (None: kvtool's default model)."""
    if model_arg in MODEL_ALIASES:
        from kvtool.models import offline

        return str(getattr(offline, f"{model_arg}_gguf")())
    from kvtool.models.resolve import resolve_model_arg

    return resolve_model_arg(model_arg, announce=announce)
