"""Eviction policies, chosen by name from the YAML (`tiers.cpu.eviction_policy`)."""

from kvstrata.tiers.policies.base import EvictionPolicy
from kvstrata.tiers.policies.lru import LRUPolicy

_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"tiers.cpu.eviction_policy: unknown policy {name!r} (known: {', '.join(sorted(_POLICIES))})"
        ) from None


__all__ = ["EvictionPolicy", "LRUPolicy", "make_policy"]
