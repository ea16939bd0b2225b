"""Where kvtool keeps what it builds once and reuses: converted models, compiled ops, skill blocks."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """KVTOOL_CACHE, else ~/.cache/kvtool (read on every call, so a test can point it elsewhere)."""
    return Path(os.environ.get("KVTOOL_CACHE", Path.home() / ".cache" / "kvtool"))
