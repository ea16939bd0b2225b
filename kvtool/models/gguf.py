"""GGUF files: validation and a one-time conversion to a Hugging Face folder.

transformers dequantizes GGUF tensors (20-45 s for a small model on 2 cores), so the
result is written once as fp32 safetensors + config + tokenizer into a cache folder
keyed by the file's content, and later loads read that folder in well under a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from kvtool.errors import ModelLoadError
from kvtool.paths import cache_root

GGUF_MAGIC = b"GGUF"
CONVERTED_FORMAT = 1  # bump when the converted folder's layout changes
IDENTITY = ("name", "basename", "finetune", "size_label")  # general.* strings that say which model a file holds
SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",  # the model's sampling
            "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",  # defaults, written by llama.cpp's
            "general.sampling.penalty_repeat": "repetition_penalty"}  # converter from generation_config.json


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _check_magic(path: Path) -> None:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    if not is_gguf(path):
        raise ModelLoadError(f"{path} is not a GGUF file (its first bytes are not the GGUF magic)")


def validate(path: Path) -> dict:
    """Check magic and that every tensor lies inside the file; return a little metadata."""
    _check_magic(path)
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        size = path.stat().st_size
        for tensor in reader.tensors:
            end = int(tensor.data_offset) + int(tensor.n_bytes)
            if end > size:
                raise ValueError(f"tensor {tensor.name} ends at byte {end} past the file's {size}")
        arch_field = reader.fields.get("general.architecture")
        arch = bytes(arch_field.parts[-1]).decode() if arch_field else "unknown"
        named = {key: str(reader.fields[f"general.{key}"].contents()) for key in IDENTITY
                 if f"general.{key}" in reader.fields}
        sampling = {name: reader.fields[key].contents() for key, name in SAMPLING.items() if key in reader.fields}
    except ModelLoadError:
        raise
    except Exception as exc:  # gguf raises ValueError/IndexError/struct.error on damaged files
        raise ModelLoadError(f"GGUF file {path} is truncated or corrupt: its {path.stat().st_size:,} bytes do not hold "
                             f"the header and tensors it declares; copy or download it again (reader: {exc})") from None
    return {"architecture": arch, "name": path.stem, **named, "tensors": len(reader.tensors), "sampling": sampling}


def source_meta(folder: Path) -> dict | None:
    """What validate() read from the GGUF a converted folder came from (None for any other folder). A folder
    converted before its metadata held `sampling` gets it now, once, from the GGUF if it is still there."""
    record = folder / "kvtool_source.json"
    if not record.is_file():
        return None
    meta = json.loads(record.read_text())
    if "sampling" not in meta and Path(meta.get("gguf", "")).is_file():
        meta = {"gguf": meta["gguf"], **validate(Path(meta["gguf"]))}
        tmp = record.with_name(f".{record.name}.{os.getpid()}")
        tmp.write_text(json.dumps(meta))
        tmp.replace(record)  # atomic: a process reading it sees the old record or the new one
    return meta


def content_key(path: Path) -> str:
    """Cheap content hash: size + first and last MiB (a full hash of 500 MB costs seconds)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as fh:
        h.update(fh.read(1 << 20))
        fh.seek(max(0, size - (1 << 20)))
        h.update(fh.read(1 << 20))
    return h.hexdigest()[:24]


def converted_folder(path: Path) -> Path:
    """The HF folder for this GGUF, converting it on first use. The whole file is validated only before a
    conversion (parsing the vocabulary field by field takes 6-21 s on 2 cores): a damaged copy changes the size
    or an end of the file, which the key covers, so it never reaches a folder converted from a good one."""
    _check_magic(path)
    target = cache_root() / "gguf" / f"{content_key(path)}-v{CONVERTED_FORMAT}"
    if (target / "kvtool_source.json").is_file():
        return target
    meta = validate(path)
    print(f"kvtool: converting {path.name} ({meta['architecture']}, {meta['tensors']} tensors) "
          f"to safetensors once; later loads reuse {target}", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        _convert(path, tmp)
        (tmp / "kvtool_source.json").write_text(json.dumps({"gguf": str(path), **meta}))
        try:
            tmp.rename(target)
        except OSError:  # another process finished first; its folder is as good as ours
            if not (target / "kvtool_source.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(path: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:
        raise ModelLoadError(f"transformers could not read GGUF file {path}: {exc}") from None
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: v.contiguous().clone() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if not getattr(tokenizer, "chat_template", None):  # a GGUF without tokenizer.chat_template
        from kvtool.models.chat_templates import default_template

        tokenizer.chat_template = default_template(config.get("model_type"))
    tokenizer.save_pretrained(str(out))
