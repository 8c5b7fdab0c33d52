"""Reliability: peers that die, ranks that disagree, corrupted bytes, bad input on the source.

Real processes on real gloo groups (the shared pools), nothing mocked. A rank dies by
SIGKILL to itself, which kills a pool process; each death forces a re-spawn, so the
lethal scenarios are one test each and everything non-lethal is grouped into few calls.

Every failure is timed inside the rank (``time.monotonic``) from the last batch that rank
received, and must come within the channel's timeout plus ``MARGIN`` (the margin absorbs
a loaded machine; it is not a performance check).
"""

from __future__ import annotations

import functools
import gc
import hashlib
import itertools
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from rankpool import Died, RankPool
from test_codec import assert_same, tensor_bytes

import tensorcast as tc
from tensorcast import _codec, _schema, _transport

TIMEOUT = 5.0  # the channel's timeout in the fault scenarios, seconds
MARGIN = 30.0  # slack for a loaded 2-core machine
CALL_TIMEOUT = 180.0  # pool.run's hard limit: a hang fails the test, never blocks it
LATE = 2.0  # how long a source waits before it sends what an out-of-step receiver awaits

HAS_CUDA = torch.cuda.is_available()


# -- comparing trees -----------------------------------------------------------------


def tree_digest(tree: Any) -> str:
    """A digest of a tree's types, structure and bytes, to compare what ranks received."""
    h = hashlib.blake2b(digest_size=16)
    stack = [tree]
    while stack:
        x = stack.pop()
        h.update(type(x).__name__.encode())
        if isinstance(x, dict):
            h.update(repr(list(x)).encode())
            stack.extend(reversed(list(x.values())))
        elif isinstance(x, (list, tuple)):
            h.update(str(len(x)).encode())
            stack.extend(reversed(x))
        elif isinstance(x, torch.Tensor):
            h.update(f"{x.dtype}{tuple(x.shape)}".encode())
            h.update(tensor_bytes(x))
        elif isinstance(x, np.ndarray):
            h.update(f"{x.dtype}{x.shape}".encode())
            h.update(x.tobytes())
        else:
            h.update(repr(x).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    out, stack = [], [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, torch.Tensor):
            out.append(x)
    return out


# -- batches -------------------------------------------------------------------------


def good_batch(tag: int, step: int) -> dict[str, Any]:
    """A small deterministic batch; every rank can rebuild the expected value."""
    g = torch.Generator().manual_seed(tag * 10_000 + step)
    return {
        "tag": tag,
        "step": step,
        "x": torch.randn(3, 5, generator=g),
        "ids": torch.randint(0, 1000, (7,), generator=g, dtype=torch.int64),
        "arr": np.arange(step, step + 4, dtype=np.int16),
        "text": f"utt-{tag}-{step}",
    }


def views_batch() -> dict[str, Any]:
    """Several views of ONE storage, the same tensor twice, a list shared by two keys."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    shared = [base[0], base[0]]
    return {
        "base": base,
        "again": base,
        "row": base[1],
        "cols": base[:, 2:5],
        "t": base.t(),
        "flat": base.view(-1),
        "bcast": torch.tensor([7.0]).expand(3, 4),
        "p": shared,
        "q": shared,
    }


def payload_batch(step: int) -> dict[str, Any]:
    """300 KB in one tensor: a payload that follows the first message."""
    return {"x": torch.full((75_000,), float(step))}


def big_text_batch() -> dict[str, Any]:
    """Multi-megabyte bytes and str leaves (they travel in the buffer, not the header)."""
    return {
        "blob": bytes(range(256)) * (12 << 12),  # 12 MiB
        "text": "héllo wörld ✓ 𝄞 " * (1 << 19),  # ~8.9 M chars, ~11 MB of UTF-8
        "lone": "\ud800" + "x" * 4000,  # a lone surrogate survives (surrogatepass)
        "small": b"\x00\xff",
    }


_installed_hooks: list[Any] = []


class _GrowDuringGC:
    """A gc callback that adds a key to ``target`` at every collection.

    With the collection threshold at 1 (see ``_mutated_batch``), every allocation of a
    tracked object collects: the dict then grows between any two steps of reading it,
    deterministically. This is exactly what another thread writing to the batch would
    do, without depending on thread scheduling.
    """

    def __init__(self, target: dict[str, int], limit: int = 100_000):
        self.target = target
        self.limit = limit

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and len(self.target) < self.limit:
            self.target[f"added-{len(self.target)}"] = 0


def _mutated_batch() -> dict[str, Any]:
    big = {f"k{i}": i for i in range(50_000)}
    hook = _GrowDuringGC(big)
    gc.callbacks.append(hook)
    _installed_hooks.append((hook, gc.get_threshold()))
    gc.set_threshold(1)
    return {"x": torch.ones(2), "big": big}


def _remove_hooks() -> None:
    while _installed_hooks:
        hook, threshold = _installed_hooks.pop()
        gc.set_threshold(*threshold)
        if hook in gc.callbacks:
            gc.callbacks.remove(hook)


def _cyclic_batch() -> list[Any]:
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    return loop


class _MyDict(dict):  # type: ignore[type-arg]
    pass


# name -> (bad batch maker, source exception type, fragment of the message both sides see)
BAD_INPUTS: dict[str, tuple[Callable[[], Any], type[BaseException], str]] = {
    "unsupported leaf": (
        lambda: {"x": torch.ones(2), "meta": [1, 2, object()]},
        tc.UnsupportedLeafError,
        "batch['meta'][2]",
    ),
    "dict subclass": (lambda: {"m": _MyDict(a=1)}, tc.UnsupportedLeafError, "_MyDict"),
    "bad dict key": (lambda: {"m": {1.5: 0}}, tc.UnsupportedLeafError, "dict key"),
    "cyclic tree": (_cyclic_batch, ValueError, "contains itself"),
    "mutated while packed": (_mutated_batch, RuntimeError, "changed while it was being packed"),
    # A stride-0 view claims 32 TiB without allocating it: over the format's limit, which
    # the message must name.
    "over the size limit": (
        lambda: {"huge": torch.zeros(1, dtype=torch.uint8).expand(1 << 45)},
        ValueError,
        str(_schema.MAX_BUFFER_BYTES),
    ),
    # 8 TiB is within the format but not within this machine: the allocation fails after
    # the batch was encoded, and the receivers must still hear about it.
    "too large to allocate": (
        lambda: {"huge": torch.zeros(1, dtype=torch.uint8).expand(1 << 43)},
        RuntimeError,
        "allocate",
    ),
    "mixed devices": (
        lambda: {"a": torch.ones(2), "b": torch.ones(2, device="cuda")},
        ValueError,
        "tensors on mixed devices",
    ),
}


# Checked in their own test (the allocation only where it cannot succeed lazily).
SIZE_CASES = ("too large to allocate", "over the size limit")


class _Passes:
    """A source whose k-th pass yields the batches that ``passes[k]`` makes, lazily."""

    def __init__(self, passes: list[list[Callable[[], Any]]]):
        self.passes = passes
        self.started = 0

    def __iter__(self) -> Iterator[Any]:
        makers = self.passes[self.started]
        self.started += 1
        for make in makers:
            yield make()


def _iterate(loader: Any) -> tuple[list[Any], BaseException | None, float]:
    """Run one pass; the batches, the error that ended it, seconds from last batch to it."""
    got: list[Any] = []
    last = time.monotonic()
    try:
        for batch in loader:
            got.append(batch)
            last = time.monotonic()
    except Exception as e:
        return got, e, time.monotonic() - last
    return got, None, 0.0


def _fresh_group_on_failure(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Tear the process group down when a rank function fails.

    A collective that timed out on one rank is still pending in gloo's worker thread and
    would swallow the next test's first message; a new group (the pool makes one on the
    next call) starts clean. Destroying waits at most the group's own timeout.
    """

    @functools.wraps(fn)
    def run(rank: int, world: int, *args: Any) -> Any:
        try:
            return fn(rank, world, *args)
        except BaseException:
            _remove_hooks()
            dist.destroy_process_group()
            raise

    return run


# -- rank functions: bad input on the source -----------------------------------------


@_fresh_group_on_failure
def _bad_inputs(rank: int, world: int, cases: list[str], prefetch: int) -> dict[str, Any]:
    """One loader, one pass per bad input: [good, good, BAD, good]; then two clean passes."""
    passes: list[list[Callable[[], Any]]] = []
    for i, name in enumerate(cases):
        make_bad = BAD_INPUTS[name][0]
        passes.append(
            [
                lambda i=i: good_batch(i, 0),
                lambda i=i: good_batch(i, 1),
                make_bad,
                lambda i=i: good_batch(i, 3),
            ]
        )
    passes.append(
        [lambda: good_batch(99, 0), views_batch, big_text_batch, lambda: good_batch(99, 3)]
    )
    source = _Passes(passes) if rank == 0 else None
    loader = tc.BroadcastingDataLoader(
        source, group=dist.group.WORLD, src=0, prefetch=prefetch, timeout=TIMEOUT
    )
    report: dict[str, Any] = {}
    try:
        for i, name in enumerate(cases):
            _, error_type, fragment = BAD_INPUTS[name]
            got, err, waited = _iterate(loader)
            _remove_hooks()
            # Nothing before the bad batch is lost, on any rank.
            assert len(got) == 2, f"{name}: {len(got)} batches before the error, expected 2"
            for step, batch in enumerate(got):
                assert_same(batch, good_batch(i, step), f"{name} batch {step}")
            assert err is not None, f"{name}: the pass ended without an error"
            if rank == 0:
                assert type(err) is error_type, f"{name}: {type(err).__name__}: {err}"
            else:
                assert type(err) is tc.SourceError, f"{name}: {type(err).__name__}: {err}"
                assert "batch serialization failed" in str(err), str(err)
                assert error_type.__name__ in str(err), str(err)
            assert fragment in str(err), f"{name}: {fragment!r} not in {err}"
            assert waited < TIMEOUT + MARGIN, f"{name}: the error took {waited:.1f}s"
            report[name] = (type(err).__name__, str(err)[:300])
        # The loader still serves a clean pass, with the awkward but valid batches.
        got, err, _ = _iterate(loader)
        assert err is None, f"clean pass failed: {err!r}"
        assert len(got) == 4
        assert_same(got[0], good_batch(99, 0))
        _check_views(got[1])
        assert_same(got[2], big_text_batch())
        assert_same(got[3], good_batch(99, 3))
        report["digests"] = [tree_digest(b) for b in got]
    finally:
        _remove_hooks()
    return report


def _check_views(got: dict[str, Any]) -> None:
    """Views of one storage arrive as independent, equal, contiguous tensors."""
    want = views_batch()
    assert_same(
        got,
        {
            k: v.contiguous() if isinstance(v, torch.Tensor) else [t.contiguous() for t in v]
            for k, v in want.items()
        },
    )
    tensors = _tensor_leaves(got)
    assert all(t.is_contiguous() for t in tensors)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start, "two received tensors share bytes"
    assert got["p"] is not got["q"]
    got["base"].add_(1000)  # writing one leaves the others untouched
    assert_same(got["again"], want["again"])
    assert_same(got["row"], want["row"].contiguous())


class _ReusingSource:
    """A loader that yields ONE dict object, mutated in place for every step (containers
    and tensor data), as loaders with preallocated buffers do. Its 4 MiB tensor travels
    from its own memory: the source's kept batches must not change with it."""

    steps = 6

    def __iter__(self) -> Iterator[Any]:
        batch: dict[str, Any] = {
            "x": torch.zeros(4),
            "big": torch.zeros(1 << 20),
            "items": [],
            "meta": {"step": -1},
        }
        for step in range(self.steps):
            batch["x"].fill_(step)
            batch["big"].fill_(step)
            batch["items"].append(step)
            batch["meta"]["step"] = step
            if step % 2:
                batch["odd"] = True
            else:
                batch.pop("odd", None)
            yield batch


def _reused_expected(step: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "x": torch.full((4,), float(step)),
        "big": torch.full((1 << 20,), float(step)),
        "items": list(range(step + 1)),
        "meta": {"step": step},
    }
    if step % 2:
        out["odd"] = True
    return out


@_fresh_group_on_failure
def _mutated_after_next(rank: int, world: int, prefetch: int) -> list[str]:
    """Every rank keeps every batch; later in-place mutation by the source's loader must not
    reach batches already handed out, on the source or on receivers."""
    source = _ReusingSource() if rank == 0 else None
    loader = tc.BroadcastingDataLoader(
        source, group=dist.group.WORLD, src=0, prefetch=prefetch, timeout=TIMEOUT
    )
    kept = list(loader)
    assert len(kept) == _ReusingSource.steps
    for step, batch in enumerate(kept):
        assert_same(batch, _reused_expected(step), f"kept batch {step}")
    return [tree_digest(b) for b in kept]


# -- rank functions: desync, setup mismatch, integrity -------------------------------


class _CorruptingChannel(_transport.Channel):
    """A receiver channel that flips one payload byte after it arrives: a bad link.

    It corrupts what the collective delivered, after the source computed its CRC, so the
    check sees exactly what a flaky interconnect would produce.
    """

    def _broadcasts(self, stages: list[Any], *args: Any) -> None:
        super()._broadcasts(stages, *args)
        if self.is_source:
            return
        for stage in stages:
            self._flip(stage.tensors, stage.what)

    def _flip(self, tensors: list[torch.Tensor], what: str) -> None:
        if what == "batch buffer":
            for tensor in tensors:
                tensor[tensor.numel() // 2] ^= 0x5A
        elif what == "frame header":
            (tensor,) = tensors
            fields = _transport._PREFIX.unpack_from(tensor.numpy(), 0)
            flags, payload_len = fields[2], fields[8]
            if flags & _transport._INLINE and not flags & _transport._DIRECT and payload_len:
                at = _transport._inline_at(tensor.numel(), payload_len)
                tensor[at + payload_len // 2] ^= 0x5A


@_fresh_group_on_failure
def _desync_and_integrity(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    group = dist.group.WORLD

    # 1. Setup mismatch: the two ranks disagree on the axes (as with different meshes).
    axes = ("cp", "tp") if rank == 0 else ("tp",)
    ch = _transport.Channel(group, 0, axes=axes, timeout=TIMEOUT)
    if rank == 0:
        ch.send_batch(good_batch(0, 0))
    else:
        with pytest.raises(tc.DesyncError) as info:
            ch.recv()
        msg = str(info.value)
        assert "axes=['cp', 'tp']" in msg and "axes=['tp']" in msg, msg
        out["fingerprint"] = msg
        # The channel is out of step with its source now: it says so at once, and posts
        # no collective that would pair with someone else's.
        with pytest.raises(tc.PeerError, match=r"failed earlier.*source's setup differs"):
            ch.recv()

    # 2. A loader restarted on one rank mid-epoch. prefetch=0 keeps the number of
    # collectives each rank posts exact, so the group stays usable afterwards.
    source = _Passes([[lambda s=s: good_batch(1, s) for s in range(4)]]) if rank == 0 else None
    loader = tc.BroadcastingDataLoader(source, group=group, src=0, prefetch=0, timeout=TIMEOUT)
    it = iter(loader)
    for step in range(3):
        assert_same(next(it), good_batch(1, step))
    if rank == 0:
        assert_same(next(it), good_batch(1, 3))
    else:
        restarted = iter(loader)  # this rank starts pass 2 while the source is in pass 1
        start = time.monotonic()
        with pytest.raises(tc.DesyncError) as info:
            next(restarted)
        assert time.monotonic() - start < TIMEOUT + MARGIN
        msg = str(info.value)
        assert "expected pass 2 step 0" in msg and "sent pass 1 step 3" in msg, msg
        out["restart"] = msg
    dist.barrier()  # nobody is left inside a collective

    # 2b. The same with a promised payload outstanding (see the transport's docstring): the
    # source starts a new pass, the receiver, which has posted the promised pieces with
    # the first message, says so at once instead of waiting for pieces never sent.
    ch = _transport.Channel(group, 0, timeout=TIMEOUT)
    for step in range(3):
        want = payload_batch(step)
        got = ch.send_batch(want) if rank == 0 else _transport.raise_for(*ch.recv(), 0)
        assert_same(got, want)
    if rank == 0:
        promise = ch._promise
        assert promise is not None
        ch.start_pass(1)
        ch.send_batch(good_batch(2, 0))
        time.sleep(LATE)  # then the pieces the receiver posted, so the group stays in step
        for piece in ch._void(promise):
            dist.broadcast(piece, 0, group=group)
    else:
        start = time.monotonic()
        with pytest.raises(tc.DesyncError) as info:
            ch.recv()
        assert time.monotonic() - start < LATE / 2, "it waited for the promised pieces"
        msg = str(info.value)
        assert "expected pass 0 step 3" in msg and "sent pass 1 step 0" in msg, msg
        with pytest.raises(tc.PeerError, match="failed earlier"):
            ch.recv()  # at once, without taking a buffer for the promise
    dist.barrier()

    # 3. verify=True: a CRC32 travels and is checked, inline, in a second message, and
    # over a payload whose large leaves travel from their own memory.
    batches = [
        good_batch(2, 0),
        {"big": torch.arange(1 << 17, dtype=torch.float32)},
        {"direct": torch.arange(1 << 20, dtype=torch.float32), "after": torch.arange(3)},
        {"nothing": None, "empty": torch.empty(0, 3)},
    ]
    ch = _transport.Channel(group, 0, timeout=TIMEOUT, verify=True)
    for want in [b for b in batches for _ in range(3)]:  # repeats: promised payloads too
        got = ch.send_batch(want) if rank == 0 else _transport.raise_for(*ch.recv(), 0)
        assert_same(got, want)

    # 4. Corruption in transit: caught with verify=True, delivered silently without it.
    for verify in (True, False):
        cls = _transport.Channel if rank == 0 else _CorruptingChannel
        ch = cls(group, 0, timeout=TIMEOUT, verify=verify)
        for want in batches[:3]:  # inline, a second message, direct leaves
            if rank == 0:
                ch.send_batch(want)
            elif verify:
                with pytest.raises(tc.PeerError, match="CRC32") as info:
                    ch.recv()
                out.setdefault("crc", []).append(str(info.value))
            else:
                got = _transport.raise_for(*ch.recv(), 0)
                assert tree_digest(got) != tree_digest(want)
    dist.barrier()

    # 5. A source whose header keeps a known structure but lies in its small values: the
    # receiver, reading the values alone, still validates them. With a payload that follows
    # the first message (300 KB), the receiver has posted its receive before it reads the
    # values: it still receives the payload, so the group stays in step, then raises.
    for key, size in (("lying_values", 4), ("lying_values_payload", 75_000)):
        cls = _LyingValuesChannel if rank == 0 else _transport.Channel
        ch = cls(group, 0, timeout=TIMEOUT)
        for step in range(4):
            want = {"x": torch.full((size,), float(step)), "n": 1000 + step}
            if rank == 0:
                ch.send_batch(want)
            elif step < 3:
                assert_same(_transport.raise_for(*ch.recv(), 0), want)
            else:
                with pytest.raises(tc.HeaderError, match="invalid value token") as info:
                    ch.recv()
                out[key] = str(info.value)
                with pytest.raises(tc.PeerError, match="failed earlier"):
                    ch.recv()
        dist.barrier()

    # 6. Frames that break the rules of promised payloads (see the transport's docstring).
    # The source has nothing left to send when its receiver raises: the frame travels
    # inline, and the pieces promised for it were posted with its first message.
    def small(step: int) -> dict[str, Any]:
        return good_batch(6, step)

    # (what the receiver raises, the flags it finds in frame 2, frames 0 and 1, frame 2)
    for key, flags, make, last in (
        ("promise_inline", _transport._NEXT, small, "data"),
        ("posted_unpromised", _transport._POSTED, small, "data"),
        ("promise_at_end", _transport._NEXT, small, "end"),
        ("posted_other_layout", _transport._POSTED, payload_batch, "data"),
    ):
        cls = _transport.Channel if rank == 0 else _FlagTamperingChannel
        ch = cls(group, 0, timeout=TIMEOUT)
        for step in range(3):
            want = make(step) if step < 2 else good_batch(6, step)
            if rank != 0 and step < 2:
                assert_same(_transport.raise_for(*ch.recv(), 0), want)
            elif rank != 0:
                ch.tamper = flags  # type: ignore[attr-defined]
                with pytest.raises(tc.HeaderError) as info:
                    ch.recv()
                out[key] = str(info.value)
            elif last == "end" and step == 2:
                ch.send(ch.end_frame())
            else:
                ch.send_batch(want)
        dist.barrier()
    return out


class _FlagTamperingChannel(_transport.Channel):
    """A receiver that sets ``tamper`` flags in the next first message it receives."""

    tamper = 0

    def _broadcasts(self, stages: list[Any], *args: Any) -> None:
        super()._broadcasts(stages, *args)
        tensors, what = stages[0].tensors, stages[0].what
        if what == "frame header" and self.tamper:
            tensors[0][5] |= self.tamper  # the prefix's flags byte
            self.tamper = 0


class _LyingValuesChannel(_transport.Channel):
    """A source whose fourth frame's header says a bare 1234567890 where the structure
    has its one small value: valid JSON of the right length, not a valid value."""

    def _prepare(self, frame: _transport.Frame) -> Any:
        prepared = super()._prepare(frame)
        if self.step == 3:
            host = prepared.first.numpy()
            data = host.tobytes()
            at = data.index(b'[["i",1003]]')
            host[at : at + 12] = np.frombuffer(b"[1234567890]", np.uint8)
        return prepared


# -- rank functions: deaths ----------------------------------------------------------


def _endless(tag: int) -> Iterator[Any]:
    step = 0
    while True:
        yield good_batch(tag, step)
        step += 1


def _die_at(
    rank: int, world: int, victim: int, die_after: int, mesh_shape: tuple[int, ...]
) -> dict[str, Any]:
    """Iterate a loader on every rank; ``victim`` SIGKILLs itself after ``die_after`` batches.
    Every survivor must raise a TensorcastError within the timeout."""
    if mesh_shape:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("cp", "tp"))
        source = _endless(5) if tc.is_dp_source_rank(mesh) else None
        loader = tc.BroadcastingDataLoader(source, mesh, prefetch=1, timeout=TIMEOUT)
    else:
        source = _endless(5) if rank == 0 else None
        loader = tc.BroadcastingDataLoader(
            source, group=dist.group.WORLD, src=0, prefetch=1, timeout=TIMEOUT
        )
    received = 0
    last = time.monotonic()
    try:
        for batch in loader:
            assert_same(batch, good_batch(5, received))
            received += 1
            last = time.monotonic()
            if rank == victim and received == die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if received > 10_000:
                raise AssertionError("the loader kept going after a peer died")
    except tc.TensorcastError as e:
        return {
            "error": type(e).__name__,
            "message": str(e),
            "waited": time.monotonic() - last,
            "received": received,
        }
    raise AssertionError("the pass ended without an error")


def _check_survivors(results: list[Any], victim: int, role: dict[int, str]) -> None:
    assert isinstance(results[victim], Died), results[victim]
    for r, res in enumerate(results):
        if r == victim:
            continue
        assert res["error"] == "PeerError", (r, res)
        assert role[r] in res["message"], (r, res["message"])
        assert res["waited"] < TIMEOUT + MARGIN, (r, res["waited"])
        assert res["received"] >= 3, (r, res)


# -- tests -----------------------------------------------------------------------------


def test_offsets_past_2_and_4_gib_are_exact() -> None:
    """The layout of a batch over 4 GiB: offsets and sizes are exact ints, aligned, in
    order, and receivers' views land at those offsets. Stride-0 tensors and a meta buffer
    keep it from allocating anything."""
    u8 = torch.zeros(1, dtype=torch.uint8)
    f32 = torch.zeros(1, dtype=torch.float32)
    tree = {
        "head": torch.ones(3, dtype=torch.int8),
        "g2": u8.expand((1 << 31) + 3),  # crosses 2 GiB
        "g4": f32.expand(1 << 30),  # 4 GiB on its own, ends past 6 GiB
        "tail": torch.ones(5, dtype=torch.float64),
        "text": "y" * 5000,
    }
    plan = _codec.plan(tree)
    schema = tc.read_header(plan.header)
    want, end = [], 0
    for path, n in (
        ("['head']", 3),
        ("['g2']", (1 << 31) + 3),
        ("['g4']", 4 << 30),
        ("['tail']", 40),
        ("['text']", 5000),
    ):
        off = (end + 63) // 64 * 64
        want.append((path, off, n))
        end = off + n
    assert [(s.path, s.offset, s.nbytes) for s in schema.leaves] == want
    assert schema.nbytes == plan.nbytes == end > 6 << 30
    # The receiver side: views into a buffer of that size, on the meta device (tensor
    # leaves only: a str leaf is copied out, and a meta buffer has no bytes).
    buffer = torch.empty(schema.nbytes, dtype=torch.uint8, device="meta")
    decoded = _schema.decode(plan.header)
    full = decoded.structure
    decoded = _schema.Decoded(
        _schema.Structure(full.nbytes, full.align, full.leaves[:4], full.tokens), decoded.values
    )
    leaves = _codec.views(decoded, buffer)
    for spec, view in zip(schema.leaves[:4], leaves, strict=True):
        assert view.storage_offset() * view.element_size() == spec.offset
        assert view.numel() * view.element_size() == spec.nbytes
    # The frame prefix carries such sizes without truncation.
    fields = (b"TCFR", 1, 0, 0, 1, 2, 3, 4, schema.nbytes, 4096, 0, 2 << 20)
    assert _transport._PREFIX.unpack(_transport._PREFIX.pack(*fields)) == fields
    # ... and cuts it into the same pieces on both sides: each large leaf its own piece.
    g2, g4 = ((o, o + n) for _, o, n in want[1:3])
    assert _transport._segments(decoded.leaves, schema.nbytes, 2 << 20) == [
        (0, g2[0], -1),
        (*g2, 1),
        (g2[1], g4[0], -1),
        (*g4, 2),
        (g4[1], schema.nbytes, -1),
    ]


def test_mutation_while_packing_is_detected_locally() -> None:
    """A dict whose size changes while it is listed raises a clear error naming its path."""
    try:
        with pytest.raises(RuntimeError, match=r"the dict at `batch\['big'\]` changed"):
            tc.pack(_mutated_batch())
    finally:
        _remove_hooks()


def test_bad_input_on_the_source(pool2: RankPool) -> None:
    """Each bad input: a clear error on the source, SourceError with the original message
    on the receiver, the batches before it on both, and the loader fine for a new pass.
    Then views of one storage and multi-megabyte bytes/str travel intact."""
    cases = [c for c in BAD_INPUTS if c not in ("mixed devices", *SIZE_CASES)]
    for prefetch in (0, 2):
        results = pool2.run(_bad_inputs, cases, prefetch, timeout=CALL_TIMEOUT)
        src, recv = results
        assert set(src) == set(recv) == {*cases, "digests"}
        assert src["digests"] == recv["digests"]
        for name in cases:
            assert src[name][1].split(": ", 1)[0] in recv[name][1]


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA for tensors on two devices")
def test_mixed_devices_on_the_source(pool2: RankPool) -> None:
    results = pool2.run(_bad_inputs, ["mixed devices"], 1, timeout=CALL_TIMEOUT)
    assert results[0]["digests"] == results[1]["digests"]


def _overcommits() -> bool:
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip() == "1"
    except OSError:
        return True


def test_oversized_batches_on_the_source(pool2: RankPool) -> None:
    """A batch over the format's size limit, and one within it that this machine cannot
    allocate, fail like any bad input: error on the source, SourceError on receivers."""
    cases = list(SIZE_CASES) if not _overcommits() else ["over the size limit"]
    results = pool2.run(_bad_inputs, cases, 1, timeout=CALL_TIMEOUT)
    assert results[0]["digests"] == results[1]["digests"]


def test_batch_mutated_after_next_is_not_corrupted(pool2: RankPool) -> None:
    for prefetch in (0, 2):
        src, recv = pool2.run(_mutated_after_next, prefetch, timeout=CALL_TIMEOUT)
        assert src == recv


def test_desync_setup_mismatch_and_integrity(pool2: RankPool) -> None:
    _, recv = pool2.run(_desync_and_integrity, timeout=CALL_TIMEOUT)
    assert "source:" in recv["fingerprint"] and "this rank:" in recv["fingerprint"]
    assert len(recv["crc"]) == 3
    assert "1234567890" in recv["lying_values"]
    assert "promises a payload it cannot have" in recv["promise_inline"]
    assert "promised no payload" in recv["posted_unpromised"]
    assert "END or ERROR frame with a payload" in recv["promise_at_end"]
    assert "not the one the frame before it promised" in recv["posted_other_layout"]


def test_source_death_fails_every_receiver(pool2: RankPool) -> None:
    results = pool2.run(_die_at, 0, 3, (), timeout=CALL_TIMEOUT, allow_death=True)
    _check_survivors(results, 0, {1: "the source rank 0 stopped answering"})


def test_receiver_death_fails_source_and_other_receivers(pool4: RankPool) -> None:
    results = pool4.run(_die_at, 3, 3, (2, 2), timeout=CALL_TIMEOUT, allow_death=True)
    _check_survivors(
        results,
        3,
        {0: "a receiver rank stopped answering", 1: "stopped answering", 2: "stopped answering"},
    )
