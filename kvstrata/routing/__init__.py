"""Routing requests to where their KV is cheapest: a Ray Serve request router over the
cluster directory (docs/routing.md).

    request_router_class: kvstrata.routing:TierAwareRouter

Layering: above `actors` (the directory and the node stores it reads) and `connector`
(vLLM's block hashing, through `connector.compat` only); nothing below imports it.
Importing this package is cheap: the router (and with it Ray Serve) loads on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierAwareRouter"]


def __getattr__(name: str) -> Any:
    if name == "TierAwareRouter":
        from kvstrata.routing.router import TierAwareRouter

        return TierAwareRouter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
