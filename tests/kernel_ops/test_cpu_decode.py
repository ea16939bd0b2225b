"""The C++ decode ops (kvtool.kernels.cpu_decode) against torch, and decode steps through them against the
reference forward on tiny and real models."""

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvtool.cache.kv import KVCache
from kvtool.errors import ModelLoadError
from kvtool.kernels import cpu_decode, cpu_gemm, quant
from kvtool.models import cpu_step
from kvtool.models.rope import apply_rope
from kvtool.testing.ops import ops_of
from kvtool.testing.tiny import tiny_checkpoint, tiny_runner

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None or cpu_gemm._op_works() is not None,
                                reason="needs a C++ compiler and oneDNN's packed linear")


@pytest.fixture(scope="module")
def ops():
    assert cpu_decode.unavailable() is None
    return torch.ops.kvtool_cpu


@pytest.mark.parametrize("rows", [1, 3])
def test_rms_norm_and_silu_mul_equal_torch(ops, rows):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=gen) * 3, torch.randn(576, generator=gen)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), atol=1e-6, rtol=1e-5)
    gu = torch.randn(rows, 2 * 100, generator=gen) * 4
    torch.testing.assert_close(ops.silu_mul(gu), F.silu(gu[:, :100]) * gu[:, 100:], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows,n,k", [(1, 96, 576), (3, 131, 70), (4, 1000, 1536), (4, 33, 41), (2, 7, 5), (1, 69, 4101),
                                      (2, 40, 2053), (2, 42, 2053)])
def test_gemv_equals_linear_with_bias_and_residual(ops, rows, n, k):
    """K not a multiple of the 32-wide or 8-wide steps exercises the tails; N below the thread grain too; N not a
    multiple of the weight rows taken at a time (four for one or two rows, two for three or four) the last ones."""
    gen = torch.Generator().manual_seed(n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    bias, residual = torch.randn(n, generator=gen), torch.randn(rows, n, generator=gen)
    want = F.linear(x, w)
    torch.testing.assert_close(ops.gemv(x, w, None, None), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ops.gemv(x, w, bias, residual), want + bias + residual, atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="w must be contiguous fp32"):
        ops.gemv(x, w.t().contiguous().t(), None, None)


def test_gemv_gives_a_row_the_same_bits_at_any_row_count(ops):
    """One to four rows go through kernels of four or two weight rows at a time, each sum in one order."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 896, generator=gen), torch.randn(258, 896, generator=gen)
    alone = torch.cat([ops.gemv(x[i : i + 1], w, None, None) for i in range(4)])
    for rows in (2, 3, 4):
        assert torch.equal(ops.gemv(x[:rows], w, None, None), alone[:rows])


def test_gemv_widens_bf16_weights_exactly(ops):
    gen = torch.Generator().manual_seed(7)
    for rows, n, k in ((1, 1000, 576), (3, 70, 21)):
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen).bfloat16()
        torch.testing.assert_close(ops.gemv(x, w, None, None), F.linear(x, w.float()), atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="w must be contiguous fp32 or bf16"):
        ops.gemv(x, w.half(), None, None)


@pytest.mark.parametrize("rows,n,k", [(1, 96, 576), (3, 48, 288), (5, 144, 64), (8, 16, 1536)])
def test_gemv_q4_equals_the_dense_grid_values(ops, rows, n, k):
    """Group counts of 18, 9 and 2 leave block tails; 5 and 8 rows take two tiles. x goes in at 16 bits per
    group, which moves a product by ~2^-16 of the group's largest |x|: far below bf16's 2^-9."""
    gen = torch.Generator().manual_seed(n)
    packed = quant.quantize_int4(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen)
    x[0, 5] = 40.0  # an outlier in one group, as real activations have
    bias, residual = torch.randn(n, generator=gen), torch.randn(rows, n, generator=gen)
    want = F.linear(x.double(), packed.dense.double()).float()
    got = ops.gemv_q4(x, packed.codes, packed.scale_zero, None, None)
    assert (got - want).abs().max() <= 2e-4 * want.abs().max()
    got = ops.gemv_q4(x, packed.codes, packed.scale_zero, bias, residual)
    assert (got - (want + bias + residual)).abs().max() <= 2e-4 * want.abs().max()
    # torch's int4 kernel (bf16 activations and output) on the same weights lands several times further off
    bf16 = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed.packed, quant.GROUP, packed.scales_zeros)
    assert (got - want - bias - residual).abs().max() * 5 < (bf16.float() - want).abs().max()


@pytest.mark.parametrize("rows,n,k", [(1, 96, 576), (2, 131, 64), (3, 5, 96), (4, 1000, 896)])
def test_gemv_q8_equals_the_grid_values_and_a_row_does_not_depend_on_the_others(ops, rows, n, k):
    """131 and 5 output rows leave tails after the tiles of 4 and 2 rows; x and the sums stay fp32."""
    gen = torch.Generator().manual_seed(n)
    small = quant.quantize_int8(torch.randn(n, k, generator=gen) * 0.05, rows_at_once=64)
    grid = (small.codes.float().reshape(n, -1, 32) * small.scale[..., None]).reshape(n, k)
    x = torch.randn(rows, k, generator=gen)
    got = ops.gemv_q8(x, small.codes, small.scale)
    want = F.linear(x.double(), grid.double())
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    for r in range(rows):  # any row count gives a row the same bits
        assert torch.equal(ops.gemv_q8(x[r : r + 1].contiguous(), small.codes, small.scale)[0], got[r])


def test_quantize_int8_keeps_q8_0_values_and_gemv_q8_refuses_what_it_cannot_index(ops):
    gen = torch.Generator().manual_seed(3)
    scale = torch.rand(16, 2, generator=gen) + 0.01  # a Q8_0 weight: codes in -127..127, each group reaching 127
    codes = torch.randint(-127, 128, (16, 2, 32), generator=gen)
    codes[..., 0] = 127
    weight = (codes * scale[..., None]).reshape(16, 64)
    small = quant.quantize_int8(weight)
    assert torch.equal(small.codes.reshape(16, 2, 32), codes.to(torch.int8))
    torch.testing.assert_close(small.scale, scale, rtol=2e-7, atol=0)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="a multiple of 32"):
        ops.gemv_q8(torch.randn(1, 40), small.codes[:, :40].contiguous(), small.scale)
    with pytest.raises(RuntimeError, match=r"scale must be contiguous fp32 \[N, K/32\]"):
        ops.gemv_q8(x, small.codes, small.scale.bfloat16())
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        ops.gemv_q8(torch.randn(5, 64), small.codes, small.scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_int8(torch.randn(4, 40))


def test_gemv_q4_refuses_what_it_cannot_index(ops):
    packed = quant.quantize_int4(torch.randn(16, 64))
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        ops.gemv_q4(torch.randn(1, 40), packed.codes, packed.scale_zero, None, None)
    with pytest.raises(RuntimeError, match=r"codes must be contiguous uint8 \[N, K/2\]"):
        ops.gemv_q4(x, packed.codes[:, :16].contiguous(), packed.scale_zero, None, None)
    with pytest.raises(RuntimeError, match=r"scale_zero must be contiguous bf16 \[N, 2, K/32\]"):
        ops.gemv_q4(x, packed.codes, packed.scale_zero.float(), None, None)
    with pytest.raises(RuntimeError, match=r"residual must be contiguous \[rows, N\]"):
        ops.gemv_q4(x, packed.codes, packed.scale_zero, None, torch.zeros(2, 16))


def test_decode_products_take_gemv_for_few_rows_and_the_runner_product_for_more(ops):
    weight = cpu_gemm.pack(torch.randn(48, 32))
    few, many = torch.randn(cpu_decode.GEMV_MAX_ROWS, 32), torch.randn(cpu_decode.GEMV_MAX_ROWS + 1, 32)
    assert "kvtool_cpu::gemv" in ops_of(lambda: cpu_step._product(few, weight))
    assert "kvtool_cpu::gemv" not in ops_of(lambda: cpu_step._product(many, weight))
    long_rows = cpu_decode.MANY_X_BYTES // 4 // 3 + 1  # three x rows of this length pass MANY_X_BYTES, two do not
    wide = cpu_gemm.pack(torch.randn(48, long_rows))
    assert "kvtool_cpu::gemv" in ops_of(lambda: cpu_step._product(torch.randn(2, long_rows), wide))
    assert "kvtool_cpu::gemv" not in ops_of(lambda: cpu_step._product(torch.randn(3, long_rows), wide))
    qwen25 = cpu_gemm.pack(torch.randn(48, 896))  # Qwen2.5's hidden size: 3 rows in gemv, 4 in oneDNN
    assert "kvtool_cpu::gemv" in ops_of(lambda: cpu_step._product(torch.randn(3, 896), qwen25))
    assert "kvtool_cpu::gemv" not in ops_of(lambda: cpu_step._product(torch.randn(4, 896), qwen25))
    for x in (few, many):
        residual = torch.randn(x.shape[0], 48)
        torch.testing.assert_close(cpu_step._product(x, weight, residual=residual),
                                   F.linear(x, weight.dense) + residual, atol=1e-4, rtol=1e-5)


def reference_attend(qkv, keys, values, slot, cos, sin, q_norm, k_norm, eps, hq, hkv):
    """What attend() computes, in torch: (output [1, hq d], the rotated k [hkv, d], v [hkv, d])."""
    d = keys.shape[-1]
    q, k, v = qkv.view(hq + 2 * hkv, d).split([hq, hkv, hkv])
    if q_norm is not None:
        q, k = F.rms_norm(q, (d,), q_norm, eps), F.rms_norm(k, (d,), k_norm, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    ks = torch.cat([keys[0, :, :slot], k[:, None]], 1)
    vs = torch.cat([values[0, :, :slot], v[:, None]], 1)
    out = F.scaled_dot_product_attention(q[None, :, None], ks[None], vs[None], enable_gqa=True)
    return out.reshape(1, hq * d), k, v


@pytest.mark.parametrize("hq,hkv,d,slot,qk_norm", [(4, 2, 16, 0, False), (9, 3, 64, 40, False),
                                                   (9, 3, 64, 700, False), (14, 2, 64, 300, False),
                                                   (16, 8, 128, 257, True), (4, 4, 32, 5, True)])
def test_attend_equals_norm_rope_and_sdpa_and_writes_only_its_slot(ops, hq, hkv, d, slot, qk_norm):
    """Slots past 256 span several key chunks (merged per head) and, past 512 keys in all, several threads.
    Three rows, each with its own buffers, slot and angles: the first at `slot`, the others shorter."""
    gen = torch.Generator().manual_seed(slot)
    slots = [slot, slot // 2, 3]
    keys = [torch.randn(1, hkv, s + 9, d, generator=gen) for s in slots]
    values = [torch.randn(1, hkv, s + 9, d, generator=gen) for s in slots]
    qkv = torch.randn(len(slots), (hq + 2 * hkv) * d, generator=gen)
    angles = torch.rand(len(slots), d // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    norms = (torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5) if qk_norm else (None, None)
    want = [reference_attend(qkv[r : r + 1], keys[r], values[r], s, cos[r], sin[r], *norms, 1e-6, hq, hkv)
            for r, s in enumerate(slots)]
    before = [(k.clone(), v.clone()) for k, v in zip(keys, values)]

    got = ops.attend(qkv, keys, values, slots, cos, sin, *norms, 1e-6, hq, hkv, [], [], 0)
    torch.testing.assert_close(got, torch.cat([w[0] for w in want]), atol=2e-5, rtol=1e-4)
    for r, s in enumerate(slots):
        torch.testing.assert_close(keys[r][0, :, s], want[r][1], atol=1e-5, rtol=1e-5)
        assert torch.equal(values[r][0, :, s], want[r][2])
        others = [i for i in range(keys[r].shape[2]) if i != s]
        assert torch.equal(keys[r][:, :, others], before[r][0][:, :, others])
        assert torch.equal(values[r][:, :, others], before[r][1][:, :, others])


def test_attend_refuses_what_does_not_fit(ops):
    keys = values = torch.zeros(1, 2, 8, 16)
    qkv, row = torch.zeros(1, 8 * 16), torch.zeros(1, 16)
    with pytest.raises(RuntimeError, match="slot is outside the buffers"):
        ops.attend(qkv, [keys], [values], [8], row, row, None, None, 1e-6, 4, 2, [], [], 0)
    with pytest.raises(RuntimeError, match="qkv has the wrong size"):
        ops.attend(torch.zeros(1, 17), [keys], [values], [0], row, row, None, None, 1e-6, 4, 2, [], [], 0)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        ops.attend(qkv, [keys.transpose(2, 3)], [values], [0], row, row, None, None, 1e-6, 4, 2, [], [], 0)
    with pytest.raises(RuntimeError, match="one entry per row"):
        ops.attend(qkv, [keys, keys], [values], [0], row, row, None, None, 1e-6, 4, 2, [], [], 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,blocks", [(16, [3, 0, 20]), (5, [1, 7, 60])])
def test_attend_reads_shared_blocks_in_place_with_the_same_bits(ops, block_size, blocks, dtype):
    """Rows whose first keys sit in shared [2, L, hkv, B, d] blocks (layer 1 of 3 here), the rest in their own
    buffers: the output has the bits of the same keys in one buffer (chunks of 256 keys cross block edges), the
    new K/V go to the buffers, and the blocks are only read. In fp32 and in bf16 (EngineConfig.kv_dtype), where
    blocks of another dtype than the buffers' are refused."""
    hq, hkv, d, layers, gen = 6, 2, 32, 3, torch.Generator().manual_seed(block_size)
    slots = [9, 300, 2]
    whole = [torch.randn(2, hkv, b * block_size + s + 4, d, generator=gen).to(dtype) for b, s in zip(blocks, slots)]
    qkv = torch.randn(len(slots), (hq + 2 * hkv) * d, generator=gen)
    angles = torch.rand(len(slots), d // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    prefix, own = [], []
    for w, b in zip(whole, blocks):
        for i in range(b):
            blk = torch.randn(2, layers, hkv, block_size, d, generator=gen).to(dtype)
            blk[:, 1] = w[:, :, i * block_size : (i + 1) * block_size]
            prefix.append(blk)
        own.append(w[:, :, b * block_size :].clone())
    kept = [blk.clone() for blk in prefix]
    full = [w.clone() for w in whole]
    want = ops.attend(qkv, [w[0:1] for w in full], [w[1:2] for w in full], [b * block_size + s for b, s in
                      zip(blocks, slots)], cos, sin, None, None, 1e-6, hq, hkv, [], [], 0)
    got = ops.attend(qkv, [o[0:1] for o in own], [o[1:2] for o in own], slots, cos, sin, None, None, 1e-6, hq, hkv,
                     prefix, blocks, 1)
    assert torch.equal(got, want)
    for w, o, b in zip(full, own, blocks):
        assert torch.equal(o, w[:, :, b * block_size :])
    assert all(torch.equal(a, b) for a, b in zip(prefix, kept))
    with pytest.raises(RuntimeError, match="does not add up"):
        ops.attend(qkv, [o[0:1] for o in own], [o[1:2] for o in own], slots, cos, sin, None, None, 1e-6, hq, hkv,
                   prefix[1:], blocks, 1)
    with pytest.raises(RuntimeError, match="L > layer"):
        ops.attend(qkv, [o[0:1] for o in own], [o[1:2] for o in own], slots, cos, sin, None, None, 1e-6, hq, hkv,
                   prefix, blocks, 3)
    with pytest.raises(RuntimeError, match=r"of the buffers' dtype"):
        ops.attend(qkv, [o[0:1] for o in own], [o[1:2] for o in own], slots, cos, sin, None, None, 1e-6, hq, hkv,
                   [p.half() for p in prefix], blocks, 1)


def decode(runner, prompt: list[int], steps: int, on: bool, positions_from: int | None = None):
    """Greedy tokens, stacked logits and the final cache of `steps` decode steps after a prefill."""
    assert runner.use_cpu_decode(on) is None
    cache = runner.new_cache(len(prompt) + steps + 1)
    logits = runner.prefill(prompt, cache)
    tokens, all_logits = [], []
    for i in range(steps):
        tok = int(logits.argmax(-1))
        tokens.append(tok)
        pos = None if positions_from is None else [positions_from + len(prompt) + i]
        logits = runner.forward([tok], cache, positions=pos)
        all_logits.append(logits)
    return tokens, torch.cat(all_logits), cache


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_decode_steps_equal_the_reference_forward(tmp_path, family):
    tiny_checkpoint(family, tmp_path)
    runner = tiny_runner(family, tmp_path)
    assert runner.cpu_decode  # kvtool's loader turns it on for packed fp32 CPU models
    prompt = list(range(3, 40))
    for shift in (None, 100):  # positions past the cache slots, as relocation passes them
        fast = decode(runner, prompt, 24, True, shift)
        ref = decode(runner, prompt, 24, False, shift)
        assert fast[0] == ref[0]
        torch.testing.assert_close(fast[1], ref[1], atol=1e-4, rtol=1e-4)
        for a, b in zip(fast[2].layers, ref[2].layers):
            assert a.offset == b.offset == len(prompt) + 24
            torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


def test_decode_steps_without_a_tap_take_the_ops(tmp_path):
    """Up to GEMV_MAX_ROWS sequences every layer runs in one `layers` call; more go layer by layer, their
    products through oneDNN; beside a chunk of several tokens (the prefill pass) the decode rows take `attend`; taps,
    and steps with the ops off, run the reference forward."""
    tiny_checkpoint("llama", tmp_path)
    runner = tiny_runner("llama", tmp_path)
    cache = runner.new_cache(64)
    step_ops = {"kvtool_cpu::layers", "kvtool_cpu::attend"}
    assert not step_ops & ops_of(lambda: runner.prefill(list(range(3, 20)), cache))
    assert "kvtool_cpu::layers" in ops_of(lambda: runner.forward([5], cache))
    assert not step_ops & ops_of(lambda: runner.forward([5], cache, tap=lambda seen: None))
    others = [runner.new_cache(64) for _ in range(cpu_decode.GEMV_MAX_ROWS)]
    for other in others:
        runner.prefill([4, 5, 6], other)
    two = [([7], cache), ([8], others[0])]
    assert "kvtool_cpu::layers" in ops_of(lambda: runner.forward_batch(two))
    many = ops_of(lambda: runner.forward_batch([([7], cache)] + [([8], other) for other in others]))
    assert "kvtool_cpu::attend" in many and "kvtool_cpu::layers" not in many
    mixed = ops_of(lambda: runner.forward_batch([([7, 8], cache), ([8], others[0])]))  # a chunk beside a decode row
    assert {"kvtool_cpu::attend", "kvtool_cpu::prefill_attention"} <= mixed and "kvtool_cpu::layers" not in mixed
    runner.use_cpu_decode(False)
    assert not step_ops & ops_of(lambda: runner.forward([5], cache))


def test_decode_steps_see_new_weights_and_swapped_ones(tmp_path):
    """The layers op's arguments are gathered once: load_state_dict() copies into the same tensors, and
    packing in int4 afterwards swaps the weight objects, which starts a new gathering."""
    tiny_checkpoint("qwen2", tmp_path)
    runner = tiny_runner("qwen2", tmp_path, dense_copies=True)
    prompt = list(range(3, 30))
    before = decode(runner, prompt, 4, True)[1]
    state = {k: v * 1.5 if k.endswith("proj.weight") else v for k, v in runner.state_dict().items()}
    runner.load_state_dict(state)
    fast, ref = decode(runner, prompt, 4, True), decode(runner, prompt, 4, False)
    assert not torch.allclose(fast[1], before, atol=1e-3)
    torch.testing.assert_close(fast[1], ref[1], atol=1e-4, rtol=1e-4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu_gemm.ENV, "0")
        unpacked = tiny_runner("qwen2", tmp_path)
    decode(unpacked, prompt, 2, True)  # gathers the dense weights
    assert unpacked.cpu_decode and not unpacked._cpu_step.layer_args(1)[-1]
    unpacked.quantize_int4()
    assert unpacked.cpu_decode and unpacked._cpu_step.layer_args(1)[-1]  # now the int4 codes
    fast, ref = decode(unpacked, prompt, 4, True), decode(unpacked, prompt, 4, False)
    torch.testing.assert_close(fast[1], ref[1], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("family,count", [("qwen3", 3), ("qwen2", 3), ("qwen2", 6)])
def test_batched_decode_steps_equal_the_reference_batch(tmp_path, family, count):
    """Sequences of different lengths decode together, each into its own cache: 3 in one `layers` call per
    step, 6 (past GEMV_MAX_ROWS) layer by layer."""
    tiny_checkpoint(family, tmp_path)
    runner = tiny_runner(family, tmp_path)
    prompts = [list(range(3, 50)), list(range(7, 12)), list(range(60, 90)), [5], list(range(9, 30)), [8, 9]][:count]

    def run(on: bool):
        runner.use_cpu_decode(on)
        caches = [runner.new_cache(64) for _ in prompts]
        tokens = [int(runner.prefill(p, c).argmax(-1)) for p, c in zip(prompts, caches)]
        logits = []
        for _ in range(12):
            out = runner.forward_batch([([t], c) for t, c in zip(tokens, caches)])
            tokens = [int(o.argmax(-1)) for o in out]
            logits.append(torch.cat(out))
        return torch.stack(logits), caches

    fast, ref = run(True), run(False)
    torch.testing.assert_close(fast[0], ref[0], atol=1e-4, rtol=1e-4)
    for a, b in zip(fast[1], ref[1]):
        assert a.offset == b.offset
        torch.testing.assert_close(a.layers[1].keys, b.layers[1].keys, atol=1e-5, rtol=1e-5)


def test_a_failed_build_or_the_env_switch_keeps_the_reference_forward(tmp_path, monkeypatch, capsys):
    tiny_checkpoint("llama", tmp_path / "ckpt")
    monkeypatch.setenv("KVTOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", shutil.which("false"))  # a "compiler" that always fails
    runner = tiny_runner("llama", tmp_path / "ckpt")
    assert not runner.cpu_decode
    reason = runner.use_cpu_decode()
    assert reason.startswith("compiling cpu_decode.cpp with") and "failed" in reason
    assert "decode steps run the reference forward: compiling cpu_decode.cpp" in capsys.readouterr().err
    assert not list((tmp_path / "cache" / "ext").glob("*.so*"))  # no half-written library left behind
    tokens, _, _ = decode(runner, list(range(3, 20)), 4, False)
    assert len(tokens) == 4

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert "no C++ compiler" in runner.use_cpu_decode()
    monkeypatch.delenv("CXX")
    monkeypatch.setenv(cpu_decode.ENV, "0")
    assert runner.use_cpu_decode() == "KVTOOL_CPU_DECODE=0" and not runner.cpu_decode
    assert tiny_runner("llama", tmp_path / "ckpt").forward_path == "reference"  # auto falls back
    with pytest.raises(ModelLoadError, match="forward cpu-ops: the C[+][+] CPU ops cannot run this model: "
                                             "KVTOOL_CPU_DECODE=0 [(]--forward auto falls back"):
        tiny_runner("llama", tmp_path / "ckpt", forward="cpu-ops")  # asked for: refused, not a silent fallback
    monkeypatch.setenv(cpu_decode.ENV, "fast")
    with pytest.raises(ValueError, match="KVTOOL_CPU_DECODE must be 0 or 1; got 'fast'"):
        runner.use_cpu_decode()
    with pytest.raises(ModelLoadError, match="KVTOOL_CPU_DECODE must be 0 or 1"):
        tiny_runner("llama", tmp_path / "ckpt")  # the loader turns a malformed switch into a load error


def test_a_damaged_library_file_is_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_CACHE", str(tmp_path))
    target = cpu_decode.library_path("c++")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"half a library")
    loaded, built = [], []

    def load(path):
        loaded.append(Path(path).read_bytes())
        if loaded[-1] == b"half a library":
            raise OSError("file too short")

    monkeypatch.setattr(torch.ops, "load_library", load)
    monkeypatch.setattr(cpu_decode, "build", lambda compiler, where: (built.append(where), where.write_bytes(b"ok")))
    assert cpu_decode._load.__wrapped__("c++") is None
    assert built == [target] and loaded == [b"half a library", b"ok"]


def test_plain_and_int4_matmuls_decode_through_the_ops_and_bf16_says_why_not(tmp_path):
    tiny_checkpoint("qwen3", tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu_gemm.ENV, "0")
        plain = tiny_runner("qwen3", tmp_path)
    int4 = tiny_runner("qwen3", tmp_path, weights="int4")
    prompt = list(range(3, 30))
    assert not plain.cpu_gemm_packed and int4.weights == "int4"
    # both int4 paths run gemv_q4, whose 16-bit x can turn summation-order differences into a step of 2^-16
    for runner, atol in ((plain, 1e-4), (int4, 1e-3)):
        assert runner.cpu_decode
        fast, ref = decode(runner, prompt, 16, True), decode(runner, prompt, 16, False)
        assert fast[0] == ref[0]
        torch.testing.assert_close(fast[1], ref[1], atol=atol, rtol=1e-4)
        assert runner.use_cpu_decode(True) is None
        assert "kvtool_cpu::layers" in ops_of(lambda: runner.forward([5], fast[2]))
    wgu = int4.model.layers[0].mlp._wgu  # gemv_q4 takes up to MAX_ROWS rows in one call (3 beside oneDNN's bf16)
    limit = quant.BF16_WIDE_MAX_ROWS if wgu.wide is not None and wgu.wide.half else quant.MAX_ROWS
    most = [int4.new_cache(8) for _ in range(limit + 1)]
    for cache in most:
        int4.prefill([3, 4], cache)
    assert "kvtool_cpu::layers" in ops_of(lambda: int4.forward_batch([([5], cache) for cache in most[1:]]))
    assert "kvtool_cpu::layers" not in ops_of(lambda: int4.forward_batch([([5], cache) for cache in most]))
    with pytest.raises(RuntimeError, match="layers: per layer, norms needs 2 entries, mats 4"):
        torch.ops.kvtool_cpu.layers(torch.zeros(1, 8), [torch.zeros(8)] * 2, [], [None], [None, None], [], [], [0],
                                    torch.zeros(1, 2), torch.zeros(1, 2), 1e-6, 0.0, 1, 1, False, [], [])
    spec = plain.spec  # caches the ops cannot index into go to the reference forward
    assert cpu_step.DecodeStep.takes([plain.new_cache(8)])
    half, bf16 = (KVCache.empty(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype, "cpu")
                  for dtype in (torch.float16, torch.bfloat16))
    assert cpu_step.DecodeStep.takes([bf16]) and not cpu_step.DecodeStep.takes([half])
    assert not cpu_step.DecodeStep.takes([plain.new_cache(8), bf16])  # one call reads one dtype
    assert "fp32 on the CPU" in plain.to(torch.bfloat16).use_cpu_decode()


@pytest.mark.real_model
@pytest.mark.parametrize("name,steps", [("smollm2", 64), ("qwen25", 32)])
def test_real_models_decode_the_same_tokens_through_the_ops(request, name, steps):
    from kvtool.cli.info import describe

    model = request.getfixturevalue(name)
    runner = model.runner
    assert runner.cpu_decode and describe(model)["decode_steps"] == "C++ ops (kvtool.kernels.cpu_decode)"
    # each projection and the head held once, in oneDNN's layout, wherever gemv can read it (AVX2, AVX-512)
    assert runner.held_once == (runner.model.layers[0].mlp._wgu.blocked is not None)
    assert describe(model)["parameters"] == {"smollm2": 134_515_008, "qwen25": 630_167_424}[name]
    prompt = list(range(200, 300))
    try:
        fast = decode(runner, prompt, steps, True)
        ref = decode(runner, prompt, steps, False)
    finally:
        runner.use_cpu_decode(True)
    assert fast[0] == ref[0]
    torch.testing.assert_close(fast[1], ref[1], atol=1e-3, rtol=1e-4)


def test_gemv_reads_blocked_weights_in_one_order_at_any_row_count(ops):
    """oneDNN's packed layout, [N / 64, K, 64], which the runner's gemv reads so that no dense copy is held:
    each output sums four quarters of K, each in one FMA chain, whatever the rows, vector width or thread."""
    gen = torch.Generator().manual_seed(11)
    w, x = torch.randn(320, 896, generator=gen), torch.randn(4, 896, generator=gen)
    bias, residual = torch.randn(320, generator=gen), torch.randn(4, 320, generator=gen)
    blocked = w.view(5, 64, 896).transpose(1, 2).contiguous()
    alone = torch.cat([ops.gemv(x[i : i + 1], blocked, None, None) for i in range(4)])
    for rows in (2, 3, 4):
        assert torch.equal(ops.gemv(x[:rows], blocked, None, None), alone[:rows])
    torch.testing.assert_close(alone, F.linear(x.double(), w.double()).float(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ops.gemv(x, blocked, bias, residual), alone + bias + residual, atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="blocked weight takes up to 4 rows"):
        ops.gemv(torch.randn(5, 896), blocked, None, None)
    with pytest.raises(RuntimeError, match="w must be contiguous fp32 or bf16"):
        ops.gemv(x, w.view(10, 896, 32), None, None)
