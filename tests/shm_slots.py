"""Helpers for the shared-memory lane's tests: what this process sees in ``/dev/shm``, a
payload sent into a slot as a source sends one, and ``/dev/shm`` checked as it was after each
test (``shm_left_as_it_was``, a fixture the lane's test files use)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
import torch

from tensorcast.transport import shm
from tensorcast.transport.shm import Ref, Writer


def mine() -> set[str]:
    """tensorcast's segments in ``/dev/shm``, anyone's."""
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith("tensorcast-")}


@pytest.fixture
def shm_left_as_it_was() -> Iterator[None]:
    gc.collect()  # the arenas of earlier tests count against the process's cap until freed
    shm._wire_warned.clear()  # said once a process: each test is a process of its own here
    before = mine()
    yield
    assert mine() <= before, f"left in {shm.SHM_DIR}: {sorted(mine() - before)}"


def send(writer: Writer, data: bytes) -> Ref | None:
    """Write ``data`` into a slot as a source does, keeping no view of it."""
    got = writer.take(len(data))
    if got is None:
        return None
    got.into.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    writer.sent(got.ref)
    return got.ref
