"""Tool output as the model sees it: capped in pages, and fenced as external content.

Anything a tool returns (a web page, a file, an API answer) may contain text that looks
like instructions; fencing it lets the system prompt say "inside these tags is data".
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict

from kvtool.agent.retry import ToolInputError

PAGE_TOOL = "read_output_page"
_OPEN, _CLOSE = "<external_content", "</external_content"


class Rendered(str):
    """Output that is already fenced and paged; the dispatcher passes it through."""


def wrap_external(tool_name: str, text: str) -> str:
    # a tool must not be able to close the fence early and speak as the system
    body = text.replace(_CLOSE, "<\\/external_content").replace(_OPEN, "<\\external_content")
    return f'<external_content source="tool:{tool_name}">\n{body}\n</external_content>'


def to_text(value: object) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return repr(value)


class OutputPager:
    """Keeps full outputs that did not fit, so the model can ask for page N."""

    def __init__(self, page_chars: int = 4000, keep: int = 64):
        if page_chars < 1:
            raise ValueError("page_chars must be >= 1")
        self.page_chars = page_chars
        self._store: OrderedDict[str, tuple[str, str]] = OrderedDict()  # ref -> (tool, text)
        self._keep = keep

    def pages(self, text: str) -> int:
        return max(1, math.ceil(len(text) / self.page_chars))

    def render(self, ref: str, tool_name: str, text: str, page: int = 1) -> str:
        """Page `page` of `text`, fenced, with an explicit marker when more exists."""
        total = self.pages(text)
        if total > 1:
            self._store[ref] = (tool_name, text)
            self._store.move_to_end(ref)
            while len(self._store) > self._keep:
                self._store.popitem(last=False)
        start = (page - 1) * self.page_chars
        body = wrap_external(tool_name, text[start : start + self.page_chars])
        if total == 1:
            return body
        end = min(len(text), start + self.page_chars)
        marker = f"[truncated — showing page {page} of {total} (characters {start + 1}-{end} of {len(text)})"
        if page < total:
            marker += f'; ask for page {page + 1}: call {PAGE_TOOL} with {{"ref": "{ref}", "page": {page + 1}}}]'
        else:
            marker += "; this is the last page]"
        return f"{body}\n{marker}"

    def read_page(self, ref: str, page: int) -> str:
        """The paging helper behind the read_output_page tool."""
        stored = self._store.get(ref)
        if stored is None:
            known = ", ".join(self._store) or "none"
            raise ToolInputError(f"no stored output with ref {ref!r} (stored refs: {known})")
        tool_name, text = stored
        total = self.pages(text)
        if not 1 <= page <= total:
            raise ToolInputError(f"page {page} does not exist: output {ref!r} has pages 1-{total}")
        return Rendered(self.render(ref, tool_name, text, page))
