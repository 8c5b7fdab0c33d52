"""The transport: frames on tensorcast's own process groups, in one order on every rank.

A *channel* is one source and its receivers on one of tensorcast's groups (``groups``:
one per set of ranks, made after an agreement through the c10d store, never the caller's
or the mesh's group); ``groups.open_role`` opens one and returns this rank's *role* in it,
a ``sender.Sender`` or a ``receiver.Receiver``, which the entry points hold. Everything
that communicates on a group is a job on its *lane* (``lane``): one FIFO, submitted only
from the caller's thread at points that are the same on every rank, so the model's
collectives and tensorcast's can never pair up; at interpreter exit nothing is submitted,
and ``exits`` stops the lanes' threads and the others (NOTE [ Interpreter exit ]).

Each batch travels as one *frame* (``frame``: its prefix, how both sides cut it into
messages, and the promise rule), through the codec's face (``tensorcast.codec``) on each
end. ``wire`` is the small per-backend interface the collectives sit behind (gloo,
NCCL), ``pool`` the memory handed out and reused under one rule (buffers, first
messages, the views they keep, rebuilt trimmed leaves), ``liveness`` and
``diagnosis`` the source's heartbeat and what a receiver says of a silent source, and
``device`` a frame's GPU side, posted and taken by the caller (NOTE [ Device work at
next() ]), made by ``staging`` on the lane's thread; ``shm`` the shared-memory arena of
ranks on one host, ``relay`` the route of a channel spread over hosts. ``docs/design.md``, "One
batch, top to bottom", follows one batch through them. This package imports the codec,
never the loader (``make lint`` checks it).

The names below are the transport's face: what the entry points (``tensorcast.loader``)
use of it, and all they may import (``make lint`` checks that too). Opening a role
(:func:`open_role`, on the :class:`World` that :func:`world` returns, each channel named
by :func:`ranks_name`), the roles themselves (:class:`Sender` with its :class:`Packing`,
:class:`Receiver`, which returns :data:`END` or :data:`CLOSE` besides batches, and the
:class:`Stamp` of each frame), a step's :class:`Job` on the lane, the device side of a
batch (:class:`DevicePart`, :func:`post`, :func:`hand_out`), and the interrupt points'
seam (:data:`interrupt_points`, NOTE [ Interrupts ]).
"""

from __future__ import annotations

from tensorcast.transport.agreement import ranks_name
from tensorcast.transport.device import DevicePart, hand_out, post
from tensorcast.transport.frame import Stamp
from tensorcast.transport.groups import Role, World, made_world, open_role, world
from tensorcast.transport.interrupts import points as interrupt_points
from tensorcast.transport.lane import Job, Lane
from tensorcast.transport.receiver import CLOSE, END, End, Receiver
from tensorcast.transport.sender import Packing, Sender

__all__ = [
    "CLOSE",
    "END",
    "DevicePart",
    "End",
    "Job",
    "Lane",
    "Packing",
    "Receiver",
    "Role",
    "Sender",
    "Stamp",
    "World",
    "hand_out",
    "interrupt_points",
    "made_world",
    "open_role",
    "post",
    "ranks_name",
    "world",
]
