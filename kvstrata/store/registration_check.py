"""What the store takes on trust from a registration, checked: the layout an engine claims for
a namespace, and what a namespace's block hash allows.

Why the layout is checked: a namespace is the digest of its layout (`keys.Layout.namespace`),
and `namespace_prefix` -- the tenant, whose quota the namespace counts against and whose
sweeps may delete its objects -- is in that digest. The store used to take the prefix (and
the anchor groups) of a namespace's first registration as sent, so a buggy engine could move
a namespace into another tenant's quota, whose sweep then deleted its objects. Now the store
recomputes the digest from the layout (over the fields the engine sent: `keys.namespace_of`)
and refuses a registration whose layout does not digest to the namespace it names. `anchor_groups` stay out of the digest on purpose (an
engine that knows them shares chunks with one that does not), so they are checked against
what the digest covers (the layout's group ids) and against the anchors the store already
knows for the namespace: the first engine that knows them tells, and a later one naming
others is refused.

Why the hash matters: with vLLM's non-cryptographic prefix hashes (`xxhash`, `xxhash_cbor`)
and a `PYTHONHASHSEED` shared between processes, chunk keys repeat across processes, so a
crafted collision (another prompt's key for your bytes) would be kept by the disk and
object tiers and reach every node. Decision: such a namespace is node-local -- it lives in
this node's arena and disk, where a collision reaches no further than vLLM's own prefix
cache on the node does for the engine's lifetime, and is never uploaded to the object store
nor fetched from it or from another node (`shared_across_nodes`). The store says so in
one log line when the namespace first registers. Use `sha256` (vLLM's default) or
`sha256_cbor` to share a namespace between nodes.

Owns: `check_registration`, `shared_across_nodes`, `public_epoch`.
Invariants: functions only (no state); a refusal is a ValueError naming the namespace and
the value at fault, raised before the store changes anything.
Must not: import Ray, vLLM or the store's parts (the engine's manager imports `public_epoch`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvstrata.keys import namespace_of

if TYPE_CHECKING:
    from kvstrata.store.context import StoreContext

# The store's logger (context.py), named here: the engine's manager imports this module
# for `public_epoch` and must not import the store's parts.
logger = logging.getLogger("kvstrata.actors.node_store")

# vLLM's prefix-cache hashes that are not collision resistant (vllm/v1/core/kv_cache_utils.py).
NON_CRYPTOGRAPHIC_HASHES = frozenset({"xxhash", "xxhash_cbor"})


def check_registration(store: StoreContext, namespace: str, layout: Mapping[str, object] | None) -> None:
    """Refuse a registration whose layout does not belong to `namespace` (ValueError naming
    the namespace and the value at fault), before the store changes anything; callers hold
    the store lock. A registration without a layout claims nothing and passes. Logs one line
    when a namespace with a non-cryptographic block hash first registers.
    """
    if layout is None:
        return
    try:
        digest = namespace_of(layout)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"registration of namespace {namespace!r} refused: its layout does not digest ({exc})") from None
    if digest != namespace:
        raise ValueError(
            f"registration of namespace {namespace!r} refused: its layout (namespace_prefix "
            f"{layout.get('namespace_prefix', '')!r}) is that of namespace {digest!r}"
        )
    if layout.get("anchor_groups") is not None:
        anchors = _groups(namespace, "anchor_groups", layout["anchor_groups"])
        groups = _groups(namespace, "group_ids", layout.get("group_ids"))
        if not anchors <= groups:
            raise ValueError(
                f"registration of namespace {namespace!r} refused: anchor_groups {sorted(anchors)!r} "
                f"are not among its group_ids {sorted(groups)!r}"
            )
        pool = store.arena.pools.get(namespace)
        known = pool.positions.anchor_groups if pool is not None else None  # the first engine that knew told
        if known is not None and set(known) != anchors:
            raise ValueError(
                f"registration of namespace {namespace!r} refused: anchor_groups {sorted(anchors)!r}, "
                f"where its engines said {sorted(known)!r}"
            )
    if namespace not in store.layouts and not shared_across_nodes(layout):
        logger.warning(
            "kvstrata node store: namespace %s hashes blocks with %s, which is not collision resistant: with a "
            "shared PYTHONHASHSEED a crafted collision would persist; its chunks stay on this node (arena, disk), "
            "never in the object store or on other nodes (use sha256 to share them)",
            namespace, layout.get("hash_algo"),
        )  # fmt: skip


def _groups(namespace: str, what: str, value: object) -> set[int]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(group, int) for group in value):
        raise ValueError(f"registration of namespace {namespace!r} refused: {what} {value!r} is not a list of group indices")
    return set(value)


def shared_across_nodes(layout: Mapping[str, object] | None) -> bool:
    """Whether a namespace's chunks may go to the object store and other nodes (see the
    module docstring); a namespace registered without a layout is, as before."""
    return layout is None or layout.get("hash_algo") not in NON_CRYPTOGRAPHIC_HASHES


def public_epoch(epoch: str) -> str:
    """A registration's epoch as a log line may show it: the store's epoch, without the
    holder's token (whoever holds the token can step and release as that engine)."""
    store_epoch, dot, _ = epoch.partition(".")
    return f"{store_epoch}.<token>" if dot else store_epoch
