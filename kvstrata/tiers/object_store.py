"""The object-storage tier: one self-describing object per chunk behind any fsspec URL.

Shared by every node and engine that points at the same URL, so it is how a chunk
outlives a node and how a new node starts warm.

Invariants:
- Names are `<root>/<namespace>/<hh>/<hash hex>-g<group>`: the namespace keeps
  incompatible layouts apart, `hh` (the hash's first byte) fans objects out over 256
  prefixes so no S3 prefix gets hot, and the group index survives. Each namespace has
  `<root>/<namespace>/manifest.json` describing its layout, for tools.
- An object is `[4 KiB record header | payload]` (the disk tier's record header): every
  read is checked against the header's xxh3-128 of namespace ‖ key ‖ payload before
  its bytes are handed out; a mismatch is a miss and a `corrupt_chunks` count.
- No call waits without bound: S3 requests carry connect/read timeouts and at most
  `max_attempts` tries (botocore's adaptive retry mode: exponential backoff with jitter,
  and a client-side rate limit that slows down while the server throttles; pyarrow's
  standard retry strategy). On top, every request has a deadline of `max_attempts x
  (connect + read) + 1 s`: s3fs calls are abandoned by fsspec at that point, and a batch
  stops waiting once that long passes with none of its requests (pyarrow's) finishing. An abandoned GET never
  writes into its buffer afterwards, and an abandoned PUT only holds a private copy, so
  the caller may reuse its slots at once. After a
  failure the tier pauses (doubling up to `backoff_max_seconds`, with jitter): while
  paused, uploads are dropped and reads miss at once, counted, so a dead or black-holed
  server costs one timeout, not one per chunk. The first call after the pause probes it.
- `capacity` and `ttl_seconds` are kept by sweeps (`scan` + `apply_limits`, run by every
  node store each `index_refresh_seconds`): expired objects go, then the oldest-written
  until the rest fit (with `reuse_of` set, the least reused of the oldest few first:
  `reuse_eviction`). S3 keeps no access times, so age is write time, not last use;
  between sweeps the bound can be exceeded by what was uploaded since the last one.
  Deletes are idempotent; with reuse weighing, each node deletes what its own sketch deems least reused.
  A tenant's quota (`quotas:`) is kept the same way, on that tenant's objects only.
- Credentials (`storage_options`, the URL's user info, the standard chain) never reach a log line, an error or stats.

No Ray and no vLLM in here; calls may come from several threads.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import fsspec
import fsspec.asyn
import numpy as np

from kvstrata.config import ObjectTierConfig, secret_values
from kvstrata.keys import key_name, make_key
from kvstrata.namespaces import check_namespace, is_namespace
from kvstrata.tiers.object_clients import open_chunk_client
from kvstrata.tiers.positions import Positions
from kvstrata.tiers.private_files import open_private_filesystem
from kvstrata.tiers.quotas import TenantQuotas
from kvstrata.tiers.records import HEADER_BYTES, record_matches, seal_header
from kvstrata.tiers.reuse_eviction import ReuseOf, least_reused_first
from kvstrata.url_credentials import url_credentials

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# How S3 servers (and SDK errors quoting them) say "too many requests": SlowDown, 503, 429.
THROTTLE_SIGNS = re.compile(r"SlowDown|Throttl|TooManyRequests|RequestLimitExceeded|\b503\b|\b429\b")
S3_PROTOCOLS = ("s3", "s3a")


@dataclass(frozen=True)
class ObjectEntry:
    """One chunk object as a listing sees it."""

    namespace: str
    key: bytes
    path: str
    size: int
    written_at: float  # seconds since the epoch; 0.0 when the filesystem does not say


class _Batch:
    """One put_many/get_many call: whether its caller stopped waiting (and took its buffers
    back), and which requests already counted their own outcome."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False
        self.settled: set[int] = set()

    def settle(self, index: int) -> bool:
        """A request that ended records that it counts its own outcome; False once the batch
        was abandoned (the abandonment counted it as failed already)."""
        with self.lock:
            if self.abandoned:
                return False
            self.settled.add(index)
            return True


def _written_at(info: Mapping[str, Any]) -> float:
    """Write time of a listed object, from whichever field its filesystem fills in."""
    for field in ("LastModified", "mtime", "created", "last_modified"):
        value = info.get(field)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


def open_filesystem(config: ObjectTierConfig) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and root path for the configured URL, with every wait bounded."""
    protocol = config.url.split("://", 1)[0]
    options: dict[str, Any] = dict(config.storage_options)
    if protocol in S3_PROTOCOLS:
        client_kwargs = dict(options.pop("client_kwargs", None) or {})
        if config.endpoint_url:
            client_kwargs.setdefault("endpoint_url", config.endpoint_url)
        config_kwargs = dict(options.pop("config_kwargs", None) or {})
        config_kwargs.setdefault("connect_timeout", config.timeouts.connect_seconds)
        config_kwargs.setdefault("read_timeout", config.timeouts.read_seconds)
        # `total_max_attempts` counts the first try (botocore's `max_attempts` is retries: one more).
        config_kwargs.setdefault("retries", {"total_max_attempts": config.max_attempts, "mode": "adaptive"})
        config_kwargs.setdefault("max_pool_connections", config.max_concurrency)
        options.update(client_kwargs=client_kwargs, config_kwargs=config_kwargs)
    elif protocol in ("file", "local"):
        # A bucket creates "directories" by itself; a local root (a shared filesystem)
        # creates them, and writes objects privately and atomically (private_files.py).
        return open_private_filesystem(config.url, options)
    fs, root = fsspec.core.url_to_fs(config.url, skip_instance_cache=True, **options)
    if protocol in S3_PROTOCOLS:
        # botocore's bounded, jittered retries only: s3fs's own retry loop would multiply
        # them (and it sleeps without jitter).
        fs.retries = 1
    return fs, root.rstrip("/")


class _Positions:
    """A scan's entries by namespace and position, so a sweep can take a hybrid model's
    position whole (see `Positions`); namespaces whose anchor groups are unknown are left out."""

    def __init__(self, entries: list[ObjectEntry], anchors: Mapping[str, frozenset[int]]):
        self._positions: dict[str, Positions] = {}
        self._entries: dict[tuple[str, bytes], ObjectEntry] = {}
        for entry in entries:
            if entry.namespace not in anchors:
                continue
            positions = self._positions.get(entry.namespace)
            if positions is None:
                positions = self._positions[entry.namespace] = Positions()
                positions.set_anchor_groups(anchors[entry.namespace])
            positions.add(entry.key)
            self._entries[(entry.namespace, entry.key)] = entry

    def take(self, entry: ObjectEntry) -> list[ObjectEntry]:
        """`entry` goes: the entries that become dead weight with it."""
        positions = self._positions.get(entry.namespace)
        if positions is None:
            return []
        dependents = positions.dependents(entry.key)
        for key in [entry.key, *dependents]:
            positions.remove(key)
        return [self._entries[(entry.namespace, key)] for key in dependents]


class ObjectTier:
    def __init__(
        self,
        config: ObjectTierConfig,
        clock: Callable[[], float] = time.monotonic,
        filesystem: tuple[fsspec.AbstractFileSystem, str] | None = None,
        wall_clock: Callable[[], float] = time.time,
        quotas: Mapping[str, int] | None = None,
    ):
        self.config = config
        # Object bytes per tenant, from each sweep's listing plus this node's uploads since.
        self.quotas = TenantQuotas(quotas)
        self.fs, self.root = filesystem or open_filesystem(config)
        self._clock = clock
        self._wall_clock = wall_clock
        # Longest first, so a secret that contains another is scrubbed whole; the URL's own user info too.
        self._secrets = sorted({*secret_values(config.storage_options), *url_credentials(config.url)}, key=len, reverse=True)
        # A hard deadline on every call of an async filesystem (s3fs): measured here, an
        # endpoint that accepts connections and never answers outlives botocore's read
        # timeout. fsspec's `sync` abandons the call after this many seconds.
        per_try = config.timeouts.connect_seconds + config.timeouts.read_seconds
        self.request_deadline = config.max_attempts * per_try + 1.0
        self._deadline: dict[str, float] = {}
        if isinstance(self.fs, fsspec.asyn.AsyncFileSystem):
            self._deadline = {"timeout": self.request_deadline}
        self.client, why = open_chunk_client(config, self.fs, self._deadline)
        logger.info(
            "kvstrata object tier %s: chunk PUTs and GETs through %s (%s)", self._scrub(config.url), self.client.name, why
        )
        self._pool = ThreadPoolExecutor(config.max_concurrency, thread_name_prefix="kvstrata-object")
        self._lock = threading.Lock()
        self._paused_until = 0.0
        self._backoff = 0.0
        self.last_error: str | None = None
        self.counters = {
            "puts": 0,
            "put_failures": 0,
            "gets": 0,
            "get_failures": 0,
            "not_found": 0,
            "corrupt_chunks": 0,
            "skipped_while_paused": 0,
            "bytes_put": 0,
            "bytes_got": 0,
            "expired": 0,
            "evicted": 0,
            "evicted_with_anchor": 0,
            "evicted_over_quota": 0,  # a tenant's oldest objects, beyond its quota
            "backoffs": 0,  # failures that paused (or kept pausing) the tier
            "throttled": 0,  # failures that were the server saying "slow down" (503/429)
        }
        # namespace -> its full-attention groups (see `Positions`), as engines tell them
        self._anchor_groups: dict[str, frozenset[int]] = {}
        # Set by the node store with a reuse sketch (admission.store: reuse): capacity sweeps spare reused chunks.
        self.reuse_of: ReuseOf | None = None

    # --- names ---------------------------------------------------------------------------

    def object_path(self, namespace: str, key: bytes) -> str:
        name = key_name(key)
        return f"{self.namespace_dir(namespace)}/{name[:2]}/{name}"

    def namespace_dir(self, namespace: str) -> str:
        """`<root>/<namespace>`, only for a valid namespace (never the root, never another's)."""
        return f"{self.root}/{check_namespace(namespace)}"

    @staticmethod
    def key_of(path: str) -> bytes | None:
        """The chunk key an object name stands for, or None for anything else."""
        name = path.rsplit("/", 1)[-1]
        digest, sep, group = name.rpartition("-g")
        if not sep or not group.isdigit():
            return None
        try:
            return make_key(bytes.fromhex(digest), int(group))
        except ValueError:
            return None

    # --- chunks --------------------------------------------------------------------------

    def put_many(self, namespace: str, items: list[tuple[bytes, np.ndarray]]) -> list[bool]:
        """Upload chunks concurrently; True for each one now readable by every node."""
        return self._fan_out(self._put, "upload", namespace, items)

    def get_many(self, namespace: str, items: list[tuple[bytes, np.ndarray]]) -> list[bool]:
        """Download and verify chunks into `out` buffers; False is a miss (absent, corrupt, failed)."""
        return self._fan_out(self._get, "download", namespace, items)

    def remove(self, namespace: str, key: bytes) -> bool:
        check_namespace(namespace)
        try:
            self.fs.rm_file(self.object_path(namespace, key), **self._deadline)
            return True
        except FileNotFoundError:
            return False
        except Exception as exc:  # noqa: BLE001 - a failed removal leaves garbage, never a wrong hit
            self._failed("remove", exc)
            return False

    def list_keys(self, namespace: str) -> set[bytes] | None:
        """Every chunk of a namespace in the store, or None when the store cannot be listed now."""
        check_namespace(namespace)
        if not self._admit(1):
            return None
        try:
            paths = self.fs.find(self.namespace_dir(namespace), **self._deadline)
        except FileNotFoundError:
            return set()
        except Exception as exc:  # noqa: BLE001
            self._failed("list", exc)
            return None
        self._succeeded()
        return {key for key in map(self.key_of, paths) if key is not None}

    def scan(self) -> list[ObjectEntry] | None:
        """Every chunk object under the root, all namespaces; None when the store cannot be listed now."""
        if not self._admit(1):
            return None
        try:
            found = self.fs.find(self.root, detail=True, **self._deadline)
        except FileNotFoundError:
            return []
        except Exception as exc:  # noqa: BLE001
            self._failed("list", exc)
            return None
        self._succeeded()
        entries = []
        for path, info in found.items():
            key = self.key_of(path)
            namespace = path[len(self.root) :].lstrip("/").split("/", 1)[0]
            # A dot-named prefix is no namespace (namespaces are hex digests): it holds
            # scratch objects (`kvstrata bench`), which a sweep must neither count
            # against `capacity` nor delete while they are being measured; nor is any
            # other name no engine could have registered (`kvstrata.namespaces`).
            if key is not None and is_namespace(namespace):
                entries.append(ObjectEntry(namespace, key, path, int(info.get("size") or 0), _written_at(info)))
        return entries

    def set_anchor_groups(self, namespace: str, groups: Iterable[int] | None) -> None:
        """A namespace's full-attention groups: a sweep that deletes one of their chunks
        also deletes the other groups' chunks at that position, dead weight without it."""
        if groups is not None:
            self._anchor_groups.setdefault(namespace, frozenset(groups))

    def apply_limits(self, entries: list[ObjectEntry]) -> list[ObjectEntry]:
        """Delete what `ttl_seconds` and `capacity` rule out of a scan; the entries that stay."""
        ttl, capacity, by_age = self.config.ttl_seconds, self.config.capacity, lambda e: e.written_at
        positions = _Positions(entries, self._anchor_groups)
        expired: list[ObjectEntry] = []
        if ttl is not None:
            cutoff = self._wall_clock() - ttl
            expired = [e for e in entries if e.written_at < cutoff]
        dependents = [d for e in expired for d in positions.take(e)]
        gone = {e.path for e in expired + dependents}
        entries = [e for e in entries if e.path not in gone]
        over: list[ObjectEntry] = []  # each tenant beyond its quota loses its own oldest, nobody else's
        if self.quotas.limits:
            self.quotas.learn({e.namespace for e in entries}, self._manifest_prefix)
            over = self.quotas.over_quota(sorted(entries, key=by_age), lambda e: e.namespace, lambda e: e.size)
            gone |= {e.path for e in over}
            dependents += [d for e in over for d in positions.take(e) if d.path not in gone]
            gone |= {d.path for d in dependents}
            entries = [e for e in entries if e.path not in gone]
        evicted: list[ObjectEntry] = []
        if capacity is not None:
            total = sum(e.size for e in entries)
            order = least_reused_first(sorted(entries, key=by_age), lambda e: (e.namespace, e.key), self.reuse_of)
            while total > capacity and (victim := next(order, None)) is not None:
                if victim.path in gone:
                    continue  # already went with its anchor
                evicted.append(victim)
                gone.add(victim.path)
                total -= victim.size
                for dependent in positions.take(victim):
                    if dependent.path not in gone:
                        dependents.append(dependent)
                        gone.add(dependent.path)
                        total -= dependent.size
            entries = [e for e in entries if e.path not in gone]
        doomed = expired + over + evicted + dependents
        if not doomed:
            return self.quotas.recount(entries, lambda e: e.namespace, lambda e: e.size)
        try:
            self.fs.rm([e.path for e in doomed], **self._deadline)
        except FileNotFoundError:
            pass  # another node's sweep got there first
        except Exception as exc:  # noqa: BLE001 - kept objects stay valid; the next sweep tries again
            self._failed("sweep", exc)
            return self.quotas.recount(entries + doomed, lambda e: e.namespace, lambda e: e.size)
        self.quotas.recount(entries, lambda e: e.namespace, lambda e: e.size)
        with self._lock:
            self.counters["expired"] += len(expired)
            self.counters["evicted_over_quota"] += len(over)
            self.counters["evicted"] += len(evicted)
            self.counters["evicted_with_anchor"] += len(dependents)
        logger.info(
            "kvstrata object tier %s: swept %d expired and %d over-capacity chunk objects (%d more left without their anchor)",
            self._scrub(self.config.url),
            len(expired),
            len(evicted) + len(over),
            len(dependents),
        )
        return entries

    def set_tenant(self, namespace: str, tenant: str) -> None:
        """The tenant (`namespace_prefix`) a namespace belongs to, for its quota (`TenantQuotas`)."""
        self.quotas.assign(namespace, tenant)

    def _manifest_prefix(self, namespace: str) -> str:
        """The tenant of a namespace another node registered: its manifest's `namespace_prefix`."""
        manifest = json.loads(self.fs.cat_file(f"{self.namespace_dir(namespace)}/{MANIFEST}", **self._deadline))
        return str(manifest["layout"].get("namespace_prefix", ""))

    def purge(self, namespace: str) -> int | None:
        """Delete a namespace's chunks and manifest; how many chunks went (None: it failed).

        Only `<root>/<namespace>/`: an invalid namespace (empty, dotted, slash-bearing) is
        a ValueError before anything is listed or deleted."""
        check_namespace(namespace)
        keys = self.list_keys(namespace) or set()
        try:
            self.fs.rm(self.namespace_dir(namespace), recursive=True)
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001
            self._failed("purge", exc)
            return None
        self.quotas.drop(namespace)
        return len(keys)

    # --- manifests -----------------------------------------------------------------------

    def write_manifest(self, namespace: str, layout: Mapping[str, object]) -> bool:
        check_namespace(namespace)
        if not self._admit(1):
            return False
        body = json.dumps({"namespace": namespace, "layout": dict(layout)}, sort_keys=True, default=str)
        try:
            self.fs.pipe_file(f"{self.namespace_dir(namespace)}/{MANIFEST}", body.encode(), **self._deadline)
        except Exception as exc:  # noqa: BLE001
            self._failed("manifest", exc)
            return False
        self._succeeded()
        return True

    def manifests(self) -> dict[str, dict[str, object]]:
        """Namespace -> layout of every namespace with a manifest under the root (tools)."""
        found: dict[str, dict[str, object]] = {}
        for path in self.fs.glob(f"{self.root}/*/{MANIFEST}"):
            manifest = json.loads(self.fs.cat_file(path))
            found[manifest["namespace"]] = manifest["layout"]
        return found

    # --- health ----------------------------------------------------------------------------

    def available(self) -> bool:
        return self._clock() >= self._paused_until

    def probe(self, name: str) -> str | None:
        """Write and delete one small object under the root: None if both worked, else why
        (credentials scrubbed). For `kvstrata up`, which must say when the store cannot
        reach or write the bucket instead of finding out at the first upload."""
        path = f"{self.root}/.kvstrata-probe-{name}"
        try:
            self.fs.pipe_file(path, b"kvstrata probe", **self._deadline)
            self.fs.rm_file(path, **self._deadline)
        except Exception as exc:  # noqa: BLE001 - any failure is the answer
            return f"{self._scrub(self.config.url)}: {self._reason(exc)}"
        return None

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {
                "url": self._scrub(self.config.url),
                "available": self.available(),
                "last_error": self.last_error,
                **self.counters,
            }

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # --- internals ---------------------------------------------------------------------------

    def _fan_out(self, op: Callable, what: str, namespace: str, items: list[tuple[bytes, np.ndarray]]) -> list[bool]:
        check_namespace(namespace)  # a bad one is the caller's error, not the store's failure
        if not items:
            return []
        if not self._admit(len(items)):
            return [False] * len(items)
        batch = _Batch()
        futures = [self._pool.submit(op, batch, i, namespace, key, buffer) for i, (key, buffer) in enumerate(items)]
        late = set(futures)
        while late:  # give up once a whole request deadline passes with no request finishing
            finished, late = wait(late, timeout=self.request_deadline)
            if not finished:
                break
        if late:
            with batch.lock:  # from here on, no request of this batch touches its buffers
                batch.abandoned = True
                queued = running = 0
                for i, future in enumerate(futures):
                    if future not in late:
                        continue
                    if future.cancel():
                        queued += 1  # never started: as if paused
                    elif i not in batch.settled:
                        running += 1  # counted here, once: it no longer counts itself
            with self._lock:
                self.counters["put_failures" if what == "upload" else "get_failures"] += running
                self.counters["skipped_while_paused"] += queued
            self._failed(what, TimeoutError(f"{running} requests still running after their deadline"))
        return [future.done() and not future.cancelled() and future.result() for future in futures]

    def _put(self, batch: _Batch, index: int, namespace: str, key: bytes, payload: np.ndarray) -> bool:
        if not self.available():
            self._settled(batch, index, "skipped_while_paused")
            return False
        header = bytearray(HEADER_BYTES)
        with batch.lock:
            if batch.abandoned:  # the caller may already have reused the payload's slot
                return False
            seal_header(memoryview(header), namespace, key, payload)
            # The one copy: the clients want a whole body, as `bytes` (measured: a
            # bytearray body uploads slower through botocore); and a PUT abandoned past
            # its deadline must not read the slot afterwards.
            body = b"".join((header, memoryview(payload.reshape(-1).view(np.uint8))))
        try:
            self.client.put(self.object_path(namespace, key), body)
        except Exception as exc:  # noqa: BLE001 - an upload that fails is a dropped copy
            self._settled(batch, index, "put_failures")
            self._failed("upload", exc)
            return False
        batch.settle(index)
        self.quotas.charge(namespace, len(body))
        self._count("puts", payload.nbytes)  # landed, even if its caller stopped waiting
        self._succeeded()
        return True

    def _get(self, batch: _Batch, index: int, namespace: str, key: bytes, out: np.ndarray) -> bool:
        if not self.available():
            self._settled(batch, index, "skipped_while_paused")
            return False
        try:
            data = self.client.get(self.object_path(namespace, key), HEADER_BYTES + out.nbytes)
        except FileNotFoundError:
            self._settled(batch, index, "not_found")
            self._succeeded()  # the store answered
            return False
        except Exception as exc:  # noqa: BLE001 - a failed read is a miss
            self._settled(batch, index, "get_failures")
            self._failed("download", exc)
            return False
        self._succeeded()
        view = memoryview(data)
        payload = view[HEADER_BYTES:]
        if len(data) < HEADER_BYTES or payload.nbytes != out.nbytes or not record_matches(view, namespace, key, payload):
            self._settled(batch, index, "corrupt_chunks")
            logger.warning(
                "kvstrata object tier: chunk %s of namespace %s failed its checksum; treated as a miss",
                key_name(key),
                namespace,
            )
            return False
        with batch.lock:
            if batch.abandoned:  # too late: the caller gave the buffer back
                return False
            out.reshape(-1).view(np.uint8)[:] = np.frombuffer(payload, dtype=np.uint8)
            batch.settled.add(index)
        self._count("gets", out.nbytes)
        return True

    def _settled(self, batch: _Batch, index: int, outcome: str) -> None:
        """Count a request's outcome, unless its batch's abandonment already counted it."""
        if batch.settle(index):
            self._count(outcome)

    def _count(self, name: str, nbytes: int = 0) -> None:
        with self._lock:
            self.counters[name] += 1
            if name == "puts":
                self.counters["bytes_put"] += nbytes
            elif name == "gets":
                self.counters["bytes_got"] += nbytes

    def _admit(self, count: int) -> bool:
        if self.available():
            return True
        with self._lock:
            self.counters["skipped_while_paused"] += count
        return False

    def _failed(self, what: str, exc: Exception) -> None:
        reason = self._reason(exc)
        with self._lock:
            self.counters["backoffs"] += 1
            self.counters["throttled"] += bool(THROTTLE_SIGNS.search(reason))
            first = self._backoff == 0.0
            self._backoff = min(self.config.backoff_max_seconds, max(1.0, self._backoff * 2))
            pause = self._backoff * random.uniform(0.5, 1.0)
            self._paused_until = max(self._paused_until, self._clock() + pause)
            self.last_error = f"{what}: {reason}"
        if first:
            logger.warning(
                "kvstrata object tier %s: %s failed (%s); uploads are dropped and loads miss "
                "while it is paused (%.1fs, growing to %.0fs while it keeps failing)",
                self._scrub(self.config.url),
                what,
                reason,
                pause,
                self.config.backoff_max_seconds,
            )

    def _succeeded(self) -> None:
        if self._backoff == 0.0:
            return
        with self._lock:
            if self._backoff == 0.0:
                return
            self._backoff = 0.0
            self._paused_until = 0.0
        logger.info("kvstrata object tier %s answers again", self._scrub(self.config.url))

    def _reason(self, exc: Exception) -> str:
        """What failed, for a log line or an operator: the exception, credentials scrubbed."""
        return self._scrub(f"{type(exc).__name__}: {exc or 'no answer before the deadline'}")

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text
