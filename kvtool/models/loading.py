"""`kvtool.load(model)`: a hub id, a local HF folder, a GGUF file or an Ollama model -> LoadedModel."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtool.config import FORWARDS, SamplingDefaults
from kvtool.errors import ModelLoadError
from kvtool.models import gguf, ollama
from kvtool.models.host import page_out_files, trim_heap, tune_host_allocator
from kvtool.models.runner import ModelRunner
from kvtool.models.sampling_defaults import sampling_defaults
from kvtool.models.spec import ModelSpec
from kvtool.models.text import ModelText, TextModel

WEIGHTS = ("dense", "int4", "bf16")  # int4: 4-bit projections, 8-bit head for CPU decode (kvtool.kernels.quant);
# bf16: projections and head rounded to bf16 for oneDNN's bf16 GEMMs and the decode gemv (kvtool.kernels.cpu_gemm)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model"]


def pick_device(device: str = "auto") -> torch.device:
    if device != "auto":
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} was asked for but CUDA is not available")
        if device == "mps" and not torch.backends.mps.is_available():
            raise ModelLoadError("device 'mps' was asked for but MPS is not available")
        try:
            return torch.device(device)
        except RuntimeError:
            raise ModelLoadError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps") from None
    return torch.device("cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu")


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class LoadedModel(ModelText):
    name: str
    folder: Path  # HF folder the weights came from (the converted one for GGUF)
    runner: ModelRunner
    tokenizer: Any
    hf_config: Any
    source: str = ""
    info: dict = field(default_factory=dict)
    sampling_defaults: SamplingDefaults = SamplingDefaults()  # what requests that name none sample with

    @property
    def spec(self) -> ModelSpec:
        return self.runner.spec

    @property
    def context_window(self) -> int:
        return self.spec.max_position

    @property
    def precision(self) -> str:
        return self.runner.precision

    @property
    def kv_bytes_per_token(self) -> int:
        return self.spec.kv_bytes_per_token(self.runner.dtype.itemsize)

    def fingerprint(self) -> dict:
        if "tokenizer_hash" not in self.info:  # hashing a 150k-entry vocab costs ~0.2 s; do it once
            vocab = json.dumps(self.tokenizer.get_vocab(), sort_keys=True).encode()
            self.info["tokenizer_hash"] = hashlib.sha256(vocab).hexdigest()[:16]
        return {"model": self.name, "config_hash": self.spec.config_hash(),
                "tokenizer_hash": self.info["tokenizer_hash"], "dtype": self.runner.precision}


def resolve_folder(model: str) -> tuple[Path, str]:
    """(HF folder, display name) for a hub id, a local folder, a GGUF file (an Ollama blob is named after its
    manifest), 'ollama:NAME[:TAG]' (kvtool.models.ollama), 'smollm2' (the embedded SmolLM2 GGUF), or 'qwen25' /
    'gemma3' (the offline test models, kvtool.models.offline)."""
    if model.startswith(ollama.PREFIX):
        blob, name = ollama.resolve(model)
        return gguf.converted_folder(blob), name
    path = Path(model).expanduser()
    if model == "smollm2" and not path.exists():  # the embedded model, by name
        from kvtool.models.embedded import smollm2_path

        path = smollm2_path()
    if model in ("qwen25", "gemma3") and not path.exists():  # the offline test models, once their pieces are installed
        from kvtool.models import offline

        path = getattr(offline, f"{model}_gguf")(install=False)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"folder {path} has no config.json; expected a Hugging Face model folder")
        return path, path.name
    if path.is_file():
        if not gguf.is_gguf(path):
            raise ModelLoadError(f"{path} is neither a model folder nor a GGUF file (no GGUF magic bytes)")
        name = path.name[: -len(".gguf")] if path.name.endswith(".gguf") else ollama.blob_name(path) or path.name
        return gguf.converted_folder(path), name
    if model.endswith(".gguf") or model.startswith(("/", ".", "~")) or model.count("/") != 1:
        raise ModelLoadError(f"model {model!r} not found: no such file or folder, and not a hub id like 'org/name', "
                             "an Ollama model like 'ollama:qwen3:0.6b', 'smollm2' (the embedded SmolLM2), "
                             "'qwen25' or 'gemma3' (the offline test models)")
    return hub_folder(model), model


def hub_folder(repo_id: str, local_only: bool = False) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=local_only))
    except Exception as exc:
        where = "in the local Hugging Face cache" if local_only else "locally or on the Hugging Face hub"
        raise ModelLoadError(f"model {repo_id!r} could not be found {where}: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0]}") from None


def load(model: str | None = None, device: str = "auto", dtype: str = "auto", progress: bool = True,
         weights: str = "dense", packed: bool = True, forward: str = "auto",
         generation_config: str = "auto") -> LoadedModel:
    """Load a model for kvtool: runner (weights on device), tokenizer, chat template; `forward`: which path its
    steps take (auto | reference | cpu-ops, as kvtool.config.EngineConfig.forward says); `generation_config`: where
    its sampling_defaults come from (auto | none | a folder, as EngineConfig.generation_config says).

    weights="int4" packs the projections in 4 bits and copies the head to bf16 for CPU decode
    (about 2x the decode tokens/s on two cores; see kvtool.kernels.quant). weights="bf16" rounds them to bf16 for
    oneDNN's bf16 GEMMs (AMX) and the decode gemv (kvtool.kernels.cpu_gemm). packed=False leaves out the
    oneDNN-packed copy of the fp32 weights on the CPU (kvtool.kernels.cpu_gemm): half the weight memory, the
    prefill matmuls through F.linear."""
    from kvtool.config import DEFAULT_MODEL

    model = model or DEFAULT_MODEL
    folder, name = resolve_folder(str(model))
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    hf_config, tokenizer = read_config_tokenizer(folder)
    defaults = sampling_defaults(folder, name, generation_config)  # a bad file fails before weights
    spec = ModelSpec.from_hf_config(hf_config)
    runner = build_runner(spec, hf_config, folder, dev, dt, progress, weights, packed, forward)
    return LoadedModel(name=name, folder=folder, runner=runner, tokenizer=tokenizer, hf_config=hf_config,
                       source=str(model), info={"device": str(dev), "dtype": str(dt).replace("torch.", ""),
                                                     "weights": weights, "forward": runner.forward_path},
                       sampling_defaults=defaults)


def load_text(model: str | None = None, generation_config: str = "auto") -> TextModel:
    """The tokenizer side of a model (config, tokenizer, chat template, sampling defaults) without its weights: for
    an engine that loads the weights itself (kvtool serve --engine vllm). A GGUF file is converted once, as load()
    does."""
    from kvtool.config import DEFAULT_MODEL

    model = model or DEFAULT_MODEL
    folder, name = resolve_folder(str(model))
    hf_config, tokenizer = read_config_tokenizer(folder)
    return TextModel(name=name, folder=folder, tokenizer=tokenizer, hf_config=hf_config,
                     spec=ModelSpec.from_hf_config(hf_config), source=str(model),
                     sampling_defaults=sampling_defaults(folder, name, generation_config))


def read_config_tokenizer(folder: Path):
    from transformers import AutoConfig, AutoTokenizer

    try:
        return AutoConfig.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:
        raise ModelLoadError(f"could not read config/tokenizer in {folder}: {exc}") from None


def check_weights(weights: str, device: torch.device, forward: str = "auto") -> None:
    if forward not in FORWARDS or (forward == "cpu-ops" and device.type != "cpu"):
        raise ModelLoadError(f"forward {forward!r} on device {device.type}: use one of {', '.join(FORWARDS)} (cpu-ops: "
                             "the CPU only)")
    if weights not in WEIGHTS:
        raise ModelLoadError(f"unknown weights {weights!r}; use one of {', '.join(WEIGHTS)}")
    if weights != "dense" and device.type != "cpu":
        raise ModelLoadError(f"{weights} weights run on the CPU only; got device {device.type} (use --device cpu "
                             "or --weights dense)")


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {folder}")
    return files


def build_runner(spec: ModelSpec, hf_config, folder: Path, device: torch.device, dtype: torch.dtype, progress=True,
                 weights: str = "dense", packed: bool = True, forward: str = "auto",
                 dense_copies: bool = False) -> ModelRunner:
    from safetensors import safe_open
    from tqdm import tqdm

    check_weights(weights, device, forward)  # before any weight is read
    if device.type == "cpu":
        tune_host_allocator()

    with torch.device("meta"):
        runner = ModelRunner(spec, hf_config)
    expected = dict(runner.named_parameters())
    state: dict[str, torch.Tensor] = {}
    files = weight_files(folder)
    with tqdm(desc=f"loading {folder.name}", unit="tensor", total=len(expected), disable=not progress,
              file=sys.stderr, leave=False) as bar:
        for file in files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as fh:
                    for key in fh.keys():
                        if key in expected:
                            state[key] = fh.get_tensor(key).to(device=device, dtype=dtype)
                            bar.update(1)
            except Exception as exc:
                raise ModelLoadError(f"could not read weights {file}: {exc}") from None
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"{folder} lacks {len(missing)} weights the model needs, e.g. {missing[:3]}")
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise ModelLoadError(f"weight {key} has shape {tuple(tensor.shape)}, config says {tuple(expected[key].shape)}")
    runner.load_state_dict(state, strict=False, assign=True)
    state.clear()  # the module holds what it needs: fuse() and packing may then free what they replace
    runner.set_rope(hf_config, device)
    runner.requires_grad_(False)
    runner.eval()
    runner.fuse()
    if weights == "int4":
        try:
            runner.quantize_int4()
        except ValueError as exc:
            raise ModelLoadError(f"cannot pack {folder.name} in int4: {exc}") from None
        if not dense_copies:
            runner.hold_weights_once()  # the codes stand for the dense values
    elif device.type == "cpu" and (packed or weights == "bf16"):
        try:
            # oneDNN's packed GEMM where it runs (fp32; plain F.linear otherwise), and only its copy of each weight
            reason = runner.pack_cpu_gemm(torch.bfloat16 if weights == "bf16" else torch.float32)
            if reason is not None and weights == "bf16":
                raise ValueError(f"cannot pack {folder.name} in bf16: {reason}")
            if reason is None and (weights == "bf16" or not dense_copies):
                runner.hold_weights_once()
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
    if device.type == "cpu":
        try:  # auto: decode steps and prefill with C++ glue where the ops build; the reference forward otherwise
            reason = runner.use_cpu_decode(forward != "reference")
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
        if forward == "cpu-ops" and reason is not None:
            raise ModelLoadError(f"forward cpu-ops: the C++ CPU ops cannot run this model: {reason} (--forward auto "
                                 "falls back to the reference forward)")
        page_out_files(files, keep=runner.state_dict().values())  # the pages of weights it dropped (unfused)
        trim_heap()  # and the dense copies hold_weights_once() let go
    return runner
