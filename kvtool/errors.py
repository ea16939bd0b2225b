"""Errors that are part of kvtool's interface.

Every error a user can cause derives from KvtoolError; the CLI prints its message
without a traceback, and the server maps it to an OpenAI-shaped error object.
"""


class KvtoolError(Exception):
    """Base class: the message says what was wrong and what to do."""

    status_code = 400


class ModelLoadError(KvtoolError):
    """A model path, id or file could not be loaded."""


class ContextWindowError(KvtoolError):
    """A prompt (plus the tokens asked for) does not fit the model's context window."""


class InvalidParameterError(KvtoolError):
    """A sampling or engine parameter is out of range or of the wrong type."""


class PoolExhausted(KvtoolError):
    """A KV block pool has no spare block (a request needs more KV than the engine's memory holds)."""


class CacheFormatError(KvtoolError):
    """A stored KV object is truncated, tampered or made for another model."""


class PrefixCacheWarning(UserWarning):
    """The prefix cache could not do what was asked (budget too small, a KV hand-back failed); the request runs."""


class DoubleBosWarning(UserWarning):
    """A raw prompt already starts with the BOS token its tokenizer adds: rendered chat text encoded as raw."""
