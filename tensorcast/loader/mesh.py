"""Mesh geometry: which ranks share a batch, which one is their source, which DP slot.

Under TP/CP every rank of one ``(cp, tp)`` sub-mesh of a DP slot needs the same batch.
The named axes that are present in the mesh with size > 1 are flattened into ONE set of
ranks per DP slot (:func:`submesh_rows`), whose first rank (coordinate 0 on every such
axis) is the source. :func:`mesh_role` opens this rank's role over its set of ranks
(``transport.groups`` makes tensorcast's own group over them); nothing else here makes a
process group.

# NOTE [ The per-axis mesh protocol ]
Which rank is a source, and which DP slot a rank is in, is read from a mesh-like through
the per-axis protocol only: ``mesh.mesh_dim_names`` and, for each name,
``mesh[name].size()`` and ``mesh[name].get_local_rank()`` (the rank's coordinate along
that dimension). That is what NeMo's helpers and tests use, so their stand-ins work
wherever a mesh is accepted. Only creating the groups (:func:`submesh_rows`) needs the
global rank of every mesh position, i.e. a real ``DeviceMesh``'s ``.mesh`` tensor.

A real ``torch.distributed.device_mesh.DeviceMesh`` is read through ``size(dim)`` and
``get_coordinate()`` instead, for two reasons. Its ``mesh[name].get_local_rank()`` is the
rank within that dimension's process group, whose ranks torch sorts: on a mesh whose
ranks are not laid out row-major (``DeviceMesh("cpu", [[3, 1], [0, 2]])``) it is not the
coordinate, and the source would not be the first rank of :func:`submesh_rows`. And
``mesh[name]`` builds a new ``DeviceMesh`` on every call (no process group, but a copy of
the rank map, about a thousand times the cost of ``get_coordinate()``).
"""

from __future__ import annotations

import datetime
import hashlib
import math
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorcast.transport import Packing, Role, open_role, ranks_name

try:
    from torch.distributed.device_mesh import DeviceMesh as _DeviceMesh
except ImportError:  # torch built without distributed support: only mesh-likes exist
    _DeviceMesh = None  # type: ignore[assignment,misc]

__all__ = [
    "dp_rank_and_size",
    "group_ranks",
    "is_dp_source_rank",
    "mesh_role",
    "normalize_axes",
    "present_axes",
    "spanning_axes",
    "submesh_rows",
]


def normalize_axes(axes: Sequence[str] | str) -> tuple[str, ...]:
    if isinstance(axes, str):
        return (axes,)
    try:
        out = tuple(axes)
    except TypeError:  # not iterable: an int, None
        out = (axes,)  # type: ignore[assignment]
    if not all(isinstance(a, str) for a in out):
        raise TypeError(
            f"axes must be mesh dimension names (a str or a sequence of str, e.g. "
            f"('cp', 'tp')), got {axes!r}"
        )
    return out


def _dim_names(device_mesh: Any) -> tuple[str, ...]:
    return tuple(device_mesh.mesh_dim_names or ())


def _named_dims(device_mesh: Any, what: str) -> tuple[str, ...]:
    """The mesh's dimension names; ``TypeError`` for a mesh without them."""
    names = getattr(device_mesh, "mesh_dim_names", None)
    if not names:
        raise TypeError(
            f"{what} needs a device mesh with named dimensions, got {device_mesh!r} with "
            f"mesh_dim_names={names!r}: without names it cannot tell which dimensions share "
            f"a batch; create it with init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
        )
    return tuple(names)


# NOTE [ Axes that miss the mesh ]
# None of the named axes in the mesh is a no-op (a job without TP/CP, a mesh built from
# the dims in use only, as torchtitan does), but when the mesh has another dimension of
# size > 1 that is not data- or pipeline-parallel, the axes almost always name it wrongly
# (``axes="TP"``, or the default axes on a ``("dp", "tensor")`` mesh) and every rank would
# iterate its own loader. Raising would break the valid meshes whose TP dim is simply
# absent, so it is a warning, once per process for each (mesh dims, axes): a training loop
# calls broadcast_batch every step. The set grows with the distinct meshes a job builds,
# never with the world size. Where some of the axes are in the mesh and one is not, the
# missing one is a mistake only where the mesh has a dimension of size > 1 named like it
# (``"TP"`` for ``"tp"``, ``"tensor"`` or ``"tensor_parallel"`` for ``"tp"``, ``"context"``
# for ``"cp"``), as on a ``("dp", "cp", "tensor")`` mesh with cp 1: an axis simply absent
# (no ``"cp"`` on a ``("dp", "tp")`` mesh, an expert-parallel dimension beside) is not.
_NOT_SHARING = ("dp", "data", "pp", "pipe")
_ALSO_NAMED = {"tp": "tensor", "cp": "context"}  # what a dimension named like an axis starts with
_warned: set[tuple[tuple[str, ...], tuple[str, ...]]] = set()
_warned_lock = threading.Lock()


def _warn_if_axes_miss(
    device_mesh: Any, names: tuple[str, ...], wanted: tuple[str, ...], what: str, stacklevel: int
) -> None:
    others = [n for n in names if n not in wanted and not n.lower().startswith(_NOT_SHARING)]
    missing = [a for a in wanted if a not in names]
    if len(missing) < len(wanted):  # some are in the mesh: the dims named like a missing one
        others = [n for n in others if any(_named_like(n, a) for a in missing)]
    big = [n for n in others if _axis_size(device_mesh, n) > 1]
    if not big:
        return
    with _warned_lock:
        if (names, wanted) in _warned:
            return
        _warned.add((names, wanted))
    if len(missing) == len(wanted):
        some = f"none of axes={wanted!r} is"
    else:
        some = f"{missing!r} of axes={wanted!r} {'is' if len(missing) == 1 else 'are'} not"
    warnings.warn(
        f"{what}: {some} a dimension of the device mesh, whose dims "
        f"are {names!r}, so ranks along {big!r} (size > 1) are their own sources: they "
        f"iterate their own loaders and get different batches. Name the dimensions that "
        f"share a batch, e.g. axes={tuple(a for a in names if a in wanted or a in big)!r}; "
        f"if this job really has no tensor/context parallelism, ignore this (warned once "
        f"per process)",
        UserWarning,
        stacklevel=stacklevel + 1,
    )


def _named_like(dim: str, axis: str) -> bool:
    """Whether the mesh dimension ``dim`` is named like the axis ``axis``: the same but for
    case, or starting with the word the axis stands for (NOTE [ Axes that miss the mesh ])."""
    word = _ALSO_NAMED.get(axis.lower())
    return dim.lower() == axis.lower() or (word is not None and dim.lower().startswith(word))


def present_axes(
    device_mesh: Any,
    axes: Sequence[str] | str,
    *,
    what: str = "tensorcast",
    stacklevel: int = 1,
) -> tuple[str, ...]:
    """The named axes present in the mesh, in mesh order (sizes included).

    Raises ``TypeError`` for a mesh without dimension names, and warns when the axes miss
    the mesh (NOTE [ Axes that miss the mesh ]); ``what`` names the caller there, and
    ``stacklevel`` counts the frames between the user's code and this call.
    """
    if device_mesh is None:
        return ()
    names = _named_dims(device_mesh, what)
    wanted = normalize_axes(axes)
    present = tuple(n for n in names if n in wanted)
    if wanted and len(present) < len(wanted):
        _warn_if_axes_miss(device_mesh, names, wanted, what, stacklevel + 1)
    return present


def _is_device_mesh(device_mesh: Any) -> bool:
    return _DeviceMesh is not None and isinstance(device_mesh, _DeviceMesh)


def _axis_size(device_mesh: Any, name: str) -> int:
    """The size of the dimension ``name``; see NOTE [ The per-axis mesh protocol ]."""
    if _is_device_mesh(device_mesh):
        return int(device_mesh.size(_dim_names(device_mesh).index(name)))
    return int(device_mesh[name].size())


def _axis_coordinate(device_mesh: Any, name: str, size: int) -> int:
    """This rank's coordinate along ``name``; ``ValueError`` when it is not in the mesh."""
    if _is_device_mesh(device_mesh):
        coords = device_mesh.get_coordinate()
        local = None if coords is None else coords[_dim_names(device_mesh).index(name)]
    else:
        local = device_mesh[name].get_local_rank()
    # torch's get_rank(group) answers -1 on a rank outside the group
    if local is None or not 0 <= int(local) < size:
        raise ValueError(
            f"this rank is not part of the device mesh {device_mesh}: its coordinate along "
            f"{name!r} is {local!r}, expected 0..{size - 1}; call this on the ranks of the "
            f"mesh only"
        )
    return int(local)


def spanning_axes(
    device_mesh: Any,
    axes: Sequence[str] | str,
    *,
    what: str = "tensorcast",
    stacklevel: int = 1,
) -> tuple[str, ...]:
    """The present axes of size > 1: the ones a batch must be broadcast across (the
    checks of :func:`present_axes` included)."""
    present = present_axes(device_mesh, axes, what=what, stacklevel=stacklevel + 1)
    return tuple(a for a in present if _axis_size(device_mesh, a) > 1)


def is_dp_source_rank(device_mesh: Any, axes: Sequence[str] | str = ("cp", "tp")) -> bool:
    """Whether this rank builds the real loader for its DP slot.

    True when ``device_mesh`` is None, when none of ``axes`` is in the mesh (with a warning
    when that looks like a mistake), or when every named axis present has size 1; otherwise True only at coordinate 0 along every present
    named axis. ``device_mesh`` is a ``DeviceMesh`` or any object with ``mesh_dim_names``
    and ``mesh[name].size()`` / ``mesh[name].get_local_rank()``.

    Args:
        device_mesh: the mesh, or None.
        axes: the names of the dimensions whose ranks share one batch.

    Returns:
        Whether this rank is its sub-mesh's source.

    Raises:
        TypeError: ``axes`` are not names, or the mesh has no dimension names.
        ValueError: this rank is not part of ``device_mesh``.

    Warns:
        UserWarning: none of ``axes`` is in the mesh, which has another dimension of size
            > 1 that is not data- or pipeline-parallel (once per process).
    """
    present = present_axes(device_mesh, axes, what="tensorcast.is_dp_source_rank", stacklevel=2)
    for name in present:
        size = _axis_size(device_mesh, name)
        if size > 1 and _axis_coordinate(device_mesh, name, size) != 0:
            return False
    return True


def dp_rank_and_size(device_mesh: Any, axes: Sequence[str] | str = ("cp", "tp")) -> tuple[int, int]:
    """This rank's data-parallel slot and the number of slots, for sharding a sampler.

    Every dimension of the mesh that is not in ``axes`` counts as data-parallel (``dp``,
    ``dp_replicate``, ``dp_shard``, ``pp``, ...). The slot is this rank's coordinate over
    those dimensions, flattened row-major in mesh order; all ranks of one ``axes``
    sub-mesh share a slot, so shard the data by it rather than by global rank. Reads the
    mesh through ``mesh_dim_names`` and ``mesh[name].size()`` /
    ``mesh[name].get_local_rank()`` only, so mesh-like objects work too.

    Args:
        device_mesh: a ``DeviceMesh`` (or mesh-like) with named dimensions, or None.
        axes: the names of the dimensions whose ranks share one batch.

    Returns:
        ``(dp_rank, dp_size)`` with ``0 <= dp_rank < dp_size``; ``(0, 1)`` when
        ``device_mesh`` is None or every dimension is in ``axes``.

    Raises:
        TypeError: ``axes`` are not names.
        ValueError: the mesh has no dimension names, or this rank is not part of it.

    Example::

        mesh = init_device_mesh("cuda", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
        dp_rank, dp_size = tc.dp_rank_and_size(mesh)  # global rank 5 -> (1, 2)
        sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank)
    """
    wanted = normalize_axes(axes)
    if device_mesh is None:
        return 0, 1
    names = _dim_names(device_mesh)
    if not names:
        raise ValueError(
            f"dp_rank_and_size needs a mesh with named dimensions, got {device_mesh} with "
            f"mesh_dim_names={device_mesh.mesh_dim_names!r}; create it with "
            f"init_device_mesh(..., mesh_dim_names=('dp', 'cp', 'tp'))"
        )
    rank, size = 0, 1
    for name in names:
        if name in wanted:
            continue
        n = _axis_size(device_mesh, name)
        if n > 1:
            rank = rank * n + _axis_coordinate(device_mesh, name, n)
            size *= n
    return rank, size


def submesh_rows(device_mesh: Any, spanning: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Every sub-mesh's global ranks: one tuple per DP slot, each in mesh order.

    The slots come in row-major order of the other dimensions; within a tuple the ranks
    are in row-major order of the ``spanning`` dimensions (taken in mesh order), so its
    first rank is the slot's source: coordinate 0 on every spanning axis.

    Args:
        device_mesh: a real ``torch.distributed.device_mesh.DeviceMesh`` (or an object
            with ``mesh_dim_names`` and a ``.mesh`` tensor of global ranks).
        spanning: names of the dimensions one sub-mesh spans.

    Returns:
        The global ranks of every sub-mesh, each rank of the mesh in exactly one tuple.

    Raises:
        TypeError: the mesh has no ``.mesh`` tensor of global ranks.
        ValueError: a name of ``spanning`` is not a dimension of the mesh.
    """
    ranks = getattr(device_mesh, "mesh", None)
    if not isinstance(ranks, torch.Tensor):
        found = "no `.mesh`" if ranks is None else f"`.mesh` of type {type(ranks).__name__}"
        cls = type(device_mesh)
        raise TypeError(
            f"creating the sub-mesh process groups needs the global rank of every mesh "
            f"position, i.e. a real torch.distributed.device_mesh.DeviceMesh (its `.mesh` "
            f"tensor); got `{cls.__module__}.{cls.__qualname__}` with {found}; build the "
            f"mesh with torch.distributed.device_mesh.init_device_mesh(..., "
            f"mesh_dim_names=...) and pass that, or pass group= and src= (tc.broadcast, "
            f"tc.BroadcastingDataLoader) instead"
        )
    names = _dim_names(device_mesh)
    if len(names) != ranks.dim():
        raise ValueError(
            f"the mesh's mesh_dim_names {names!r} do not name its {ranks.dim()} dimensions; "
            f"create it with init_device_mesh(..., mesh_dim_names=...)"
        )
    spanning = normalize_axes(spanning)
    missing = [a for a in spanning if a not in names]
    if missing:
        raise ValueError(f"axes {missing!r} are not dimensions of the mesh {names!r}")
    keep = sorted({names.index(a) for a in spanning})
    rest = [i for i in range(ranks.dim()) if i not in keep]
    size = math.prod(ranks.size(i) for i in keep)
    rows = ranks.permute(*rest, *keep).reshape(-1, size).tolist()
    return [tuple(int(r) for r in row) for row in rows]


def group_ranks(group: Any, src: int | None) -> tuple[int, ...]:
    """The global ranks of ``group`` (None: every rank), sorted; ``src`` (an int: the
    callers' ``check_src``; None: not asked) must be one, and so must this rank.

    Raises:
        TypeError: ``group`` is not a process group nor None.
        ValueError: ``src`` or this rank is not a rank of ``group``.
    """
    rank = dist.get_rank()
    if group is not None and not isinstance(group, dist.ProcessGroup):
        if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                f"global rank {rank} is not a member of the group it passed (new_group "
                f"returned GroupMember.NON_GROUP_MEMBER here): call tensorcast on the "
                f"group's ranks only"
            )
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup (as new_group returns) or None "
            f"(every rank), got {type(group).__name__} {group!r}"
        )
    if group is None:
        ranks = tuple(range(dist.get_world_size()))
    else:
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
    if src is not None and src not in ranks:
        raise ValueError(
            f"src={src} is not a rank of the group (global ranks {list(ranks)}); src is a "
            f"global rank, as in torch.distributed.broadcast"
        )
    if rank not in ranks:
        raise ValueError(
            f"global rank {rank} is not a rank of the group it passed (global ranks "
            f"{list(ranks)}): call tensorcast on the group's ranks only"
        )
    return ranks


def mesh_role(
    device_mesh: Any,
    axes: tuple[str, ...],
    what: str,
    setup: dict[str, Any],
    *,
    extra: dict[str, Any] | None = None,
    timeout: datetime.timedelta | None = None,
    setup_timeout: datetime.timedelta | None = None,
    verify: bool = False,
    packing: Packing | None = None,
    shm: bool | None = None,
) -> tuple[Role, dict[int, dict[str, Any]]]:
    """This rank's role over its flattened sub-mesh of ``axes``, from its first rank (see
    ``transport.groups.open_role``, which takes ``verify``, ``packing`` and ``shm``).

    Every rank of the mesh calls this together: the ranks of each sub-mesh agree on
    ``setup`` (with the mesh's shape, rank layout and the axes), numbered among the
    mesh's ranks, and each sub-mesh gets tensorcast's group over its ranks.
    """
    spanning = spanning_axes(device_mesh, axes)
    rows = submesh_rows(device_mesh, spanning)
    rank = dist.get_rank()
    mine = next((r for r in rows if rank in r), None)
    if mine is None:
        raise ValueError(f"rank {rank} is not part of the device mesh {device_mesh}")
    layout = device_mesh.mesh.to(torch.int64).contiguous().numpy().tobytes()
    full = {
        **setup,
        "axes": list(axes),
        "mesh": [list(device_mesh.mesh_dim_names), list(device_mesh.mesh.shape)],
        "layout": hashlib.blake2b(layout, digest_size=8).hexdigest(),
    }
    everyone = sorted(r for row in rows for r in row)
    return open_role(
        ranks_name(everyone),
        mine,
        mine[0],
        what,
        full,
        extra=extra,
        timeout=timeout,
        setup_timeout=setup_timeout,
        first=(everyone[0], len(everyone)) if len(rows) > 1 else None,
        verify=verify,
        packing=packing,
        shm=shm,
    )
