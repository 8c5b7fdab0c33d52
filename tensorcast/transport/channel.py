"""A channel: one source and its receivers on one of tensorcast's groups.

A loader, a mesh's ``broadcast_batch`` and each ``(group, src)`` of ``broadcast`` own a
channel. Channels on the same ranks share one group and its lane, and every method
that communicates (:meth:`Channel.send_batch`, :meth:`send_end`, :meth:`send_close`,
:meth:`send_error`, :meth:`recv`) must run as a job on that lane (see NOTE [ One
ordered lane ]). Each frame is stamped with the channel's agreed id, its pass and its
step, so a receiver that is handed another channel's frame raises ``DesyncError``
instead of taking it.

:func:`open_channel` sets one up: agreement among the ranks of its group, then the group
(made on first use), then the channel.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorcast.codec import schema as _schema
from tensorcast.transport import groups as _groups
from tensorcast.transport import promise as _promise
from tensorcast.transport.device import DevicePart
from tensorcast.transport.diagnosis import diagnose, timed_out
from tensorcast.transport.frame import FRAMES_VERSION, Kind, Stamp
from tensorcast.transport.groups import Group, World
from tensorcast.transport.receiver import Receiver
from tensorcast.transport.sender import Outgoing, Sender

__all__ = ["Channel", "group_ranks", "open_channel"]


def group_ranks(group: Any, src: int) -> tuple[int, ...]:
    """The global ranks of ``group`` (None: every rank), sorted; ``src`` must be one."""
    if group is None:
        ranks = tuple(range(dist.get_world_size()))
    else:
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
    if src not in ranks:
        raise ValueError(
            f"src={src} is not a rank of the group (global ranks {list(ranks)}); src is a "
            f"global rank, as in torch.distributed.broadcast"
        )
    return ranks


class Channel:
    """One source (a *global* rank) and its peers on tensorcast's group over ``group.ranks``.

    Args:
        world: tensorcast's state for the default group.
        group: tensorcast's group the frames travel on.
        src: the source's global rank.
        channel_id: the number the ranks agreed on for this channel.
        timeout: how long a rank waits for one message; None means the default group's.
        verify: carry a CRC32 of every payload and check it on receivers.
        promises: promise payloads (NOTE [ Promised payloads ]); every rank must agree.
    """

    def __init__(
        self,
        world: World,
        group: Group,
        src: int,
        channel_id: int,
        *,
        timeout: datetime.timedelta | None = None,
        verify: bool = False,
        promises: bool = False,
    ) -> None:
        self.group = group
        self.src = src
        self.id = channel_id
        self.timeout = timeout or world.timeout
        self.rank = world.rank
        self.is_source = world.rank == src
        self.pass_index = 0
        self.step = 0
        root = group.local(src)
        self._world = world
        self._sender: Sender | None = None
        self._receiver: Receiver | None = None
        if self.is_source:
            self._sender = Sender(
                group, root, verify=verify, promises=promises, timeout=self.timeout
            )
            world.heartbeat.start(self.timeout.total_seconds())
            #: the context in which the heartbeat says this source is in ``next(source)``
            self.pulling = world.heartbeat.busy("next(source)", channel_id)
        else:
            self._receiver = Receiver(group, root, src, self._diagnose, promises=promises)

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.group.ranks

    def start_pass(self, pass_index: int) -> None:
        """Number the frames of a new pass; run as a job, like the frames."""
        self.pass_index = pass_index
        self.step = 0

    def _stamp(self) -> Stamp:
        return Stamp(self.id, self.pass_index, self.step)

    # -- source (jobs) -------------------------------------------------------------------

    def prepare(
        self, batch: Any, device: torch.device | None, timeout: datetime.timedelta | None = None
    ) -> tuple[Outgoing, Any]:
        """Everything before the first message of ``batch``'s frame: the frame, written,
        and this rank's own tree (see NOTE [ A frame is atomic ]), or its device part.

        Raises:
            UnsupportedLeafError, ValueError, HeaderError: the batch cannot travel.
        """
        if self.group.lane.broken is not None:
            self.group.lane.check()
        return self._source().data(batch, self._stamp(), device, timeout or self.timeout)

    def send(self, frame: Outgoing, timeout: datetime.timedelta | None = None) -> None:
        """Post a frame :meth:`prepare` made (or an END / ERROR frame).

        The frame is counted before its first message is posted: from here on, whatever
        escapes (a signal handler's exception when ``send`` returns included) finds the
        count moved and breaks the lane (``Lane.break_if_lost``), never a retry that
        would send the frame again (NOTE [ A frame is atomic ])."""
        sender = self._source()
        self.step += 1
        sender.send(frame, timeout or self.timeout)

    def send_batch(
        self, batch: Any, device: torch.device | None, timeout: datetime.timedelta | None = None
    ) -> Any:
        """Send ``batch`` and return this rank's own tree of it.

        A batch that cannot travel is announced with an ERROR frame, then raised.
        """
        try:
            frame, own = self.prepare(batch, device, timeout)
        except Exception as e:
            self.send_error(f"batch serialization failed: {type(e).__name__}: {e}", timeout)
            raise
        self.send(frame, timeout)
        return own

    def send_end(self, timeout: datetime.timedelta | None = None) -> None:
        self.group.lane.check()
        self.send(self._source().end(self._stamp()), timeout)

    def send_close(self, timeout: datetime.timedelta | None = None) -> None:
        """The pass was left early at this step (a loader's ``for ... break``)."""
        self.group.lane.check()
        self.send(self._source().close(self._stamp()), timeout)

    def send_error(self, message: str, timeout: datetime.timedelta | None = None) -> None:
        self.group.lane.check()
        self.send(self._source().error(message, self._stamp()), timeout)

    def _source(self) -> Sender:
        if self._sender is None:
            raise RuntimeError(f"this rank is not the source (rank {self.src}) of the channel")
        return self._sender

    # -- receivers (jobs) ----------------------------------------------------------------

    def _diagnose(self, stamp: Stamp, error: BaseException, timeout_s: float) -> str:
        """Why the source did not send the frame ``stamp`` (see ``transport.diagnosis``)."""
        world = self._world
        return diagnose(
            world.store,
            self.src,
            rank=world.rank,
            frame=(stamp.channel, stamp.pass_index, stamp.step),
            timeout_s=timeout_s,
            timed_out=timed_out(error),
        )

    def recv(
        self, device: torch.device | None, timeout: datetime.timedelta | None = None
    ) -> tuple[Kind, Any]:
        """The next frame from the source: ``(DATA, tree)``, ``(END, None)``,
        ``(CLOSE, None)`` or ``(ERROR, message)``."""
        if self.group.lane.broken is not None:
            self.group.lane.check()
        if self._receiver is None:
            raise RuntimeError(f"rank {self.src} is the source of this channel")
        try:
            return self._receiver.recv(self._stamp(), device, timeout or self.timeout)
        finally:
            # A frame refused once it was read whole (a bad CRC, bad values) was still
            # this step's: the stream goes on in step. A broken lane has no next step.
            if self.group.lane.broken is None:
                self.step += 1

    # -- the caller's thread ------------------------------------------------------------

    def hand_out(self, value: Any) -> Any:
        """What a job returned, as the caller gets it: a frame's device part is posted
        (if it was not yet) and taken for the caller's current stream (NOTE [ Device work
        at next() ]); anything else as it is. Only on the caller's thread, in lane order."""
        if isinstance(value, DevicePart):
            if self.group.lane.broken is not None:
                self.group.lane.check()
            return value.take()
        return value

    @staticmethod
    def post(value: Any) -> None:
        """Post a frame's device part ahead of its hand-out (a loader's ``prefetch``)."""
        if isinstance(value, DevicePart):
            value.post()

    @property
    def received_nbytes(self) -> int:
        """The payload bytes of the last batch :meth:`recv` returned."""
        return self._receiver.last_nbytes if self._receiver is not None else 0


def open_channel(
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
) -> tuple[Channel, dict[int, dict[str, Any]]]:
    """Agree on ``setup`` among ``group``, then open a channel on tensorcast's group over it.

    Args:
        scope: names the ranks that number their setups together (``ranks_name`` of a
            mesh's ranks, or of the group's); see NOTE [ Agreement before anything
            collective ].
        group: this rank's group: the source and its receivers (global ranks, in mesh
            order where there is a mesh).
        src: the source's global rank.
        what: names the thing in errors.
        setup: what must agree on every rank of ``group``; the format and frame versions
            are added, and whether payloads are promised.
        extra: what this rank tells the others (see :meth:`Agreement.agree`).
        timeout: the channel's wait for one message; None means the default group's.
        setup_timeout: bounds the agreement's waits and the group's creation; None means
            ``timeout``.
        first: for a mesh of several groups, its first rank and number of ranks (see
            :meth:`Agreement.agree`).

    Returns:
        The channel, and every rank's ``extra``.

    Raises:
        DesyncError: the ranks disagree, or one did not come within the timeout.
    """
    world = _groups.world()
    promises = _promise.enabled()
    full = {
        **setup,
        "format": _schema.FORMAT_VERSION,
        "frames": FRAMES_VERSION,
        "promises": promises,
    }
    wait = setup_timeout or timeout
    channel_id, extras = world.agreement.agree(
        scope, group, what, full, extra, first=first, timeout=wait
    )
    made = world.group(tuple(sorted(group)), wait)
    channel = Channel(
        world, made, src, channel_id, timeout=timeout, verify=verify, promises=promises
    )
    return channel, extras
