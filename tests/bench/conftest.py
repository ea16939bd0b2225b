"""A tiny random Qwen3 as a BenchModel (CPU, fp32), shared by the benchmark tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_bench(tmp_path_factory):
    from kvtool.bench.loading import from_checkpoint
    from kvtool.testing.tiny import tiny_checkpoint

    folder = tmp_path_factory.mktemp("tiny-qwen3-bench")
    tiny_checkpoint("qwen3", folder)
    bm = from_checkpoint(folder, "tiny-qwen3", device="cpu", dtype="float32")
    yield bm
    bm.close()
