"""oneDNN-packed CPU projections (kvtool.kernels.cpu_gemm) against plain F.linear, alone and in a model."""

import pytest
import torch

from kvtool.errors import ModelLoadError
from kvtool.kernels import cpu_decode, cpu_gemm, quant
from kvtool.testing.ops import ops_of
from kvtool.testing.tiny import tiny_checkpoint, tiny_runner

pytestmark = pytest.mark.skipif(cpu_gemm._op_works() is not None, reason=f"{cpu_gemm._op_works()}")


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 100])
def test_packed_product_equals_the_reference_at_any_row_count(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    packed = cpu_gemm.pack(weight)
    for x in (torch.randn(rows, 64, generator=gen), torch.randn(1, rows, 64, generator=gen),
              torch.randn(64, rows, generator=gen).t()):  # 2-D, 3-D and a transposed (strided) input
        for b in (None, bias):
            got = cpu_gemm.packed_linear(x, packed, b)
            want = cpu_gemm.packed_linear_reference(x, packed, b)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_packed_product_runs_onednn_and_falls_back_where_it_cannot():
    weight = torch.randn(32, 16)
    packed = cpu_gemm.pack(weight)
    x = torch.randn(4, 16)
    assert "mkldnn::_linear_pointwise" in ops_of(lambda: cpu_gemm.packed_linear(x, packed))
    x.requires_grad_(True)  # an input that needs a gradient takes F.linear over the dense values
    assert "mkldnn::_linear_pointwise" not in ops_of(lambda: cpu_gemm.packed_linear(x, packed))
    cpu_gemm.packed_linear(x, packed).sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0).expand(4, 16))


def test_what_cannot_be_packed_says_why(monkeypatch):
    assert "fp32" in cpu_gemm.unsupported(torch.randn(8, 8).bfloat16())
    assert "2-D" in cpu_gemm.unsupported(torch.randn(8))
    with pytest.raises(ValueError, match="fp32"):
        cpu_gemm.pack(torch.randn(8, 8).half())
    monkeypatch.setenv(cpu_gemm.ENV, "0")
    assert cpu_gemm.unsupported(torch.randn(8, 8)) == f"{cpu_gemm.ENV}=0"
    monkeypatch.setenv(cpu_gemm.ENV, "yes")
    with pytest.raises(ValueError, match="KVTOOL_CPU_GEMM must be 0, 1 or unset; got 'yes'"):
        cpu_gemm.unsupported(torch.randn(8, 8))
    monkeypatch.setattr(cpu_gemm.platform, "machine", lambda: "arm64")
    monkeypatch.delenv(cpu_gemm.ENV)
    assert "x86_64 only (this is arm64" in cpu_gemm.unsupported(torch.randn(8, 8))
    monkeypatch.setenv(cpu_gemm.ENV, "1")
    assert cpu_gemm.unsupported(torch.randn(8, 8)) is None


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def pair(request, tmp_path_factory):
    """(packed runner keeping its dense copies, plain runner) of one tiny family, same checkpoint."""
    folder = tmp_path_factory.mktemp(request.param)
    tiny_checkpoint(request.param, folder)
    packed = tiny_runner(request.param, folder, dense_copies=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu_gemm.ENV, "0")
        plain = tiny_runner(request.param, folder)
    return packed, plain


def test_cpu_fp32_runners_load_packed_and_the_env_switch_keeps_them_plain(pair):
    packed, plain = pair
    assert packed.cpu_gemm_packed and not plain.cpu_gemm_packed
    assert packed.weights == plain.weights == "dense" and packed.precision == "float32"
    layer = packed.model.layers[0]
    assert isinstance(layer.self_attn._wqkv, cpu_gemm.PackedWeight)
    assert isinstance(layer.mlp.down_proj, cpu_gemm.PackedLinear)
    # the HF-named parameters stay views of the dense values the packed copies were made from
    assert layer.self_attn.q_proj.weight.data_ptr() == layer.self_attn._wqkv.dense.data_ptr()
    assert layer.mlp.down_proj.weight.data_ptr() == layer.mlp.down_proj.packed.dense.data_ptr()
    assert packed.decode_weight_bytes() == plain.decode_weight_bytes()
    assert packed.pack_cpu_gemm() is None and packed.model.layers[0] is layer  # packing twice is a no-op


def test_packed_runner_matches_the_plain_one(pair):
    packed, plain = pair
    ids = torch.randint(0, packed.spec.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    caches = packed.new_cache(), plain.new_cache()
    got, want = packed.prefill(ids, caches[0], logits="all"), plain.prefill(ids, caches[1], logits="all")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for token in (3, 17, 5):
        got, want = packed(torch.tensor([token]), caches[0]), plain(torch.tensor([token]), caches[1])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    step = lambda: packed(torch.tensor([7]), packed.new_cache())  # noqa: E731
    assert "aten::mm" not in ops_of(step)  # the C++ decode ops' gemv where they build (kvtool.kernels.cpu_decode)
    packed.use_cpu_decode(False)
    try:  # the reference forward's products
        assert "mkldnn::_linear_pointwise" in ops_of(step) and "aten::mm" not in ops_of(step)
    finally:
        packed.use_cpu_decode(True)


def test_new_weights_loaded_by_state_dict_reach_the_packed_copies(pair):
    packed, plain = pair
    ids = torch.arange(1, 12)
    before = packed.prefill(ids, packed.new_cache())
    state = {k: v * 1.5 if k.endswith("proj.weight") else v for k, v in plain.state_dict().items()}
    try:
        packed.load_state_dict(state)
        plain.load_state_dict(state)
        after = packed.prefill(ids, packed.new_cache())
        assert not torch.allclose(after, before, atol=1e-3)
        torch.testing.assert_close(after, plain.prefill(ids, plain.new_cache()), atol=1e-4, rtol=1e-4)
    finally:  # the module-scoped pair goes back to the checkpoint's weights
        state = {k: v / 1.5 if k.endswith("proj.weight") else v for k, v in plain.state_dict().items()}
        packed.load_state_dict(state)
        plain.load_state_dict(state)


def test_int4_runners_pack_only_their_wide_products_and_packed_runners_refuse_int4(tmp_path, monkeypatch):
    tiny_checkpoint("llama", tmp_path)
    int4 = tiny_runner("llama", tmp_path, weights="int4")
    assert int4.pack_cpu_gemm() == "the projections are int4"
    wqkv = int4.model.layers[0].self_attn._wqkv
    half = cpu_gemm._op_works(torch.bfloat16) is None  # then the copy for many rows is oneDNN's bf16 one
    assert wqkv.wide.half == half and int4._head_packed.half == half
    most = quant.BF16_WIDE_MAX_ROWS if half else quant.MAX_ROWS  # where gemv_q4 is faster
    few, many = torch.randn(1, most, wqkv.dense.shape[1]), torch.randn(1, most + 1, wqkv.dense.shape[1])
    assert "mkldnn::_linear_pointwise" not in ops_of(lambda: quant.int4_linear(few, wqkv))  # the int4 kernel
    assert "mkldnn::_linear_pointwise" in ops_of(lambda: quant.int4_linear(many, wqkv))
    tol = 2e-2 if half else 1e-4
    torch.testing.assert_close(quant.int4_linear(many, wqkv), quant.int4_linear_reference(many, wqkv),
                               atol=tol, rtol=tol)
    h = torch.randn(12, int4.spec.hidden_size)
    want = torch.nn.functional.linear(h, int4.output_weight)
    torch.testing.assert_close(int4.head(h), want, atol=tol * want.abs().max().item(), rtol=tol)
    assert torch.equal(int4.output_weight, int4.model.embed_tokens.weight if int4.spec.tie_word_embeddings
                       else int4.lm_head.weight)  # the fp32 head the top logits are recomputed from
    with pytest.raises(ValueError, match="before pack_cpu_gemm"):
        tiny_runner("llama", tmp_path).quantize_int4()
    monkeypatch.setenv(cpu_gemm.ENV, "yes")
    with pytest.raises(ModelLoadError, match="KVTOOL_CPU_GEMM must be 0, 1 or unset"):
        tiny_runner("llama", tmp_path)


def test_the_real_model_runs_its_projections_and_head_through_onednn(smollm2, smollm2_hf):
    from kvtool.cli.info import describe

    runner = smollm2.runner
    assert runner.cpu_gemm_packed and describe(smollm2)["matmuls"] == "oneDNN packed"
    ids = smollm2.encode("The capital of France is")
    assert {"mkldnn::_linear_pointwise"} <= ops_of(lambda: runner.prefill(ids, runner.new_cache()))
    assert "aten::mm" not in ops_of(lambda: runner.prefill(ids, runner.new_cache()))
    got = runner.prefill(ids, runner.new_cache())[0]
    want = smollm2_hf(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(got.log_softmax(-1), want.log_softmax(-1), atol=1e-3, rtol=0)


def test_a_real_model_loaded_unpacked_holds_one_copy_and_matches_the_packed_one(smollm2):
    """load(packed=False), as the vLLM connector loads kvtool's model: dense weights only, the same logits."""
    from kvtool.models.loading import load
    from kvtool.testing.models import smollm2_gguf

    plain = load(str(smollm2_gguf()), device="cpu", dtype="float32", progress=False, packed=False).runner
    assert smollm2.runner.cpu_gemm_packed and not plain.cpu_gemm_packed and not plain._packed_weights()
    ids = smollm2.encode("The capital of France is")
    assert "mkldnn::_linear_pointwise" not in ops_of(lambda: plain.prefill(ids, plain.new_cache()))
    got, want = plain.prefill(ids, plain.new_cache()), smollm2.runner.prefill(ids, smollm2.runner.new_cache())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_packed_weight_whose_layout_gemv_reads_can_drop_its_dense_copy():
    """oneDNN lays fp32 weights out as [N / 64, K, 64] on AVX2 and AVX-512; `blocked` is that view, checked value
    for value, and it stands in for the dense copy exactly. Other shapes keep theirs."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(192, 96, generator=gen)
    packed = cpu_gemm.pack(weight.clone())
    if packed.blocked is None:
        pytest.skip("oneDNN picked another layout on this CPU; the dense copies stay")
    assert torch.equal(packed.blocked, weight.view(3, 64, 96).transpose(1, 2))
    ids = torch.tensor([0, 63, 64, 191, 5])
    assert packed.drop_dense() and packed.held is None
    assert torch.equal(packed.dense, weight) and torch.equal(packed.rows(ids), weight[ids])
    odd = cpu_gemm.pack(torch.randn(100, 96, generator=gen))  # 100 rows: not whole blocks
    assert odd.blocked is None and not odd.drop_dense() and odd.held is not None


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "gemma3"])
def test_loaded_runners_hold_each_packed_weight_once_with_the_same_bits(tmp_path, family):
    """kvtool.load keeps only oneDNN's copy of every projection and of the head (its rows are the tied
    embedding's; Gemma 3 scales its embedding and keeps that table): prefill, decode steps and the values
    made on demand have the bits of a runner that keeps the dense copies, which can still move and load."""
    tiny_checkpoint(family, tmp_path)
    once, copies = tiny_runner(family, tmp_path), tiny_runner(family, tmp_path, dense_copies=True)
    if once.model.layers[0].mlp._wgu.blocked is None:
        pytest.skip("oneDNN picked another layout on this CPU; the dense copies stay")
    assert once.held_once and not copies.held_once
    assert not [k for k in once.state_dict() if k.endswith("proj.weight")]
    assert ("model.embed_tokens.weight" in once.state_dict()) == (family != "qwen3")  # untied, or scaled
    assert "lm_head.weight" not in once.state_dict()
    assert [k for k in copies.state_dict() if k.endswith("proj.weight")]
    for mine, theirs in zip(once._packed_weights(), copies._packed_weights()):
        assert (mine.held is None) != (family == "gemma3" and mine is once._head_packed)
        assert torch.equal(mine.dense, theirs.dense)
    assert torch.equal(once.output_weight, copies.output_weight)
    assert once.decode_weight_bytes() == copies.decode_weight_bytes()
    ids = torch.randint(0, once.spec.vocab_size, (30,), generator=torch.Generator().manual_seed(1))
    caches = once.new_cache(), copies.new_cache()
    assert torch.equal(once.prefill(ids, caches[0], logits="all"), copies.prefill(ids, caches[1], logits="all"))
    for token in (3, 17, 5):
        assert torch.equal(once(torch.tensor([token]), caches[0]), copies(torch.tensor([token]), caches[1]))
    with pytest.raises(ValueError, match="holds its packed weights once"):
        once.to(torch.bfloat16)
    with pytest.raises(ValueError, match="holds its packed weights once"):
        once.load_state_dict(once.state_dict())
    assert copies.to(torch.float64).dtype == torch.float64


bf16_runs = pytest.mark.skipif(cpu_gemm._op_works(torch.bfloat16) is not None,
                               reason=f"{cpu_gemm._op_works(torch.bfloat16)}")


@bf16_runs
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_a_bf16_packed_product_rounds_x_and_its_output_to_bf16(rows):
    """weights="bf16": the weight is held as its bf16 rounding; oneDNN multiplies x rounded to bf16 and rounds the
    product to bf16; bias and residual are added in fp32. `exact_rows` (the head's few rows), with the C++ ops
    loaded: their gemv, in fp32 over the exact weight values."""
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x, residual = torch.randn(rows, 64, generator=gen), torch.randn(rows, 96, generator=gen)
    half = cpu_gemm.pack(weight, torch.bfloat16)
    assert half.half and half.held.dtype == torch.bfloat16 and half.blocked is None and half.nbytes == 96 * 64 * 2
    assert torch.equal(half.dense, weight.bfloat16().float()) and half.dense.dtype == torch.float32
    ids = torch.tensor([0, 95, 7])
    assert torch.equal(half.rows(ids), weight.bfloat16().float()[ids])
    assert half.drop_dense() and half.held is not None  # nothing in fp32 to let go; the bf16 values stay
    if rows <= cpu_decode.GEMV_MAX_ROWS and cpu_decode.unavailable() is None:  # the head's few rows: fp32
        exact = cpu_gemm.packed_linear(x, half, bias, residual, exact_rows=rows)
        torch.testing.assert_close(exact, torch.nn.functional.linear(x, half.dense, bias) + residual)
    got = cpu_gemm.packed_linear(x, half, bias, residual)
    assert got.dtype == torch.float32
    product = torch.nn.functional.linear(x.bfloat16().float(), half.dense)
    # the product was rounded to bf16 (2^-8 of itself at most) before bias and residual joined in fp32
    torch.testing.assert_close(got - bias - residual, product, atol=1e-4, rtol=2 ** -8)
    assert torch.equal(cpu_gemm.packed_linear(x, half), cpu_gemm.packed_linear(x, half).bfloat16().float())


@bf16_runs
def test_a_bf16_product_can_stay_bf16_for_the_next_product():
    """half_out leaves a bare bf16 product in bf16 (the values packed_linear would widen), and a bf16 x goes to
    oneDNN as it is: the gate_up -> silu_mul -> down chain without fp32 copies between."""
    gen = torch.Generator().manual_seed(4)
    weight, x, residual = torch.randn(96, 64, generator=gen), torch.randn(7, 64, generator=gen), torch.randn(7, 96)
    half = cpu_gemm.pack(weight, torch.bfloat16)
    kept = cpu_gemm.packed_linear(x, half, half_out=True)
    assert kept.dtype == torch.bfloat16 and torch.equal(kept.float(), cpu_gemm.packed_linear(x, half))
    assert cpu_gemm.packed_linear(x, half, residual=residual, half_out=True).dtype == torch.float32  # a sum: fp32
    assert torch.equal(cpu_gemm.packed_linear(x.bfloat16(), half, residual=residual),
                       cpu_gemm.packed_linear(x, half, residual=residual))
    dense = cpu_gemm.pack(weight) if cpu_gemm._op_works() is None else None
    if dense is not None:  # an fp32 weight takes fp32 x only; a bf16 one goes through the reference
        assert cpu_gemm.packed_linear(x.bfloat16(), dense).dtype == torch.bfloat16

def _bf16_checkpoint(family: str, folder):
    """A tiny checkpoint whose weights are all bf16 values, so a dense runner holds exactly what a bf16 one does."""
    from safetensors.torch import load_file, save_file

    tiny_checkpoint(family, folder)
    for file in folder.glob("*.safetensors"):
        save_file({k: v.bfloat16().float() for k, v in load_file(str(file)).items()}, str(file),
                  metadata={"format": "pt"})


@bf16_runs
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_bf16_runners_hold_bf16_weights_once_and_follow_the_dense_model(tmp_path, family):
    """kvtool.load(weights="bf16"): each projection and the head held once, in bf16 (oneDNN's copy, and the plain
    bf16 values the head's gemv widens exactly); prefill and decode steps (x rounded to bf16) agree with a dense
    runner on the same values to bf16's rounding, the head of a few rows to fp32's; the runner says so and refuses
    to move or reload."""
    _bf16_checkpoint(family, tmp_path)
    half, dense = tiny_runner(family, tmp_path, weights="bf16"), tiny_runner(family, tmp_path)
    assert half.weights == "bf16" and half.precision == "float32/bf16" and half.held_once
    assert dense.weights == "dense" and dense.precision == "float32"
    assert not [k for k in half.state_dict() if k.endswith("proj.weight") or k == "lm_head.weight"]
    assert all(w.half for w in half._packed_weights())
    assert half.decode_weight_bytes() * 2 == dense.decode_weight_bytes()
    assert torch.equal(half.output_weight, dense.output_weight)
    ids = torch.randint(0, half.spec.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    caches = half.new_cache(), dense.new_cache()
    got, want = half.prefill(ids, caches[0], logits="all"), dense.prefill(ids, caches[1], logits="all")
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    for token in (3, 17, 5):  # decode steps: the projections in bf16 too
        torch.testing.assert_close(half(torch.tensor([token]), caches[0]), dense(torch.tensor([token]), caches[1]),
                                   atol=0.05, rtol=0.05)
    h = torch.randn(2, half.spec.hidden_size, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(half.head(h), dense.head(h), atol=1e-4, rtol=1e-4)  # the head's few rows: fp32
    with pytest.raises(ValueError, match="holds its packed weights once"):
        half.to(torch.float64)
    with pytest.raises(ValueError, match="in bf16"):
        half.load_state_dict(half.state_dict())


def test_bf16_weights_are_refused_off_the_cpu_and_where_onednn_cannot_pack_them(tmp_path, monkeypatch):
    from kvtool.models.loading import check_weights

    with pytest.raises(ModelLoadError, match="bf16 weights run on the CPU only; got device cuda"):
        check_weights("bf16", torch.device("cuda"))
    tiny_checkpoint("qwen3", tmp_path)
    monkeypatch.setenv(cpu_gemm.ENV, "0")
    with pytest.raises(ModelLoadError, match=f"cannot pack .* in bf16: {cpu_gemm.ENV}=0"):
        tiny_runner("qwen3", tmp_path, weights="bf16")


@pytest.fixture(scope="module")
def smollm2_bf16():
    import kvtool
    from kvtool.testing.models import smollm2_gguf

    return kvtool.load(str(smollm2_gguf()), device="cpu", dtype="float32", progress=False, weights="bf16")


@bf16_runs
def test_the_real_model_in_bf16_keeps_the_fp32_models_tokens(smollm2, smollm2_bf16):
    """SmolLM2 with weights="bf16": top-1 agreement with fp32 over 32 greedy decode steps and over one prefill of
    the prompt and those tokens (the bf16 GEMMs), what `kvtool bench decode` reports; half the weight bytes."""
    from kvtool.bench.decode import weights_fidelity
    from kvtool.cli.info import describe

    runner = smollm2_bf16.runner
    assert runner.weights == "bf16" and runner.held_once and runner.forward_path == "cpu-ops"
    assert runner.decode_weight_bytes() * 2 == smollm2.runner.decode_weight_bytes()
    assert describe(smollm2_bf16)["parameters"] == describe(smollm2)["parameters"]
    prompt = smollm2.encode("The three primary colors are")
    fid = weights_fidelity(smollm2.runner, runner, prompt, 32, prefill=True)
    assert fid["top1_agreement"] >= 0.9 and fid["prefill_top1_agreement"] >= 0.9 and fid["kl_mean"] < 0.05
