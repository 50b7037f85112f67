"""The vLLM adapter. vLLM selects it with `spec_name: StrataSpec`,
`spec_module_path: kvstrata.connector`. Importing it loads vLLM's offloading base
classes (vLLM is already imported wherever this runs) and starts nothing.
"""

from kvstrata.connector.spec import StrataSpec

__all__ = ["StrataSpec"]
