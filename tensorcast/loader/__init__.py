"""The entry points: ``broadcast``, ``broadcast_batch`` and ``BroadcastingDataLoader``.

``mesh`` reads a device mesh (which ranks share a batch, which one is their source, which
DP slot) and opens this rank's role over them; ``broadcast`` sends one tree per call with
a role per ``(group, src)``; ``dataloader`` wraps a real loader on each DP slot's source
rank, ``passes`` runs one pass on the caller's thread and ``steps`` its steps as lane
jobs, ``prefetch`` of them ahead of the consumer; ``broadcast`` also checks the
arguments both entry points take. This package knows nothing of byte layouts or frames: it hands trees to a
role and gets back trees, ``END``, or ``SourceError``.
"""
