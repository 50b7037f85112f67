"""The vLLM adapter. vLLM selects it with `spec_name: StrataSpec`,
`spec_module_path: kvstrata.connector`.

`StrataSpec` is loaded on first access (PEP 562), not at package import: vLLM reaches it
with getattr(module, spec_name), which loads vLLM's offloading base classes then, while
the torch-only parts under kvstrata.connector (the copy engine and its executors) import
without vLLM, so a GPU benchmark machine runs them without it.
"""

from typing import Any

__all__ = ["StrataSpec"]


def __getattr__(name: str) -> Any:
    if name == "StrataSpec":
        from kvstrata.connector.spec import StrataSpec

        return StrataSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
