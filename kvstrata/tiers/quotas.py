"""Per-tenant byte quotas of one tier: who holds how much, and how much more it may take.

A tenant is a `namespace_prefix`. The store sees layout namespaces (digests that include
the prefix), so each tier is told which tenant a namespace belongs to when an engine of
it registers (`assign`); a namespace no engine has registered yet (a disk slab recovered
at start-up, another node's objects) belongs to no tenant and has no quota.

Why a quota is enforced by the tier at the place it takes bytes, and only there: the
arena's pools and the disk's slabs already evict only their own namespace's chunks when
they cannot grow, so capping a tenant's *growth* makes a tenant at its quota evict its
own least-valuable chunks and never another tenant's. A tenant without a quota shares
what is left of the tier, as before quotas existed. A quota is a ceiling, not a
reservation: a tenant is guaranteed room only when the others are bounded too.

Invariants:
- `used(tenant)` is the sum of the bytes charged to that tenant's namespaces: every
  call is O(1) (dictionary updates), so tiers may call it per allocation.
- A namespace's tenant never changes once assigned (its digest includes the prefix, so
  every honest engine of it names the same one); its bytes charged before the
  assignment move to the tenant then.
- With a quota, `room` never lets a caller charge past it; bytes already above it (a
  quota lowered across a restart) only shrink.

No Ray and no vLLM; one lock, so tiers with I/O threads may call it from any of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from kvstrata.namespaces import check_tenant

Entry = TypeVar("Entry")


class TenantQuotas:
    """Bytes held per tenant in one tier, against the tenants' quotas (prefix -> bytes)."""

    def __init__(self, limits: Mapping[str, int] | None = None):
        # Keys follow `namespace_prefix`'s rules (kvstrata.namespaces), as the config's do.
        self.limits: dict[str, int] = {check_tenant(tenant, "quotas key"): limit for tenant, limit in (limits or {}).items()}
        self._lock = threading.Lock()
        self._tenant_of: dict[str, str] = {}  # namespace -> tenant prefix
        self._held: dict[str, int] = {}  # namespace -> bytes charged to it
        self._used: dict[str, int] = {}  # tenant -> bytes of all its namespaces

    def assign(self, namespace: str, tenant: str) -> None:
        """`namespace` belongs to `tenant` (the first assignment stands); a tenant that is not
        a valid `namespace_prefix` (e.g. from a foreign manifest) is a ValueError."""
        check_tenant(tenant)
        with self._lock:
            if namespace in self._tenant_of:
                return
            self._tenant_of[namespace] = tenant
            self._used[tenant] = self._used.get(tenant, 0) + self._held.get(namespace, 0)

    def tenant(self, namespace: str) -> str | None:
        return self._tenant_of.get(namespace)

    def limit(self, namespace: str) -> int | None:
        """The quota of the namespace's tenant; None: no quota (or no tenant yet)."""
        tenant = self._tenant_of.get(namespace)
        return None if tenant is None else self.limits.get(tenant)

    def room(self, namespace: str) -> int | None:
        """Bytes the namespace may still take; None when its tenant has no quota."""
        with self._lock:
            tenant = self._tenant_of.get(namespace)
            limit = None if tenant is None else self.limits.get(tenant)
            return None if limit is None else max(0, limit - self._used.get(tenant, 0))

    def charge(self, namespace: str, nbytes: int) -> None:
        """The namespace took `nbytes` more of the tier (negative: gave them back)."""
        if not nbytes:
            return
        with self._lock:
            self._held[namespace] = self._held.get(namespace, 0) + nbytes
            tenant = self._tenant_of.get(namespace)
            if tenant is not None:
                self._used[tenant] = self._used.get(tenant, 0) + nbytes

    def drop(self, namespace: str) -> None:
        """The namespace holds nothing in the tier any more (purged)."""
        self.charge(namespace, -self._held.get(namespace, 0))

    def reset(self, held: Mapping[str, int] | None = None) -> None:
        """Start the count again from what each namespace holds now (a tier's full listing
        or its close); tenants stay assigned."""
        with self._lock:
            self._held = {namespace: nbytes for namespace, nbytes in (held or {}).items() if nbytes}
            self._used = {}
            for namespace, nbytes in self._held.items():
                tenant = self._tenant_of.get(namespace)
                if tenant is not None:
                    self._used[tenant] = self._used.get(tenant, 0) + nbytes

    def learn(self, namespaces: Iterable[str], tenant_of: Callable[[str], str]) -> None:
        """Assign the namespaces without a tenant yet, asking `tenant_of` (e.g. a manifest
        read); a namespace it cannot answer for (raises) stays without a quota for now."""
        for namespace in namespaces:
            if namespace not in self._tenant_of:
                try:
                    self.assign(namespace, tenant_of(namespace))
                except Exception:  # noqa: BLE001 - asked again next time
                    continue

    def recount(self, entries: list[Entry], namespace_of: Callable[[Entry], str], size_of: Callable[[Entry], int]) -> list[Entry]:
        """`reset` to what a full listing of the tier holds; returns the listing."""
        held: dict[str, int] = {}
        for entry in entries:
            held[namespace_of(entry)] = held.get(namespace_of(entry), 0) + size_of(entry)
        self.reset(held)
        return entries

    def used(self, tenant: str) -> int:
        return self._used.get(tenant, 0)

    def usage(self) -> dict[str, dict[str, int | None]]:
        """Every tenant with a quota or bytes in the tier: `used` and `quota` (None: none)."""
        with self._lock:
            tenants = sorted(set(self.limits) | set(self._used))
            return {tenant: {"used": self._used.get(tenant, 0), "quota": self.limits.get(tenant)} for tenant in tenants}

    def over_quota(
        self, entries: Iterable[Entry], namespace_of: Callable[[Entry], str], size_of: Callable[[Entry], int]
    ) -> list[Entry]:
        """Of `entries` (oldest first), the ones each tenant must lose, its oldest first, so
        that what it keeps fits its quota. Other tenants' entries are never picked.

        For tiers that learn what they hold by listing it (the object store): one pass
        over the listing, O(1) per entry.
        """
        entries = list(entries)
        excess: dict[str, int] = {}
        for entry in entries:
            tenant = self.tenant(namespace_of(entry))
            if tenant is not None and tenant in self.limits:
                excess[tenant] = excess.get(tenant, 0) + size_of(entry)
        excess = {tenant: total - self.limits[tenant] for tenant, total in excess.items() if total > self.limits[tenant]}
        victims: list[Entry] = []
        for entry in entries:
            if not excess:
                break
            tenant = self.tenant(namespace_of(entry))
            if tenant in excess:
                victims.append(entry)
                excess[tenant] -= size_of(entry)
                if excess[tenant] <= 0:
                    del excess[tenant]
        return victims
