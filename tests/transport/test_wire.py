"""The wires' rules on a fake gloo backend: which collective moves a head or a payload,
and that each is waited for with the timeout. No process group."""

from __future__ import annotations

import datetime
import types
from typing import Any

import pytest
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


class _FakeNccl:
    """The part of an NCCL backend an ``NcclWire`` uses: its works record how they are
    waited for."""

    class Work:
        def __init__(self, log: list[str]) -> None:
            self.log = log

        def wait(self, timeout: Any = None) -> bool:
            self.log.append("wait")  # a host poll under TORCH_NCCL_BLOCKING_WAIT=1
            return True

        def synchronize(self) -> None:
            self.log.append("synchronize")

    def __init__(self) -> None:
        self.log: list[str] = []

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        self.log.append("broadcast")
        return self.Work(self.log)


def _nccl_wire(nccl: _FakeNccl | None = None) -> _wire.NcclWire:
    return _wire.NcclWire(_FakeGloo(2), nccl or _FakeNccl(), 0, torch.device("cuda", 0))


def test_each_nccl_group_has_a_transfer_stream_of_its_own() -> None:
    """Two groups on one GPU do not share the stream their payloads are posted on, so a
    slow peer on one does not hold up the other's payloads (NOTE [ Device work at
    next() ]). No CUDA call is made: the stream itself is made at the first post."""
    a, b = _nccl_wire(), _nccl_wire()
    assert a.streams is not b.streams
    assert a.streams.device == b.streams.device == torch.device("cuda", 0)


def test_a_payload_is_waited_for_on_the_stream_whatever_blocking_wait_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Work.wait()`` polls on the host under TORCH_NCCL_BLOCKING_WAIT=1; a payload's end
    is waited for with ``synchronize()``, a stream wait on torch 2.6 and later (NOTE [ A
    stream wait ]). An older torch is warned of, naming the variable, once per group."""
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    nccl = _FakeNccl()
    timeout = datetime.timedelta(seconds=3)
    _nccl_wire(nccl).payload(torch.zeros(8, dtype=torch.uint8), 0, timeout).wait(timeout)
    assert nccl.log == ["broadcast", "synchronize"]
    assert _wire.blocking_wait("2.11.0+cu130") is None
    assert _wire.blocking_wait("2.5.1+cu124") == "TORCH_NCCL_BLOCKING_WAIT"
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "0")  # the first name set decides
    monkeypatch.setenv("NCCL_BLOCKING_WAIT", "1")
    assert _wire.blocking_wait("2.5.1") is None
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT")
    assert _wire.blocking_wait("2.5.1") == "NCCL_BLOCKING_WAIT"
    monkeypatch.setattr(_wire, "blocking_wait", lambda: "NCCL_BLOCKING_WAIT")
    with pytest.warns(RuntimeWarning, match="NCCL_BLOCKING_WAIT is set.*host"):
        _nccl_wire()


def test_broadcast_options_of_older_bindings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Older c10d bindings of ``BroadcastOptions`` define only ``rootRank``, ``rootTensor``
    and ``timeout``: a wire made there sets what they have and nothing else."""

    class Older:
        __slots__ = ("rootRank", "rootTensor", "timeout")

    monkeypatch.setattr(_wire.dist, "BroadcastOptions", Older)
    timeout = datetime.timedelta(seconds=3)
    opts = _wire._broadcast_options(1, timeout)
    assert (opts.rootRank, opts.rootTensor, opts.timeout) == (1, 0, timeout)


# -- making a wire: the device an NCCL group is bound to


def test_an_nccl_group_is_bound_to_the_device_the_rank_chose() -> None:
    chosen = torch.device("cuda", 3)
    assert _wire.rank_device(types.SimpleNamespace(bound_device_id=chosen)) == chosen


@pytest.mark.skipif(torch.cuda.is_available(), reason="a rank with CUDA has a current device")
def test_a_rank_that_chose_no_device_is_told_how_to_choose_one() -> None:
    with pytest.raises(RuntimeError, match=r"torch.cuda.set_device\(local_rank\).*device_id"):
        _wire.rank_device(types.SimpleNamespace(bound_device_id=None))


def test_a_closed_wire_refuses_every_message_with_peer_error() -> None:
    """A group closed between a frame's head and its relayed payload raises what any
    message on it raises, not an AttributeError."""
    from tensorcast import PeerError

    was = types.SimpleNamespace(device=None, streams=None, size=4)
    closed = _wire.ClosedWire(was, "the default group was destroyed")  # type: ignore[arg-type]
    t, wait = torch.zeros(4, dtype=torch.uint8), datetime.timedelta(seconds=1)
    for post in (
        lambda: closed.head(t, 0, wait),
        lambda: closed.payload(t, 0, wait),
        lambda: closed.send(t, (1, 2)),
        lambda: closed.recv(t, 0),
    ):
        with pytest.raises(PeerError, match="destroyed"):
            post()
    closed.abort()
    closed.shutdown()
