"""Token ids from the Python API: a list, tuple, range, numpy array or 1-D tensor of integers.

Everything else (text, floats, nested lists, None) is refused with a message that names the
argument, rather than a TypeError from deep inside, or a float quietly rounded to a token.
"""

from __future__ import annotations

import numbers
from typing import Any

from kvtool.errors import InvalidParameterError


def as_token_ids(value: Any, what: str = "prompt") -> list[int]:
    """`value` as a list of Python ints; InvalidParameterError naming `what` if it is not token ids."""
    if isinstance(value, (str, bytes)):
        raise InvalidParameterError(f"{what} is {type(value).__name__}, not token ids; encode text first "
                                    "(model.encode(text))")
    if hasattr(value, "tolist") and hasattr(value, "ndim"):  # numpy array or torch tensor
        if value.ndim != 1:
            raise InvalidParameterError(f"{what} must be 1-D token ids; got an array of shape {tuple(value.shape)}")
        value = value.tolist()
    try:
        items = list(value)
    except TypeError:
        raise InvalidParameterError(f"{what} must be a list of token ids; got {type(value).__name__}") from None
    for t in items:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise InvalidParameterError(f"{what} must hold integer token ids; got {t!r} ({type(t).__name__})")
    return [int(t) for t in items]
