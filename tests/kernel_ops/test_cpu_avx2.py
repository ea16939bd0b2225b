"""The C++ decode ops built for a CPU with AVX2 but no AVX-512 (-march=haswell; AMD's AVX2 parts among them) give the
products of this machine's own build: the same bits for oneDNN's blocked layout, whose sums do not depend on the
vector width, and the same values within float rounding for the plain layouts. Built in a process of its own (one
library of the ops per process) into a cache folder of its own."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtool.kernels import cpu_decode


pytestmark = [pytest.mark.slow, pytest.mark.skipif(  # (_cpu_id: the flags -march=native builds for)
    shutil.which(os.environ.get("CXX", "c++")) is None or not {"avx2", "fma"} <= set(cpu_decode._cpu_id().split())
    or cpu_decode.unavailable() is not None,
    reason="needs a C++ compiler, an x86 CPU with AVX2 and FMA, and the ops built for this machine")]

AVX2_BUILD = """
import sys, torch
from kvtool.kernels import cpu_decode
cpu_decode.FLAGS = [f if f != "-march=native" else "-march=haswell" for f in cpu_decode.FLAGS]
cpu_decode.SOURCES = (cpu_decode.SOURCE,)  # the decode ops alone
assert cpu_decode.unavailable() is None
torch.save([torch.ops.kvtool_cpu.gemv(x, w, None, None) for x, w in torch.load(sys.argv[1])], sys.argv[2])
"""


def test_an_avx2_build_gives_this_builds_products(tmp_path):
    gen = torch.Generator().manual_seed(0)
    k, n = 576, 192  # SmolLM2's hidden size; three blocks of 64 outputs
    dense = torch.randn(n, k, generator=gen) / k**0.5
    blocked = dense.view(n // 64, 64, k).transpose(1, 2).contiguous()  # oneDNN's [N / 64, K, 64]
    cases = [(torch.randn(rows, k, generator=gen), w) for rows in (1, 2, 3, 4)
             for w in (blocked, dense, dense.bfloat16())]
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "KVTOOL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "2",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", AVX2_BUILD, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    for (x, w), got in zip(cases, torch.load(tmp_path / "out.pt")):
        want = torch.ops.kvtool_cpu.gemv(x, w, None, None)
        if w.dim() == 3:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, x @ w.float().T if w.dim() == 2 else x @ dense.T, rtol=1e-4, atol=1e-4)
