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
next() ]), made by ``staging`` on the lane's thread. ``docs/design.md``, "One
batch, top to bottom", follows one batch through them. This package imports the codec,
never the loader (``make lint`` checks it).
"""
