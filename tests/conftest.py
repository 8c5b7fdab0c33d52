"""Shared fixtures: one pool of local gloo ranks per world size, for the whole session.

Multi-process tests take ``pool2`` / ``pool4`` / ``pool8`` and call
``pool.run(rank_fn, *args, timeout=...)``; see ``rankpool.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from rankpool import RankPool


def _pool(world_size: int) -> Iterator[RankPool]:
    pool = RankPool(world_size)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def pool2() -> Iterator[RankPool]:
    yield from _pool(2)


@pytest.fixture(scope="session")
def pool4() -> Iterator[RankPool]:
    yield from _pool(4)


@pytest.fixture(scope="session")
def pool8() -> Iterator[RankPool]:
    yield from _pool(8)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if {"pool2", "pool4", "pool8"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.dist)
