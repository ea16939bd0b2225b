"""Engine and sampling configuration: the one place where defaults live.

The CLI and the server read their defaults from these dataclasses.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace

from kvtool.errors import InvalidParameterError
from kvtool.skill_settings import parse_preamble, parse_repair
from kvtool.structured.grammar import request_grammar, unenforced_keywords

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
FORWARDS = ("auto", "reference", "cpu-ops")  # which forward a model's steps take (EngineConfig.forward)
KV_DTYPES = ("auto", "float32", "bfloat16")  # a paged engine's KV elements (EngineConfig.kv_dtype)
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes; the server's seed fields use it too
REAL = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
FLAGS = ("ignore_eos", "include_stop_str_in_output", "strict")
MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")  # None in a SamplingParams: the model's value (SamplingDefaults), as vLLM 0.32
# reads these keys of generation_config.json (and max_new_tokens, which kvtool does not: --default-max-tokens)


def is_whole(value, least: int = 0) -> bool:
    """An int (a bool is not one) >= least: the check behind every count, size and id kvtool takes."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


RETIRED = {"fast_decode": "every device runs ModelRunner.run; EngineConfig.forward picks its path (auto, "
                          "reference, cpu-ops)",
           "static_max_tokens": "a request's KV is bounded by kv_bytes and the model's context window"}


def refuse_retired(cls):
    """cls with an __init__ that names a retired setting (RETIRED) and what does its job now, not only an unknown
    keyword."""
    @functools.wraps(init := cls.__init__)
    def checked(self, *args, **kwargs):
        if gone := sorted(RETIRED.keys() & kwargs.keys()):
            raise InvalidParameterError(f"EngineConfig has no setting {gone[0]} any more: {RETIRED[gone[0]]}")
        init(self, *args, **kwargs)
    cls.__init__ = checked
    return cls


@refuse_retired
@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    device: str = "auto"  # auto: cuda, then mps, then cpu
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU; or float32/bfloat16/float16
    weights: str = "dense"  # dense | int4: 4-bit projections, 8-bit head (CPU decode ~2x) | bf16: bf16 GEMMs (AMX)
    kv_dtype: str = "auto"  # the KV cache's elements where steps run the C++ CPU ops: auto | float32 | bfloat16
    # (kvtool.cache.store.kv_dtype says what auto picks); elsewhere the model's dtype
    prefill_chunk: int = 2048  # prompt tokens per scheduler step (each forward): bounds activation memory and how
    # long one step stalls running streams; a later chunk attends over all earlier keys
    max_running: int = 16  # requests the scheduler batches in each step (kvtool serve --max-active sets it)
    kv_bytes: int | None = None  # KV of the running requests; beyond it the newest is preempted (and recomputed
    # later). None: half the engine's KV memory budget (half the memory available, at most 32 GiB; Engine.memory)
    cache_bytes: int | None = None  # the prefix cache's byte budget; None: the budget's other half
    prefix_block: int = 16  # tokens per prefix-cache block
    enable_prefix_cache: bool = True
    cache_file: str | None = None  # a .kvc file: the prefix cache is loaded from it (if it exists) and saved to it
    kv_store: str | None = None  # a block store engines share (a folder or redis://host:port/db; kvtool.cache.kvstore)
    kv_store_bytes: int | None = None  # a folder store's size limit, for every engine on it; None: the folder's own
    forward: str = "auto"  # the path of each step: auto (the C++ CPU ops where they build on the CPU) | reference |
    # cpu-ops (refused where the ops cannot run); the model is loaded with it (kvtool.load(forward=...))
    skills_dir: str | None = None  # a skills folder: compile its blocks and splice them into prompts
    skill_repair: str = "recompute_attended:ratio=0.1"  # how spliced blocks are repaired (kvtool.skills.repair)
    skill_preamble: str = "deep:tokens=2048"  # what blocks are compiled after (kvtool.skills.preamble)
    skill_min_tokens: int = 128  # blocks shorter than this are prefilled, not spliced (docs/skills.md: break-even)
    generation_config: str = "auto"  # the sampling defaults of requests that name none: auto (the model's
    # generation_config.json or GGUF metadata, else its card, else llama-server's) | none (SamplingDefaults()) |
    # a folder with a generation_config.json (kvtool.models.sampling_defaults)

    def validate(self) -> "EngineConfig":
        """Raise InvalidParameterError naming the first bad value; return self. Engine() runs it."""
        def bad(name: str, why: str) -> None:
            raise InvalidParameterError(f"invalid engine setting {name}={getattr(self, name)!r}: {why}")

        for name, optional, least in (("prefill_chunk", False, 1), ("prefix_block", False, 1),
                                      ("max_running", False, 1), ("kv_bytes", True, 1), ("cache_bytes", True, 0),
                                      ("skill_min_tokens", False, 0), ("kv_store_bytes", True, 1)):
            value = getattr(self, name)
            if not (optional and value is None) and not is_whole(value, least):
                bad(name, f"must be an integer >= {least}" + (" or None" if optional else ""))
        choices = {"weights": ("dense", "int4", "bf16"), "forward": FORWARDS, "kv_dtype": KV_DTYPES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                bad(name, f"must be one of {', '.join(allowed)}")
        if not isinstance(self.enable_prefix_cache, bool):
            bad("enable_prefix_cache", "must be true or false")
        if self.cache_file is not None and (not isinstance(self.cache_file, str) or not self.cache_file):
            bad("cache_file", "must be a file path (str) or None")
        if self.cache_file is not None and not self.enable_prefix_cache:
            bad("cache_file", "saves the prefix cache, which enable_prefix_cache=False turns off")
        if self.kv_store is not None and not (self.enable_prefix_cache and isinstance(self.kv_store, str)):
            bad("kv_store", "must be a folder or redis://host:port/db (str) or None, with enable_prefix_cache on")
        if self.skills_dir is not None and not isinstance(self.skills_dir, str):
            bad("skills_dir", "must be a folder path (str) or None")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            bad("generation_config", "must be auto, none or a folder with a generation_config.json")
        parse_repair(self.skill_repair)
        parse_preamble(self.skill_preamble)
        return self


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a MODEL_DEFAULTS field unset samples with, and where that came from. These
    field defaults are the plain ones (no truncation, no penalty), in force with source "none"."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    source: str = "none"  # generation_config.json | GGUF metadata | model card: NAME | llama-server defaults | none

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line: the temperature, each value that is not the plain one, and their source."""
        plain = SamplingDefaults()
        values = ", ".join(f"{name} {getattr(self, name):g}" for name in MODEL_DEFAULTS
                           if name == "temperature" or getattr(self, name) != getattr(plain, name))
        return f"{values} ({self.source})"


@dataclass
class SamplingParams:
    max_tokens: int | None = None  # None: up to the context window
    # None in the next seven (MODEL_DEFAULTS): the model's default (with_defaults; the engines apply their model's),
    # else the plain SamplingDefaults() (temperature 1, top_p 1, top_k 0, min_p 0, no penalties)
    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None
    top_k: int | None = None  # 0 = off
    min_p: float | None = None
    repetition_penalty: float | None = None  # HF-style multiplicative, 1 = off
    presence_penalty: float | None = None  # OpenAI-style additive
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # keep the stop string (or stop_token_ids token's text) that ended it
    min_tokens: int = 0  # end of turn, stop_token_ids and stop strings count only after this many tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these tokens may be drawn (vLLM's allowed_token_ids)
    choice: list[str] | None = None  # the output is exactly one of these strings (kvtool.structured.grammar)
    regex: str | None = None  # the whole output matches this pattern (kvtool.structured.grammar)
    grammar: str | None = None  # the output follows this Lark or GBNF grammar (kvtool.structured.grammar)
    logprobs: int | None = None  # None: off; k >= 0: chosen token + top k
    prompt_logprobs: int | None = None  # None: off; k >= 0: each prompt token's logprob + top k (full prefill)
    response_format: str = "text"  # text | json_object | json_schema: one JSON value (kvtool.structured.grammar)
    json_schema: dict | bool | None = None  # for json_schema: the schema it follows
    json_suffix: str = ""  # JSON modes: text that must follow the object before the turn ends (a closing tag)
    strict: bool = False  # json_schema: refuse a schema with a keyword the grammar cannot enforce; False enforces
    # the rest and lists what it left out (unenforced), as OpenAI's json_schema.strict

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_defaults(self, defaults: SamplingDefaults | None = None) -> "SamplingParams":
        """These params with each unset MODEL_DEFAULTS field taken from defaults (a model's sampling_defaults;
        None: the plain SamplingDefaults()); a value the caller set always stays."""
        unset = [name for name in MODEL_DEFAULTS if getattr(self, name) is None]
        if not unset:
            return self
        defaults = defaults or SamplingDefaults()
        return replace(self, **{name: getattr(defaults, name) for name in unset})

    @property
    def structured(self) -> bool:
        """Whether the output follows a JSON mode, a choice, a regex or a grammar."""
        return self.response_format != "text" or any(x is not None for x in (self.choice, self.regex, self.grammar))

    @property
    def unenforced(self) -> tuple:
        """The JSON schema's keywords the grammar leaves out (kvtool.structured.lenient.Unenforced): () with strict,
        without a schema, or when it enforces all of it. Call after validate()."""
        if self.strict or self.response_format != "json_schema":
            return ()
        return unenforced_keywords(self.json_schema, self.json_suffix)

    def validate(self) -> "SamplingParams":
        """Raise InvalidParameterError naming the first bad value; return self."""
        def bad(name: str, why: str) -> None:
            raise InvalidParameterError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        for name in REAL:
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))) and not (
                    value is None and name in MODEL_DEFAULTS):
                bad(name, "must be a number" + (" or None (the model's default)" if name in MODEL_DEFAULTS else ""))
        for name in FLAGS:
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                bad(f.name, "must be a finite number")
        if self.max_tokens is not None and not is_whole(self.max_tokens, 1):
            bad("max_tokens", "must be an integer >= 1")
        if self.temperature is not None and not 0.0 <= self.temperature <= 100.0:
            bad("temperature", "must be in [0, 100]")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if self.top_k is not None and not is_whole(self.top_k):
            bad("top_k", "must be an integer >= 0 (0 disables it)")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty is not None and not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", "must be in (0, 10]")
        if self.presence_penalty is not None and not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if self.frequency_penalty is not None and not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not is_whole(self.min_tokens):
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if not isinstance(self.logit_bias, dict):
            bad("logit_bias", "must map token ids to biases")
        for token, value in self.logit_bias.items():
            if not is_whole(token):
                bad("logit_bias", f"key {token!r} is not a token id (an integer >= 0)")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
                bad("logit_bias", f"the bias of token {token} is {value!r}; it must be a number in [-100, 100]")
        if self.seed is not None and (not is_whole(self.seed, SEED_RANGE[0]) or self.seed >= SEED_RANGE[1]):
            bad("seed", "must be an integer in [-2^63, 2^64)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
                not is_whole(t) for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of token ids >= 0")
        if not isinstance(self.response_format, str) or self.response_format not in ("text", "json_object",
                                                                                     "json_schema"):
            bad("response_format", "must be 'text', 'json_object' or 'json_schema'")
        if (self.response_format == "json_schema") != (self.json_schema is not None):
            bad("json_schema", "give a schema exactly when response_format is 'json_schema'")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            bad("json_schema", "must be a JSON Schema (an object, or true / false)")
        if not isinstance(self.json_suffix, str):
            bad("json_suffix", "must be a string")
        if self.json_suffix and self.response_format == "text":
            bad("json_suffix", "follows the JSON object of a JSON mode; response_format is 'text'")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or any(not is_whole(t) for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of token ids >= 0")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or any(
                    not isinstance(c, str) or not c for c in self.choice):
                bad("choice", "must be a non-empty list of non-empty strings")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            bad("regex", "must be a non-empty pattern string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            bad("grammar", "must be a Lark or GBNF grammar (a non-empty string)")
        modes = [name for name in ("choice", "regex", "grammar") if getattr(self, name) is not None]
        if modes and (len(modes) > 1 or self.response_format != "text" or self.min_tokens):
            bad(modes[0], "the output follows one structure: give one of response_format, choice, regex and "
                          "grammar, without min_tokens")
        if self.structured:
            try:
                request_grammar(self.response_format, self.json_schema, self.json_suffix, self.choice, self.regex,
                                self.grammar, strict=self.strict)
            except InvalidParameterError as exc:
                name = modes[0] if modes else "json_schema" if self.json_schema is not None else "response_format"
                raise InvalidParameterError(f"invalid sampling parameter {name}: {exc}") from None
        if self.response_format != "text" and self.min_tokens:
            bad("min_tokens", "a JSON mode ends the output when its object closes; min_tokens does not apply")
        if self.response_format != "text" and self.ignore_eos and not self.stop_token_ids:
            bad("response_format", "json_object ends the output with an end-of-turn token: drop ignore_eos or "
                                   "give stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not is_whole(k) or k > 20):
                bad(name, "must be an integer in [0, 20]")
        return self


def as_sampling_params(value: SamplingParams | Mapping | None) -> SamplingParams:
    """None (the defaults), a SamplingParams, or a mapping of its fields ({"max_tokens": 16, ...})."""
    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, Mapping):
        names = {f.name for f in fields(SamplingParams)}
        unknown = sorted(str(k) for k in value if k not in names)
        if unknown:
            raise InvalidParameterError(f"unknown sampling parameter(s) {unknown}; SamplingParams has "
                                        f"{', '.join(sorted(names))}")
        return SamplingParams(**value)
    raise InvalidParameterError(f"params must be a SamplingParams or a dict of its fields; got {type(value).__name__}")
