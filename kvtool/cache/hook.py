"""The Engine's prefix-cache hook, typed: what the scheduler calls on whatever gives a request its starting KV.

Two implement it: PrefixCache (cache/manager.py) and the skill splicer (skills/splice.py), which wraps one.
Both subclass PrefixHook, so they inherit the optional members' defaults. Any other object with the three
required methods is accepted too: the engine checks a hook when it is set, refusing one that lacks a required
method (naming it) instead of failing in the middle of a batch, and gives one that lacks an optional member
PrefixHook's default for it by wrapping it (DefaultsFor), so the engine calls every member without probing.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from kvtool.cache.kv import KVCache

METHODS = ("prepare", "publish", "commit")  # required
OPTIONAL = ("fork", "splice_stats")  # PrefixHook's defaults stand in for those a hook lacks


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

    def fork(self, cache: KVCache, token_ids: Sequence[int], runner) -> tuple[KVCache, Any]:
        """(a copy of `cache`, which holds the KV of `token_ids`, for one more of the n choices of that prompt, a
        handle for commit()). Optional: by default a whole copy (KVCache.fork) that holds nothing."""
        return cache.fork(), None

    def splice_stats(self, handle: Any):
        """The skill splicer's stats (kvtool.skills.splice.SpliceStats) of the request prepare() gave `handle`,
        which split its ready tokens into prefix hit and skill blocks. Optional: by default None (all a hit)."""
        return None


class DefaultsFor(PrefixHook):
    """A hook that has the required methods but not every optional one, given PrefixHook's defaults for those it
    lacks; every other attribute is the wrapped hook's."""

    def __init__(self, hook):
        self.hook = hook
        for name in METHODS + OPTIONAL:
            if has(hook, name):
                setattr(self, name, getattr(hook, name))

    def __getattr__(self, name: str):  # only for names the wrapper lacks
        if name == "hook":  # (not set yet: e.g. while copy or pickle builds one)
            raise AttributeError(name)
        return getattr(self.hook, name)


def has(hook, name: str) -> bool:
    return callable(getattr(hook, name, None))


def checked_hook(hook) -> PrefixHook | None:
    """`hook` as a PrefixHook with every member: None stays None, a hook with all of them (a PrefixHook subclass
    inherits the optional ones) is kept, one with the required methods only is wrapped in DefaultsFor; else a
    TypeError that names what it lacks."""
    missing = [] if hook is None else [name for name in METHODS if not has(hook, name)]
    if missing:
        raise TypeError(f"prefix_cache: a {type(hook).__name__} lacks {', '.join(missing)}; a prefix-cache hook has "
                        "prepare(prompt_ids, runner), publish(handle, token_ids, cache) and commit(handle, token_ids, "
                        "cache) (kvtool.cache.hook.PrefixHook)")
    return hook if hook is None or all(has(hook, name) for name in OPTIONAL) else DefaultsFor(hook)
