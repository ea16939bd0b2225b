"""The C++ prefill ops (kvtool/kernels/cpu_prefill.cpp, and the many-row paths of rms_norm and silu_mul) against
their PyTorch references at several thread counts, and prefill through them (kvtool.models.cpu_prefill) against
the reference forward on tiny and real models."""

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvtool.kernels import cpu_decode, cpu_gemm
from kvtool.models.rope import apply_rope
from kvtool.testing.ops import ops_of
from kvtool.testing.tiny import tiny_checkpoint, tiny_runner

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None or cpu_gemm._op_works() is not None,
                                reason="needs a C++ compiler and oneDNN's packed linear")

THREADS = (1, 2, 3)


@pytest.fixture(scope="module")
def ops():
    assert cpu_decode.unavailable() is None
    return torch.ops.kvtool_cpu


def at_threads(fn):
    """fn() at each of THREADS torch threads; the results, which must not depend on the count."""
    before = torch.get_num_threads()
    try:
        outs = []
        for n in THREADS:
            torch.set_num_threads(n)
            outs.append(fn())
    finally:
        torch.set_num_threads(before)
    return outs


def assert_same_bits(outs):
    first = outs[0] if isinstance(outs[0], tuple) else (outs[0],)
    for other in outs[1:]:
        for a, b in zip(first, other if isinstance(other, tuple) else (other,)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("rows,n", [(1, 576), (37, 576), (300, 70), (2, 5)])
def test_rms_norm_over_many_rows_equals_torch_at_any_thread_count(ops, rows, n):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, n, generator=gen) * 3, torch.randn(n, generator=gen)
    outs = at_threads(lambda: ops.rms_norm(x, w, 1e-5))
    assert_same_bits(outs)
    torch.testing.assert_close(outs[0], F.rms_norm(x, (n,), w, 1e-5), atol=1e-6, rtol=1e-5)
    half = ops.rms_norm(x, w, 1e-5, True)  # for a bf16 product: the fp32 result rounded to nearest even
    assert half.dtype == torch.bfloat16 and torch.equal(half, outs[0].bfloat16())


@pytest.mark.parametrize("rows,inter", [(1, 100), (45, 1536), (513, 7), (3, 1)])
def test_silu_mul_over_many_rows_gives_the_reference_bits(ops, rows, inter):
    """Blocks of rows through ATen's own silu, then * up: the reference forward's bits, whatever the split."""
    gu = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4
    outs = at_threads(lambda: ops.silu_mul(gu))
    for out in outs:
        assert torch.equal(out, F.silu(gu[:, :inter]) * gu[:, inter:])


@pytest.mark.parametrize("rows,inter", [(1, 100), (16, 1536), (513, 7)])
def test_silu_mul_of_a_bf16_gate_up_is_the_fp32_result_rounded(ops, rows, inter):
    """A bf16 gate_up (the bf16 weights' product) gives bf16: the fp32 path's bits over the widened values, rounded
    to nearest even, whatever the split, under inference mode too."""
    gu = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).bfloat16()
    want = (F.silu(gu[:, :inter].float()) * gu[:, inter:].float()).bfloat16()
    with torch.inference_mode():
        outs = at_threads(lambda: ops.silu_mul(gu))
    for out in outs:
        assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        ops.silu_mul(gu.half())


def test_silu_mul_under_inference_mode_on_many_threads(ops):
    """The blocks run on the pool's threads; under torch.inference_mode (as the runner's forward is) their
    writes into the inference-mode output must be allowed there too, as they are on the calling thread."""
    with torch.inference_mode():
        gu = torch.randn(45, 2 * 1536, generator=torch.Generator().manual_seed(3))
        outs = at_threads(lambda: ops.silu_mul(gu))
    for out in outs:
        assert torch.equal(out, F.silu(gu[:, :1536]) * gu[:, 1536:])


def reference_rope_qkv(qkv, cos, sin, q_norm, k_norm, eps, hq, hkv):
    """q [T, hq, d], k and v [hkv, T, d] as the reference forward computes them (kvtool.models.layers)."""
    t = qkv.shape[0]
    d = qkv.shape[1] // (hq + 2 * hkv)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    q, k, v = q.view(t, hq, d).transpose(0, 1), k.view(t, hkv, d).transpose(0, 1), v.view(t, hkv, d).transpose(0, 1)
    if q_norm is not None:
        q, k = F.rms_norm(q, (d,), q_norm, eps), F.rms_norm(k, (d,), k_norm, eps)
    return apply_rope(q, cos, sin).transpose(0, 1), apply_rope(k, cos, sin), v


@pytest.mark.parametrize("hq,hkv,d,t,slot,qk_norm", [(4, 2, 16, 1, 0, False), (9, 3, 64, 37, 0, False),
                                                     (9, 3, 64, 130, 41, False), (14, 2, 6, 17, 3, False),
                                                     (16, 8, 128, 33, 5, True), (4, 4, 10, 19, 0, True)])
def test_rope_qkv_equals_norm_and_rope_and_writes_only_its_slots(ops, hq, hkv, d, t, slot, qk_norm):
    """Odd token counts and head sizes that are no multiple of 8; without q/k norms q and k are the reference's
    bits (RoPE's products and sums rounded as x * cos + rotate_half(x) * sin rounds them)."""
    gen = torch.Generator().manual_seed(t + d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    angles = torch.rand(t, d // 2, generator=gen) * 60
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    norms = (torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5) if qk_norm else (None, None)
    q_want, k_want, v_want = reference_rope_qkv(qkv, cos, sin, *norms, 1e-6, hq, hkv)
    capacity = slot + t + 4
    start = (torch.randn(1, hkv, capacity, d, generator=gen), torch.randn(1, hkv, capacity, d, generator=gen))

    def run():
        keys, values = start[0].clone(), start[1].clone()
        q = ops.rope_qkv(qkv, keys, values, slot, cos, sin, *norms, 1e-6, hq, hkv, [], 0, 0)
        return q, keys, values

    outs = at_threads(run)
    assert_same_bits(outs)
    q, keys, values = outs[0]
    assert q.shape == (t, hq, d)
    close = torch.equal if not qk_norm else lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert close(q, q_want) and close(keys[0, :, slot : slot + t], k_want)
    assert torch.equal(values[0, :, slot : slot + t], v_want)
    others = [i for i in range(capacity) if not slot <= i < slot + t]
    assert torch.equal(keys[:, :, others], start[0][:, :, others])
    assert torch.equal(values[:, :, others], start[1][:, :, others])


@pytest.mark.parametrize("t,slot,blocks", [(37, 5, 3), (12, 0, 3), (20, 9, 1)])
def test_rope_qkv_writes_positions_below_base_into_the_blocks(ops, t, slot, blocks):
    """Positions slot .. slot + t - 1 land in layer 1's part of the blocks [2, L, hkv, B, d] below base and in the
    buffers from base on: the same values as one flat buffer gets, and nothing else written."""
    gen = torch.Generator().manual_seed(t + slot)
    hq, hkv, d, bs, base = 4, 2, 16, 8, 8 * blocks
    qkv, angles = torch.randn(t, (hq + 2 * hkv) * d, generator=gen), torch.rand(t, d // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    flat = torch.zeros(1, hkv, slot + t, d), torch.zeros(1, hkv, slot + t, d)
    q_want = ops.rope_qkv(qkv, *flat, slot, cos, sin, None, None, 1e-6, hq, hkv, [], 0, 0)
    shared = [torch.zeros(2, 3, hkv, bs, d) for _ in range(blocks)]
    own = torch.zeros(1, hkv, max(slot + t - base, 0) + 2, d), torch.zeros(1, hkv, max(slot + t - base, 0) + 2, d)
    q = ops.rope_qkv(qkv, *own, slot, cos, sin, None, None, 1e-6, hq, hkv, shared, 1, base)
    assert torch.equal(q, q_want)
    for kv in range(2):
        got = torch.cat([*(b[kv, 1] for b in shared), own[kv][0, :, : max(slot + t - base, 0)]], 1)
        assert torch.equal(got[:, : slot + t], flat[kv][0])
        assert not any(b[kv, [0, 2]].any() for b in shared) and not own[kv][:, :, slot + t - base :].any()


def test_rope_qkv_refuses_what_does_not_fit(ops):
    keys = values = torch.zeros(1, 2, 8, 16)
    qkv, rows = torch.zeros(3, 8 * 16), torch.zeros(3, 16)
    with pytest.raises(RuntimeError, match=r"slots 6\.\.8 are outside 0 blocks \(0 tokens\) and the buffers' 8"):
        ops.rope_qkv(qkv, keys, values, 6, rows, rows, None, None, 1e-6, 4, 2, [], 0, 0)
    with pytest.raises(RuntimeError, match=r"rope_qkv: blocks must be contiguous"):
        ops.rope_qkv(qkv, keys, values, 0, rows, rows, None, None, 1e-6, 4, 2, [torch.zeros(2, 1, 2, 4, 16)], 1, 4)
    with pytest.raises(RuntimeError, match="qkv's width must be"):
        ops.rope_qkv(torch.zeros(3, 17), keys, values, 0, rows, rows, None, None, 1e-6, 4, 2, [], 0, 0)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        ops.rope_qkv(qkv, keys.transpose(2, 3), values, 0, rows, rows, None, None, 1e-6, 4, 2, [], 0, 0)
    with pytest.raises(RuntimeError, match="cos/sin must be"):
        ops.rope_qkv(qkv, keys, values, 0, rows[:2], rows, None, None, 1e-6, 4, 2, [], 0, 0)
    with pytest.raises(RuntimeError, match="q_norm/k_norm must be"):
        ops.rope_qkv(qkv, keys, values, 0, rows, rows, torch.ones(15), torch.ones(16), 1e-6, 4, 2, [], 0, 0)


@pytest.mark.parametrize("hq,hkv,d,t,slot,blocks", [(9, 3, 64, 64, 200, 0), (9, 3, 64, 300, 0, 0), (14, 2, 64, 5, 3, 0),
                                                  (4, 4, 16, 7, 1, 0), (16, 8, 128, 33, 70, 4), (2, 1, 8, 2, 600, 9),
                                                  (4, 2, 24, 97, 40, 2), (9, 3, 64, 40, 8, 3), (4, 2, 24, 50, 20, 4)])
def test_prefill_attention_equals_masked_attention(ops, hq, hkv, d, t, slot, blocks):
    """prefill_attention (keys in tiles, each KV head's query group at once, no mask) against SDPA with the causal
    mask over the whole cache, with the first keys read from blocks of 16 in place (the queries' own too, where
    slot < base); the same bits at any
    thread count and at eight lanes (the AVX2 width) as at the widest vectors the build has (AVX-512's sixteen)."""
    from kvtool.models.layers import causal_mask

    gen = torch.Generator().manual_seed(t * slot + blocks)
    base, layers = 16 * blocks, 3
    shared = [torch.randn(2, layers, hkv, 16, d, generator=gen) for _ in range(blocks)]
    own_k, own_v = (torch.randn(1, hkv, slot + t - base + 3, d, generator=gen) for _ in range(2))
    q = torch.randn(t, hq, d, generator=gen) * 2
    outs = at_threads(lambda: ops.prefill_attention(q, shared, 1, own_k, own_v, base, slot))
    assert_same_bits(outs)
    assert torch.equal(outs[0], ops.prefill_attention(q, shared, 1, own_k, own_v, base, slot, 8))
    keys, values = (torch.cat([*(b[kv, 1] for b in shared), mine[0, :, : slot + t - base]], 1)[None]
                    for kv, mine in ((0, own_k), (1, own_v)))
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values,
                                          attn_mask=causal_mask(t, slot + t, "cpu"), enable_gqa=True)
    torch.testing.assert_close(outs[0], want[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_prefill_attention_refuses_what_does_not_fit(ops):
    q, keys = torch.zeros(4, 2, 16), torch.zeros(1, 1, 8, 16)
    with pytest.raises(RuntimeError, match=r"positions 6\.\.9 do not fit 0 blocks \(0 tokens\) and buffers of 8"):
        ops.prefill_attention(q, [], 0, keys, keys, 0, 6)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.prefill_attention(torch.zeros(4, 2, 12), [], 0, torch.zeros(1, 1, 8, 12), torch.zeros(1, 1, 8, 12), 0, 0)
    with pytest.raises(RuntimeError, match="blocks must be contiguous"):
        ops.prefill_attention(q, [torch.zeros(2, 1, 1, 4, 16)], 1, keys, keys, 4, 4)
    with pytest.raises(RuntimeError, match="width must be 0 .the widest. or 8, got 16"):
        ops.prefill_attention(q, [], 0, keys, keys, 0, 0, 16)


def prefill(runner, ids, on: bool, chunk: int, cache=None):
    """(logits of every token, the cache) of a prefill through the ops (on) or the reference forward."""
    assert runner.use_cpu_prefill(on) is None
    cache = runner.new_cache(len(ids) + 1) if cache is None else cache
    return runner.prefill(ids, cache, chunk=chunk, logits="all"), cache


def assert_same_prefill(fast, ref, atol):
    torch.testing.assert_close(fast[0], ref[0], atol=atol, rtol=1e-4)
    assert torch.equal(fast[0].argmax(-1), ref[0].argmax(-1))
    for a, b in zip(fast[1].layers, ref[1].layers):
        assert a.offset == b.offset
        torch.testing.assert_close(a.keys, b.keys, atol=atol, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_prefill_through_the_ops_equals_the_reference_forward(tmp_path, family):
    """Chunks of 7 over 40 tokens: the first chunk attends to itself only, later ones to the cache too."""
    tiny_checkpoint(family, tmp_path)
    runner = tiny_runner(family, tmp_path)
    assert runner.cpu_prefill  # kvtool's loader turns it on with the decode ops
    ids = list(range(3, 43))
    try:
        fast = at_threads(lambda: prefill(runner, ids, True, 7))
        ref = prefill(runner, ids, False, 7)
    finally:
        runner.use_cpu_prefill(True)
    assert_same_bits([(logits, *(layer.keys for layer in cache.layers)) for logits, cache in fast])
    assert_same_prefill(fast[0], ref, 1e-5)


def test_batched_prefill_and_taps(tmp_path):
    """Sequences of several lengths in one forward_batch, after cached tokens, equal the reference batch; a tap
    (attention capture) keeps the reference forward."""
    tiny_checkpoint("qwen2", tmp_path)
    runner = tiny_runner("qwen2", tmp_path)
    prompts = [list(range(5, 17)), [9], list(range(40, 45))]

    def batch(on):
        runner.use_cpu_prefill(on)
        caches = [runner.new_cache(32) for _ in prompts]
        for cache in caches:
            runner.forward(list(range(100, 103)), cache, logits="none")
        out = runner.forward_batch([(torch.tensor(p), c) for p, c in zip(prompts, caches)], logits="all")
        return out, caches

    try:
        fast, ref = batch(True), batch(False)
        runner.use_cpu_prefill(True)
        assert "kvtool_cpu::rope_qkv" in ops_of(lambda: runner.prefill(list(range(3, 20)), runner.new_cache(32)))
        seen = []
        tapped = ops_of(lambda: runner.prefill(list(range(3, 20)), runner.new_cache(32), tap=seen.append))
        assert "kvtool_cpu::rope_qkv" not in tapped and len(seen) == runner.spec.num_layers
    finally:
        runner.use_cpu_prefill(True)
    for a, b in zip(fast[0], ref[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for ca, cb in zip(fast[1], ref[1]):
        assert ca.offset == cb.offset
        torch.testing.assert_close(ca.layers[1].keys, cb.layers[1].keys, atol=1e-5, rtol=1e-5)


def test_decode_rows_beside_a_prompt_chunk_take_the_decode_op(tmp_path):
    """A packed forward of decode rows and a prompt chunk (a serving step where a prompt arrives) attends the rows of
    one token through `attend`, the decode step's op, and the chunk through prefill_attention: logits and KV as the
    decode step gives the rows alone and as the reference forward gives the whole batch."""
    tiny_checkpoint("qwen3", tmp_path)
    runner = tiny_runner("qwen3", tmp_path)
    before = [list(range(3, 23)), list(range(30, 67)), list(range(70, 75))]
    new = [[5], list(range(80, 91)), [7]]

    def step(on, rows):
        runner.use_cpu_prefill(on)
        runner.use_cpu_decode(on)
        caches = [runner.new_cache(64) for _ in before]
        for ids, cache in zip(before, caches):
            runner.forward(ids, cache, logits="none")
        seqs = [(torch.tensor(new[j]), caches[j]) for j in rows]
        return runner.forward_batch(seqs), [caches[j] for j in rows]

    try:
        names = ops_of(lambda: step(True, [0, 1, 2]))
        mixed, alone, ref = step(True, [0, 1, 2]), step(True, [0, 2]), step(False, [0, 1, 2])
    finally:
        runner.use_cpu_prefill(True)
        runner.use_cpu_decode(True)
    assert {"kvtool_cpu::attend", "kvtool_cpu::prefill_attention"} <= names
    for got, want in zip([mixed[0][0], mixed[0][2]], alone[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got, want in zip([mixed[1][0], mixed[1][2]], alone[1]):
        assert got.offset == want.offset
        torch.testing.assert_close(got.layers[2].keys, want.layers[2].keys, atol=1e-6, rtol=1e-6)
    for got, want in zip(mixed[0], ref[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    for got, want in zip(mixed[1], ref[1]):
        assert got.offset == want.offset
        torch.testing.assert_close(got.layers[1].values, want.layers[1].values, atol=1e-5, rtol=1e-5)


def test_bf16_and_the_env_switch_keep_the_reference_prefill(tmp_path, monkeypatch):
    tiny_checkpoint("llama", tmp_path)
    runner = tiny_runner("llama", tmp_path, dense_copies=True)
    assert "fp32 on the CPU" in runner.to(torch.bfloat16).use_cpu_prefill()
    assert not runner.cpu_prefill
    monkeypatch.setenv(cpu_decode.ENV, "0")
    assert tiny_runner("llama", tmp_path).cpu_prefill is False


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2", "qwen25"])
def test_real_models_prefill_through_the_ops(request, name):
    """600 tokens in chunks of 256 (the causal kernel, then masks over the cache): logits of every token close
    to the reference forward's, the same greedy token everywhere, and the same 16 greedy tokens after it."""
    runner = request.getfixturevalue(name).runner
    assert runner.cpu_prefill
    ids = torch.randint(100, 20000, (600,), generator=torch.Generator().manual_seed(3)).tolist()

    def greedy(on):
        logits, cache = prefill(runner, ids, on, 256)
        runner.use_cpu_decode(on)
        cache.reserve(len(ids) + 17)
        tokens = [int(logits[-1].argmax())]
        for _ in range(15):
            tokens.append(int(runner.forward(tokens[-1:], cache).argmax(-1)))
        return logits, cache, tokens

    try:
        fast, ref = greedy(True), greedy(False)
    finally:
        runner.use_cpu_decode(True)
    assert fast[2] == ref[2]
    assert_same_prefill(fast[:2], ref[:2], 5e-3)
