"""KvtoolSide: what the vLLM connector serves from, shared by its scheduler and worker halves in this process.

It holds kvtool's own model (its runner composes skill blocks, prefills the text between them and runs the
repairs), the skill catalog (the same compiled .kvb blocks kvtool's engine splices), and, with --cache-file,
a kvtool PrefixCache used as the store behind vLLM's prefix cache: every finished prompt's KV is copied
there, saved in kvtool's .kvc format, and loaded back at start, so a restarted server supplies known
prefixes from it. Each request's accounting (what vLLM's cache, the store and the blocks supplied, and the
path taken) waits in `accounts` for the serving worker.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from kvtool.engines.vllm.plan import Plan, plan_request

log = logging.getLogger("kvtool.serving")

MAX_ACCOUNTS = 4096


@dataclass
class Account:
    local: int = 0  # vLLM's prefix cache
    stored: int = 0  # the kvtool store (cache file) beyond vLLM's hit
    block_tokens: int = 0  # skill-block tokens supplied with reused KV
    recomputed: int = 0  # skill-block tokens the repair recomputed
    gap_tokens: int = 0  # text between blocks (and a query-guided repair's query) prefilled by kvtool's runner
    path: str = "prefill"
    blocks: tuple = ()
    compose_ms: float = 0.0
    skill_path: str = "prefilled"  # composed | prefilled | cached, as kvtool's engine reports it
    skill_reason: str = ""


class KvtoolSide:
    def __init__(self, model, catalog=None, repair="none", store=None, min_block_tokens: int = 0,
                 chunk: int = 512):
        from kvtool.skills.repair import make_repair

        self.model, self.catalog, self.store = model, catalog, store
        self.repair = make_repair(repair)
        self.min_block_tokens, self.chunk = min_block_tokens, chunk
        self.accounts: dict[str, Account] = {}
        self._lock = threading.Lock()

    @property
    def runner(self):
        return self.model.runner

    def plan(self, prompt: list[int], local: int) -> Plan:
        from kvtool.skills.repair import is_query_guided

        stored = self.store.cached_tokens(prompt[:-1]) if self.store is not None else 0
        find = self.catalog.index.find if self.catalog is not None else (lambda ids: [])
        return plan_request(prompt, local, stored, find, self.min_block_tokens, is_query_guided(self.repair))

    def account(self, request_id: str, plan: Plan) -> Account:
        acc = Account(local=plan.local, path=plan.path, blocks=tuple(plan.block_names), skill_path=plan.skill_path,
                      skill_reason=plan.skill_reason)
        if plan.path == "stored":
            acc.stored = plan.ready - plan.local
        elif plan.path == "splice":
            acc.stored = max(0, min(plan.stored, plan.cut) - plan.local)
        with self._lock:
            self.accounts[request_id] = acc
            while len(self.accounts) > MAX_ACCOUNTS:  # requests aborted before their first token
                self.accounts.pop(next(iter(self.accounts)))
        return acc

    def take_account(self, request_id: str) -> Account | None:
        """The account of the request the serving worker added as `request_id` (vLLM appends "-<suffix>")."""
        with self._lock:
            for key in list(self.accounts):
                if key == request_id or key.rsplit("-", 1)[0] == request_id:
                    return self.accounts.pop(key)
            return None

    @torch.inference_mode()
    def supply(self, prompt: list[int], plan: Plan, read_local, acc: Account):
        """(keys, values) [L, H, ready - local, D] for positions [local, ready). read_local(end) reads vLLM's KV of
        [0, end) for end <= plan.local; the store gives what it holds beyond."""
        import time

        from kvtool.skills.compose import compose_segments

        t0 = time.perf_counter()
        runner, handle = self.runner, None
        base = min(plan.cut, plan.ready)
        if self.store is not None and plan.stored > plan.local:
            cache, hit, handle = self.store.prepare(prompt, runner)
            cache.truncate(min(hit, base))
        else:
            cache = runner.new_cache(plan.ready + 64)
        try:
            if cache.offset < base:  # vLLM's pages hold what the store does not
                if base > plan.local:
                    raise RuntimeError(f"the store no longer holds the {plan.stored} tokens planned")
                cache.truncate(0)
                if base:
                    keys, values = read_local(base)
                    cache.reserve(plan.ready + 64)
                    cache.append_all(keys.to(runner.dtype), values.to(runner.dtype))
            if plan.segments:
                segments = [self.catalog.block(x) if kind == "block" else x for kind, x in plan.segments]
                done = compose_segments(runner, segments, self.repair, cache=cache, logits="none", chunk=self.chunk)
                acc.block_tokens, acc.recomputed = done.reused_tokens, done.recomputed_tokens
                acc.gap_tokens = done.prefilled_tokens
            if cache.offset < plan.ready:
                raise RuntimeError(f"the connector composed {cache.offset} tokens, short of the {plan.ready} planned")
            acc.compose_ms = (time.perf_counter() - t0) * 1000.0
            return cache.stacked(plan.local, plan.ready)
        finally:
            if handle is not None:
                self.store.commit(handle, [], cache)  # releases the store's hold; inserts nothing

    def keep(self, tokens: list[int], read) -> int:
        """Copy the whole store blocks of `tokens` that the store lacks into it; read(start, end) gives vLLM's KV
        (keys, values) [L, H, end - start, D]. Returns the tokens the store holds."""
        if self.store is None:
            return 0
        bs = self.store.block_size
        whole = len(tokens) // bs * bs
        if not whole:
            return 0

        def block_kv(i):
            keys, values = read(i * bs, (i + 1) * bs)
            return keys.to(self.store.store.dtype), values.to(self.store.store.dtype)

        return self.store.import_chain(tokens[:whole], block_kv)
