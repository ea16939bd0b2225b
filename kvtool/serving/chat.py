"""Chat requests -> the exact prompt: message and tool checks, tool-call ids, rendering.

Messages and tools are rendered from the client's own JSON (key order and extra fields
kept), so the prompt is byte-identical to `tokenizer.apply_chat_template` on the same
conversation and a reordered tool definition shows up as the cache miss it is. The only
rewrite: assistant tool-call `arguments` (a JSON string in the OpenAI API) are parsed to
objects, as chat templates expect, and `developer` becomes `system`.

tool_choice: `none` renders the conversation without the tool definitions and parses no
calls: small models (Qwen2.5-Coder-0.5B) keep emitting calls while tools are in the prompt,
so this is what makes "answer in text now" work. The price: with tools in the system turn
(Qwen), that turn changes, so the prefix cache misses from there on; send `auto` and take
text answers as they come if the cache matters more. `required` and a named
function prefill the assistant turn with `<tool_call>\\n` and the call is written in JSON
schema mode: `{"name": one of the allowed tools, "arguments": that tool's parameters}`
(any object when several tools are allowed), then `\\n</tool_call>`, so it is a valid call.
A keyword of the tool's parameters the grammar compiler cannot enforce (`not`, `uniqueItems`, ...)
is left out and reported as for response_format, unless the tool says `"strict": true`: then it is a
400 naming the keyword. Where the parameters do not compile at all (a `$ref` to nothing), the prefill
goes on to `{"name": "` (or up to `"arguments": ` for a named one) and the model completes it; if
that is not a valid call, the text comes back as content with finish_reason "stop".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from jsonschema import Draft202012Validator, SchemaError

from kvtool.errors import InvalidParameterError
from kvtool.serving.errors import ServingError
from kvtool.serving.protocol import ChatMessage, NamedToolChoice, ToolDef
from kvtool.serving.served import ServedModel, check_text
from kvtool.serving.toolparse import THINK_CLOSE, THINK_OPEN, ToolFormat
from kvtool.structured.grammar import check, json_grammar, rebase

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
RESERVED_KWARGS = {"conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding",
                   "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                   "add_generation_prompt", "continue_final_message", "tokenizer_kwargs"}


def bad(message: str, param: str | None = None) -> ServingError:
    return ServingError(message, param=param)


@dataclass
class PreparedChat:
    prompt: str  # rendered conversation + prefill
    prompt_ids: list[int]
    tools: list[str] = field(default_factory=list)  # names a call may use (empty: parse no calls)
    prefill: str = ""  # assistant-turn text the server appended to force a call
    in_reasoning: bool = False  # the prompt ends inside an open <think> block
    call_schema: dict | None = None  # a forced call's JSON schema ({"name", "arguments"}), for JSON schema mode
    call_suffix: str = ""  # what follows that call's JSON before the turn ends
    call_strict: bool = False  # the forced call's tool says strict: its schema is enforced whole or refused


def check_tools(validated: list[ToolDef] | None, raw: list | None) -> list[dict] | None:
    """Declared tools as the client sent them; 400 on a bad name, type or JSON schema."""
    if not validated:
        return None
    names: set[str] = set()
    for i, tool in enumerate(validated):
        where = f"tools[{i}]"
        if tool.type != "function":
            raise bad(f"{where}.type is {tool.type!r}; only 'function' tools are supported", f"{where}.type")
        name = tool.function.name
        if not TOOL_NAME.match(name):
            raise bad(f"{where}.function.name {name!r} is invalid: use 1-64 letters, digits, '_', '-' or '.'",
                      f"{where}.function.name")
        if name in names:
            raise bad(f"{where}: tool {name!r} is declared twice; tool names must be unique", f"{where}.function.name")
        names.add(name)
        params = tool.function.parameters
        if params is not None:
            try:
                Draft202012Validator.check_schema(params)
            except SchemaError as exc:
                raise bad(f"{where}.function.parameters is not a valid JSON Schema: {exc.message}",
                          f"{where}.function.parameters") from None
            if params.get("type", "object") != "object":
                raise bad(f"{where}.function.parameters must describe an object (type 'object'), got "
                          f"{params.get('type')!r}", f"{where}.function.parameters")
    return [dict(t) for t in raw]


def _text_content(content, where: str) -> str:
    if isinstance(content, str):
        check_text(content, where)
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad(f"{where}[{j}] has type {part.type!r}; kvtool serves text-only models: send "
                      "{'type': 'text', 'text': ...} parts", f"{where}[{j}]")
        check_text(part.text, f"{where}[{j}]")
        parts.append(part.text)
    return "\n".join(parts)


def _tool_calls(i: int, msg: ChatMessage, raw: dict, open_calls: dict[str, str]) -> list[dict]:
    calls = []
    for j, (call, raw_call) in enumerate(zip(msg.tool_calls, raw["tool_calls"])):
        where = f"messages[{i}].tool_calls[{j}]"
        if call.type != "function":
            raise bad(f"{where}.type is {call.type!r}; only 'function' calls exist", f"{where}.type")
        if not call.id:
            raise bad(f"{where}.id is missing; every tool call needs the id its tool message answers", f"{where}.id")
        if call.id in open_calls:
            raise bad(f"{where}.id {call.id!r} is used twice; tool call ids must be unique", f"{where}.id")
        args = call.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise bad(f"{where}.function.arguments is not valid JSON ({exc}); send a JSON object as a string",
                          f"{where}.function.arguments") from None
        if not isinstance(args, dict):
            raise bad(f"{where}.function.arguments must be a JSON object, got {type(args).__name__}",
                      f"{where}.function.arguments")
        open_calls[call.id] = call.function.name
        calls.append({**raw_call, "function": {**raw_call["function"], "arguments": args}})
    return calls


def normalize_messages(validated: list[ChatMessage], raw: list[dict], answers_required: bool) -> list[dict]:
    """Template-ready messages; 400 on an unknown role, missing content or an unmatched tool_call_id."""
    if not validated:
        raise bad("messages is empty; send at least one message", "messages")
    out, open_calls, asked_at = [], {}, None
    for i, (msg, r) in enumerate(zip(validated, raw)):
        where = f"messages[{i}]"
        if msg.role not in ROLES:
            raise bad(f"{where}.role {msg.role!r} is unknown; use one of {', '.join(ROLES)}", f"{where}.role")
        role = "system" if msg.role == "developer" else msg.role
        m = {**r, "role": role}
        if msg.tool_calls and role != "assistant":
            raise bad(f"{where}: only assistant messages carry tool_calls (this one is {role})", f"{where}.tool_calls")
        if role != "tool" and open_calls:
            raise bad(f"{where}: the tool calls of messages[{asked_at}] ({', '.join(open_calls)}) have no tool "
                      "result yet; add one tool message per tool_call_id first", f"{where}")
        if msg.content is None and not (role == "assistant" and (msg.tool_calls or i == len(validated) - 1)):
            raise bad(f"{where} ({role}) has no content", f"{where}.content")
        m["content"] = "" if msg.content is None else _text_content(msg.content, f"{where}.content")
        if msg.tool_calls:
            m["tool_calls"] = _tool_calls(i, msg, r, open_calls)
            asked_at = i
        if role == "tool":
            if not msg.tool_call_id:
                raise bad(f"{where} (tool) has no tool_call_id; it must answer a call an assistant message made",
                          f"{where}.tool_call_id")
            if msg.tool_call_id not in open_calls:
                raise bad(f"{where}.tool_call_id {msg.tool_call_id!r} matches no unanswered tool call of an earlier "
                          f"assistant message (open: {sorted(open_calls) or 'none'})", f"{where}.tool_call_id")
            del open_calls[msg.tool_call_id]
        out.append(m)
    if answers_required and open_calls and out[-1]["role"] == "assistant":
        raise bad(f"the last message's tool calls ({', '.join(open_calls)}) have no tool result; add one tool "
                  "message per tool_call_id", f"messages[{len(out) - 1}]")
    return out


def template_kwargs(kwargs: dict | None) -> dict:
    kwargs = dict(kwargs or {})
    clash = RESERVED_KWARGS & kwargs.keys()
    if clash:
        raise bad(f"chat_template_kwargs may not set {sorted(clash)}; use the request fields instead",
                  "chat_template_kwargs")
    return kwargs


def render(served: ServedModel, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
           continue_final_message: bool, kwargs: dict) -> str:
    model = served.model
    if not model.chat_template:
        raise bad(f"model {served.name} has no chat template; use /v1/completions with a raw prompt")
    if continue_final_message:
        if add_generation_prompt:
            raise bad("continue_final_message=true needs add_generation_prompt=false", "continue_final_message")
        if messages[-1]["role"] != "assistant":
            raise bad("continue_final_message=true needs an assistant message last (the prefix to continue)",
                      "continue_final_message")
        kwargs = {**kwargs, "continue_final_message": True}
    try:
        return model.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
    except InvalidParameterError as exc:  # the template only sees client data: its complaints are the client's
        raise bad(str(exc), "messages") from None


def forced_tool(choice, tools: list[dict] | None) -> tuple[str, str | None]:
    """(mode, name): mode is auto | none | required | named."""
    if choice is None or choice == "auto":
        return "auto", None
    if isinstance(choice, NamedToolChoice):
        names = [t["function"]["name"] for t in tools or []]
        if choice.function.name not in names:
            raise bad(f"tool_choice names {choice.function.name!r}, which is not among the declared tools "
                      f"{names}", "tool_choice")
        return "named", choice.function.name
    if choice == "required" and not tools:
        raise bad("tool_choice 'required' needs at least one tool in tools", "tool_choice")
    return choice, None


TURN_STARTS = ("<|im_start|>", "<|start_header_id|>", "<|assistant|>")


def ends_in_reasoning(prompt: str) -> bool:
    """Whether the turn being generated is already inside `<think>` (a template or prefix opened it).

    Only the last turn counts: a user who merely mentions `<think>` does not open a block."""
    tail = prompt[max(0, *(prompt.rfind(m) for m in TURN_STARTS)):]
    i = tail.rfind(THINK_OPEN)
    return i >= 0 and tail.find(THINK_CLOSE, i) < 0


def skill_messages(served: ServedModel, names: list[str], continue_final_message: bool) -> list[dict]:
    """The `skills` extension: for each skill, the Skill tool call and its result, appended in order.

    Their rendering is the skill's block verbatim, so the engine splices the block instead of
    prefilling it."""
    catalog = served.skills
    if catalog is None or not len(catalog):
        raise bad(f"this server (--engine {served.engine}) has no skills; start it with kvtool serve --skills DIR to "
                  "use the skills field", "skills")
    if continue_final_message:
        raise bad("skills are loaded as new turns after the conversation; they cannot be combined with "
                  "continue_final_message=true", "skills")
    if len(set(names)) != len(names):
        raise bad(f"skills lists a skill twice: {names}", "skills")
    out = []
    for i, name in enumerate(names):
        if name not in catalog:
            raise bad(f"skills[{i}] {name!r} is not a skill of this server; known: {', '.join(catalog.names())} "
                      "(GET /v1/skills)", f"skills[{i}]")
        out += catalog.messages(name)
    return out


def call_schema(tools: list[dict], name: str | None) -> dict | None:
    """The JSON schema of one call {"name", "arguments"}: of the named tool, or of any declared tool (whose
    arguments follow its parameters when there is only one, else any object). None when the parameters use
    what the grammar compiler cannot compile: the prefill alone then starts the call. A strict tool's parameters
    compile whole or are a 400 naming what could not be enforced; otherwise leniently (see call_strict)."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    args = (chosen[0].get("parameters") or {"type": "object"}) if len(chosen) == 1 else {"type": "object"}
    args = rebase(args, "#/properties/arguments")  # its own '#/$defs/...' references, now inside the call
    schema = {"type": "object", "properties": {"name": {"enum": [f["name"] for f in chosen]}, "arguments": args},
              "required": ["name", "arguments"], "additionalProperties": False}
    try:
        check(json_grammar(schema, strict=call_strict(tools, name)), "the call")
    except InvalidParameterError as exc:
        if call_strict(tools, name):
            raise bad(f"tool {chosen[0]['name']!r} is strict and {exc}", "tools") from None
        return None
    return schema


def call_strict(tools: list[dict], name: str | None) -> bool:
    """Whether a forced call's arguments follow one tool that says `"strict": true` (OpenAI's function.strict)."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    return len(chosen) == 1 and chosen[0].get("strict") is True


def prepare_chat(served: ServedModel, req, raw: dict, fmt: ToolFormat, answers_required: bool = True) -> PreparedChat:
    """Validate and render a chat request (completions, template and tokenize share it)."""
    tools = check_tools(req.tools, raw.get("tools"))
    messages = normalize_messages(req.messages, raw["messages"], answers_required)
    if getattr(req, "skills", None):
        messages += skill_messages(served, req.skills, getattr(req, "continue_final_message", False))
    mode, name = forced_tool(getattr(req, "tool_choice", None), tools)
    if tools and mode != "none" and not served.supports_tools:
        raise bad(f"model {served.name}'s chat template does not render tools, so it cannot call them; serve a "
                  "tool-calling model (Qwen2.5/Qwen3) or describe the tools in the system message", "tools")
    prompt = render(served, messages, tools if mode != "none" else None, req.add_generation_prompt,
                    req.continue_final_message, template_kwargs(req.chat_template_kwargs))
    prefill, schema = "", None
    if mode in ("required", "named"):
        if not req.add_generation_prompt or req.continue_final_message:
            raise bad(f"tool_choice {mode!r} prefills a new assistant turn; it needs add_generation_prompt=true "
                      "and continue_final_message=false", "tool_choice")
        if not fmt.open:
            raise bad(f"tool_choice {mode!r} writes a tool call, which this server does not parse (kvtool serve "
                      "--tool-parser none); serve with a tool parser (--tool-parser qwen) or send 'auto'",
                      "tool_choice")
        schema = call_schema(tools, name)  # the call is then written in JSON schema mode
        prefill = f"{fmt.open}\n" if schema is not None else fmt.prefill(name)
    call_names = [t["function"]["name"] for t in tools or []] if mode != "none" else []
    if name:
        call_names = [name]
    text = prompt + prefill
    ids = served.encode(text, bool(getattr(req, "add_special_tokens", False)))  # the template writes them
    return PreparedChat(prompt=text, prompt_ids=ids, tools=call_names, prefill=prefill,
                        in_reasoning=ends_in_reasoning(text), call_schema=schema,
                        call_strict=schema is not None and call_strict(tools, name),
                        call_suffix=f"\n{fmt.close}" if schema is not None else "")
