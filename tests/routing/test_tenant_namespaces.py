"""`kvstrata warm` and route-time prefetch land in the tenant asked for, not in every tenant's
copy of a model (issue #51, finding 11): a node's figures know each namespace's tenant."""

from __future__ import annotations

from kvstrata.routing.figures import node_figures
from tests.utils import layout


def test_namespaces_of_a_model_are_picked_by_tenant():
    spaces = {}
    for tenant in ("", "acme", "globex"):
        described = layout(model="/models/m", prefix=tenant).describe()
        spaces[tenant] = (described["namespace"], {**described, "models": ["/models/m"]})
    figures = node_figures("n1", {"layouts": dict(spaces.values())})
    assert figures.namespaces("/models/m", "acme") == [spaces["acme"][0]]
    assert figures.namespaces("/models/m", "") == [spaces[""][0]]
    assert figures.namespaces("/models/m", "initech") == []
    assert sorted(figures.namespaces("/models/m")) == sorted(ns for ns, _ in spaces.values())  # no tenant named: all
