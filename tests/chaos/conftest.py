"""Chaos tests: the ``chaos`` marker.

The marker is registered here (pyproject.toml is not ours to edit). The short
campaign runs in every ``make test`` (a few minutes); ``pytest -m "not chaos"``
leaves it out of a quick local run. The long campaign is ``make chaos``.
"""

from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "chaos: chaos campaign with real agents, etcd and network namespaces "
                   "(minutes; needs root for namespaces, else falls back to loopback)")
