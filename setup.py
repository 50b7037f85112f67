"""Build of kvstrata's one optional native module; everything else is in pyproject.toml.

`kvstrata.connector._rowcopy` batches the CPU copy engine's page copies into one call.
It is optional: without a C compiler the install still succeeds and the copy engine
uses numpy copies (slower for pages under ~1 MiB; see docs/benchmarks.md, "Arena copy").
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstrata.connector._rowcopy",
            sources=["kvstrata/connector/rowcopy.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
