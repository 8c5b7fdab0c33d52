"""The entry points: ``broadcast``, ``broadcast_batch`` and ``BroadcastingDataLoader``.

``mesh`` reads a device mesh (which ranks share a batch, which one is their source, which
DP slot); ``broadcast`` sends one tree per call on a channel per ``(group, src)``;
``dataloader`` wraps a real loader on each DP slot's source rank, and ``steps`` runs one
pass's steps as lane jobs, ``prefetch`` of them ahead of the consumer. This package knows
nothing of byte layouts or frames: it hands trees to the transport and gets trees back.
"""
