"""OpenAI-compatible request bodies (pydantic, strict types) and their SamplingParams.

Unknown fields are ignored, as OpenAI-compatible servers do, so clients that send
vendor extensions keep working; every known field is type-checked strictly (a string
where a number belongs is a 400, not a silent conversion).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtool.config import SEED_RANGE as SEEDS
from kvtool.config import SamplingParams
from kvtool.serving.errors import ServingError

SEED_RANGE = dict(ge=SEEDS[0], lt=SEEDS[1])  # pydantic bounds of SamplingParams' range
TOKEN_ID_KEY = re.compile(r"\s*[0-9]{1,18}\s*")  # a logit_bias key
MAX_STOP_STRINGS = 64  # stop strings per request: each is looked for after every token
MAX_STOP_CHARS = 1024  # characters per stop string


def documented(**schema) -> Any:
    """A limit the server checks itself (with its own message) declared in the OpenAPI schema."""
    return Field(json_schema_extra=schema)


StopString = Annotated[str, documented(maxLength=MAX_STOP_CHARS)]
NonEmptyMessages = Annotated[list["ChatMessage"], documented(minItems=1)]  # "messages is empty" otherwise
# a prompt of no tokens is refused ("the prompt is empty"), in every form
Prompt = (Annotated[str, documented(minLength=1)] | Annotated[list[int], documented(minItems=1)]
          | Annotated[list[Annotated[str, documented(minLength=1)]], documented(minItems=1)]
          | Annotated[list[Annotated[list[int], documented(minItems=1)]], documented(minItems=1)])


def check_stop(stop: list[str]) -> None:
    """A 400 for more than MAX_STOP_STRINGS stop strings or one longer than MAX_STOP_CHARS."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ServingError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed (each is looked "
                           "for after every token)", param="stop")
    for i, text in enumerate(stop):
        if len(text) > MAX_STOP_CHARS:
            raise ServingError(f"stop string {i} has {len(text)} characters; at most {MAX_STOP_CHARS} are allowed",
                               param="stop")


def strict_flag(value, param: str) -> bool:
    """OpenAI's `strict` of a JSON schema (or a tool): true enforces all of it or refuses; false or absent enforces
    what the grammar can and reports the rest (kvtool.structured.lenient)."""
    if value is not None and not isinstance(value, bool):
        raise ServingError(f"{param} must be true or false, got {value!r}", param=param)
    return bool(value)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDef(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Strict):
    type: str = "function"
    function: FunctionDef


class FunctionCall(Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; a dict is accepted too


class ToolCallIn(Strict):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ContentPart(Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # history reasoning; templates like Qwen3's read it


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(Strict):
    include_usage: bool = False


class ResponseFormat(Strict):
    type: str = "text"
    json_schema: dict[str, Any] | None = None  # OpenAI: {"name", "schema", "strict"}
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama.cpp: {"type": "json_object",
    # "schema": {...}}


class StructuredOutputs(Strict):
    """vLLM's structured_outputs: exactly one of json (a schema), regex, choice, grammar or json_object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF
    json_object: bool | None = None
    structural_tag: Any = None  # named so a request using it gets a clear 400


class GenerationRequest(Strict):
    """Fields shared by chat and raw completions."""

    model: str | None = None
    max_tokens: Annotated[int | None, documented(minimum=1)] = None  # completions: 0 with echo (scores the prompt)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, **SEED_RANGE)
    stop: StopString | Annotated[list[StopString], documented(maxItems=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    allowed_token_ids: list[int] | None = None  # vLLM's extension: only these tokens may be drawn
    guided_choice: list[str] | None = None  # vLLM's extension: the output is exactly one of these strings
    guided_regex: str | None = None  # vLLM's extension: the output matches this pattern
    guided_json: dict[str, Any] | str | None = None  # vLLM's extension: the output is JSON of this schema
    guided_grammar: str | None = None  # vLLM's extension: the output follows this Lark or GBNF grammar
    structured_outputs: StructuredOutputs | None = None  # vLLM's newer form of the guided_* fields
    grammar: str | None = None  # llama.cpp's extension: a GBNF (or Lark) grammar
    json_schema: dict[str, Any] | bool | None = None  # llama.cpp's extension: the output is JSON of this schema
    structural_tag: Any = None  # vLLM's; named so a client sending one gets a 400 instead of unconstrained text
    include_stop_str_in_output: bool = False  # vLLM's extension: the stop string that ended the text stays in it
    min_tokens: int = 0  # vLLM's extension: no end of turn, stop token or stop string before this many tokens
    logit_bias: dict[str, float] | None = None  # token id (a JSON key) -> bias added to its logit, in [-100, 100]
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None  # text | json_object | json_schema (kvtool.structured.grammar)

    def sampling(self, default_max_tokens: int | None, max_tokens: int | None = None,
                 logprobs: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        if self.n < 1:
            raise ServingError(f"n must be >= 1, got {self.n}", param="n")
        defaults = SamplingParams()  # the one place sampling defaults live

        def pick(name: str):
            value = getattr(self, name)
            return getattr(defaults, name) if value is None else value

        fmt, choice, regex, grammar = self.structured(self.response_format or ResponseFormat())
        if fmt.type not in ("text", "json_object", "json_schema"):
            raise ServingError(f"response_format type {fmt.type!r} is not supported; use 'text', 'json_object' or "
                               "'json_schema'", param="response_format")
        schema = (fmt.json_schema or {}).get("schema") if fmt.type == "json_schema" else None
        if fmt.type == "json_schema" and not isinstance(schema, (dict, bool)):
            raise ServingError("response_format json_schema needs json_schema.schema, a JSON schema object",
                               param="response_format")
        strict = strict_flag((fmt.json_schema or {}).get("strict"), "response_format.json_schema.strict")
        if max_tokens is None:  # max_completion_tokens wins over max_tokens, then the server default
            max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        check_stop(stop)
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not TOKEN_ID_KEY.fullmatch(key):  # ASCII digits only: "²".isdigit() is True, but int() refuses it
                shown = repr(key) if len(key) <= 40 else f"{key[:40]!r}... ({len(key)} characters)"
                raise ServingError(f"logit_bias keys are token ids (decimal digits 0-9); {shown} is not one",
                                   param="logit_bias")
            bias[int(key)] = value
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"), min_p=pick("min_p"),
            repetition_penalty=pick("repetition_penalty"), presence_penalty=pick("presence_penalty"),
            frequency_penalty=pick("frequency_penalty"), seed=self.seed, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logprobs=logprobs,
            min_tokens=self.min_tokens, logit_bias=bias, include_stop_str_in_output=self.include_stop_str_in_output,
            allowed_token_ids=self.allowed_token_ids, choice=choice, regex=regex, grammar=grammar,
            prompt_logprobs=prompt_logprobs, response_format=fmt.type, json_schema=schema, strict=strict)
        return params.validate()

    def structured(self, fmt: ResponseFormat) -> tuple[ResponseFormat, list[str] | None, str | None, str | None]:
        """(response format, choice, regex, grammar) from response_format, guided_*, structured_outputs and
        llama.cpp's grammar / json_schema: one of them."""
        out = self.structured_outputs
        if self.structural_tag is not None or (out is not None and out.structural_tag is not None):
            raise ServingError("structural_tag is not supported; use response_format, guided_json / guided_regex / "
                               "guided_choice / guided_grammar, structured_outputs or grammar", param="structural_tag")
        given = [f"guided_{k}" for k in ("choice", "regex", "json", "grammar")
                 if getattr(self, f"guided_{k}") is not None]
        given += [k for k in ("grammar", "json_schema") if getattr(self, k) is not None]
        if out is not None:
            named = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                     if getattr(out, "json_" if k == "json" else k) not in (None, False)]
            if len(named) != 1:
                raise ServingError(f"structured_outputs takes exactly one of json, regex, choice, grammar and "
                                   f"json_object; got {named}", param="structured_outputs")
            given.append(f"structured_outputs.{named[0]}")
        if fmt.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise ServingError(f"give one way to structure the output, not {' and '.join(given)}", param=given[1])
        if fmt.type == "json_object" and fmt.schema_ is not None:  # llama.cpp: {"type": "json_object", "schema"}
            fmt = ResponseFormat(type="json_schema", json_schema={"schema": fmt.schema_})
        if out is not None and out.json_object:
            fmt = ResponseFormat(type="json_object")
        schema = next((s for s in (self.guided_json, self.json_schema, out.json_ if out else None) if s is not None),
                      None)
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise ServingError("the JSON schema given as a string is not JSON", param=given[0]) from None
        if schema is not None:
            fmt = ResponseFormat(type="json_schema", json_schema={"schema": schema})

        def pick(name: str, *mine):  # an empty list or string stays, for validate() to refuse by name
            return next((v for v in (*mine, getattr(out, name) if out is not None else None) if v is not None), None)

        return fmt, pick("choice", self.guided_choice), pick("regex", self.guided_regex), \
            pick("grammar", self.guided_grammar, self.grammar)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationRequest):
    messages: NonEmptyMessages
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: Annotated[int | None, documented(minimum=1)] = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is a prefix to continue
    add_special_tokens: bool = False  # vLLM: the tokenizer's special tokens before the rendered prompt too
    raw_tokens: bool = False  # kvtool: every generated token as {id, piece, channel, t_ms}
    skills: list[str] | None = None  # kvtool: load these skills (GET /v1/skills) into the context
    prompt_logprobs: int | None = None  # vLLM: each prompt token's logprob (+ top k); the prompt is prefilled whole

    def chat_sampling(self, default_max_tokens: int | None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ServingError("top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling(default_max_tokens, self.max_completion_tokens, logprobs, self.prompt_logprobs)


class CompletionRequest(GenerationRequest):
    prompt: Prompt
    max_tokens: Annotated[int | None, documented(minimum=0)] = None  # 0 with echo: the prompt scored, no tokens
    logprobs: int | None = None
    echo: bool = False  # the text starts with the prompt; with logprobs, the prompt tokens' come first
    suffix: str | None = None  # fill-in-the-middle: the prompt is the text before, suffix the text after
    add_special_tokens: bool = True  # vLLM: a text prompt gets its tokenizer's special tokens (Gemma's <bos>)
    prompt_logprobs: int | None = None  # vLLM: each prompt token's logprob (+ top k); the prompt is prefilled whole

    def completion_sampling(self, default_max_tokens: int | None) -> SamplingParams:
        if self.suffix is not None and self.echo:
            raise ServingError("echo cannot be combined with suffix: a fill-in-the-middle prompt is not text to "
                               "echo (send the prefix and suffix again yourself)", param="echo")
        if self.max_tokens == 0 and not self.echo:
            raise ServingError("max_tokens=0 generates nothing: it only scores the prompt, with echo=true (and "
                               "logprobs=N for the prompt tokens' logprobs); otherwise ask for max_tokens >= 1",
                               param="max_tokens")
        scored = self.prompt_logprobs if self.prompt_logprobs is not None or not self.echo else self.logprobs
        # max_tokens=0 with echo: one token is computed (the prompt is prefilled and scored) and not returned
        return self.sampling(default_max_tokens, max_tokens=1 if self.score_only else None, logprobs=self.logprobs,
                             prompt_logprobs=scored)

    @property
    def score_only(self) -> bool:
        """echo with max_tokens=0: the response is the prompt (and its logprobs), no completion, as vLLM's."""
        return self.echo and self.max_tokens == 0


class TokenizeRequest(Strict):
    """vLLM shape: either a raw `prompt` or chat `messages` (rendered with the template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template has them)
    skills: list[str] | None = None  # kvtool: as in chat completions
    return_token_strs: bool = False  # vLLM: the tokenizer's own token strings (e.g. "Ġhello")
    with_pieces: bool = False  # kvtool: each token decoded alone, verbatim


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]
    with_pieces: bool = False


class TemplateRequest(Strict):
    model: str | None = None
    messages: NonEmptyMessages
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    skills: list[str] | None = None  # kvtool: as in chat completions
