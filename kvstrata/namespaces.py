"""The names a caller can hand the store: namespaces, tenant prefixes and pin holders.

Why: a namespace reaches disk file names (`<dir>/<namespace>-<n>.payloads`), object keys
(`<root>/<namespace>/...`) and a recursive delete of `<root>/<namespace>`; an empty, dotted
or slash-bearing one would name the tier's root or another tenant's directory (measured:
`kvstrata purge --namespace ""` deleted every tenant's objects). Holder names are asserted
by engines; the store's own holders (`kvstrata:cascade`, ...) contain a `:`, which no valid
holder name may, so no request can name them.

Invariants: every function returns its argument unchanged when it is valid and raises
`ValueError` naming the offending value (repr, cut to a readable length) and the rule it
broke otherwise; nothing here has side effects. Paths are built only from values that
passed here. This module imports nothing of Ray or vLLM (the CLI, the config, the actors
and the tiers all use it).
"""

from __future__ import annotations

import re

MAX_NAME_LENGTH = 128
MAX_HOLDER_LENGTH = 200

# One part of a name: letters, digits, `_`, `-`, `.`; never only dots, never led by a dot
# (a dot-named directory under an object root is no namespace, see object_store.py).
_PART = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_HOLDER = re.compile(r"[A-Za-z0-9_.@+-]+")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_name(value: object, what: str = "namespace", *, allow_empty: bool = False, allow_slash: bool = False) -> str:
    """The one validator of namespaces (`allow_slash=False`) and tenant prefixes.

    Rules: a str; at most `MAX_NAME_LENGTH` characters; not empty (unless `allow_empty`,
    for the default tenant `""`); no `..`; characters `A-Z a-z 0-9 _ - .` and, where
    `allow_slash`, `/` between parts (none at either end, no empty part); no part that
    starts with a dot. Returns the value; raises ValueError naming it otherwise.
    """
    if not isinstance(value, str):
        raise ValueError(f"invalid {what} {_shown(value)}: must be a string")
    if value == "":
        if allow_empty:
            return value
        raise ValueError(f"invalid {what} {_shown(value)}: must not be empty")
    if len(value) > MAX_NAME_LENGTH:
        raise ValueError(f"invalid {what} {_shown(value)}: longer than {MAX_NAME_LENGTH} characters")
    if ".." in value:
        raise ValueError(f"invalid {what} {_shown(value)}: must not contain '..'")
    if "/" in value:
        if not allow_slash:
            raise ValueError(f"invalid {what} {_shown(value)}: must not contain '/'")
        if value.startswith("/") or value.endswith("/"):
            raise ValueError(f"invalid {what} {_shown(value)}: must not start or end with '/'")
    for part in value.split("/"):
        if part == "":
            raise ValueError(f"invalid {what} {_shown(value)}: has an empty part")
        if not _PART.fullmatch(part):
            raise ValueError(
                f"invalid {what} {_shown(value)}: only letters, digits, '_', '-' and '.' (not first) are allowed"
            )
    return value


def check_namespace(value: object) -> str:
    """A namespace as it reaches file names and object keys: one part, no `/`, not empty."""
    return check_name(value, "namespace")


def is_namespace(value: object) -> bool:
    """Whether `check_namespace` accepts the value (for names found in a directory or bucket)."""
    try:
        check_namespace(value)
    except ValueError:
        return False
    return True


def check_tenant(value: object, what: str = "namespace_prefix") -> str:
    """A tenant (`namespace_prefix`, a `quotas:` key): may be `""` (the default tenant) and
    may hold `/` between parts."""
    return check_name(value, what, allow_empty=True, allow_slash=True)


def check_holder(value: object) -> str:
    """A pin holder an engine names: 1..`MAX_HOLDER_LENGTH` of `A-Z a-z 0-9 _ . @ + -`.

    No `:`, so the store's internal holders (`kvstrata:...`) are out of every request's reach.
    """
    if not isinstance(value, str):
        raise ValueError(f"invalid holder {_shown(value)}: must be a string")
    if not value or len(value) > MAX_HOLDER_LENGTH:
        raise ValueError(f"invalid holder {_shown(value)}: must be 1 to {MAX_HOLDER_LENGTH} characters")
    if not _HOLDER.fullmatch(value):
        raise ValueError(f"invalid holder {_shown(value)}: only letters, digits and '_.@+-' are allowed")
    return value


def holder_name(text: str) -> str:
    """A valid holder made from an engine's own id (vLLM's `engine_id` may hold `:` -- an
    IPv6 host -- or other characters): each character outside the holder set becomes `-`,
    and the last `MAX_HOLDER_LENGTH` characters are kept (the pid suffix stays)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.@+-]", "-", text)[-MAX_HOLDER_LENGTH:]
    return check_holder(cleaned or "engine")
