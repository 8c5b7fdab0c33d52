"""A source's and a receiver's :class:`Pass` over a fake wire, and the sources they run:
shared by the loader's passes and steps tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tensorcast.loader.passes import Ledger, Pass
from tensorcast.loader.stats import Recorder
from tensorcast.transport import Receiver, Sender
from tensorcast.transport.testing import fake_roles


def batch(i: int) -> dict[str, Any]:
    return {"x": torch.arange(6.0) + i, "audio": torch.full((70_000,), float(i)), "i": i}


class Counter:
    """A resumable source of ``n`` batches that fails at ``fail_at`` (if given)."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at, self.pos = n, fail_at, 0
        self.error = ValueError("shard 3 is corrupt")

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.pos < self.n:
            if self.pos == self.fail_at:
                raise self.error
            self.pos += 1
            yield batch(self.pos - 1)

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}


def roles() -> tuple[Sender, Receiver]:
    return fake_roles(5, idle_exit_s=0.2)


def passes(source: Any, prefetch: int, index: int = 1) -> tuple[Pass, Pass, Ledger]:
    sender, receiver = roles()
    ledger = Ledger()

    def make(role: Any, source: Any, ledger: Ledger) -> Pass:
        return Pass(
            role, index, source=source, prefetch=prefetch, device=None, ledger=ledger,
            stats=Recorder(),
        )  # fmt: skip

    return make(sender, source, ledger), make(receiver, None, Ledger()), ledger
