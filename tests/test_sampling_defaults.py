"""A model's sampling defaults: the request's value, then the model's file, then its card, then llama-server's
(kvtool.models.sampling_defaults); `none` gives the plain ones. Folders stand in for models here; the real
models' defaults are checked in tests/serving/test_sampling_defaults_served.py."""

from __future__ import annotations

import json

import pytest

from kvtool.config import MODEL_DEFAULTS, EngineConfig, SamplingDefaults, SamplingParams
from kvtool.errors import InvalidParameterError, ModelLoadError
from kvtool.models.sampling_defaults import LLAMA_SERVER, sampling_defaults

QWEN_FILE = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "repetition_penalty": 1.05,
             "temperature": 0.7, "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0"}


def hf_folder(tmp_path, name="model", **files):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(files.pop("config", {"model_type": "llama"})))
    for file, data in files.items():
        (folder / f"{file}.json").write_text(json.dumps(data))
    return folder


def gguf_folder(tmp_path, sampling: dict, **general):
    """A folder as gguf.converted_folder leaves it: its record names what the GGUF's metadata said."""
    folder = hf_folder(tmp_path, "converted")
    (folder / "kvtool_source.json").write_text(json.dumps({"gguf": str(tmp_path / "gone.gguf"), "architecture": "x",
                                                           "tensors": 1, "sampling": sampling, **general}))
    return folder


def test_unset_fields_take_the_model_defaults_and_set_ones_stay():
    model = SamplingDefaults(temperature=0.2, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
                             presence_penalty=0.5, frequency_penalty=-0.5, source="x")
    unset = SamplingParams(max_tokens=4)
    assert [getattr(unset, name) for name in MODEL_DEFAULTS] == [None] * 7
    got = unset.with_defaults(model)
    assert [getattr(got, name) for name in MODEL_DEFAULTS] == [0.2, 0.9, 20, 0.05, 1.1, 0.5, -0.5]
    mine = SamplingParams(temperature=0.0, top_p=1.0, top_k=0).with_defaults(model)
    assert (mine.temperature, mine.top_p, mine.top_k, mine.min_p) == (0.0, 1.0, 0, 0.05) and mine.greedy
    plain = SamplingParams().with_defaults()  # no model: the plain values of SamplingDefaults()
    assert [getattr(plain, name) for name in MODEL_DEFAULTS] == [1.0, 1.0, 0, 0.0, 1.0, 0.0, 0.0]


def test_validate_takes_unset_and_still_refuses_bad_values():
    assert SamplingParams().validate().temperature is None
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_k=-1), dict(min_p=2.0), dict(repetition_penalty=0),
                dict(presence_penalty=3), dict(temperature="hot")):
        with pytest.raises(InvalidParameterError, match=f"invalid sampling parameter {next(iter(bad))}="):
            SamplingParams(**bad).validate()


def test_describe_names_the_temperature_and_what_is_not_plain():
    assert SamplingDefaults().describe() == "temperature 1 (none)"
    assert LLAMA_SERVER.describe() == "temperature 0.8, top_p 0.95, top_k 40, min_p 0.05 (llama-server defaults)"


def test_generation_config_json_decides_and_says_so(tmp_path):
    folder = hf_folder(tmp_path, "SmolLM2-135M-Instruct", generation_config=QWEN_FILE)  # the file wins over a card
    assert sampling_defaults(folder, folder.name) == SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, repetition_penalty=1.05, source="generation_config.json")


def test_keys_the_file_leaves_out_are_the_plain_ones_and_do_sample_is_not_read(tmp_path):
    folder = hf_folder(tmp_path, generation_config={"do_sample": False, "temperature": 0.6, "top_k": -1,
                                                    "presence_penalty": 1.5, "max_new_tokens": 64})
    assert sampling_defaults(folder, "mystery") == SamplingDefaults(temperature=0.6, presence_penalty=1.5,
                                                                    source="generation_config.json")


def test_config_json_when_there_is_no_generation_config(tmp_path):
    folder = hf_folder(tmp_path, config={"model_type": "llama", "temperature": 0.5, "top_k": 30.0})
    defaults = sampling_defaults(folder, "mystery")
    assert (defaults.temperature, defaults.top_k, defaults.source) == (0.5, 30, "config.json")
    assert isinstance(defaults.top_k, int)


def test_a_file_without_sampling_keys_falls_to_the_card_then_llama_server(tmp_path):
    folder = hf_folder(tmp_path, generation_config={"bos_token_id": 1, "eos_token_id": 2})
    smol = sampling_defaults(folder, "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert smol == SamplingDefaults(temperature=0.2, top_p=0.9, source="model card: SmolLM2-135M-Instruct")
    assert sampling_defaults(folder, "someone/mystery-7b") == LLAMA_SERVER
    assert LLAMA_SERVER.as_dict() == {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05,
                                      "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                      "source": "llama-server defaults"}


def test_gguf_metadata_decides_for_a_converted_file(tmp_path):
    folder = gguf_folder(tmp_path, {"temperature": 0.5, "top_k": 7, "min_p": 0.1}, name="Qwen3 0.6B", basename="Qwen3")
    assert sampling_defaults(folder, "Qwen3-0.6B-Q8_0") == SamplingDefaults(temperature=0.5, top_k=7, min_p=0.1,
                                                                            source="GGUF metadata")


@pytest.mark.parametrize("name, general, card", [
    ("SmolLM2-135M-Instruct.Q4_1", {"name": "Smollm2 135M 8k Lc100K Mix1 Ep2", "basename": "smollm2",
                                    "size_label": "135M"}, "SmolLM2-135M-Instruct"),
    ("Qwen2.5-Coder-0.5B-Instruct-Q4_K_M", {"name": "Qwen2.5 Coder 0.5B Instruct AWQ", "basename": "Qwen2.5-Coder"},
     "Qwen2.5-Coder-Instruct"),
    ("qwen3:0.6b", {}, "Qwen3"),
    ("Qwen3-4B-Instruct-2507-Q4_K_M", {}, "Qwen3-Instruct-2507"),
    ("smollm2-135m", {"basename": "smollm2"}, None),  # the base model: no "instruct" anywhere
    ("Qwen3.5-2B", {}, None),  # not Qwen3
    ("gemma-3-270m-q4_k_m", {"name": "Gemma 3 270m", "basename": "gemma-3"}, None),
])
def test_a_gguf_without_metadata_takes_its_card_where_kvtool_knows_the_model(tmp_path, name, general, card):
    defaults = sampling_defaults(gguf_folder(tmp_path, {}, **general), name)
    assert defaults.source == (f"model card: {card}" if card else "llama-server defaults")


def test_the_cards_values(tmp_path):
    folder = gguf_folder(tmp_path, {})
    assert sampling_defaults(folder, "Qwen2.5-Coder-0.5B-Instruct") == SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, source="model card: Qwen2.5-Coder-Instruct")
    assert sampling_defaults(folder, "Qwen3-0.6B") == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20,
                                                                       min_p=0.0, source="model card: Qwen3")


def test_none_and_a_folder(tmp_path):
    model = hf_folder(tmp_path, generation_config=QWEN_FILE)
    assert sampling_defaults(model, "m", "none") == SamplingDefaults()
    other = hf_folder(tmp_path, "other", generation_config={"temperature": 0.3})
    assert sampling_defaults(model, "m", str(other)) == SamplingDefaults(temperature=0.3,
                                                                         source="generation_config.json")
    with pytest.raises(ModelLoadError, match="--generation-config .*: no generation_config.json there"):
        sampling_defaults(model, "m", str(tmp_path / "nowhere"))
    assert EngineConfig().generation_config == "auto"
    with pytest.raises(InvalidParameterError, match="generation_config"):
        EngineConfig(generation_config="").validate()


def test_a_value_no_request_could_take_fails_at_load_naming_the_file(tmp_path):
    folder = hf_folder(tmp_path, generation_config={"top_p": 0.0})
    with pytest.raises(ModelLoadError, match=r"generation_config.json sets a sampling default .*top_p.*"
                                             r"--generation-config none"):
        sampling_defaults(folder, "m")
