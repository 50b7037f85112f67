"""The YAML schema: sizes, strictness, and errors that name file, key and reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.config import ConfigError, KvstrataConfig, load_config, parse_size

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "text,expected",
    [("64GiB", 64 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GiB", int(1.5 * 1024**3)), ("2GB", 2 * 10**9), ("4096", 4096), (1234, 1234)],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


def test_shipped_local_config_is_the_builtin_default():
    assert load_config(REPO / "configs" / "local.yaml") == KvstrataConfig() == load_config(None)


def test_inline_mapping():
    cfg = load_config({"tiers": {"cpu": {"capacity": "2GiB"}}, "namespace_prefix": "tenant-a"})
    assert cfg.tiers.cpu.capacity == 2 * 1024**3
    assert cfg.namespace_prefix == "tenant-a"


def test_unknown_key_names_file_and_key_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("tiers:\n  cpu:\n    capacty: 1GiB\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value)
    assert "tiers.cpu.capacty: unknown key" in str(err.value)


def test_negative_size_is_rejected_with_reason(tmp_path):
    path = tmp_path / "neg.yaml"
    path.write_text("tiers:\n  cpu:\n    capacity: -4GiB\n")
    with pytest.raises(ConfigError, match=r"tiers\.cpu\.capacity: Input should be greater than 0"):
        load_config(path)


def test_unparseable_size():
    with pytest.raises(ConfigError, match=r"tiers\.cpu\.capacity: Value error, expected a size such as '4GiB'.*'lots'"):
        load_config({"tiers": {"cpu": {"capacity": "lots"}}})


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("tiers:\n  cpu: [capacity: 1GiB\n")
    with pytest.raises(ConfigError, match=rf"{path}: malformed YAML at line \d+, column \d+"):
        load_config(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the kvstrata config"):
        load_config(tmp_path / "nope.yaml")


def test_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        load_config(path)


def test_shipped_single_node_config_has_a_disk_tier():
    cfg = load_config(REPO / "configs" / "single-node.yaml")
    assert cfg.tiers.disk.capacity == 1024**4
    assert cfg.tiers.disk.write_policy == "write_through"


def test_disk_write_policy_is_checked():
    with pytest.raises(ConfigError, match=r"tiers\.disk\.write_policy"):
        load_config({"tiers": {"disk": {"path": "/x", "capacity": "1GiB", "write_policy": "sometimes"}}})
    with pytest.raises(ConfigError, match=r"tiers\.disk\.path: Field required"):
        load_config({"tiers": {"disk": {"capacity": "1GiB"}}})


def test_shipped_object_config_and_object_tier_checks():
    cfg = load_config(REPO / "configs" / "object.yaml")
    assert cfg.tiers.object.url == "s3://my-kv-bucket/kvstrata"
    assert cfg.tiers.object.timeouts.read_seconds == 5
    with pytest.raises(ConfigError, match=r"tiers\.object\.url"):
        load_config({"tiers": {"object": {"url": "my-bucket/no-scheme"}}})
    with pytest.raises(ConfigError, match=r"tiers\.object\.timeouts\.connect_seconds"):
        load_config({"tiers": {"object": {"url": "s3://b/p", "timeouts": {"connect_seconds": 0}}}})
    limited = load_config({"tiers": {"object": {"url": "s3://b/p", "capacity": "2TiB", "ttl_seconds": 86400}}})
    assert (limited.tiers.object.capacity, limited.tiers.object.ttl_seconds) == (2 * 1024**4, 86400)
    with pytest.raises(ConfigError, match=r"tiers\.object\.ttl_seconds"):
        load_config({"tiers": {"object": {"url": "s3://b/p", "ttl_seconds": -1}}})
    with pytest.raises(ConfigError, match=r"tiers\.object\.client"):
        load_config({"tiers": {"object": {"url": "s3://b/p", "client": "boto3"}}})


def test_a_config_error_never_echoes_credentials():
    with pytest.raises(ConfigError) as error:
        load_config({"tiers": {"object": {"url": "s3://b/p", "storage_options": {"secret": "s3cr3t-value"}, "max_concurrency": 0}}})
    assert "s3cr3t-value" not in str(error.value)


def test_shipped_multinode_config_and_cluster_checks():
    cfg = load_config(REPO / "configs" / "multinode.yaml")
    assert cfg.cluster.directory_shards == 4 and cfg.cluster.fetch_batch_bytes == 64 * 1024**2
    assert cfg.tiers.disk is not None and cfg.tiers.object is not None
    assert load_config({}).cluster is None  # one node stands alone unless told otherwise
    with pytest.raises(ConfigError, match=r"cluster\.directory_shards"):
        load_config({"cluster": {"directory_shards": 0}})


def test_admission_defaults_change_nothing_and_bad_values_name_their_key() -> None:
    config = load_config({})
    assert config.admission.load == "break_even"
    # The disk writes the head of every prefix and what is used again (#47); the bucket everything.
    assert config.admission.store.disk == "chain" and config.admission.store.object == "always"
    assert config.admission.store.head_tokens == 8192
    with pytest.raises(ConfigError, match="head_tokens"):
        load_config({"admission": {"store": {"head_tokens": -1}}})
    assert config.engine.recompute_tokens_per_second is None
    tuned = load_config({"admission": {"load": "break_even", "store": {"object": "reuse", "min_uses": 3}}})
    assert tuned.admission.store.object == "reuse" and tuned.admission.store.min_uses == 3
    with pytest.raises(ConfigError, match="admission"):
        load_config({"admission": {"store": {"disk": "sometimes"}}})
