"""Damage done to a disk tier's files or a bucket's objects behind the store's back.

Shared by the test suite (tests/utils.py re-exports `flip_disk_payload_bytes`) and the
fault matrix, so both break things the same way.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvstrata.tiers.disk import HEADERS_SUFFIX, PAYLOADS_SUFFIX
from kvstrata.tiers.records import HEADER_BYTES


def flip_disk_payload_bytes(directory: str | Path, stride: int, at: int = 7, key: bytes | None = None) -> int:
    """Flip one payload byte (`at` bytes into it) of every record a disk tier's directory holds,
    or only of the record whose header names `key`. Returns how many records were hit."""
    flipped = 0
    for payloads in Path(directory).glob(f"*{PAYLOADS_SUFFIX}"):
        headers = payloads.with_suffix(HEADERS_SUFFIX).read_bytes()
        if key is None:
            records = range(len(headers) // HEADER_BYTES)
        else:
            records = [headers.index(key) // HEADER_BYTES] if key in headers else []
        with open(payloads, "r+b") as f:
            for record in records:
                f.seek(record * stride + at)
                byte = f.read(1)
                f.seek(record * stride + at)
                f.write(bytes([byte[0] ^ 0x5A]))
        flipped += len(records)
    return flipped


def truncate_headers(directory: str | Path) -> int:
    """Cut every header file of a disk tier to half its length (a crash mid-write)."""
    count = 0
    for headers in Path(directory).glob(f"*{HEADERS_SUFFIX}"):
        os.truncate(headers, headers.stat().st_size // 2)
        count += 1
    return count


def scramble_headers(directory: str | Path, seed: int = 0) -> int:
    """Overwrite every header file with random bytes of the same length (a corrupt index)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    count = 0
    for headers in Path(directory).glob(f"*{HEADERS_SUFFIX}"):
        headers.write_bytes(rng.integers(0, 256, headers.stat().st_size, dtype=np.uint8).tobytes())
        count += 1
    return count


def overwrite_objects(fs, root: str, seed: int = 0) -> int:
    """Replace every chunk object under `root` (not manifests) with other bytes of its size."""
    import numpy as np

    rng = np.random.default_rng(seed)
    count = 0
    for path, info in fs.find(root, detail=True).items():
        if path.endswith(".json") or info.get("size", 0) == 0:
            continue
        fs.pipe_file(path, rng.integers(0, 256, int(info["size"]), dtype=np.uint8).tobytes())
        count += 1
    return count
