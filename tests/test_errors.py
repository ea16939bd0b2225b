"""Bad input gets a clear error naming the problem, never a traceback dump."""

from pathlib import Path

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


@pytest.mark.real_model
def test_smollm2_by_name_is_the_embedded_model_unless_a_folder_has_that_name(tmp_path, monkeypatch, capsys):
    from kvtool.models import gguf
    from kvtool.models.loading import resolve_folder
    from kvtool.testing.models import smollm2_gguf

    assert resolve_folder("smollm2") == (gguf.converted_folder(smollm2_gguf()), "SmolLM2-135M-Instruct.Q4_1")
    code, text = run_cli(capsys, "info", "--model", "smollm2")
    assert code == 0 and "SmolLM2-135M-Instruct.Q4_1" in text
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()  # a path of that name is what the user means
    with pytest.raises(ModelLoadError, match="folder smollm2 has no config.json"):
        resolve_folder("smollm2")
    code, text = run_cli(capsys, "info", "--model", "smolm2")
    assert code == 2 and "'smollm2' (the embedded SmolLM2)" in text


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
    assert code == 2 and "truncated or corrupt: its" in text and "copy or download it again" in text
    assert "Traceback" not in text


@pytest.mark.real_model
def test_a_converted_gguf_loads_without_reading_its_metadata_again(monkeypatch):
    """Parsing the whole file costs seconds per start (the vocabulary is one field per token): a file whose
    converted folder exists is only checked for its magic, and its key (size and both ends) finds the folder."""
    from kvtool.models import gguf
    from kvtool.testing.models import smollm2_gguf

    folder = gguf.converted_folder(smollm2_gguf())  # converts once if this cache has never seen it
    monkeypatch.setattr(gguf, "validate", lambda path: pytest.fail(f"{path} was parsed again"))
    assert gguf.converted_folder(smollm2_gguf()) == folder


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
                                         ('{"type": "object", "not": {}}', "schema uses not"),
                                         ('{"properties": {"a": {"$ref": "#/$defs/A"}}}', "'#/$defs/A' points to nothing")])
def test_bad_json_schema_on_cli(capsys, value, words):
    code, text = run_cli(capsys, "generate", "hi", "--json-schema", value, "--strict", "--model", "/unused")
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


@pytest.mark.real_model
def test_cli_answers_in_a_schema_whose_root_is_not_an_object(capsys):
    import json

    import jsonschema

    from kvtool.testing.models import smollm2_gguf

    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}
    assert main(["generate", "The first two prime numbers:", "--chat", "--json-schema", json.dumps(schema),
                 "--temperature", "0", "--max-tokens", "24", "--model", str(smollm2_gguf())]) == 0
    out = capsys.readouterr()
    assert "[stop]" in out.err
    jsonschema.validate(json.loads(out.out), schema)


@pytest.mark.parametrize("argv,words", [
    (["generate", "hi", "--temperature", "1", "--seed", str(10**24)], "seed=1000000000000000000000000: must be an integer in"),
    (["serve", "--port", "70000"], "--port must be in 0..65535, got 70000"),
    (["generate", "hi", "--system", "be brief"], "--system is the system message of a chat; add --chat"),
    (["skill", "eval", ".", "--repair", "bogus"], "unknown repair strategy 'bogus'"),
    (["skill", "eval", ".", "--repair", "recompute_deviation:ratio=2.0"], "ratio must be in [0, 1]"),
    (["skill", "eval", ".", "--blocks", "0"], "--blocks must be >= 1, got 0"),
    (["skill", "eval", ".", "--repeats", "-1"], "--repeats must be >= 0, got -1"),
    (["skill", "eval", ".", "--queries", "9"], "--queries must be in 1..4, got 9"),
    (["skill", "eval", ".", "--scaling", "a,b"], "--scaling takes block counts separated by commas"),
    (["skill", "eval", ".", "--out", "."], "--out . is a folder; give a file path"),
    (["skill", "compile", str(Path(__file__).parents[1] / "examples" / "skills"), "-o", __file__],
     f"-o {__file__} is a file; give a folder path"),
    (["skill", "compile", str(Path(__file__).parents[1] / "examples" / "skills"), "-o", "out", "--cache-dir", "c"],
     "--cache-dir is where a folder of skills is cached when no -o is given; with -o the blocks go to that folder"),
    (["skill", "compile", str(Path(__file__).parents[1] / "examples" / "skills" / "pdf"), "--cache-dir", "c"],
     "a single skill is written to -o (default: NAME.kvb here)"),  # it wrote pdf.kvb here, saying nothing
    # benchmarks: each of these failed after the model load, some after the whole run
    (["bench", "ttft", "--repeats", "0"], "--repeats and --max-tokens must be >= 1; got 0 and 1"),
    (["bench", "ttft", "--block-size", "0"], "--block-size must be an integer >= 1, got 0"),
    (["bench", "ttft", "--requests", "0"], "--requests and --window-turns must be >= 1"),
    (["bench", "ttft", "--out", "."], "--out . is a folder; give a file path"),
    (["bench", "ttft", "--png", f"{__file__}/x.png"], f"cannot be written: {__file__} is a file, not a folder"),
    (["bench", "ttft", "--endpoint", "localhost:8000"], "--endpoint 'localhost:8000' is not a base URL"),
    (["bench", "prefix", "--prefix-tokens", "0"], "--prefix-tokens (0) must be a positive multiple of the block"),
    (["bench", "prefix", "--warmup", "-1"], "--warmup >= 0; got 64, 3 and -1"),
    (["bench", "skills", "--scaling-repair", "bogus"], "unknown repair strategy 'bogus'"),
    (["bench", "skills", "--preamble", "bogus"], "unknown skill preamble 'bogus'"),
    (["bench", "skills", "--scaling=-1"], "--scaling block counts must be >= 0; got [-1]"),
    (["bench", "decode", "--out", "."], "--out . is a folder"),
    (["bench", "batching", "--png", "."], "--png . is a folder"),
    (["bench", "batching", "--endpoint", "notaurl"], "--endpoint 'notaurl' is not a base URL"),
    (["bench", "all", "--out-dir", __file__], f"--out-dir {__file__} is a file; give a folder path"),
    (["viz", "sink", "--prompt", "hi", "--json", "."], "--json . is a folder; give a file path")])
def test_cli_options_are_checked_before_the_model_loads(capsys, argv, words):
    code, text = run_cli(capsys, *argv, "--model", "/unused")  # loading /unused would say "not found"
    assert code == 2 and words in text and "not found" not in text and "Traceback" not in text


def test_a_device_torch_does_not_know_is_named():
    from kvtool.models.loading import pick_device

    with pytest.raises(ModelLoadError, match="unknown device 'banana'; use auto, cpu, cuda, cuda:N or mps"):
        pick_device("banana")


def test_a_schema_file_that_is_not_utf8_is_one_line(capsys, tmp_path):
    path = tmp_path / "schema.json"
    path.write_bytes(b"\xff\xfe{}")
    code, text = run_cli(capsys, "generate", "hi", "--json-schema", str(path), "--model", "/unused")
    assert code == 2 and "not UTF-8 text" in text and "Traceback" not in text


def test_a_path_the_command_cannot_write_is_one_line(capsys, monkeypatch, tmp_path):
    import kvtool.cli.info as info

    def writes_into_a_folder(args):
        raise IsADirectoryError(21, "Is a directory", str(tmp_path / "out.tmp"), None, str(tmp_path))

    monkeypatch.setattr(info, "run", writes_into_a_folder)
    code, text = run_cli(capsys, "info", "--model", "/unused")
    assert code == 2 and f"Is a directory: {tmp_path / 'out.tmp'} -> {tmp_path}" in text and "Traceback" not in text


@pytest.mark.real_model
def test_text_that_is_not_valid_unicode(smollm2, capsys):
    from kvtool.testing.models import smollm2_gguf

    with pytest.raises(InvalidParameterError, match="not valid UTF-8 / Unicode .* at character 2"):
        smollm2.encode("hi\ud800")
    code, text = run_cli(capsys, "generate", "\udced\udca0\udc80", "--model", str(smollm2_gguf()), "--max-tokens", "2")
    assert code == 2 and "not valid UTF-8" in text and "Traceback" not in text
    code, text = run_cli(capsys, "bench", "prefix", "--model", str(smollm2_gguf()), "--block-size", "0",
                         "--no-baseline", "--prefix-tokens", "32", "--suffix-tokens", "4", "--repeats", "1")
    assert code == 2 and "--block-size must be an integer >= 1, got 0" in text and "Traceback" not in text
