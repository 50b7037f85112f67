"""The self-describing chunk record every persistent tier writes: a header and its payload.

The header names the key, the namespace and the payload length and carries an
xxh3-128 digest of namespace ‖ key ‖ payload, so a chunk read back from a disk slab,
an object store or a peer is checked before it can become a hit, and a record that
landed under the wrong name is never mistaken for another chunk. It is one 4 KiB
block so disk records stay O_DIRECT-aligned. An object holds `[header | payload]`; the
disk keeps headers in a file beside the payloads.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import xxhash

from kvstrata.keys import SLOT_ALIGNMENT

HEADER_BYTES = SLOT_ALIGNMENT
MAGIC = b"KVSTRAT1"
_HEADER = struct.Struct("<8sHHHQ16s")  # magic, version, key len, namespace len, payload len, digest
VERSION = 1
_ZEROS = bytes(HEADER_BYTES)
_FIELDS = struct.Struct("<8sHHHQ")  # the header up to its digest
_DIGEST = slice(_FIELDS.size, _HEADER.size)


@functools.lru_cache(maxsize=64)
def _header_with_names(key_len: int, namespace_len: int) -> struct.Struct:
    """The header's fields followed by the key and the namespace, packed in one call."""
    if _HEADER.size + key_len + namespace_len > HEADER_BYTES:
        raise ValueError(f"a key of {key_len} bytes and a namespace of {namespace_len} do not fit a record header")
    return struct.Struct(f"{_HEADER.format}{key_len}s{namespace_len}s")


def payload_hasher(namespace: str, key: bytes) -> "xxhash.xxh3_128":
    """The digest of a chunk before its payload: fed the payload in order, in one piece or
    several (a large record is verified piece by piece as it is read), it gives `chunk_digest`."""
    return xxhash.xxh3_128(namespace.encode() + key)


def chunk_digest(namespace: str, key: bytes, payload) -> bytes:
    hasher = payload_hasher(namespace, key)
    hasher.update(memoryview(payload).cast("B"))
    return hasher.digest()


def seal_header(out: memoryview, namespace: str, key: bytes, payload) -> None:
    """Write the header of this chunk's record into `out` (one `HEADER_BYTES` block)."""
    _pack(out, key, namespace, memoryview(payload).nbytes, chunk_digest(namespace, key, payload))


def recorded_digest(header: memoryview, namespace: str, key: bytes, payload_bytes: int) -> bytes | None:
    """The digest a record header holds if it names this chunk at this size, else None.

    Why not `RecordHeader.unpack`: a promotion checks thousands of headers, and comparing
    with the header it expects is two byte comparisons instead of a parse.
    """
    name = namespace.encode()
    names = slice(_HEADER.size, _HEADER.size + len(key) + len(name))
    if names.stop > HEADER_BYTES or header[: _FIELDS.size] != _FIELDS.pack(MAGIC, VERSION, len(key), len(name), payload_bytes):
        return None
    return bytes(header[_DIGEST]) if header[names] == key + name else None


def record_matches(header: memoryview, namespace: str, key: bytes, payload) -> bool:
    """True when `header` describes exactly these payload bytes of this chunk (the check every
    tier makes before a chunk read back can become a hit)."""
    expected = recorded_digest(header, namespace, key, memoryview(payload).nbytes)
    return expected is not None and expected == chunk_digest(namespace, key, payload)


def _pack(out: memoryview, key: bytes, namespace: str, payload_bytes: int, digest: bytes) -> None:
    """Why not field by field: a disk write seals thousands of small records per second,
    and per-header Python calls held the GIL the disk's I/O threads wait for."""
    name = namespace.encode()
    out[:HEADER_BYTES] = _ZEROS
    _header_with_names(len(key), len(name)).pack_into(
        out, 0, MAGIC, VERSION, len(key), len(name), payload_bytes, digest, key, name
    )


@dataclass(frozen=True)
class RecordHeader:
    key: bytes
    namespace: str
    payload_bytes: int
    digest: bytes

    def pack(self, out: memoryview) -> None:
        _pack(out, self.key, self.namespace, self.payload_bytes, self.digest)

    @classmethod
    def unpack(cls, data: memoryview) -> "RecordHeader | None":
        magic, version, key_len, ns_len, payload, digest = _HEADER.unpack_from(data, 0)
        if magic != MAGIC or version != VERSION or _HEADER.size + key_len + ns_len > HEADER_BYTES:
            return None
        start = _HEADER.size
        key = bytes(data[start : start + key_len])
        try:
            namespace = bytes(data[start + key_len : start + key_len + ns_len]).decode()
        except UnicodeDecodeError:
            return None
        return cls(key, namespace, payload, digest)
