"""`kvtool serve` wiring: defaults come from ServerConfig, flags reach the server (no model loaded)."""

from __future__ import annotations

import pytest

from kvtool.cli import build_parser, main
from kvtool.config import SamplingDefaults
from kvtool.serving.config import ServerConfig


def test_defaults_come_from_server_config(monkeypatch):
    monkeypatch.delenv("KVTOOL_API_KEY", raising=False)
    from kvtool.cli.serve import config_from_args

    args = build_parser().parse_args(["serve"])
    assert config_from_args(args) == ServerConfig()


def test_flags_reach_serve(monkeypatch, capsys):
    import kvtool.cli.serve as cli
    import kvtool.serving.server as server

    seen = {}

    class FakeModel:
        name, info = "fake", {"device": "cpu", "dtype": "float32"}
        sampling_defaults = SamplingDefaults()

    monkeypatch.setattr(cli, "load_from_args", lambda args: FakeModel())
    monkeypatch.setattr(server, "check_listen", lambda host, port: None)
    monkeypatch.setattr(server, "serve", lambda model, cfg, engine_config, log_level, on_ready: (on_ready(), seen.update(
        cfg=cfg, engine=engine_config, level=log_level)))
    rc = main(["serve", "--port", "9123", "--host", "0.0.0.0", "--api-key", "k", "--max-queue", "3",
               "--max-active", "2", "--tool-parser", "hermes", "--default-max-tokens", "64", "--log-level", "warning",
               "--cache-bytes", "1000000", "--kv-bytes", "5000000", "--shutdown-timeout", "4.5", "--metrics-open"])
    assert rc == 0
    cfg = seen["cfg"]
    assert cfg.shutdown_timeout == 4.5 and cfg.metrics_open
    assert (cfg.port, cfg.host, cfg.api_key, cfg.max_queue, cfg.max_active, cfg.tool_parser,
            cfg.default_max_tokens, cfg.kv_bytes) == (9123, "0.0.0.0", "k", 3, 2, "hermes", 64, 5_000_000)
    assert seen["level"] == "warning"
    assert seen["engine"].cache_bytes == 1_000_000 and seen["engine"].enable_prefix_cache
    assert "http://0.0.0.0:9123/v1" in capsys.readouterr().err


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("KVTOOL_API_KEY", "from-env")
    from kvtool.cli.serve import config_from_args

    assert config_from_args(build_parser().parse_args(["serve"])).api_key == "from-env"


def test_bad_sizes_are_clear_errors(capsys):
    assert main(["serve", "--max-active", "0"]) == 2
    assert "--max-active must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--kv-bytes", "0"]) == 2
    assert "--kv-bytes must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--tool-parser", "nope"])


def test_skills_flags_reach_the_engine_config(monkeypatch, tmp_path):
    import kvtool.cli.serve as cli
    import kvtool.serving.server as server

    seen = {}

    class FakeModel:
        name, info = "fake", {"device": "cpu", "dtype": "float32"}

    monkeypatch.setattr(cli, "load_from_args", lambda args: FakeModel())
    monkeypatch.setattr(server, "check_listen", lambda host, port: None)
    monkeypatch.setattr(server, "serve", lambda model, cfg, engine_config, log_level, on_ready: seen.update(
        engine=engine_config, server=cfg))
    assert main(["serve", "--skills", str(tmp_path), "--skill-repair", "recompute_deviation:ratio=0.2",
                 "--skill-preamble", "conversation"]) == 0
    assert seen["engine"].skills_dir == str(tmp_path)
    assert seen["engine"].skill_repair == "recompute_deviation:ratio=0.2"
    assert seen["engine"].skill_preamble == "conversation"
    assert main(["serve", "--skills", str(tmp_path)]) == 0  # the defaults, from EngineConfig
    assert (seen["engine"].skill_repair, seen["engine"].skill_preamble) == ("recompute_attended:ratio=0.1",
                                                                           "deep:tokens=2048")


@pytest.mark.parametrize("argv, needle", [(["--skills", "/no/such/folder"], "is not a folder of skills"),
                                          (["--skill-repair", "magic"], "unknown repair strategy 'magic'"),
                                          (["--skill-repair", "recompute_first_k:q=1"], "has no knob 'q'"),
                                          (["--skill-preamble", "deep:tokens=0"], "tokens=N with N >= 1")])
def test_bad_skills_flags_are_clear_errors(monkeypatch, capsys, tmp_path, argv, needle):
    import kvtool.cli.serve as cli

    monkeypatch.setattr(cli, "load_from_args", lambda args: pytest.fail("the model must not load on bad flags"))
    assert main(["serve", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_weights_flag_reaches_the_loader_and_the_banner(monkeypatch, capsys):
    import kvtool.cli.serve as cli
    import kvtool.serving.server as server

    class FakeModel:
        name, info = "fake", {"device": "cpu", "dtype": "float32", "weights": "int4"}
        sampling_defaults = SamplingDefaults()

    seen = {}
    monkeypatch.setattr(cli, "load_from_args", lambda args: seen.update(weights=args.weights) or FakeModel())
    monkeypatch.setattr(server, "check_listen", lambda host, port: None)
    monkeypatch.setattr(server, "serve", lambda model, cfg, engine_config, log_level, on_ready: on_ready())
    assert main(["serve", "--weights", "int4"]) == 0
    assert seen["weights"] == "int4" and "(cpu, float32, int4 weights, no API key)" in capsys.readouterr().err


def test_forward_flag_reaches_the_loader_the_engine_and_the_banner(monkeypatch, capsys):
    import kvtool.cli.serve as cli
    import kvtool.serving.server as server

    class FakeModel:
        name, info = "fake", {"device": "cpu", "dtype": "float32", "weights": "dense", "forward": "reference"}
        sampling_defaults = SamplingDefaults()

    seen = {}
    monkeypatch.setattr(cli, "load_from_args", lambda args: seen.update(loaded=args.forward) or FakeModel())
    monkeypatch.setattr(server, "check_listen", lambda host, port: None)
    monkeypatch.setattr(server, "serve", lambda model, cfg, engine_config, log_level, on_ready:
                        seen.update(engine=engine_config.forward) or on_ready())
    assert main(["serve", "--forward", "reference"]) == 0
    assert seen == {"loaded": "reference", "engine": "reference"}
    assert "(cpu, float32, reference forward, no API key)" in capsys.readouterr().err


def test_generation_config_flag_reaches_the_loader_and_the_banner_says_the_defaults(monkeypatch, capsys, tmp_path):
    import kvtool.cli.serve as cli
    import kvtool.serving.server as server

    class FakeModel:
        name, info = "fake", {"device": "cpu", "dtype": "float32"}
        sampling_defaults = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, source="generation_config.json")

    seen = {}
    monkeypatch.setattr(cli, "load_from_args", lambda args: seen.update(loaded=args.generation_config) or FakeModel())
    monkeypatch.setattr(server, "check_listen", lambda host, port: None)
    monkeypatch.setattr(server, "serve", lambda model, cfg, engine_config, log_level, on_ready:
                        seen.update(engine=engine_config.generation_config) or on_ready())
    assert main(["serve", "--generation-config", str(tmp_path)]) == 0
    assert seen == {"loaded": str(tmp_path), "engine": str(tmp_path)}
    assert ("kvtool: sampling defaults (requests that name none): temperature 0.7, top_p 0.8, top_k 20 "
            "(generation_config.json)") in capsys.readouterr().err
    assert build_parser().parse_args(["serve"]).generation_config == "auto"  # EngineConfig's default


def test_a_port_in_use_or_a_bad_host_is_said_before_the_model_loads(monkeypatch, capsys):
    import socket

    import kvtool.cli.serve as cli

    monkeypatch.setattr(cli, "load_from_args", lambda args: pytest.fail("the model must not load"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
        assert f"port {port} on 127.0.0.1 is in use; pick another with --port" in capsys.readouterr().err
    assert main(["serve", "--host", "no-such-host.invalid"]) == 2
    assert "cannot listen on host 'no-such-host.invalid'" in capsys.readouterr().err


@pytest.mark.parametrize("settings,words", [
    (dict(max_active=0), "--max-active must be >= 1, got 0"),
    (dict(max_queue=-1), "--max-queue must be >= 0, got -1"),
    (dict(default_max_tokens=0), "--default-max-tokens must be >= 1, got 0"),  # a request without max_tokens got a 400
    (dict(kv_bytes=True), "--kv-bytes must be >= 1, got True"),
    (dict(port=-1), "--port must be in 0..65535, got -1"),
    (dict(tool_parser="hermes2"), "--tool-parser 'hermes2' is not one of"),
    (dict(api_key=""), "--api-key must be a non-empty string"),
    (dict(shutdown_timeout=-1), "--shutdown-timeout must be a number of seconds >= 0, got -1"),
])
def test_server_settings_are_checked_for_the_python_api_too(settings, words):
    from kvtool.errors import InvalidParameterError
    from kvtool.serving.app import create_app

    with pytest.raises(InvalidParameterError, match=words):
        create_app(object(), server_config=ServerConfig(**settings))  # refused before the model is touched


def test_default_max_tokens_is_checked_on_the_command_line(capsys):
    assert main(["serve", "--default-max-tokens", "0", "--model", "/unused"]) == 2
    assert "--default-max-tokens must be >= 1, got 0" in capsys.readouterr().err


def test_cache_file_reaches_the_engine_and_needs_the_prefix_cache(monkeypatch, capsys, tmp_path):
    import kvtool.cli.serve as cli
    import kvtool.serving.server as server

    seen = {}

    class FakeModel:
        name, info = "fake", {"device": "cpu", "dtype": "float32"}

    monkeypatch.setattr(cli, "load_from_args", lambda args: seen.setdefault("loaded", FakeModel()))
    monkeypatch.setattr(server, "check_listen", lambda host, port: None)
    monkeypatch.setattr(server, "serve", lambda model, cfg, engine_config, log_level, on_ready: seen.update(
        engine=engine_config, server=cfg))
    assert main(["serve", "--cache-file", str(tmp_path / "c.kvc")]) == 0
    assert seen["engine"].cache_file == str(tmp_path / "c.kvc")
    seen.clear()
    assert main(["serve", "--cache-file", str(tmp_path / "c.kvc"), "--no-prefix-cache"]) == 2
    assert "cache_file" in capsys.readouterr().err and "loaded" not in seen  # refused before the model loads
    assert main(["serve", "--cache-file", str(tmp_path)]) == 2
    assert f"--cache-file {tmp_path} is a folder" in capsys.readouterr().err
    assert main(["serve", "--cache-save-every", "60"]) == 2
    assert "--cache-save-every saves the prefix cache to --cache-file" in capsys.readouterr().err
    assert main(["serve", "--cache-file", str(tmp_path / "c.kvc"), "--cache-save-every", "0"]) == 2
    assert "--cache-save-every must be a number of seconds >= 1, got 0.0" in capsys.readouterr().err
    assert "loaded" not in seen
    assert main(["serve", "--cache-file", str(tmp_path / "c.kvc"), "--cache-save-every", "30"]) == 0
    assert seen["server"].cache_save_every == 30
