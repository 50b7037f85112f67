"""The store's metrics as samples (no Ray): every sample is a declared metric with exactly
its declared labels, figures come from the report unchanged, namespaces are capped."""

from __future__ import annotations

from kvstrata.actors.store_metrics import MAX_NAMESPACE_LABELS, METRICS, directory_samples, metric_samples


def report_stats(namespaces: int = 2) -> dict:
    on = {"state": "on", "capacity": 100, "used": 40, "chunks": 4, "hits": 7, "misses": 1, "evicted": 2,
          "dropped": 3, "failed": 0, "corrupt": 1, "read_bytes": 700, "write_bytes": 400,
          "read_seconds": 0.5, "write_seconds": 0.25}  # fmt: skip
    return {
        "report": {
            "node_id": "n1",
            "tiers": {"cpu": dict(on), "disk": dict(on, hits=5, set_aside=4), "object": {"state": "paused", "reason": "503"},
                      "peer": {"state": "off"}},  # fmt: skip
            "namespaces": {f"ns{i}": {"models": ["m"], "chunks": {"cpu": i + 1, "disk": 1, "object": 0}} for i in range(namespaces)},
            "engines": {"e1": {"lease_seconds_left": 3.0, "pinned": 2, "reserved": 1}, "e2": {"lease_seconds_left": 1.0, "pinned": 3, "reserved": 0}},
            "purges_refused": 6,
        },
        "object": {"puts": 5, "put_failures": 1, "gets": 4, "get_failures": 2, "not_found": 0, "corrupt_chunks": 0,
                   "skipped_while_paused": 6, "backoffs": 3, "throttled": 2},  # fmt: skip
        "peers": None,
    }


def by_key(samples):
    return {(name, tuple(sorted(labels.items()))): value for name, labels, value in samples}


def test_every_sample_is_a_declared_metric_with_its_declared_labels():
    for name, labels, _ in metric_samples(report_stats()) + directory_samples({"shard": 0, "epoch": "e", "namespaces": {"a": 3}}):
        assert name in METRICS, name
        assert tuple(labels) == METRICS[name].tags or set(labels) == set(METRICS[name].tags), (name, labels)


def test_samples_carry_the_report_figures():
    samples = by_key(metric_samples(report_stats()))
    assert samples[("kvstrata_tier_hits", (("node", "n1"), ("tier", "disk")))] == 5
    assert samples[("kvstrata_promotions", (("node", "n1"), ("source", "disk")))] == 5
    assert samples[("kvstrata_tier_read_bytes", (("node", "n1"), ("tier", "cpu")))] == 700
    assert samples[("kvstrata_tier_up", (("node", "n1"), ("tier", "object")))] == 0  # paused is not up
    assert samples[("kvstrata_tier_up", (("node", "n1"), ("tier", "cpu")))] == 1
    assert samples[("kvstrata_store_pinned_chunks", (("node", "n1"),))] == 5
    assert samples[("kvstrata_leases_held", (("node", "n1"),))] == 2
    assert samples[("kvstrata_tier_set_aside_files", (("node", "n1"), ("tier", "disk")))] == 4
    assert samples[("kvstrata_purges_refused", (("node", "n1"),))] == 6
    assert samples[("kvstrata_object_throttles", (("node", "n1"),))] == 2
    assert samples[("kvstrata_object_requests", (("node", "n1"), ("op", "put"), ("outcome", "failed")))] == 1
    assert not any(dict(labels).get("tier") == "peer" for name, labels in samples)  # an off tier exports nothing


def test_namespace_labels_are_capped():
    many = MAX_NAMESPACE_LABELS + 10
    samples = [s for s in metric_samples(report_stats(namespaces=many)) if s[0] == "kvstrata_tier_chunks" and s[1]["tier"] == "cpu"]
    assert len(samples) == MAX_NAMESPACE_LABELS
    assert sum(value for _, _, value in samples) == sum(i + 1 for i in range(many))  # nothing lost, only summed
    assert any(labels["namespace"] == "other" for _, labels, _ in samples)
