"""Fakes of the transport's seams, for tests: an in-memory wire and a counting store.

:class:`FakeWire` is an in-memory :class:`~tensorcast.transport.wire.Wire`: two ranks,
one process.

They ship with the transport, so tests and anyone extending the transport fake
the same interface the real wires implement, and pass it in instead of patching a wire::

    source_wire, receiver_wire = FakeWire.pair()
    sender = Sender(Group((0, 1), source_wire, Lane("0-1", source_wire.abort)), 0)

Messages are matched as gloo matches them: heads (a send and its receive) in their
order, payloads (broadcasts) in theirs. The source is group rank 0; its messages go at
once, and a receiver's arrives when it is waited for (run the receiver in a thread, as
it would run on its own rank).
"""

from __future__ import annotations

import datetime
import queue
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CountingStore", "FakeWire"]


class FakeWire:
    """One rank's end of two in-memory links, one for heads and one for payloads.

    Attributes:
        log: what the source posted, shared by both ends: ``(kind, nbytes)`` with kind
            ``"head"``, ``"payload"`` or ``"zeros"`` (a payload of zeros: a promise the
            frame did not keep).
        aborted: set by :meth:`abort`; every later post raises ``RuntimeError``.
        corrupt_next_payload: flip a bit of the next payload this end receives.
    """

    device = torch.device("cpu")
    size = 2

    def __init__(
        self, rank: int, links: dict[str, queue.Queue[bytes]], log: list[tuple[str, int]]
    ) -> None:
        self.rank = rank
        self._links = links
        self.log = log
        self.aborted = False
        self.corrupt_next_payload = False

    @classmethod
    def pair(cls) -> tuple[FakeWire, FakeWire]:
        """The source's end (group rank 0) and a receiver's (group rank 1), joined."""
        links: dict[str, queue.Queue[bytes]] = {"head": queue.Queue(), "payload": queue.Queue()}
        log: list[tuple[str, int]] = []
        return cls(0, links, log), cls(1, links, log)

    def head(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> _Posted:
        return self._post("head", tensor, root, timeout)

    def payload(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> _Posted:
        return self._post("payload", tensor, root, timeout)

    def abort(self) -> None:
        self.aborted = True

    def _post(
        self, what: str, tensor: torch.Tensor, root: int, timeout: datetime.timedelta
    ) -> _Posted:
        if self.rank == root:
            self._move(what, tensor, root, timeout)
            return _Posted(lambda: None)
        if self.aborted:
            raise RuntimeError("the group was aborted")
        return _Posted(lambda: self._move(what, tensor, root, timeout))

    def _move(
        self, what: str, tensor: torch.Tensor, root: int, timeout: datetime.timedelta
    ) -> None:
        if self.aborted:
            raise RuntimeError("the group was aborted")
        if self.rank == root:
            zeros = what == "payload" and tensor.numel() and not tensor.any()
            self.log.append(("zeros" if zeros else what, tensor.numel()))
            self._links[what].put(tensor.numpy().tobytes())
            return
        try:
            data = self._links[what].get(timeout=timeout.total_seconds())
        except queue.Empty:
            raise RuntimeError(f"no {what} within {timeout.total_seconds():g} s") from None
        if len(data) != tensor.numel():
            raise RuntimeError(f"message of {len(data)} bytes into {tensor.numel()}")
        tensor.numpy()[:] = memoryview(data)
        if what == "payload" and self.corrupt_next_payload:
            self.corrupt_next_payload = False
            tensor[0] ^= 1


class _Posted:
    def __init__(self, wait: Callable[[], None]) -> None:
        self._wait = wait

    def wait(self, timeout: datetime.timedelta) -> Any:
        self._wait()


class CountingStore:
    """A store that counts the requests made through it (one per call), for tests and
    benchmarks of what an agreement costs: ``CountingStore(store).requests``."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.requests = 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.requests += 1
            return method(*args, **kwargs)

        return counted
