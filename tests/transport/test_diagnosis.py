"""What a receiver says of a silent source (``transport.diagnosis``), in one process: the
heartbeats it reads are a real ``Heartbeat``'s, in a real ``HashStore``, or a store that
never answers.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch.distributed as dist

from tensorcast.transport.diagnosis import diagnose, failed_after
from tensorcast.transport.liveness import Heartbeat


class Frozen:
    """A store whose every request blocks, as one hosted in a stopped process does."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        def request(*args: Any) -> Any:
            self.release.wait()
            raise RuntimeError("the store went away")

        return request


def test_a_store_that_does_not_answer_is_said_within_its_bound() -> None:
    store = Frozen()
    start = time.monotonic()
    text = diagnose(store, 0, rank=1, frame=(1, 0, 3), timeout_s=2.0, timed_out=True)
    took = time.monotonic() - start
    store.release.set()
    assert took < 3.0, took
    assert "the store did not answer within 2 s" in text, text
    assert "frozen or gone" in text and "rank 0, here the source itself" in text, text


def test_receivers_of_one_frame_say_the_same() -> None:
    """Two receivers of one frame diagnose at once: one watches, both say its words."""
    store = dist.HashStore()
    heartbeat = Heartbeat(store, 0, 2.0, lambda: True)
    heartbeat.start(2.0)
    texts: dict[int, str] = {}

    def receiver(rank: int) -> None:
        texts[rank] = diagnose(store, 0, rank=rank, frame=(9, 0, 1), timeout_s=2.0, timed_out=True)

    threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert texts[1] == texts[2], texts
    assert "is alive and has been outside next(source)" in texts[1], texts[1]
    text = diagnose(store, 5, rank=1, frame=(9, 0, 1), timeout_s=2.0, timed_out=True)
    assert "never sent a heartbeat" in text, text


def test_a_key_that_is_not_a_beat_is_named_not_raised() -> None:
    store = dist.HashStore()
    store.set("alive/0", "not a beat")
    text = diagnose(store, 0, rank=1, frame=(1, 0, 0), timeout_s=2.0, timed_out=True)
    assert "does not read as one" in text and "the same tensorcast" in text, text


def test_a_wait_that_failed_says_how_and_after_how_long() -> None:
    """A closed connection fails in about a second: the message says so, not the timeout."""
    closed = RuntimeError("[../gloo/transport/tcp/pair.cc:598] Connection closed by peer")
    said = failed_after(closed, 1.04, 1800.0)
    assert said.startswith("failed after 1.0 s, its connection closed"), said
    late = RuntimeError("Timed out waiting 1800000ms for recv operation to complete")
    assert failed_after(late, 1800.2, 1800.0).startswith("timed out after 1800.2 s"), said
