"""POST /v1/responses bodies, and the chat completion request each one is.

A Responses request is a chat request in other clothes: `instructions` is the system turn, `input` is a
string (one user message) or a list of items (messages, `function_call`, `function_call_output`,
`reasoning`), a function tool is flat (`{"type": "function", "name", "parameters"}`) and `text.format` is
response_format. `chat_body` rewrites the body into chat completion JSON, so rendering, tool-call parsing,
structured output and sampling are the chat route's own; the stored conversation of `previous_response_id`
goes between the instructions and the new items.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ValidationError

from kvtool.serving.errors import ServingError
from kvtool.serving.protocol import ChatCompletionRequest, Strict, documented

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")
# fields that are not the Responses API's but that the chat route takes as they are (vLLM's and kvtool's)
PASSED_ON = ("top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "chat_template_kwargs", "logit_bias")


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int | None, documented(minimum=1)] = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict[str, Any] | None = None  # echoed; the model's template decides whether it reasons
    store: bool = True  # kept for previous_response_id and GET /v1/responses/{id}
    stream: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    raw_tokens: bool = False  # kvtool: every generated token as {id, piece, channel, t_ms}


def bad(message: str, param: str) -> ServingError:
    return ServingError(message, param=param)


def text_of(content, where: str) -> str:
    """The text of a message's content: a string, or text parts joined by newlines (as the chat route joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of text parts, got {type(content).__name__}", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if isinstance(part, dict) else None
        if kind not in (*TEXT_PARTS, "refusal") or not isinstance(text, str):
            raise bad(f"{where}[{j}] has type {kind!r}; kvtool serves text-only models: send "
                      "{'type': 'input_text', 'text': ...} parts", f"{where}[{j}]")
        texts.append(text)
    return "\n".join(texts)


def required(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad(f"{where}.{name} is missing or not a string; a {item.get('type')} item needs it", f"{where}.{name}")
    return value


def input_messages(items: str | list[dict], where: str = "input") -> list[dict]:
    """Chat messages of Responses input items. Consecutive assistant items (text, function calls) are one
    assistant message, as the chat route returns one turn; a reasoning item becomes the next assistant
    message's reasoning_content, so the turn renders as the model wrote it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    reasoning, joins = None, False  # joins: the last message is an assistant turn the next call belongs to
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(f"{at}.role {role!r} is unknown; use one of {', '.join(ROLES)}", f"{at}.role")
            if "content" not in item:
                raise bad(f"{at} ({role}) has no content", f"{at}.content")
            text = text_of(item["content"], f"{at}.content")
            if role == "assistant" and joins:  # text after a call of the same turn: one assistant message
                out[-1]["content"] = (out[-1]["content"] or "") + text
            else:
                out.append({"role": role, "content": text})
            joins = role == "assistant"
        elif kind == "function_call":
            call = {"id": required(item, "call_id", at), "type": "function",
                    "function": {"name": required(item, "name", at), "arguments": required(item, "arguments", at)}}
            if not joins:
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
            joins = True
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": required(item, "call_id", at),
                        "content": text_of(output if output is not None else "", f"{at}.output")})
            joins = False
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = text_of(parts, f"{at}.content")
            continue
        else:
            raise bad(f"{at}.type {kind!r} is not supported; send message, function_call, function_call_output or "
                      "reasoning items", f"{at}.type")
        if reasoning is not None and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"], reasoning = reasoning, None
    return out


def chat_tools(tools: list[dict]) -> list[dict]:
    """Flat Responses function tools as chat tools; any other tool type is a 400 (no hosted tools here)."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad(f"tools[{i}].type {tool.get('type')!r} is not supported; kvtool serves function tools only "
                      "({'type': 'function', 'name', 'parameters'})", f"tools[{i}].type")
        required(tool, "name", f"tools[{i}]")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                            "strict") if tool.get(k) is not None}})
    return out


def chat_tool_choice(choice: str | dict) -> str | dict:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad(f"tool_choice {choice!r} is not supported; use 'auto', 'none', 'required' or "
              "{'type': 'function', 'name': ...}", "tool_choice")


def response_format(text: dict) -> dict | None:
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad("text.format json_schema needs schema, a JSON schema object", "text.format.schema")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise bad(f"text.format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'",
              "text.format.type")


def chat_body(req: ResponsesRequest, raw: dict, history: list[dict]) -> tuple[ChatCompletionRequest, dict]:
    """(the chat request, its JSON) for this Responses request after `history` (a stored conversation)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    messages += history + input_messages(req.input)
    if not messages:
        raise bad("input is empty; send a string or at least one input item", "input")
    body: dict = {"messages": messages, "parallel_tool_calls": req.parallel_tool_calls,
                  "raw_tokens": req.raw_tokens}
    for name, value in (("model", req.model), ("max_completion_tokens", req.max_output_tokens),
                        ("temperature", req.temperature), ("top_p", req.top_p), ("user", req.user)):
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = chat_tools(req.tools)
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    if req.text and (fmt := response_format(req.text)) is not None:
        body["response_format"] = fmt
    body.update({k: raw[k] for k in PASSED_ON if k in raw})
    try:
        return ChatCompletionRequest.model_validate(body), body
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad(f"invalid request: {where}: {first['msg']}", where) from None
