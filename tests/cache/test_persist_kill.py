"""kill -9 at random moments while a process saves its prefix cache over and over (12 seeded cycles): every
restart loads the file, no file is ever refused, and every block a completed save named is there after the
restart. The KV has SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64), so a block is 737 KB and a
save appends tens of MB: kills land inside appends, syncs and manifest renames alike."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CYCLES = 12
SETUP = {"model": "kill-test", "config_hash": "0", "tokenizer_hash": "0", "dtype": "float32", "rope": "{}"}
ROOT = Path(__file__).resolve().parents[2]


def held_keys(cache) -> list[str]:
    from kvtool.cache.kvlog import chain_keys

    blocks, _, _ = cache.export_blocks()
    row = {block_id: j for j, (block_id, *_) in enumerate(blocks)}
    parents = [-1 if parent is None else row[parent] for _, parent, _, _ in blocks]
    return [k.hex() for k in chain_keys([list(b[2]) for b in blocks], parents)]


def child(path: str, seed: int) -> None:
    """Load path (if there), print the keys held; then add chains and save forever, printing the keys a save
    is about to write before it starts ("saving") and "saved" once it returned."""
    import torch

    from kvtool.cache.manager import PrefixCache
    from kvtool.cache.persist import load_cache, save_cache

    block = 16
    cache = PrefixCache(30, 3, 64, budget_bytes=(30 * 3 * 64 * block * 2 * 4) * 400, block_size=block)
    if os.path.exists(path):
        load_cache(cache, path, SETUP)
    print("loaded", json.dumps(held_keys(cache)), flush=True)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    roots = [[rng.randrange(1, 49152) for _ in range(block)] for _ in range(4)]
    while True:
        for _ in range(rng.randrange(1, 4)):
            tokens = rng.choice(roots) + [rng.randrange(1, 49152) for _ in range(block * rng.randrange(1, 6))]
            cache.import_chain(tokens, lambda i: tuple(torch.randn(2, 30, 3, block, 64, generator=gen)))
        if rng.random() < 0.15:  # evict some: the data file gathers dead blocks, and compacts past half
            cache.set_budget(cache.store.bytes_per_block * rng.randrange(20, 80))
            cache.set_budget(cache.store.bytes_per_block * 400)
        print("saving", json.dumps(held_keys(cache)), flush=True)
        save_cache(cache, path, SETUP)
        print("saved", flush=True)


@pytest.mark.slow
def test_kill_9_at_random_moments_never_corrupts_or_loses_a_saved_block(tmp_path):
    path, rng = tmp_path / "prefix.kvc", random.Random(42)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    last_saved: set[str] = set()  # the keys of the last save that returned
    in_flight: set[str] | None = None  # those of a save the kill cut short (it may have renamed its manifest)
    saves = 0
    for cycle in range(CYCLES):
        out, err = tmp_path / f"child{cycle}.out", tmp_path / f"child{cycle}.err"
        with open(out, "wb") as fh, open(err, "wb") as eh:
            proc = subprocess.Popen([sys.executable, "-c", "import sys; from tests.cache.test_persist_kill import "
                                     "child; child(sys.argv[1], int(sys.argv[2]))", str(path), str(cycle)],
                                    stdout=fh, stderr=eh, cwd=ROOT, env=env)
        deadline = time.monotonic() + 120
        while not out.read_text().startswith("loaded") or "\n" not in out.read_text():
            assert proc.poll() is None, f"cycle {cycle}: the restart failed:\n{err.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the child did not load in time"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.1, 3.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        lines = out.read_text().split("\n")[:-1]  # a line cut by the kill has no newline
        loaded = set(json.loads(lines[0].split(" ", 1)[1]))
        assert "Traceback" not in err.read_text(), err.read_text()[-3000:]
        # the manifest is replaced atomically: the restart holds exactly the last completed save, or the one the
        # previous kill interrupted if it got as far as its rename
        assert loaded == last_saved or loaded == in_flight, \
            f"cycle {cycle}: loaded {len(loaded)} blocks, {len(last_saved - loaded)} of the last save missing"
        in_flight = None
        for line in lines[1:]:
            if line.startswith("saving "):
                in_flight = set(json.loads(line.split(" ", 1)[1]))
            else:
                assert line == "saved", line
                last_saved, in_flight = in_flight, None
                saves += 1
    assert saves >= CYCLES, f"only {saves} saves completed in {CYCLES} cycles: the kills hit too early to test"
