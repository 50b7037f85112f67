"""What the connector reads from vLLM for a model's identity, on every supported vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvstrata.connector import compat
from kvstrata.identity import SAMPLED, resolve_model_identity


class FakeHfConfig:
    def __init__(self, **values):
        self.values = values

    def to_dict(self):
        return dict(self.values)


def engine_config(hf=None, **changes):
    """The parts of a VllmConfig that `model_settings` reads."""
    model = dict(revision=None, quantization=None, dtype="torch.float32", override_attention_dtype=None)
    cache = dict(cache_dtype="auto", calculate_kv_scales=False)
    for name, value in changes.items():
        (cache if name in cache else model)[name] = value
    hf_config = FakeHfConfig(**(hf or {"_name_or_path": "/models/a", "transformers_version": "5.0", "rope_theta": 1e4}))
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_config, **model),
        cache_config=SimpleNamespace(**cache),
        load_config=SimpleNamespace(load_format="auto", download_dir=None),
    )


def identity(checkpoint, config):
    return resolve_model_identity(str(checkpoint), SAMPLED, compat.model_settings(config)).digest


@pytest.fixture
def checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    return tmp_path


def test_paths_and_library_versions_in_the_hf_config_do_not_split_a_cache(checkpoint):
    here = engine_config()
    there = engine_config(hf={"_name_or_path": "/other/path", "transformers_version": "5.1", "rope_theta": 1e4})
    assert identity(checkpoint, here) == identity(checkpoint, there)
    assert "_name_or_path" not in compat.model_settings(here)["hf_config"]


@pytest.mark.parametrize(
    "change",
    [
        {"hf": {"rope_theta": 5e5}},  # an hf_overrides entry, as vLLM applies it to hf_config
        {"hf": {"rope_theta": 1e4, "rope_scaling": {"type": "yarn", "factor": 4.0}}},
        {"quantization": "fp8"},
        {"cache_dtype": "fp8_e5m2"},
        {"dtype": "torch.bfloat16"},
        {"calculate_kv_scales": True},
        {"override_attention_dtype": "float32"},
    ],
)
def test_each_engine_setting_that_changes_kv_bytes_changes_the_identity(checkpoint, change):
    assert identity(checkpoint, engine_config(**change)) != identity(checkpoint, engine_config())


def test_the_engine_config_is_found_where_the_connector_holds_it():
    """vLLM builds the spec inside the connector's constructor: a `vllm_config` argument
    and `self._vllm_config` (KVConnectorBase_V1) are on the stack; nothing else is."""
    from vllm.config import VllmConfig

    # Built without its constructor: CUDA builds of vLLM cannot infer a device without one.
    config = VllmConfig.__new__(VllmConfig)

    def spec_constructor():
        return compat.engine_vllm_config()

    def connector_constructor(vllm_config):
        return spec_constructor()

    class Connector:
        def __init__(self):
            self._vllm_config = config
            self.found = spec_constructor()

    assert connector_constructor(config) is config
    assert Connector().found is config
    assert spec_constructor() is not config  # not on this stack: not found
