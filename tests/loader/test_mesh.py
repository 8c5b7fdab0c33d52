"""Unit tests of the mesh logic: which rank is a DP slot's source, its DP slot, and the
sub-mesh rows.

No process group here. Two stand-ins expose what the logic reads from a mesh:
``AxisMesh`` only the per-axis protocol that NeMo's helpers and tests use
(``mesh_dim_names``, ``mesh[name].size()``, ``mesh[name].get_local_rank()``), and
``StandInMesh`` that protocol plus ``mesh``, the tensor of global ranks that creating the
groups needs. Neither has ``get_coordinate()``: nothing may rely on it.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Sequence
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorcast as tc
from tensorcast.loader import mesh as _mesh


class Axis:
    """``mesh[name]``: a 1-D mesh with its size and this rank's place along it."""

    def __init__(self, size: int, local_rank: int) -> None:
        self._size, self._local_rank = size, local_rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._local_rank


class AxisMesh:
    """A NeMo-style mesh-like: dimension names and, per name, a size and a coordinate."""

    def __init__(self, sizes: dict[str, int], coords: dict[str, int]) -> None:
        self.mesh_dim_names = tuple(sizes)
        self._axes = {n: Axis(sizes[n], coords[n]) for n in sizes}

    def __getitem__(self, name: str) -> Axis:
        return self._axes[name]


def coordinate(ranks: torch.Tensor, rank: int) -> list[int] | None:
    hits = (ranks == rank).nonzero()
    return None if len(hits) == 0 else [int(i) for i in hits[0]]


class StandInMesh:
    """The part of ``DeviceMesh`` that tensorcast reads, seen from global rank ``rank``."""

    def __init__(self, ranks: torch.Tensor, names: Sequence[str] | None, rank: int) -> None:
        self.mesh = ranks
        self.mesh_dim_names = tuple(names) if names is not None else None
        self.rank = rank

    def __getitem__(self, name: str) -> Axis:
        assert self.mesh_dim_names is not None
        dim = self.mesh_dim_names.index(name)
        coords = coordinate(self.mesh, self.rank)
        # like torch's get_rank(group): -1 on a rank outside the group
        return Axis(self.mesh.size(dim), -1 if coords is None else coords[dim])


def grid(shape: tuple[int, ...], names: Sequence[str] | None, rank: int) -> StandInMesh:
    """A mesh whose global ranks are laid out row-major, as ``init_device_mesh`` does."""
    return StandInMesh(torch.arange(math.prod(shape)).reshape(shape), names, rank)


def sources(
    shape: tuple[int, ...], names: Sequence[str] | None, axes: Sequence[str] | str = ("cp", "tp")
) -> list[int]:
    return [r for r in range(math.prod(shape)) if tc.is_dp_source_rank(grid(shape, names, r), axes)]


def axis_meshes(sizes: dict[str, int]) -> list[AxisMesh]:
    """One ``AxisMesh`` per rank of a mesh of ``sizes``, in row-major (global rank) order."""
    names = list(sizes)
    return [
        AxisMesh(sizes, dict(zip(names, c)))
        for c in itertools.product(*(range(sizes[n]) for n in names))
    ]


# -- the unconditional cases: every rank is a source ------------------------------------


@pytest.mark.parametrize("axes", [("cp", "tp"), ("tp",), "cp", ()])
def test_no_mesh_is_a_source(axes: Sequence[str] | str) -> None:
    assert tc.is_dp_source_rank(None, axes) is True
    assert tc.is_dp_source_rank(None) is True


@pytest.mark.parametrize(
    ("shape", "names"),
    [
        ((4,), ("dp",)),
        ((2, 2), ("dp", "pp")),
        ((2, 2, 2), ("data", "pipe", "tp_unused")),  # tp_unused has size 2: see below
        ((2, 2, 1), ("dp_replicate", "dp_shard", "tensor")),
        ((2, 2), ("DP", "PP")),
    ],
)
def test_mesh_without_the_named_axes_is_a_source_everywhere(
    shape: tuple[int, ...], names: tuple[str, ...]
) -> None:
    """A job without TP/CP, or a mesh of the dims in use only (torchtitan): a quiet no-op
    when every other dimension of size > 1 is data- or pipeline-parallel."""
    axes = ("cp", "tp") if "tp_unused" not in names else ("cp", "tp", "tp_unused")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if "tp_unused" in names:  # present: not a no-op, a real source choice
            assert sources(shape, names, axes) == [0, 2, 4, 6][: math.prod(shape) // 2]
        else:
            assert sources(shape, names, axes) == list(range(math.prod(shape)))


@pytest.mark.parametrize("names", [None, ()])
def test_mesh_without_dim_names_is_a_type_error(names: tuple[str, ...] | None) -> None:
    mesh = grid((2, 2), names, 0)
    with pytest.raises(TypeError, match=r"named dimensions.*mesh_dim_names="):
        tc.is_dp_source_rank(mesh)
    with pytest.raises(TypeError, match=r"tensorcast\.is_dp_source_rank"):
        tc.is_dp_source_rank(mesh, "tp")


class _NoNames:
    """A mesh-like without ``mesh_dim_names`` at all."""


def test_mesh_like_without_dim_names_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="named dimensions"):
        tc.is_dp_source_rank(_NoNames())


@pytest.mark.parametrize(
    ("shape", "names", "axes"),
    [
        ((1, 2), ("dp", "w_tp"), "TP"),  # a wrong case
        ((2, 2), ("dp", "w_tensor"), ("cp", "tp")),  # the default axes, another TP name
        ((2, 4), ("w_pp", "w_tensor_model_parallel"), ("cp", "tp")),
    ],
)
def test_axes_that_miss_a_mesh_with_another_big_dim_warn_once(
    shape: tuple[int, ...], names: tuple[str, ...], axes: Sequence[str] | str
) -> None:
    """Still a no-op (every rank a source), with one UserWarning per process naming the
    mesh's dims and the axes asked for. (Dim names are unique to this test: the warning is
    once per process for each mesh dims and axes.)"""
    with pytest.warns(UserWarning) as record:
        assert sources(shape, names, axes) == list(range(math.prod(shape)))
        assert sources(shape, names, axes) == list(range(math.prod(shape)))
    assert len(record) == 1
    message = str(record[0].message)
    assert "tensorcast.is_dp_source_rank" in message
    assert repr(names) in message and repr(_mesh.normalize_axes(axes)) in message
    assert record[0].filename == __file__  # points at the caller's line


@pytest.mark.parametrize(
    ("shape", "names", "axes", "big"),
    [
        ((1, 1, 2), ("dp", "cp", "tensor_w2"), ("cp", "tp"), "tensor_w2"),  # cp 1, tp misnamed
        ((1, 2, 1), ("dp", "context_w2", "tp"), ("cp", "tp"), "context_w2"),
        ((1, 1, 2), ("dp", "cp", "tp"), ("cp", "TP"), "tp"),  # a wrong case beside a present axis
    ],
)
def test_an_axis_that_misses_a_mesh_dim_named_like_it_warns_though_another_is_there(
    shape: tuple[int, ...], names: tuple[str, ...], axes: tuple[str, ...], big: str
) -> None:
    """A mistake beside an axis that is in the mesh (of size 1, as cp often is) is no
    silent no-op either: the dim named like the missing axis is said, once."""
    with pytest.warns(UserWarning) as record:
        assert sources(shape, names, axes) == list(range(math.prod(shape)))
        assert sources(shape, names, axes) == list(range(math.prod(shape)))
    assert len(record) == 1
    message = str(record[0].message)
    assert repr(names) in message and f"ranks along {[big]!r}" in message, message


@pytest.mark.parametrize(
    ("shape", "names"),
    [((2, 2, 2), ("dp", "tp", "ep")), ((2, 2, 2), ("dp", "cp", "experts")), ((2, 2), ("dp", "tp"))],
)
def test_an_axis_simply_absent_beside_one_that_is_there_says_nothing(
    shape: tuple[int, ...], names: tuple[str, ...]
) -> None:
    """No cp on a (dp, tp) mesh, an expert-parallel dim beside: not a mistake."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tc.is_dp_source_rank(grid(shape, names, 0))


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
    assert _mesh.submesh_rows(StandInMesh(ranks, ("dp", "tp"), 0), spanning) == [(3, 1), (0, 2)]
    slots = [tc.dp_rank_and_size(StandInMesh(ranks, ("dp", "tp"), r)) for r in range(4)]
    assert slots == [(1, 2), (0, 2), (1, 2), (0, 2)]


def test_rank_outside_the_mesh_is_an_error() -> None:
    with pytest.raises(ValueError, match="not part of the device mesh"):
        tc.is_dp_source_rank(grid((2, 2), ("cp", "tp"), rank=9))
    with pytest.raises(ValueError, match="not part of the device mesh"):
        tc.dp_rank_and_size(grid((2, 2), ("dp", "tp"), rank=9))


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
        ((2, 2, 2), ("dp", "cp", "tp"), ("cp", "tp"), [(0, 1, 2, 3), (4, 5, 6, 7)]),
        ((2, 2, 2), ("dp", "cp", "tp"), ("tp",), [(0, 1), (2, 3), (4, 5), (6, 7)]),
        ((2, 2, 2), ("dp", "cp", "tp"), ("cp",), [(0, 2), (1, 3), (4, 6), (5, 7)]),
        ((2, 2, 2), ("cp", "dp", "tp"), ("cp", "tp"), [(0, 1, 4, 5), (2, 3, 6, 7)]),
        ((2, 2), ("cp", "tp"), ("cp", "tp"), [(0, 1, 2, 3)]),
        ((2, 2), ("cp", "tp"), ("tp", "cp"), [(0, 1, 2, 3)]),  # tuples keep mesh order
        ((2, 2), ("dp", "tp"), (), [(0,), (1,), (2,), (3,)]),
    ],
)
def test_submesh_rows_one_per_dp_slot_source_first(
    shape: tuple[int, ...],
    names: tuple[str, ...],
    axes: tuple[str, ...],
    rows: list[tuple[int, ...]],
) -> None:
    assert _mesh.submesh_rows(grid(shape, names, 0), axes) == rows


def test_submesh_rows_need_a_real_rank_layout() -> None:
    nemo = AxisMesh({"dp": 2, "tp": 2}, {"dp": 0, "tp": 0})
    with pytest.raises(TypeError, match=r"real torch\.distributed\.device_mesh\.DeviceMesh") as e:
        _mesh.submesh_rows(nemo, ("tp",))
    assert "AxisMesh" in str(e.value) and "no `.mesh`" in str(e.value)
    assert "init_device_mesh" in str(e.value)
    mocked = mock.MagicMock(mesh_dim_names=("dp", "tp"))  # .mesh is a MagicMock, not ranks
    with pytest.raises(TypeError, match=r"`\.mesh` of type MagicMock"):
        _mesh.submesh_rows(mocked, ("tp",))


def test_submesh_rows_reject_unknown_axes_and_unnamed_meshes() -> None:
    with pytest.raises(ValueError, match=r"\['cp'\] are not dimensions"):
        _mesh.submesh_rows(grid((2, 2), ("dp", "tp"), 0), ("cp",))
    with pytest.raises(ValueError, match="mesh_dim_names"):
        _mesh.submesh_rows(grid((2, 2), None, 0), ())


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
    with warnings.catch_warnings():  # axes that miss the mesh: see the warning tests above
        warnings.simplefilter("ignore", UserWarning)
        spanning = _mesh.spanning_axes(meshes[0], axes)
        is_source = {r: tc.is_dp_source_rank(m, axes) for r, m in meshes.items()}
    if not spanning:
        assert all(is_source.values())
        return
    rows = _mesh.submesh_rows(meshes[0], spanning)
    assert sorted(r for row in rows for r in row) == list(range(world))
    size = math.prod(ranks.size(names.index(a)) for a in spanning)
    assert all(len(row) == size for row in rows)
    fixed = [i for i, n in enumerate(names) if n not in spanning]
    for row in rows:
        coords = [coordinate(ranks, r) for r in row]
        assert coords[0] is not None
        assert all(
            c is not None and [c[i] for i in fixed] == [coords[0][i] for i in fixed] for c in coords
        )
        assert [is_source[r] for r in row] == [True] + [False] * (len(row) - 1)


@settings(deadline=None, print_blob=True)
@given(layouts())
def test_dp_slot_agrees_with_submesh_rows(
    layout: tuple[torch.Tensor, tuple[str, ...], tuple[str, ...]],
) -> None:
    """Law: ``dp_rank_and_size`` numbers the sub-mesh rows: a rank's DP slot ``k`` is the index
    of the row that holds it, and there are ``dp_size`` rows."""
    ranks, names, axes = layout
    meshes = {r: StandInMesh(ranks, names, r) for r in range(ranks.numel())}
    with warnings.catch_warnings():  # axes that miss the mesh: see the warning tests above
        warnings.simplefilter("ignore", UserWarning)
        rows = _mesh.submesh_rows(meshes[0], _mesh.spanning_axes(meshes[0], axes))
    for r, m in meshes.items():
        dp_rank, dp_size = tc.dp_rank_and_size(m, axes)
        assert dp_size == len(rows)
        assert r in rows[dp_rank]


# -- NeMo-style mesh-likes: only mesh_dim_names and mesh[name].size() / .get_local_rank() ----


@pytest.mark.parametrize(
    ("sizes", "axes", "expected"),
    [
        ({"tp": 4}, ("cp", "tp"), [0]),
        ({"dp": 4}, ("cp", "tp"), [0, 1, 2, 3]),
        ({"dp": 2, "tp": 2}, ("cp", "tp"), [0, 2]),
        ({"dp": 2, "cp": 2, "tp": 2}, ("cp", "tp"), [0, 4]),
        ({"dp": 2, "cp": 1, "tp": 2}, ("cp", "tp"), [0, 2]),
        ({"dp": 4, "cp": 1, "tp": 1}, ("cp", "tp"), [0, 1, 2, 3]),
        ({"dp": 2, "cp": 2, "tp": 2}, "tp", [0, 2, 4, 6]),
        ({"tp": 2, "dp": 2}, ("cp", "tp"), [0, 1]),
        (
            {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2},
            ("cp", "tp"),
            [0, 4, 8, 12],
        ),
        ({"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1}, ("cp", "tp"), [0, 1, 2, 3]),
    ],
)
def test_source_rank_on_mesh_likes(
    sizes: dict[str, int], axes: Sequence[str] | str, expected: list[int]
) -> None:
    meshes = axis_meshes(sizes)
    assert [r for r, m in enumerate(meshes) if tc.is_dp_source_rank(m, axes)] == expected


def test_mesh_likes_give_the_same_answers_as_the_rank_layout() -> None:
    shape, names = (2, 3, 2), ("dp", "cp", "tp")
    for rank, like in enumerate(axis_meshes(dict(zip(names, shape)))):
        full = grid(shape, names, rank)
        for axes in [("cp", "tp"), ("tp",), ("cp",), ("dp",), ()]:
            assert tc.is_dp_source_rank(like, axes) == tc.is_dp_source_rank(full, axes)
            assert tc.dp_rank_and_size(like, axes) == tc.dp_rank_and_size(full, axes)
            assert _mesh.spanning_axes(like, axes) == _mesh.spanning_axes(full, axes)
            assert _mesh.present_axes(like, axes) == _mesh.present_axes(full, axes)


def test_mocked_mesh_as_nemo_tests_build_it() -> None:
    """NeMo's tests mock the per-axis protocol; ``.mesh`` and ``get_coordinate()`` are
    MagicMocks there, so the answer must come from ``mesh[name]`` alone."""
    axes = {"dp": Axis(2, 1), "cp": Axis(2, 0), "tp": Axis(2, 0)}
    mesh = mock.MagicMock(mesh_dim_names=("dp", "cp", "tp"))
    mesh.__getitem__.side_effect = axes.__getitem__
    assert tc.is_dp_source_rank(mesh) is True
    assert tc.dp_rank_and_size(mesh) == (1, 2)
    assert _mesh.spanning_axes(mesh, ("cp", "tp")) == ("cp", "tp")
    axes["tp"] = Axis(2, 1)
    assert tc.is_dp_source_rank(mesh) is False
    mesh.get_coordinate.assert_not_called()


def test_size_one_axes_are_never_asked_for_a_coordinate() -> None:
    class NoCoordinate(Axis):
        def get_local_rank(self) -> int:
            raise AssertionError("a size-1 axis has coordinate 0; no need to ask")

    mesh = mock.MagicMock(mesh_dim_names=("dp", "cp", "tp"))
    mesh.__getitem__.side_effect = {
        "dp": NoCoordinate(1, 0),
        "cp": NoCoordinate(1, 0),
        "tp": NoCoordinate(1, 0),
    }.__getitem__
    assert tc.is_dp_source_rank(mesh) is True
    assert tc.dp_rank_and_size(mesh) == (0, 1)


@pytest.mark.parametrize("local_rank", [-1, 2, 7])
def test_mesh_like_rank_outside_its_mesh_is_an_error(local_rank: int) -> None:
    mesh = AxisMesh({"dp": 2, "tp": 2}, {"dp": 0, "tp": local_rank})
    with pytest.raises(ValueError, match="not part of the device mesh"):
        tc.is_dp_source_rank(mesh)
    assert tc.dp_rank_and_size(mesh) == (0, 2)  # the DP coordinate alone is fine
    with pytest.raises(ValueError, match="'dp' is 5"):
        tc.dp_rank_and_size(AxisMesh({"dp": 2, "tp": 2}, {"dp": 5, "tp": 0}))


# -- dp_rank_and_size --------------------------------------------------------------------------


@pytest.mark.parametrize("axes", [("cp", "tp"), "tp", ()])
def test_dp_slot_without_a_mesh(axes: Sequence[str] | str) -> None:
    assert tc.dp_rank_and_size(None, axes) == (0, 1)
    assert tc.dp_rank_and_size(None) == (0, 1)


@pytest.mark.parametrize(
    ("sizes", "axes", "expected"),
    [
        ({"dp": 4}, ("cp", "tp"), [(0, 4), (1, 4), (2, 4), (3, 4)]),
        ({"tp": 4}, ("cp", "tp"), [(0, 1)] * 4),
        ({"cp": 2, "tp": 2}, ("cp", "tp"), [(0, 1)] * 4),
        ({"dp": 2, "tp": 2}, ("cp", "tp"), [(0, 2), (0, 2), (1, 2), (1, 2)]),
        ({"tp": 2, "dp": 2}, ("cp", "tp"), [(0, 2), (1, 2), (0, 2), (1, 2)]),
        ({"dp": 2, "cp": 2, "tp": 2}, ("cp", "tp"), [(0, 2)] * 4 + [(1, 2)] * 4),
        (
            {"dp": 2, "cp": 2, "tp": 2},
            ("tp",),
            [(r // 2, 4) for r in range(8)],
        ),
        ({"dp": 2, "cp": 1, "tp": 2}, ("cp", "tp"), [(0, 2), (0, 2), (1, 2), (1, 2)]),
        ({"dp": 1, "cp": 2, "tp": 2}, ("cp", "tp"), [(0, 1)] * 4),
        ({"dp": 2, "cp": 2, "tp": 2}, (), [(r, 8) for r in range(8)]),
    ],
)
def test_dp_slot_is_the_coordinate_over_the_other_dimensions(
    sizes: dict[str, int], axes: Sequence[str] | str, expected: list[tuple[int, int]]
) -> None:
    assert [tc.dp_rank_and_size(m, axes) for m in axis_meshes(sizes)] == expected


def test_dp_slot_on_flattened_five_dimensional_meshes() -> None:
    sizes = {"pp": 2, "dp_replicate": 2, "dp_shard": 3, "cp": 2, "tp": 2}
    meshes = axis_meshes(sizes)
    slots = [tc.dp_rank_and_size(m) for m in meshes]
    assert {size for _, size in slots} == {12}  # pp x dp_replicate x dp_shard
    # row-major over (pp, dp_replicate, dp_shard); the 4 ranks of each (cp, tp) share it
    assert [rank for rank, _ in slots] == [r // 4 for r in range(48)]
    without_pp = {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2}
    assert [tc.dp_rank_and_size(m) for m in axis_meshes(without_pp)] == [
        (r // 2, 4) for r in range(8)
    ]


def test_dp_slot_errors() -> None:
    with pytest.raises(TypeError, match="mesh dimension names"):
        tc.dp_rank_and_size(grid((2, 2), ("dp", "tp"), 0), (1,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="named dimensions"):
        tc.dp_rank_and_size(grid((4,), None, 0))
