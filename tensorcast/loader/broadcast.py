"""``broadcast`` and ``broadcast_batch``: one batch from a source rank to its peers.

Both run one job on the lane of tensorcast's own group over the caller's ranks (see
NOTE [ One ordered lane ]): this rank's role sends or receives the batch, and the batch
is handed out on the caller's thread. The caller's group (or mesh) only says which
ranks; nothing travels on it. A role is opened once per ``(group, src)`` (or per mesh and
axes) and kept with tensorcast's state for the default group.

The arguments these two share with ``BroadcastingDataLoader`` (timeouts, output devices,
``src``, ``shm``, packed batches) are checked by the functions at the end, which the
loader imports from here.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import numbers
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tensorcast._errors import SourceError, describe
from tensorcast.codec import Packed, check_trim, resolve_device, unpack
from tensorcast.loader import mesh as _mesh
from tensorcast.transport import (
    CLOSE,
    END,
    DevicePart,
    Role,
    Sender,
    World,
    hand_out,
    made_world,
    open_role,
    ranks_name,
)
from tensorcast.transport import (
    world as _world,
)

__all__ = [
    "broadcast",
    "broadcast_batch",
    "check_shm",
    "check_src",
    "distributed",
    "output_device",
    "to_timedelta",
    "unpack_if_packed",
]

_ATTR = "_tensorcast_roles"  # on a mesh: its roles by axes
_lock = threading.Lock()
# The roles of ``tensorcast.broadcast`` by (group ranks, source), per default group's state.
_roles: weakref.WeakKeyDictionary[World, dict[tuple[tuple[int, ...], int, bool | None], Role]] = (
    weakref.WeakKeyDictionary()
)


_NOT_DISTRIBUTED = (
    "tensorcast.broadcast needs torch.distributed: call torch.distributed.init_process_group() "
    "first (tensorcast.broadcast_batch and BroadcastingDataLoader are no-ops without it)"
)


def broadcast(
    tree: Any,
    src: int,
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | str | None = None,
    timeout: float | datetime.timedelta | None = None,
    trim: bool = True,
    shm: bool | None = None,
) -> Any:
    """Send ``tree`` from rank ``src`` to every rank of ``group``; all return the same tree.

    Every rank of ``group`` calls this, in the same order as its other tensorcast calls
    on those ranks. The source packs the tree into a header and one buffer; receivers
    rebuild it as views into the buffer they received. Nothing is pickled on any rank,
    and nothing travels on ``group`` itself: tensorcast sends on its own group over the
    same ranks, made (with an agreement among the ranks) the first time a ``(group,
    src)`` pair is used.

    Args:
        tree: the batch on the source rank (a tree or a :class:`Packed`); ignored elsewhere,
            where ``None`` is the usual value.
        src: the source's *global* rank, as in ``torch.distributed.broadcast``.
        group: the ranks to reach; None means every rank.
        device: where output tensors land. Defaults to the group's transfer device:
            ``cuda:<current device>`` for NCCL, CPU for gloo. numpy leaves stay on CPU.
        timeout: seconds (or a timedelta) to wait for a peer; None means the default
            process group's timeout.
        trim: padding never travels: padded leaves are sent without their rows' trailing
            runs and rebuilt bit-identical (NOTE [ Trimmed leaves ]); False sends every
            leaf whole. Read on the source only.
        shm: where every rank of the group shares the source's host, payloads go through
            shared memory, not the wire (None: where it can; False: never; True: required,
            a ``ValueError`` at setup saying why not). The same on every rank.

    Returns:
        The rebuilt tree, on every rank including the source.

    Raises:
        UnsupportedLeafError: on the source, when the tree holds a leaf that cannot travel.
        SourceError: on receivers, when the source could not encode its tree.
        DesyncError: the ranks disagree on ``src`` the first time it is used.
        PeerError: a peer died or did not answer within the timeout.
        TypeError: ``trim`` is not a bool.
    """
    known = _known(functools.partial(_broadcast_role, group, src, None, shm, open_new=False))
    meant = known if known is not None else _known(functools.partial(_meant_role, group, src, shm))
    with _taking_part(meant, timeout):
        check_trim(trim)
        if not distributed():
            raise RuntimeError(_NOT_DISTRIBUTED)
        wait = to_timedelta(timeout)
        dev = output_device(device)
        check_shm(shm)
        src = check_src(src)
        if meant is not known:  # src or shm picks no channel: a src outside the group, say so
            _mesh.group_ranks(group, src)
    role = known if known is not None else _broadcast_role(group, src, wait, shm)
    assert role is not None  # opened where it was not
    return _run(role, tree, dev, wait, trim)


# NOTE [ A call that does not take its part ]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every rank's calls over a group line up one for one: its peers cannot tell a call this
# rank never made from one it made late. So a call that raised on one rank before taking
# its part (a mistyped argument, caught by the caller) would leave that rank a frame behind
# or ahead, and its next call would return another call's batch with no error anywhere.
# Where the call's channel exists, a call whose own arguments fail still takes its part,
# then raises its own error: a source sends an ERROR frame (its receivers raise
# ``SourceError`` naming the mistake), a receiver reads the frame and drops it. A first
# call has no channel yet: its peers fail at the setup's agreement instead. A call whose
# ``src`` or ``shm`` is itself wrong (not an int, not a rank of the group; not None nor a
# bool) takes its part on the channel it most likely meant: the one this rank has over the
# group's ranks (the mesh's axes) that its other arguments fit, where there is exactly one.
# Where its peers were setting up another instead (their first call with a new ``src``),
# it waits there for its timeout and raises, as they do. Where it has none or several, or
# the group or the axes are wrong, the call cannot tell which channel it was meant for,
# and raises only.
#
# A setup that fails on a rank because its peers did not come (a later call with another
# ``src`` or axes on that rank only) leaves every group of this rank's that shares a peer
# with it suspect (``World.suspect_groups``). At its next job there, unless they have come
# to that setup since (late: they were told, and skipped it too), they went on without
# this rank, and what it would read there may be another call's, so the group breaks
# (``lane.settle_suspects``). The store says only that they came, not what they sent
# before: a peer whose own first call of that setup comes late, after it went on over the
# same ranks, and before this rank's next job there, is not told apart.


def _meant_role(group: Any, src: Any, shm: Any) -> Role | None:
    """Where ``src`` or ``shm`` is itself wrong, the one role of this rank's over
    ``group``'s ranks that the call's other arguments fit: the channel it can only have
    meant (NOTE [ A call that does not take its part ]). None where both are valid (the
    call names its channel), or where this rank has none or several that fit."""
    try:
        _mesh.group_ranks(group, check_src(src))
        src_ok = True
    except (TypeError, ValueError):
        src_ok = False
    shm_ok = _shm_ok(shm)
    if src_ok and shm_ok:
        return None
    ranks = _mesh.group_ranks(group, None)
    with _lock:  # this world's roles, if it has any: made by a call with valid arguments
        keys = [kv for w, roles in _roles.items() if w.current() for kv in roles.items()]
    fits = [
        role
        for (on, from_, lane), role in keys
        if on == ranks and (not src_ok or from_ == src) and (not shm_ok or lane is shm)
    ]
    return fits[0] if len(fits) == 1 else None


def _known(find: Callable[[], Role | None]) -> Role | None:
    """The role a call's arguments name, where it already exists: never sets one up and
    never raises (the arguments are checked after it)."""
    try:
        return find()
    except Exception:
        return None


@contextlib.contextmanager
def _taking_part(known: Role | None, timeout: Any) -> Iterator[None]:
    """Checks of a call's own arguments: where the call's channel exists, a failure still
    takes its part in the frame (within ``timeout`` where it is valid), then raises: its
    own error, whatever that part met (NOTE [ A call that does not take its part ])."""
    try:
        yield
    except Exception as e:
        if known is not None:
            try:
                _take_part(known, e, _valid_timeout(timeout))
            except Exception as part:  # the frame's own failure: said beside the caller's
                if hasattr(e, "add_note"):  # Python 3.11+
                    e.add_note(f"taking this rank's part in the frame failed: {part!r}")
        raise


def _valid_timeout(timeout: Any) -> datetime.timedelta | None:
    try:
        return to_timedelta(timeout)
    except ValueError:
        return None


def _take_part(role: Role, error: Exception, wait: datetime.timedelta | None) -> None:
    """This rank's part in a frame whose call failed here before it began: the source
    tells its receivers (they raise ``SourceError``), a receiver reads the frame and drops
    it (the source's own failure, if it failed too, included)."""
    lane = role.group.lane
    frames_taken = functools.partial(getattr, role, "frames")
    if isinstance(role, Sender):
        message = f"its call failed before sending: {describe(error)}"
        lane.run(functools.partial(role.send_error, message, wait), frames_taken)
        return
    try:
        value = lane.run(functools.partial(role.recv, None, wait), frames_taken)
    except SourceError:
        return
    if isinstance(value, DevicePart):
        hand_out(value, lane)


def _run(
    role: Role,
    tree: Any,
    device: torch.device | None,
    wait: datetime.timedelta | None,
    trim: bool = True,
) -> Any:
    """One frame on the role's lane, then handed out on this thread."""
    lane = role.group.lane
    frames_taken = functools.partial(getattr, role, "frames")  # read by the lane: no call in here
    if isinstance(role, Sender):
        send = functools.partial(role.send_batch, tree, device, wait, trim=trim)
        value = lane.run(send, frames_taken)
    else:
        value = lane.run(functools.partial(role.recv, device, wait), frames_taken)
        if value is END or value is CLOSE:
            raise SourceError(f"source rank {role.src} ended the stream where a batch was expected")
    return hand_out(value, lane) if isinstance(value, DevicePart) else value  # a host tree


# The (group, src) broadcast was last called with, under which default group, and its
# role: a training loop calls with the same arguments every step, and the lookup below
# (the group's ranks, tensorcast's state) is most of a tiny batch's cost on a receiver.
# Weak references: a destroyed group is not kept alive by it.
_last: tuple[Any, int, Any, Any, bool | None] | None = None


def _broadcast_role(
    group: Any,
    src: int,
    setup: datetime.timedelta | None = None,
    shm: bool | None = None,
    *,
    open_new: bool = True,
) -> Role | None:
    """The role of ``tc.broadcast`` over ``group`` from ``src``, set up on first use (None
    instead, with ``open_new=False``)."""
    global _last
    default = dist.distributed_c10d._get_default_group()
    last = _last
    if (
        last is not None
        and last[1] == src
        and last[4] is shm
        and last[2]() is default
        and (last[0] is None if group is None else last[0] is not None and last[0]() is group)
        and (hit := last[3]()) is not None
    ):
        return hit  # type: ignore[no-any-return]
    ranks = _mesh.group_ranks(group, src)
    world = _world(setup) if open_new else made_world()
    if world is None:  # no call made it yet: nothing is set up
        return None
    key = (ranks, src, shm)
    with _lock:
        roles = _roles.setdefault(world, {})
    role = roles.get(key)
    if role is None:
        if not open_new:
            return None
        what = f"tensorcast.broadcast(src={src})"
        # The call's timeout bounds this setup; later calls give their own for messages.
        role, _ = open_role(
            ranks_name(ranks), ranks, src, what, {"src": src}, setup_timeout=setup, shm=shm
        )
        with _lock:  # read whole by _meant_role
            roles[key] = role
    # The role too, weakly: it lives with its world, which goes with the default group.
    _last = (
        None if group is None else weakref.ref(group),
        src,
        weakref.ref(default),
        weakref.ref(role),
        shm,
    )
    return role


def broadcast_batch(
    batch: Any,
    device_mesh: Any,
    axes: Sequence[str] | str = ("cp", "tp"),
    *,
    device: torch.device | str | None = None,
    timeout: float | datetime.timedelta | None = None,
    trim: bool = True,
    shm: bool | None = None,
) -> Any:
    """Broadcast ``batch`` across this rank's ``(cp, tp)`` sub-mesh, from its first rank.

    The named axes present in ``device_mesh`` are flattened into one group per DP slot
    (tensorcast's own, made on the first call and reused). Returns ``batch`` itself, the
    very same object, when there is nothing to do: ``torch.distributed`` not initialized,
    ``device_mesh`` None, no named axis in the mesh, or every present named axis of size 1.
    A mesh without dimension names is a ``TypeError``; axes that miss a dimension of size
    > 1 they likely meant warn once per process (NOTE [ Axes that miss the mesh ]).

    Every rank of the mesh must make the first call together (it sets up the groups).
    ``timeout`` (seconds or a timedelta) bounds every wait of the call, the first call's
    setup included; None means the default process group's timeout. ``trim`` and ``shm``
    as for ``tc.broadcast`` (a ``TypeError`` unless a bool, or None for ``shm``, on every
    rank, no-op or not).
    """
    known = _known(functools.partial(_mesh_role, device_mesh, axes, shm))
    with _taking_part(known, timeout):
        check_trim(trim)
        wait = to_timedelta(timeout)
        check_shm(shm)
        names = _mesh.normalize_axes(axes)
        what = "tensorcast.broadcast_batch"
        if not distributed():  # the mesh's mistakes raise or warn all the same, as the loader's
            _mesh.present_axes(device_mesh, names, what=what, stacklevel=2)
            return batch
        if not _mesh.spanning_axes(device_mesh, names, what=what, stacklevel=2):
            return batch
        dev = output_device(device)
    if known is not None:
        return _run(known, batch, dev, wait, trim)
    # none yet for this world (``_mesh_role``): set up, then kept on the mesh
    role, _ = _mesh.mesh_role(device_mesh, names, what, {}, setup_timeout=wait, shm=shm)
    with _lock:
        cache: dict[Any, tuple[Any, Role]] = device_mesh.__dict__.setdefault(_ATTR, {})
        cache[(names, shm)] = (weakref.ref(_world()), role)
    return _run(role, batch, dev, wait, trim)


def _mesh_role(device_mesh: Any, axes: Sequence[str] | str, shm: Any) -> Role | None:
    """The role ``broadcast_batch`` has on ``device_mesh`` for ``axes``, if set up; where
    ``shm`` is itself wrong, the one set up for ``axes``, if there is one only
    (:func:`_meant_role`)."""
    names = _mesh.normalize_axes(axes)
    cache = vars(device_mesh).get(_ATTR, {})
    if _shm_ok(shm):
        hits = [cache.get((names, shm))]
    else:
        hits = [hit for (on, _), hit in cache.items() if on == names]
    if len(hits) != 1 or hits[0] is None or hits[0][0]() is not made_world():
        return None
    return hits[0][1]  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- arguments

_AVAILABLE = dist.is_available()  # fixed by how torch was built
_MAX_TIMEOUT_S = 10.0**9  # about 32 years: past it, a timedelta overflows
#: where output tensors may land
_OUTPUT_DEVICES = ("cpu", "cuda")


def distributed() -> bool:
    """Whether ``torch.distributed`` is built and initialized."""
    return _AVAILABLE and dist.is_initialized()


# The shortest timeout: the waits below count in milliseconds (a shorter one was 0, the
# default's, there).
_SHORTEST_S = 1e-3
_SHORTEST = datetime.timedelta(seconds=_SHORTEST_S)


def to_timedelta(timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    """A timeout in seconds (or a timedelta) as a timedelta; None stays None.

    Raises:
        ValueError: not a positive number of seconds.
    """
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        if not _SHORTEST <= timeout < datetime.timedelta(seconds=_MAX_TIMEOUT_S):
            raise ValueError(
                f"timeout must be a timedelta of 1 ms to {_MAX_TIMEOUT_S:.0e} s, got "
                f"{timeout!r} (None: the default process group's timeout)"
            )
        return timeout
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not _SHORTEST_S <= timeout < _MAX_TIMEOUT_S  # NaN too
    ):
        raise ValueError(
            f"timeout must be a positive number of seconds, 0.001 (1 ms: the waits' "
            f"resolution) or more, and finite, got {timeout!r} "
            f"(None: the default process group's timeout)"
        )
    return datetime.timedelta(seconds=timeout)


def check_src(src: Any) -> int:
    """``src`` as a plain int (a numpy integer too: it goes into the setup's JSON).

    Raises:
        TypeError: ``src`` is not an integer (a bool, a float, a str).
    """
    if isinstance(src, bool) or not isinstance(src, (int, np.integer)):
        raise TypeError(
            f"src must be an int, a global rank as in torch.distributed.broadcast, got "
            f"{type(src).__name__} {src!r}"
        )
    return int(src)


def _shm_ok(shm: object) -> bool:
    return shm is None or type(shm) is bool


def check_shm(shm: object) -> None:
    """``shm=`` is None, True or False.

    Raises:
        TypeError: anything else.
    """
    if not _shm_ok(shm):
        raise TypeError(f"shm must be None (automatic), True or False, got {shm!r}")


def output_device(device: torch.device | str | int | None) -> torch.device | None:
    """Where output tensors land: ``device`` normalised, a bare ``"cuda"`` meaning this
    rank's GPU: the one ``init_process_group(device_id=)`` bound, else the current one."""
    if device is None:
        return None
    dev = None if isinstance(device, numbers.Integral) else torch.device(device)  # ints: CUDA
    if dev is not None and dev.type not in _OUTPUT_DEVICES:  # before anything is sent
        raise ValueError(
            f"device={device!r}: a batch lands on the CPU or a CUDA device; pass device=None "
            f"(the group's transfer device), 'cpu' or 'cuda'"
        )
    if dev is not None and dev.type == "cuda" and dev.index is None and distributed():
        bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
        if bound is not None and bound.type == "cuda":
            return resolve_device(bound)
    return resolve_device(device)


def unpack_if_packed(batch: Any) -> Any:
    """A pre-packed batch rebuilt as a tree; anything else unchanged."""
    return unpack(batch) if isinstance(batch, Packed) else batch
