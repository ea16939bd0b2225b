"""Which model the main command runs when the user names none."""

from __future__ import annotations

import textwrap

from kvtool.config import DEFAULT_MODEL
from kvtool.errors import ModelLoadError
from kvtool.models.embedded import smollm2_path
from kvtool.models.loading import hub_folder


def default_model() -> tuple[str, str]:
    """(model path or id, one-line reason). Qwen3-0.6B if cached or downloadable, else embedded SmolLM2."""
    try:
        hub_folder(DEFAULT_MODEL, local_only=True)
        return DEFAULT_MODEL, f"using {DEFAULT_MODEL} from the local Hugging Face cache"
    except ModelLoadError:
        pass
    try:
        hub_folder(DEFAULT_MODEL)
        return DEFAULT_MODEL, f"using {DEFAULT_MODEL}, downloaded from the Hugging Face hub"
    except ModelLoadError as exc:
        offline = str(exc)
    path = smollm2_path()
    reason = textwrap.shorten(offline.split(": ", 1)[-1].split(". ")[0], 200, placeholder=" ...")  # its first sentence
    return str(path), (f"using the embedded SmolLM2-135M-Instruct ({path.name}) because {DEFAULT_MODEL} "
                       f"is not cached and the hub is unreachable ({reason})")


def resolve_model_arg(model: str | None, announce=print) -> str:
    """The model to load for a CLI command; prints the choice and why when defaulted."""
    if model:
        return model
    choice, why = default_model()
    announce(f"kvtool: {why}")
    return choice
