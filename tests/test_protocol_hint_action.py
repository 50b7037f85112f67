"""The typed hint action (kvstrata/protocol.py) is where every hint action is checked, built
by an engine or read off the wire by a store: numbers finite (an integer beyond a double's
range is a ValueError naming it, never an OverflowError), the owner a bounded string, and
the owner travels with the action (issue 51 findings 4, 11 on issue 46's typed contract)."""

import pytest

from kvstrata.hint_owners import MAX_TAG_CHARS
from kvstrata.protocol import HintAction

KEY = b"\x01" * 32 + b"\x00\x00\x00\x00"


@pytest.mark.parametrize(
    "field, value",
    [
        ("deadline_seconds", 10**400),
        ("lease_seconds", 10**400),
        ("ttl_seconds", 10**400),
        ("deadline_seconds", float("nan")),
        ("lease_seconds", float("inf")),
        ("ttl_seconds", -1),
        ("lease_seconds", True),
        ("priority", 101),
        ("owner", 7),
        ("owner", "x" * (MAX_TAG_CHARS + 1)),
    ],
)
def test_a_bad_number_or_owner_is_a_value_error_naming_it(field, value):
    wire = {"action": "kv.prefetch", "keys": [KEY], field: value}
    with pytest.raises(ValueError, match=field.split("_")[0]):
        HintAction.from_wire(wire)


def test_the_owner_survives_the_wire_and_numbers_become_floats():
    action = HintAction("pin", [KEY], owner="tenant-a", deadline_seconds=3, lease_seconds=5)
    again = HintAction.from_wire(action.to_wire())
    assert again == action and again.owner == "tenant-a"
    assert isinstance(again.deadline_seconds, float) and again.lease_seconds == 5.0
    assert HintAction.from_wire({"action": "unpin", "keys": [KEY]}).owner == ""
