"""The judgement of a `kvtool bench peers` pass (pure Python): each engine's figures as flat metrics, kvtool's
ratios to every peer, the pairs of equal precision (kvtool fp32 / vLLM fp32, kvtool-bf16 / vLLM bf16,
kvtool-int4 / llama.cpp at 4 bits), the best variant of each engine against the best of another, and the
targets, equal precision first. A target whose figures were not all measured is "not measured", never met.
"""

from __future__ import annotations

from kvtool.bench.peers.config import CLIENT_LOADS
from kvtool.bench.peers.vllm_client import result_key

KVTOOL = ("kvtool", "kvtool-bf16", "kvtool-int4")  # in the order the pairs are reported
CLIENT_ROWS = ("vllm-bench", *CLIENT_LOADS)  # the `bench serve` workloads, one row of figures each
# what an equal-precision row is judged on: {metric suffix: label}; ratios > 1 favour kvtool
ROW_METRICS = {"output_tok_s": "output tok/s", "median_tpot_ms": "TPOT p50", "median_ttft_ms": "TTFT p50",
               "p90_ttft_ms": "TTFT p90"}
CLIENT_TIMES = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


# entries whose name does not start with their engine: vLLM's engine behind kvtool's server is neither kvtool's
# engine nor vLLM's own server, so it is judged as an engine of its own
FAMILIES = {"kvtool-vllm": "kvtool-vllm"}


def family(engine: str) -> str:
    """The engine an entry is a variant of: kvtool-int4 -> kvtool, vllm-bf16 -> vllm, kvtool-vllm -> itself."""
    return FAMILIES.get(engine, engine.split("-")[0])


def metrics(results: dict) -> dict[str, tuple[float, bool]]:
    """{metric: (value, higher is better)} of one engine's results, flat, for ratios."""
    out = {}
    for key, value in results.items():
        if key == "decode_tok_s":
            out[key] = (value["median"], True)
        elif key.startswith("ttft_ms_") or key == "prefix_hit_ms":
            out[key] = (value["median"], False)
        elif key.startswith("streams_"):
            out[f"{key}_tok_s"] = (value["tok_s"]["median"], True)
            for m in ("itl_ms_p50", "itl_ms_p99"):
                if value.get(m) is not None:
                    out[f"{key}_{m}"] = (value[m], False)
        elif key == "memory":
            out["memory_rss_mib"] = (value["rss_mib"], False)
        elif key in map(result_key, CLIENT_ROWS) and isinstance(value, dict):
            out[f"{key}_output_tok_s"] = (value.get("output_throughput"), True)
            for m in CLIENT_TIMES:
                out[f"{key}_{m}"] = (value.get(m), False)
        elif key == "layouts":
            for name, row in value.items():
                out[f"layout_{name}_ttft_ms_p50"] = (row["ttft_ms_p50"], False)
                if row.get("hit_rate_after_first") is not None:
                    out[f"layout_{name}_hit_after_first"] = (row["hit_rate_after_first"], True)
    return out


def ratio(ours: tuple[float, bool], theirs: tuple[float, bool]) -> float | None:
    """> 1: ours is better (faster, or more tokens cached). None where a value is 0 or missing."""
    (a, higher), (b, _) = ours, theirs
    if a is None or b is None:
        return None
    if higher:
        return round(a / b, 3) if b else (1.0 if a == b else None)
    return round(b / a, 3) if a else None


def _flat(engines: dict) -> dict[str, dict]:
    return {name: metrics(e.get("results", {})) for name, e in engines.items() if e.get("status") == "ok"}


def ratios(engines: dict) -> dict:
    """{kvtool variant: {peer: {metric: ratio}}} over the metrics both measured."""
    flat = _flat(engines)
    return {k: {p: {m: ratio(flat[k][m], flat[p][m]) for m in flat[k] if m in flat[p]}
                for p in flat if p not in KVTOOL} for k in KVTOOL if k in flat}


def pairs(engines: dict) -> list[dict]:
    """Each kvtool variant beside every peer of its precision (the entries' "precision"), both run:
    [{"precision", "kvtool", "peer", "ratios": {metric: ratio}}]."""
    rs = ratios(engines)
    return [{"precision": engines[k]["precision"], "kvtool": k, "peer": p, "ratios": rs[k][p]}
            for k in KVTOOL if k in rs for p in rs[k] if engines[p].get("precision") == engines[k].get("precision")]


def best(engines: dict) -> dict:
    """Per peer engine (vllm, llama.cpp, transformers), kvtool's best variant against that engine's best variant on
    every metric both measured: {engine: {metric: {"ratio", "kvtool", "peer"}}}."""
    flat, out = _flat(engines), {}

    def top(names, metric):
        have = [(flat[n][metric], n) for n in names if flat[n].get(metric, (None,))[0] is not None]
        return max(have, key=lambda vn: vn[0][0] if vn[0][1] else -vn[0][0], default=None)

    ours = [n for n in flat if n in KVTOOL]
    for fam in dict.fromkeys(family(n) for n in flat if n not in KVTOOL):
        theirs = [n for n in flat if n not in KVTOOL and family(n) == fam]
        rows = {}
        for m in dict.fromkeys(m for n in ours for m in flat[n]):
            a, b = top(ours, m), top(theirs, m)
            if a and b:
                rows[m] = {"ratio": ratio(a[0], b[0]), "kvtool": a[1], "peer": b[1]}
        if ours and rows:
            out[fam] = rows
    return out


def judge(label: str, got: dict[str, float | None], names: dict[str, str], why: str = "") -> dict:
    """One target row over several ratios (>= 1.0 each): missed if any measured one is below 1, else not measured
    if one is missing (why says what did not run), else met; the ratio shown is the lowest measured."""
    low = min(((r, m) for m, r in got.items() if r is not None), default=None)
    missing = [names[m] for m, r in got.items() if r is None]
    status = "missed" if low and low[0] < 1.0 else "not measured" if missing or not low else "met"
    detail = [f"lowest: {names[low[1]]}" if low and len(got) > 1 else "",
              f"not measured: {', '.join(missing)}{f' ({why})' if why else ''}" if missing else ""]
    return {"target": label, "ratio": low and low[0], "detail": "; ".join(d for d in detail if d) or "-",
            "status": status}


def client_load(config: dict, workload: str) -> dict | None:
    """A `bench serve` workload's sizes (config.ClientLoad's fields) from a record's config; None if it has none."""
    if workload != "vllm-bench":
        return config.get("client_loads", {}).get(workload)
    fields = ("prompts", "prefix_tokens", "input_tokens", "output_tokens", "concurrency")
    return {k: config[f"client_{k}"] for k in fields} if "client_prompts" in config else None


def _partner(engines: dict, kvtool: str, peer_family: str, precision: str) -> tuple[str | None, str]:
    """The engine of peer_family at ``precision`` that ran beside ``kvtool``, or None and why not."""
    found = [n for n, e in engines.items() if family(n) == peer_family and e.get("precision") == precision]
    ok = [n for n in found if engines[n].get("status") == "ok"]
    if (engines.get(kvtool) or {}).get("status") != "ok":
        return None, f"{kvtool} did not run"
    return (ok[0], "") if ok else (None, f"no {peer_family} at {precision} ran")


def equal_precision(record: dict) -> list[dict]:
    """The targets at equal precision: kvtool fp32 and bf16 >= 1.0x vLLM at the same dtype on every `bench serve`
    row (output tok/s, TPOT p50, TTFT p50 and p90); kvtool-int4 >= 1.0x llama.cpp at 4 bits on bs=1 decode (1 /
    TPOT) and on every concurrent row."""
    rs, engines, rows = record["ratios"], record["engines"], []
    concurrent = [w for w in CLIENT_ROWS if (client_load(record["config"], w) or {}).get("concurrency", 0) > 1]
    for kvtool, peer_family, precision, workloads in (("kvtool", "vllm", "fp32", CLIENT_ROWS),
                                                       ("kvtool-bf16", "vllm", "bf16", CLIENT_ROWS),
                                                       ("kvtool-int4", "llama.cpp", "int4", concurrent)):
        peer, why = _partner(engines, kvtool, peer_family, precision)
        got = rs.get(kvtool, {}).get(peer, {}) if peer else {}
        name = f"{kvtool} >= 1.0x {peer or peer_family} at {precision}"
        if kvtool == "kvtool-int4":
            rows.append(judge(f"{name}: bs=1 TPOT (decode tok/s)", {"d": got.get("decode_tok_s")},
                              {"d": "decode tok/s"}, why or "the decode workload did not run"))
        for w in workloads:
            keys = {f"{result_key(w)}_{m}": label for m, label in ROW_METRICS.items()}
            rows.append(judge(f"{name}: {w} ({', '.join(ROW_METRICS.values())})",
                              {m: got.get(m) for m in keys}, keys, why or f"{w} did not run for both"))
    return rows


def targets(record: dict) -> list[dict]:
    """The targets on this pass's ratios, equal precision first (equal_precision), then kvtool's best variant
    against vLLM's best, cold TTFT and the cached share per context layout: met, missed or not measured."""
    rs, engines, rows = record["ratios"], record["engines"], equal_precision(record)

    def row(label, value, detail, ok=None):
        status = "not measured" if value is None else ("met" if (value >= 1.0 if ok is None else ok) else "missed")
        rows.append({"target": label, "ratio": value, "detail": detail, "status": status})

    vs_vllm = record["best"].get("vllm", {})
    worst = min(((v["ratio"], m, v["kvtool"], v["peer"]) for m, v in vs_vllm.items() if v["ratio"] is not None),
                default=None)
    row("best kvtool variant >= 1.0x best vLLM on every metric", worst and worst[0],
        f"lowest: {worst[1]} ({worst[2]} / {worst[3]})" if worst else "vLLM or kvtool did not run")
    length = max(record["config"]["ttft_lengths"])
    found = [(rs[k]["llama.cpp"][f"ttft_ms_{length}"], k) for k in KVTOOL
             if rs.get(k, {}).get("llama.cpp", {}).get(f"ttft_ms_{length}") is not None]
    r, k = max(found) if found else (None, None)
    row(f"cold TTFT at {length} tokens >= 1.0x llama.cpp", r, f"llama.cpp / {k} ms" if k else "not measured")
    ours = next(((engines[k].get("results") or {}).get("layouts") for k in KVTOOL
                 if (engines.get(k, {}).get("results") or {}).get("layouts")), None)
    peers = {n: e["results"]["layouts"] for n, e in engines.items()
             if n not in KVTOOL and e.get("status") == "ok" and "layouts" in e.get("results", {})}
    if ours and peers:
        short, worst = [], 1.0
        for name, mine in ours.items():
            top = max(((p[name].get("hit_rate_after_first") or 0.0, n) for n, p in peers.items() if name in p),
                      default=(0.0, None))
            have = mine.get("hit_rate_after_first") or 0.0
            if top[0] > 0:
                worst = min(worst, have / top[0])
            if have + 1e-9 < top[0]:
                short.append(f"{name} ({100 * have:.1f}% vs {top[1]} {100 * top[0]:.1f}%)")
        row("cached-token share per context layout >= best peer", round(worst, 3),
            "every layout" if not short else "behind on " + ", ".join(short), ok=not short)
    else:
        row("cached-token share per context layout >= best peer", None, "no layouts from kvtool and a peer")
    return rows
