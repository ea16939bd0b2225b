"""Tiny random runners for fast skill tests (real-model tests use the session fixtures in tests/conftest.py)."""

import pytest
import torch

from kvtool.skills import compile_ids, setup_of
from kvtool.testing.tiny import tiny_checkpoint, tiny_runner


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("skills-qwen3")
    tiny_checkpoint("qwen3", folder)
    return tiny_runner("qwen3", folder)


def rand_ids(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="session")
def tiny_blocks(tiny):
    """Two blocks compiled after a 5-token preamble (canonical start 5)."""
    setup = setup_of(runner=tiny, name="tiny-qwen3")
    return [compile_ids(tiny, [1] + rand_ids(29, 1), setup, "alpha", preamble=[2, 9, 9, 9, 9]),
            compile_ids(tiny, [1] + rand_ids(22, 2), setup, "beta", preamble=[2, 9, 9, 9, 9])]
