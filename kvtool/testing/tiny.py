"""Tiny random checkpoints, where tests import them from (they live in kvtool.models.tiny)."""

from kvtool.models.tiny import (TINY_COMMON, qwen3_0_6b_config, random_checkpoint, tiny_checkpoint,
                                tiny_config, tiny_runner)

__all__ = ["TINY_COMMON", "qwen3_0_6b_config", "random_checkpoint", "tiny_checkpoint", "tiny_config", "tiny_runner"]
