"""Sampling, detokenization and the streaming generate loop."""

from kvtool.engine.engine import Engine
from kvtool.engine.output import Generation, Timings, TokenEvent

__all__ = ["Engine", "Generation", "Timings", "TokenEvent"]
