"""Models an Ollama install keeps: GGUF blobs named by their digest, and manifests that name them.

    $OLLAMA_MODELS/manifests/registry.ollama.ai/library/qwen3/0.6b   JSON: layers [{mediaType, digest}, ...]
    $OLLAMA_MODELS/blobs/sha256-<hex>                                the GGUF (the image.model layer)

(OLLAMA_MODELS defaults to ~/.ollama/models.) kvtool.load takes a blob's path, and names the model
after the manifest that lists it ('qwen3:0.6b'), or 'ollama:NAME[:TAG]' (tag 'latest' if none).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from kvtool.errors import ModelLoadError

PREFIX = "ollama:"
MODEL_LAYER = "application/vnd.ollama.image.model"
DEFAULT_REGISTRY, DEFAULT_NAMESPACE = "registry.ollama.ai", "library"
BLOB_NAME = re.compile(r"sha256-([0-9a-f]{64})")


def models_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS", Path.home() / ".ollama" / "models")).expanduser()


def manifests(root: Path) -> dict[str, Path]:
    """'name:tag' -> manifest file, for every model the install has ('namespace/name:tag' outside library)."""
    found = {}
    base = root / "manifests"
    for path in sorted(base.glob("*/*/*/*")) if base.is_dir() else []:
        registry, namespace, name, tag = path.relative_to(base).parts
        short = name if (registry, namespace) == (DEFAULT_REGISTRY, DEFAULT_NAMESPACE) else f"{namespace}/{name}"
        found[f"{short}:{tag}" if registry == DEFAULT_REGISTRY else f"{registry}/{short}:{tag}"] = path
    return found


def model_digest(manifest: Path) -> str | None:
    """The digest ('sha256:<hex>') of a manifest's model layer, or None if it has none or cannot be read."""
    try:
        layers = json.loads(manifest.read_text()).get("layers", [])
    except (OSError, ValueError, AttributeError):
        return None
    return next((layer.get("digest") for layer in layers if isinstance(layer, dict)
                 and layer.get("mediaType") == MODEL_LAYER), None)


def blob_name(blob: Path) -> str | None:
    """The 'name:tag' whose manifest lists this blob as its model, if it lies in an Ollama blobs folder."""
    match = BLOB_NAME.fullmatch(blob.name)
    if match is None or blob.parent.name != "blobs":
        return None
    digest = f"sha256:{match.group(1)}"
    return next((name for name, manifest in manifests(blob.parent.parent).items()
                 if model_digest(manifest) == digest), None)


def resolve(spec: str) -> tuple[Path, str]:
    """(blob path, 'name:tag') for 'ollama:NAME[:TAG]'; ModelLoadError naming what is missing."""
    name = spec[len(PREFIX):]
    if ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    root = models_root()
    known = manifests(root)
    if name not in known:
        have = ", ".join(known) or "none"
        raise ModelLoadError(f"{spec}: no Ollama model {name!r} in {root} (it has: {have}); pull it with "
                             f"`ollama pull`, or set OLLAMA_MODELS to the folder that holds it")
    digest = model_digest(known[name])
    if digest is None or not digest.startswith("sha256:"):
        raise ModelLoadError(f"{spec}: the manifest {known[name]} lists no model layer ({MODEL_LAYER})")
    blob = root / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise ModelLoadError(f"{spec}: the model blob {blob} is missing; pull the model again with `ollama pull`")
    return blob, name
