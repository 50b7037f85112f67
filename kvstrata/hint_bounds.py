"""Bounds on numbers that come from outside the trust boundary: KV hints (HTTP clients through
an engine), `kvstrata warm`, router calls.

Why: a hint is advice any HTTP client can send, so every number it carries is checked here
before it is used, and an error is a ValueError naming the value -- never an OverflowError
(`float(10**400)`, `math.isfinite(10**400)` raise one) or a TypeError escaping into vLLM.

Must not: import Ray or vLLM (the engine's hint parser and the store both use it).
"""

from __future__ import annotations

import math


def seconds(value: object, name: str, *, positive: bool = False) -> float:
    """`value` as finite seconds (>= 0, or > 0 with `positive`); a ValueError naming it otherwise.

    Integers beyond a double's range, NaN, infinities, booleans and non-numbers are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be seconds (a number), got {_short(value)}")
    try:
        result = float(value)
    except OverflowError:
        raise ValueError(f"{name} {_short(value)} is out of range") from None
    if not math.isfinite(result) or result < 0 or (positive and result == 0):
        raise ValueError(f"{name} must be {'positive' if positive else '>= 0'} finite seconds, got {_short(value)}")
    return result


def capped(value: float, maximum: float) -> tuple[float, bool]:
    """`value` cut to `maximum`, and whether it was cut."""
    return (maximum, True) if value > maximum else (value, False)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
