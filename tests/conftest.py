"""Session-scoped real models: each GGUF is converted once (cached on disk) and loaded once."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2():
    import kvtool
    from kvtool.testing.models import smollm2_gguf

    return kvtool.load(str(smollm2_gguf()), device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="session")
def qwen25():
    import kvtool
    from kvtool.testing.models import qwen25_gguf

    return kvtool.load(str(qwen25_gguf()), device="cpu", dtype="float32", progress=False)


def _hf_oracle(model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model.folder), dtype=torch.float32)
    return hf.eval()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    return _hf_oracle(smollm2)


@pytest.fixture(scope="session")
def qwen25_hf(qwen25):
    return _hf_oracle(qwen25)


@pytest.fixture(scope="session")
def gemma3():
    import kvtool
    from kvtool.testing.models import gemma3_gguf

    return kvtool.load(str(gemma3_gguf()), device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="session")
def gemma3_hf(gemma3):
    return _hf_oracle(gemma3)
