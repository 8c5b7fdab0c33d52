"""Device frames over a fake wire with NCCL's stream contract (``FakeWire.pair(streams=True)``):
a real ``Sender`` and ``Receiver`` on real lanes, and consumers that take each batch as
``next()`` would. Shared by the transport's device and staging tests."""

from __future__ import annotations

import datetime
import threading
from typing import Any

import numpy as np
import torch

from tensorcast.transport.device import DevicePart
from tensorcast.transport.groups import Group
from tensorcast.transport.lane import Job, Lane
from tensorcast.transport.receiver import Receiver
from tensorcast.transport.sender import Sender
from tensorcast.transport.testing import FakeWire

TIMEOUT = datetime.timedelta(seconds=10)


def device_pair(
    *, verify: bool = False, timeout: datetime.timedelta = TIMEOUT
) -> tuple[Sender, Receiver, Group, Group]:
    wires = FakeWire.pair(streams=True)
    groups = [Group((0, 1), w, Lane(f"dev{w.rank}", w.abort, idle_exit_s=0.2)) for w in wires]
    sender = Sender(groups[0], 0, verify=verify, timeout=timeout)
    receiver = Receiver(groups[1], 0, rank=1, timeout=TIMEOUT)
    return sender, receiver, groups[0], groups[1]


def batches() -> list[Any]:
    return [
        {"x": torch.arange(1000.0), "step": 0},
        {
            "audio": torch.randn(3, 5000),
            "names": ["a", "b"],
            "mask": torch.ones(7, dtype=torch.bool),
        },
        {"feats": np.arange(12, dtype=np.float32).reshape(3, 4), "ids": torch.arange(9)},
        {"x": torch.arange(1000.0), "step": 3},
        {"big": torch.arange(200_000, dtype=torch.int32), "s": "x" * 3000},
    ]


def run_both(
    sender: Sender,
    receiver: Receiver,
    trees: list[Any],
    *,
    ahead: int,
    source_device: torch.device | None = None,
) -> tuple[list[Any], list[Any]]:
    """Both ranks, each a consumer thread submitting ``ahead`` steps to its lane before it
    takes the first, then one more per step (a loader's ``prefetch``)."""
    out: dict[str, Any] = {}

    def consumer(name: str, lane: Lane, step_fn: Any) -> None:
        def submit(i: int) -> Job[Any]:
            job: Job[Any] = Job(lambda: step_fn(i))
            lane.enqueue(job)  # on the lane's worker, as a loader's prefetched steps
            return job

        try:
            jobs = [submit(i) for i in range(min(ahead, len(trees)))]
            taken = []
            for i in range(len(trees)):
                if len(jobs) <= i:
                    jobs.append(submit(i))
                part = jobs[i].result()
                assert isinstance(part, DevicePart), type(part)
                taken.append(part.take())
                if i + ahead < len(trees):
                    jobs.append(submit(i + ahead))
            out[name] = taken
        except BaseException as e:  # reported by the test
            out[name] = e

    def send(i: int) -> Any:
        return sender.send_batch(trees[i], source_device, TIMEOUT)

    def recv(i: int) -> Any:
        return receiver.recv(None, TIMEOUT)

    threads = [
        threading.Thread(
            target=consumer, args=("source", sender.group.lane, send), name="source-main"
        ),
        threading.Thread(
            target=consumer, args=("receiver", receiver.group.lane, recv), name="receiver-main"
        ),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for name in ("source", "receiver"):
        if isinstance(out.get(name), BaseException):
            raise out[name]
    return out["source"], out["receiver"]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)
