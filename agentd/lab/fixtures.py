"""pytest fixtures for system tests (loaded as a plugin by tests/conftest.py).

``netns_factory(role)`` makes a uniquely named namespace ``ad-<tag>-<role>``;
every namespace it made is deleted (processes killed first) when the test ends,
pass or fail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from agentd.lab.netns import Netns, delete_matching, unique_tag


@pytest.fixture
def netns_factory() -> Iterator[Callable[[str], Netns]]:
    tag = unique_tag()
    made: list[Netns] = []

    def make(role: str) -> Netns:
        ns = Netns.create(f"ad-{tag}-{role}")
        made.append(ns)
        return ns

    try:
        yield make
    finally:
        for ns in reversed(made):
            ns.delete()
        delete_matching(f"ad-{tag}-")
