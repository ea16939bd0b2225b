"""KV storage and prefix-cache bookkeeping."""

_LAZY = {"PrefixCache": "kvtool.cache.manager", "attach_prefix_cache": "kvtool.cache.manager"}


def __getattr__(name: str):  # `from kvtool.cache import PrefixCache` without importing the manager eagerly
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvtool.cache' has no attribute {name!r}")
