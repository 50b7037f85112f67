"""StrataSpec as vLLM builds it: cheap to import, the layout namespace, config errors at start."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from kvstrata.config import ConfigError
from kvstrata.connector import compat
from kvstrata.connector.spec import StrataSpec, build_layout
from tests.connector.harness import offloading_config


def test_importing_the_connector_starts_no_ray():
    code = "import sys, kvstrata.connector; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_spec_builds_without_touching_ray_or_the_store():
    spec = StrataSpec(offloading_config({"config": {"tiers": {"cpu": {"capacity": "8MiB"}}}}))
    assert spec.kvstrata_config.tiers.cpu.capacity == 8 * 1024**2
    assert spec.layout.slot_bytes == 16384 * 2
    assert spec._manager is None


def test_bad_config_fails_at_engine_start_naming_the_file(tmp_path):
    path = tmp_path / "kvstrata.yaml"
    path.write_text("tiers:\n  cpu:\n    capacity: -1\n")
    with pytest.raises(ConfigError, match=rf"{path}: tiers\.cpu\.capacity"):
        StrataSpec(offloading_config({"config": str(path)}))


def test_layout_namespace_separates_what_makes_bytes_incompatible():
    base = build_layout(offloading_config({}), StrataSpec(offloading_config({})).kvstrata_config)
    same = build_layout(offloading_config({}), StrataSpec(offloading_config({})).kvstrata_config)
    assert base.namespace == same.namespace
    other_model = build_layout(offloading_config({}, model="other"), StrataSpec(offloading_config({})).kvstrata_config)
    other_dtype = build_layout(offloading_config({}, dtype="bfloat16"), StrataSpec(offloading_config({})).kvstrata_config)
    tp2 = build_layout(offloading_config({}, world_size=2), StrataSpec(offloading_config({})).kvstrata_config)
    tenant = StrataSpec(offloading_config({"config": {"namespace_prefix": "tenant-a"}}))
    assert len({base.namespace, other_model.namespace, other_dtype.namespace, tp2.namespace, tenant.layout.namespace}) == 5
    assert tp2.slot_bytes == 2 * base.slot_bytes


def test_metric_definitions_cover_counters_and_gauges():
    names = set(StrataSpec.build_metric_definitions({}))
    assert {"kvstrata:chunks_loaded", "kvstrata:chunks_stored", "kvstrata:reserved_slots"} <= names


def test_the_vllm_under_test_is_the_one_asked_for():
    """The CI matrix sets KVSTRATA_EXPECT_VLLM: prove the run used that vLLM, not another on the path."""
    expected = os.environ.get("KVSTRATA_EXPECT_VLLM")
    if expected is None:
        pytest.skip("not a vLLM-matrix run")
    assert str(compat.VLLM_VERSION) == expected


def test_the_group_ids_of_every_supported_vllm():
    config = offloading_config({"config": {"tiers": {"cpu": {"capacity": "8MiB"}}}})
    assert compat.group_ids(config) == (0,)
    assert build_layout(config, StrataSpec(config).kvstrata_config).group_ids == (0,)


def test_an_unsupported_vllm_fails_at_engine_start_with_the_range(monkeypatch):
    from packaging.version import Version

    monkeypatch.setattr(compat, "VLLM_VERSION", Version("0.34.0"))
    with pytest.raises(RuntimeError, match=r"kvstrata supports vLLM >= 0\.29, < 0\.34; this is vLLM"):
        StrataSpec(offloading_config({}))


def test_the_full_attention_groups_are_known_where_vllm_says_which_they_are():
    config = offloading_config({"config": {"tiers": {"cpu": {"capacity": "8MiB"}}}}, windows=(None, 2, 1))
    layout = StrataSpec(config).layout
    says = compat.VLLM_VERSION >= compat.Version("0.33")  # sliding_window_size_in_chunks
    assert layout.anchor_groups == ((0,) if says else None)
    # Policy, not bytes: engines that know and engines that do not share one namespace.
    assert layout.namespace == dataclasses.replace(layout, anchor_groups=None).namespace
