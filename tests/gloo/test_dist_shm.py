"""The shared-memory lane on real gloo ranks (``transport.shm``): payloads of ranks on one
host never reach the wire, kept batches never change, a killed peer fails the others and
leaves ``/dev/shm`` as it was."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from taps import WireTap, tapped

import tensorcast as tc
from tensorcast.transport.shm import SHM_DIR

_BIG = 300_000  # float32s: 1.2 MB, over the lane's smallest payload


def _mine() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("tensorcast-")}


@pytest.fixture(autouse=True)
def shm_left_as_it_was() -> Iterator[None]:
    before = _mine()
    yield
    assert _mine() <= before, f"left in {SHM_DIR}: {sorted(_mine() - before)}"


@contextlib.contextmanager
def lane(limit: int = 1 << 30, host: str | None = None) -> Iterator[None]:
    """The lane on in this rank (the pool turns it off: ``rankpool._ENV``), within ``limit``
    bytes, on the host ``host`` (None: the real one)."""
    saved = {k: os.environ.get(k) for k in ("TENSORCAST_SHM_LIMIT", "TENSORCAST_HOST_ID")}
    os.environ["TENSORCAST_SHM_LIMIT"] = str(limit)
    if host is not None:
        os.environ["TENSORCAST_HOST_ID"] = host
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _batch(step: int, n: int = _BIG) -> dict[str, Any]:
    return {"x": torch.arange(n, dtype=torch.float32) + step, "step": step}


@tapped
def _rank_one_host(rank: int, world: int, tap: WireTap, shm: bool | None) -> dict[str, Any]:
    moved = [0]

    def count(wire: Any, tensor: torch.Tensor, root: int) -> None:
        moved[0] += tensor.numel()

    kept = []
    with lane(), tap.hook("payload", before=count):
        loader = tc.BroadcastingDataLoader(
            [_batch(i) for i in range(6)] if rank == 0 else None,
            group=dist.group.WORLD, src=0, shm=shm, timeout=20,
        )  # fmt: skip
        for batch in loader:
            kept.append(batch)
    for i, batch in enumerate(kept):  # every batch kept is as it was sent
        assert torch.equal(batch["x"], _batch(i)["x"]) and batch["step"] == i
    return {"wire": moved[0], "stats": loader.stats()}


@pytest.mark.parametrize("shm", [None, False])
def test_the_lane_keeps_payloads_off_the_wire(pool2: Any, shm: bool | None) -> None:
    results = pool2.run(_rank_one_host, shm, timeout=60)
    for r in results:
        if shm is None:
            assert r["wire"] == 0
            assert r["stats"].shm_bytes == r["stats"].bytes > 0
        else:
            assert r["wire"] >= 6 * 4 * _BIG
            assert r["stats"].shm_bytes == 0
