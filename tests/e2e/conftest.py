"""Shared fixtures of the end-to-end tests: one local Ray cluster per test module."""

from __future__ import annotations

import contextlib

import pytest

from kvstrata.actors.client import StoreUnavailable, get_node_store, shutdown_node_store
from tests.utils import local_ray


@pytest.fixture(scope="module")
def cluster(request):
    """A loopback Ray cluster for the module; the node store it ends up with is taken down too."""
    with local_ray(f"kvstrata-e2e-{request.module.__name__.rsplit('.', 1)[-1]}"):
        try:
            yield
        finally:
            with contextlib.suppress(StoreUnavailable):
                shutdown_node_store(get_node_store())
