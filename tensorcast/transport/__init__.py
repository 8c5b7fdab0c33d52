"""The transport: frames on tensorcast's own process groups, in one order on every rank.

A *channel* is one source and its receivers on one of tensorcast's groups (``groups``:
one per set of ranks, made after an agreement through the c10d store, never the caller's
or the mesh's group). Everything that communicates on a group is a job on its *lane*
(``lane``): one FIFO, submitted only from the caller's thread at points that are the same
on every rank, so the model's collectives and tensorcast's can never pair up.

Each batch travels as one *frame*: a fixed-size first message (prefix, header and, when
it fits, the payload), then a spilled header and a separate payload where they did not
fit (``frame`` cuts it, the same pure function on both sides; ``promise`` may post the
payload with the first message). ``sender`` writes and posts a frame; ``receiver`` reads
it, validates it before allocating, and rebuilds the tree through the codec; ``wire`` is
the small per-backend interface the collectives sit behind (gloo, NCCL), ``pool`` the
reused buffers, ``liveness`` the source's heartbeat. On a GPU the lane's thread does host
work only: a frame's device side (the upload, the NCCL payload, the stream waits) is a
``device.DevicePart`` that ``staging`` makes and the caller's thread posts at ``next()``
(NOTE [ Device work at next() ]). This package imports the codec,
never the loader (``make lint`` checks it).
"""
