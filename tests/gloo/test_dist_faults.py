"""Reliability: peers that die, ranks that disagree, corrupted bytes, bad input on the source.

Real processes on real gloo groups (the shared pools). A bad link or a lying source is a
hook around the heads and payloads of one rank's wires (``taps.WireTap``, through
``groups.wrapping_wires``), changing bytes just before they leave or just after they
arrive; nothing else is mocked. A rank dies by SIGKILL to itself, which kills a pool
process; each death forces a re-start, so the lethal scenarios are one test each and
everything non-lethal is grouped into few calls.
Scenarios that break tensorcast's group on purpose run on a default group of their own
(``rankpool.in_a_new_process_group``), so that they leave nothing broken for the next call.

Every failure is timed inside the rank (``time.monotonic``) from the last batch that rank
received, and must come within the channel's timeout plus ``MARGIN`` (the margin absorbs
a loaded machine; it is not a performance check).
"""

from __future__ import annotations

import contextlib
import functools
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
from rankpool import Died, RankPool, in_a_new_process_group
from taps import WireTap, tapped
from torch.distributed.device_mesh import init_device_mesh
from trees import assert_same, mutated_batch, remove_hooks, tensor_bytes

import tensorcast as tc
from tensorcast import codec
from tensorcast.codec import schema as _schema
from tensorcast.transport import frame as _frame
from tensorcast.transport.frame import FRAMES_VERSION, PREFIX_SIZE, Flags, cut_frame

TIMEOUT = 5.0  # the channel's timeout in the fault scenarios, seconds
MARGIN = 30.0  # slack for a loaded 2-core machine
CALL_TIMEOUT = 180.0  # pool.run's hard limit: a hang fails the test, never blocks it
LATE = 2.0  # how long a rank that is late to a setup keeps the others waiting, seconds

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
    "mutated while packed": (mutated_batch, RuntimeError, "changed while it was being packed"),
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
            remove_hooks()
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
            remove_hooks()
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
        remove_hooks()
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
    and tensor data), as loaders with preallocated buffers do, with a 4 MiB tensor among
    them: the source's kept batches must not change with it."""

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


# -- rank functions: setups that disagree, frames out of step, integrity -------------

PG_TIMEOUT = 60.0  # the pool's process group timeout (RankPool's default)


def _is_first_message(tensor: torch.Tensor) -> bool:
    """A head that starts a frame (a spilled header starts with the schema's magic)."""
    return tensor.numel() >= PREFIX_SIZE and bytes(tensor[:4].numpy()) == b"TCFR"


def _prefix_fields(tensor: torch.Tensor) -> dict[str, Any]:
    return dict(
        zip(_frame.PREFIX_FIELDS, _frame._STRUCT.unpack_from(tensor.numpy(), 0), strict=True)
    )


def _rewrite_prefix(tensor: torch.Tensor, **fields: Any) -> None:
    """Set fields of a first message's prefix in place: what a lying source would send."""
    values = {**_prefix_fields(tensor), **fields}
    _frame._STRUCT.pack_into(tensor.numpy(), 0, *(values[f] for f in _frame.PREFIX_FIELDS))


def _flip_inline_payload(wire: Any, tensor: torch.Tensor, root: int) -> None:
    """A bad link, on a receiver: one byte of a payload that travelled inline flipped in
    the first message after it arrived (after the source computed its CRC, so the check
    sees what a flaky interconnect would produce)."""
    if wire.rank == root or not _is_first_message(tensor):
        return
    fields = _prefix_fields(tensor)
    if fields["flags"] & Flags.INLINE and fields["payload_len"]:
        plan = cut_frame(
            tensor.numel(), fields["header_len"], fields["payload_len"], host_payloads=True
        )
        tensor[plan.payload_at + plan.payload_len // 2] ^= 0x5A


def _flip_payload(wire: Any, tensor: torch.Tensor, root: int) -> None:
    """The same for a payload that travelled in a message of its own."""
    if wire.rank != root and tensor.numel():
        tensor[tensor.numel() // 2] ^= 0x5A


@contextlib.contextmanager
def _bad_link(tap: WireTap) -> Iterator[None]:
    with tap.hook("head", after=_flip_inline_payload), tap.hook("payload", after=_flip_payload):
        yield


@in_a_new_process_group
def _setups_that_disagree(rank: int, world: int) -> dict[str, Any]:
    """Ranks that build the same loader (or broadcast) with other arguments all raise
    DesyncError when they build it, naming both sides; then they are still in step."""
    out: dict[str, Any] = {}
    group = dist.group.WORLD
    want = [good_batch(0, s) for s in range(3)]

    def desync(key: str, build: Callable[[], Any]) -> None:
        start = time.monotonic()
        with pytest.raises(tc.DesyncError) as info:
            build()
        assert time.monotonic() - start < TIMEOUT + MARGIN, key
        out[key] = str(info.value)

    def in_step(what: str) -> None:
        loader = tc.BroadcastingDataLoader(
            want if rank == 0 else None, group=group, src=0, timeout=TIMEOUT
        )
        got = list(loader)
        assert len(got) == len(want), what
        for a, b in zip(got, want, strict=True):
            assert_same(a, b, what)

    in_step("before")  # makes tensorcast's group over both ranks
    desync(
        "prefetch",
        lambda: tc.BroadcastingDataLoader(
            want if rank == 0 else None, group=group, src=0, prefetch=1 + rank, timeout=TIMEOUT
        ),
    )
    desync(
        "src",  # each rank thinks it is the source
        lambda: tc.BroadcastingDataLoader(want, group=group, src=rank, timeout=TIMEOUT),
    )
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("cp", "tp"))
    axes = ("cp", "tp") if rank == 0 else ("tp",)  # both span the same ranks
    desync(
        "axes",
        lambda: tc.BroadcastingDataLoader(
            want if rank == 0 else None, mesh, axes=axes, timeout=TIMEOUT
        ),
    )
    real_format = codec.FORMAT_VERSION  # what the transport's setup agreement reads
    if rank == 1:
        codec.FORMAT_VERSION = real_format + 1  # a rank with another tensorcast
    try:
        desync("format", lambda: tc.BroadcastingDataLoader(want if rank == 0 else None, mesh))
    finally:
        codec.FORMAT_VERSION = real_format
    if rank == 1:
        os.environ["TENSORCAST_PROMISES"] = "0"  # one rank runs without promised payloads
    try:
        desync("promises", lambda: tc.BroadcastingDataLoader(want if rank == 0 else None, mesh))
    finally:
        os.environ.pop("TENSORCAST_PROMISES", None)
    in_step("after the loaders that disagreed")
    # tc.broadcast from a source the ranks disagree on, the first time each is used.
    desync("broadcast_src", lambda: tc.broadcast(good_batch(0, 0), rank))
    # A rank that does not come: the one that waits names it, within its timeout; the
    # late one is told at once that the other gave up (it makes no group).
    if rank == 1:
        desync(
            "missing",
            lambda: tc.BroadcastingDataLoader(None, group=group, src=0, timeout=LATE),
        )
    else:
        time.sleep(2 * LATE)
        desync("late", lambda: tc.BroadcastingDataLoader(want, group=group, src=0, timeout=TIMEOUT))
    dist.barrier()
    in_step("after a rank that did not come")
    return out


@tapped
def _integrity(rank: int, world: int, tap: WireTap) -> dict[str, Any]:
    """verify=True carries a CRC32 and checks it, inline, in a message of its own and over
    megabytes; bytes corrupted in transit are caught with it, delivered silently without."""
    out: dict[str, Any] = {}
    group = dist.group.WORLD
    batches = [
        good_batch(2, 0),  # inline in the first message
        {"big": torch.arange(1 << 17, dtype=torch.float32)},  # 512 KiB: a message of its own
        {"large": torch.arange(1 << 20, dtype=torch.float32), "after": torch.arange(3)},
        {"nothing": None, "empty": torch.empty(0, 3)},  # no payload bytes at all
    ]
    repeated = [b for b in batches for _ in range(3)]
    for prefetch in (0, 2):
        loader = tc.BroadcastingDataLoader(
            repeated if rank == 0 else None, group=group, src=0, prefetch=prefetch,
            timeout=TIMEOUT, verify=True,
        )  # fmt: skip
        got = list(loader)
        assert len(got) == len(repeated)
        for a, b in zip(got, repeated, strict=True):
            assert_same(a, b, f"verify=True, prefetch={prefetch}")

    # A message of its own, inline, megabytes, and a payload promised (the third of one
    # size in a row, posted with its first message): should a receiver break its channel
    # on the way, the source is left with no payload it cannot send.
    corrupted = [batches[1], batches[0], batches[2], batches[2], batches[2]]
    # Without verify, corruption in transit goes unseen: the receiver's tree differs.
    loader = tc.BroadcastingDataLoader(
        corrupted if rank == 0 else None, group=group, src=0, prefetch=0, timeout=TIMEOUT
    )
    with _bad_link(tap):
        got = list(loader)
    assert len(got) == len(corrupted)
    for a, b in zip(got, corrupted, strict=True):
        if rank == 0:
            assert_same(a, b, "the source's own tree")
        else:
            assert tree_digest(a) != tree_digest(b), "the corruption did not reach the tree"
    dist.barrier()

    # With verify, each corrupted batch is an error on the receiver, of that batch alone:
    # the next one is received (and fails its check too).
    loader = tc.BroadcastingDataLoader(
        corrupted if rank == 0 else None, group=group, src=0, prefetch=0, timeout=TIMEOUT,
        verify=True,
    )  # fmt: skip
    it = iter(loader)
    with _bad_link(tap):
        for step, want in enumerate(corrupted):
            if rank == 0:
                assert_same(next(it), want, f"the source's own batch {step}")
            else:
                with pytest.raises(tc.TensorcastError, match="CRC32") as info:
                    next(it)
                out.setdefault("crc", []).append(f"{type(info.value).__name__}: {info.value}")
    dist.barrier()
    return out


@in_a_new_process_group
def _out_of_step(rank: int, world: int) -> dict[str, Any]:
    """A loader restarted on one rank mid-epoch: the receiver's new pass is handed a frame
    of the source's old one where its own first frame was due (each frame carries its
    pass and step, NOTE [ Where a pass ends ]): DesyncError at once, and its channel
    refuses any further use."""
    out: dict[str, Any] = {}
    source = _Passes([[lambda s=s: good_batch(1, s) for s in range(4)]]) if rank == 0 else None
    loader = tc.BroadcastingDataLoader(
        source, group=dist.group.WORLD, src=0, prefetch=0, timeout=TIMEOUT
    )
    it = iter(loader)
    for step in range(3):
        assert_same(next(it), good_batch(1, step))
    if rank == 0:
        assert_same(next(it), good_batch(1, 3))
    else:
        start = time.monotonic()
        with pytest.raises(tc.DesyncError) as info:
            next(iter(loader))  # this rank starts pass 2 while the source is in pass 1
        assert time.monotonic() - start < TIMEOUT + MARGIN
        msg = str(info.value)
        assert "expected channel" in msg and "pass 2 step 0" in msg, msg
        assert "pass 1 step 3" in msg and "after different batches" in msg, msg
        out["restart"] = msg
        start = time.monotonic()
        with pytest.raises(tc.PeerError, match="failed earlier") as info:
            next(iter(loader))  # at once, without waiting on the group
        assert time.monotonic() - start < LATE
        out["after"] = str(info.value)
    dist.barrier()
    return out


def _lie_in_values(wire: Any, tensor: torch.Tensor, root: int) -> None:
    """On the source: the fourth frame's header says a bare 1234567890 where the structure
    has its one small value (valid JSON of the right length, not a valid value)."""
    if wire.rank != root or not _is_first_message(tensor):
        return
    if _prefix_fields(tensor)["step"] == 3:
        data = tensor.numpy()
        at = data.tobytes().index(b'[["i",1003]]')
        data[at : at + 12] = np.frombuffer(b"[1234567890]", np.uint8)


def _tamper_on_receiver(change: dict[str, Any]) -> Callable[..., None]:
    """On the receiver: the first message of step 3 rewritten after it arrived."""

    def tamper(wire: Any, tensor: torch.Tensor, root: int) -> None:
        if wire.rank == root or not _is_first_message(tensor):
            return
        if _prefix_fields(tensor)["step"] == 3:
            _rewrite_prefix(tensor, **change)

    return tamper


# name -> (floats in each batch, hook: (where, the hook), what the receiver's error says)
LIES: dict[str, tuple[int, tuple[str, Callable[..., None]], str]] = {
    "lying values": (4, ("before", _lie_in_values), "invalid value token"),
    # With a payload that follows the first message, the receiver refuses the frame before
    # it takes the payload.
    "lying values, payload": (75_000, ("before", _lie_in_values), "invalid value token"),
    # An inline frame whose flags say its payload follows: the cut is checked.
    "cut flags": (4, ("after", _tamper_on_receiver({"flags": 0})), "the frame is cut as"),
    # A payload of 1 TiB announced (in a message of its own) for an empty buffer: refused
    # before any allocation.
    "absurd payload size": (
        0,
        ("after", _tamper_on_receiver({"payload_len": 1 << 40, "flags": 0})),
        "a 0-byte buffer but the frame carries 1099511627776 bytes",
    ),
    "unknown kind": (4, ("after", _tamper_on_receiver({"kind": 7})), "unknown frame kind 7"),
    "other version": (
        4,
        ("after", _tamper_on_receiver({"version": FRAMES_VERSION + 1})),
        f"speaks frames v{FRAMES_VERSION}",
    ),
}


#: the timeout of the frames that lie: the source of a frame its receiver refuses waits
#: it out, in 4 of the scenarios; the frames before take milliseconds
LIE_TIMEOUT = 3.0


@tapped
def _lying_frame(rank: int, world: int, tap: WireTap, name: str) -> dict[str, Any]:
    """Frames 0-2 arrive; frame 3 lies (on the source) or is garbled (on the receiver):
    the receiver raises HeaderError. Then the source sends frame 4: a receiver that could
    not read frame 3 to its end refuses it at once (PeerError: its channel cannot be
    trusted); one that read it whole may take frame 4 instead. No rank hangs."""
    size, (where, hook), _ = LIES[name]
    out: dict[str, Any] = {}
    wanted = [{"x": torch.full((size,), float(step)), "n": 1000 + step} for step in range(5)]
    with tap.hook("head", **{where: hook}):
        for step, want in enumerate(wanted):
            start = time.monotonic()
            if rank == 0:
                try:
                    assert_same(tc.broadcast(want, 0, timeout=LIE_TIMEOUT), want)
                except tc.PeerError as e:  # the receiver left before it took the payload
                    assert step >= 3, f"step {step}: {e}"
                    out.setdefault("source", []).append(str(e))
            elif step < 3:
                assert_same(tc.broadcast(None, 0, timeout=LIE_TIMEOUT), want)
            elif step == 3:
                with pytest.raises(tc.HeaderError) as info:
                    tc.broadcast(None, 0, timeout=LIE_TIMEOUT)
                out["error"] = str(info.value)
            else:
                try:
                    got = tc.broadcast(None, 0, timeout=LIE_TIMEOUT)
                except tc.PeerError as e:
                    assert "failed earlier" in str(e), str(e)
                    assert time.monotonic() - start < LATE, "a broken channel refuses at once"
                    out["after"] = "refused"
                else:
                    assert_same(got, want, "the frame after the one refused")
                    out["after"] = "received"
            assert time.monotonic() - start < LIE_TIMEOUT + MARGIN, f"step {step}"
    return out


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


def test_setups_that_disagree_raise_desync_error_on_every_rank(pool2: RankPool) -> None:
    results = pool2.run(_setups_that_disagree, timeout=CALL_TIMEOUT)
    for rank, (me, other) in enumerate(((0, 1), (1, 0))):
        out = results[rank]
        mine = {"prefetch": 1 + me, "src": me, "format": tc.FORMAT_VERSION + me}
        theirs = {"prefetch": 1 + other, "src": other, "format": tc.FORMAT_VERSION + other}
        mine["promises"], theirs["promises"] = me == 0, other == 0
        for key in ("prefetch", "src", "format", "promises"):
            side = f"{key}={mine[key]} on rank {me}, {theirs[key]} on rank {other}"
            assert side in out[key], (rank, out[key])
        assert "BroadcastingDataLoader" in out["prefetch"]
        axes = ["['cp', 'tp'] on rank 0", "['tp'] on rank 1"]
        assert "axes=" in out["axes"] and all(a in out["axes"] for a in axes), out["axes"]
        side = f"src={me} on rank {me}, {other} on rank {other}"
        assert "tensorcast.broadcast" in out["broadcast_src"] and side in out["broadcast_src"]
    missing = results[1]["missing"]
    assert "rank(s) [0] did not set up" in missing and f"within {LATE:g} s" in missing, missing
    assert "rank 1 gave up waiting" in results[0]["late"], results[0]["late"]


def test_integrity_checks_and_corruption_in_transit(pool2: RankPool) -> None:
    """verify=True round trips; a bad link corrupts bytes silently without it, and every
    corrupted batch (inline, in a message of its own, megabytes) fails its CRC32 with it."""
    _, recv = pool2.run(_integrity, timeout=CALL_TIMEOUT)
    assert len(recv["crc"]) == 5, recv["crc"]


def test_a_receiver_out_of_step_raises_desync_error(pool2: RankPool) -> None:
    _, recv = pool2.run(_out_of_step, timeout=CALL_TIMEOUT)
    assert "after different batches" in recv["restart"]
    assert "DesyncError" in recv["after"]  # what broke the channel, named


@pytest.mark.parametrize("name", list(LIES))
def test_lying_or_garbled_frames_raise_header_error(pool2: RankPool, name: str) -> None:
    _, recv = pool2.run(_lying_frame, name, timeout=CALL_TIMEOUT)
    assert LIES[name][2] in recv["error"], recv["error"]
    if name.startswith("lying values"):
        assert "1234567890" in recv["error"]
    else:  # the frame could not be read to its end: the channel is broken on this rank
        assert recv["after"] == "refused", recv


def test_source_death_fails_every_receiver(pool2: RankPool) -> None:
    results = pool2.run(_die_at, 0, 3, (), timeout=CALL_TIMEOUT, allow_death=True)
    _check_survivors(results, 0, {1: "waiting for the source rank 0"})
    assert "the source rank 0 is gone" in results[1]["message"], results[1]["message"]


def test_receiver_death_fails_source_and_other_receivers(pool4: RankPool) -> None:
    results = pool4.run(_die_at, 3, 3, (2, 2), timeout=CALL_TIMEOUT, allow_death=True)
    _check_survivors(
        results,
        3,
        {
            0: "sending a frame failed: a receiver died",
            1: "waiting for the source rank 0",
            2: "waiting for the source rank 0",
        },
    )
