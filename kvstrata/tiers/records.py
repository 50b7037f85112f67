"""The self-describing chunk record every persistent tier writes: `[header | payload]`.

The header names the key, the namespace and the payload length and carries an
xxh3-128 digest of namespace ‖ key ‖ payload, so a chunk read back from a disk slab,
an object store or a peer is checked before it can become a hit, and a record that
landed under the wrong name is never mistaken for another chunk. It is one 4 KiB
block so disk records stay O_DIRECT-aligned.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvstrata.keys import SLOT_ALIGNMENT

HEADER_BYTES = SLOT_ALIGNMENT
MAGIC = b"KVSTRAT1"
_HEADER = struct.Struct("<8sHHHQ16s")  # magic, version, key len, namespace len, payload len, digest
VERSION = 1


def payload_hasher(namespace: str, key: bytes) -> "xxhash.xxh3_128":
    """The digest of a chunk before its payload: fed the payload in order, in one piece or
    several (a large record is verified piece by piece as it is read), it gives `chunk_digest`."""
    hasher = xxhash.xxh3_128()
    hasher.update(namespace.encode())
    hasher.update(key)
    return hasher


def chunk_digest(namespace: str, key: bytes, payload) -> bytes:
    hasher = payload_hasher(namespace, key)
    hasher.update(memoryview(payload).cast("B"))
    return hasher.digest()


@dataclass(frozen=True)
class RecordHeader:
    key: bytes
    namespace: str
    payload_bytes: int
    digest: bytes

    def pack(self, out: memoryview) -> None:
        namespace = self.namespace.encode()
        out[: HEADER_BYTES] = bytes(HEADER_BYTES)
        _HEADER.pack_into(out, 0, MAGIC, VERSION, len(self.key), len(namespace), self.payload_bytes, self.digest)
        start = _HEADER.size
        out[start : start + len(self.key)] = self.key
        out[start + len(self.key) : start + len(self.key) + len(namespace)] = namespace

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

    def describes(self, namespace: str, key: bytes, payload_bytes: int) -> bool:
        """True when this header names this chunk at this size (its digest is checked apart)."""
        return self.key == key and self.namespace == namespace and self.payload_bytes == payload_bytes

    def matches(self, namespace: str, key: bytes, payload) -> bool:
        """True when this header describes exactly these payload bytes of this chunk."""
        return self.describes(namespace, key, memoryview(payload).nbytes) and self.digest == chunk_digest(
            namespace, key, payload
        )
