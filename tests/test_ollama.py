"""Models an Ollama install keeps (kvtool.models.ollama): a blob path is named after its manifest, and
'ollama:NAME[:TAG]' finds the blob; the real SmolLM2 GGUF stands in for a pulled model."""

from __future__ import annotations

import json

import pytest

import kvtool
from kvtool.errors import ModelLoadError
from kvtool.models import ollama
from kvtool.testing.models import smollm2_gguf

pytestmark = pytest.mark.real_model
DIGEST = "6f85a640a97cf2bf5b8e764087b1e83da0fdb51d7c9fab7d0fece9385611df83"


@pytest.fixture
def install(tmp_path, monkeypatch):
    """An Ollama models folder as `ollama pull smollm2:135m` leaves it, plus a user model and a broken manifest."""
    blob = tmp_path / "blobs" / f"sha256-{DIGEST}"
    blob.parent.mkdir()
    blob.symlink_to(smollm2_gguf())
    layers = [{"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64},
              {"mediaType": ollama.MODEL_LAYER, "digest": f"sha256:{DIGEST}", "size": blob.stat().st_size}]
    for registry, namespace, name, tag, body in [
            ("registry.ollama.ai", "library", "smollm2", "135m", {"layers": layers}),
            ("registry.ollama.ai", "someone", "tiny", "latest", {"layers": layers}),
            ("registry.ollama.ai", "library", "broken", "latest", {"layers": layers[:1]})]:
        manifest = tmp_path / "manifests" / registry / namespace / name / tag
        manifest.parent.mkdir(parents=True)
        manifest.write_text(json.dumps({"schemaVersion": 2, **body}))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    return tmp_path, blob


def test_a_blob_is_named_after_its_manifest_and_generates(install):
    root, blob = install
    assert ollama.manifests(root).keys() == {"broken:latest", "smollm2:135m", "someone/tiny:latest"}
    model = kvtool.load(str(blob), progress=False)
    assert model.name == "smollm2:135m"  # the first manifest that lists it
    from kvtool.engine import Engine

    prompt = model.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in Engine(model).generate(prompt, kvtool.SamplingParams(temperature=0, max_tokens=24)).run().text


def test_ollama_names_resolve_to_their_blob(install):
    root, blob = install
    assert ollama.resolve("ollama:smollm2:135m") == (blob, "smollm2:135m")
    assert ollama.resolve("ollama:someone/tiny") == (blob, "someone/tiny:latest")  # tag 'latest' by default
    assert kvtool.load("ollama:smollm2:135m", progress=False).name == "smollm2:135m"
    with pytest.raises(ModelLoadError, match=r"no Ollama model 'qwen3:latest' in .* \(it has: broken:latest, "
                                             r"smollm2:135m, someone/tiny:latest\); pull it with `ollama pull`"):
        kvtool.load("ollama:qwen3")
    with pytest.raises(ModelLoadError, match="lists no model layer"):
        kvtool.load("ollama:broken")
    blob.unlink()
    with pytest.raises(ModelLoadError, match="the model blob .* is missing"):
        kvtool.load("ollama:smollm2:135m")


def test_a_gguf_outside_an_ollama_folder_keeps_its_file_name(tmp_path):
    copy = tmp_path / f"sha256-{DIGEST}"
    copy.symlink_to(smollm2_gguf())
    assert ollama.blob_name(copy) is None  # not in a blobs folder
    assert kvtool.load(str(copy), progress=False).name == copy.name
