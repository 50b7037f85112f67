"""The clients that move chunk objects (the bulk path of the object tier).

Listing, manifests and removals always go through fsspec, whatever the URL. Chunk PUTs
and GETs go through the fastest client that can honour the configured URL and
credentials:

- `PyArrowS3Client`, for `s3://` URLs: pyarrow's C++ S3 client. Measured here against
  SeaweedFS on loopback: GETs as fast as s3fs at best and far steadier, PUTs up to 1.6x
  s3fs for 32 MiB objects (it uploads parts in parallel) (docs/benchmarks.md). Requests are bounded
  by libcurl's connect and low-speed timeouts and the SDK's retry strategy
  (max_attempts, backoff with jitter) -- but measured, a PUT with a body against a
  black-holed endpoint takes ~8 s per attempt whatever the timeouts, so the tier bounds
  every batch itself (see `ObjectTier`) and hands this client private copies only.
- `FsspecClient`, for every other URL (`gs://`, `file://`, `memory://`, ...) and for S3
  options pyarrow cannot express (a profile, a custom botocore config, ...).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any, Protocol

import fsspec

from kvstrata.config import ObjectTierConfig

# s3fs storage_options that map one-to-one onto pyarrow.fs.S3FileSystem arguments.
PYARROW_CREDENTIALS = {"key": "access_key", "secret": "secret_key", "token": "session_token", "anon": "anonymous"}
# botocore settings the tier sets itself from `timeouts`, `max_attempts`, `max_concurrency`.
TIER_BOTOCORE_SETTINGS = {"connect_timeout", "read_timeout", "retries", "max_pool_connections"}


class ChunkClient(Protocol):
    name: str

    def put(self, path: str, body: bytes) -> None:
        """Write one whole object. Raises on failure."""

    def get(self, path: str, expected_bytes: int) -> bytes | memoryview:
        """The object's bytes (any length: the caller verifies). FileNotFoundError if absent."""


class FsspecClient:
    name = "fsspec"

    def __init__(self, fs: fsspec.AbstractFileSystem, call_options: Mapping[str, Any]):
        self.fs = fs
        self._call_options = dict(call_options)

    def put(self, path: str, body: bytes) -> None:
        self.fs.pipe_file(path, body, **self._call_options)

    def get(self, path: str, expected_bytes: int) -> bytes:
        return self.fs.cat_file(path, **self._call_options)


class PyArrowS3Client:
    """pyarrow's S3 client. Each PUT buffers its body in a part buffer of 10 MiB from
    pyarrow's memory pool, however small the object (measured: a 64 KiB chunk's PUT
    peaks the pool at 10 MiB, 16 at once at 160 MiB, all of it resident), and the pool's
    allocator (mimalloc) keeps those pages once freed: a store that uploaded once stayed
    160 MiB larger, or not, as the allocator pleased (issue #51 finding 13: the fault
    matrix's object-blackhole row read it as a leak of +148 MiB). So whenever the last
    PUT in flight ends, the pool gives its unused memory back (~1 ms, once per batch):
    the part buffers cost memory while uploads run, at most `max_concurrency` x 10 MiB,
    and none after."""

    name = "pyarrow"

    def __init__(self, options: Mapping[str, Any]):
        import pyarrow
        from pyarrow import fs as pafs

        self.fs = pafs.S3FileSystem(**options)
        self._memory = pyarrow.default_memory_pool()  # what the S3 streams allocate from
        self._lock = threading.Lock()
        self._putting = 0  # PUTs in flight
        self.releases = 0  # times the pool gave its unused memory back

    def put(self, path: str, body: bytes) -> None:
        with self._lock:
            self._putting += 1
        try:
            with self.fs.open_output_stream(path, metadata={}) as stream:
                stream.write(body)
        finally:
            with self._lock:
                self._putting -= 1
                last = self._putting == 0
                self.releases += last
            if last:
                self._memory.release_unused()

    def get(self, path: str, expected_bytes: int) -> memoryview:
        with self.fs.open_input_file(path) as source:
            if source.size() != expected_bytes:
                return memoryview(b"")  # wrong length: never worth downloading
            return memoryview(source.read_at(expected_bytes, 0))


def pyarrow_s3_options(config: ObjectTierConfig) -> dict[str, Any] | str:
    """pyarrow.fs.S3FileSystem arguments equivalent to the configured s3fs ones, or why there are none."""
    try:
        from pyarrow import fs as pafs
    except ImportError:
        return "pyarrow is not installed"
    if not hasattr(pafs, "S3FileSystem"):
        return "this pyarrow was built without S3 support"
    options = dict(config.storage_options)
    client_kwargs = dict(options.pop("client_kwargs", None) or {})
    config_kwargs = dict(options.pop("config_kwargs", None) or {})
    endpoint = config.endpoint_url or client_kwargs.pop("endpoint_url", None) or options.pop("endpoint_url", None)
    region = client_kwargs.pop("region_name", None) or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    leftover = [name for name in options if name not in PYARROW_CREDENTIALS]
    leftover += [f"client_kwargs.{name}" for name in client_kwargs]
    leftover += [f"config_kwargs.{name}" for name in config_kwargs if name not in TIER_BOTOCORE_SETTINGS]
    if leftover:
        return f"storage option {leftover[0]!r} has no pyarrow equivalent"
    if not endpoint and not region:
        return "neither endpoint_url nor a region (client_kwargs.region_name, AWS_REGION) is set"
    arguments: dict[str, Any] = {
        PYARROW_CREDENTIALS[name]: value for name, value in options.items() if value is not None
    }
    if endpoint:
        scheme, _, host = endpoint.rpartition("://")
        arguments.update(endpoint_override=host, scheme=scheme or "https")
    if region:
        arguments["region"] = region
    arguments.update(
        # As for s3fs (open_filesystem): explicit botocore settings win over `timeouts`.
        connect_timeout=config_kwargs.get("connect_timeout", config.timeouts.connect_seconds),
        request_timeout=config_kwargs.get("read_timeout", config.timeouts.read_seconds),
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=config.max_attempts),
        # One PutObject for chunks below the multipart size, not Create + UploadPart + Complete.
        allow_delayed_open=True,
    )
    return arguments


def open_chunk_client(
    config: ObjectTierConfig, fs: fsspec.AbstractFileSystem, call_options: Mapping[str, Any]
) -> tuple[ChunkClient, str]:
    """The chunk client for this configuration, and why it was chosen (for the one start-up log line)."""
    protocol = config.url.split("://", 1)[0]
    if config.client == "fsspec":
        return FsspecClient(fs, call_options), "configured"
    if protocol not in ("s3", "s3a"):
        if config.client == "pyarrow":
            raise ValueError(f"tiers.object.client: pyarrow serves s3:// URLs only, not {protocol}://")
        return FsspecClient(fs, call_options), f"pyarrow serves s3:// only, not {protocol}://"
    options = pyarrow_s3_options(config)
    if isinstance(options, str):
        if config.client == "pyarrow":
            raise ValueError(f"tiers.object.client: pyarrow cannot be used: {options}")
        return FsspecClient(fs, call_options), options
    return PyArrowS3Client(options), "s3:// URL"
