"""Random checkpoints at a real model's shape, for timing runs (the tiny ones tests use are kvtool.testing.tiny's)."""

from __future__ import annotations

from pathlib import Path

import torch


def qwen3_0_6b_config():
    """The Qwen3-0.6B shape (28 layers, hidden 1024, 16 q / 8 kv heads, head_dim 128) for timing runs."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)


def random_checkpoint(config, folder: Path, seed: int = 0) -> Path:
    """Save a randomly initialised HF model for `config` (bf16 keeps the file small)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf.save_pretrained(str(folder))
    return folder
