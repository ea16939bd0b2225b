"""kvtool serve --engine vllm --cache-file: a file saved for another model (real SmolLM2's KV, offered to a
Qwen2.5 server) is refused at start with a clear error naming the difference. The file surviving a restart and a kill
during a save is in test_skill_cache_contract.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtool.integrations.vllm import available

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not available(), reason="vLLM is not installed (pip install -e '.[vllm]')")]

LONG = " ".join(f"Entry {i}: the lighthouse at cape {i} logs {i * 3} ships a night." for i in range(60))


def smol_file(model, path):
    """A real .kvc for `model`: the KV of 64 prompt tokens, saved as kvtool's engine saves its prefix cache."""
    from kvtool.cache.manager import PrefixCache

    ids = model.encode(LONG)[:64]
    cache = model.runner.new_cache(80)
    model.runner.prefill(ids, cache, logits="none")
    store = PrefixCache.for_runner(model.runner, 1 << 26)
    store.import_chain(ids, lambda i: cache.stacked(i * 16, (i + 1) * 16))
    store.save(path, model)
    return path


def test_a_file_for_another_model_is_refused_naming_the_difference(smollm2, tmp_path):
    from kvtool.testing.models import qwen25_gguf

    path = smol_file(smollm2, tmp_path / "smol.kvc")
    done = subprocess.run([sys.executable, "-m", "kvtool.cli", "serve", "--engine", "vllm", "--model",
                           str(qwen25_gguf()), "--cache-file", str(path), "--port", "0"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("kvtool: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "different setup" in errors[0] and "model:" in errors[0] and "SmolLM2" in errors[0], errors[0]
    assert "Traceback" not in done.stderr
