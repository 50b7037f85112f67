"""Hostile and broken YAML: every invalid document is a ConfigError that names the key (or
the value) at fault, never a traceback of another type, and never a hang.

The fields come from the schema itself (`_fields`), so a field added later is attacked too.
Example counts stay small (CI runs every property in a few seconds); what they found when
first run is listed in docs/config.md ("What the property tests found").
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from kvstrata.config import ConfigError, KvstrataConfig, load_config

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
BOUND_SECONDS = 5.0  # one document, loaded and dumped, on a busy 2-core machine

# A document with every optional section present, so every field is reachable.
BASE: dict[str, Any] = {
    "tiers": {
        "cpu": {"capacity": "64MiB"},
        "disk": {"path": "/var/tmp/kvstrata-props", "capacity": "1GiB"},
        "object": {"url": "memory://bucket/kv", "timeouts": {}},
    },
    "engine": {},
    "ray": {},
    "cluster": {"node_label": "a=b"},
}


def _fields(model: type[BaseModel] = KvstrataConfig, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every key path of the schema, sections and leaves."""
    for name, info in model.model_fields.items():
        path = (*prefix, name)
        yield path
        for candidate in getattr(info.annotation, "__args__", (info.annotation,)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                yield from _fields(candidate, path)


FIELDS = sorted(_fields())
# Every mapping of the schema whose keys are its own (not `quotas:`, whose keys are tenants' prefixes).
SECTIONS = sorted({path[:-1] for path in FIELDS if len(path) > 1 and path[0] != "quotas"}) + [()]

hostile_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**300, max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["", " ", "-1", "0", "1e9", "nan", "inf", "-inf", "4GiB", "0.1B", "1.5", "9" * 400, "9" * 400 + "TiB",
                     "9" * 5000, "s3://", "memory://", "a=b=c", "=", "\x00", "GiB", "-0", "1 2", "🙂"]),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=8), st.integers(), max_size=3),
)


def _set(document: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    copy = yaml.safe_load(yaml.safe_dump(document))
    node = copy
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            return copy
    node[path[-1]] = value
    return copy


def _usable_numbers(value: Any, top: bool = True) -> bool:
    """Numbers the code reading a setting can hold: finite, waits within threading.TIMEOUT_MAX,
    integers within 64 bits (a file offset, a Prometheus float). storage_options are passed
    through as given, so only the schema's own fields are judged."""
    if isinstance(value, bool):
        return True
    if isinstance(value, float):
        return math.isfinite(value) and abs(value) <= threading.TIMEOUT_MAX
    if isinstance(value, int):
        return abs(value) < 2**63
    if isinstance(value, dict):
        return all(_usable_numbers(v, False) for k, v in value.items() if k != "storage_options")
    return True


def _load_bounded(source: Any) -> KvstrataConfig | ConfigError:
    """Load (and dump, as `kvstrata up` does to hand the config to actors): a config or the
    ConfigError; any other exception fails the property, and so does taking too long."""
    started = time.monotonic()
    try:
        config = load_config(source)
        config.model_dump()
        result: KvstrataConfig | ConfigError = config
    except ConfigError as exc:
        result = exc
    assert time.monotonic() - started < BOUND_SECONDS, "loading took too long"
    return result


@pytest.mark.parametrize("path", FIELDS, ids=".".join)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=hostile_values)
def test_a_wrong_value_anywhere_is_refused_naming_its_key(path, value, tmp_path):
    document = _set(BASE, path, value)
    outcome = _load_bounded(document)
    if isinstance(outcome, ConfigError):
        # The key at fault, or (where the value was not even a mapping) the section above it.
        named = {".".join(path[:n]) for n in range(1, len(path) + 1)}
        assert any(f"{key}:" in str(outcome) or f"{key}." in str(outcome) for key in named), str(outcome)
    else:
        dumped = outcome.model_dump()
        assert _usable_numbers(dumped), f"{'.'.join(path)} = {value!r} was accepted: {dumped}"
    # The same document as a YAML file gives the same verdict.
    yaml_path = tmp_path / "config.yaml"
    try:
        yaml_path.write_text(yaml.safe_dump(document))
    except (ValueError, yaml.YAMLError):
        return  # not representable in YAML (e.g. a NUL in a string)
    from_file = _load_bounded(yaml_path)
    assert isinstance(from_file, ConfigError) == isinstance(outcome, ConfigError), (from_file, outcome)


@SETTINGS
@given(
    section=st.sampled_from(SECTIONS),
    key=st.text(min_size=1, max_size=20),
    value=hostile_values,
)
def test_an_unknown_key_is_refused_by_name(section, key, value):
    assume(key not in {path[-1] for path in FIELDS})
    document = _set(BASE, (*section, key), value)
    outcome = _load_bounded(document)
    assert isinstance(outcome, ConfigError), f"unknown key {key!r} accepted"
    assert f"{'.'.join((*section, key))}: unknown key" in str(outcome), str(outcome)


@SETTINGS
@given(text=st.text(max_size=300))
def test_any_text_is_a_config_or_a_config_error(text, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    _load_bounded(path)


@SETTINGS
@given(data=st.binary(max_size=200))
def test_any_bytes_are_a_config_or_a_config_error(data, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_bytes(data)
    _load_bounded(path)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(min_value=1, max_value=3_000), opener=st.sampled_from(["[", "{a: ", "- "]))
def test_deep_nesting_is_refused_not_a_crash(depth, opener, tmp_path):
    path = tmp_path / "config.yaml"
    text = opener * depth if opener != "- " else "".join("  " * level + "-\n" for level in range(min(depth, 2000)))
    path.write_text("tiers:\n  object:\n    url: memory://b/k\n    storage_options:\n      x: " + text)
    _load_bounded(path)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.integers(min_value=2, max_value=12), levels=st.integers(min_value=1, max_value=40))
def test_aliases_that_expand_exponentially_are_refused_in_bounded_time(width, levels, tmp_path):
    """A 'billion laughs' document: each level repeats the one below `width` times."""
    lines = ["a0: &a0 x"]
    for level in range(1, levels + 1):
        lines.append(f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * width)}]")
    body = "\n".join("        " + line for line in lines)
    path = tmp_path / "config.yaml"
    path.write_text(f"tiers:\n  object:\n    url: memory://b/k\n    storage_options:\n      bomb:\n{body}\n")
    outcome = _load_bounded(path)
    if width**levels > 100_000:
        assert isinstance(outcome, ConfigError) and "tiers.object.storage_options" in str(outcome), outcome


def test_a_self_referencing_alias_is_refused(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("tiers:\n  object:\n    url: memory://b/k\n    storage_options:\n      loop: &loop [*loop]\n")
    outcome = _load_bounded(path)
    assert isinstance(outcome, ConfigError) and "tiers.object.storage_options" in str(outcome), outcome


@SETTINGS
@given(path=st.sampled_from([path for path in FIELDS if len(path) >= 2]), first=st.integers(1, 9), second=st.integers(1, 9))
def test_a_key_given_twice_is_refused_by_name(path, first, second, tmp_path):
    """YAML keeps the last of two equal keys without a word: a limit set twice, the first silently lost."""
    indent = "".join("  " * n + f"{part}:\n" for n, part in enumerate(path[:-1]))
    pad = "  " * (len(path) - 1)
    yaml_path = tmp_path / "config.yaml"
    yaml_path.write_text(f"{indent}{pad}{path[-1]}: {first}\n{pad}{path[-1]}: {second}\n")
    outcome = _load_bounded(yaml_path)
    assert isinstance(outcome, ConfigError), f"{'.'.join(path)} given twice was accepted"
    assert f"key {path[-1]!r} given twice" in str(outcome) and f"line {len(path) + 1}" in str(outcome), str(outcome)


@pytest.mark.parametrize("source", [Path("/"), Path("/proc/self/mem"), Path("/nonexistent/kvstrata.yaml")])
def test_unreadable_sources_are_config_errors(source):
    assert isinstance(_load_bounded(source), ConfigError)


@SETTINGS
@given(count=st.integers(min_value=0, max_value=2**63 - 1), unit=st.sampled_from(["", "B", "KiB", "MB", "GiB", "tb"]))
def test_a_size_is_read_exactly_or_refused(count, unit):
    """`12345678901234567891` once came back as 12345678901234567168 (read through a float)."""
    from kvstrata.config import parse_size

    factor = {"": 1, "B": 1, "KiB": 1024, "MB": 10**6, "GiB": 1024**3, "tb": 10**12}[unit]
    assert parse_size(f"{count}{unit}") == count * factor
