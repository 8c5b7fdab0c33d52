"""The methods a run compares, and their interleaved timing.

Each timed iteration runs every method once, in an order rotated per iteration, with a
barrier before and after each; each full cycle of rotations starts from a new seeded shuffle of
the methods (with one fixed order, a method always pays for the one before it). An
iteration's time for a method is the slowest rank's. On CUDA a method is timed with CUDA
events on the current stream, from an idle device to the moment its output is there.
"""

from __future__ import annotations

import inspect
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import tensorcast as tc
from tensorcast.bench import baselines

__all__ = [
    "METHODS",
    "OFF_SHM",
    "REFERENCES",
    "UNTRIMMED",
    "Feed",
    "LoaderMethod",
    "Slot",
    "build_methods",
    "close_methods",
    "shm_supported",
    "trim_decision_ms",
    "trim_supported",
    "wire_bytes",
]

#: tensorcast's methods with every leaf sent whole (``trim=False``), beside the default's
UNTRIMMED = (
    "tc.broadcast(trim=False)",
    "tc.loader(trim=False)",
    "tc.loader+packed(trim=False)",
)

#: tensorcast's methods that never use the shared-memory lane (``shm=False``)
OFF_SHM = ("tc.broadcast(shm=False)", "tc.loader(shm=False)")

#: what the others are measured against: one broadcast of the bytes (the floor, every
#: ratio's unit) and one copy of them on the host (``memcpy``); their outputs are no batch
REFERENCES = ("memcpy", "floor")

METHODS = (
    "tc.broadcast",
    "tc.loader",
    "tc.loader+packed",
    *UNTRIMMED,
    *OFF_SHM,
    "pickled_packet",
    "object_list",
    "per_tensor",
    *REFERENCES,
)


@dataclass(frozen=True)
class Slot:
    """Where this rank runs: its data-parallel slot's group and source, and the rest.

    Attributes:
        group: the process group of the slot's ranks (the batches' peers).
        src: the slot's source, a *global* rank.
        control: a gloo group of every rank, for barriers and the timing reductions.
        device: where the messages travel and the receivers' tensors land.
    """

    group: dist.ProcessGroup
    src: int
    control: dist.ProcessGroup
    device: torch.device

    @property
    def is_source(self) -> bool:
        return dist.get_rank() == self.src


def trim_supported() -> bool:
    """Whether this tensorcast takes ``trim=`` (trimmed leaves, issue 34) on every call the
    benchmark makes: the ``(trim=False)`` methods need it."""
    calls = (tc.pack, tc.broadcast, tc.BroadcastingDataLoader)
    return all("trim" in inspect.signature(fn).parameters for fn in calls)


def shm_supported() -> bool:
    """Whether this tensorcast takes ``shm=`` (the shared-memory lane): the
    ``(shm=False)`` methods need it."""
    calls = (tc.broadcast, tc.BroadcastingDataLoader)
    return all("shm" in inspect.signature(fn).parameters for fn in calls)


def _trim(on: bool) -> dict[str, Any]:
    """The keyword that asks for ``trim=on``; none where it is the default (an older
    tensorcast, which has no such keyword, runs the default methods as before)."""
    return {} if on else {"trim": False}


class Feed:
    """An endless source that yields whatever batch the harness last put in ``item``."""

    def __init__(self, item: Any) -> None:
        self.item = item

    def __iter__(self) -> Feed:
        return self

    def __next__(self) -> Any:
        return self.item


class LoaderMethod:
    """One ``next()`` of a BroadcastingDataLoader that runs for the whole benchmark."""

    def __init__(
        self,
        source: Feed | None,
        group: dist.ProcessGroup,
        src: int,
        prefetch: int = 0,
        *,
        trim: bool = True,
        packed: bool = False,
        shm: dict[str, Any] | None = None,
    ) -> None:
        self.source = source
        self.trim, self.packed = trim, packed
        self.loader = tc.BroadcastingDataLoader(
            source, group=group, src=src, prefetch=prefetch, **_trim(trim), **(shm or {})
        )
        self.it = iter(self.loader)

    def feed(self, batch: Any) -> None:
        """Hand the source the next batch, packed as a DataLoader worker with
        ``packed_collate(trim=...)`` would hand it over."""
        if self.source is not None:
            self.source.item = tc.pack(batch, **_trim(self.trim)) if self.packed else batch

    def __call__(self) -> Any:
        return next(self.it)

    def close(self) -> None:
        self.it.close()  # type: ignore[attr-defined]


def build_methods(batch: Any, nbytes: int, slot: Slot) -> dict[str, Callable[[], Any]]:
    """Every method as a zero-argument call that returns the batch this rank ends up with
    (``batch`` is None off the source)."""
    group, src, device = slot.group, slot.src, slot.device
    mine = batch if slot.is_source else None
    floor = baselines.Floor(nbytes, device)

    def loader(trim: bool, packed: bool, **shm: Any) -> LoaderMethod:
        # A worker packs each batch; the harness packs it again whenever the batch changes.
        method = LoaderMethod(
            Feed(None) if slot.is_source else None, group, src, trim=trim, packed=packed,
            shm=shm,
        )  # fmt: skip
        method.feed(batch)
        return method

    methods: dict[str, Callable[[], Any]] = {
        "tc.broadcast": lambda: tc.broadcast(mine, src, group),
        "tc.loader": loader(True, False),
        "tc.loader+packed": loader(True, True),
    }
    if trim_supported():
        untrimmed = _trim(False)
        methods["tc.broadcast(trim=False)"] = lambda: tc.broadcast(mine, src, group, **untrimmed)
        methods["tc.loader(trim=False)"] = loader(False, False)
        methods["tc.loader+packed(trim=False)"] = loader(False, True)
    if shm_supported():
        methods["tc.broadcast(shm=False)"] = lambda: tc.broadcast(mine, src, group, shm=False)
        methods["tc.loader(shm=False)"] = loader(True, False, shm=False)
    copy = baselines.Memcpy(nbytes, device)
    return {
        **methods,
        "pickled_packet": lambda: baselines.pickled_packet(mine, src, group, device),
        "object_list": lambda: baselines.object_list(mine, src, group, device),
        "per_tensor": lambda: baselines.per_tensor(mine, src, group, device),
        "memcpy": lambda: copy(mine),
        "floor": lambda: floor(mine, src, group),
    }


def close_methods(methods: dict[str, Callable[[], Any]]) -> None:
    for fn in methods.values():
        if isinstance(fn, LoaderMethod):
            fn.close()


def wire_bytes(
    methods: dict[str, Callable[[], Any]], batch: Any, nbytes: int, slot: Slot
) -> dict[str, int]:
    """On a source: the bytes of the buffer each tensorcast method sent per batch (a
    loader's own count, ``loader.stats().bytes`` over its steps; for ``tc.broadcast``,
    ``tc.pack(...).nbytes`` packed for the receivers' device, as it decides its trims),
    and the floor's. Call it before :func:`close_methods`."""
    out = {"floor": nbytes}
    for name, fn in methods.items():
        if isinstance(fn, LoaderMethod):
            stats = fn.loader.stats()
            out[name] = stats.bytes // max(stats.steps, 1)
        elif name.startswith("tc.broadcast"):
            trim = _trim(not name.endswith("(trim=False)"))
            out[name] = tc.pack(batch, device=slot.device, **trim).nbytes
    return out


def trim_decision_ms(batch: Any, device: torch.device, reps: int = 21) -> dict[str, float] | None:
    """On a source: what deciding the trims costs a batch, timed in this process beside
    the run, where the broadcasts' noise does not reach it. ``Encoder.encode`` of the
    batch with ``trim=True`` (the probe of every leaf that could pay; on a padded leaf the
    scan and the side table too) and with ``trim=False``, alternating, ``reps`` times
    each: the medians in ms. Writing the buffer is not in it (a trimmed leaf's compact
    copy replaces its whole copy). None where this tensorcast does not trim."""
    if not trim_supported():
        return None
    from tensorcast.codec import Encoder

    receiver = "device" if device.type == "cuda" else "host"
    encoders = {"on": Encoder(trim=True), "off": Encoder(trim=False)}
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(reps + 1):  # the first of each: layouts made, caches warm
        for key, encoder in encoders.items():
            t0 = time.perf_counter()
            encoder.encode(batch, receiver=receiver)
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(t[1:]) * 1e3 for key, t in times.items()}


def timed(fn: Callable[[], Any], cuda: bool) -> tuple[Any, float]:
    """``fn()``'s result and its seconds; on CUDA, CUDA events on the current stream."""
    if not cuda:
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()  # an idle device: the start event's time is the call's
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end) / 1e3


def time_methods(
    methods: dict[str, Callable[[], Any]],
    names: list[str],
    rounds: int,
    slot: Slot,
    before: Callable[[int], None],
    after: Callable[[int, str, Any], None],
) -> dict[str, list[float]]:
    """Interleaved timing: ``rounds`` iterations, seconds per iteration (max over ranks).

    ``before(it)`` runs before iteration ``it`` (on every rank, outside the timed region),
    ``after(it, name, out)`` after each method, with its output.
    """
    cuda = slot.device.type == "cuda"
    times: dict[str, list[float]] = {n: [] for n in names}
    base = list(names)
    for it in range(rounds):
        k = it % len(names)
        if k == 0:  # a new cycle of rotations, from a shuffle every rank draws alike
            random.Random(it).shuffle(base)
        before(it)
        elapsed = torch.zeros(len(names), dtype=torch.float64)
        for name in base[k:] + base[:k]:
            dist.barrier(group=slot.control)
            out, seconds = timed(methods[name], cuda)
            elapsed[names.index(name)] = seconds
            # Every rank's call ends before any checks its batch: a rank whose call returned
            # early must not take the cores from one still in its call.
            dist.barrier(group=slot.control)
            after(it, name, out)
            del out  # a training loop drops the batch before fetching the next
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=slot.control)
        for i, n in enumerate(names):
            times[n].append(float(elapsed[i]))
    return times
