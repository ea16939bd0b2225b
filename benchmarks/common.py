"""Shared benchmark protocol for the scripts in this folder (one implementation: kvtool.bench.protocol)."""

from kvtool.bench.protocol import device_name, emit, measure, percentile, summary, sync, versions

__all__ = ["device_name", "emit", "measure", "percentile", "summary", "sync", "versions"]
