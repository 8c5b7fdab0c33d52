"""tensorcast's own process groups, made after an agreement among their ranks.

Everything tensorcast sends travels on groups it creates itself, one per set of ranks,
never on the mesh's or the caller's group: the model's collectives and the loader's
cannot then meet, whatever either does (see NOTE [ One ordered lane ] in ``transport.lane``).

Before a loader or a broadcast channel makes its group, the ranks of that group agree on
their setup (see NOTE [ Agreement before anything collective ] in ``transport.agreement``): only
then are groups created, so a disagreement never hangs inside group creation. The store
is also where a source keeps its heartbeat (see ``transport.liveness``).

The groups are raw c10d backends over a prefix of the default store, owned here and torn
down with the default group: a loader built per epoch makes no new group or thread.
State lives on a :class:`World`, one per default process group (a job that destroys and
re-initialises the default group gets a new one).
"""

from __future__ import annotations

import datetime
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from tensorcast.transport.agreement import Agreement, ranks_name
from tensorcast.transport.frame import INITIAL_CAPACITY
from tensorcast.transport.lane import Lane
from tensorcast.transport.liveness import Heartbeat
from tensorcast.transport.wire import GlooWire, NcclWire, Wire

__all__ = ["Group", "World", "world"]

_lock = threading.Lock()
_worlds: weakref.WeakKeyDictionary[Any, World] = weakref.WeakKeyDictionary()


def world() -> World:
    """tensorcast's state for the current default process group (made on first use)."""
    default = dist.distributed_c10d._get_default_group()
    with _lock:
        state = _worlds.get(default)
        if state is None:
            state = _worlds[default] = World(default)
        return state


class Group:
    """One of tensorcast's groups: its global ranks, its wire and its lane."""

    def __init__(self, ranks: tuple[int, ...], wire: Wire, lane: Lane) -> None:
        self.ranks = ranks
        self.wire = wire
        self.lane = lane
        #: the size of the next first message; only the lane's worker reads or sets it,
        #: frame after frame, so it is the same on every rank (see ``transport.frame``)
        self.capacity = INITIAL_CAPACITY

    def local(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


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
        self._groups: dict[tuple[int, ...], Group] = {}
        self._lock = threading.Lock()
        default_ref = weakref.ref(default)
        self.heartbeat = Heartbeat(
            self.store, self.rank, self.timeout.total_seconds(), lambda: default_ref() is not None
        )
        #: channels of ``tensorcast.broadcast``, by (group ranks, source)
        self.broadcast_channels: dict[tuple[tuple[int, ...], int], Any] = {}

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
        # Connecting waits for every peer up to the timeout it is made with; the group's
        # own collectives then wait up to the default group's.
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), local, len(ranks), connect)
        set_default = getattr(gloo, "_set_default_timeout", None)
        if set_default is not None and connect != self.timeout:
            set_default(self.timeout)
        wire: Wire
        cuda: int | None = None
        if "nccl" in self.backend:
            cuda = torch.cuda.current_device()
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), local, len(ranks), opts)
            wire = NcclWire(gloo, nccl, local, torch.device("cuda", cuda))
        else:
            wire = GlooWire(gloo, local)
        return Group(ranks, wire, Lane(name, wire.abort, cuda))


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
