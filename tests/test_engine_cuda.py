"""The engine on CUDA runs the same scheduler and ModelRunner.run as on the CPU: its tokens and logprobs are the CPU
reference forward's on the same fp32 weights, and seeded draws repeat."""

import pytest

from kvtool import SamplingParams
from kvtool.config import EngineConfig
from kvtool.engine import Engine
from kvtool.testing.tiny import tiny_checkpoint

PROMPTS = [list(range(3, 40)), list(range(60, 71)), [5]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=2)


def engine_outputs(engine: Engine) -> dict:
    """Greedy tokens of a batch (n=2 choices of each prompt, sharing its prefill), one stream's logprobs, and a
    seeded top-p draw made twice."""
    events = list(engine.generate(PROMPTS[0], GREEDY))
    seeded = SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=16)
    return {"batch": [g.token_ids for g in engine.generate_batch(PROMPTS, GREEDY, n=2)],
            "logprobs": [e.logprob for e in events], "top": [[t for t, _ in e.top_logprobs] for e in events],
            "seeded": [engine.generate(PROMPTS[1], seeded).run().token_ids for _ in range(2)]}


def outputs_on(folder, device: str, config: EngineConfig) -> dict:
    from kvtool.bench.loading import from_checkpoint

    with from_checkpoint(folder, "tiny-qwen3", device=device, dtype="float32") as bm:
        return engine_outputs(Engine(bm.model, config))


@pytest.mark.gpu
def test_engine_on_cuda_gives_the_cpu_reference_tokens(tmp_path):
    tiny_checkpoint("qwen3", tmp_path)
    want = outputs_on(tmp_path, "cpu", EngineConfig(forward="reference"))
    got = outputs_on(tmp_path, "cuda", EngineConfig())
    assert got["batch"] == want["batch"] and got["top"] == want["top"]
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)
    assert got["seeded"][0] == got["seeded"][1]  # (CUDA's generator draws other numbers than the CPU's)
