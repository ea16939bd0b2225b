"""kvtool's prompt ids against vLLM's own `prompt_token_ids` on every real model (SmolLM2, Qwen2.5, Gemma 3):
vLLM's `LLM.generate` on raw text (the tokenizer's special tokens: Gemma 3's <bos>) and `LLM.chat` on messages
(what the template writes, one <bos>), each model's converted folder loaded by vLLM in a child process with
kvtool's engine settings. Skips where vLLM is not installed (scripts/test.sh runs it in .venv-vllm)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real_model

RAW = ["The capital of France is", " two  spaces, then\n\na blank line", "naïve café 日本"]
CHATS = [[{"role": "user", "content": "Name three colours."}],
         [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"}],
         [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
          {"role": "user", "content": "What is 2+2?"}]]

# Runs in a child: vLLM changes process-wide thread settings. argv[1]: {"folder", "model_type", "raw", "chats"}; the
# last line printed: {"raw": [ids...], "chat": [ids...]}, vLLM's prompt_token_ids.
CHILD = """
import json, sys
from kvtool.integrations.vllm.settings import apply_env_defaults, engine_kwargs
apply_env_defaults()
from vllm import LLM, SamplingParams
job = json.loads(sys.argv[1])
llm = LLM(**engine_kwargs(job["folder"], "auto", False, {"max_model_len": 1024}, job["model_type"]))
one = SamplingParams(max_tokens=1, temperature=0)
raw = [list(o.prompt_token_ids) for o in llm.generate(job["raw"], one, use_tqdm=False)]
chat = [list(o.prompt_token_ids) for o in llm.chat(job["chats"], one, use_tqdm=False, add_generation_prompt=True)]
print(json.dumps({"raw": raw, "chat": chat}))
"""


@pytest.fixture(scope="module", autouse=True)
def needs_vllm():
    from kvtool.integrations.vllm import available

    if not available():
        pytest.skip("vLLM is not installed (pip install -e '.[vllm]'; scripts/setup.sh --test installs it)")


@pytest.mark.parametrize("gguf", ["smollm2_gguf", "qwen25_gguf", "gemma3_gguf"])
def test_prompt_ids_are_vllms(gguf):
    from kvtool.models.loading import load_text
    from kvtool.testing import models

    model = load_text(str(getattr(models, gguf)()))  # the tokenizer and template only; vLLM loads the weights
    job = {"folder": str(model.folder), "model_type": model.hf_config.model_type, "raw": RAW, "chats": CHATS}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert [model.encode(text) for text in RAW] == theirs["raw"]
    assert [model.encode_chat(messages) for messages in CHATS] == theirs["chat"]
    bos = model.tokenizer.bos_token_id
    if gguf == "gemma3_gguf":  # the case that differs: raw text gets the tokenizer's <bos>, chat the template's
        assert all(ids[0] == bos and ids.count(bos) == 1 for ids in theirs["raw"] + theirs["chat"])
