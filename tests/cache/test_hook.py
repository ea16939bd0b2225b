"""checked_hook: what the engine keeps as its prefix-cache hook, so the engine calls every member without probing."""

import pytest

from kvtool.cache.hook import DefaultsFor, PrefixHook, checked_hook
from kvtool.cache.manager import PrefixCache
from kvtool.skills.splice import SkillSplicer, SpliceHandle, SpliceStats


class Required:
    """A hook with the required methods only, and an attribute of its own."""

    label = "mine"

    def prepare(self, prompt_ids, runner):
        return None, 0, "handle"

    def publish(self, handle, token_ids, cache): ...

    def commit(self, handle, token_ids, cache): ...


class Forks(Required):
    def fork(self, cache, token_ids, runner):
        return "own fork", "hold"


class Copyable:
    def fork(self):
        return "whole copy"


def test_a_hook_without_the_optional_members_gets_the_defaults_and_keeps_its_own():
    hook = Required()
    kept = checked_hook(hook)
    assert isinstance(kept, DefaultsFor) and kept.hook is hook and kept.label == "mine"
    assert kept.prepare([1, 2], None) == (None, 0, "handle")
    assert kept.fork(Copyable(), [1, 2], None) == ("whole copy", None)  # a whole copy, no hold
    assert kept.splice_stats("handle") is None
    partial = checked_hook(Forks())  # its own fork stays; only splice_stats is the default
    assert partial.fork(Copyable(), [1], None) == ("own fork", "hold") and partial.splice_stats(None) is None


def test_the_hooks_kvtool_ships_are_kept_as_they_are():
    cache = PrefixCache(1, 1, 4, budget_bytes=1 << 16)
    splicer = SkillSplicer(catalog=None, inner=cache)
    assert checked_hook(cache) is cache and checked_hook(splicer) is splicer and checked_hook(None) is None
    assert PrefixHook in PrefixCache.__mro__ and cache.splice_stats("handle") is None  # the default, inherited
    stats = SpliceStats(prompt_tokens=5)
    assert splicer.splice_stats(SpliceHandle(None, stats)) is stats and splicer.splice_stats(None) is None


def test_a_hook_without_a_required_method_is_refused():
    class NoCommit:
        def prepare(self, prompt_ids, runner): ...

        def publish(self, handle, token_ids, cache): ...

        def fork(self, cache, token_ids, runner): ...

    with pytest.raises(TypeError, match="a NoCommit lacks commit; a prefix-cache hook has"):
        checked_hook(NoCommit())
