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


def load_script(name: str):
    """benchmarks/NAME.py imported as a module, for tests of its pieces."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
