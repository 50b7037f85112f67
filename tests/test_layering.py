"""The package's layering, read from the source: imports run one way and never in a circle.

tiers (storage engines) <- store (the node store, plain Python) <- actors (Ray glue) <-
connector (the vLLM adapter) <- routing
(the Ray Serve request router: it reads the directory and names chunks with vLLM's
hashing, through the compat module like every other vLLM use). Every
import counts, also one inside a function: a lazy import that runs upward still ties
a lower layer to a higher one. `kvstrata._dev` (the simulation, the fault matrix, the GPU
check, test helpers) serves tests, examples and benchmarks, stands outside the layers, and
is not in the wheel: nothing else in the package may import it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvstrata"
MAX_MODULE_LINES = 600

# layer -> what it must never import (kvstrata layers and third-party roots)
FORBIDDEN = {
    "kvstrata.tiers": ("kvstrata.store", "kvstrata.actors", "kvstrata.connector", "kvstrata.routing", "ray", "vllm"),
    "kvstrata.store": ("kvstrata.actors", "kvstrata.connector", "kvstrata.routing", "ray", "vllm"),
    "kvstrata.protocol": ("kvstrata.store", "kvstrata.actors", "kvstrata.connector", "kvstrata.routing", "ray", "vllm"),
    "kvstrata.actors": ("kvstrata.connector", "kvstrata.routing", "vllm"),
    "kvstrata.connector": ("kvstrata.routing",),
    "kvstrata.keys": ("kvstrata.tiers", "kvstrata.actors", "kvstrata.connector", "kvstrata.routing", "ray", "vllm"),
    "kvstrata.identity": ("kvstrata.tiers", "kvstrata.actors", "kvstrata.connector", "kvstrata.routing", "ray", "vllm"),
    "kvstrata.config": ("kvstrata.tiers", "kvstrata.actors", "kvstrata.connector", "kvstrata.routing", "ray", "vllm"),
}
VLLM_GATEWAY = "kvstrata.connector.compat"
OUTSIDE_LAYERS = ("kvstrata._dev",)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code, as absolute names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: imports_of(path) for name, path in modules.items()}


def test_no_layer_imports_one_above_it(graph):
    wrong = [
        f"{module} imports {imported}"
        for module, imported_set in graph.items()
        for layer, forbidden in FORBIDDEN.items()
        if within(module, layer)
        for imported in imported_set
        if any(within(imported, bad) for bad in forbidden)
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_only_the_compat_module_imports_vllm(graph):
    wrong = [
        f"{module} imports {imported}"
        for module, imported_set in graph.items()
        if module != VLLM_GATEWAY and not any(within(module, outside) for outside in OUTSIDE_LAYERS)
        for imported in imported_set
        if within(imported, "vllm")
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycle_inside_the_package(graph):
    internal = {
        module: {imp for imp in imported if imp in graph and imp != module and not within(module, imp)}
        for module, imported in graph.items()
    }
    # A package's __init__ importing its own submodules is not a cycle of responsibility.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for imported in sorted(internal[module]):
            if state.get(imported) == 1:
                cycles.append(stack[stack.index(imported) :] + [imported])
            elif imported not in state:
                visit(imported)
        stack.pop()
        state[module] = 2

    for module in sorted(internal):
        if module not in state:
            visit(module)
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_module_is_too_long_to_hold_in_one_head():
    long = {
        module_name(path): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, long


def test_the_checks_see_what_they_claim(graph):
    """The walk finds lazy imports and relative ones; a checker that sees nothing passes vacuously."""
    assert "kvstrata.actors.client" in graph["kvstrata.connector.spec"]  # imported inside get_manager
    assert "vllm" in graph[VLLM_GATEWAY]
    assert any(within(imported, "kvstrata.tiers") for imported in graph["kvstrata.store.node_store"])
    assert "kvstrata.connector.compat" in graph["kvstrata.routing.keys"]  # vLLM's hashing, imported lazily


# --- the node store from parts (issue 46) ----------------------------------------------------

STORE = PACKAGE / "store"


def store_classes() -> dict[str, tuple[Path, ast.ClassDef]]:
    found = {}
    for path in STORE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                found[node.name] = (path, node)
    return found


def test_no_store_class_inherits_from_another_store_class():
    classes = store_classes()
    wrong = [
        f"{path.name}: {name}({ast.unparse(base)})"
        for name, (path, node) in classes.items()
        for base in node.bases
        if ast.unparse(base).rpartition(".")[2] in classes
    ]
    assert not wrong, "\n".join(wrong)
    assert "StoreState" not in classes and "StoreControl" in classes


def own_private_names(node: ast.ClassDef) -> set[str]:
    """The private methods and attributes a class defines or assigns on `self`."""
    names = {item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
            names.add(sub.attr)
        elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
            names.add(sub.target.id)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_no_store_part_calls_a_private_method_it_does_not_own_through_self():
    """A part reaches another only through its public methods: `self._x(...)` names a method
    of the part's own class, and `self._part._x(...)` (another part's private) never appears."""
    wrong = []
    for name, (path, node) in store_classes().items():
        own = own_private_names(node)
        for sub in ast.walk(node):
            if not (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)):
                continue
            target, method = sub.func.value, sub.func.attr
            if not method.startswith("_") or method.startswith("__"):
                continue
            if isinstance(target, ast.Name) and target.id == "self" and method not in own:
                wrong.append(f"{path.name}:{sub.lineno} {name} calls self.{method}() it does not define")
            elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                wrong.append(f"{path.name}:{sub.lineno} {name} calls self.{target.attr}.{method}(), another part's private")
    assert not wrong, "\n".join(wrong)


def test_the_private_call_check_sees_a_call_into_another_part(tmp_path):
    """The check above is not vacuous: the old mixins' call shape is caught."""
    tree = ast.parse("class Prefetch:\n    def f(self):\n        self._promote(1)\n        self._promotion._finish(2)\n")
    node = tree.body[0]
    calls = [sub.func for sub in ast.walk(node) if isinstance(sub, ast.Call)]
    assert {call.attr for call in calls} == {"_promote", "_finish"}
    assert "_promote" not in own_private_names(node)


def test_the_product_never_imports_the_dev_harnesses(graph):
    """`kvstrata._dev` is left out of the wheel (pyproject.toml): an import of it from the
    product would fail for every user who installed the wheel."""
    wrong = [
        f"{module} imports {imported}"
        for module, imported_set in graph.items()
        if not within(module, "kvstrata._dev")
        for imported in imported_set
        if within(imported, "kvstrata._dev")
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_the_wheel_leaves_out_the_dev_harnesses_and_psutil():
    """What `pip wheel .` packs: setuptools' own package finder with pyproject's settings
    (checked by hand with `pip wheel . && unzip -l`, docs/operations.md)."""
    import tomllib

    from setuptools import find_packages

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    found = project["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(PACKAGE.parent), include=found["include"], exclude=found.get("exclude", ()))
    assert "kvstrata" in packages and "kvstrata.store" in packages
    assert not [name for name in packages if within(name, "kvstrata._dev")], packages
    assert not [dep for dep in project["project"]["dependencies"] if dep.split()[0].startswith("psutil")]


STORE_HANDLE_MAKERS = {"get_node_store", "ensure_node_store"}


def raw_store_calls(tree: ast.AST, store_only: set[str]) -> list[str]:
    """`<handle>.<method>.remote(...)` calls on a node store's handle: a method only a store
    has, or any method of a handle `get_node_store` / `ensure_node_store` just returned."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "remote"):
            continue
        method = node.func.value
        if not isinstance(method, ast.Attribute):
            continue
        receiver = method.value
        made_here = isinstance(receiver, ast.Call) and getattr(receiver.func, "id", None) in STORE_HANDLE_MAKERS
        if method.attr in store_only or made_here:
            found.append(f"line {node.lineno}: .{method.attr}.remote()")
    return found


def store_only_methods() -> set[str]:
    from kvstrata.actors.directory import DirectoryShard
    from kvstrata.actors.node_actor import NodeStoreActor
    from kvstrata.actors.cluster import Reconciler
    from kvstrata.routing.ledger import RoutingLedger

    public = lambda cls: {name for name in dir(cls) if not name.startswith("_")}  # noqa: E731
    return public(NodeStoreActor) - public(DirectoryShard) - public(Reconciler) - public(RoutingLedger)


def test_only_the_store_client_calls_a_store_handle():
    """Issue 46 item 1: engines, routers, the CLI, Serve's callback, `up` and peers reach a
    store through `RayStoreClient` (its timeouts and its errors), never a raw `.remote`."""
    store_only = store_only_methods()
    assert {"step", "register", "export_chunks", "prefetch"} <= store_only
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if name in ("kvstrata.actors.store_client", "kvstrata.actors.client") or name.startswith(OUTSIDE_LAYERS):
            continue
        calls = raw_store_calls(ast.parse(path.read_text()), store_only)
        if calls:
            offenders[name] = calls
    assert not offenders, offenders


def test_the_raw_store_call_check_sees_both_forms():
    source = "get_node_store(node).ping.remote()\nstore.export_chunks.remote(ns, keys)\nshard.stats.remote()\n"
    assert len(raw_store_calls(ast.parse(source), {"export_chunks"})) == 2
