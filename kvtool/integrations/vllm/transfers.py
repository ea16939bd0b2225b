"""A worker half's transfers off vLLM's step: one daemon thread per direction (KV written into a request's pages,
or copied out of them) that vLLM polls through the connector's get_finished."""

from __future__ import annotations

import logging
import queue
import threading

import torch

log = logging.getLogger("kvtool.serving")


class Transfers:
    """A worker half's daemon thread running `work(layers, item)` for each queued request in order; take() hands back
    the requests done since the last call and those still queued or running, as one snapshot."""

    def __init__(self, name: str, work, layers: list):
        self._queue: queue.Queue = queue.Queue()
        self._work, self._layers = work, layers
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._done: set[str] = set()
        threading.Thread(target=self._run, daemon=True, name=name).start()

    def put(self, request_id: str, item) -> None:
        with self._lock:
            self._pending.add(request_id)
        self._queue.put((request_id, item))

    @torch.inference_mode()
    def _run(self) -> None:
        while True:
            request_id, item = self._queue.get()
            try:
                self._work(self._layers, item)
            except Exception:  # a failed transfer is done too: vLLM must get the request's pages back
                log.exception("kvtool connector: a KV transfer failed (%s)", request_id)
            finally:
                with self._lock:
                    self._pending.discard(request_id)
                    self._done.add(request_id)

    def take(self) -> tuple[set[str], set[str]]:
        with self._lock:
            done, self._done = self._done, set()
            return done, set(self._pending)
