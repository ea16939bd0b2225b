"""--weights int4: projections in 4 bits for CPU decode, tested against the dense model they stand for."""

import json
import re

import pytest
import torch

from kvtool.bench.decode import weights_fidelity
from kvtool.errors import ModelLoadError
from kvtool.kernels import cpu_decode, cpu_gemm, quant
from kvtool.kernels.quant import BF16_WIDE_MAX_ROWS, MAX_ROWS
from kvtool.kernels.quant import Int4Linear, Int4Weight
from kvtool.models.loading import check_weights
from kvtool.testing.tiny import tiny_checkpoint, tiny_runner

FAMILIES = ["qwen3", "qwen2", "llama"]


def random_ids(runner, n, seed=0):
    return torch.randint(0, runner.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(int4 runner, dense runner holding the int4 runner's grid values) of one tiny family."""
    folder = tmp_path_factory.mktemp(request.param)
    tiny_checkpoint(request.param, folder)
    packed = tiny_runner(request.param, folder, weights="int4", dense_copies=True)
    dense = tiny_runner(request.param, folder, dense_copies=True)
    dense.load_state_dict(packed.state_dict())
    return packed, dense


def wide_in_bf16(runner) -> bool:
    """Whether the runner's products of many rows run on oneDNN's bf16 GEMM (where this CPU has it)."""
    return runner.model.layers[0].mlp._wgu.wide is not None and runner.model.layers[0].mlp._wgu.wide.half


def test_every_projection_is_packed_and_the_hf_names_stay_views_of_it(pair):
    packed, _ = pair
    assert wide_in_bf16(packed) == (cpu_gemm._op_works(torch.bfloat16) is None)
    assert packed.weights == "int4" and packed.precision == "float32/int4" + "+bf16" * wide_in_bf16(packed)
    for layer in packed.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn._wqkv, Int4Weight) and isinstance(mlp._wgu, Int4Weight)
        assert isinstance(attn.o_proj, Int4Linear) and isinstance(mlp.down_proj, Int4Linear)
        assert attn.q_proj.weight.data_ptr() == attn._wqkv.dense.data_ptr()
        assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp._wgu.dense.untyped_storage().data_ptr()
    assert not isinstance(packed.output_weight, Int4Weight)  # the head stays dense, with a bf16 copy for decode
    if packed._head_q8 is not None:  # where the C++ ops run, decode's first pass reads an 8-bit copy
        assert packed._head_bf16 is None and packed._head_q8.codes.dtype == torch.int8
    else:
        assert packed._head_bf16.dtype == torch.bfloat16 and torch.equal(packed._head_bf16.float(),
                                                                          packed.output_weight.bfloat16().float())
    names = set(dict(packed.named_parameters()))
    assert "model.layers.0.self_attn.o_proj.weight" in names and "model.layers.0.mlp.down_proj.weight" in names


def test_decode_weight_bytes_count_what_a_step_reads(pair):
    packed, dense = pair
    s = dense.spec
    d = s.head_dim
    per_layer = s.hidden_size * (s.num_heads * d + 2 * s.num_kv_heads * d) + s.num_heads * d * s.hidden_size \
        + 3 * s.hidden_size * s.intermediate_size
    assert dense.decode_weight_bytes() == 4 * (s.num_layers * per_layer + s.vocab_size * s.hidden_size)
    # half a byte a weight plus a bf16 scale and zero (4 bytes) per 32: 5/8 of a byte; the head's first pass in 8
    # bits plus an fp32 scale per 32 (9/8 of a byte) where the C++ ops run, else in bf16
    head = s.vocab_size * s.hidden_size * (9 / 8 if packed._head_q8 is not None else 2)
    assert packed.decode_weight_bytes() == s.num_layers * per_layer * 5 // 8 + head


def test_prefill_is_the_dense_model_of_the_grid_values(pair):
    """Exactly with an fp32 copy for the products of many rows; within bf16's rounding with a bf16 one."""
    packed, dense = pair
    ids = random_ids(packed, 40)
    got = packed.prefill(ids, packed.new_cache(), logits="all")
    want = dense.prefill(ids, dense.new_cache(), logits="all")
    if wide_in_bf16(packed):
        assert not torch.equal(got, want) and (got - want).abs().max() <= 0.03 * want.abs().max()
    else:
        assert torch.equal(got, want)


def test_without_onednn_bf16_the_wide_products_are_the_grid_values_exactly(tmp_path, monkeypatch):
    """On CPUs whose oneDNN has no bf16 GEMM (AVX2) the copy for many rows is fp32: prefill is the dense grid model."""
    monkeypatch.setattr(cpu_gemm, "_op_works", lambda dtype=torch.float32: None if dtype == torch.float32 else "no")
    tiny_checkpoint("qwen2", tmp_path)
    packed = tiny_runner("qwen2", tmp_path, weights="int4", dense_copies=True)
    dense = tiny_runner("qwen2", tmp_path, dense_copies=True)
    dense.load_state_dict(packed.state_dict())
    assert not wide_in_bf16(packed) and packed.precision == "float32/int4"
    wqkv = packed.model.layers[0].self_attn._wqkv
    assert wqkv.wide.dense.data_ptr() == wqkv.dense.data_ptr()  # the fp32 copy is the dense values themselves
    ids = random_ids(packed, 40)
    assert torch.equal(packed.prefill(ids, packed.new_cache(), logits="all"),
                       dense.prefill(ids, dense.new_cache(), logits="all"))


def test_decode_steps_run_the_int4_kernel_close_to_the_dense_grid_model(pair):
    packed, dense = pair
    ids = random_ids(packed, 20, seed=1)
    caches = packed.new_cache(), dense.new_cache()
    packed.prefill(ids, caches[0])
    dense.prefill(ids, caches[1])
    for token in random_ids(packed, 8, seed=2):
        got, want = packed(torch.tensor([token]), caches[0]), dense(torch.tensor([token]), caches[1])
        assert not torch.equal(got, want)  # bf16 activations: the kernel ran
        assert (got - want).abs().max() <= 0.03 * want.abs().max()


@pytest.mark.parametrize("half", [True, False], ids=["bf16-wide", "fp32-wide"])
def test_held_once_the_codes_stand_for_the_dense_values(tmp_path, monkeypatch, half):
    """kvtool.load keeps no dense fp32 projections beside an int4 runner's oneDNN copies: `dense` is made from the
    codes bit for bit, and the runner computes exactly what one holding its dense copies does."""
    if not half:
        monkeypatch.setattr(cpu_gemm, "_op_works", lambda dtype=torch.float32: None if dtype == torch.float32 else "no")
    elif cpu_gemm._op_works(torch.bfloat16) is not None:
        pytest.skip("oneDNN's bf16 GEMM does not run on this CPU")
    tiny_checkpoint("qwen3", tmp_path)
    once = tiny_runner("qwen3", tmp_path, weights="int4")
    copies = tiny_runner("qwen3", tmp_path, weights="int4", dense_copies=True)
    assert once.held_once and not copies.held_once and wide_in_bf16(once) == half
    for a, b in zip(once.model.layers, copies.model.layers):
        assert a.self_attn._wqkv.held is None and a.mlp.down_proj.packed.held is None
        assert a.self_attn.q_proj.weight is None and a.mlp.down_proj.weight is None  # no HF-named fp32 copies
        assert torch.equal(a.mlp._wgu.dense, b.mlp._wgu.dense) and torch.equal(a.self_attn._wqkv.dense,
                                                                                 b.self_attn._wqkv.dense)
    ids = random_ids(once, 30, seed=4)
    caches = once.new_cache(), copies.new_cache()
    assert torch.equal(once.prefill(ids, caches[0], logits="all"), copies.prefill(ids, caches[1], logits="all"))
    for token in random_ids(once, 4, seed=5):
        assert torch.equal(once(torch.tensor([token]), caches[0]), copies(torch.tensor([token]), caches[1]))
    with pytest.raises(ValueError, match="cannot be moved"):
        once.to(torch.float64)


def test_packing_twice_is_a_no_op_and_unfused_runners_are_refused(tmp_path, monkeypatch):
    tiny_checkpoint("llama", tmp_path)
    runner = tiny_runner("llama", tmp_path, weights="int4")
    first = runner.model.layers[0].self_attn._wqkv
    runner.quantize_int4()
    assert runner.model.layers[0].self_attn._wqkv is first
    monkeypatch.setenv("KVTOOL_CPU_GEMM", "0")  # a runner loaded dense on the CPU is packed for oneDNN
    unfused = tiny_runner("llama", tmp_path)
    unfused.model.layers[0].self_attn._wqkv = None
    with pytest.raises(ValueError, match="call fuse"):
        unfused.quantize_int4()
    assert unfused.weights == "dense" and not isinstance(unfused.model.layers[1].mlp._wgu, Int4Weight)


def test_bad_weights_choices_are_clear_errors():
    with pytest.raises(ModelLoadError, match="unknown weights 'int3'; use one of dense, int4"):
        check_weights("int3", torch.device("cpu"))
    with pytest.raises(ModelLoadError, match="CPU only; got device cuda"):
        check_weights("int4", torch.device("cuda"))
    check_weights("int4", torch.device("cpu"))
    with pytest.raises(ModelLoadError, match=r"forward 'fast' on device cpu: use one of auto, reference, cpu-ops \("):
        check_weights("dense", torch.device("cpu"), "fast")
    with pytest.raises(ModelLoadError, match=r"forward 'cpu-ops' on device cuda: .*\(cpu-ops: the CPU only\)"):
        check_weights("dense", torch.device("cuda"), "cpu-ops")


@pytest.fixture(scope="module")
def smollm2_int4():
    import kvtool
    from kvtool.testing.models import smollm2_gguf

    return kvtool.load(str(smollm2_gguf()), device="cpu", dtype="float32", progress=False, weights="int4")


@pytest.mark.real_model
def test_smollm2_int4_stays_close_to_the_dense_model(smollm2, smollm2_int4):
    prompt = smollm2.encode_chat([{"role": "user", "content": "Name three rivers in Europe."}])
    fid = weights_fidelity(smollm2.runner, smollm2_int4.runner, prompt, 32, prefill=True)
    assert fid["top1_agreement"] >= 0.9 and fid["kl_mean"] <= 0.005, fid
    assert fid["prefill_top1_agreement"] >= 0.9, fid  # the products of many rows (oneDNN's copy, bf16 on AMX)
    assert fid["kl_mean"] > 0  # the packed model is not the dense one


@pytest.mark.real_model
def test_the_heads_8_bit_pass_holds_smollm2s_q8_0_head_and_its_top_logits_are_exact(smollm2_int4):
    """The GGUF's head is Q8_0 (its values converted through fp16), so its 8-bit copy is within 2^-11 of each value
    where bf16 is off by up to 2^-9; the first pass reads it (half the bytes of bf16) and the EXACT_TOP highest
    logits are the dense head's."""
    runner = smollm2_int4.runner
    small, dense = runner._head_q8, runner.output_weight
    assert small is not None and runner._head_bf16 is None and small.nbytes < dense.numel() * 2 * 0.6  # bf16's
    grid = (small.codes.float().reshape(dense.shape[0], -1, 32) * small.scale[..., None]).reshape(dense.shape)
    assert ((grid - dense).abs() <= dense.abs() * 2**-11).all()
    assert ((dense.bfloat16().float() - dense).abs() > dense.abs() * 2**-11).any()
    h = torch.randn(2, dense.shape[1], generator=torch.Generator().manual_seed(0))
    logits, exact = runner.head(h), h @ dense.float().T
    top = exact.topk(8).indices
    torch.testing.assert_close(logits.gather(-1, top), exact.gather(-1, top), atol=1e-5, rtol=1e-6)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    bf16 = h @ dense.bfloat16().float().T  # the former first pass's weights: further off than the 8-bit copy
    assert (logits - exact).abs().max() < (bf16 - exact).abs().max() / 2


@pytest.mark.real_model
def test_blocks_and_fingerprints_tell_int4_from_dense(smollm2, smollm2_int4):
    from kvtool.errors import CacheFormatError
    from kvtool.skills.block import compile_ids, setup_of

    dense_setup, packed_setup = setup_of(smollm2), setup_of(smollm2_int4)
    int4 = smollm2_int4.runner.precision
    assert dense_setup["dtype"] == "float32" and packed_setup["dtype"] == int4 and int4.startswith("float32/int4")
    block = compile_ids(smollm2.runner, smollm2.encode_rendered("A short skill."), dense_setup, "short")
    with pytest.raises(CacheFormatError, match=re.escape(f"dtype: block has 'float32', this model has '{int4}'")):
        block.check_setup(packed_setup)


@pytest.mark.real_model
def test_cli_info_and_generate_take_weights_int4(capsys):
    from kvtool.cli import main
    from kvtool.testing.models import smollm2_gguf

    assert main(["info", "--model", str(smollm2_gguf()), "--weights", "int4", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["weights"] == "int4" and 90e6 < info["decode_weight_bytes"] < 150e6  # dense: 538 MB
    kernel = "C++ gemv_q4" if cpu_decode.unavailable() is None else "torch's int4 kernel"
    half = cpu_gemm._op_works(torch.bfloat16) is None
    most = BF16_WIDE_MAX_ROWS if half else MAX_ROWS
    assert info["matmuls"] == f"int4 ({kernel}) up to {most} rows, oneDNN packed{' bf16' * half} above"
    assert main(["info", "--model", str(smollm2_gguf()), "--weights", "int4", "--forward", "reference", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["decode_steps"] == "reference forward"
    assert main(["generate", "Rivers of Europe:", "--model", str(smollm2_gguf()), "--weights", "int4",
                 "--max-tokens", "8", "--temperature", "0"]) == 0
    assert "decode 8 tok" in capsys.readouterr().err


@pytest.mark.real_model
def test_server_runs_int4_and_says_so(smollm2_int4):
    import httpx

    from kvtool.serving import ServerConfig, create_app
    from kvtool.serving.server import BackgroundServer

    srv = BackgroundServer(create_app(smollm2_int4, server_config=ServerConfig())).start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=120) as client:
            assert client.get("/v1/models").json()["data"][0]["precision"].startswith("float32/int4")
            r = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0, "max_tokens": 24}).json()
            assert "Paris" in r["choices"][0]["message"]["content"] and r["usage"]["completion_tokens"] > 3
    finally:
        srv.stop()
