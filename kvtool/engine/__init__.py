"""Sampling, detokenization and the streaming generate loop."""

from kvtool.engine.generate import Engine, Generation, Timings, TokenEvent

__all__ = ["Engine", "Generation", "Timings", "TokenEvent"]
