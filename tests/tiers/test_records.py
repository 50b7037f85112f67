"""The record header every persistent tier writes: what it names is what a read accepts."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvstrata.tiers.records import HEADER_BYTES, RecordHeader, chunk_digest, record_matches, recorded_digest, seal_header
from tests.utils import key


def sealed(namespace: str, chunk_key: bytes, payload: np.ndarray) -> memoryview:
    header = memoryview(mmap.mmap(-1, HEADER_BYTES))
    header[:] = b"\xa5" * HEADER_BYTES  # reused staging memory: nothing of it may survive
    seal_header(header, namespace, chunk_key, payload)
    return header


def test_a_sealed_header_names_its_chunk_and_nothing_else():
    payload = np.arange(8192, dtype=np.uint8)
    header = sealed("model-a", key(1), payload)
    parsed = RecordHeader.unpack(header)
    assert parsed == RecordHeader(key(1), "model-a", 8192, chunk_digest("model-a", key(1), payload))
    assert record_matches(header, "model-a", key(1), payload)
    assert not record_matches(header, "model-a", key(1), payload[::-1].copy())
    assert recorded_digest(header, "model-a", key(1), 8192) == parsed.digest
    assert recorded_digest(header, "model-b", key(1), 8192) is None
    assert recorded_digest(header, "model-a", key(2), 8192) is None
    assert recorded_digest(header, "model-a", key(1), 4096) is None
    assert recorded_digest(header, "model-a" * 1000, key(1), 8192) is None  # could never fit: no match, no error
    assert bytes(header[200:]) == bytes(HEADER_BYTES - 200)


def test_a_key_and_namespace_too_long_for_a_header_are_refused_by_name():
    with pytest.raises(ValueError, match="do not fit a record header"):
        sealed("n" * HEADER_BYTES, key(1), np.zeros(16, dtype=np.uint8))
