"""tensorcast's own process groups, made after an agreement among their ranks.

Everything tensorcast sends travels on groups it creates itself, one per set of ranks,
never on the mesh's or the caller's group: the model's collectives and the loader's
cannot then meet, whatever either does (see NOTE [ One ordered lane ] in ``transport.lane``).

Before a loader or a broadcast channel makes its group, the ranks of that group agree on
their setup (see NOTE [ Agreement before anything collective ] in ``transport.agreement``): only
then are groups created, so a disagreement never hangs inside group creation. The store
is also where a source keeps its heartbeat (see ``transport.liveness``).

The groups are raw c10d backends over a prefix of the default store, owned here and shut
down with the default group (``destroy_process_group``): a loader built per epoch makes
no new group or thread. State lives on a :class:`World`, one per default process group (a
job that destroys and re-initialises the default group gets a new one).

On an NCCL job a group's payloads travel on an NCCL backend bound to the rank's own
device (:func:`rank_device`), connected eagerly when the group is made and
non-blocking, so that a broken channel can abort it with kernels in flight.

Each group's wire is made by :func:`make_wire`; :func:`wrapping_wires` wraps the wires
of the groups made inside it (tests inject faults that way), and a group's ``wire`` is
read at every message, so one can be wrapped later too.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from tensorcast.transport.agreement import Agreement, ranks_name
from tensorcast.transport.frame import INITIAL_CAPACITY
from tensorcast.transport.lane import Lane
from tensorcast.transport.liveness import Heartbeat
from tensorcast.transport.wire import GlooWire, NcclWire, Wire

__all__ = ["Group", "World", "make_wire", "rank_device", "world", "wrapping_wires"]

_lock = threading.Lock()
_worlds: weakref.WeakKeyDictionary[Any, World] = weakref.WeakKeyDictionary()
_wraps: list[Callable[[Wire], Wire]] = []  # see wrapping_wires


def world() -> World:
    """tensorcast's state for the current default process group (made on first use)."""
    default = dist.distributed_c10d._get_default_group()
    with _lock:
        state = _worlds.get(default)
        if state is None:
            state = _worlds[default] = World(default)
        return state


@contextlib.contextmanager
def wrapping_wires(wrap: Callable[[Wire], Wire]) -> Iterator[None]:
    """Groups made inside get ``wrap(wire)`` for their wire (a tap, a fault injector)."""
    _wraps.append(wrap)
    try:
        yield
    finally:
        _wraps.remove(wrap)


class Group:
    """One of tensorcast's groups: its global ranks, its wire and its lane.

    ``wire`` is read at every message: assigning a wrapped one taps a group made earlier.
    """

    def __init__(self, ranks: tuple[int, ...], wire: Wire, lane: Lane) -> None:
        self.ranks = ranks
        self.wire = wire
        self.lane = lane
        #: the size of the next first message; only the lane's worker reads or sets it,
        #: frame after frame, so it is the same on every rank (see ``transport.frame``)
        self.capacity = INITIAL_CAPACITY

    def local(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


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


class World:
    """The default group's store, its agreement, and tensorcast's groups."""

    def __init__(self, default: Any) -> None:
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.backend = str(dist.get_backend()).lower()
        self.timeout = _default_timeout(default)
        base = dist.distributed_c10d._get_default_store()
        # A store outlives a re-initialised group in some launchers: number this world's
        # keys by how many worlds this rank has made on it.
        generation = base.add(f"tensorcast/generation/{self.rank}", 1)
        self.store = dist.PrefixStore(f"tensorcast/{generation}/", base)
        #: compares setups before a group is made (and before a channel on one opens)
        self.agreement = Agreement(self.store, self.rank, self.timeout, exits=base)
        #: where NCCL payloads travel (None: a host job)
        self.device = rank_device(default) if "nccl" in self.backend else None
        self._groups: dict[tuple[int, ...], Group] = {}
        self._lock = threading.Lock()
        default_ref = weakref.ref(default)
        self.heartbeat = Heartbeat(
            self.store, self.rank, self.timeout.total_seconds(), lambda: default_ref() is not None
        )
        #: channels of ``tensorcast.broadcast``, by (group ranks, source)
        self.broadcast_channels: dict[tuple[tuple[int, ...], int], Any] = {}
        # Shut the groups down with the default group, in the thread that destroys it.
        weakref.finalize(default, _shut_down, self._groups)

    # -- groups ----------------------------------------------------------------------

    def group(self, ranks: tuple[int, ...], timeout: datetime.timedelta | None = None) -> Group:
        """tensorcast's group over ``ranks`` (global, sorted), made on first use.

        Every rank of ``ranks`` must ask together the first time (the group connects
        them); call it only after an agreement among them. ``timeout`` bounds how long
        the ranks wait for each other to connect (None: the default group's).
        """
        with self._lock:
            group = self._groups.get(ranks)
            if group is None:
                group = self._groups[ranks] = self._make_group(ranks, timeout or self.timeout)
            return group

    def _make_group(self, ranks: tuple[int, ...], connect: datetime.timedelta) -> Group:
        local = ranks.index(self.rank)
        name = ranks_name(ranks)
        store = dist.PrefixStore(f"group/{name}/", self.store)
        wire = make_wire(
            store,
            local,
            len(ranks),
            connect=connect,
            timeout=self.timeout,
            device=self.device,
            name=name,
            ranks=ranks,
        )
        for wrap in _wraps:
            wire = wrap(wire)
        lane = Lane(
            name, wire.abort, _worker_device(self.device), device_group=wire.streams is not None
        )
        return Group(ranks, wire, lane)


def _worker_device(device: torch.device | None) -> int | None:
    """The CUDA device a lane's worker sets: the rank's NCCL device, or on a host job the
    current device once this process uses CUDA (a source iterator or a receiver's
    ``device="cuda"`` on the worker would otherwise make a context on ``cuda:0``)."""
    if device is not None:
        return device.index
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    return None


def _shut_down(groups: dict[tuple[int, ...], Group]) -> None:
    for group in list(groups.values()):
        group.lane.inflight.clear()  # what the device was reading goes, and so does the worker
        group.lane.wake()
        with contextlib.suppress(Exception):
            group.wire.shutdown()
    groups.clear()


def _default_timeout(default: Any) -> datetime.timedelta:
    """The timeout given to ``init_process_group`` (torch keeps it on the backend)."""
    for device in ("cpu", "cuda"):
        try:
            timeout = default._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return dist.default_pg_timeout
