"""A model's sampling defaults: what a request that names no temperature, top_p, top_k, min_p or penalty samples
with (kvtool.config.MODEL_DEFAULTS), and where they came from.

The model decides first: its generation_config.json (else config.json), read as vLLM's `--generation-config
auto` reads it (those keys; `do_sample` is not read), or a GGUF's general.sampling.* metadata. Where the model
says nothing, the card of a model kvtool knows (CARDS), else llama-server's defaults. Keys a model's file leaves
out take the plain SamplingDefaults() values, as in vLLM.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from kvtool.config import MODEL_DEFAULTS, SamplingDefaults, SamplingParams
from kvtool.errors import InvalidParameterError, ModelLoadError
from kvtool.models import gguf

LLAMA_SERVER = SamplingDefaults(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05, repetition_penalty=1.0,
                                source="llama-server defaults")


@dataclass(frozen=True)
class Card:
    """A model family's recommended sampling, for files that carry none: the card applies where every one of
    `words` (regexes) is found in the model's names (file or hub id, GGUF general.name/basename/finetune/size)."""

    name: str
    words: tuple[str, ...]
    values: dict


SMOLLM2 = dict(temperature=0.2, top_p=0.9)  # the cards' generate(..., temperature=0.2, top_p=0.9, do_sample=True)
QWEN_INSTRUCT = dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)  # Qwen2.5-*-Instruct's file
QWEN3_THINKING = dict(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0)  # Qwen3's file, and its card (thinking)
CARDS = [  # first match wins: the more specific name first
    Card("SmolLM2-135M-Instruct", (r"smollm2", r"135m", r"instruct"), SMOLLM2),
    Card("SmolLM2-360M-Instruct", (r"smollm2", r"360m", r"instruct"), SMOLLM2),
    Card("SmolLM2-1.7B-Instruct", (r"smollm2", r"1\.7b", r"instruct"), SMOLLM2),
    Card("Qwen2.5-Coder-Instruct", (r"qwen2\.5", r"coder", r"instruct"), QWEN_INSTRUCT),
    Card("Qwen2.5-Instruct", (r"qwen2\.5", r"instruct"), QWEN_INSTRUCT),
    Card("Qwen3-Coder", (r"qwen3", r"coder"), QWEN_INSTRUCT),
    Card("Qwen3-Instruct-2507", (r"qwen3", r"instruct", r"2507"), dict(temperature=0.7, top_p=0.8, top_k=20,
                                                                         min_p=0.0)),
    Card("Qwen3", (r"qwen3",), QWEN3_THINKING),
]


def sampling_defaults(folder: Path, name: str, setting: str = "auto") -> SamplingDefaults:
    """The defaults for the model in `folder` (an HF folder, or one converted from a GGUF) named `name` (its hub
    id, folder or file name, Ollama name). setting: auto | none | a folder with a generation_config.json
    (EngineConfig.generation_config)."""
    if setting == "none":
        return SamplingDefaults()
    meta = gguf.source_meta(folder) or {}
    if setting != "auto":
        own = from_file(generation_file(Path(setting).expanduser()), f"--generation-config {setting}")
    elif meta:  # converted from a GGUF: its config.json is kvtool's, the metadata is the model's
        own = checked(meta.get("sampling") or {}, "GGUF metadata", f"the metadata of {meta.get('gguf')}")
    else:
        own = from_file(folder / "generation_config.json") or from_file(folder / "config.json")
    if own is not None:
        return own
    said = " ".join([name, *(meta.get(key, "") for key in gguf.IDENTITY)]).lower()
    for card in CARDS:
        if all(re.search(rf"(?<![a-z0-9.]){word}(?![a-z0-9]|\.[0-9])", said) for word in card.words):
            return checked(card.values, f"model card: {card.name}", f"the card of {card.name}")
    return LLAMA_SERVER


def generation_file(path: Path) -> Path:
    """--generation-config FOLDER: its generation_config.json (a file path is taken as it is)."""
    file = path if path.is_file() else path / "generation_config.json"
    if not file.is_file():
        raise ModelLoadError(f"--generation-config {path}: no generation_config.json there; give a folder that has "
                             "one, auto (the model's own) or none (temperature 1, no top-p/top-k)")
    return file


def from_file(file: Path, what: str | None = None) -> SamplingDefaults | None:
    """The defaults a generation_config.json (or config.json) sets; None where the file or the keys are missing."""
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{what or file} is not readable JSON: {exc}") from None
    return checked(data if isinstance(data, dict) else {}, file.name, what or str(file))


def checked(values: dict, source: str, where: str) -> SamplingDefaults | None:
    """SamplingDefaults of those MODEL_DEFAULTS keys values sets (None if it sets none), each checked as a request's
    would be: a bad value is refused at load, not on every request."""
    given = {name: values[name] for name in MODEL_DEFAULTS if values.get(name) is not None}
    if not given:
        return None
    top_k = given.get("top_k")
    if isinstance(top_k, float) and top_k.is_integer():
        given["top_k"] = top_k = int(top_k)  # 20.0 in a JSON file
    if isinstance(top_k, int) and top_k < 0:
        given["top_k"] = 0  # -1: off, as in vLLM and llama.cpp
    try:
        SamplingParams(**given).validate()
    except InvalidParameterError as exc:
        raise ModelLoadError(f"{where} sets a sampling default kvtool cannot use: {exc}; load with "
                             "--generation-config none (or generation_config='none') to ignore it") from None
    return SamplingDefaults(**{k: v if k == "top_k" else float(v) for k, v in given.items()}, source=source)
