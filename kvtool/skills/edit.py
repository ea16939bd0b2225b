"""Edit a field of a cached context without a full recompute.

A context's KV was computed with a field ("city: Beijing"); the field gets a new value. The ways to an
edited context (`apply_edit`):
- full: prefill the edited token ids from scratch (the reference);
- field_only: recompute the field's tokens in place. They attend only to the unchanged tokens before them,
  so their own KV becomes exact; every later token keeps the KV it got against the old value;
- erratum: keep the whole cache and append a correction turn ("Correction: the user's city is Shanghai, not
  Beijing."); the cache stays a prefix of the new context, which ordinary prefix caching serves;
- a repair (kvtool.skills.repair strategy): field_only plus a selective recompute of the later tokens.
  recompute_deviation ranks them by how far their KV moves at an early layer once the field changed
  (every later token runs through layers 0..layer for that), recompute_attended by the attention the
  question after the context pays them (it needs that question). Their knob `ratio` is the share of the
  context's tokens recomputed through every layer, the field's included (budgets 1 %, 5 %, 10 %).
The in-place ways (field_only and the repairs) need the new value to tokenize to as many tokens as the
old one, with every other token unchanged. `apply_edit` never changes the cache it is given.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from kvtool.config import EngineConfig
from kvtool.errors import InvalidParameterError
from kvtool.skills.repair import make_repair
from kvtool.skills.selective import recompute_most_attended, recompute_selected, recompute_slots

WAYS = ("full", "field_only", "erratum")  # plus a repair spec: recompute_deviation:ratio=R, recompute_attended:...
REPAIR_WAYS = ("recompute_deviation", "recompute_attended")
CHUNK = EngineConfig.prefill_chunk


class EditInputError(InvalidParameterError):
    """An edit that cannot be made as asked; `param` names the input at fault (the HTTP route's 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class FieldEdit:
    """A resolved edit: the field is tokens [start, end) of old_ids and [start, new_end) of new_ids."""
    old_ids: list[int]
    new_ids: list[int]
    start: int
    end: int
    new_end: int
    old_value: str
    new_value: str

    @property
    def field_tokens(self) -> int:
        return self.end - self.start

    @property
    def in_place(self) -> bool:
        """Same token count, and every token outside the field unchanged: the KV slots line up."""
        return (self.new_end == self.end and len(self.new_ids) == len(self.old_ids)
                and self.new_ids[: self.start] == self.old_ids[: self.start]
                and self.new_ids[self.end :] == self.old_ids[self.end :])

    def require_in_place(self, way: str) -> None:
        if not self.in_place:
            new = self.new_end - self.start
            raise EditInputError(
                f"{way} edits the KV in place, so the new value must tokenize to as many tokens as the field "
                f"with every other token unchanged: {self.old_value!r} is {self.field_tokens} token(s), "
                f"{self.new_value!r} gives {new} (the context goes from {len(self.old_ids)} to {len(self.new_ids)} "
                "tokens, or tokens next to the field merge differently); use the erratum way, which appends a "
                "correction instead, or full", param="new_value")


def _check_text(value, what: str) -> str:
    if not isinstance(value, str):
        raise EditInputError(f"{what} must be text (a str), got {type(value).__name__}", param=what)
    return value


def plan_edit(model, context, span: tuple[int, int], new_value, unit: str = "chars") -> FieldEdit:
    """Resolve an edit of `context` (rendered text, or token ids for unit="tokens"): span [start, end) in
    characters of the text or in tokens; new_value is text (for a token span, with its own leading space)
    or token ids (token spans only). For a character span the edited text is tokenized whole, so a value
    that merges with its neighbours shows up as a changed token count."""
    if unit not in ("chars", "tokens"):
        raise EditInputError(f"span unit must be 'chars' or 'tokens', got {unit!r}", param="unit")
    try:
        lo, hi = (int(span[0]), int(span[1])) if len(span) == 2 and not any(isinstance(v, bool) for v in span) \
            else (None, None)
    except (TypeError, ValueError):
        lo = hi = None
    if lo is None or lo != span[0] or hi != span[1]:
        raise EditInputError(f"span must be two integers [start, end), got {span!r}", param="span")
    if isinstance(context, str):
        text = context
        old_ids = model.encode_rendered(text)
    elif unit == "tokens" and isinstance(context, (list, tuple)):
        text, old_ids = None, [int(t) for t in context]
    else:
        raise EditInputError("context must be the rendered text, or token ids with unit='tokens'", param="context")
    size = len(text) if unit == "chars" else len(old_ids)
    if not 0 <= lo < hi <= size:
        raise EditInputError(f"the span [{lo}, {hi}) is outside the context, which has {size} {unit}; give "
                             f"0 <= start < end <= {size}", param="span")
    if unit == "tokens":
        if isinstance(new_value, (list, tuple)):
            field = [int(t) for t in new_value]
            new_text = model.decode(field)
        else:
            new_text = _check_text(new_value, "new_value")
            field = model.encode_rendered(new_text)
        if not field:
            raise EditInputError("new_value is empty; an edit needs a value to put in the field", param="new_value")
        return FieldEdit(old_ids, old_ids[:lo] + field + old_ids[hi:], lo, hi, lo + len(field),
                         model.decode(old_ids[lo:hi]), new_text)
    new_text = _check_text(new_value, "new_value")
    offsets = model.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if len(offsets) != len(old_ids):
        raise EditInputError("this tokenizer gives no character offsets for the context; give the span in tokens",
                             param="unit")
    covered = [i for i, (a, b) in enumerate(offsets) if a < hi and b > lo]
    if not covered:
        raise EditInputError(f"no token covers the characters [{lo}, {hi}) of the context; give the span in "
                             "tokens", param="span")
    start, end = covered[0], covered[-1] + 1
    new_ids = model.encode_rendered(text[:lo] + new_text + text[hi:])
    tail = len(old_ids) - end  # the tokens after the field, if they survive the edit unchanged
    same_tail = tail <= len(new_ids) - start and new_ids[len(new_ids) - tail :] == old_ids[end:]
    new_end = len(new_ids) - tail if same_tail else len(new_ids)
    return FieldEdit(old_ids, new_ids, start, end, new_end, text[lo:hi], new_text)


def find_field(text: str, value: str) -> tuple[int, int]:
    """The character span of the one occurrence of `value` in `text`."""
    _check_text(value, "field")
    at = text.find(value) if value else -1
    if at < 0:
        raise EditInputError(f"the field {value!r} does not occur in the context", param="field")
    if text.find(value, at + 1) >= 0:
        raise EditInputError(f"the field {value!r} occurs more than once in the context; give its span "
                             "instead", param="field")
    return at, at + len(value)


def erratum_text(old_value: str, new_value: str, label: str | None = None) -> str:
    """The correction appended by the erratum way."""
    old, new = old_value.strip(), new_value.strip()
    if label:
        return f"Correction: {label} is {new}, not {old}."
    return f"Correction: where the conversation above says {old}, it should say {new}."


def user_turn_ids(model, text: str) -> list[int]:
    """Token ids of one user turn as the chat template renders it after earlier turns (no generation prompt)."""
    # After a whole exchange: a template that folds the system message into the first user turn (Gemma)
    # renders a later user turn on its own.
    earlier = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    head = model.render(earlier, add_generation_prompt=False)
    both = model.render(earlier + [{"role": "user", "content": _check_text(text, "erratum")}],
                        add_generation_prompt=False)
    if not both.startswith(head):
        raise EditInputError("this model's chat template re-renders earlier turns when a user turn is added; "
                             "the erratum cannot be appended to the cached context", param="way")
    return model.encode_rendered(both[len(head):])


def check_context(runner, ids: list[int], cache) -> None:
    """The cache must hold this model's KV of exactly these tokens (else the edit would mix models)."""
    s = runner.spec
    layers = cache.layers
    shape = (len(layers), layers[0].num_kv_heads, layers[0].head_dim) if layers else (0, 0, 0)
    if shape != (s.num_layers, s.num_kv_heads, s.head_dim):
        raise EditInputError(f"the cache holds KV of another model: {shape[0]} layers x {shape[1]} KV heads x "
                             f"head_dim {shape[2]}, this model has {s.num_layers} x {s.num_kv_heads} x {s.head_dim}",
                             param="cache")
    if layers and layers[0].dtype != runner.dtype:
        raise EditInputError(f"the cache holds {layers[0].dtype} KV, this model computes {runner.dtype}; "
                             "load the model with the dtype the cache was made with", param="cache")
    if cache.offset != len(ids):
        raise EditInputError(f"the cache holds {cache.offset} tokens but the context has {len(ids)}; the cache "
                             "must hold exactly the context's KV", param="cache")
    bad = [t for t in ids if not 0 <= t < s.vocab_size]
    if bad:
        raise EditInputError(f"the context has token ids outside this model's vocabulary [0, {s.vocab_size}): "
                             f"{bad[:5]}; it was tokenized for another model", param="context")


def parse_way(way: str):
    """(kind, repair or None): kind is full, field_only, erratum or the repair strategy's name."""
    if not isinstance(way, str):
        raise EditInputError(f"way must be a string, got {type(way).__name__}", param="way")
    if way in WAYS:
        return way, None
    name = way.partition(":")[0]
    if name not in REPAIR_WAYS:
        raise EditInputError(f"unknown edit way {way!r}; use one of {', '.join(WAYS)} or a repair "
                             f"{' / '.join(f'{r}:ratio=R' for r in REPAIR_WAYS)}", param="way")
    try:
        return name, make_repair(way)
    except InvalidParameterError as exc:
        raise EditInputError(str(exc), param="way") from None


@dataclass
class EditResult:
    way: str
    cache: object  # KVCache of token_ids, then the question if one was given
    token_ids: list[int]  # the edited context the cache holds (before the question)
    recomputed: int  # context tokens run through every layer (full: all of them)
    appended: int = 0  # new context tokens computed (the erratum)
    partial: int = 0  # tokens run through only the first layers (recompute_deviation's scoring)
    partial_layers: int = 0
    logits: torch.Tensor | None = None  # [1, V] after the question, if one was given
    ms: float = 0.0  # wall time of the edit and the question's prefill


@torch.inference_mode()
def apply_edit(runner, cache, edit: FieldEdit, way: str, erratum_ids: list[int] | None = None,
               question: list[int] | None = None, chunk: int = CHUNK) -> EditResult:
    """The context `edit` describes, made `way` from `cache` (the KV of edit.old_ids, left as it is).
    With a question (token ids after the context), it is prefilled too and its last logits returned."""
    kind, repair = parse_way(way)
    check_context(runner, edit.old_ids, cache)
    if kind != "full" and kind != "erratum":
        edit.require_in_place(way)
    if kind == "erratum" and not erratum_ids:
        raise EditInputError("the erratum way needs the correction's token ids (user_turn_ids(model, "
                             "erratum_text(old, new)))", param="erratum")
    if kind == "recompute_attended" and not question:
        raise EditInputError("recompute_attended ranks tokens by the attention of the question after the context; "
                             "give the question, or use recompute_deviation", param="way")
    question = list(question or [])
    t0 = time.perf_counter()
    result = _EDITS[kind](runner, cache, edit, repair, erratum_ids or [], question, chunk)
    result.way = way
    if question and result.logits is None:
        result.logits = runner.prefill(question, result.cache, chunk=chunk)
    if result.logits is not None:
        int(result.logits.argmax(-1))  # wait for the device
    result.ms = (time.perf_counter() - t0) * 1000.0
    return result


def _copy(runner, cache, extra: int):
    out = cache.fork()  # a paged cache's copy reads its full blocks in place; a block an edit writes is copied
    out.reserve(out.offset + extra + 1)
    return out


def _full(runner, cache, edit, repair, erratum, question, chunk):
    out = runner.new_cache(len(edit.new_ids) + len(question) + 1)
    logits = runner.prefill(edit.new_ids + question, out, chunk=chunk, logits="last" if question else "none")
    return EditResult("full", out, edit.new_ids, len(edit.new_ids), logits=logits)


def _field_only(runner, cache, edit, repair, erratum, question, chunk):
    out = _copy(runner, cache, len(question))
    recompute_slots(runner, out, list(range(edit.start, edit.end)), edit.new_ids[edit.start : edit.end], chunk=chunk)
    return EditResult("field_only", out, edit.new_ids, edit.field_tokens)


def _erratum(runner, cache, edit, repair, erratum, question, chunk):
    out = _copy(runner, cache, len(erratum) + len(question))
    logits = runner.prefill(erratum + question, out, chunk=chunk, logits="last" if question else "none")
    return EditResult("erratum", out, edit.old_ids + erratum, 0, appended=len(erratum), logits=logits)


def budget_tokens(ratio: float, context: int, field: int) -> int:
    """Tokens a repair at `ratio` recomputes through every layer: ratio of the context, at least the field."""
    return min(context, max(field, math.ceil(ratio * context - 1e-9)))


def _deviation(runner, cache, edit, repair, erratum, question, chunk):
    if repair.layer >= runner.spec.num_layers:
        raise EditInputError(f"{repair.name}: layer {repair.layer} does not exist; the model has "
                             f"{runner.spec.num_layers} layers", param="way")
    out = _copy(runner, cache, len(question))
    n = len(edit.new_ids) - edit.start  # the field and everything after it
    keep = budget_tokens(repair.ratio, len(edit.new_ids), edit.field_tokens)
    ratio = min(1.0, (keep - 0.5) / n)  # recompute_selected keeps ceil(ratio * n) = keep tokens
    kind = repair.name
    sel = recompute_selected(runner, out, edit.new_ids[edit.start :], edit.start, ratio, repair.layer, repair.score,
                             first=edit.field_tokens)
    return EditResult(kind, out, edit.new_ids, len(sel.selected), partial=n,
                      partial_layers=min(repair.layer + 1, runner.spec.num_layers))


def _attended(runner, cache, edit, repair, erratum, question, chunk):
    base = _field_only(runner, cache, edit, None, erratum, question, chunk)
    out, ctx = base.cache, len(edit.new_ids)
    keep = budget_tokens(repair.ratio, ctx, edit.field_tokens) - edit.field_tokens
    token_at = {s: edit.new_ids[s] for s in range(edit.end, ctx)}
    kind = repair.name
    chosen, logits = recompute_most_attended(runner, out, list(range(edit.end, ctx)), token_at, question, keep,
                                             repair.window, chunk, "last", values=repair.score == "attention_v")
    return EditResult(kind, out, edit.new_ids, edit.field_tokens + len(chosen), logits=logits)


_EDITS = {"full": _full, "field_only": _field_only, "erratum": _erratum, "recompute_deviation": _deviation,
          "recompute_attended": _attended}
