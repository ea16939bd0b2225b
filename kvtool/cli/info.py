"""`kvtool info`: the installed versions and lock (`--versions`), or model shape, dtype, weights, device, KV bytes per token, weight bytes per decode step, matmul
and decode-step paths."""

from __future__ import annotations

from kvtool.cli.common import add_model_args, load_from_args


def register(subparsers) -> None:
    p = subparsers.add_parser("info", help="print model shape, dtype, device and KV bytes per token")
    add_model_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--versions", action="store_true",
                   help="print kvtool's key package versions and the lock the venv was installed from; loads no model")
    p.set_defaults(func=run)


def describe(model) -> dict:
    s = model.spec
    from kvtool.kernels.quant import Int4Weight

    runner, bf16 = model.runner, model.runner.weights == "bf16"
    held_once = [w for w in runner._packed_weights() if w.held is None or bf16]  # not module parameters
    held_once += [w for w, _ in runner._weight_slots() if isinstance(w, Int4Weight) and w.held is None]
    params = sum(p.numel() for p in model.runner.parameters()) + sum(w.shape.numel() for w in held_once)
    return {
        "model": model.name, "folder": str(model.folder), "family": s.model_type,
        "parameters": params, "layers": s.num_layers, "hidden": s.hidden_size,
        "intermediate": s.intermediate_size, "q_heads": s.num_heads, "kv_heads": s.num_kv_heads,
        "head_dim": s.head_dim, "vocab": s.vocab_size, "context_window": s.max_position,
        "rope_theta": s.rope_theta, "rope_type": s.rope.get("rope_type", "default"), "qk_norm": s.qk_norm,
        "tied_embeddings": s.tie_word_embeddings, "dtype": model.info["dtype"], "weights": model.runner.weights,
        "decode_weight_bytes": model.runner.decode_weight_bytes(), "device": model.info["device"],
        "matmuls": matmul_path(model.runner),
        "decode_steps": "C++ ops (kvtool.kernels.cpu_decode)" if model.runner.cpu_decode else "reference forward",
        "kv_bytes_per_token": model.kv_bytes_per_token, "chat_template": bool(model.chat_template),
    }


def matmul_path(runner) -> str:
    from kvtool.kernels import cpu_decode
    from kvtool.kernels.quant import BF16_WIDE_MAX_ROWS, MAX_ROWS

    half = runner.cpu_gemm_packed and runner._head_packed.half
    dense = ("oneDNN packed" + " bf16" * half) if runner.cpu_gemm_packed else "torch F.linear"
    if runner.weights == "bf16":
        return "oneDNN packed bf16 (x and products rounded to bf16); the head's few rows in the C++ gemv (fp32 x)"
    kernel = "C++ gemv_q4" if cpu_decode.loaded() else "torch's int4 kernel"
    most = BF16_WIDE_MAX_ROWS if half else MAX_ROWS
    return dense if runner.weights == "dense" else f"int4 ({kernel}) up to {most} rows, {dense} above"


def run(args) -> int:
    import json

    if args.versions:
        from kvtool.version import install_record

        info = install_record()
        if not args.json:
            lock = info.pop("lock")
            info.update(info.pop("packages"))
            info["lock"] = (f"{', '.join(lock['files'])} sha256 {lock['sha256']}, {lock['pins']} pins, "
                            f"{len(lock['differ'])} differ" if lock else "none (not set up by scripts/setup.sh)")
            if lock and lock["differ"]:
                info["differ"] = ", ".join(f"{k} {v['installed']} (lock {v['lock']})" for k, v in lock["differ"].items())
    else:
        info = describe(load_from_args(args))
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0
