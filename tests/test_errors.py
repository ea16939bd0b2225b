"""Bad input gets a clear error naming the problem, never a traceback dump."""

import pytest

from kvtool import SamplingParams
from kvtool.cli import main
from kvtool.engine import Engine
from kvtool.errors import ContextWindowError, InvalidParameterError, ModelLoadError
from kvtool.models.loading import load


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_unknown_model_path(capsys):
    code, text = run_cli(capsys, "info", "--model", "/no/such/model.gguf")
    assert code == 2
    assert "not found" in text and "/no/such/model.gguf" in text and "Traceback" not in text


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"PK\x03\x04not a gguf at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file|no GGUF magic"):
        load(str(bad))


@pytest.mark.real_model
def test_truncated_gguf(tmp_path, capsys):
    from kvtool.testing.models import smollm2_gguf

    src = smollm2_gguf()
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as fh:
        cut.write_bytes(fh.read(src.stat().st_size // 3))
    code, text = run_cli(capsys, "info", "--model", str(cut))
    assert code == 2 and "truncated or corrupt" in text and "Traceback" not in text


def test_corrupt_gguf_header(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load(str(bad))


def test_invalid_sampling_on_cli(capsys):
    code, text = run_cli(capsys, "generate", "hi", "--top-p", "0", "--model", "/unused")
    assert code == 2 and "top_p" in text and "Traceback" not in text


@pytest.mark.parametrize("args,words", [
    (["--logit-bias", "7"], "TOKEN_ID=BIAS"), (["--logit-bias", "x=1"], "TOKEN_ID"),
    (["--logit-bias", "7=500"], "logit_bias"), (["--min-tokens", "-1"], "min_tokens")])
def test_bad_logit_bias_and_min_tokens_on_cli(capsys, args, words):
    code, text = run_cli(capsys, "generate", "hi", *args, "--model", "/unused")
    assert code == 2 and words in text and "Traceback" not in text


@pytest.mark.real_model
def test_prompt_longer_than_window(smollm2):
    engine = Engine(smollm2)
    window = smollm2.context_window
    with pytest.raises(ContextWindowError, match=f"{window + 5} tokens.*{window}"):
        engine.generate([1] * (window + 5), SamplingParams(max_tokens=1))
    with pytest.raises(ContextWindowError, match="exceeds the context window"):
        engine.generate([1] * 100, SamplingParams(max_tokens=window))
    with pytest.raises(InvalidParameterError, match="empty"):
        engine.generate([], SamplingParams())
    with pytest.raises(InvalidParameterError, match="token ids"):
        engine.generate([10**9], SamplingParams())
    with pytest.raises(InvalidParameterError, match="logit_bias token ids"):
        engine.generate([1, 2], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ContextWindowError, match="min_tokens"):
        engine.generate([1] * 100, SamplingParams(min_tokens=window))


@pytest.mark.parametrize("value,words", [("no/such/schema.json", "neither a file nor a JSON object"),
                                         ('{"type": "object",', "not valid JSON"),
                                         ('{"type": "string"}', "root must be an object")])
def test_bad_json_schema_on_cli(capsys, value, words):
    code, text = run_cli(capsys, "generate", "hi", "--json-schema", value, "--model", "/unused")
    assert code == 2 and words in text and "Traceback" not in text


@pytest.mark.real_model
def test_cli_answers_in_a_json_schema(capsys, tmp_path):
    import json

    import jsonschema

    from kvtool.testing.models import smollm2_gguf

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "legs": {"type": "integer"}},
              "required": ["name", "legs"], "additionalProperties": False}
    path = tmp_path / "animal.json"
    path.write_text(json.dumps(schema))
    assert main(["generate", "Describe a spider.", "--chat", "--json-schema", str(path), "--temperature", "0",
                 "--max-tokens", "48", "--model", str(smollm2_gguf())]) == 0
    out = capsys.readouterr()
    assert "[stop]" in out.err
    jsonschema.validate(json.loads(out.out), schema)
