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
}


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
    rope: dict[str, Any] = field(default_factory=dict)  # rope_parameters as in the HF config

    @property
    def rope_theta(self) -> float:
        return float(self.rope["rope_theta"])

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    def config_hash(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True, default=str).encode()
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
        )
