"""The one module that imports vLLM: every vLLM name kvstrata uses comes from here.

vLLM marks the offloading API experimental and changes it between minor versions;
absorbing the differences here keeps the manager, worker and spec version-agnostic.
Supported: vLLM 0.29 through 0.33 (CI runs the connector tests on 0.29.0, 0.32.0 and
0.33.0). What differs, and how it is absorbed:

| vLLM | difference | here |
|---|---|---|
| 0.29 | `OffloadingGroupConfig` has no `group_id` (a group's index is its position) | `group_ids()` |
| < 0.32 | no `ReqContext.get_offload_key_position` | `key_position()` is None: order of arrival |
| 0.29 | `OffloadPolicy.BLOCK_LEVEL`, renamed `CHUNK_LEVEL` in 0.30 | not used by kvstrata |
| < 0.32 | no `get_load_source` / `CacheHitSource` (where a hit came from) | `load_source()` is None, never asked |
| < 0.33 | no `OffloadingManager.lock`: callers never take it | the manager locks itself (reentrant) on every version |
| < 0.33 | no `on_reset_flushed`: what a reset kept for jobs in flight is released with the request after the step that flushed them | `HAS_RESET_FLUSHED` |
| < 0.33 | no `config_info` / `config_info_keys` | not used: 0.33's defaults (no labels) apply |
| < 0.33 | `submit_load` has no `expedited` argument | the worker accepts and ignores it |
| < 0.33 | `OffloadingEvent` has no `metadata_only` | never set |
| < 0.33 | groups do not say which are full attention (`sliding_window_size_in_chunks`) | `anchor_groups()` is None |
| all | `OffloadingEvent.ownership` / `removal_expected` | set per tier by `make_event` |
| all | the spec gets no `VllmConfig` (revision, quantization, overrides) | `engine_vllm_config()` |
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

import vllm
from packaging.version import Version
from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvstrata.connector.kv_events import event_fields

try:  # 0.32+
    from vllm.v1.kv_offload.base import Locality
except ImportError:  # pragma: no cover - older vLLM
    Locality = None  # type: ignore[assignment,misc]
try:  # 0.32+
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # older vLLM: nobody asks where a hit came from
    CacheHitSource = None  # type: ignore[assignment,misc]

logger = logging.getLogger(__name__)

MIN_VLLM = Version("0.29")
# 0.33 tells managers when the workers finished every job in flight at a reset.
HAS_RESET_FLUSHED = hasattr(OffloadingManager, "on_reset_flushed")
MAX_VLLM_EXCLUSIVE = Version("0.34")
VLLM_VERSION = Version(vllm.__version__.split("+")[0])


def check_vllm_version() -> None:
    """Fail at engine start, with the range, on a vLLM whose offloading API we do not know."""
    if not (MIN_VLLM <= VLLM_VERSION < MAX_VLLM_EXCLUSIVE):
        raise RuntimeError(
            f"kvstrata supports vLLM >= {MIN_VLLM}, < {MAX_VLLM_EXCLUSIVE}; this is vLLM {vllm.__version__}"
        )


def make_event(keys: list[bytes], removed: bool, medium: str = "CPU") -> OffloadingEvent:
    """An event of a tier: `CPU` (the node arena), `STORAGE` (the node's disk), `OBJECT`
    (the shared object store) or `PEER` (another node's store), with the medium, locality
    and ownership `kv_events.TIER_EVENTS` gives it.

    Every tier announces its removals, so every store says so (`removal_expected`).
    """
    fields = event_fields(medium)
    kwargs: dict[str, Any] = {
        "keys": keys,
        "medium": Medium(fields.medium),
        "removed": removed,
        "ownership": fields.ownership,
        "removal_expected": not removed,
    }
    if Locality is not None:
        kwargs["locality"] = Locality(fields.locality)
    return OffloadingEvent(**kwargs)


def anchor_groups(config: OffloadingConfig) -> tuple[int, ...] | None:
    """The full-attention groups, where vLLM says which they are (0.33+); else None.

    0.33 gives each group `sliding_window_size_in_chunks` (None: full attention); before
    that the offloading config does not tell a sliding-window or Mamba group apart.
    """
    if not all(hasattr(group, "sliding_window_size_in_chunks") for group in config.groups):
        return None
    ids = group_ids(config)
    return tuple(gid for gid, group in zip(ids, config.groups) if group.sliding_window_size_in_chunks is None)


def key_position(req_context: ReqContext, key: bytes) -> int | None:
    """The token position a request's chunk ends at (0.32+), or None where vLLM has no such call."""
    get = getattr(req_context, "get_offload_key_position", None)
    return None if get is None else get(key)


def key_positions(req_context: ReqContext) -> Mapping[bytes, int] | None:
    """Every chunk of the request and the token its prefix ends at, as the scheduler
    recorded them before its lookups (0.32+; None before). Read-only: vLLM owns it."""
    return getattr(req_context, "_offload_key_positions", None)


def group_ids(config: OffloadingConfig) -> tuple[int, ...]:
    """The KV-cache group index of each offloaded group (0.29: its position in `groups`)."""
    return tuple(getattr(group, "group_id", index) for index, group in enumerate(config.groups))


def load_source(medium: str) -> Any:
    """vLLM's name for the tier a hit was loaded from, on versions that ask (0.32+).

    `CPU` (the node arena) is host memory, `STORAGE` the node's disk, `PEER` another
    node's store (peer to peer); the shared object store has no name of its own in
    vLLM: external, unspecified.
    """
    if CacheHitSource is None:
        return None
    known = {"CPU": CacheHitSource.HOST, "STORAGE": CacheHitSource.DISK, "PEER": CacheHitSource.P2P}
    return known.get(medium, CacheHitSource.EXTERNAL_UNSPECIFIED)


# How far up the stack `engine_vllm_config` looks for the connector that builds the spec
# (OffloadingConnector.__init__ -> OffloadingSpecFactory.create_spec -> spec.__init__).
_CONFIG_SEARCH_FRAMES = 12
# Keys of a Hugging Face config that name where or with what it was read, not what it is.
_VOLATILE_HF_KEYS = ("transformers_version",)


def engine_vllm_config() -> Any | None:
    """The engine's `VllmConfig`, or None where it cannot be found.

    vLLM hands an offloading spec only its `OffloadingConfig`, which names the model by
    path and the KV-cache dtype but not its revision, quantization or config overrides:
    what a model identity needs. The connector that builds the spec holds the whole
    config (`KVConnectorBase_V1._vllm_config`, and a `vllm_config` argument) in its
    constructor's frame, so the spec's constructor looks a few frames up for it; vLLM's
    `get_current_vllm_config_or_none` is the fallback (set in workers, not in the
    scheduler). Call it from the spec's constructor only.
    """
    from vllm.config import VllmConfig

    frame = sys._getframe(1)
    for _ in range(_CONFIG_SEARCH_FRAMES):
        if frame is None:
            break
        local = frame.f_locals
        for candidate in (local.get("vllm_config"), getattr(local.get("self"), "_vllm_config", None)):
            if isinstance(candidate, VllmConfig):
                return candidate
        frame = frame.f_back
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # pragma: no cover - older vLLM
        return None
    return get_current_vllm_config_or_none()


def cached_prefix_unsupported(vllm_config: Any | None) -> str | None:
    """Why this engine's attention cannot compute a prompt over a prefix loaded into its KV
    cache, or None. Such an engine must never get a hit: vLLM turns its own prefix caching
    off there, and an offloaded hit would be a wrong answer.

    vLLM 0.32's CPU platform runs MLA on its reference backend (CPU_MLA, unless AMX MLA
    is on), whose prefill is a plain SDPA over the new tokens only; it then forces prefix
    caching and chunked prefill off (platforms/cpu.py). The exactness matrix found kvstrata
    hits there giving other tokens than recomputing (28 Nov 2026), with every byte of the
    chunks round-tripped exactly."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    if model is None or cache is None or not getattr(model, "use_mla", False):
        return None
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and not cache.enable_prefix_caching:
        return "vLLM's CPU MLA backend prefills without a cached prefix (vLLM forced its own prefix caching off)"
    return None


def async_scheduling(vllm_config: Any | None) -> bool:
    """Whether the engine schedules a step while the one before runs (the recompute rate
    then times a step by the interval after the next: connector/recompute_rate.py)."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    return bool(getattr(scheduler, "async_scheduling", False))


def model_settings(vllm_config: Any) -> dict[str, Any]:
    """Everything in an engine's config that changes KV bytes for the same token ids.

    The effective Hugging Face config is taken *after* vLLM applied `hf_overrides`
    (RoPE scaling, layer types, a checkpoint's `quantization_config` all live there),
    less the keys that name a path or a library version. Not vLLM's own
    `ModelConfig.compute_hash`: that is the compile-cache key, which includes the model
    path (defeating sharing between nodes that keep a checkpoint at different paths).
    """
    model, cache = vllm_config.model_config, vllm_config.cache_config
    return {
        "revision": model.revision,
        "quantization": model.quantization,
        "model_dtype": str(model.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(cache.cache_dtype),
        "calculate_kv_scales": getattr(cache, "calculate_kv_scales", None),
        "override_attention_dtype": getattr(model, "override_attention_dtype", None),
        "load_format": str(getattr(vllm_config.load_config, "load_format", "")),
        "hf_config": _portable_hf_config(model.hf_config.to_dict()),
    }


def model_download_dir(vllm_config: Any) -> str | None:
    """Where vLLM keeps downloaded checkpoints (None: the Hugging Face cache's default)."""
    return getattr(vllm_config.load_config, "download_dir", None)


def _portable_hf_config(value: Any) -> Any:
    """The config with private keys (`_name_or_path`, `_commit_hash`, ...) and library
    versions removed at every level, values made JSON-stable."""
    if isinstance(value, Mapping):
        return {
            str(key): _portable_hf_config(item)
            for key, item in value.items()
            if not str(key).startswith("_") and key not in _VOLATILE_HF_KEYS
        }
    if isinstance(value, list | tuple):
        return [_portable_hf_config(item) for item in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def prefix_hash_algo(vllm_config: Any | None = None) -> str:
    """The prefix-cache hash in use: chunks hashed differently must never meet."""
    if vllm_config is None:
        try:
            from vllm.config import get_current_vllm_config_or_none

            vllm_config = get_current_vllm_config_or_none()
        except ImportError:  # pragma: no cover - older vLLM
            vllm_config = None
    if vllm_config is None:
        return "sha256"
    return str(vllm_config.cache_config.prefix_caching_hash_algo)


def prefix_block_hashes(
    token_ids: list[int],
    tokens_per_hash: int,
    hash_algo: str,
    seed: str | None = None,
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """The block hashes an engine computes for a prompt (`Request.block_hashes`), outside
    any engine: what a router needs to name the prompt's chunks.

    vLLM's own functions do the work (the hash function by name, the extra keys of LoRA
    and `cache_salt` in the order and form vLLM builds them, the parent chaining); the
    request they read is a stand-in with no multimodal inputs or prompt embeddings.
    `seed`: what the engines' first parent hash (`NONE_HASH`) is derived from; None:
    as vLLM derives it in this process (`PYTHONHASHSEED`, else vLLM's fixed seed for
    cryptographic hashes). `lora`: (adapter name, adapter path) as the engine resolved
    them. Leaves vLLM's module state (its `NONE_HASH`) alone.

    Raises ValueError where this process cannot reproduce the engines' hashes: an
    unknown algorithm, or a non-cryptographic one with no seed (vLLM then seeds each
    engine at random).
    """
    from types import SimpleNamespace

    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name(hash_algo)
    if seed is None:
        resolve = getattr(kv_cache_utils, "resolve_none_hash_seed", None)
        seed = os.environ.get("PYTHONHASHSEED")
        if seed is None and resolve is not None and hash_algo.startswith("sha256"):
            seed = resolve(hash_fn)
        if seed is None:
            raise ValueError(
                f"kvstrata: the engines' {hash_algo} block hashes start from a random seed; set PYTHONHASHSEED "
                "to one value for the engines and the router (or pass the seed)"
            )
    lora_request = None if lora is None else SimpleNamespace(lora_name=lora[0], lora_path=lora[1], name=lora[0])
    request = SimpleNamespace(
        lora_request=lora_request,
        cache_salt=cache_salt,
        mm_features=[],
        prompt_embeds=None,
        _prompt_embeds_per_block_hashes={},
    )
    parent: bytes = hash_fn(seed)
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - tokens_per_hash + 1, tokens_per_hash):
        extra_keys, _ = kv_cache_utils.generate_block_hash_extra_keys(request, start, start + tokens_per_hash, 0)
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, token_ids[start : start + tokens_per_hash], extra_keys)
        hashes.append(bytes(parent))
    return hashes


__all__ = [
    "BlockIDsLoadStoreSpec",
    "CanonicalKVCaches",
    "GPULoadStoreSpec",
    "LoadStoreSpec",
    "LookupResult",
    "OffloadKey",
    "OffloadingConfig",
    "OffloadingConnectorStats",
    "OffloadingCounterMetadata",
    "OffloadingEvent",
    "OffloadingGaugeMetadata",
    "OffloadingManager",
    "OffloadingMetricMetadata",
    "OffloadingSpec",
    "OffloadingWorker",
    "PrepareStoreOutput",
    "ReqContext",
    "RequestOffloadingContext",
    "ScheduleEndContext",
    "TransferResult",
    "HAS_RESET_FLUSHED",
    "anchor_groups",
    "async_scheduling",
    "check_vllm_version",
    "engine_vllm_config",
    "group_ids",
    "key_position",
    "key_positions",
    "load_source",
    "make_event",
    "model_download_dir",
    "model_settings",
    "override",
    "prefix_block_hashes",
    "prefix_hash_algo",
]
