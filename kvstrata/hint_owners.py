"""Who owns a pin or a retention, and which sources may pin at all.

Why: hints reach the node store from two kinds of callers. An operator (`kvstrata warm`,
the store's Python and Ray calls: `pin_chunks`, `unpin_chunks`, `retain`, `prefetch`) is
trusted; a request's hints (`apply_hints`, sent by an engine for whatever an HTTP client
wrote) are not. Every pin names its owner: `operator`, or `request:<tag>` where the tag is
the request's `cache_salt` (the tenant isolation vLLM already has; empty without one).
An `unpin` ends only its owner's pin, so a request cannot unpin an operator's warm pin
nor another tenant's; `prefetch.pin_sources` says which sources may pin at all (requests
may not, by default).

Must not: import Ray or vLLM.
"""

from __future__ import annotations

OPERATOR = "operator"
REQUEST = "request"
MAX_TAG_CHARS = 256


def request_owner(tag: object) -> str:
    """The owner of a request's pins: `request:<tag>` (the tag cut to `MAX_TAG_CHARS`)."""
    text = tag if isinstance(tag, str) else ""
    return f"{REQUEST}:{text[:MAX_TAG_CHARS]}"


def source_of(owner: str) -> str:
    """`operator` or `request`: what `prefetch.pin_sources` names."""
    return owner.split(":", 1)[0]


def may_pin(owner: str, sources: list[str] | tuple[str, ...]) -> bool:
    return source_of(owner) in sources
