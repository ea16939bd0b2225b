"""Reference attention on SmolLM2 (real GGUF weights) against transformers' eager attention."""

import numpy as np
import pytest
import torch

from kvtool.viz.heatmap import compute_heatmap, plot_heatmap
from kvtool.viz.inputs import build_tokens, prompt_ids
from kvtool.viz.probs import attention_rows
from kvtool.viz.sink import plot_sink, sink_stats
from kvtool.viz.tokens import find_spans

pytestmark = pytest.mark.real_model
QUESTION = "Tell me about the history of Paris, its bridges and its markets."


def eager_attentions(hf, ids):
    previous = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = hf(torch.tensor([ids]), output_attentions=True)
    finally:
        hf.set_attn_implementation(previous)
    return torch.stack([a[0] for a in out.attentions]).float()  # [L, H, T, T]


@pytest.fixture(scope="module")
def chat_case(smollm2, smollm2_hf):
    ids = prompt_ids(smollm2, QUESTION, chat=True)
    return ids, eager_attentions(smollm2_hf, ids)


def test_probabilities_match_transformers_eager(smollm2, chat_case):
    ids, ref = chat_case
    rows = [0, 5, len(ids) // 2, len(ids) - 1]
    ours = attention_rows(smollm2, ids, range(smollm2.spec.num_layers), range(smollm2.spec.num_heads), rows)
    diff = (ours - ref[:, :, rows]).abs().max().item()
    assert diff <= 1e-4, diff


def test_sink_json_matches_transformers_and_late_layers_sink(smollm2, chat_case, tmp_path):
    ids, ref = chat_case
    res = sink_stats(smollm2, build_tokens(smollm2, ids), k=4, skip=4)
    record = res.to_json()
    ref_t0 = ref[:, :, 4:, 0].mean(-1)  # [L, H]
    ref_k = ref[:, :, 4:, :4].sum(-1).mean(-1)
    ours_t0 = torch.tensor([layer["token0_per_head"] for layer in record["layers"]])
    ours_k = torch.tensor([layer["first_k_per_head"] for layer in record["layers"]])
    assert (ours_t0 - ref_t0).abs().max() <= 1e-4 and (ours_k - ref_k).abs().max() <= 1e-4
    late = [layer["token0"] for layer in record["layers"] if layer["layer"] in record["late_layers"]]
    assert record["late_layers"] == list(range(20, 30))
    assert sum(v >= 0.5 for v in late) > len(late) / 2, late
    assert plot_sink(res, tmp_path / "sink.png").stat().st_size > 10_000


def test_block_pooled_heatmap_equals_pooled_dense(smollm2, tmp_path):
    tokens = build_tokens(smollm2, prompt_ids(smollm2, QUESTION * 4, chat=True))
    n = len(tokens)
    dense = compute_heatmap(smollm2, tokens, [3, 25], list(range(9)), "mean", max_cells=n)
    pooled = compute_heatmap(smollm2, tokens, [3, 25], list(range(9)), "mean", max_cells=n // 5)
    assert dense.block == 1 and pooled.block >= 5
    b = pooled.block
    d = np.nan_to_num(dense.values)
    pad = -n % b
    d = np.pad(d, ((0, 0), (0, pad), (0, pad)))
    blocks = d.reshape(2, -1, b, d.shape[2] // b, b).sum(-1)  # key mass per block
    counts = np.minimum(b, n - np.arange(blocks.shape[1]) * b)
    expect = blocks.sum(2) / counts[None, :, None]
    assert np.allclose(np.nan_to_num(pooled.values), expect, atol=1e-5)
    assert np.allclose(np.nansum(pooled.values, -1), 1.0, atol=1e-4)  # every row's mass is kept
    assert np.isnan(pooled.values[0, 0, -1])  # the future is masked, not zero
    for name, scale in (("h.png", "linear"), ("h.svg", "log")):
        out = plot_heatmap(pooled, tmp_path / name, scale, highlight=find_spans(tokens, "text:Paris"))
        assert out.stat().st_size > 5_000


def test_row_blocks_split_to_the_byte_budget_give_the_same_probabilities(smollm2):
    from kvtool.viz.probs import attention_pass

    ids = prompt_ids(smollm2, QUESTION, chat=True)
    got = {}

    def collect(key):
        def consume(layer, part, probs):
            got.setdefault(key, []).append((part.tolist(), probs.clone()))
        return consume

    attention_pass(smollm2, ids, [2], [0, 4], None, collect("whole"), chunk=16)
    attention_pass(smollm2, ids, [2], [0, 4], None, collect("split"), chunk=16, budget_bytes=1)
    assert all(len(rows) == 1 for rows, _ in got["split"])  # one row per block at a 1-byte budget
    def dense(key):  # chunks see keys up to their end; pad each to the full length
        return torch.cat([torch.nn.functional.pad(p, (0, len(ids) - p.shape[-1])) for _, p in got[key]], dim=1)

    whole, split = dense("whole"), dense("split")
    assert whole.shape == (2, len(ids), len(ids)) and torch.allclose(whole, split, atol=1e-6)
