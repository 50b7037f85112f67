"""The reuse sketch behind `admission.store: reuse`: fixed memory, and it keeps the chunks
a trace reuses while writing few of those it sees once."""

from __future__ import annotations

import numpy as np

from kvstrata.keys import make_key
from kvstrata.tiers.frequency import FrequencySketch, ReuseCounter, keys_to_u64


def test_memory_stays_fixed_through_ten_million_distinct_keys() -> None:
    sketch = FrequencySketch(window=100_000)
    before = sketch.nbytes
    rng = np.random.default_rng(7)
    for _ in range(10):
        sketch.add_many(rng.integers(0, 2**63, 1_000_000, dtype=np.uint64))
    # The table is the whole state: 4 rows of 2^17 one-byte counters, whatever passed through.
    assert sketch.nbytes == before == 4 * (1 << 17)
    # Just before a halving (the fullest the table gets), a fresh key rarely reads as reused.
    sketch.add_many(rng.integers(0, 2**63, 99_999, dtype=np.uint64))
    fresh = sketch.counts(rng.integers(0, 2**63, 50_000, dtype=np.uint64))
    assert (fresh >= 2).mean() < 0.02
    assert sketch.nbytes == before


def test_counts_never_under_count_and_halve_each_window() -> None:
    sketch = FrequencySketch(window=1024)
    key = keys_to_u64([b"k" * 36])
    for _ in range(3):
        sketch.add_many(key)
    assert sketch.counts(key)[0] >= 3
    sketch.add_many(np.arange(1, 1022, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    # 3 + 1021 = 1024 additions: one halving, 3 -> 1.
    assert sketch.counts(key)[0] == 1


def test_groups_of_one_position_are_counted_apart() -> None:
    counter = ReuseCounter(window=4096, min_uses=2)
    block_hash = b"h" * 32
    # A hybrid model stores two groups at one position: that is one use of each, not two.
    assert counter.note("ns", [make_key(block_hash, 0), make_key(block_hash, 1)]) == [False, False]


def test_a_trace_of_seventy_percent_one_offs_writes_the_reused_and_few_others() -> None:
    """10 000 requests of 8 chunks; 70 % are prompts seen once, 30 % draw from 300 prompts
    used ~10 times each. `reuse` (min_uses 2) writes a chunk the first time it reaches 2 uses."""
    rng = np.random.default_rng(11)
    counter = ReuseCounter(window=100_000, min_uses=2)
    repeated = [[f"r{p}-{c}".encode().ljust(36, b"\0") for c in range(8)] for p in range(300)]
    written: set[bytes] = set()
    seen: set[bytes] = set()
    one_off_chunks: set[bytes] = set()
    for request in range(10_000):
        if rng.random() < 0.7:
            keys = [f"o{request}-{c}".encode().ljust(36, b"\0") for c in range(8)]
            one_off_chunks.update(keys)
        else:
            keys = repeated[int(rng.integers(0, 300))]
        seen.update(keys)
        for key, reused in zip(keys, counter.note("ns", keys)):
            if reused:
                written.add(key)
    reused_chunks = seen - one_off_chunks
    # Every prompt seen twice or more is written down (on its second use) ...
    assert reused_chunks <= written
    # ... and almost no one-off: `always` would write every chunk seen.
    assert len(written & one_off_chunks) < 0.01 * len(one_off_chunks)
    assert len(written) < 0.5 * len(seen)


def test_estimate_reads_counts_without_adding_and_knows_no_unseen_namespace() -> None:
    counter = ReuseCounter(window=4096, min_uses=2)
    reused, once = make_key(1, 0), make_key(2, 0)
    counter.note("ns", [reused, reused, reused, once])
    assert counter.estimate("ns", [reused, once]) == [3, 1]
    assert counter.estimate("ns", [reused, once]) == [3, 1]  # reading counted nothing
    assert counter.estimate("other", [reused]) == [0] and counter.estimate("ns", []) == []
