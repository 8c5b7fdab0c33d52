"""tensorcast's groups, without a process group: shut down with the default group."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch.distributed as dist

from tensorcast.transport import groups as _groups


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
