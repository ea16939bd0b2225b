"""Checks on one value in JSON schema mode: can this number or string, as written so far, still end as
the schema allows, and may it end here?

- integers: `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum` and an integer `enum`; each digit
  must leave some integer in range.
- numbers with any of those bounds are written without an exponent. The decimals a prefix can still
  reach form intervals ("12." reaches [12, 13), "0" reaches [0, 1), "7" reaches [7, 8), [70, 80), ...);
  a character is allowed while one of them meets the bounds, compared exactly as decimals (a bound
  of 0.3 is 3/10, as written, not the double nearest it).
- strings: `pattern` is searched for, as JSON schema does (anchor it, ^...$, to match the whole
  string), and the formats in FORMATS are anchored patterns. Each character must leave some
  continuation that matches (the `regex` package's partial matching on the decoded string), and
  the closing quote needs a match. A character split across tokens is checked as U+FFFD. Patterns are
  compiled by kvtool.structured.regex_mode.compile_pattern, under its limits (repeat counts, size, no recursion).
"""

from __future__ import annotations

import functools
import json
import math
from fractions import Fraction

from kvtool.errors import InvalidParameterError
from kvtool.structured.regex_mode import MATCH_TIMEOUT, compile_pattern, timeout_message

_DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,9})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)?"
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
FORMATS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "email": r"^[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(\.[A-Za-z0-9-]{1,63})+$",
    "ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$",
    "uri": r"^[A-Za-z][A-Za-z0-9+.-]*:[^\s]+$",
}
RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


# integers

def int_range(node: dict | None) -> tuple[int | None, int | None]:
    """The integers an integer value may take: (lowest, highest), None where unbounded."""
    node = node or {}
    lows = [math.ceil(node["minimum"])] if "minimum" in node else []
    lows += [math.floor(node["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in node else []
    highs = [math.floor(node["maximum"])] if "maximum" in node else []
    highs += [math.ceil(node["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in node else []
    return (max(lows) if lows else None), (min(highs) if highs else None)


def _in(value: int, lo: int | None, hi: int | None) -> bool:
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def int_prefix_ok(text: str, lo: int | None, hi: int | None) -> bool:
    """Whether some JSON integer whose text starts with `text` (a sign, digits) lies in [lo, hi]."""
    digits = text.lstrip("-")
    if text.startswith("-"):  # its magnitude m = -value lies in [-hi, -lo]
        lo, hi = (None if hi is None else -hi), (None if lo is None else -lo)
    if not digits:  # any magnitude >= 0
        return hi is None or hi >= 0
    if digits == "0":
        return _in(0, lo, hi)
    d, scale = int(digits), 1
    while hi is None or d * scale <= hi:  # the magnitudes d, d0..d9, d00..d99, ...
        if lo is None or (d + 1) * scale - 1 >= lo:
            return True
        scale *= 10
    return False


def int_ok(node: dict, text: str, ended: bool) -> bool:
    """An integer's text so far (ended: the number stops here) against its bounds and integer enum."""
    lo, hi = int_range(node)
    values = node.get("enum")
    if ended:
        return _in(int(text), lo, hi) and (values is None or int(text) in values)
    return int_prefix_ok(text, lo, hi) and (values is None or any(str(v).startswith(text) for v in values))


# numbers

Bound = tuple[Fraction, bool]  # (value, closed)


def _exact(x: int | float) -> Fraction:
    return Fraction(str(x)) if isinstance(x, float) else Fraction(x)  # 0.3 -> 3/10, its shortest decimal


def has_range(node: dict | None) -> bool:
    return any(name in (node or {}) for name in RANGE)


def number_bounds(node: dict) -> tuple[Bound | None, Bound | None]:
    """(lowest, highest) a number may take, each with whether it is allowed itself; None: unbounded."""
    lows = [(_exact(node["minimum"]), True)] if "minimum" in node else []
    lows += [(_exact(node["exclusiveMinimum"]), False)] if "exclusiveMinimum" in node else []
    highs = [(_exact(node["maximum"]), True)] if "maximum" in node else []
    highs += [(_exact(node["exclusiveMaximum"]), False)] if "exclusiveMaximum" in node else []
    lo = max(lows, key=lambda b: (b[0], not b[1])) if lows else None  # at a tie the open bound is tighter
    hi = min(highs, key=lambda b: (b[0], b[1])) if highs else None
    return lo, hi


def _meets(a: Fraction, b: Fraction | None, lo: Bound | None, hi: Bound | None) -> bool:
    """Whether the decimals in [a, b) (b None: no end) meet the interval between lo and hi."""
    low = (a, True) if lo is None or a > lo[0] else lo if a < lo[0] else (a, lo[1])
    if b is None:
        high = hi
    else:
        high = (b, False) if hi is None or b <= hi[0] else hi
    if high is None:
        return True
    return low[0] < high[0] or (low[0] == high[0] and low[1] and high[1])


def empty_range(node: dict) -> bool:
    lo, hi = number_bounds(node)
    return lo is not None and hi is not None and not _meets(lo[0], None, lo, hi)


def number_ok(node: dict, text: str, ended: bool) -> bool:
    """A bounded number's text so far (sign, digits, point, fraction digits; no exponent)."""
    lo, hi = number_bounds(node)
    if ended:
        value = Fraction(text)
        return (lo is None or value > lo[0] or (value == lo[0] and lo[1])) and (
            hi is None or value < hi[0] or (value == hi[0] and hi[1]))
    if text.startswith("-"):  # its magnitude lies between -hi and -lo
        lo, hi = (None if hi is None else (-hi[0], hi[1])), (None if lo is None else (-lo[0], lo[1]))
    whole, dot, frac = text.lstrip("-").partition(".")
    if not whole:
        return _meets(Fraction(0), None, lo, hi)
    if dot:
        a = Fraction(f"{whole}.{frac}" if frac else whole)
        return _meets(a, a + Fraction(1, 10 ** len(frac)), lo, hi)
    if whole == "0":
        return _meets(Fraction(0), Fraction(1), lo, hi)
    d, scale = int(whole), 1
    while hi is None or d * scale <= hi[0]:  # [d, d+1), [d0, d0+10), ...
        if _meets(Fraction(d * scale), Fraction((d + 1) * scale), lo, hi):
            return True
        scale *= 10
    return False


# strings

@functools.lru_cache(maxsize=256)
def _compile(pattern: str):
    return compile_pattern(pattern)


def patterns(node: dict | None) -> list:
    """The compiled patterns a string must match: its `pattern` and its `format`'s (empty: any string)."""
    if not node:
        return []
    out = [_compile(node["pattern"])] if isinstance(node.get("pattern"), str) else []
    if node.get("format") in FORMATS:
        out.append(_compile(FORMATS[node["format"]]))
    return out


def check_pattern(node: dict, where: str) -> None:
    if "pattern" not in node:
        return
    if not isinstance(node["pattern"], str):
        raise InvalidParameterError(f"json_schema: {where}.pattern must be a string")
    try:
        _compile(node["pattern"])
    except InvalidParameterError as exc:
        raise InvalidParameterError(f"json_schema: {where}.pattern {node['pattern']!r}: {exc}") from None


def string_ok(node: dict, raw: str, ended: bool) -> bool:
    """A string's raw JSON text so far (escapes complete) against its patterns."""
    value = json.loads(f'"{raw}"')
    try:
        return all(p.search(value, partial=not ended, timeout=MATCH_TIMEOUT) is not None for p in patterns(node))
    except TimeoutError:
        raise InvalidParameterError(timeout_message(f"json_schema: pattern {node.get('pattern')!r}")) from None
