"""The Redis (or Valkey) block store: ``redis://[:password@]host:port/db``, for engines on several machines.

One string key per block, ``kvtool:block:<key>``, written with SET NX: Redis applies each command whole, so a
reader gets a whole record or none, and the second writer of a key changes nothing. The size limit is the
server's own: its ``maxmemory`` with ``maxmemory-policy allkeys-lru`` evicts the least recently used blocks, and
a read (GET, TOUCH) makes a block recent. The client speaks the few RESP commands it needs over one socket, so
the store needs no package beyond Python.
"""

from __future__ import annotations

import socket
import threading
from typing import Iterator, Sequence
from urllib.parse import unquote, urlsplit

from kvtool.cache.kvstore import KVStore
from kvtool.errors import InvalidParameterError

PREFIX = "kvtool:block:"
TIMEOUT_S = 10.0


class RespError(RuntimeError):
    """An error reply from the server (e.g. OOM past maxmemory with a noeviction policy)."""


class Resp:
    """One RESP2 connection: call(*args) sends a command and returns its reply (bytes, int, str, list, None)."""

    def __init__(self, host: str, port: int, timeout: float = TIMEOUT_S):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb")

    def call(self, *args):
        return self.pipeline([args])[0]

    def pipeline(self, commands: Sequence[Sequence]) -> list:
        """Send every command, then read every reply (one round trip); an error reply raises after all are read."""
        out = []
        for args in commands:
            parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
            out.append(b"*%d\r\n" % len(parts))
            for part in parts:
                out += [b"$%d\r\n" % len(part), part, b"\r\n"]
        self.sock.sendall(b"".join(out))
        replies = [self._read() for _ in commands]
        if errors := [r for r in replies if isinstance(r, RespError)]:
            raise errors[0]
        return replies

    def _read(self):
        line = self.reader.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError("redis: the connection closed mid-reply")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return RespError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.reader.read(n + 2)
            if len(data) != n + 2:
                raise ConnectionError("redis: the connection closed mid-reply")
            return data[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._read() for _ in range(n)]
        raise ConnectionError(f"redis: unexpected reply {line[:40]!r}")

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


class RedisStore(KVStore):
    def __init__(self, location: str, limit_bytes: int | None = None):
        if limit_bytes is not None:
            raise InvalidParameterError(f"kv store {location}: a Redis server keeps its own size limit; set its "
                                        "maxmemory and maxmemory-policy allkeys-lru instead of a kvtool limit")
        url = urlsplit(location)
        try:
            self.address = (url.hostname or "127.0.0.1", url.port or 6379)
            self.db = int(url.path.strip("/") or 0)
        except ValueError:
            raise InvalidParameterError(f"kv store {location!r}: expected redis://[:password@]host:port/db") from None
        self.location, self._password = location, unquote(url.password) if url.password else None
        self._lock = threading.Lock()  # one connection: the engine's thread and the store's writer take turns
        self._conn: Resp | None = None
        try:
            self._call("PING")
        except OSError as exc:
            raise InvalidParameterError(f"kv store {location}: no Redis server answers at "
                                        f"{self.address[0]}:{self.address[1]} ({exc})") from None

    def _pipeline(self, commands: Sequence[Sequence]) -> list:
        with self._lock:
            try:
                if self._conn is None:
                    conn = Resp(*self.address)
                    setup = ([("AUTH", self._password)] if self._password else []) + [("SELECT", self.db)]
                    conn.pipeline(setup)
                    self._conn = conn
                return self._conn.pipeline(commands)
            except (OSError, ConnectionError):  # a dropped connection: the next call connects again
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                raise

    def _call(self, *args):
        return self._pipeline([args])[0]

    def get(self, key: str) -> bytes | None:
        return self._call("GET", PREFIX + key)

    def held(self, keys: Sequence[str]) -> int:
        found = self._pipeline([("EXISTS", PREFIX + k) for k in keys]) if keys else []
        return next((i for i, n in enumerate(found) if not n), len(keys))

    def put(self, key: str, record: bytes) -> bool:
        return self._call("SET", PREFIX + key, record, "NX") == "OK"

    def touch(self, keys: Sequence[str]) -> None:
        if keys:  # the last touched is the most recent: a chain's root
            self._call("TOUCH", *[PREFIX + k for k in reversed(keys)])

    def discard(self, key: str) -> None:
        self._call("DEL", PREFIX + key)

    def keys(self) -> Iterator[str]:
        cursor = b"0"
        while True:
            cursor, found = self._call("SCAN", cursor, "MATCH", PREFIX + "*", "COUNT", 1000)
            yield from (k.decode()[len(PREFIX):] for k in found)
            if cursor == b"0":
                return

    def usage(self) -> dict:
        keys = list(self.keys())
        sizes = self._pipeline([("STRLEN", PREFIX + k) for k in keys]) if keys else []
        info = dict(line.split(":", 1) for line in self._call("INFO", "memory").decode().splitlines()
                    if ":" in line)
        limit = int(info.get("maxmemory", 0))
        return {"backend": "redis", "location": self.location, "blocks": len(keys), "bytes": sum(sizes),
                "limit_bytes": limit or None, "used_memory": int(info.get("used_memory", 0)),
                "policy": info.get("maxmemory_policy")}

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
