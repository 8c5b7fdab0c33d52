"""Choices made when tensorcast makes a group, without a process group: the device an NCCL
group is bound to, and the groups shut down with the default group."""

from __future__ import annotations

import gc
import time
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tensorcast.transport import groups as _groups
from tensorcast.transport.wire import rank_device


def test_an_nccl_group_is_bound_to_the_device_the_rank_chose() -> None:
    chosen = torch.device("cuda", 3)
    assert rank_device(types.SimpleNamespace(bound_device_id=chosen)) == chosen


@pytest.mark.skipif(torch.cuda.is_available(), reason="a rank with CUDA has a current device")
def test_a_rank_that_chose_no_device_is_told_how_to_choose_one() -> None:
    with pytest.raises(RuntimeError, match=r"torch.cuda.set_device\(local_rank\).*device_id"):
        rank_device(types.SimpleNamespace(bound_device_id=None))


def test_groups_are_shut_down_when_the_default_group_is_destroyed(tmp_path: Any) -> None:
    shut: list[tuple[int, ...]] = []

    class Counting:
        def __init__(self, wire: Any) -> None:
            self._wire = wire

        def __getattr__(self, name: str) -> Any:
            return getattr(self._wire, name)

        def shutdown(self) -> None:
            shut.append(ranks)
            self._wire.shutdown()

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ranks = (0,)
        with _groups.wrapping_wires(Counting):
            group = _groups.world().group(ranks)
        assert isinstance(group.wire, Counting)
        del group
    finally:
        dist.destroy_process_group()
    gc.collect()
    # The world's watch closes its groups within _WATCH_S (no finaliser does: one could run
    # while a lane's lock is held, NOTE [ A destroyed default group ]).
    deadline = time.monotonic() + 10 * _groups._WATCH_S
    while not shut and time.monotonic() < deadline:
        time.sleep(0.02)
    assert shut == [(0,)]
