"""An engine whose attention cannot compute over a loaded prefix never gets a hit.

Found by the exactness matrix (issue 50, 28 Nov 2026): vLLM 0.32's CPU MLA backend
prefills with SDPA over the new tokens only (vLLM forces its own prefix caching off
for it), so a kvstrata hit there gave other tokens than recomputing, although every
chunk's bytes round-tripped exactly. kvstrata is now off for such an engine: every
lookup a MISS (counted), nothing stored."""

from __future__ import annotations

from types import SimpleNamespace

from kvstrata.connector.compat import LookupResult, cached_prefix_unsupported
from kvstrata.connector.deferred_start import Off
from kvstrata.connector.metrics import COUNTER_NAMES, metric_name
from tests.connector.test_manager import ctx
from tests.utils import key


def engine_config(use_mla: bool, prefix_caching: bool):
    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=use_mla),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
    )


def on_platform(monkeypatch, cpu: bool) -> None:
    """vLLM's platform as the check sees it (the CUDA builds of scripts/vllm_matrix.py do
    not detect this machine as their CPU platform)."""
    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "current_platform", SimpleNamespace(is_cpu=lambda: cpu))


def test_cpu_mla_with_prefix_caching_forced_off_cannot_take_a_hit(monkeypatch):
    on_platform(monkeypatch, cpu=True)  # vLLM's CPU platform turned prefix caching off for MLA
    why = cached_prefix_unsupported(engine_config(use_mla=True, prefix_caching=False))
    assert why is not None and "MLA" in why
    assert cached_prefix_unsupported(engine_config(use_mla=True, prefix_caching=True)) is None  # AMX MLA
    assert cached_prefix_unsupported(engine_config(use_mla=False, prefix_caching=False)) is None  # a user's choice
    assert cached_prefix_unsupported(None) is None
    on_platform(monkeypatch, cpu=False)  # a GPU: MLA backends there compute over a cached prefix
    assert cached_prefix_unsupported(engine_config(use_mla=True, prefix_caching=False)) is None


def test_the_off_manager_misses_counts_and_stores_nothing():
    off = Off("a reason")
    assert off.lookup(key(1), ctx("r")) is LookupResult.MISS
    assert off.lookup(key(2), ctx("r")) is LookupResult.MISS
    assert off.prepare_store([key(1), key(2)], ctx("r")).keys_to_store == []
    reported = off.get_stats().reduce()
    assert reported[metric_name("lookups_cache_off")] == 2
    assert "lookups_cache_off" in COUNTER_NAMES


def test_the_spec_gives_such_an_engine_the_off_manager_without_joining_anything(monkeypatch):
    import kvstrata.actors.client as client_module
    import kvstrata.connector.spec as spec_module
    from tests.connector.test_deferred_start import _bare_spec

    spec = _bare_spec(spec_module, monkeypatch)
    spec._cache_off = "vLLM's CPU MLA backend prefills without a cached prefix"

    def no_store(cfg):
        raise AssertionError("an engine kvstrata is off for joined the node store")

    monkeypatch.setattr(client_module, "ensure_node_store", no_store)
    manager = spec.get_manager()
    assert isinstance(manager, Off) and spec.get_manager() is manager
    assert manager.lookup(key(1), ctx("r")) is LookupResult.MISS
