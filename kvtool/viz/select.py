"""Parse layer / head / query-row selections ("all", "3", "0,5,-1", "20:30", "last:8", "generated")."""

from __future__ import annotations

from kvtool.errors import InvalidParameterError

AGGREGATES = ("mean", "max")


def parse_indices(text: str | int | list, n: int, what: str) -> list[int]:
    """Indices into range(n); negative ones count from the end (HF/Python style)."""
    if isinstance(text, int):
        items: list = [text]
    elif isinstance(text, list):
        items = text
    else:
        text = str(text).strip()
        if text in ("all", ""):
            return list(range(n))
        items = [p.strip() for p in text.split(",") if p.strip()]
    out: list[int] = []
    for item in items:
        try:
            if isinstance(item, str) and ":" in item:
                a, b = item.split(":", 1)
                lo = int(a) if a else 0
                hi = int(b) if b else n
                lo, hi = lo + n if lo < 0 else lo, hi + n if hi < 0 else hi
                if not 0 <= lo < hi <= n:
                    raise InvalidParameterError(f"{what} range {item!r} is out of range: there are {n} {what}s "
                                                f"(0..{n - 1})")
                out.extend(range(lo, hi))
                continue
            i = int(item)
        except ValueError:
            raise InvalidParameterError(f"bad {what} selection {item!r}: use all, N, N,M or A:B") from None
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise InvalidParameterError(f"{what} {i} is out of range: there are {n} {what}s (0..{n - 1}, "
                                        "Hugging Face numbering)")
        out.append(j)
    return sorted(set(out))


def parse_heads(text: str, n: int) -> tuple[list[int], str | None]:
    """("mean" | "max" | indices) -> (heads to compute, aggregate or None)."""
    if str(text) in AGGREGATES:
        return list(range(n)), str(text)
    return parse_indices(text, n, "head"), None


def parse_rows(text: str, tokens) -> list[int]:
    """Query rows: all | last:N | A:B | N,M | generated | reasoning | prompt-end (last prompt token)."""
    n, text = len(tokens.ids), str(text).strip()
    if text.startswith("last:"):
        try:
            k = int(text[5:])
        except ValueError:
            raise InvalidParameterError(f"bad rows {text!r}: last:N needs an integer N") from None
        if not 1 <= k <= n:
            raise InvalidParameterError(f"rows {text!r}: N must be in 1..{n} (the input has {n} tokens)")
        return list(range(n - k, n))
    if text == "prompt-end":
        return [tokens.n_prompt - 1]
    if text in ("generated", "reasoning"):
        rows = list(range(tokens.n_prompt, n))
        if text == "reasoning":
            rows = [i for i in rows if tokens.channels[i] == "reasoning"]
        if not rows:
            raise InvalidParameterError(f"rows {text!r} selects nothing: there are no {text} tokens "
                                        "(use --generate N, and a reasoning model for 'reasoning')")
        return rows
    return parse_indices(text, n, "row")
