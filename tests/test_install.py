"""The locks that scripts/setup.sh installs from (docs/install.md): complete, hash-checked, within
pyproject.toml's ranges, and what the running venv actually has. `bash scripts/lock.sh` refreshes them and
`bash scripts/test.sh --latest` runs the release canary; both are documented in docs/install.md."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from kvtool.version import LOCK_RECORD, install_record, lock_pins

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "locks"
CPU_LOCKS = ["cpu.txt", "cpu-vllm.txt"]


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def lock_entries(text: str) -> list[tuple[str, list[str]]]:
    """(the `name==version` line, its hashes) per entry of a `--generate-hashes` lock."""
    entries, cur = [], None
    for line in text.splitlines():
        if re.match(r"^[A-Za-z0-9]", line):
            cur = (line.rstrip(" \\"), [])
            entries.append(cur)
        elif cur and (m := re.search(r"--hash=sha256:([0-9a-f]{64})", line)):
            cur[1].append(m[1])
    return entries


@pytest.mark.parametrize("name", sorted(p.name for p in LOCKS.glob("*.txt")))
def test_every_lock_entry_is_pinned_with_hashes(name):
    entries = lock_entries((LOCKS / name).read_text())
    assert entries, name
    for line, hashes in entries:
        assert re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*==\S+$", line), f"{name}: not an exact pin: {line}"
        assert hashes, f"{name}: {line} has no hash, so pip's --require-hashes refuses the lock"


@pytest.mark.parametrize("name", CPU_LOCKS)
def test_cpu_locks_leave_torch_to_its_own_pin(name):
    # setup.sh installs torch==2.13.0 first (the CPU build); a lock entry would pull PyPI's CUDA build over it
    assert not {"torch", "torchvision", "torchaudio"} & set(lock_pins(LOCKS / name)), name


@pytest.mark.parametrize("lock, extras", [("cpu.txt", ["test", "agents"]), ("cuda.txt", ["test", "agents"]),
                                          ("cpu-vllm.txt", ["test", "vllm"]), ("cuda-vllm.txt", ["test", "vllm-gpu"])])
def test_lock_satisfies_pyproject_ranges(lock, extras):
    pins = lock_pins(LOCKS / lock)
    proj = project()
    env = {"platform_system": "Linux", "platform_machine": "x86_64", "sys_platform": "linux",
           "python_version": "3.11", "extra": ""}
    reqs = [Requirement(r) for r in proj["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in proj["optional-dependencies"][extra]]
    for req in reqs:
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name == "torch" and lock in CPU_LOCKS:
            continue
        assert name in pins, f"{lock} does not pin {req.name}"
        assert req.specifier.contains(pins[name].split("+")[0], prereleases=True), \
            f"{lock} pins {req.name}=={pins[name]}, outside pyproject's {req}"


def test_model_locks_pin_what_their_inputs_name():
    for stem in ("fallback-model", "test-models"):
        wanted = {Requirement(ln).name for ln in (LOCKS / f"{stem}.in").read_text().splitlines()
                  if ln.strip() and not ln.startswith("#")}
        assert set(lock_pins(LOCKS / f"{stem}.txt")) == wanted, stem


def test_setup_installs_only_from_locks():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "--require-hashes" in setup and "--no-deps" in setup
    for lock in re.findall(r"locks/[\w-]+\.txt", setup):
        assert (ROOT / lock).exists(), lock
    assert "scripts/lock.sh" in (ROOT / "docs" / "install.md").read_text()


def test_no_registry_host_or_download_url_in_the_repository():
    hosts = ["files." + "pythonhosted.org", "pypi" + ".org", "download." + "pytorch.org", "huggingface" + ".co/"]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    for rel in tracked:
        path = ROOT / rel
        if path.suffix in {".png", ".kvb", ".kvc", ".gguf", ".bin"} or not path.is_file():
            continue
        text = path.read_text(errors="ignore")
        for host in hosts:
            assert host not in text, f"{rel} names {host}"


@pytest.mark.skipif(not (Path(sys.prefix) / LOCK_RECORD).exists(), reason="this venv was not set up by scripts/setup.sh")
def test_this_venv_has_exactly_what_its_locks_pin():
    rec = install_record()["lock"]
    files = [ROOT / f for f in rec["files"]]
    import hashlib

    assert rec["sha256"] == hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16], \
        "the locks changed since this venv was set up: run scripts/setup.sh"
    assert rec["differ"] == {}


def test_info_versions_prints_the_lock(capsys):
    from kvtool.cli import main

    assert main(["info", "--versions", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kvtool"] and "torch" in out["packages"]
    assert out["lock"] is None or re.fullmatch(r"[0-9a-f]{16}", out["lock"]["sha256"])
