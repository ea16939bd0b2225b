"""The connector's counters as vLLM collects them: KvtoolStats travels from the connector's halves to vLLM's
logger process (summed per interval, logged as "KV Transfer metrics"), and KvtoolPromMetrics adds them to vLLM's
Prometheus /metrics as vllm:kvtool_<name>_total counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTERS = {
    "store_tokens": "prompt tokens the connector supplied from the shared block store",
    "block_tokens": "prompt tokens the connector supplied from mounted skill blocks",
    "composed_requests": "requests with at least one skill block supplied",
    "saved_blocks": "KV blocks the connector queued for the store",
    "dropped_blocks": "KV blocks not saved because the store's writer was behind",
    "load_errors": "vLLM blocks whose KV the store no longer held (recomputed by vLLM)",
    "load_ms": "milliseconds the workers spent writing supplied KV into vLLM's pages (a loader thread, "
               "beside the other requests' steps, unless load is 'sync')",
    "save_ms": "milliseconds the workers spent copying prompts' KV out of vLLM's pages, after the forward",
}


@dataclass
class KvtoolStats(KVConnectorStats):
    def __post_init__(self):
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, **counts: int) -> None:
        for name, n in counts.items():
            self.data[name] += n

    def reset(self):
        self.data = {name: 0 for name in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> "KvtoolStats":
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 1) if isinstance(v, float) else v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> "KvtoolStats | None":
        """These counts as a new object (for vLLM), this one reset; None when there is nothing to report."""
        if self.is_empty():
            return None
        out = KvtoolStats(dict(self.data))
        self.reset()
        return out


class KvtoolPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {name: self._counter_cls(name=f"vllm:kvtool_{name}_total", documentation=doc,
                                                  labelnames=labelnames) for name, doc in COUNTERS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for name, n in transfer_stats_data.items():
            if name in self._counters and n:
                self._counters[name].labels(*labels).inc(n)
