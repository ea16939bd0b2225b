"""Per-token views of a prompt: piece, id, and what part of the chat each token belongs to.

Flags come from the tokenizer (special: `all_special_ids` plus added tokens marked special)
and from the rendered text (role markers, `<think>`, `<tool_call>`, `<tool_response>`
blocks, tags included), so they hold whether a tag is one added token (Qwen3) or
several ordinary ones (Qwen2.5 has no `<think>` token).
"""

from __future__ import annotations

import re

from kvtool.serving.served import ServedModel

REGIONS = {
    "role_marker": re.compile(r"<\|im_start\|>[^\n<]*\n?|<\|im_end\|>|<\|start_header_id\|>.*?<\|end_header_id\|>\n*"
                              r"|<\|eot_id\|>", re.S),
    "think": re.compile(r"<think>.*?(?:</think>|$)", re.S),
    "tool_call": re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.S),
    "tool_response": re.compile(r"<tool_response>.*?(?:</tool_response>|$)", re.S),
}


def token_spans(served: ServedModel, text: str, ids: list[int]) -> list[tuple[int, int]]:
    """Character span of each token in text (offsets from a fast tokenizer, else decoded pieces)."""
    try:
        enc = served.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(enc["input_ids"]) == list(ids):
            return [tuple(span) for span in enc["offset_mapping"]]
    except Exception:  # slow tokenizers have no offsets
        pass
    spans, pos = [], 0
    for piece in served.pieces(ids):
        spans.append((pos, pos + len(piece)))
        pos += len(piece)
    return spans


def token_table(served: ServedModel, text: str, ids: list[int]) -> list[dict]:
    """[{index, id, piece, special, role_marker, think, tool_call, tool_response}] for each token."""
    masks = {}
    for flag, pattern in REGIONS.items():
        mask = bytearray(len(text) + 1)
        for m in pattern.finditer(text):
            mask[m.start() : m.end()] = b"\x01" * (m.end() - m.start())
        masks[flag] = mask
    rows = []
    for i, (tid, piece, (start, end)) in enumerate(zip(ids, served.pieces(ids), token_spans(served, text, ids))):
        row = {"index": i, "id": tid, "piece": piece, "special": tid in served.special_ids}
        for flag, mask in masks.items():
            row[flag] = any(mask[start : max(end, start + 1)])
        rows.append(row)
    return rows
