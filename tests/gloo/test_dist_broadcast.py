"""Multi-process tests of ``tc.broadcast`` and ``tc.broadcast_batch`` on real gloo groups.

Every rank builds the expected tree itself (the builders are deterministic), checks what
it received against it, and returns a digest; the test then checks that the digests
agree on every rank, the source included. Each rank function runs several checks so the
number of pool calls (and group set-ups) stays small.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.serialization
from taps import WireTap, first_message_problems, tapped
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import init_device_mesh
from trees import (
    PAYLOAD_STEPS,
    STEADY_STEPS,
    big_header,
    check_same,
    digest,
    every_kind,
    payload_batch,
    steady_batch,
    tensors_of,
    tiny,
)

import tensorcast as tc
from tensorcast.transport import groups as _groups
from tensorcast.transport import wire as _wire
from tensorcast.transport.frame import Flags, Prefix

TIMEOUT = 120.0


class Opaque:
    """A leaf type nobody registered."""

    def __repr__(self) -> str:
        return "Opaque()"


def large() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"audio": torch.randn(300_000, generator=g), "lens": torch.tensor([300_000])}


def large_leaves() -> dict[str, Any]:
    """Several leaves of megabytes: contiguous, non-contiguous (arrives contiguous), a bool
    mask of raw bytes, a complex one, and small leaves between them."""
    g = torch.Generator().manual_seed(4)
    return {
        "audio": torch.randn(4, 150_000, generator=g),
        "lens": torch.tensor([150_000, 1, 2, 3]),
        "feats": torch.randn(700, 800, generator=g).t(),
        "ids": [f"utt-{i}" for i in range(4)],
        "mask": torch.randint(0, 256, (3 << 20,), generator=g, dtype=torch.uint8).view(torch.bool),
        "spec": torch.randn(300_000, generator=g, dtype=torch.complex64),
        "tail": torch.arange(5),
    }


def large_leaf_and_rest() -> dict[str, Any]:
    """A 4 MiB leaf, then 400 KB more."""
    g = torch.Generator().manual_seed(5)
    return {"audio": torch.randn(1 << 20, generator=g), "rest": torch.randn(100_000, generator=g)}


def big_header_and_payload() -> dict[str, Any]:
    return {**big_header(), "x": torch.arange(70_000, dtype=torch.float32)}


CASES: dict[str, Callable[[], Any]] = {
    "tiny": tiny,
    "every_kind": every_kind,
    "large": large,
    "tiny_after_large": tiny,
    "large_leaves": large_leaves,
    "large_leaf_and_rest": large_leaf_and_rest,
    "big_header": big_header,
    "big_header_and_payload": big_header_and_payload,
    "none": lambda: None,
    "empty_list": list,
}


# (case, head messages, payload messages): how each of these batches travels. Heads are
# the first message and, when it did not fit, the header on its own (see ``transport.frame``).
MESSAGES = [("tiny", 1, 0), ("large", 1, 1), ("big_header", 2, 0)]


# -- helpers run inside the ranks ---------------------------------------------------------


class CountMessages:
    """Counts the messages tensorcast moves while in a ``with``: ``log`` names each one
    (``"head"`` or ``"payload"``: every message goes through a wire's ``head`` or
    ``payload``, which ``tap`` sees), ``calls`` is how many; ``ops`` counts the operations
    this rank posts on torch's gloo backends for them (how many ``broadcast``, ``send`` and
    ``recv``)."""

    OPS = ("broadcast", "send", "recv")
    BACKEND = distributed_c10d.ProcessGroupGloo.__mro__[1]  # the C++ Backend, which has them

    def __init__(self, tap: WireTap, before_head: Callable[..., None] | None = None) -> None:
        self.log: list[str] = []
        self.ops: dict[str, int] = {}
        self._tap = tap
        self._before_head = before_head  # sees every head before it travels

    @property
    def calls(self) -> int:
        return len(self.log)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[CountMessages]:
        group_ops = {op: self.BACKEND.__dict__[op] for op in self.OPS}  # descriptors
        self.log = []
        self.ops = dict.fromkeys(self.OPS, 0)

        def head(wire: Any, *args: Any) -> None:
            self.log.append("head")
            if self._before_head is not None:
                self._before_head(wire, *args)

        def payload(wire: Any, *args: Any) -> None:
            self.log.append("payload")

        def counted(op: str) -> Callable[..., Any]:
            original = getattr(self.BACKEND, op)

            def call(group: Any, *args: Any) -> Any:
                self.ops[op] += 1
                return original(group, *args)

            return call

        for op in self.OPS:
            setattr(self.BACKEND, op, counted(op))
        try:
            with self._tap.hook("head", before=head), self._tap.hook("payload", before=payload):
                yield self
        finally:
            for op, descriptor in group_ops.items():
                setattr(self.BACKEND, op, descriptor)


def tensorcast_groups() -> set[tuple[int, ...]]:
    """The ranks of every group tensorcast made on this rank (it makes one per set)."""
    return set(_groups.world()._groups)


def group_count() -> int:
    return len(distributed_c10d._world.pg_map)


class PickleForbidden(AssertionError):
    pass


@contextlib.contextmanager
def no_pickle() -> Iterator[None]:
    """Make every pickle / torch.load entry point raise, including c10d's own aliases."""
    targets = [
        (pickle, "loads"),
        (pickle, "load"),
        (pickle, "Unpickler"),
        (pickle, "dumps"),
        (pickle, "dump"),
        (pickle, "Pickler"),
        (torch, "load"),
        (torch.serialization, "load"),
        (distributed_c10d, "_pickler"),
        (distributed_c10d, "_unpickler"),
    ]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr in targets]

    def forbid(name: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise PickleForbidden(f"{name} was called")

        return refuse

    for obj, attr, _ in saved:
        setattr(obj, attr, forbid(f"{obj.__name__}.{attr}"))
    try:
        yield
    finally:
        for obj, attr, original in saved:
            setattr(obj, attr, original)


def expect_unsupported_everywhere(rank: int, src: int, send: Callable[[Any], Any]) -> str:
    """Send an unencodable tree from ``src``; return the message this rank raised."""
    bad = {"x": torch.ones(3), "meta": [1, 2, 3, Opaque()]}
    try:
        send(bad if rank == src else None)
    except tc.UnsupportedLeafError as e:
        if rank != src:
            raise AssertionError(f"receiver rank {rank} raised {e!r}") from e
        return str(e)
    except tc.SourceError as e:
        if rank == src:
            raise AssertionError(f"source rank {rank} raised {e!r}") from e
        return str(e)
    raise AssertionError(f"rank {rank}: sending an unencodable tree did not raise")


# -- rank functions -----------------------------------------------------------------------


@tapped
def _rank_two(
    rank: int, world: int, tap: WireTap
) -> tuple[dict[str, Any], dict[str, dict[str, int]]]:
    counter = CountMessages(tap)
    found: dict[str, Any] = {}
    ops: dict[str, dict[str, int]] = {}  # this rank's, which differ between ranks
    kept: list[tuple[str, Any]] = []
    for src in (0, 1):
        for name, build in CASES.items():
            with counter():
                out = tc.broadcast(build() if rank == src else None, src)
            check_same(out, build(), f"{name} from {src}")
            assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors_of(out))
            found[f"{name}/{src}"] = (digest(out), counter.calls)
            ops[f"{name}/{src}"] = counter.ops
            kept.append((name, out))

    # The source's own tree is made of its copy of the batch, not of the input: changing
    # the input afterwards (a loader reusing its tensors) changes nothing.
    g = torch.Generator().manual_seed(6)
    weights = torch.randn(1 << 20, generator=g).requires_grad_()
    grid = torch.randn(1000, 1000, generator=g).t()
    want = {"w": weights.detach().clone(), "grid": grid.contiguous()}
    out = tc.broadcast({"w": weights, "grid": grid} if rank == 0 else None, 0)
    with torch.no_grad():
        weights.zero_()
        grid.zero_()
    check_same(out, want, "large leaves, inputs changed afterwards")
    assert not out["w"].requires_grad and out["grid"].is_contiguous()

    # a CPU with an index is the CPU (torch.device("cpu", 0) != torch.device("cpu")): on one
    # rank only, too, and the next call still agrees
    for device in ("cpu", torch.device("cpu"), "cpu:0", torch.device("cpu", 0)):
        out = tc.broadcast(large() if rank == 1 else None, 1, device=device)
        check_same(out, large(), f"device={device!r}")
        assert all(t.device == torch.device("cpu") for t in tensors_of(out))
        out = tc.broadcast(tiny() if rank == 0 else None, 0, device=device if rank else None)
        check_same(out, tiny(), f"device={device!r} on rank 1 only")

    # timeout= in seconds or as a timedelta; a bad one is refused before anything travels.
    for timeout in (30, 30.0, datetime.timedelta(seconds=30)):
        out = tc.broadcast(tiny() if rank == 0 else None, 0, timeout=timeout)
        check_same(out, tiny(), f"timeout={timeout!r}")
    for timeout in (0, -1.0, True, "30"):
        with pytest.raises(ValueError, match="timeout"):
            tc.broadcast(tiny() if rank == 0 else None, 0, timeout=timeout)  # type: ignore[arg-type]
    check_same(tc.broadcast(tiny() if rank == 1 else None, 1), tiny(), "after bad timeouts")

    # 1-D ("cp",) mesh: tensorcast's group over its ranks, created once (the same one
    # tc.broadcast used on these ranks).
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    first = tc.broadcast_batch(tiny() if tc.is_dp_source_rank(mesh) else None, mesh)
    groups = group_count()
    made = tensorcast_groups()
    assert made == {(0, 1)}, made
    for step in range(5):
        batch = {"step": step, "x": torch.full((3,), step)} if rank == 0 else None
        check_same(
            tc.broadcast_batch(batch, mesh),
            {"step": step, "x": torch.full((3,), step)},
            f"1-D mesh step {step}",
        )
    assert group_count() == groups, "broadcast_batch created process groups after the first call"
    assert tensorcast_groups() == made, "broadcast_batch made a group after the first call"
    check_same(first, tiny(), "1-D mesh first batch")

    # The pool hands a buffer out again only when nothing views it: all kept trees intact.
    for name, out in kept:
        check_same(out, CASES[name](), f"{name}, kept while later batches arrived")

    # A caller's group only names the ranks: nothing travels on it, so destroying it
    # leaves a tree received through it intact, and a new group over the same ranks uses
    # the same tensorcast group.
    group = dist.new_group([0, 1])
    out = tc.broadcast(large() if rank == 0 else None, 0, group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    check_same(out, large(), "a tree received on a group destroyed since")
    again = dist.new_group([0, 1])
    for src in (1, 0):
        out = tc.broadcast(every_kind() if rank == src else None, src, again)
        check_same(out, every_kind(), f"a new group over the same ranks, from {src}")
    assert tensorcast_groups() == made, "a caller's group made a tensorcast group of its own"
    dist.destroy_process_group(again)
    return found, ops


@tapped
def _rank_four(rank: int, world: int, tap: WireTap) -> dict[str, Any]:
    found: dict[str, Any] = {}

    # 2-D ("cp", "tp") mesh: one flattened group of 4, created on the first call only.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    assert tc.is_dp_source_rank(mesh) == (rank == 0)
    before = group_count()
    outs = []
    for step in range(6):
        build = large if step == 3 else every_kind if step == 4 else tiny
        out = tc.broadcast_batch(build() if rank == 0 else None, mesh)
        check_same(out, build(), f"2-D mesh step {step}")
        outs.append(digest(out))
        if step == 0:
            created = group_count() - before
            made = tensorcast_groups()
    assert group_count() == before + created, "groups re-created after the first call"
    assert created <= 1
    assert tensorcast_groups() == made, "broadcast_batch made a group after the first call"
    assert (0, 1, 2, 3) in made
    found["2d"] = outs
    counter = CountMessages(tap)
    for name in ("tiny", "large"):
        with counter():
            out = tc.broadcast_batch(CASES[name]() if rank == 0 else None, mesh)
        check_same(out, CASES[name](), f"2-D mesh, {name}, counted")
        found[f"{name}_ops"] = counter.ops

    # A second, equal mesh is another object over the same ranks: it travels on the same
    # tensorcast group (groups are made once per set of ranks, never cached by id()).
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    for _ in range(2):
        out = tc.broadcast_batch(tiny() if rank == 0 else None, other)
        check_same(out, tiny(), "second mesh")
    assert tensorcast_groups() == made, "an equal mesh made a group of its own"
    del other
    gc.collect()
    out = tc.broadcast_batch(large() if rank == 0 else None, mesh)
    check_same(out, large(), "the first mesh after the second one")

    # ("dp", "cp") with the default axes: tp is absent, cp spans; one source per DP slot.
    dpcp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp = dpcp.get_local_rank("dp")
    assert tc.is_dp_source_rank(dpcp) == (rank in (0, 2))
    for step in range(3):
        want = {"dp": dp, "step": step, "x": torch.full((5,), 10 * dp + step)}
        out = tc.broadcast_batch(want if tc.is_dp_source_rank(dpcp) else None, dpcp)
        check_same(out, want, f"dp slot {dp} step {step}")

    # No-op cases: the very same object back.
    batch = {"x": torch.ones(2)}
    assert tc.broadcast_batch(batch, None) is batch
    assert tc.broadcast_batch(batch, init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))) is batch
    ones = init_device_mesh("cpu", (4, 1, 1), mesh_dim_names=("dp", "cp", "tp"))
    assert tc.is_dp_source_rank(ones)
    assert tc.broadcast_batch(batch, ones) is batch
    assert tc.broadcast_batch(batch, mesh, axes=("pp",)) is batch
    assert tc.broadcast_batch(batch, mesh, axes=()) is batch

    # A non-zero source on a group that leaves rank 0 out; src is a global rank.
    group = dist.new_group([1, 2, 3])
    if rank != 0:
        for src in (3, 2):
            out = tc.broadcast(every_kind() if rank == src else None, src, group=group)
            check_same(out, every_kind(), f"group [1, 2, 3] from {src}")
            found[f"group/{src}"] = digest(out)
    out = tc.broadcast(large() if rank == 2 else None, 2)  # default group, source 2
    check_same(out, large(), "default group from 2")

    # An unencodable tree: the source raises it, receivers learn why; the channel lives on.
    message = expect_unsupported_everywhere(rank, 0, lambda b: tc.broadcast_batch(b, mesh))
    found["unsupported"] = message
    out = tc.broadcast_batch(tiny() if rank == 0 else None, mesh)
    check_same(out, tiny(), "after an unencodable tree")
    if rank != 0:
        message = expect_unsupported_everywhere(rank, 3, lambda b: tc.broadcast(b, 3, group))
        found["unsupported_group"] = message
        check_same(tc.broadcast(tiny() if rank == 3 else None, 3, group), tiny(), "group after")
    # The channel a (group, src) used last is remembered between calls; once that group
    # is gone, the same src with group=None means every rank, not the group's ranks.
    dist.destroy_process_group(group)
    group = None  # the last reference (the lambda above shares it): the group is freed
    gc.collect()
    check_same(tc.broadcast(tiny() if rank == 3 else None, 3), tiny(), "default group after")
    return found


@tapped
def _rank_dp_slots(rank: int, world: int, tap: WireTap) -> list[tuple[int, int]]:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    dp = mesh.get_local_rank("dp")
    source = tc.is_dp_source_rank(mesh)
    assert source == (rank in (0, 4))

    def batch(step: int) -> dict[str, Any]:
        size = 100_000 if step == 1 else 8  # one step over 256 KiB, the others inline
        return {"dp": dp, "step": step, "x": torch.full((size,), 1000.0 * dp + step)}

    seen = []
    groups = -1
    made: set[tuple[int, ...]] = set()
    for step in range(4):
        out = tc.broadcast_batch(batch(step) if source else None, mesh)
        check_same(out, batch(step), f"dp slot {dp} step {step}")
        seen.append((out["dp"], out["step"]))
        if step == 0:
            groups = group_count()
            made = tensorcast_groups()
    assert group_count() == groups, "groups re-created after the first call"
    assert tensorcast_groups() == made, "broadcast_batch made a group after the first call"
    slot = (0, 1, 2, 3) if dp == 0 else (4, 5, 6, 7)
    assert slot in made, made

    # The whole world is a group of 8, over HEAD_SENDS_MAX_RANKS: its heads are
    # broadcasts (gloo's tree), and the same frames arrive.
    assert world > _wire.HEAD_SENDS_MAX_RANKS
    counter = CountMessages(tap)
    for name, headers, payloads in MESSAGES:
        with counter():
            out = tc.broadcast(CASES[name]() if rank == 0 else None, 0)
        check_same(out, CASES[name](), f"{name} on a group of 8")
        assert counter.ops == {"broadcast": headers + payloads, "send": 0, "recv": 0}, name
    # A payload whose size repeats is promised there too: posted with the first message, as
    # a broadcast in the same order on every rank (the heads are broadcasts here as well).
    logs = []
    for i in range(3):
        with counter():
            out = tc.broadcast(CASES["large"]() if rank == 0 else None, 0)
        check_same(out, CASES["large"](), f"large {i} on a group of 8")
        assert counter.ops == {"broadcast": 2, "send": 0, "recv": 0}, i
        logs.append(counter.log)
    assert logs == [["head", "payload"], ["head", "payload"], ["payload", "head"]], logs
    return seen


def _rank_zero_pickle(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    tc.broadcast_batch(tiny() if rank == 0 else None, mesh)  # creates the groups
    source = rank == 0
    digests = []
    with no_pickle():
        with pytest.raises(PickleForbidden):
            pickle.dumps(1)
        trees = [
            tiny(),
            {"text": ["a", "b" * 5000], "n": [1, -(2**80)], "t": torch.arange(6).reshape(2, 3)},
            every_kind(),
            large(),
            big_header_and_payload(),
        ]
        for tree in trees:
            out = tc.broadcast_batch(tree if source else None, mesh)
            check_same(out, tree, "without pickle")
            digests.append(digest(out))
            out = tc.broadcast(tree if rank == 3 else None, 3)
            check_same(out, tree, "without pickle, default group")
        expect_unsupported_everywhere(rank, 0, lambda b: tc.broadcast_batch(b, mesh))
        for prefetch in (0, 1):
            loader = tc.BroadcastingDataLoader(trees if source else None, mesh, prefetch=prefetch)
            got = list(loader)
            assert len(got) == len(trees)
            for out, tree in zip(got, trees, strict=True):
                check_same(out, tree, f"loader without pickle, prefetch={prefetch}")
    pickle.loads(pickle.dumps(1))  # restored
    return digests


# -- tests --------------------------------------------------------------------------------


def test_broadcast_trees_of_every_kind_on_two_ranks(pool2: Any) -> None:
    (found, ops0), (found1, ops1) = pool2.run(_rank_two, timeout=TIMEOUT)
    assert found == found1
    for key, (got, _) in found.items():
        assert got == digest(CASES[key.split("/")[0]]()), key
    calls = {key: n for key, (_, n) in found.items()}
    for src in (0, 1):
        assert calls[f"tiny/{src}"] == 1, "a tiny batch travels in one message"
        assert calls[f"tiny_after_large/{src}"] == 1
        assert calls[f"none/{src}"] == 1
        assert calls[f"large/{src}"] == 2, "first message, then the >256 KiB payload"
        assert calls[f"big_header/{src}"] == 2, "a >256 KiB header spills into a second message"
        assert calls[f"big_header_and_payload/{src}"] >= 2
        assert calls[f"large_leaves/{src}"] == 2, "first message, then the one payload"
        assert calls[f"large_leaf_and_rest/{src}"] == 2
        # On gloo, heads are one send to each receiver (the group's worker thread never
        # sees them); payloads are broadcasts.
        source, receiver = (ops0, ops1) if src == 0 else (ops1, ops0)
        for name, headers, payloads in MESSAGES:
            key = f"{name}/{src}"
            assert source[key] == {"broadcast": payloads, "send": headers, "recv": 0}, key
            assert receiver[key] == {"broadcast": payloads, "send": 0, "recv": headers}, key


def test_broadcast_on_meshes_and_groups_of_four(pool4: Any) -> None:
    results = pool4.run(_rank_four, timeout=TIMEOUT)
    assert all(r["2d"] == results[0]["2d"] for r in results)
    # The source sends each receiver the head itself; payloads are broadcasts.
    for name, payloads in [("tiny", 0), ("large", 1)]:
        key = f"{name}_ops"
        assert results[0][key] == {"broadcast": payloads, "send": 3, "recv": 0}, name
        assert all(r[key] == {"broadcast": payloads, "send": 0, "recv": 1} for r in results[1:])
    for src in (2, 3):
        assert {r[f"group/{src}"] for r in results[1:]} == {digest(every_kind())}
    source_message, *receiver_messages = (r["unsupported"] for r in results)
    assert "batch['meta'][3]" in source_message and "Opaque" in source_message
    for message in receiver_messages:
        assert "batch serialization failed" in message
        assert source_message in message
    messages = [results[r]["unsupported_group"] for r in (1, 2)]
    source_message = results[3]["unsupported_group"]
    assert all("batch serialization failed" in m and source_message in m for m in messages)


def test_every_dp_slot_gets_its_own_source_batches(pool8: Any) -> None:
    seen = pool8.run(_rank_dp_slots, timeout=TIMEOUT)
    for rank, steps in enumerate(seen):
        dp = rank // 4
        assert steps == [(dp, step) for step in range(4)], f"rank {rank}"


@tapped
def _rank_changing(rank: int, world: int, tap: WireTap) -> tuple[list[list[str]], list[str]]:
    """Every step's messages in order, and what was wrong with the source's first
    messages, for batches whose header, then payload, change as they go."""
    problems: list[str] = []
    spilled = [False]  # the next head is the header of a frame that spilled it
    where = [""]

    def look(wire: Any, tensor: torch.Tensor, root: int, *args: Any) -> None:
        if wire.rank != root:
            return
        if spilled[0]:
            spilled[0] = False
            return
        spilled[0] = bool(Prefix.unpack(tensor.numpy().data, tensor.numel()).flags & Flags.SPILL)
        problems.extend(f"{where[0]}: {p}" for p in first_message_problems(tensor))

    counter = CountMessages(tap, look)
    steps = [(f"steady {i}", steady_batch, i) for i in range(STEADY_STEPS)]
    steps += [(f"payload {i}", payload_batch, i) for i in range(PAYLOAD_STEPS)]
    logs = []
    for name, make, i in steps:
        where[0] = name
        with counter():
            out = tc.broadcast(make(i) if rank == 0 else None, 0)
        check_same(out, make(i), name)
        del out  # as a training loop drops the batch before it fetches the next
        logs.append(counter.log)
    return logs, problems


def test_batches_whose_header_or_payload_changes_arrive_as_sent(pool2: Any) -> None:
    """Headers that repeat, then change (a shape, a dtype, a small value, a length), and
    payloads that follow the first message: every rank returns what was sent, in the
    messages the frame's plan says, and the source's first messages carry no stale bytes."""
    (source, problems), (receiver, _) = pool2.run(_rank_changing, timeout=TIMEOUT)
    assert source == receiver
    # Payloads that follow the first message: a size that repeats twice is promised, its
    # payload then posted with the first message; a promise not kept costs zeros first.
    after, promised, broken = (
        ["head", "payload"],
        ["payload", "head"],
        ["payload", "head", "payload"],
    )
    payloads = [after, after, *[promised] * 4]  # phase 0: one size
    payloads += [broken, *[after] * 3, *[promised] * 2]  # phase 1: the next needs a run of 4
    payloads += [broken, after, after, after]  # phase 2: a new size every step
    assert len(payloads) == PAYLOAD_STEPS
    assert source == [["head"]] * STEADY_STEPS + payloads
    assert problems == []


def test_nothing_is_pickled_on_any_rank(pool4: Any) -> None:
    digests = pool4.run(_rank_zero_pickle, timeout=TIMEOUT)
    assert all(d == digests[0] for d in digests)
