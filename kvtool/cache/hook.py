"""The Engine's prefix-cache hook, typed: what the scheduler calls on whatever gives a request its starting KV.

Two implement it: PrefixCache (cache/manager.py) and the skill splicer (skills/splice.py), which wraps one.
The engine checks a hook when it is set, so a hook that lacks a method is refused then, naming it, instead of
failing in the middle of a batch.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from kvtool.cache.kv import KVCache

METHODS = ("prepare", "publish", "commit")  # and, optional, fork (PrefixCache.fork: the n choices of a prompt)


class PrefixHook(Protocol):
    def prepare(self, prompt_ids: Sequence[int], runner) -> tuple[KVCache, int, Any]:
        """(a KVCache the request owns, how many leading prompt tokens it already holds, a handle): the handle
        holds what the KV came from until commit()."""
        ...

    def publish(self, handle: Any, token_ids: Sequence[int], cache: KVCache) -> None:
        """A running request's prompt is prefilled: share it with later requests and keep the hold."""
        ...

    def commit(self, handle: Any, token_ids: Sequence[int], cache: KVCache) -> None:
        """The request ended (finished, aborted or preempted): keep what it computed and drop the hold. Never
        raises because of caching."""
        ...


def checked_hook(hook):
    """`hook` if it is None or has every method of a PrefixHook; else a TypeError that names what it lacks."""
    missing = [] if hook is None else [name for name in METHODS if not callable(getattr(hook, name, None))]
    if not missing:
        return hook
    raise TypeError(f"prefix_cache: a {type(hook).__name__} lacks {', '.join(missing)}; a prefix-cache hook has "
                    "prepare(prompt_ids, runner), publish(handle, token_ids, cache) and commit(handle, token_ids, "
                    "cache) (kvtool.cache.hook.PrefixHook)")
