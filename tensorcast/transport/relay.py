"""Which arena of the shared-memory lane each rank of a channel writes or reads, decided
alike on every rank from what each told at the setup agreement (:func:`told`,
:func:`open_side`); and several hosts: a payload crosses the wire once per remote host,
and reaches that host's other ranks through the shared-memory arena of one rank there,
its *leader*.

# NOTE [ Several hosts ]
A channel whose ranks are on several hosts (``agreement.host_id``), at least one of
which holds two of them, is *relayed*: every rank reads the hosts every rank told at the
setup agreement and makes the same :class:`Route`, so no more is agreed. The first
message still goes from the source to every rank on the group's ordered lane; only a
payload that does not ride in it moves otherwise, on the same group, one rank to another
(``GlooWire.send``/``recv``, a tag of its own):

==============================  =============================================================
rank                            where its payload comes from
==============================  =============================================================
the source's host               the source's arena when the frame says SHM (as on one host),
                                else a send from the source
a remote host's leader          a send from the source, received into a slot of the leader's
(its lowest rank)               own arena (a pooled buffer when none is free); it then sends
                                each of its host's others the slot's Ref (16 bytes, zeros
                                for none), and the payload itself when there is no slot
the other ranks of that host    the Ref from their leader: the leader's arena, else a send
                                from the leader
==============================  =============================================================

So the payload crosses the network once per remote host, and each host holds it once.
The leader's arena is the source's, in the leader's process (``shm.Writer``: its slots,
their release, the cap, the warning). No group is made for the route: the messages are
point-to-point on the channel's own group, in the frame's lane job on each rank, in
one order per pair (the source to a leader: the first message, then the payload; a
leader to its host's others: the Ref, then the payload if it is not in a slot). A
follower's wait for its leader is bounded by the frame's timeout as any receive is, and
a leader or follower that dies breaks the others' lanes (``PeerError``) as a receiver of
the wire does. The Ref leaves the leader after its receive of the payload has completed
and before its send of the Ref: the memory ordering of NOTE [ Shared-memory slots ] for
the source's arena holds for the leader's. Promised payloads are off on such channels
(each rank would need the payload's size before its first message, and only leaders and
the source's host take it from the source). Trimming stays on: the wire still carries
the payload to remote hosts.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from tensorcast._errors import PeerError
from tensorcast.transport import shm as _shm
from tensorcast.transport.agreement import host_id
from tensorcast.transport.pool import BufferPool

if TYPE_CHECKING:
    from tensorcast.transport.groups import Group

__all__ = ["Relay", "Route", "arena", "open_side", "reader", "told", "why_not", "writer"]


class _PointToPoint(Protocol):
    """What a relayed channel's wire does beside heads (``GlooWire``'s)."""

    def send(self, tensor: torch.Tensor, peers: tuple[int, ...]) -> Any: ...

    def recv(self, tensor: torch.Tensor, peer: int) -> Any: ...


@dataclass(frozen=True, slots=True)
class Route:
    """How one rank of a relayed channel moves its payloads (group-local ranks).

    Attributes:
        leaders: on the source: a rank of each remote host, which takes the payload.
        near: on the source: the receivers on its host (sent the payload when the frame's
            payload is not in the source's arena).
        upstream: on a receiver: the rank its payload comes from (the source, or its
            host's leader).
        near_source: on a receiver: on the source's host.
        leads: on a receiver: it is its remote host's leader.
        followers: on a leader: its host's other ranks.
    """

    leaders: tuple[int, ...] = ()
    near: tuple[int, ...] = ()
    upstream: int = -1
    near_source: bool = False
    leads: bool = False
    followers: tuple[int, ...] = ()


class Relay:
    """This rank's part of a relayed channel (NOTE [ Several hosts ]): its :class:`Route`,
    and the arena it writes as a leader (``writer``) or reads (``reader``). ``ranks``: the
    group's global ranks, in the order the route's indices count them."""

    def __init__(
        self,
        route: Route,
        writer: _shm.Writer | None,
        reader: _shm.Reader | None,
        ranks: Sequence[int],
    ) -> None:
        self.route = route
        self.writer = writer
        self.reader = reader
        self.ranks = tuple(ranks)
        #: what this rank's last wait of a frame was, for the error when it fails: the
        #: peer it waited on is not always the source (a host's leader, its followers)
        self.doing = ""

    def send(self, wire: Any, payload: torch.Tensor, in_slot: bool) -> Any:
        """On the source: post ``payload`` to the leaders, and to its host's receivers
        unless it is in the source's arena (``in_slot``)."""
        route = self.route
        peers = route.leaders if in_slot else route.leaders + route.near
        return cast(_PointToPoint, wire).send(payload, peers)

    def receive(
        self,
        wire: Any,
        pool: BufferPool,
        ref: _shm.Ref | None,
        nbytes: int,
        timeout: datetime.timedelta,
    ) -> tuple[torch.Tensor, bool]:
        """On a receiver: the frame's payload of ``nbytes`` bytes and whether it was read
        from shared memory; ``ref`` is the source's slot when the frame says SHM."""
        p2p, route = cast(_PointToPoint, wire), self.route
        self.doing = ""
        if route.near_source and ref is not None:
            return _read(self.reader, ref, nbytes, route.upstream), True
        if route.near_source or route.leads:
            return self._lead(p2p, pool, nbytes, timeout), False
        leader = self.ranks[route.upstream]
        self.doing = f"receiving the rest of a frame from this host's leader, rank {leader}"
        message = torch.empty(_shm.REF_SIZE, dtype=torch.uint8)
        p2p.recv(message, route.upstream).wait(timeout)
        mem = message.numpy().data
        if any(mem):
            return _read(self.reader, _shm.Ref.unpack(mem, 0), nbytes, route.upstream), True
        payload = pool.take(nbytes, torch.device("cpu"))
        p2p.recv(payload, route.upstream).wait(timeout)
        return payload, False

    def _lead(
        self, p2p: _PointToPoint, pool: BufferPool, nbytes: int, timeout: datetime.timedelta
    ) -> torch.Tensor:
        """The payload from the source, and on a leader its fan-out to its host."""
        writer, followers = self.writer, self.route.followers
        slot = writer.take(nbytes) if writer is not None and nbytes >= _shm.MIN_PAYLOAD else None
        payload = pool.take(nbytes, torch.device("cpu")) if slot is None else slot.into
        p2p.recv(payload, self.route.upstream).wait(timeout)
        seen = payload if slot is None else slot.seen  # its tree's own (shm: Private views)
        if not followers:
            return seen
        message = torch.zeros(_shm.REF_SIZE, dtype=torch.uint8)
        if slot is not None:
            slot.ref.pack_into(message.numpy().data, 0)
            assert writer is not None
            writer.sent(slot.ref)
        ranks = [self.ranks[f] for f in followers]
        self.doing = f"passing the rest of a frame on to this host's ranks {ranks}, as their leader"
        posted = [p2p.send(message, followers)]
        if slot is None:
            posted.append(p2p.send(payload, followers))
        for each in posted:
            each.wait(timeout)
        return seen

    def close(self) -> None:
        """The lane broke: unlink what this rank's arena holds, and sweep what a dead
        writer of the arena it reads left."""
        if self.writer is not None:
            self.writer.close()
        if self.reader is not None:
            self.reader.sweep()


def _read(reader: _shm.Reader | None, ref: _shm.Ref, nbytes: int, writer: int) -> torch.Tensor:
    if reader is None:
        raise PeerError("a payload in shared memory on a rank that reads no arena")
    try:
        return reader.payload(ref, nbytes)
    except OSError as e:
        raise PeerError(
            f"the shared-memory segment of group rank {writer} is gone (it exited?): {e}"
        ) from e


def open_side(
    shm: bool | None,
    group: Group,
    src: int,
    rank: int,
    extras: dict[int, dict[str, Any]],
    what: str,
) -> tuple[_shm.Writer | _shm.Reader | None, Relay | None]:
    """This rank's side of the shared-memory lane of a channel on ``group`` from ``src``
    (:func:`arena` on one host) and, where the channel is relayed (NOTE [ Several hosts ]), its
    :class:`Relay`; alike on every rank, from what every rank told (:func:`told`).

    Raises:
        ValueError: ``shm=True`` where the lane cannot be, saying why.
    """
    ranks, host_wire = group.ranks, group.wire.streams is None
    order = sorted(ranks)
    wrong = [r for r in order if extras[r].get("shm_error")]
    if wrong:  # a setting one rank cannot read: every rank says so, at once
        raise ValueError(f"{what}: on rank {wrong[0]}: {extras[wrong[0]]['shm_error']}")
    hosts: dict[str, list[int]] = {}
    if shm is not False and host_wire:
        for r in order:
            hosts.setdefault(str(extras[r]["host"]), []).append(r)
    if len(hosts) < 2 or all(len(on) == 1 for on in hosts.values()):
        return arena(shm, ranks, src, rank, extras, host_wire, what), None
    unable = [r for r in order if extras[r]["shm_why_not"]]
    if unable:
        if shm:
            why = extras[unable[0]]["shm_why_not"]
            raise ValueError(f"{what}: shm=True, but on rank {unable[0]}: {why}")
        return None, None
    local = order.index
    home = hosts[str(extras[src]["host"])]
    near = [r for r in home if r != src]
    leaders = [on[0] for on in hosts.values() if on is not home]
    if rank == src:
        route = Route(leaders=tuple(map(local, leaders)), near=tuple(map(local, near)))
        writer = _writer(extras, src, near) if near else None
        return writer, Relay(route, None, None, order)
    if rank in near:
        reader = _shm.Reader(extras[src]["shm_token"], near.index(rank))
        return reader, Relay(Route(upstream=local(src), near_source=True), None, reader, order)
    on = hosts[str(extras[rank]["host"])]
    if rank == on[0]:
        followers = on[1:]
        writer = _writer(extras, rank, followers) if followers else None
        route = Route(upstream=local(src), leads=True, followers=tuple(map(local, followers)))
        return None, Relay(route, writer, None, order)
    reader = _shm.Reader(extras[on[0]]["shm_token"], on.index(rank) - 1)
    return reader, Relay(Route(upstream=local(on[0])), None, reader, order)


def told(source: bool, extra: dict[str, Any] | None, shm: bool | None) -> dict[str, Any] | None:
    """What this rank tells the others at the setup agreement: ``extra``, and for the lane
    (unless ``shm`` is False) its host, why it cannot use the lane (empty: it can), and the
    token of the arena it would write."""
    if shm is False:
        return extra
    why, error = _shm.available() or "", ""
    try:  # read on every rank: any may write an arena (a host's leader)
        cap = _shm.limit()
    except ValueError as e:  # told, so that every rank raises it (:func:`open_side`)
        cap, error = 0, str(e)
    if source and not why and cap == 0:
        why = _shm.no_room()
    # every rank's token: a rank may lead its host's arena (NOTE [ Several hosts ])
    return {
        **(extra or {}), "host": host_id(), "shm_why_not": why, "shm_error": error,
        "shm_token": _shm.new_token(),
    }  # fmt: skip


def writer(side: _shm.Writer | _shm.Reader | None) -> _shm.Writer | None:
    """The arena this rank writes, of its side (:func:`open_side`)."""
    return side if isinstance(side, _shm.Writer) else None


def reader(side: _shm.Writer | _shm.Reader | None) -> _shm.Reader | None:
    """The arena this rank reads, of its side (:func:`open_side`)."""
    return side if isinstance(side, _shm.Reader) else None


def why_not(
    shm: bool | None,
    ranks: Sequence[int],
    src: int,
    extras: dict[int, dict[str, Any]],
    host_wire: bool,
) -> str | None:
    """Why a channel over ``ranks`` from ``src`` does not use the lane (None: it does),
    decided alike on every rank from what every rank told (:func:`told`)."""
    if shm is False:
        return "shm=False"
    if not host_wire:
        return "payloads travel on GPUs (an NCCL group): the lane is for host payloads"
    host = extras[src]["host"]
    away = [r for r in ranks if extras[r]["host"] != host]
    if away:
        return (
            f"ranks {away} are not on the source rank {src}'s host (boot id and host name, "
            f"or TENSORCAST_HOST_ID, differ)"
        )
    for r in ranks:
        if extras[r]["shm_why_not"]:
            return f"on rank {r}: {extras[r]['shm_why_not']}"
    return None


def arena(
    shm: bool | None,
    ranks: Sequence[int],
    src: int,
    rank: int,
    extras: dict[int, dict[str, Any]],
    host_wire: bool,
    what: str,
) -> _shm.Writer | _shm.Reader | None:
    """This rank's side of a one-host channel's lane (the source's ``shm.Writer``, a
    receiver's ``shm.Reader``), or None where the channel has none (:func:`why_not`).

    Raises:
        ValueError: ``shm=True`` where the lane cannot be, saying why (on every rank alike).
    """
    why = why_not(shm, ranks, src, extras, host_wire)
    if why is not None:
        if shm:
            raise ValueError(f"{what}: shm=True, but the shared-memory lane cannot be used: {why}")
        if rank == src and why == f"on rank {src}: {_shm.NO_FREE_SPACE}":  # too little room
            _shm.warn_wire(f"{_shm.NO_FREE_SPACE}, so payloads travel over the wire: {_shm.FIX}")
        return None
    readers = [r for r in sorted(ranks) if r != src]
    if not readers:
        return None
    if rank == src:
        return _writer(extras, src, readers)
    return _shm.Reader(extras[src]["shm_token"], readers.index(rank))


def _writer(extras: dict[int, dict[str, Any]], rank: int, readers: Sequence[int]) -> _shm.Writer:
    """The arena ``rank`` writes for ``readers`` (each reader's index, its place there)."""
    tokens = [extras[r]["shm_token"] for r in readers]
    return _shm.Writer(extras[rank]["shm_token"], len(readers), _shm.limit(), tokens)
