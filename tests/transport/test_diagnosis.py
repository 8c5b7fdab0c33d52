"""What a receiver says of a silent source (``transport.diagnosis``), in one process: the
heartbeats it reads are a real ``Heartbeat``'s, in a real ``HashStore``, or a store that
never answers.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from tensorcast.transport.diagnosis import Asker, Silent, diagnose, failed_after
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


class _Stalls:
    """A store whose ``check`` waits ``stall`` seconds the first time."""

    def __init__(self, stall: float) -> None:
        self.stall, self.checks = stall, 0

    def check(self, keys: list[str]) -> bool:
        self.checks += 1
        if self.checks == 1:
            time.sleep(self.stall)
        return True


def test_an_asker_asks_again_once_a_request_it_gave_up_came_back() -> None:
    """Given up, a request that still has not come back makes the next fail at once (it
    would queue behind it); once it came back, the store is asked again: one slow answer
    does not silence the store for good."""
    asked = Asker(_Stalls(0.5), 60.0)
    with asked.bounded(0.1), pytest.raises(Silent, match="did not answer its check request"):
        asked.check(["k"])
    with pytest.raises(Silent, match="earlier request"):
        asked.check(["k"])
    time.sleep(0.6)
    assert asked.check(["k"]) is True


def test_setups_on_two_threads_keep_their_own_limits() -> None:
    asked = Asker(_Stalls(0.0), 60.0)
    seen: dict[str, float] = {}

    def setup(name: str, limit: float) -> None:
        with asked.bounded(limit):
            time.sleep(0.05)  # the other thread sets its own meanwhile
            seen[name] = asked.limit_s

    threads = [threading.Thread(target=setup, args=(n, s)) for n, s in (("a", 2.0), ("b", 9.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"a": 2.0, "b": 9.0} and asked.limit_s == 60.0
