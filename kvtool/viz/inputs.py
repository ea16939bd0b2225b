"""What to look at: a raw prompt, a messages file, or a conversation fetched from a server, turned
into Tokens — optionally after generating N tokens so reasoning/output rows exist.

Templates without tool support (SmolLM2's) get tool calls and results written the way the
Qwen/ChatML templates write them (`<tool_call>`/`<tool_response>` blocks, tools in the system
turn), so the same conversation renders on every ChatML model.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvtool.errors import InvalidParameterError
from kvtool.viz.tokens import Tokens, make_tokens

TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
                  "</tools>\n\nFor each function call, return a json object with function name and arguments within "
                  "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                  "<args-json-object>}}\n</tool_call>")


def parse_conversation(doc) -> tuple[list[dict], list[dict] | None]:
    """A list of messages, or {"messages": [...], "tools": [...]} (an OpenAI request body works)."""
    if isinstance(doc, dict):
        messages, tools = doc.get("messages"), doc.get("tools")
    else:
        messages, tools = doc, None
    if not isinstance(messages, list) or not messages:
        raise InvalidParameterError("a conversation needs a non-empty list of messages "
                                    '(a JSON list, or {"messages": [...], "tools": [...]})')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidParameterError(f"message {i} must be an object with a string 'role'")
    if tools is not None and not isinstance(tools, list):
        raise InvalidParameterError("'tools' must be a list of tool definitions")
    return messages, tools or None


def load_messages_file(path: str) -> tuple[list[dict], list[dict] | None]:
    p = Path(path)
    if not p.is_file():
        raise InvalidParameterError(f"messages file {path} does not exist")
    try:
        doc = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise InvalidParameterError(f"messages file {path} is not valid JSON: {exc}") from None
    return parse_conversation(doc)


def fetch_conversation(url: str) -> tuple[list[dict], list[dict] | None]:
    """GET a JSON conversation (messages [+ tools]) from a running server."""
    import httpx

    try:
        resp = httpx.get(url, timeout=30)
        resp.raise_for_status()
        return parse_conversation(resp.json())
    except (httpx.HTTPError, ValueError) as exc:
        raise InvalidParameterError(f"could not fetch a conversation from {url}: {exc}") from None


def supports_tools(model) -> bool:
    return "tool" in (model.chat_template or "")


def chatml_tools_fallback(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Tool calls / results / declarations as plain content, the way Qwen's template writes them."""
    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m.pop("tool_calls"):
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                args = json.loads(args) if isinstance(args, str) else args
                calls.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args})
                             + "\n</tool_call>")
            content = "\n".join(([content] if content else []) + calls)
        elif m["role"] == "tool":
            m["role"] = "user"
            content = f"<tool_response>\n{content}\n</tool_response>"
        m["content"] = content
        out.append(m)
    if tools:
        decl = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{decl}"
        else:
            out.insert(0, {"role": "system", "content": decl})
    return out


def native_message(m: dict) -> dict:
    """content None -> ""; JSON-string tool arguments (OpenAI shape) -> objects, which Qwen2.5's
    template would otherwise encode twice."""
    m = {**m, "content": m.get("content") or ""}
    if m.get("tool_calls"):
        calls = []
        for call in m["tool_calls"]:
            fn = dict(call.get("function", {}))
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    raise InvalidParameterError("tool call arguments are not valid JSON: "
                                                f"{fn['arguments'][:80]!r}") from None
            calls.append({**call, "function": fn})
        m["tool_calls"] = calls
    return m


def render_conversation(model, messages: list[dict], tools: list[dict] | None = None,
                        add_generation_prompt: bool = True) -> str:
    if not supports_tools(model):
        messages, tools = chatml_tools_fallback(messages, tools), None
    else:
        messages = [native_message(m) for m in messages]
    return model.render(messages, tools, add_generation_prompt=add_generation_prompt)


def prompt_ids(model, prompt: str | None = None, messages: list[dict] | None = None,
               tools: list[dict] | None = None, chat: bool = False) -> list[int]:
    if messages is None:
        if prompt is None or not prompt.strip():
            raise InvalidParameterError("the prompt is empty; give --prompt TEXT, --messages FILE or --from-url URL")
        if not chat:
            return model.encode(prompt)
        messages = [{"role": "user", "content": prompt}]
    return model.encode_rendered(render_conversation(model, messages, tools))


def build_tokens(model, ids: list[int], generate: int = 0, params=None) -> Tokens:
    """Tokens of `ids`, after generating `generate` more (greedy unless params say otherwise)."""
    from kvtool.config import SamplingParams
    from kvtool.viz.probs import check_ids

    ids = check_ids(model, ids)
    n_prompt = len(ids)
    if generate:
        from kvtool.engine import Engine

        params = params or SamplingParams(temperature=0.0)
        params.max_tokens = generate
        gen = Engine(model).generate(ids, params, skip_special_tokens=False).run()
        ids = ids + gen.token_ids
    return make_tokens(model, ids, n_prompt)
