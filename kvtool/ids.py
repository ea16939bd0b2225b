"""Token ids from the Python API (a list, tuple, range, numpy array or 1-D tensor of integers), and a request's.

Everything else (text, floats, nested lists, None) is refused with a message that names the argument, rather than a
TypeError from deep inside, or a float quietly rounded to a token; check_request() checks a request's ids and sizes.
"""

from __future__ import annotations

import numbers
from typing import Any

from kvtool.config import SamplingParams
from kvtool.errors import ContextWindowError, InvalidParameterError


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


def check_request(prompt_ids: list[int], params: SamplingParams, window: int, vocab: int, stop_ids: set[int]) -> int:
    """Validate a request's sizes against a context window and vocabulary (any engine); return its effective
    max_tokens. stop_ids: the tokens that end its output."""
    if not prompt_ids:
        raise InvalidParameterError("the prompt is empty; give at least one token")
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise InvalidParameterError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
    for name in ("logit_bias", "allowed_token_ids"):
        bad = sorted(t for t in getattr(params, name) or () if t >= vocab)
        if bad:
            raise InvalidParameterError(f"{name} token ids must be in [0, {vocab}); got {bad[:5]}")
    if len(prompt_ids) >= window:
        raise ContextWindowError(f"the prompt has {len(prompt_ids)} tokens; the model's context window is "
                                 f"{window} tokens and must leave room for at least 1 new token")
    if params.min_tokens and params.allowed_token_ids is not None and set(params.allowed_token_ids) <= stop_ids:
        raise InvalidParameterError("allowed_token_ids lists only stop tokens, which min_tokens holds back: "
                                    "nothing could be drawn")
    max_tokens = params.max_tokens if params.max_tokens is not None else window - len(prompt_ids)
    if params.min_tokens > max_tokens:
        raise ContextWindowError(f"min_tokens ({params.min_tokens}) does not fit: the context window of {window} "
                                 f"tokens leaves {max_tokens} after the prompt")
    if len(prompt_ids) + max_tokens > window:
        raise ContextWindowError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = "
                                 f"{len(prompt_ids) + max_tokens} exceeds the context window of {window} tokens")
    return max_tokens
