"""The YAML schema users write: every tier, its limits, and how stores are placed.

The schema is strict (unknown keys are errors) because a misspelt limit that is
silently ignored is worse than an engine that refuses to start. Errors name the
file, the key path and the reason, so an operator can fix the YAML without reading
a traceback.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from kvstrata.namespaces import check_tenant

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
# Bounds every setting must keep (found by tests/test_config_properties.py): byte counts and
# integers fit a signed 64-bit value (file offsets, Prometheus floats), and numbers of seconds
# fit what a Python wait accepts (`threading.TIMEOUT_MAX`: a longer one is an OverflowError).
MAX_INTEGER = 2**63 - 1
MAX_NUMBER = float(threading.TIMEOUT_MAX)
# A document expanding to more than this (YAML aliases repeating aliases, a "billion laughs")
# or nesting deeper is refused before anything walks it.
MAX_VALUES = 100_000
MAX_DEPTH = 32


# `storage_options` keys whose values are credentials, wherever they nest (`key`, `secret`,
# `aws_session_token`, Azure's `account_key` and `sas_token`, `password`, `credentials`, ...):
# never in a log line, an exception, `kvstrata status`, a metric or an actor's arguments.
SECRET_OPTION = re.compile(r"key|secret|token|passw|credential|username", re.IGNORECASE)


def is_secret_option(name: object) -> bool:
    return isinstance(name, str) and SECRET_OPTION.search(name) is not None


def secret_values(options: Any) -> list[str]:
    """The values of secret-named entries in `storage_options`, at any depth (as text)."""
    found: list[str] = []
    todo = [options]
    while todo:
        value = todo.pop()
        items = value.items() if isinstance(value, Mapping) else enumerate(value) if isinstance(value, list) else ()
        for name, item in items:
            if isinstance(item, (Mapping, list)):
                todo.append(item)
            elif is_secret_option(name) and item not in (None, "", True, False):
                found.append(str(item))
    return found


class ConfigError(ValueError):
    """A tier configuration that cannot be used; the message names file, key and reason."""


def parse_size(value: Any) -> int:
    """Turn `64GiB`, `512 MB`, `1.5GiB` or a plain integer into a byte count."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as '4GiB', got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and len(value) <= 64:
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _UNITS:
            try:  # exact: a float would round `12345678901234567891` and overflow on 400 digits
                return int(Decimal(match.group(1)) * _UNITS[match.group(2).lower()])
            except InvalidOperation:
                pass
    shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
    raise ValueError(f"expected a size such as '4GiB' or '512MB', got {shown}")


ByteSize = Annotated[int, BeforeValidator(parse_size)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="after")
    @classmethod
    def _within_bounds(cls, value: Any) -> Any:
        """No setting is infinite, NaN, or beyond what the code that reads it can hold."""
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and abs(value) > MAX_INTEGER:
            raise ValueError(f"must be at most {MAX_INTEGER} (2**63 - 1)")
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= MAX_NUMBER):
            raise ValueError(f"must be a finite number at most {MAX_NUMBER:.0f}")
        return value


class CpuTierConfig(_Strict):
    """The node arena: fixed-size slots in shared memory, shared by every engine."""

    capacity: ByteSize = Field(default=1024**3, gt=0, description="arena budget per node")
    segment_size: ByteSize = Field(
        default=256 * 1024**2,
        gt=0,
        description="the arena grows in shared-memory files of this size (whole slots)",
    )
    shm_dir: str = Field(default="/dev/shm", description="where arena segments live")
    eviction_policy: str = Field(
        default="lru", pattern=r"^[a-z_]+$", description="eviction policy by name, from kvstrata/tiers/policies (`lru`)"
    )
    prefault: bool = Field(
        default=True, description="touch new segments once so first copies run at memcpy speed"
    )
    audit_chunks: bool = Field(
        default=False, description="check every chunk promoted from disk or the object store against its commits' digests"
    )


class DiskTierConfig(_Strict):
    """Local NVMe: checksummed records in one slab (a payload file and a header file) per namespace, restart-safe."""

    path: str = Field(description="directory of this node's slab files; one store per directory")
    capacity: ByteSize = Field(gt=0, description="bytes of records on disk at most")
    write_policy: Literal["write_through", "write_back"] = Field(
        default="write_through",
        description="write_through: every committed chunk goes to disk; write_back: when evicted from the arena",
    )
    io_threads: int = Field(default=4, ge=1, le=64, description="disk reads and writes in flight at once")
    direct_io: bool = Field(default=True, description="O_DIRECT where the filesystem supports it")
    queue_depth: int = Field(default=256, ge=1, description="disk writes waiting at most; more are dropped and counted")


class ObjectTimeouts(_Strict):
    connect_seconds: float = Field(default=2.0, gt=0, description="bound on opening a connection")
    read_seconds: float = Field(default=5.0, gt=0, description="bound on waiting for the server's next bytes")


class ObjectTierConfig(_Strict):
    """Object storage shared by every node: any fsspec URL (`s3://bucket/prefix`, `file://`, `memory://`)."""

    url: str = Field(pattern=r"^[a-z0-9+]+://.+", description="root of kvstrata's objects, e.g. s3://bucket/kv")
    endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint (MinIO, SeaweedFS, ...)")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="passed to the fsspec filesystem (credentials, region, ...); never logged"
    )
    max_concurrency: int = Field(default=16, ge=1, le=256, description="object requests in flight at once")
    timeouts: ObjectTimeouts = ObjectTimeouts()
    max_attempts: int = Field(
        default=3, ge=1, le=10, description="tries per request on throttling, 5xx and timeouts (backoff with jitter)"
    )
    write_policy: Literal["write_through", "write_back"] = Field(
        default="write_through",
        description="write_through: every committed chunk is uploaded; write_back: when evicted from the arena",
    )
    queue_depth: int = Field(default=256, ge=1, description="uploads waiting at most; more are dropped and counted")
    index_refresh_seconds: float = Field(
        default=30.0,
        gt=0,
        description="how often a node store lists `url` (the sweep) to learn chunks other nodes stored, "
        "and to apply `capacity` and `ttl_seconds`",
    )
    backoff_max_seconds: float = Field(
        default=30.0, gt=0, description="longest pause of the tier after failures before it tries the store again"
    )
    capacity: ByteSize | None = Field(
        default=None,
        gt=0,
        description="bytes of chunk objects under `url` at most; each sweep deletes the oldest-written beyond it (with admission.store reuse, the least reused of the oldest 8 first)",
    )
    ttl_seconds: float | None = Field(
        default=None, gt=0, description="chunk objects written longer ago than this are deleted by the next sweep"
    )
    client: Literal["auto", "pyarrow", "fsspec"] = Field(
        default="auto",
        description="client of chunk PUTs and GETs: auto = pyarrow's S3 client for s3:// when the options "
        "allow, else fsspec (listing, manifests and removals always use fsspec)",
    )


    def __repr_args__(self) -> Any:
        """A config printed or logged shows which options are set, never a credential's value."""
        for name, value in super().__repr_args__():
            yield name, (_masked(value) if name == "storage_options" else value)


def _masked(options: Any) -> Any:
    if isinstance(options, Mapping):
        return {name: "***" if is_secret_option(name) and not isinstance(value, (Mapping, list)) else _masked(value)
                for name, value in options.items()}  # fmt: skip
    if isinstance(options, list):
        return [_masked(value) for value in options]
    return options


class TiersConfig(_Strict):
    """The node's tiers: the arena always, disk and object storage when their section is present."""

    cpu: CpuTierConfig = CpuTierConfig()
    disk: DiskTierConfig | None = None
    object: ObjectTierConfig | None = None


class EngineConfig(_Strict):
    """How the scheduler-side manager talks to its node store."""

    lease_seconds: float = Field(
        default=30.0,
        gt=0,
        description="pins and reservations of an engine that stops renewing expire after this (the store's "
        "setting; time the store spent stalled in one call does not count); an idle engine sends a heartbeat "
        "every third of its own, and an engine whose last answer from the store is older than half the "
        "store's lease answers no HIT from its own state and stores nothing",
    )
    reserve_slots: int = Field(
        default=32, ge=1, description="free slots kept reserved so prepare_store never waits"
    )
    refresh_seconds: float = Field(
        default=0.05,
        ge=0,
        description="an engine with nothing to send still refreshes its view of the store this often",
    )
    control_timeout_seconds: float = Field(
        default=10.0, gt=0, description="bound on one control call to the node store"
    )
    max_view_age_seconds: float = Field(
        default=0.1,
        ge=0,
        description="a lookup answers MISS only from a view of the node store taken at most this long "
        "before its request arrived, or two of the store's usual round trips where those are longer (a busy "
        "machine); an older view makes it RETRY while a fresh one is fetched "
        "(0: chunks that reached any tier before the request arrived are always found)",
    )
    lookup_wait_seconds: float = Field(
        default=2.0,
        gt=0,
        description="longest a request waits (RETRY) for its chunks to be located or promoted "
        "before its lookups answer MISS and it recomputes",
    )
    view_wait_steps: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="longest a request waits, in this engine's own scheduler steps, for a store that has "
        "not answered since (a fresher view, a pin), and at least 8 of the store's usual round trips (an idle "
        "engine's steps come faster than a healthy store answers): then it is answered from what the engine knows",
    )
    copy_threads: int = Field(
        default=2,
        ge=1,
        le=64,
        description="threads a CPU engine's worker copies one large transfer with (CUDA copies run on "
        "their own streams and ignore this)",
    )
    gpu_copy: Literal["auto", "dma", "kernel"] = Field(
        default="auto",
        description="how a CUDA worker moves pages: dma (one batched driver copy per transfer; never takes "
        "an SM from the model), kernel (a Triton copy kernel on 2 SMs per direction) or auto (the kernel for "
        "transfers whose rows are all under 256 KiB, 16 or more of them, "
        "multiples of 8 bytes, pinned memory; DMA otherwise: measured on an H200, docs/gpu-copy.md)",
    )
    recompute_tokens_per_second: float | None = Field(
        default=None,
        gt=0,
        description="this engine's prefill rate (tokens/s), which `admission.load: break_even` weighs "
        "loads against (unset: measured from the engine's own scheduler steps)",
    )


class StoreAdmissionConfig(_Strict):
    """Which chunks the cascade writes down to disk and to the object store."""

    disk: Literal["always", "reuse", "chain"] = Field(
        default="chain",
        description="always: every chunk; reuse: only chunks used min_uses times; chain (default): those and the "
        "first head_tokens of every prefix (half the writes of always on real chat traffic, docs/real-traffic.md)",
    )
    object: Literal["always", "reuse", "chain"] = Field(
        default="always",
        description="reuse: only chunks used min_uses times; chain: those and the first head_tokens of every prefix",
    )
    head_tokens: int = Field(
        default=8192,
        ge=0,
        description="chain: chunks whose prefix ends within this many tokens of a request are written at once",
    )
    min_uses: int = Field(default=2, ge=1, le=255, description="uses within the window before a chunk is written down")
    window: int = Field(
        default=100_000, ge=1024, le=1 << 26, description="chunk uses per namespace after which counts halve"
    )


class AdmissionConfig(_Strict):
    """Cost-based admission: what engines load from the lower tiers, what the store writes to them."""

    load: Literal["always", "break_even"] = Field(
        default="break_even",
        description="break_even: recompute a prefix's rest when loading it would be slower (always: load every hit)",
    )
    safety_margin: float = Field(
        default=0.2, ge=0, le=10, description="recompute only when loading is slower by more than this fraction"
    )
    stale_seconds: float = Field(
        default=30.0,
        gt=0,
        description="an estimate older than this is measured again: by the next load if it says load, "
        "else by promoting the skipped chunks in the background while the request recomputes",
    )
    store: StoreAdmissionConfig = StoreAdmissionConfig()


class PrefetchConfig(_Strict):
    """Chunks brought into the arena before a request asks (route-time prefetch, `kvstrata warm`,
    `kv.prefetch` hints), retention (`kv.retain`) and hint pins (docs/prefetch.md)."""

    lease_seconds: float = Field(
        default=10.0,
        gt=0,
        le=86400,
        description="how long a prefetched chunk is held in the arena, after the moment it is expected, "
        "for its first use; then it is left to normal eviction",
    )
    max_share: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="share of a namespace's arena slots that prefetched chunks waiting for their first use "
        "may hold at once; beyond it a prefetch is refused (counted)",
    )
    pin_share: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="share of a tenant's arena (its `quotas` cpu bytes, else the arena) that `pin` hints may hold",
    )
    max_retain_seconds: float = Field(
        default=7 * 86400, gt=0, description="longest TTL a `kv.retain` hint gets; longer ones are cut to it (counted)"
    )
    max_retained_chunks: int = Field(
        default=1_000_000, ge=0, description="chunks retained at once per node; retentions beyond are refused (counted)"
    )
    retain_share: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="share of `max_retained_chunks` one tenant's retentions may hold; beyond it they are refused "
        "(counted), so no tenant fills the table for the others",
    )
    max_lease_seconds: float = Field(
        default=600.0,
        gt=0,
        le=86400,
        description="longest hold a prefetch (a `kv.prefetch` hint's `lease_seconds`, `kvstrata warm --lease`) gets; "
        "longer ones are cut to it (counted)",
    )
    max_deadline_seconds: float = Field(
        default=600.0,
        ge=0,
        le=86400,
        description="latest a prefetch's expected use (`deadline_seconds`) may be; later ones are cut to it (counted)",
    )
    pin_sources: list[Literal["operator", "request"]] = Field(
        default=["operator"],
        description="who may `pin`: `operator` (`kvstrata warm --pin`, the store's Python and Ray calls), "
        "`request` (`pin` hints in requests, i.e. any HTTP client); a pin from another source is refused (counted)",
    )
    hint_max_actions: int = Field(
        default=32, ge=0, le=1024, description="hint actions one request may carry; further ones are dropped (counted)"
    )
    hint_max_tokens: int = Field(
        default=131072,
        ge=0,
        le=16_777_216,
        description="token ids (or block hashes) the hint actions of one request may name together, checked before "
        "any hashing; an action past it is dropped (counted)",
    )


class RayConfig(_Strict):
    """The Ray cluster engines join, and the node-store actor's resources."""

    address: str = Field(
        default="auto", description="Ray cluster to join when the process has not joined one"
    )
    store_num_cpus: float = Field(
        default=0.0, ge=0, description="CPUs the node-store actor reserves from Ray's scheduler (0: none)"
    )


class ClusterConfig(_Strict):
    """Many nodes as one cache: a sharded directory of who holds what, and peer fetch."""

    directory_shards: int = Field(default=4, ge=1, le=256, description="directory actors the keys are spread over")
    sync_seconds: float = Field(
        default=0.2, gt=0, description="how often a store publishes what it holds and learns what its peers hold"
    )
    call_timeout_seconds: float = Field(
        default=5.0, gt=0, description="bound on one directory call or one peer fetch"
    )
    fetch_batch_bytes: ByteSize = Field(
        default=64 * 1024**2, gt=0, description="chunk bytes moved by one peer fetch call at most"
    )
    reconcile_seconds: float = Field(
        default=5.0, gt=0, description="how often `kvstrata up`'s reconciler checks for nodes that joined or left"
    )
    node_resource: str | None = Field(
        default=None, description="only nodes offering this custom resource get a store (default: every node)"
    )
    node_label: str | None = Field(
        default=None,
        pattern=r"^[^=]+=[^=]*$",
        description="only nodes with this Ray node label (`key=value`, from `ray start --labels`) get a store",
    )


class TenantQuota(_Strict):
    """Bytes one tenant (a `namespace_prefix`) may hold in each tier; a tier left out is unbounded for it.

    A ceiling enforced by eviction inside the tenant's own share (`kvstrata.tiers.quotas`).
    """

    cpu: ByteSize | None = Field(default=None, gt=0, description="arena bytes (segments) of the tenant's pools at most")
    disk: ByteSize | None = Field(default=None, gt=0, description="disk bytes (records) of the tenant's slabs at most")
    object: ByteSize | None = Field(
        default=None, gt=0, description="bytes of the tenant's chunk objects at most, kept by each sweep"
    )


class KvstrataConfig(_Strict):
    namespace_prefix: str = Field(
        default="",
        max_length=128,
        description="isolates tenants: chunks of different prefixes never mix",
    )
    model_identity: str = Field(
        default="exact",
        min_length=1,
        max_length=256,
        pattern=r"^[\x21-\x7e][\x20-\x7e]*$",
        description="how engines decide they serve the same weights: `exact` (every byte of every file: a Hugging "
        "Face cache snapshot by its content names, other files hashed once per node and remembered by inode and "
        "times), `full` (every byte hashed at every engine start), `sampled` (sizes and a fixed sample of each "
        "weight file: misses most in-place edits), or any other string: your own version label for the weights, "
        "shared by every engine that gives it",
    )
    tiers: TiersConfig = TiersConfig()
    engine: EngineConfig = EngineConfig()
    admission: AdmissionConfig = AdmissionConfig()
    prefetch: PrefetchConfig = PrefetchConfig()
    ray: RayConfig = RayConfig()
    cluster: ClusterConfig | None = Field(
        default=None, description="multi-node: directory and peer fetch (off: each node's store stands alone)"
    )
    quotas: dict[Annotated[str, Field(max_length=128)], TenantQuota] = Field(
        default_factory=dict,
        description="per tenant (`namespace_prefix`): bytes it may hold in the arena, on disk and in the bucket",
    )

    @field_validator("namespace_prefix")
    @classmethod
    def _tenant_name(cls, value: str) -> str:
        """The rules of `kvstrata.namespaces.check_tenant` (the store checks them again)."""
        return check_tenant(value)

    @field_validator("quotas")
    @classmethod
    def _quota_tenants(cls, value: dict[str, TenantQuota]) -> dict[str, TenantQuota]:
        """A quota key is a `namespace_prefix`: the same rules, or it could never match one."""
        for tenant in value:
            check_tenant(tenant, "quotas key")
        return value

    def tier_quotas(self, tier: Literal["cpu", "disk", "object"]) -> dict[str, int]:
        """Prefix -> bytes of the tenants with a quota in `tier` (what the tier enforces)."""
        return {prefix: limit for prefix, quota in self.quotas.items() if (limit := getattr(quota, tier)) is not None}


def _describe(error: Mapping[str, Any]) -> str:
    loc = ".".join(str(part) for part in error.get("loc", ())) or "<root>"
    if error.get("type") == "extra_forbidden":
        return f"{loc}: unknown key"
    return f"{loc}: {error.get('msg', 'invalid value')}"


def _check_size(data: Any, source: str) -> None:
    """Refuse a document that nests deeper than MAX_DEPTH or expands to more than MAX_VALUES
    values, naming the key where it does; the walk itself stops there, so it is bounded."""
    budget = MAX_VALUES
    todo: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while todo:
        value, path = todo.pop()
        budget -= 1
        where = ".".join(path[:MAX_DEPTH]) or "<root>"
        if budget < 0 or len(path) > MAX_DEPTH:
            raise ConfigError(
                f"{source}: {where}: the document nests deeper than {MAX_DEPTH} levels or holds more than "
                f"{MAX_VALUES:,} values (YAML aliases that repeat aliases, or one that contains itself?)"
            )
        if isinstance(value, Mapping):
            todo.extend((item, (*path, str(name))) for name, item in value.items())
        elif isinstance(value, (list, tuple)):
            todo.extend((item, (*path, str(n))) for n, item in enumerate(value))


def _validate(data: Any, source: str) -> KvstrataConfig:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    _check_size(data, source)
    try:
        return KvstrataConfig.model_validate(dict(data))
    except ValidationError as exc:
        reasons = "; ".join(_describe(error) for error in exc.errors())
        raise ConfigError(f"{source}: {reasons}") from None


def load_config(source: str | Path | Mapping[str, Any] | KvstrataConfig | None) -> KvstrataConfig:
    """Load a config from a YAML path, an inline mapping, or None for the built-in default.

    The built-in default is what `configs/local.yaml` spells out: a CPU tier only.
    """
    if source is None:
        return KvstrataConfig()
    if isinstance(source, KvstrataConfig):
        return source
    if isinstance(source, Mapping):
        return _validate(source, "inline kvstrata config")
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the kvstrata config ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: malformed YAML: nested too deeply") from None
    except ValueError as exc:  # PyYAML's int() of a number beyond Python's digit limit
        raise ConfigError(f"{path}: malformed YAML: {str(exc)[:200]}") from None
    return _validate(data, str(path))


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: YAML keeps the last
    without a word, so a limit set twice would lose the first silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = self.construct_scalar(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice in one mapping", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)
