"""ModelSpec: the shape facts kvtool needs, read from a Hugging Face config."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtool.errors import ModelLoadError

# model_type -> (q/k RMSNorm per head, bias on q/k/v projections)
FAMILIES: dict[str, tuple[bool, bool]] = {
    "qwen3": (True, False),
    "qwen2": (False, True),
    "llama": (False, False),
    "gemma3_text": (True, False),  # also: sliding-window layers, two RoPE bases (kvtool.models.gemma3)
}
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    rope: dict[str, Any] = field(default_factory=dict)  # rope_parameters as in the HF config (global layers)
    # Gemma 3: per-layer attention kind, the local window (a token sees itself and window - 1 before it),
    # the sliding layers' own rope parameters and the query scale 1/sqrt(query_pre_attn_scalar).
    layer_types: tuple[str, ...] = ()  # empty: every layer is full attention
    sliding_window: int | None = None
    rope_local: dict[str, Any] = field(default_factory=dict)
    query_pre_attn_scalar: float | None = None

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == SLIDING]

    def kv_bytes_read(self, tokens: int, element_size: int) -> int:
        """KV bytes attention can still read after `tokens` tokens: global layers all of them, sliding
        layers their window. kv_bytes_per_token * tokens is what the cache stores (every layer, every token)."""
        local = len(self.sliding_layers)
        seen = (self.num_layers - local) * tokens + local * min(tokens, self.sliding_window or tokens)
        return 2 * seen * self.num_kv_heads * self.head_dim * element_size

    @property
    def rope_theta(self) -> float:
        return float(self.rope["rope_theta"])

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    def config_hash(self) -> str:
        fields = asdict(self)
        for key in ("layer_types", "sliding_window", "rope_local", "query_pre_attn_scalar"):
            if not fields[key]:  # the families without them hash as they did before these fields existed
                fields.pop(key)
        blob = json.dumps(fields, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelSpec":
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            raise ModelLoadError(
                f"unsupported model_type {model_type!r}; kvtool runs {', '.join(sorted(FAMILIES))}"
            )
        qk_norm, default_bias = FAMILIES[model_type]
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or {})
        gemma = gemma_fields(cfg, rope) if model_type == "gemma3_text" else {}
        rope = gemma.pop("rope", rope)
        if "rope_theta" not in rope:
            rope["rope_theta"] = cfg.get("rope_theta", 10000.0)
            rope.setdefault("rope_type", "default")
            if cfg.get("rope_scaling"):
                rope.update(cfg["rope_scaling"])
                rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            max_position=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            attention_bias=bool(cfg.get("attention_bias", default_bias)),
            rope=rope,
            **gemma,
        )


def gemma_fields(cfg: dict, rope: dict) -> dict:
    """Gemma 3's extra fields from its config; ModelLoadError for what the forward does not implement."""
    for knob in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(knob):
            raise ModelLoadError(f"{knob}={cfg[knob]} is not supported; kvtool runs Gemma 3 without logit softcapping")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention is not supported; kvtool runs causal Gemma 3")
    layers = cfg["num_hidden_layers"]
    kinds = tuple(cfg.get("layer_types") or ())
    if len(kinds) != layers or set(kinds) - {SLIDING, FULL}:
        raise ModelLoadError(f"layer_types must name {SLIDING} or {FULL} for each of the {layers} layers; got {kinds}")
    if FULL in rope or SLIDING in rope:  # transformers 5 nests the two rope settings by layer type
        full, local = dict(rope.get(FULL) or {}), dict(rope.get(SLIDING) or {})
    else:
        full, local = rope, {"rope_theta": cfg.get("rope_local_base_freq", 10000.0), "rope_type": "default"}
    return {"rope": full, "layer_types": kinds, "sliding_window": int(cfg["sliding_window"]), "rope_local": local,
            "query_pre_attn_scalar": float(cfg["query_pre_attn_scalar"])}
