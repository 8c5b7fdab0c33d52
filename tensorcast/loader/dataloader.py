"""BroadcastingDataLoader: one real loader per DP slot, its batches broadcast to its peers.

Each step of a pass is one job on the lane of tensorcast's group over the sub-mesh (NOTE
[ One ordered lane ]): the source pulls ``next(source)`` and sends it, the receivers
receive it, and every rank yields the same batch (the path of one batch: ``docs/design.md``,
"One batch, top to bottom"); the end of the source ends the pass on every rank together.

``prefetch=k`` keeps k steps submitted ahead of the consumer: the pass's first ``next()``
submits k (``iter()`` itself does nothing yet), and each ``next()`` takes the oldest and
submits one more. Submissions happen only there, on the caller's thread, so every rank
runs the same steps in the same order; a loop broken on every rank after the same batch
leaves exactly k steps, which run on every rank, their batches dropped (NOTE [ Where a
pass ends ] in ``loader.passes``: each ``iter()`` is a pass of its own, and nothing ends
one from a finaliser or at exit). ``state_dict()`` then describes the position after the
last batch *yielded*, from a snapshot taken right after that batch was pulled from the
source.

It holds this rank's role (``transport.groups.open_role``) and knows nothing of byte
layouts or frames.
"""

from __future__ import annotations

import copy
import datetime
import gc
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorcast._errors import SourceError, describe
from tensorcast.loader import mesh as _mesh
from tensorcast.loader.broadcast import (
    check_shm,
    check_src,
    output_device,
    to_timedelta,
    unpack_if_packed,
)
from tensorcast.loader.passes import Ledger, NoOpPass, Pass, finish_queued
from tensorcast.loader.stats import WINDOW, LoaderStats, Recorder
from tensorcast.loader.steps import stateful
from tensorcast.transport import Packing, Role, open_role, ranks_name

__all__ = ["BroadcastingDataLoader"]

_TOLD_CHARS = 500  # of a source's len() failure, told to its peers at setup

_WHAT = "BroadcastingDataLoader"


class BroadcastingDataLoader:
    """Iterate a loader on one source rank per DP slot; every peer gets the same batches.

    Every rank of the mesh (or group) builds it together: the ranks agree on their setup
    then, and learn the source's length.

    Args:
        source: the real loader (any iterable) on the source rank; ``None`` on the others
            (a loader passed on a receiver is never iterated).
        device_mesh: a ``DeviceMesh`` whose ``axes`` span the ranks that share batches.
        axes: the mesh dimensions to broadcast across.
        prefetch: how many batches are broadcast ahead of the consumer; 0 = none.
        device: where output tensors land (default: the group's transfer device).
        group: instead of a mesh, the ranks that share batches (a process group; nothing
            travels on it)...
        src: ...and the *global* rank of their source.
        timeout: seconds (or a timedelta) any rank waits for one message before raising
            ``PeerError``; None means the default process group's timeout.
        verify: carry a CRC32 of every buffer and check it on receivers.
        log_every: on the source rank, log ``stats()``'s last ``log_every`` steps every
            ``log_every`` steps (``logging``, logger ``"tensorcast"``, level INFO).
        align: every leaf's offset in a batch's buffer is a multiple of this (a power of
            two), as in ``tc.pack``; 1 packs many tiny leaves tightest. Used on the
            source rank (receivers read the offsets from each header), so the ranks need
            not agree on it.
        trim: padding never travels, as in ``tc.pack`` (source rank); False: leaves whole.
        shm: ranks on the source's host read payloads from shared memory, as in
            ``tc.broadcast`` (None: where they can; False: never; True: required).

    Raises:
        ValueError: on a source rank whose ``source`` is None (and on its receivers); on
            bad arguments (``align``: as ``tc.pack`` raises).
        DesyncError: the ranks' setups disagree (axes, mesh, source, prefetch, version).
        TypeError: ``device_mesh`` has no dimension names; ``shm`` is not None or a bool.
        RuntimeError: at ``iter()``, when built before ``init_process_group`` and iterated
            in a group of more than one rank.

    Warns:
        UserWarning: none of ``axes`` is in the mesh, which has another dimension of size
            > 1 that is not data- or pipeline-parallel (once per process).
    """

    def __init__(
        self,
        source: Iterable[Any] | None = None,
        device_mesh: Any = None,
        axes: Sequence[str] | str = ("cp", "tp"),
        prefetch: int = 1,
        device: torch.device | str | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        src: int | None = None,
        timeout: float | datetime.timedelta | None = None,
        verify: bool = False,
        log_every: int | None = None,
        align: int = 64,
        trim: bool = True,
        shm: bool | None = None,
    ) -> None:
        if type(prefetch) is not int or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        if log_every is not None and (type(log_every) is not int or log_every < 1):
            raise ValueError(f"log_every must be an int >= 1 or None, got {log_every!r}")
        if device_mesh is not None and group is not None:
            raise ValueError("pass either device_mesh= or group= (with src=), not both")
        if (group is None) != (src is None):
            raise ValueError(
                "group= and src= go together: src is the group's source, a global rank"
            )
        self._packing = Packing(align=align, trim=trim)  # checked on every rank, before the setup
        check_shm(shm)
        self._shm = shm
        self.source = source
        self.prefetch = prefetch
        self.device = output_device(device)
        self.axes = _mesh.normalize_axes(axes)
        self._role: Role | None = None
        self._passes = 0
        #: each pass made by iter() (its number, the iterator), held weakly
        self._iters: list[tuple[int, weakref.ReferenceType[Any]]] = []
        self._ledger = Ledger()  # what its passes leave: the state, who draws
        self._length: int | None = None
        self._warned = self._warned_workers = False
        self._log_every = log_every
        self._stats = Recorder()  # the current pass's; NOTE [ Where a step's time goes ]
        if device_mesh is not None:  # TypeError for an unnamed mesh; axes that miss it warn
            _mesh.present_axes(device_mesh, self.axes, what=_WHAT, stacklevel=2)
        # Decided here, checked at iter(): a loader built before init_process_group
        # would otherwise iterate as a no-op on every rank (see _check_still_no_op).
        self._built_without_group = not (dist.is_available() and dist.is_initialized())
        if not self._built_without_group:
            self._open(device_mesh, group, src, to_timedelta(timeout), verify)

    def _open(
        self,
        device_mesh: Any,
        group: dist.ProcessGroup | None,
        src: int | None,
        timeout: datetime.timedelta | None,
        verify: bool,
    ) -> None:
        """Agree with the peers and open this rank's role; stays a no-op where nothing spans."""
        setup = {"prefetch": self.prefetch, "verify": verify}
        extra, failed = _length_told(self.source)
        what = _WHAT
        if group is not None and src is not None:
            src = check_src(src)
            ranks = _mesh.group_ranks(group, src)
            if len(ranks) == 1:
                return
            setup["src"] = src
            self._role, extras = open_role(
                ranks_name(ranks), ranks, src, what, setup, extra=extra, timeout=timeout,
                verify=verify, packing=self._packing, shm=self._shm,
            )  # fmt: skip
        elif _mesh.spanning_axes(device_mesh, self.axes):
            self._role, extras = _mesh.mesh_role(
                device_mesh, self.axes, what, setup, extra=extra, timeout=timeout,
                verify=verify, packing=self._packing, shm=self._shm,
            )  # fmt: skip
        else:
            return
        self._length = _told_length(extras[self._role.src], self._role, failed)

    # -- iteration -----------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """A new pass over the source, of its own (NOTE [ Where a pass ends ]): a second
        ``iter()`` never silently ends the first, and ``zip(loader, loader)`` yields pairs
        (over a source that hands out one iterator, the first pass raises instead)."""
        role = self._role
        self._passes += 1
        self._iters = [(n, ref) for n, ref in self._iters if ref() is not None]
        run: Pass | NoOpPass
        if role is None:
            self._check_still_no_op()
            self._stats = Recorder(self._log_every)
            source = self.source if self.source is not None else ()
            run = NoOpPass(self._passes, source, self._stats, unpack_if_packed)
        else:
            self._stats = Recorder(self._log_every if role.is_source else None)
            # The ledger's state stays the last batch yielded until this pass starts: the
            # source's own runs ahead by the steps a dropped pass queued.
            run = Pass(
                role, self._passes, source=self.source, prefetch=self.prefetch,
                device=self.device, ledger=self._ledger, stats=self._stats,
            )  # fmt: skip
        # Held weakly: a pass the program drops is gone (it needs nothing more).
        self._iters.append((self._passes, weakref.ref(run)))
        return run

    def _check_still_no_op(self) -> None:
        """A loader built before ``init_process_group`` is a no-op; iterated once there is a
        group of more than one rank it would hand every rank its own batches (or none)."""
        if not self._built_without_group or not (dist.is_available() and dist.is_initialized()):
            return
        world = dist.get_world_size()
        if world > 1:
            raise RuntimeError(
                f"this BroadcastingDataLoader was built before "
                f"torch.distributed.init_process_group() (so it is a no-op), and is iterated "
                f"on rank {dist.get_rank()} of a group of {world}: every rank would iterate "
                f"its own source and peers would train on different batches. Build the "
                f"loader after init_process_group(), on every rank together"
            )

    def stats(self, last: int = 100) -> LoaderStats:
        """Where this rank's pass so far spent its time, and its last ``last`` steps.

        Args:
            last: the steps ``.recent`` covers (at most 1000).

        Raises:
            ValueError: ``last`` is not an int from 1 to 1000.
        """
        if type(last) is not int or not 1 <= last <= WINDOW:
            raise ValueError(f"last must be an int from 1 to {WINDOW}, got {last!r}")
        return self._stats.stats(last)

    # -- length, epochs and checkpoints ----------------------------------------------

    def __len__(self) -> int:
        if self._role is None:  # no-op: len(source) itself
            length = 0 if self.source is None else _length(self.source)
            if length is None:
                raise TypeError(f"the source, a {type(self.source).__name__}, has no len()")
            return length
        if self._length is None:
            raise TypeError(
                f"the source loader on rank {self._role.src} has no len(); every rank of "
                f"its group learns the end of a pass when the source stops"
            )
        return self._length

    @property
    def is_source(self) -> bool:
        """Whether this rank iterates the real loader."""
        return self._role is None or self._role.is_source

    @property
    def sampler(self) -> Any:
        """The source's sampler on the source rank, or the source itself where it is a
        sampler (it has ``set_epoch`` and no sampler of its own: a lhotse sampler), so that
        a framework's ``loader.sampler.set_epoch`` reaches it; None elsewhere."""
        return _sampler_of(self.source) if self.is_source else None

    @property
    def batch_sampler(self) -> Any:
        """The source's batch sampler on the source rank; None elsewhere."""
        return getattr(self.source, "batch_sampler", None) if self.is_source else None

    def set_epoch(self, epoch: int) -> None:
        """Forward ``set_epoch`` to the source, or to its (batch) sampler (source rank only)."""
        if not self.is_source:
            return
        for target in (self.source, self.batch_sampler, self.sampler):
            fn = getattr(target, "set_epoch", None)
            if callable(fn):
                fn(epoch)
                return

    def state_dict(self) -> dict[str, Any]:
        """The source's state after the last batch yielded; ``{}`` on receivers.

        Delegates to the source, or to its batch sampler or sampler when it has no state of
        its own (exact with ``num_workers=0``: DataLoader workers read ahead of it, and a
        ``UserWarning``, once, says so; ``StatefulDataLoader`` is the exact path there).
        """
        if not self.is_source:
            return {}
        target = stateful(self.source)
        if target is None:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"nothing under this BroadcastingDataLoader has a state_dict() (source "
                    f"{type(self.source).__name__}); a resume from this checkpoint restarts "
                    f"the pass from its first batch",
                    UserWarning,
                    stacklevel=2,
                )
            return {}
        workers = getattr(self.source, "num_workers", None)
        if target is not self.source and isinstance(workers, int) and workers > 0:
            self._warn_workers_read_ahead(target, workers)
        if self._ledger.state is not None:
            # A copy: a sampler's load_state_dict may consume the dict it is given (lhotse's
            # do), and this snapshot must describe the position for every later call too.
            return copy.deepcopy(self._ledger.state)  # type: ignore[no-any-return]
        return target.state_dict()  # type: ignore[no-any-return]

    def _warn_workers_read_ahead(self, target: Any, workers: int) -> None:
        if self._warned_workers:
            return
        self._warned_workers = True
        warnings.warn(
            f"this BroadcastingDataLoader's state is its source's {type(target).__name__} "
            f"(the source, a {type(self.source).__name__}, has no state_dict()), and with "
            f"num_workers={workers} the sampler runs ahead of the batches yielded: a resume "
            f"from this checkpoint will skip batches. For an exact resume use "
            f"torchdata.stateful_dataloader.StatefulDataLoader as the source (a drop-in "
            f"for DataLoader), or num_workers=0",
            UserWarning,
            stacklevel=3,
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the source's position (source rank only; a no-op elsewhere). Call it
        before ``iter()``, on every rank: a pass that the program dropped (a ``break``) is
        no obstacle, and every step queued on these ranks (its steps among them) is waited
        for first, so that the next pass starts where ``state_dict`` says.

        Raises:
            RuntimeError: a pass of this loader is open (started by ``next()``, not ended,
                its iterator alive), on every rank alike.
        """
        _refuse_while_open(self._iters)
        if self._role is not None:
            lane = self._role.group.lane
            error = finish_queued(lane)  # waits only: nothing is queued
            if error is not None and lane.broken:
                raise error
        self._ledger.state = None
        target = stateful(self.source) if self.is_source else None
        if target is not None and hasattr(target, "load_state_dict"):
            target.load_state_dict(copy.deepcopy(state_dict))  # the caller's stays whole

    def __repr__(self) -> str:
        if self._role is None:
            return f"BroadcastingDataLoader(no-op, source={type(self.source).__name__})"
        what = "source" if self._role.is_source else "receiver"
        return (
            f"BroadcastingDataLoader({what}, group ranks={list(self._role.ranks)}, "
            f"src={self._role.src}, prefetch={self.prefetch})"
        )


def _refuse_while_open(iters: list[tuple[int, weakref.ReferenceType[Any]]]) -> None:
    """Raise while one of a loader's passes ``iters`` is open. Whether one is depends on
    when the collector last ran on this rank: a pass dropped in a reference cycle looks
    alive until then. So a collection decides first, and every rank decides alike."""
    if not any(_is_open(ref()) for _, ref in iters):
        return
    gc.collect()
    for index, ref in iters:
        if _is_open(ref()):
            raise RuntimeError(
                f"load_state_dict() was called while pass {index} of this "
                f"BroadcastingDataLoader is open (started by next(), not ended, its iterator "
                f"alive): it would move the source under that pass. Call load_state_dict() "
                f"before iter(), or once the pass has ended or its iterator is closed or dropped"
            )


def _is_open(run: Pass | NoOpPass | None) -> bool:
    """Whether ``run``, a pass (None once dropped), is open."""
    return run is not None and run.open


def _sampler_of(source: Any) -> Any:
    """``source.sampler``, or ``source`` itself where it is a sampler: it has ``set_epoch``
    and neither a sampler nor a batch sampler of its own."""
    own = getattr(source, "sampler", None)
    if own is None and getattr(source, "batch_sampler", None) is None:
        return source if callable(getattr(source, "set_epoch", None)) else None
    return own


def _length_told(source: Any) -> tuple[dict[str, Any], Exception | None]:
    """What a rank tells its peers of its source at setup: its length (None: it has none),
    or how ``len(source)`` failed, so that the peers fail now, not at their timeout; and
    that failure. Nothing for a rank without a source."""
    if source is None:
        return {}, None
    try:
        return {"length": _length(source)}, None
    except Exception as e:
        return {"length": None, "length failed": describe(e)[:_TOLD_CHARS]}, e


def _told_length(told: dict[str, Any], role: Role, failed: Exception | None) -> int | None:
    """The length of the source, as its rank ``told`` it; raises what it told went wrong
    (the source rank its own error, ``failed``)."""
    ranks = list(role.ranks)
    if "length failed" in told:
        if failed is not None and role.is_source:
            raise failed
        raise SourceError(
            f"the source loader on rank {role.src} (group ranks {ranks}) failed in "
            f"len(source): {told['length failed']}. Fix its __len__, or give it none: a "
            f"TypeError or NotImplementedError from len() means the source has no length"
        )
    if "length" not in told:
        raise ValueError(
            f"rank {role.src} is the source of its group (global ranks {ranks}) but its "
            f"source is None; build the real loader there, e.g. "
            f"source=loader if tensorcast.is_dp_source_rank(mesh) else None"
        )
    return told["length"]  # type: ignore[no-any-return]


def _length(source: Any) -> int | None:
    """``len(source)``, or None where the source has no length: no ``__len__``, an
    ``IterableDataset``'s ``DataLoader`` (``TypeError``), or a ``__len__`` that says so with
    ``NotImplementedError`` (as Lightning reads it too)."""
    try:
        return len(source)
    except (TypeError, NotImplementedError):
        return None
