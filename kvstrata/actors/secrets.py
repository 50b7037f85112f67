"""Credentials reach the store actors without being their constructor arguments.

Why: Ray keeps an actor's constructor arguments for as long as the actor may restart, and
tools that show actors (the dashboard's actor table) can show them. So whoever creates a
store (`kvstrata up`, an engine, the reconciler, the Serve callback) calls `stash_secrets`:
every secret-named entry of `tiers.object.storage_options` (`kvstrata.config.is_secret_option`),
and the user info of `tiers.object.url` (`s3://user:password@host/...`), is put in the Ray
cluster's internal key-value store (the GCS's, namespace `kvstrata`), and
the actor gets the config with each such value replaced by a placeholder
`kvstrata-secret:<digest>:<n>`. The store calls `resolve_secrets` when it starts.

Why the GCS key-value store rather than a file or Ray runtime-env variables: it is reachable
from every node (a 0600 file would exist only where `kvstrata up` ran, and a store is created
on every node), it lives exactly as long as the cluster and so as long as the detached
stores that restart from it, and it shows in no table of actors, tasks or jobs (runtime-env
variables do: they are part of the actor's and the job's runtime env). Its trust boundary is
the cluster's: any process that can join the cluster can call the store anyway.

Invariants:
- A placeholder names the digest of the secrets it stands for, salted once per cluster (so
  the digest reveals nothing of a short password); the same secrets give the same
  placeholders, so stashing is idempotent and creates one entry.
- A config that already holds placeholders (the reconciler's) is passed on unchanged.
- A store that cannot resolve a placeholder fails at start, naming the key-value entry.
"""

from __future__ import annotations

import hashlib
import json
import secrets as token_source
from collections.abc import Mapping
from typing import Any

from kvstrata.actors.options import STORE_NAMESPACE
from kvstrata.config import KvstrataConfig, is_secret_option
from kvstrata.url_credentials import url_userinfo

PLACEHOLDER = "kvstrata-secret:"
KV_PREFIX = "kvstrata/secrets/"


def stash_secrets(config: KvstrataConfig) -> dict[str, Any]:
    """The config as a dict for an actor's arguments, its credentials stashed in the cluster:
    secret-named `storage_options` and the user info of the object `url` (`s3://user:pass@...`),
    which becomes `s3://<placeholder>@...` (still a URL, so the config still loads)."""
    dumped = config.model_dump()
    object_tier = dumped["tiers"].get("object")
    if not object_tier:
        return dumped
    found: list[Any] = []
    _replace(object_tier["storage_options"], lambda value: found.append(value) or len(found) - 1, digest="")
    userinfo = url_userinfo(object_tier["url"])
    if userinfo is not None and not _is_placeholder(userinfo):
        found.append(userinfo)
    if not found:
        return dumped
    from ray.experimental import internal_kv

    blob = json.dumps(found).encode()
    digest = hashlib.sha256(_salt() + blob).hexdigest()[:32]
    internal_kv._internal_kv_put(KV_PREFIX + digest, blob, overwrite=True, namespace=STORE_NAMESPACE)
    counter = iter(range(len(found)))
    _replace(object_tier["storage_options"], lambda value: next(counter), digest=digest)
    if userinfo is not None and not _is_placeholder(userinfo):
        object_tier["url"] = object_tier["url"].replace(f"{userinfo}@", f"{PLACEHOLDER}{digest}:{len(found) - 1}@", 1)
    return dumped


def resolve_secrets(config: Any) -> Any:
    """`config` with every placeholder replaced by its secret (unchanged if it has none)."""
    if not isinstance(config, Mapping):
        return config
    object_tier = (config.get("tiers") or {}).get("object") or {}
    options = object_tier.get("storage_options")
    in_url = url_userinfo(str(object_tier.get("url", "")))
    in_url = in_url if _is_placeholder(in_url) else None
    if not _has_placeholder(options) and in_url is None:
        return config
    from ray.experimental import internal_kv

    resolved = json.loads(json.dumps(config))  # a copy: the caller's dict is Ray's argument
    cache: dict[str, list[Any]] = {}

    def secret(placeholder: str) -> Any:
        digest, _, index = placeholder[len(PLACEHOLDER) :].partition(":")
        if digest not in cache:
            blob = internal_kv._internal_kv_get(KV_PREFIX + digest, namespace=STORE_NAMESPACE)
            if blob is None:
                raise RuntimeError(
                    f"the object tier's credentials are not in this Ray cluster's key-value store "
                    f"({STORE_NAMESPACE}/{KV_PREFIX}{digest}); run `kvstrata up` again"
                )
            cache[digest] = json.loads(blob)
        return cache[digest][int(index)]

    resolved_tier = resolved["tiers"]["object"]
    if options is not None:
        _substitute(resolved_tier["storage_options"], secret)
    if in_url is not None:
        resolved_tier["url"] = resolved_tier["url"].replace(f"{in_url}@", f"{secret(in_url)}@", 1)
    return resolved


def _salt() -> bytes:
    from ray.experimental import internal_kv

    key = KV_PREFIX + "salt"
    internal_kv._internal_kv_put(key, token_source.token_hex(16), overwrite=False, namespace=STORE_NAMESPACE)
    return internal_kv._internal_kv_get(key, namespace=STORE_NAMESPACE)


def _replace(options: Any, index_of: Any, digest: str) -> None:
    """Replace secret-named values (not already placeholders) in place, in a fixed order."""
    items = options.items() if isinstance(options, dict) else enumerate(options) if isinstance(options, list) else ()
    for name, value in list(items):
        if isinstance(value, (dict, list)):
            _replace(value, index_of, digest)
        elif is_secret_option(name) and value not in (None, "", True, False) and not _is_placeholder(value):
            index = index_of(value)
            if digest:
                options[name] = f"{PLACEHOLDER}{digest}:{index}"


def _substitute(options: Any, secret: Any) -> None:
    items = options.items() if isinstance(options, dict) else enumerate(options) if isinstance(options, list) else ()
    for name, value in list(items):
        if isinstance(value, (dict, list)):
            _substitute(value, secret)
        elif _is_placeholder(value):
            options[name] = secret(value)


def _has_placeholder(options: Any) -> bool:
    if isinstance(options, Mapping):
        return any(_has_placeholder(value) for value in options.values())
    if isinstance(options, list):
        return any(_has_placeholder(value) for value in options)
    return _is_placeholder(options)


def _is_placeholder(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(PLACEHOLDER)
