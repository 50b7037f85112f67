"""Test and tool harnesses: in the repository, not in the wheel (pyproject.toml excludes
this package). The simulation, the fault matrix, the GPU check, engine and Serve test
helpers, the loopback S3 server. An editable install and the tests import them; the
product never does (tests/test_layering.py)."""
