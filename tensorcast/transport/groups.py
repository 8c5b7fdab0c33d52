"""tensorcast's own process groups, made after an agreement among their ranks.

Everything tensorcast sends travels on groups it creates itself, one per set of ranks,
never on the mesh's or the caller's group: the model's collectives and the loader's
cannot then meet, whatever either does (see NOTE [ One ordered lane ] in ``transport.lane``).

:func:`open_role` opens a *channel*, one source and its receivers on one of these groups,
and returns this rank's role in it: a ``Sender`` or a ``Receiver``. Before it makes the
group, the ranks agree on their setup (see NOTE [ Agreement before anything collective ] in
``transport.agreement``): only then are groups created, so a disagreement never hangs
inside group creation. The store
is also where a source keeps its heartbeat (see ``transport.liveness``).

The groups are raw c10d backends over a prefix of the default store, owned here: a
loader built per epoch makes no new group or thread. State lives on a :class:`World`, one
per default process group (a job that destroys and re-initialises the default group gets
a new one). A world closes when its default group is destroyed (``destroy_process_group``),
whoever still holds a mesh, a loader or a role of it: a thread that watches the default
group while the world has groups closes them, and the heartbeat stops (NOTE [ A destroyed
default group ]).

On an NCCL job a group's payloads travel on an NCCL backend bound to the rank's own
device (``wire.rank_device``), connected eagerly when the group is made and
non-blocking, so that a broken channel can abort it with kernels in flight.

Each group's wire is made by ``wire.make_wire``; :func:`wrapping_wires` wraps the wires
of the groups made inside it (tests inject faults that way), and a group's ``wire`` is
read at every message, so one can be wrapped later too.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorcast import codec
from tensorcast._errors import DesyncError, PeerError
from tensorcast.transport import exits as _exits
from tensorcast.transport import relay as _relay
from tensorcast.transport.agreement import Agreement, ranks_name, store_failed
from tensorcast.transport.diagnosis import Asker, Silent, diagnose, timed_out
from tensorcast.transport.frame import FRAMES_VERSION, INITIAL_CAPACITY, promises_enabled
from tensorcast.transport.lane import Lane
from tensorcast.transport.liveness import Heartbeat
from tensorcast.transport.receiver import Receiver
from tensorcast.transport.sender import Packing, Sender
from tensorcast.transport.wire import ClosedWire, Wire, make_wire, rank_device

__all__ = [
    "Group",
    "Role",
    "World",
    "open_role",
    "world",
    "wrapping_wires",
]

#: what a rank holds for one channel: the source's role, or a receiver's
Role = Sender | Receiver

_lock = threading.Lock()
_worlds: weakref.WeakKeyDictionary[Any, World] = weakref.WeakKeyDictionary()
# Default groups whose first store request was given up (a stopped store): the request may
# still land, numbering this rank's keys past its peers', so no world is made on them again.
_given_up: weakref.WeakKeyDictionary[Any, PeerError] = weakref.WeakKeyDictionary()
_wraps: list[Callable[[Wire], Wire]] = []  # see wrapping_wires
_WATCH_S = 0.5  # how often a world with groups looks whether its default group is gone


def made_world() -> World | None:
    """tensorcast's state for the current default process group, if a call made it."""
    with _lock:
        return _worlds.get(dist.distributed_c10d._get_default_group())


def world(setup: datetime.timedelta | None = None) -> World:
    """tensorcast's state for the current default process group (made on first use, its
    store's answers waited for up to ``setup``: None, the default group's timeout).

    Making one closes, here and now, the worlds of earlier default groups that are still
    open (their watch looks every ``_WATCH_S``): after a re-initialisation, what tensorcast
    opened for the destroyed group is closed before it opens anything for the new one
    (NOTE [ A destroyed default group ])."""
    default = dist.distributed_c10d._get_default_group()
    with _lock:
        state = _worlds.get(default)
        if state is not None:
            return state
        stale = [w for w in _worlds.values() if w.closed is None]
        state = _worlds[default] = World(default, setup)
    for old in stale:
        if not old.current():
            old.close(_DESTROYED)
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


class World:
    """The default group's store, its agreement, and tensorcast's groups."""

    def __init__(self, default: Any, setup: datetime.timedelta | None = None) -> None:
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.backend = str(dist.get_backend()).lower()
        self.timeout = _default_timeout(default)
        base = dist.distributed_c10d._get_default_store()
        #: the default store's requests of this world (its number, ranks that exited), each
        #: answered in time or ``Silent`` (NOTE [ A store that does not answer ])
        asked_base = Asker(base, self.timeout.total_seconds())
        if default in _given_up:  # its number may still land: this rank's keys would differ
            raise _given_up[default]
        # A store outlives a re-initialised group in some launchers: number this world's
        # keys by how many worlds this rank has made on it.
        try:
            with asked_base.bounded(None if setup is None else setup.total_seconds()):
                generation = asked_base.add(f"tensorcast/generation/{self.rank}", 1)
        except RuntimeError as e:  # the store's host exited, or is stopped
            error = store_failed(base, self.rank, "setting up tensorcast", e)
            if isinstance(e, Silent):
                _given_up[default] = error
            raise error from e
        self.store = dist.PrefixStore(f"tensorcast/{generation}/", base)
        #: the setups' store: each request answered within the setup's timeout, or a
        #: ``PeerError`` (NOTE [ A store that does not answer ] in ``transport.diagnosis``)
        self.asked = Asker(self.store, self.timeout.total_seconds())
        #: compares setups before a group is made (and before a channel on one opens)
        self.agreement = Agreement(self.asked, self.rank, self.timeout, exits=asked_base)
        #: the store as receivers' diagnoses reach it; let go of when the world closes, so
        #: that a role kept past destroy_process_group() keeps no socket to the old store
        self.reach = _Reach(self.store)
        #: where NCCL payloads travel (None: a host job)
        self.device = rank_device(default) if "nccl" in self.backend else None
        self._groups: dict[tuple[int, ...], Group] = {}
        self._lock = threading.Lock()
        self._default = weakref.ref(default)
        #: why this world is closed (its default group was destroyed); None while it is up
        self.closed: str | None = None
        self.heartbeat = Heartbeat(
            self.store, self.rank, self.timeout.total_seconds(), self.current
        )
        self._watch: threading.Thread | None = None
        self._stop_watch = threading.Event()  # set at interpreter exit

    def stop_at_exit(self) -> _exits.Waiter:
        """Stop the watch (NOTE [ Interpreter exit ]); it leaves at once, or after the
        close it is in."""
        self._stop_watch.set()
        return _exits.Waiter(self._watch, 5.0, "the watch on the default process group")

    def current(self) -> bool:
        """Whether this world's default group is still the process's default group: False
        once ``destroy_process_group()`` ran (any thread may ask)."""
        if self.closed is not None or not dist.is_initialized():
            return False
        return dist.distributed_c10d._get_default_group() is self._default()

    def close(self, why: str) -> None:
        """Close every group of this world for good (see NOTE [ A destroyed default group ]):
        a later message on one raises ``PeerError`` saying ``why``."""
        with self._lock:
            if self.closed is not None:
                return
            self.closed = why
        _shut_down(self._groups, why, self.reach)

    # -- groups ----------------------------------------------------------------------

    def group(self, ranks: tuple[int, ...], timeout: datetime.timedelta | None = None) -> Group:
        """tensorcast's group over ``ranks`` (global, sorted), made on first use.

        Every rank of ``ranks`` must ask together the first time (the group connects
        them); call it only after an agreement among them. ``timeout`` bounds how long
        the ranks wait for each other to connect (None: the default group's).
        """
        with self._lock:
            if self.closed is not None:
                raise PeerError(f"rank {self.rank}: {self.closed}")
            group = self._groups.get(ranks)
            if group is None:
                try:
                    made = self._make_group(ranks, timeout or self.timeout)
                except (dist.DistNetworkError, dist.DistStoreError) as e:
                    what = f"connecting tensorcast's group over ranks {list(ranks)}"
                    raise store_failed(self.store, self.rank, what, e) from e
                if self._watch is None:  # the first: from now on, watch the default group
                    self._watch = threading.Thread(
                        target=_watch, args=(weakref.ref(self), self._groups, self.reach, self._stop_watch),
                        name="tensorcast-watch", daemon=True,
                    )  # fmt: skip
                    _exits.register(self)
                    self._watch.start()
                group = self._groups[ranks] = made
            return group

    def suspect_groups(
        self, ranks: Sequence[int], cause: BaseException, came: Callable[[], bool]
    ) -> None:
        """A setup over ``ranks`` failed on this rank for want of peers (``came()``: whether
        they have come to it since): every group of this rank's that shares a peer with it
        breaks at its next job unless they have (``lane.settle_suspects``)."""
        peers = set(ranks) - {self.rank}
        with self._lock:
            hit = [g for r, g in self._groups.items() if peers.intersection(r)]
        for group in hit:
            group.lane.suspects.append((cause, came))

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
        # The lane aborts the group's wire of the moment (a closed group's holds nothing). The
        # closure makes a cycle with the group, but no backend is ever freed through it:
        # _shut_down takes each group's wire out before the group can go.
        lane = Lane(
            name,
            lambda: group.wire.abort(),
            _worker_device(self.device),
            device_group=wire.streams is not None,
            exit_wait_s=self.timeout.total_seconds(),
        )
        group = Group(ranks, wire, lane)
        return group


def _worker_device(device: torch.device | None) -> int | None:
    """The CUDA device a lane's worker sets: the rank's NCCL device, or on a host job the
    current device once this process uses CUDA (a source iterator or a receiver's
    ``device="cuda"`` on the worker would otherwise make a context on ``cuda:0``)."""
    if device is not None:
        return device.index
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    return None


# NOTE [ A destroyed default group ]
# tensorcast's groups, its heartbeat and its threads belong to one default group, and go
# when it is destroyed, whatever the caller still holds: a kept DeviceMesh keeps the
# destroyed default group's object alive (from C++, so no finaliser of ours runs), and a
# kept loader keeps its role and group. torch calls nothing of ours in
# ``destroy_process_group()``, so a world with groups has one daemon thread that looks,
# every ``_WATCH_S``, whether its default group is still the process's; once it is not,
# that thread closes the groups: device work is dropped, idle lane workers leave, each
# group's wire is shut down and replaced by one that raises ``PeerError``, so that the
# backend (its sockets and threads) goes with its last reference, in that thread or in a
# lane worker finishing its job, never in the garbage collector's. A default group that is
# freed rather than destroyed is noticed the same way (its weak reference is dead): no
# finaliser of ours closes anything, as one could run while a lane's lock is held. The
# heartbeat asks the same question (``World.current``) at every wake and stops. Closing
# never talks to another rank, and an in-flight job ends at its own timeout, as on torch's
# own groups. The first use of tensorcast under a new default group closes the worlds of
# earlier ones still open, without waiting for their watch (``world()``): a program that
# re-initialises at once holds no more of tensorcast's sockets than one generation's. The watch sleeps on an event, so that interpreter exit stops it at once
# (NOTE [ Interpreter exit ] in ``transport.exits``).
_DESTROYED = (
    "its default process group was destroyed (destroy_process_group), so tensorcast's groups "
    "of it are closed; after init_process_group, build the loader (or mesh) again"
)


def _watch(
    ref: weakref.ReferenceType[World],
    groups: dict[tuple[int, ...], Group],
    reach: _Reach,
    stop: threading.Event,
) -> None:
    """Close the world once its default group is destroyed (NOTE [ A destroyed default
    group ]); leave then, or at interpreter exit. A world freed with its default group
    (the roles that hold its groups do not keep it) has its groups closed here too."""
    while True:
        if stop.wait(_WATCH_S):
            return
        state = ref()
        if state is None:
            _shut_down(groups, _DESTROYED, reach)
            return
        if state.closed is not None:
            return
        if not state.current():
            state.close(_DESTROYED)
            return
        del state  # not kept alive between two looks


class _Reach:
    """The store a world's receivers ask about a silent source; None once it closed."""

    __slots__ = ("store",)

    def __init__(self, store: Any) -> None:
        self.store: Any = store


def _shut_down(groups: dict[tuple[int, ...], Group], why: str, reach: _Reach) -> None:
    """Close ``groups`` for good, and let go of the store (NOTE [ A destroyed default
    group ])."""
    reach.store = None
    for group in list(groups.values()):
        group.lane.inflight.clear()  # deadlines no longer watched: the worker goes
        wire, group.wire = (
            group.wire,
            ClosedWire(group.wire, f"tensorcast's group over ranks {list(group.ranks)}: {why}"),
        )
        group.lane.wake()  # an idle worker leaves now
        with contextlib.suppress(Exception):
            wire.shutdown()
        del wire  # the backend goes with its last reference (here, or a running job's)
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


def open_role(
    scope: str,
    group: Sequence[int],
    src: int,
    what: str,
    setup: dict[str, Any],
    *,
    extra: dict[str, Any] | None = None,
    timeout: datetime.timedelta | None = None,
    setup_timeout: datetime.timedelta | None = None,
    first: tuple[int, int] | None = None,
    verify: bool = False,
    packing: Packing | None = None,
    shm: bool | None = None,
) -> tuple[Role, dict[int, dict[str, Any]]]:
    """Agree on ``setup`` among ``group`` (every rank of it calls this together), then open a
    channel on tensorcast's group over it: the :class:`Sender` on ``src``, else a Receiver.

    Args:
        scope: names the ranks that number their setups together (``ranks_name`` of the
            mesh's or group's ranks; NOTE [ Agreement before anything collective ]).
        group: the source and its receivers (global ranks, in mesh order for a mesh).
        src: the source's global rank.
        what: names the thing in errors.
        setup: what must agree on every rank of ``group`` (with the format and frame
            versions, and whether payloads are promised).
        extra: what this rank tells the others (see :meth:`Agreement.agree`).
        timeout: the role's wait for one message; None means the default group's.
        setup_timeout: bounds the agreement and the group's creation (None: ``timeout``).
        first: a mesh's first rank and number of ranks (see :meth:`Agreement.agree`).
        verify, packing: the sender's (``Sender``); receivers need not agree on packing.
        shm: the shared-memory lane (``transport.shm``): None automatic, False, True.

    Returns: the role, and every rank's ``extra``.

    Raises:
        DesyncError: the ranks disagree, or one did not come within the timeout.
        ValueError: ``shm=True`` where the lane cannot be (on every rank, saying why).
    """
    wait = setup_timeout or timeout
    state, promises = world(wait), promises_enabled()
    versions = {"format": codec.FORMAT_VERSION, "frames": FRAMES_VERSION, "promises": promises}
    told, setup = _relay.told(state.rank == src, extra, shm), {**setup, **versions, "shm": shm}
    channel_id, extras = _agree(state, scope, group, what, setup, told, first, wait)
    made, timeout = state.group(tuple(sorted(group)), wait), timeout or state.timeout
    arena, relay = _relay.open_side(shm, made, src, state.rank, extras, what)
    promises = promises and relay is None  # NOTE [ Several hosts ]
    if state.rank == src:
        state.heartbeat.start(timeout.total_seconds())
        pulling = state.heartbeat.busy("next(source)", channel_id)
        return Sender(
            made, src, channel_id, timeout=timeout, verify=verify, promises=promises,
            pulling=pulling, packing=packing, shm=_relay.writer(arena), relay=relay,
        ), extras  # fmt: skip
    return Receiver(
        made, src, rank=state.rank, channel_id=channel_id, timeout=timeout, promises=promises,
        diagnose=functools.partial(_why, state.reach, src, state.rank), shm=_relay.reader(arena),
        relay=relay,
    ), extras  # fmt: skip


def _agree(
    state: World,
    scope: str,
    group: Sequence[int],
    what: str,
    setup: dict[str, Any],
    told: dict[str, Any] | None,
    first: tuple[int, int] | None,
    wait: datetime.timedelta | None,
) -> tuple[int, dict[int, dict[str, Any]]]:
    """``Agreement.agree``; where this rank's peers did not come, its groups that share a
    peer with them are suspect (NOTE [ A call that does not take its part ])."""
    try:
        with state.asked.bounded((wait or state.timeout).total_seconds()):
            return state.agreement.agree(scope, group, what, setup, told, first=first, timeout=wait)
    except DesyncError as e:
        came = getattr(e, "came", None)  # set where peers did not come: they may come late
        if came is not None:
            state.suspect_groups(group, e, came)
        raise


def _why(
    reach: _Reach, src: int, rank: int, frame: tuple[int, int, int], error: BaseException, s: float
) -> str:
    """Why the source ``src`` did not send ``frame`` (``transport.diagnosis``); bound to
    the world's :class:`_Reach`, not the world: a role does not keep the world alive."""
    store = reach.store
    if store is None:
        return f"rank {rank}: {_DESTROYED}"
    return diagnose(store, src, rank=rank, frame=frame, timeout_s=s, timed_out=timed_out(error))
