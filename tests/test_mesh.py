"""Unit tests of the mesh logic: which rank is a DP slot's source, and the sub-mesh rows.

No process group here: a tiny stand-in exposes the three things the logic reads from a
``DeviceMesh`` (``mesh_dim_names``, ``mesh`` - a tensor of global ranks - and
``get_coordinate()``), so every layout can be checked without spawning ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorcast as tc
from tensorcast import _mesh


class StandInMesh:
    """The part of ``DeviceMesh`` that tensorcast reads, seen from global rank ``rank``."""

    def __init__(self, ranks: torch.Tensor, names: Sequence[str] | None, rank: int) -> None:
        self.mesh = ranks
        self.mesh_dim_names = tuple(names) if names is not None else None
        self.rank = rank

    def get_coordinate(self) -> list[int] | None:
        hits = (self.mesh == self.rank).nonzero()
        return None if len(hits) == 0 else [int(i) for i in hits[0]]


def grid(shape: tuple[int, ...], names: Sequence[str] | None, rank: int) -> StandInMesh:
    """A mesh whose global ranks are laid out row-major, as ``init_device_mesh`` does."""
    return StandInMesh(torch.arange(math.prod(shape)).reshape(shape), names, rank)


def sources(
    shape: tuple[int, ...], names: Sequence[str] | None, axes: Sequence[str] | str = ("cp", "tp")
) -> list[int]:
    return [r for r in range(math.prod(shape)) if tc.is_dp_source_rank(grid(shape, names, r), axes)]


# -- the unconditional cases: every rank is a source ------------------------------------


@pytest.mark.parametrize("axes", [("cp", "tp"), ("tp",), "cp", ()])
def test_no_mesh_is_a_source(axes: Sequence[str] | str) -> None:
    assert tc.is_dp_source_rank(None, axes) is True
    assert tc.is_dp_source_rank(None) is True


@pytest.mark.parametrize(
    ("shape", "names"),
    [((4,), ("dp",)), ((2, 2), ("dp", "pp")), ((8,), None), ((2, 2), None)],
)
def test_mesh_without_the_named_axes_is_a_source_everywhere(
    shape: tuple[int, ...], names: tuple[str, ...] | None
) -> None:
    assert sources(shape, names) == list(range(math.prod(shape)))


@pytest.mark.parametrize(
    ("shape", "names"),
    [
        ((4, 1, 1), ("dp", "cp", "tp")),
        ((2, 1), ("dp", "cp")),
        ((1,), ("tp",)),
        ((1, 1), ("cp", "tp")),
        ((2, 1, 2), ("dp", "tp", "pp")),
    ],
)
def test_named_axes_of_size_one_make_every_rank_a_source(
    shape: tuple[int, ...], names: tuple[str, ...]
) -> None:
    assert sources(shape, names) == list(range(math.prod(shape)))


def test_empty_axes_make_every_rank_a_source() -> None:
    assert sources((2, 2), ("cp", "tp"), ()) == [0, 1, 2, 3]


# -- coordinates ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "names", "axes", "expected"),
    [
        ((2,), ("cp",), ("cp", "tp"), [0]),
        ((4,), ("tp",), ("cp", "tp"), [0]),
        ((2, 2), ("cp", "tp"), ("cp", "tp"), [0]),
        ((2, 2, 2), ("dp", "cp", "tp"), ("cp", "tp"), [0, 4]),
        ((2, 2), ("dp", "cp"), ("cp", "tp"), [0, 2]),  # tp absent: cp alone spans
        ((2, 2), ("cp", "dp"), ("cp", "tp"), [0, 1]),  # named axis first in the mesh
        ((2, 1, 2), ("dp", "cp", "tp"), ("cp", "tp"), [0, 2]),  # cp present with size 1
        ((2, 2, 2), ("dp", "cp", "tp"), "tp", [0, 2, 4, 6]),  # a bare str is one axis
        ((2, 2, 2), ("dp", "cp", "tp"), ("tp", "cp"), [0, 4]),  # axes order is irrelevant
        ((2, 2, 2), ("dp", "cp", "tp"), ("dp",), [0, 1, 2, 3]),
        ((2, 3), ("tp", "cp"), ("cp", "tp"), [0]),
    ],
)
def test_source_is_coordinate_zero_on_every_present_axis(
    shape: tuple[int, ...],
    names: tuple[str, ...],
    axes: Sequence[str] | str,
    expected: list[int],
) -> None:
    assert sources(shape, names, axes) == expected


def test_source_follows_the_mesh_layout_not_the_rank_numbers() -> None:
    ranks = torch.tensor([[3, 1], [0, 2]])  # dp x tp, ranks placed out of order
    found = [r for r in range(4) if tc.is_dp_source_rank(StandInMesh(ranks, ("dp", "tp"), r))]
    assert found == [0, 3]
    spanning = _mesh.spanning_axes(StandInMesh(ranks, ("dp", "tp"), 0), ("cp", "tp"))
    assert _mesh._submesh_rows(StandInMesh(ranks, ("dp", "tp"), 0), spanning) == [[3, 1], [0, 2]]


def test_rank_outside_the_mesh_is_an_error() -> None:
    with pytest.raises(ValueError):
        tc.is_dp_source_rank(grid((2, 2), ("cp", "tp"), rank=9))


def test_axes_must_be_names() -> None:
    with pytest.raises(TypeError, match="mesh dimension names"):
        tc.is_dp_source_rank(grid((2, 2), ("cp", "tp"), 0), (0, 1))  # type: ignore[arg-type]


# -- axis selection and sub-mesh rows --------------------------------------------------------


def test_present_and_spanning_axes_keep_mesh_order() -> None:
    mesh = grid((2, 1, 2), ("tp", "dp", "cp"), 0)
    assert _mesh.present_axes(mesh, ("cp", "tp", "pp")) == ("tp", "cp")
    assert _mesh.spanning_axes(mesh, ("cp", "tp")) == ("tp", "cp")
    assert _mesh.spanning_axes(grid((2, 1), ("dp", "cp"), 0), ("cp", "tp")) == ()
    assert _mesh.present_axes(None, ("cp",)) == ()
    assert _mesh.normalize_axes("cp") == ("cp",)


@pytest.mark.parametrize(
    ("shape", "names", "axes", "rows"),
    [
        ((2, 2, 2), ("dp", "cp", "tp"), ("cp", "tp"), [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ((2, 2, 2), ("dp", "cp", "tp"), ("tp",), [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ((2, 2, 2), ("dp", "cp", "tp"), ("cp",), [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ((2, 2, 2), ("cp", "dp", "tp"), ("cp", "tp"), [[0, 1, 4, 5], [2, 3, 6, 7]]),
        ((2, 2), ("cp", "tp"), ("cp", "tp"), [[0, 1, 2, 3]]),
    ],
)
def test_submesh_rows_one_per_dp_slot_source_first(
    shape: tuple[int, ...],
    names: tuple[str, ...],
    axes: tuple[str, ...],
    rows: list[list[int]],
) -> None:
    mesh = grid(shape, names, 0)
    assert _mesh._submesh_rows(mesh, _mesh.spanning_axes(mesh, axes)) == rows


_NAMES = ("dp", "pp", "cp", "tp")


@st.composite
def layouts(draw: st.DrawFn) -> tuple[torch.Tensor, tuple[str, ...], tuple[str, ...]]:
    ndim = draw(st.integers(1, 4))
    names = tuple(draw(st.permutations(_NAMES))[:ndim])
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim)))
    order = draw(st.permutations(range(math.prod(shape))))
    axes = tuple(draw(st.lists(st.sampled_from(_NAMES), max_size=3, unique=True)))
    return torch.tensor(order).reshape(shape), names, axes


@settings(deadline=None, print_blob=True)
@given(layouts())
def test_source_rank_agrees_with_submesh_rows(
    layout: tuple[torch.Tensor, tuple[str, ...], tuple[str, ...]],
) -> None:
    """Law: the sub-mesh rows partition the mesh into equal groups that differ only along the
    spanning axes, and ``is_dp_source_rank`` holds exactly at each row's first rank (at every
    rank when no named axis spans more than one rank)."""
    ranks, names, axes = layout
    world = ranks.numel()
    meshes = {r: StandInMesh(ranks, names, r) for r in range(world)}
    spanning = _mesh.spanning_axes(meshes[0], axes)
    is_source = {r: tc.is_dp_source_rank(m, axes) for r, m in meshes.items()}
    if not spanning:
        assert all(is_source.values())
        return
    rows = _mesh._submesh_rows(meshes[0], spanning)
    assert sorted(r for row in rows for r in row) == list(range(world))
    size = math.prod(ranks.size(names.index(a)) for a in spanning)
    assert all(len(row) == size for row in rows)
    fixed = [i for i, n in enumerate(names) if n not in spanning]
    for row in rows:
        coords = [meshes[r].get_coordinate() for r in row]
        assert coords[0] is not None
        assert all(
            c is not None and [c[i] for i in fixed] == [coords[0][i] for i in fixed] for c in coords
        )
        assert [is_source[r] for r in row] == [True] + [False] * (len(row) - 1)
