"""Wires: the collectives a frame's messages travel on, one small class per backend.

A wire moves one message from a source to every other rank of tensorcast's own group
and knows nothing of what the bytes mean. Two kinds of message:

- a *head* (a first message, or a spilled header): small, on a host group;
- a *payload*: the packed buffer, on the transfer device's group.

==========  ======================================  ===================================
wire        heads                                   payloads
==========  ======================================  ===================================
GlooWire    gloo; sends from the source to each     gloo broadcast (a tree); on a channel
            receiver on groups of up to             spread over hosts, sends to one rank
            ``HEAD_SENDS_MAX_RANKS`` ranks, else a  at a time (``transport.relay``)
            broadcast
NcclWire    the same gloo group (no device sync     NCCL broadcast on the rank's CUDA
            to read a header)                       device, posted on the caller's
                                                    thread
==========  ======================================  ===================================

Why sends: ProcessGroupGloo runs a send or a receive on the calling thread but queues a
broadcast for a worker thread on every rank, a hop that a small message pays on every
rank. The source sends one receiver after another, so large groups keep gloo's
broadcast tree.

Ranks here are *group-local*. Both return a handle to ``wait`` on once the message is
posted: a promised payload is posted together with its first message (NOTE [ Promised
payloads ]), and a rank does work of its own while a head is on the wire (NOTE [ Views
made ahead ], ``codec.views``). A failure or a timeout raises
``RuntimeError`` from torch, which the caller turns into a broken channel.

A group's wire is made here (:func:`make_wire`, on the rank's own device for NCCL:
:func:`rank_device`), and a closed group keeps a :class:`ClosedWire`, whose messages raise.
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from tensorcast._errors import PeerError
from tensorcast.transport.device import CudaStreams, Streams

__all__ = [
    "HEAD_SENDS_MAX_RANKS",
    "ClosedWire",
    "GlooWire",
    "NcclWire",
    "Posted",
    "Wire",
    "make_wire",
    "rank_device",
]

#: The largest group whose heads the source sends each receiver itself.
HEAD_SENDS_MAX_RANKS = 4
_TAG = 0  # the group is tensorcast's own: no other traffic to tell apart
_RELAY_TAG = 1  # payloads sent to one rank at a time (``transport.relay``)
_MAX_OPTIONS = 32  # broadcast options kept per wire, by (root, timeout)
# Backends aborted after a failure, kept for the life of the process: abort() does not
# cancel a collective already queued on gloo's worker thread, and a backend's destructor
# waits for it, up to the group's timeout, in whatever thread drops the last reference
# (often the garbage collector's, in the middle of unrelated work). A broken group is
# rare and ends a job; keeping it costs its sockets, never a stall.
_ABORTED: list[Any] = []


class Posted(Protocol):
    """A message posted and not yet waited for."""

    def wait(self, timeout: datetime.timedelta) -> Any: ...


class Wire(Protocol):
    """The collectives of one tensorcast group (group-local ranks)."""

    #: where payloads travel: the host for gloo, the rank's CUDA device for NCCL
    device: torch.device
    #: the device's streams when payloads travel on a device, else None: the payload's
    #: collective is then posted on the caller's thread (NOTE [ Device work at next() ])
    streams: Streams | None
    size: int

    def head(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Posted:
        """Post a head's move from ``root`` to every rank (``tensor`` is read there,
        written elsewhere) and return at once; it has moved once waited for."""
        ...

    def payload(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Posted:
        """Post a payload's move from ``root`` to every rank and return at once: a promised
        payload is waited for after the first message (NOTE [ Promised payloads ]). ``timeout``
        bounds it from now, and its ``wait`` too."""
        ...

    def abort(self) -> None:
        """Tear the group down so that peers blocked on it fail now, not at their timeout."""
        ...

    def shutdown(self) -> None:
        """Release the group's resources for good (the default group was destroyed)."""
        ...


def _abort(backend: Any) -> None:
    """Abort a backend where torch can (older gloo backends cannot: their peers then
    fail at their own timeout instead of at once)."""
    abort = getattr(backend, "abort", None)
    if abort is not None:
        abort()


def _broadcast_options(root: int, timeout: datetime.timedelta | None = None) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    if hasattr(opts, "asyncOp"):  # older bindings lack it: their collectives are async
        opts.asyncOp = True
    if timeout is not None:  # else the group's own, from when the collective starts
        opts.timeout = timeout
    return opts


class GlooWire:
    """Heads and payloads on one gloo group."""

    device = torch.device("cpu")
    streams: Streams | None = None

    def __init__(self, gloo: Any, rank: int) -> None:
        self._gloo = gloo
        self.rank = rank
        self.size = gloo.size()
        self._sends = self.size <= HEAD_SENDS_MAX_RANKS
        self._peers = [peer for peer in range(self.size) if peer != rank]  # as the source
        self._options: dict[tuple[int, datetime.timedelta | None], Any] = {}

    def _opts(self, root: int, timeout: datetime.timedelta | None = None) -> Any:
        key = root, timeout
        opts = self._options.get(key)
        if opts is None:
            if len(self._options) >= _MAX_OPTIONS:  # callers that vary their timeout
                self._options.clear()
            opts = self._options[key] = _broadcast_options(root, timeout)
        return opts

    def head(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Posted:
        gloo = self._gloo
        if not self._sends:
            return gloo.broadcast([tensor], self._opts(root))  # type: ignore[no-any-return]
        if self.rank == root:
            peers = self._peers
            if len(peers) == 1:  # its own work: nothing to wait for together
                return gloo.send([tensor], peers[0], _TAG)  # type: ignore[no-any-return]
            return _All([gloo.send([tensor], peer, _TAG) for peer in peers])
        return gloo.recv([tensor], root, _TAG)  # type: ignore[no-any-return]

    def payload(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Posted:
        # One posted with the first message waits for that as well: the collective's own
        # clock (the group's timeout, from now) must not run out before its wait's.
        return self._gloo.broadcast([tensor], self._opts(root, 2 * timeout))  # type: ignore[no-any-return]

    def send(self, tensor: torch.Tensor, peers: tuple[int, ...]) -> Posted:
        """Post ``tensor`` to each of ``peers`` alone (``transport.relay``)."""
        return _All([self._gloo.send([tensor], peer, _RELAY_TAG) for peer in peers])

    def recv(self, tensor: torch.Tensor, peer: int) -> Posted:
        """Post the receive of what :meth:`send` posts to this rank from ``peer``."""
        return self._gloo.recv([tensor], peer, _RELAY_TAG)  # type: ignore[no-any-return]

    def abort(self) -> None:
        _ABORTED.append(self._gloo)
        _abort(self._gloo)

    def shutdown(self) -> None:
        """Nothing to do: a gloo backend goes with its last reference."""


class NcclWire(GlooWire):
    """Heads on a gloo group, payloads on an NCCL group over the same ranks.

    A payload is posted on the caller's thread, inside this group's own transfer stream
    (NOTE [ Device work at next() ]: one per group, so that groups do not wait on each
    other's peers): NCCL's own stream first waits on it, and waiting for the payload makes
    it wait on NCCL's end (NOTE [ A stream wait ]).
    """

    def __init__(self, gloo: Any, nccl: Any, rank: int, device: torch.device) -> None:
        super().__init__(gloo, rank)
        self._nccl = nccl
        self.device = device
        self.streams = CudaStreams(device)
        variable = blocking_wait()
        if variable is not None:
            warnings.warn(
                f"{variable} is set: with torch {torch.__version__}, tensorcast's NCCL payloads "
                f"then wait on the host at every hand-over (a host sync per batch on the "
                f"training thread, so a transfer no longer overlaps the step, and a hung peer "
                f"holds that thread up to NCCL's own timeout). Unset it, or use torch 2.6 or "
                f"later, where tensorcast's stream wait ignores it",
                RuntimeWarning,
                stacklevel=2,
            )

    def payload(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Posted:
        return _StreamWait(self._nccl.broadcast([tensor], self._opts(root)))

    def abort(self) -> None:
        _ABORTED.append(self._nccl)
        super().abort()
        _abort(self._nccl)

    def shutdown(self) -> None:
        shutdown = getattr(self._nccl, "shutdown", None)
        if shutdown is not None and self._nccl not in _ABORTED:
            shutdown()


class _All:
    """Messages posted to every receiver, waited for together."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, timeout: datetime.timedelta) -> None:
        for work in self._works:
            work.wait(timeout)


# NOTE [ A stream wait ]
# A payload's end is waited for with ``Work.synchronize()``: since torch 2.6
# (pytorch/pytorch#137295) it only makes the current stream wait on NCCL's end event, and
# lets go of what PGNCCL stashed for the allocator. ``Work.wait()`` does the same, unless a
# timeout is given or TORCH_NCCL_BLOCKING_WAIT=1 (or its old name NCCL_BLOCKING_WAIT) is
# set: it then polls on the host until the collective is done, a host wait per batch on
# the caller's thread. Before 2.6 ``synchronize()`` polls too under that variable, so an
# NCCL wire warns once when it is made there (:func:`blocking_wait`). Blocking-wait mode
# also runs no PGNCCL watchdog; the channel's deadline (NOTE [ Device work at next() ])
# still breaks a lane whose payload never completes.
_TRUE = ("1", "y", "yes", "t", "true")  # what torch's getCvarBool reads as set


def blocking_wait(version: str = torch.__version__) -> str | None:
    """The variable that makes a payload's stream wait a host wait on this torch (NOTE
    [ A stream wait ]), or None; the first of the two names that is set decides, as in
    torch."""
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        value = os.environ.get(name)
        if value is not None:
            on = value.strip().lower() in _TRUE
            return name if on and TorchVersion(version) < "2.6" else None
    return None


class _StreamWait:
    """An NCCL collective whose ``wait`` makes the current stream wait, never the host
    (NOTE [ A stream wait ])."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self, timeout: datetime.timedelta) -> None:
        self._work.synchronize()


# --------------------------------------------------------------------------- making one


def rank_device(default: Any) -> torch.device:
    """The CUDA device this rank's NCCL traffic uses: ``init_process_group(device_id=)``,
    else the current device once the rank has chosen one.

    Raises:
        RuntimeError: the rank chose none (every rank would land on ``cuda:0``).
    """
    bound = getattr(default, "bound_device_id", None)
    if bound is not None:
        return torch.device(bound)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    raise RuntimeError(
        "tensorcast on an NCCL process group needs this rank's GPU: call "
        "torch.cuda.set_device(local_rank) before the first loader or broadcast (or pass "
        "device_id=torch.device('cuda', local_rank) to init_process_group); without it "
        "every rank would use cuda:0"
    )


def make_wire(
    store: Any,
    rank: int,
    size: int,
    *,
    connect: datetime.timedelta,
    timeout: datetime.timedelta,
    device: torch.device | None,
    name: str = "",
    ranks: tuple[int, ...] = (),
) -> Wire:
    """The wire of a new group over ``store``: gloo heads, and payloads on gloo, or on an
    NCCL backend bound to ``device``, connected now and non-blocking (see the module).

    ``connect`` bounds how long the ranks wait for each other to connect; the group's
    collectives then wait up to ``timeout``. ``name`` and ``ranks`` (global) name the
    NCCL backend in torch's logs and flight-recorder dumps.
    """
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, connect)
    set_default = getattr(gloo, "_set_default_timeout", None)
    if set_default is not None and connect != timeout:
        set_default(timeout)
    if device is None:
        return GlooWire(gloo, rank)
    opts = dist.ProcessGroupNCCL.Options()
    # NCCL's watchdog ends the process when a collective outlives the group's timeout:
    # give it twice the default group's, so that a channel's own deadline (NOTE [ Device
    # work at next() ]) breaks the lane and raises PeerError first.
    opts._timeout = 2 * timeout
    opts.is_high_priority_stream = False
    if name and hasattr(opts, "group_name"):
        opts.group_name = f"tensorcast:{name}"  # type: ignore[assignment]
    if ranks and hasattr(opts, "global_ranks_in_group"):
        opts.global_ranks_in_group = list(ranks)
    config = getattr(opts, "config", None)
    if config is not None and hasattr(config, "blocking"):
        config.blocking = 0  # abort() is safe with kernels in flight only when non-blocking
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, opts)
    eager = getattr(nccl, "eager_connect_single_device", None)
    if eager is not None:  # now, on the caller's thread, not inside the first batch
        eager(device)
    return NcclWire(gloo, nccl, rank, device)


class ClosedWire:
    """The wire of a closed group: what it was, without its backend; messages raise."""

    def __init__(self, wire: Wire, why: str) -> None:
        self.device = wire.device
        self.streams = wire.streams
        self.size = wire.size
        self._why = why

    def head(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Any:
        raise PeerError(self._why)

    def payload(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Any:
        raise PeerError(self._why)

    def send(self, tensor: torch.Tensor, peers: tuple[int, ...]) -> Any:
        raise PeerError(self._why)

    def recv(self, tensor: torch.Tensor, peer: int) -> Any:
        raise PeerError(self._why)

    def abort(self) -> None:
        """Nothing left to abort."""

    def shutdown(self) -> None:
        """Nothing left to release."""
