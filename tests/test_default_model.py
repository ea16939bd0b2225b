"""Which model the main command runs when the user names none: Qwen3-0.6B when the local Hugging Face
cache has it (or the hub is reachable), else the embedded SmolLM2, said in one line with the reason."""

from __future__ import annotations

import pytest

from kvtool.config import DEFAULT_MODEL
from kvtool.models.embedded import smollm2_path
from kvtool.models.resolve import default_model, resolve_model_arg


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, and no network: the hub refuses every call, as it does offline."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path


def test_offline_without_qwen3_falls_back_to_the_embedded_smollm2(hub_cache):
    said = []
    choice = resolve_model_arg(None, announce=said.append)
    assert choice == str(smollm2_path()) and choice.endswith(".gguf")
    assert len(said) == 1 and "\n" not in said[0]
    assert said[0].startswith("kvtool: using the embedded SmolLM2-135M-Instruct (SmolLM2-135M-Instruct.Q4_1.gguf) "
                              f"because {DEFAULT_MODEL} is not cached and the hub is unreachable (")
    from kvtool.errors import ModelLoadError
    from kvtool.models.loading import hub_folder

    with pytest.raises(ModelLoadError) as hub:
        hub_folder(DEFAULT_MODEL)
    reason = str(hub.value).split(": ", 1)[1]  # the hub's reason: its first sentence, whole words
    assert said[0].endswith(f"({reason.split('. ')[0]})") and len(said[0]) < 400


def test_qwen3_in_the_local_cache_is_the_default(hub_cache):
    repo = hub_cache / ("models--" + DEFAULT_MODEL.replace("/", "--"))
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    assert default_model() == (DEFAULT_MODEL, f"using {DEFAULT_MODEL} from the local Hugging Face cache")


def test_a_named_model_is_used_as_given_and_nothing_is_said(hub_cache):
    said = []
    assert resolve_model_arg("some/model", announce=said.append) == "some/model" and said == []
