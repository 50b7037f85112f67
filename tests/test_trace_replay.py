"""`benchmarks/trace_replay.py policy`: the replay's accounting against a trace worked out
by hand, a one-minute window of the real trace through kvstrata and vLLM's LRU (the
figures are there and the ceiling is the trace's), and bad traces named by their line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
FIRST_MINUTE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_first_minute.jsonl"


@pytest.fixture
def replay(monkeypatch):
    """benchmarks/trace_replay.py, loaded from its file (benchmarks/ is scripts, not a package)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("trace_replay", BENCHMARKS / "trace_replay.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def write_trace(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


# Five requests, 3 blocks each (512 + 512 + 76 tokens), over three chunks of host memory:
#   t=0      [1,2,3]  all computed
#   t=10 s   [4,5,6]  all computed; storing them evicts 1,2,3 (written to disk)
#   t=100 s  [1,2,7]  1,2 from disk (gap 100 s), their promotion evicts 4,5 (written); 7 evicts 6
#   t=700 s  [4,5,8]  4,5 from disk (gap 690 s); 1,2 leave memory (on disk already); 8 evicts 7
#   t=710 s  [4,5,9]  4,5 from memory (gap 10 s); 9 evicts 8
HAND_TRACE = [(0, [1, 2, 3]), (10_000, [4, 5, 6]), (100_000, [1, 2, 7]), (700_000, [4, 5, 8]), (710_000, [4, 5, 9])]


@pytest.fixture
def hand_trace(tmp_path):
    rows = [{"timestamp": t, "input_length": 1100, "output_length": 1, "hash_ids": ids} for t, ids in HAND_TRACE]
    return write_trace(tmp_path / "hand.jsonl", rows)


def test_hit_accounting_on_a_hand_computed_trace(replay, hand_trace):
    from trace_systems import StrataSystem, VllmSystem

    run = replay.Replay(replay.load_trace(hand_trace))
    # The ceiling: 1,2 at t=100 s, 4,5 at 700 s and at 710 s.
    assert (run.ceiling.hit_blocks, run.ceiling.hit_tokens, run.ceiling.tokens) == (6, 6 * 512, 5 * 1100)
    assert run.ceiling.gap_reuses == {"<1min": 2, "1-10min": 2, ">10min": 2}

    kvstrata = StrataSystem("kvstrata", 4096, 3, 10, None, "always", 8192)
    try:
        tally, _ = run.run(kvstrata)
        counters = kvstrata.finish()
    finally:
        kvstrata.close()
    assert not kvstrata.root.exists()  # its arena, disk and bucket went with it
    assert tally.by_tier == {"cpu": 2, "disk": 4, "object": 0}
    assert (tally.hit_blocks, tally.hit_tokens) == (6, 6 * 512)
    assert tally.gap_hits == {"<1min": 2, "1-10min": 2, ">10min": 2}
    # 1,2,3 then 4,5,6 then 7 then 8: each written once, when memory let it go.
    assert counters["disk_writes"] == 8 and counters["disk_write_bytes"] == 8 * 4096
    assert counters["cpu_evictions"] == 10 and counters["object_puts"] == 0

    lru = VllmSystem("lru", 3, 4096)
    tally, _ = run.run(lru)
    assert tally.by_tier == {"cpu": 2, "disk": 0, "object": 0}  # only the last request's 4,5
    assert tally.gap_hits == {"<1min": 2, "1-10min": 0, ">10min": 0}


def test_the_oracle_writes_only_what_is_read_again(replay, hand_trace):
    from trace_systems import StrataSystem

    run = replay.Replay(replay.load_trace(hand_trace))
    key_of = {replay.chunk_key(b): b for b in run.last_use}
    oracle = StrataSystem("oracle", 4096, 3, 10, None, "oracle", 8192, admit=run.used_later(key_of))
    try:
        tally, _ = run.run(oracle)
        counters = oracle.finish()
    finally:
        oracle.close()
    assert tally.by_tier == {"cpu": 2, "disk": 4, "object": 0}
    assert counters["disk_writes"] == 4  # 1, 2, 4, 5: the blocks asked for again


def test_one_minute_of_the_real_trace_through_kvstrata_and_vllm_lru(replay, capsys):
    summary = replay.run_policy(
        replay.parser().parse_args(
            ["policy", "--trace", str(FIRST_MINUTE), "--minutes", "1", "--systems", "kvstrata,vllm-lru"]
        )
    )
    # The ceiling, computed here the plain way: every block seen before is a hit.
    seen, hits, blocks = set(), 0, 0
    for line in FIRST_MINUTE.read_text().splitlines():
        ids = json.loads(line)["hash_ids"]
        hits += sum(1 for b in ids if b in seen)
        blocks += len(ids)
        seen.update(ids)
    assert summary["requests"] == 162 and summary["distinct_blocks"] == len(seen)
    assert summary["ceiling_blocks"] == round(hits / blocks, 4)
    assert 0 < summary["ceiling"] < 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == summary  # the last line is the JSON summary
    for name in ("kvstrata-chain", "vllm-lru"):
        figures = summary["systems"][name]
        assert 0 < figures["hit_ratio"] <= summary["ceiling"]
        assert 0 < figures["share_of_ceiling"] <= 1
        assert set(figures["hits_by_tier"]) == {"cpu", "disk", "object"}
        assert set(figures["hit_ratio_by_gap"]) == {"<1min", "1-10min", ">10min"}
        for key in ("disk_writes", "object_puts", "object_gets", "evictions"):
            assert key in figures
    assert summary["systems"]["vllm-lru"]["disk_writes"] == 0
    assert summary["systems"]["kvstrata-chain"]["disk_writes"] > 0


def test_the_whole_trace_has_the_ceiling_its_readme_states(replay):
    """36.6 % of prompt blocks (../shared/traces/README.md), where the trace is here."""
    if not replay.DEFAULT_TRACE.is_file():
        pytest.skip(f"no {replay.DEFAULT_TRACE}")
    run = replay.Replay(replay.load_trace(replay.DEFAULT_TRACE))
    assert len(run.requests) == 12_031 and run.ceiling.blocks == 288_500 and run.distinct == 182_790
    assert round(run.ceiling.hit_blocks / run.ceiling.blocks, 3) == 0.366


@pytest.mark.parametrize(
    "rows, message",
    [
        (['{"timestamp": 0, "input_length": 10, "output_length": 1}'], ":1: no `hash_ids`"),
        (['{"timestamp": 0, "input_length": 10, "hash_ids": [1]}', '{"timestamp": 5, "input_length": 10}'], ":2: no `hash_ids`"),
        (
            ['{"timestamp": 10, "input_length": 10, "hash_ids": [1]}', '{"timestamp": 3, "input_length": 10, "hash_ids": [1]}'],
            ":2: timestamp 3 is before the previous line's 10 (not monotone)",
        ),
        (['{"timestamp": 0, "input_length": 10, "hash_ids": ["a"]}'], ":1: `hash_ids` must be a list of integers"),
        (['not json'], ":1: not JSON"),
    ],
)
def test_a_bad_line_is_named(replay, tmp_path, rows, message):
    path = write_trace(tmp_path / "bad.jsonl", rows)
    with pytest.raises(replay.TraceError) as raised:
        replay.load_trace(path)
    assert str(raised.value) == f"{path}{message}" or str(raised.value).startswith(f"{path}{message}")


def test_a_missing_file_is_a_clear_error_from_the_command(replay, tmp_path, capsys):
    missing = tmp_path / "nowhere.jsonl"
    assert replay.main(["policy", "--trace", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"trace_replay: trace file not found: {missing}"


def test_capacities_keep_their_share_of_the_working_set(replay):
    args = replay.parser().parse_args(["policy", "--model", "llama-3.1-8b", "--dram-gib", "228", "--disk-share", "0.2"])
    scale = replay.make_scale(args, 182_790)
    assert replay.bytes_per_token("llama-3.1-8b") == 128 * 1024  # 32 layers x 8 heads x 128 x 2 x 2 bytes
    assert replay.bytes_per_token("qwen3-32b") == 256 * 1024  # 64 layers x 8 heads x 128 x 2 x 2 bytes
    assert scale.block_bytes == 64 << 20 and scale.slot_bytes == 4096
    assert scale.dram_chunks == 228 * 16  # 228 GiB of 64 MiB blocks: 2 % of the distinct blocks
    assert scale.disk_chunks == int(0.2 * 182_790)
