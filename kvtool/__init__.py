"""kvtool: an inference-level toolkit for small local models and their KV cache."""

from kvtool.config import EngineConfig, SamplingParams
from kvtool.errors import KvtoolError
from kvtool.models.loading import LoadedModel, load
from kvtool.version import __version__ as __version__

__all__ = ["EngineConfig", "SamplingParams", "KvtoolError", "LoadedModel", "load"]
