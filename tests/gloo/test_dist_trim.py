"""Trimmed leaves on real gloo groups: padding never travels, and every rank gets the batch
bit for bit (``../shared/CONTRACT.md``: "Codec", "Broadcast", "BroadcastingDataLoader", issue 34).

The law, checked by hypothesis on 2 and 4 ranks, with ``trim`` on and off::

    for every rank r:  tc.broadcast(tree, 0)  on r  ==  tree   (bit for bit)
                       each batch the loader yields on r  ==  the source's batch

for trees whose leaves carry random trailing runs: every dtype, NaN payloads and -0.0 as run
elements and as data, rows with no run and rows that are all run, zero-length dimensions,
non-contiguous tensors and ndarrays. Hypothesis draws each tree's description in the test
process (small, so it shrinks); every rank builds the tree from it deterministically and
checks what it received against its own build.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from models import dp_tp_mesh, model_step
from trees import check_same, digest

import tensorcast as tc
from tensorcast.bench.baselines import batch_nbytes
from tensorcast.bench.workloads import make_workload

pytestmark = pytest.mark.dist
TIMEOUT = 60.0
SETTINGS = settings(deadline=None, print_blob=True, max_examples=10, derandomize=True)

# fmt: off
DTYPES = ["bool", "uint8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64", "complex64", "complex128", "float8_e4m3fn"]
NUMPY = {"bool", "uint8", "int16", "int32", "int64", "float16", "float32", "float64",
         "complex64", "complex128"}
# fmt: on
#: a run's element, as raw bits: zero, -0.0 (the sign bit), a NaN with a payload, any bits
RUN_ELEMENTS = ("zero", "neg_zero", "nan_payload", "random")


@dataclass(frozen=True)
class Leaf:
    """How to build one leaf: ``rows`` rows of shape ``row``, each ending in a run of
    ``element`` whose length is drawn from ``fill`` (share of the row, at most)."""

    dtype: str
    rows: int
    row: tuple[int, ...]
    element: str
    fill: float
    seed: int
    layout: str  # "contiguous", "transposed", "strided"
    ndarray: bool
    no_run_row: bool
    all_run_row: bool


def _element(dtype: torch.dtype, kind: str, rng: np.random.Generator) -> np.ndarray:
    """The run's element as its bytes."""
    size = torch.empty(0, dtype=dtype).element_size()
    if dtype == torch.bool:
        return np.array([0 if kind in ("zero", "neg_zero") else 1], dtype=np.uint8)
    bits = np.zeros(size, dtype=np.uint8)
    part = size // 2 if dtype.is_complex else size  # the real part of a complex
    if kind == "neg_zero":
        bits[part - 1] = 0x80  # little-endian: the sign bit of the (real part's) top byte
    elif kind == "nan_payload":
        bits[:part] = 0xFF
        bits[part - 1] = 0x7F  # every exponent bit, the top mantissa bit and a payload
        bits[0] = 0xA5 if part > 1 else 0x7F  # float8_e4m3fn's only NaN is 0x7F
    elif kind == "random":
        bits[:] = rng.integers(0, 256, size, dtype=np.uint8)
    return bits


def build_leaf(leaf: Leaf) -> Any:
    """The leaf ``leaf`` describes, the same on every rank."""
    rng = np.random.default_rng(leaf.seed)
    dtype = getattr(torch, leaf.dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    shape = (leaf.rows, *leaf.row)
    per_row = int(np.prod(leaf.row)) if leaf.row else 1
    raw = rng.integers(0, 256, leaf.rows * per_row * size, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    data = raw.reshape(leaf.rows, per_row * size)
    if dtype.is_floating_point or dtype.is_complex:  # -0.0 and NaN payloads as data too
        width = size // 2 if dtype.is_complex else size
        for kind in ("neg_zero", "nan_payload"):
            for r in range(leaf.rows):
                if per_row:
                    at = int(rng.integers(0, per_row)) * size
                    data[r, at : at + width] = _element(dtype, kind, rng)[:width]
    element = _element(dtype, leaf.element, rng)
    share = (1 + rng.random(leaf.rows)) / 2 * leaf.fill  # of each row: from fill / 2 to fill
    runs = (share * (per_row + 1)).astype(np.int64).clip(0, per_row)
    if leaf.rows and leaf.no_run_row:
        runs[0] = 0
    if leaf.rows and leaf.all_run_row:
        runs[-1] = per_row
    for r, k in enumerate(runs.tolist()):
        if k:
            data[r, (per_row - k) * size :] = np.tile(element, k)
    flat = torch.from_numpy(data.reshape(-1).copy())
    # torch cannot view an empty byte tensor as a wider dtype
    t = flat.view(dtype).reshape(shape) if flat.numel() else torch.empty(shape, dtype=dtype)
    if leaf.layout == "transposed" and t.dim() >= 2:  # the same values, other strides
        t = t.transpose(0, -1).contiguous().transpose(0, -1)
    elif leaf.layout == "strided":
        wide = torch.empty((*shape[:-1], 2 * shape[-1]) if shape[-1:] else shape, dtype=dtype)
        t = wide[..., ::2].copy_(t) if shape[-1:] else wide.copy_(t)
    return t.numpy() if leaf.ndarray else t


def build_tree(leaves: list[Leaf], step: int = 0) -> dict[str, Any]:
    tree: dict[str, Any] = {f"leaf{i}": build_leaf(leaf) for i, leaf in enumerate(leaves)}
    tree["step"] = step
    tree["lens"] = torch.tensor([leaf.rows for leaf in leaves], dtype=torch.int64)
    return tree


#: a row of this many bytes: the leaves a host receiver's rule trims (they must save 256 KiB
#: plus 24 KiB a row, and 35% of the leaf; ``tensorcast.codec.trim``)
BIG_ROW = 512 << 10


def _row_of(dtype: str) -> int:
    """The elements of a row of :data:`BIG_ROW` bytes."""
    return BIG_ROW // torch.empty(0, dtype=getattr(torch, dtype)).element_size()


@st.composite
def leaves(draw: st.DrawFn) -> Leaf:
    dtype = draw(st.sampled_from(DTYPES))
    n = _row_of(dtype)
    rows = draw(st.sampled_from([0, 1, 3, 4]))
    small = [(0,), (7,), (300,), (2048,), (4, 0), (64, 3), (3, 5, 17)]
    row = draw(st.sampled_from([(n,), (n // 4, 4), (n // 64, 8, 8), *small]))
    return Leaf(
        dtype=dtype,
        rows=rows,
        row=row,
        element=draw(st.sampled_from(RUN_ELEMENTS)),
        fill=draw(st.sampled_from([0.0, 0.3, 0.9, 1.0])),
        seed=draw(st.integers(0, 2**31)),
        layout=draw(st.sampled_from(["contiguous", "transposed", "strided"])),
        ndarray=dtype in NUMPY and draw(st.booleans()),
        no_run_row=draw(st.booleans()),
        all_run_row=draw(st.booleans()),
    )


TREES = st.lists(leaves(), min_size=1, max_size=4)


# -- on the ranks -------------------------------------------------------------------------


def _round_trips(rank: int, world: int, described: list[Leaf]) -> list[str]:
    """Every rank: the tree through tc.broadcast and through the loader (two batches, both
    kept: a later batch does not overwrite an earlier one's rebuilt leaves), trim on and
    off; checked against this rank's own build. The source's own tree is left as it was."""
    want = [build_tree(described, step) for step in range(2)]
    before = [digest(t) for t in want]
    digests = []
    for trim in (True, False):
        mine = build_tree(described) if rank == 0 else None
        got = tc.broadcast(mine, 0, trim=trim)
        check_same(got, want[0], f"rank {rank} tc.broadcast(trim={trim})")
        if mine is not None:
            check_same(mine, want[0], f"the source's tree after tc.broadcast(trim={trim})")
        for prefetch in (0, 1):
            source = [build_tree(described, s) for s in range(2)] if rank == 0 else None
            loader = tc.BroadcastingDataLoader(
                source, group=dist.group.WORLD, src=0, prefetch=prefetch, trim=trim
            )
            kept = list(loader)
            assert len(kept) == 2, f"rank {rank}: {len(kept)} batches"
            for step, batch in enumerate(kept):
                check_same(batch, want[step], f"rank {rank} loader(trim={trim}) batch {step}")
        digests.append(digest(got))
    assert [digest(t) for t in want] == before
    return digests


def _step_tree(dp: int, step: int) -> dict[str, Any]:
    """The batch of data-parallel slot ``dp`` at ``step``: padded leaves whose data and
    runs change from step to step (so the trimmed sizes do too) and from slot to slot."""
    seeded = [dataclasses.replace(leaf, seed=leaf.seed + 100 * dp + step) for leaf in PADDED[:4]]
    return build_tree(seeded, step)


def _trimmed_under_a_model(rank: int, world: int) -> list[str]:
    """Every rank of a (dp, tp) mesh: trimmed batches through the loader at prefetch 0, 1
    and 2, a model step of the TP group's own collectives after each (at moments that
    differ per rank), and a trimmed tc.broadcast on the TP group between; each batch
    checked against this rank's own build, the digests returned."""
    mesh = dp_tp_mesh(world)
    tp = mesh.get_group("tp")
    dp, _ = tc.dp_rank_and_size(mesh, ("tp",))
    tp_root = dist.get_process_group_ranks(tp)[0]
    digests = []
    for prefetch in (0, 1, 2):
        source = (
            [_step_tree(dp, s) for s in range(3)] if tc.is_dp_source_rank(mesh, ("tp",)) else None
        )
        loader = tc.BroadcastingDataLoader(source, mesh, axes=("tp",), prefetch=prefetch)
        for step, batch in enumerate(loader):
            check_same(batch, _step_tree(dp, step), f"rank {rank} prefetch={prefetch} step {step}")
            model_step(rank, step, tp)
            extra = _step_tree(dp, 50 + step) if rank == tp_root else None
            got = tc.broadcast(extra, tp_root, tp)
            check_same(got, _step_tree(dp, 50 + step), f"rank {rank} tc.broadcast at {step}")
            digests.append(digest(batch))
        stats, whole = loader.stats(), sum(batch_nbytes(_step_tree(dp, s)) for s in range(3))
        assert stats.steps == 3 and stats.bytes < whole / 2, (stats, whole)  # trimmed
    return digests


def _packed_loader_bytes(rank: int, world: int) -> dict[str, Any]:
    """The audio_padded batch through the loader, trim on and off: what each rank's
    ``loader.stats().bytes`` says, and that every rank got the batch bit for bit."""
    batch = make_workload("audio_padded", quick=True)
    out: dict[str, Any] = {"tensor_bytes": batch_nbytes(batch)}
    for trim in (True, False):
        source = [batch, batch] if rank == 0 else None
        loader = tc.BroadcastingDataLoader(source, group=dist.group.WORLD, src=0, trim=trim)
        for got in loader:
            check_same(got, batch, f"rank {rank} loader(trim={trim})")
        out[trim] = loader.stats().bytes
    return out


# -- the tests ----------------------------------------------------------------------------


@SETTINGS
@given(described=TREES)
def test_trees_with_trailing_runs_round_trip_on_2_ranks(pool2: Any, described: list[Leaf]) -> None:
    results = pool2.run(_round_trips, described, timeout=TIMEOUT)
    assert all(r == results[0] for r in results), results


@SETTINGS
@given(described=TREES)
def test_trees_with_trailing_runs_round_trip_on_4_ranks(pool4: Any, described: list[Leaf]) -> None:
    results = pool4.run(_round_trips, described, timeout=TIMEOUT)
    assert all(r == results[0] for r in results), results


def _padded(dtype: str, element: str, **over: Any) -> Leaf:
    """A leaf that is mostly padding: trimmed, whatever the run's element."""
    n = _row_of(dtype)
    fields: dict[str, Any] = dict(
        dtype=dtype, rows=4, row=(n,), element=element, fill=1.0, seed=7,
        layout="contiguous", ndarray=False, no_run_row=True, all_run_row=True,
    )  # fmt: skip
    fields.update(over)
    return Leaf(**fields)


PADDED = [
    _padded("float32", "nan_payload"),
    _padded("bfloat16", "neg_zero", layout="transposed"),
    _padded("float64", "neg_zero", ndarray=True),
    _padded("complex64", "nan_payload", layout="strided"),
    _padded("int64", "random", row=(BIG_ROW // 32, 4)),
    _padded("bool", "zero", row=(BIG_ROW // 64, 8, 8)),
    _padded("complex128", "neg_zero", layout="transposed"),
    _padded("float16", "random", ndarray=True, layout="strided"),
    _padded("float8_e4m3fn", "nan_payload"),
]


def test_the_drawn_trees_are_trimmed_where_they_are_padding() -> None:
    """The law above is not vacuous: leaves like the drawn ones are stored trimmed (each
    saves what a host receiver's rule asks), and whole with trim=False."""
    tree = build_tree(PADDED)
    trimmed = {s.path: s.trimmed for s in tc.read_header(tc.pack(tree).header).leaves}
    whole = {s.path: s.trimmed for s in tc.read_header(tc.pack(tree, trim=False).header).leaves}
    assert not any(whole.values()), whole
    assert all(trimmed[f"['leaf{i}']"] for i in range(len(PADDED))), trimmed
    check_same(tc.unpack(tc.pack(tree)), tree, "pack/unpack")


@pytest.mark.parametrize("world", [2, 4])
def test_padded_leaves_of_every_kind_round_trip(world: int, request: pytest.FixtureRequest) -> None:
    """The trimmed leaves above, through tc.broadcast and the loader on every rank."""
    pool = request.getfixturevalue(f"pool{world}")
    results = pool.run(_round_trips, PADDED, timeout=TIMEOUT)
    assert all(r == results[0] for r in results), results


def test_the_loader_sends_fewer_bytes_with_trim_on(pool2: Any) -> None:
    """``loader.stats().bytes`` on the audio_padded batch (59% padding): trimmed, at
    most 0.6x of what trim=False sends, on the source and the receiver alike."""
    results = pool2.run(_packed_loader_bytes, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert r[False] >= 2 * r["tensor_bytes"], (rank, r)  # two batches, every byte
        assert r[True] <= 0.6 * r[False], (rank, r)
    assert results[0][True] == results[1][True]


def test_trimmed_batches_under_a_model_with_its_own_collectives(pool4: Any) -> None:
    """Four ranks, a (dp=2, tp=2) mesh: trimmed batches whose sizes change every step
    reach both ranks of each slot bit for bit at every prefetch, with the model's own
    all_reduce and broadcast on the TP group after each batch and a trimmed
    tc.broadcast on that group between; the slots' batches differ."""
    results = pool4.run(_trimmed_under_a_model, timeout=TIMEOUT)
    assert results[0] == results[1] and results[2] == results[3], results
    assert results[0] != results[2]
