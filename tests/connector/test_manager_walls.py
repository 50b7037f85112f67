"""The manager's walls, checked in code (issue 46, item 5): each part of `StrataManager`
declares the state fields it writes (`WRITES` in its module), and this test reads the
code (AST) to hold the declarations to what the methods do, both ways, and every field
to its one declaration in `ManagerState`.

A write is an assignment to `self.<field>` (also augmented, subscripted or deleted) or a
call of a mutating method on it (`append`, `pop`, `update`, ...). Why a check rather than
state split into objects: a reply changes the mirror, the pins, the stock and the
outgoing queues in one transaction (manager_state.py says why), and the manager's
per-request cost is vLLM's level only while its state is plain fields; a declaration
that the test holds to the code costs nothing at run time and cannot drift.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# module -> the class in it that is a part of StrataManager
PARTS = {
    "kvstrata.connector.inbox": "ReplyInbox",
    "kvstrata.connector.eviction": "EvictionOrder",
    "kvstrata.connector.pins": "PinsAndSlots",
    "kvstrata.connector.manager": "StrataManager",
}
MUTATORS = {
    "append", "appendleft", "extend", "add", "update", "pop", "popleft", "popitem", "clear", "discard",
    "remove", "setdefault", "insert", "difference_update", "intersection_update", "sort",
}  # fmt: skip


def _self_field(node: ast.AST) -> str | None:
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def written_fields(cls: ast.ClassDef) -> set[str]:
    """The `self` fields a class's methods write (properties' own names excluded)."""
    fields: set[str] = set()
    for node in ast.walk(cls):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        for target in targets:
            for leaf in target.elts if isinstance(target, ast.Tuple) else [target]:
                field = _self_field(leaf)
                if field is not None:
                    fields.add(field)
    return fields


def class_node(module_name: str, class_name: str) -> ast.ClassDef:
    module = importlib.import_module(module_name)
    tree = ast.parse(Path(inspect.getsourcefile(module)).read_text())
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name)


def declared_fields() -> set[str]:
    """ManagerState's fields: its annotations and what its constructor assigns."""
    state = class_node("kvstrata.connector.manager_state", "ManagerState")
    annotated = {node.target.id for node in state.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    init = next(node for node in state.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    return annotated | written_fields(ast.ClassDef(name="init", bases=[], keywords=[], body=[init], decorator_list=[]))


@pytest.mark.parametrize("module_name", sorted(PARTS))
def test_each_part_writes_exactly_the_fields_it_declares(module_name):
    written = written_fields(class_node(module_name, PARTS[module_name]))
    declared = set(importlib.import_module(module_name).WRITES)
    assert not written - declared, f"{module_name} writes fields it does not declare in WRITES: {sorted(written - declared)}"
    assert not declared - written, f"{module_name} declares fields in WRITES it never writes: {sorted(declared - written)}"


def test_every_field_a_part_writes_is_declared_once_in_the_state():
    fields = declared_fields()
    for module_name in PARTS:
        stray = set(importlib.import_module(module_name).WRITES) - fields
        assert not stray, f"{module_name} writes fields ManagerState does not declare: {sorted(stray)}"


def test_the_check_sees_every_kind_of_write():
    """The checker itself: each form of write is seen, reads are not."""
    source = """
class Part:
    def run(self, other):
        self.a = 1
        self.b += 1
        self.c[0] = 2
        del self.d[3]
        self.e.append(4)
        self.f[1].add(5)
        self.g, self.h = 6, 7
        other.x = self.i
        len(self.j)
        self.k.get(8)
"""
    cls = ast.parse(source).body[0]
    assert written_fields(cls) == {"a", "b", "c", "d", "e", "f", "g", "h"}
