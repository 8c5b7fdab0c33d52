"""The wires' rules on a fake gloo backend: which collective moves a head or a payload,
and that each is waited for with the timeout. No process group."""

from __future__ import annotations

import datetime
from typing import Any

import torch

from tensorcast.transport import wire as _wire


class _FakeGloo:
    """The part of a gloo backend a ``GlooWire`` uses; records each operation and wait."""

    class Work:
        def __init__(self, log: list[Any], op: tuple[Any, ...]) -> None:
            self.log, self.op = log, op

        def wait(self, timeout: Any = None) -> bool:
            self.log.append(("wait", self.op, timeout))
            return True

    def __init__(self, size: int) -> None:
        self._size = size
        self.log: list[Any] = []

    def size(self) -> int:
        return self._size

    def _work(self, *op: Any) -> Any:
        self.log.append(op)
        return self.Work(self.log, op)

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        return self._work("send", peer)

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        return self._work("recv", peer)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._work("broadcast", opts.rootRank)


def test_heads_are_sends_on_small_gloo_groups_only() -> None:
    """The rule every rank applies alike (the group's size is the same on all): on groups
    of up to ``HEAD_SENDS_MAX_RANKS`` the source sends each receiver its heads, one after
    another; larger groups keep gloo's broadcast tree; payloads are always broadcasts.
    Every operation is waited for, with the timeout."""
    most = _wire.HEAD_SENDS_MAX_RANKS
    assert most == 4
    tensor = torch.zeros(8, dtype=torch.uint8)
    timeout = datetime.timedelta(seconds=3)
    for size in range(2, 2 * most + 1):
        for rank in range(size):
            for root in {0, 1, size - 1}:
                gloo = _FakeGloo(size)
                wire = _wire.GlooWire(gloo, rank)
                assert wire.size == size and wire.device == torch.device("cpu")
                wire.head(tensor, root, timeout).wait(timeout)
                heads = [op for op in gloo.log if op[0] != "wait"]
                if size > most:
                    assert heads == [("broadcast", root)], (size, rank, root)
                elif rank == root:
                    assert heads == [("send", p) for p in range(size) if p != root]
                else:
                    assert heads == [("recv", root)]
                gloo.log.clear()
                wire.payload(tensor, root, timeout).wait(timeout)
                assert gloo.log == [("broadcast", root), ("wait", ("broadcast", root), timeout)]
                gloo.log.clear()


def test_heads_wait_for_every_send_with_the_timeout() -> None:
    gloo = _FakeGloo(4)
    timeout = datetime.timedelta(seconds=3)
    _wire.GlooWire(gloo, 0).head(torch.zeros(8, dtype=torch.uint8), 0, timeout).wait(timeout)
    sends = [("send", p) for p in (1, 2, 3)]
    # Posted together, then waited for: a slow receiver does not hold up the sends after it.
    assert gloo.log == sends + [("wait", op, timeout) for op in sends]
