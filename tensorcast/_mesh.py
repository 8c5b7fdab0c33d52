"""From a DeviceMesh to the group a batch travels on, and its source rank.

Under TP/CP every rank of one ``(cp, tp)`` sub-mesh of a DP slot needs the same batch.
The named axes that are present in the mesh with size > 1 are flattened into ONE
process group per DP slot, whose first rank (coordinate 0 on every such axis) is the
source. The groups are created once, by every rank together, and kept on the mesh
object that owns them (never in a dict keyed by ``id()``); a mesh from a process group
that was destroyed and re-initialised gets new groups.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = [
    "SubMesh",
    "is_dp_source_rank",
    "normalize_axes",
    "present_axes",
    "resolve_submesh",
    "spanning_axes",
]

_ATTR = "_tensorcast_submeshes"
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class SubMesh:
    """The flattened sub-mesh of this rank: its group and its source (a global rank)."""

    group: dist.ProcessGroup
    src: int
    ranks: tuple[int, ...]
    axes: tuple[str, ...]
    world: weakref.ReferenceType[Any]


def normalize_axes(axes: Sequence[str] | str) -> tuple[str, ...]:
    if isinstance(axes, str):
        return (axes,)
    out = tuple(axes)
    if not all(isinstance(a, str) for a in out):
        raise TypeError(f"axes must be mesh dimension names (str), got {axes!r}")
    return out


def present_axes(device_mesh: Any, axes: Sequence[str] | str) -> tuple[str, ...]:
    """The named axes present in the mesh, in mesh order (sizes included)."""
    if device_mesh is None:
        return ()
    names = tuple(device_mesh.mesh_dim_names or ())
    wanted = normalize_axes(axes)
    return tuple(n for n in names if n in wanted)


def _axis_size(device_mesh: Any, name: str) -> int:
    return int(device_mesh.mesh.size(tuple(device_mesh.mesh_dim_names).index(name)))


def spanning_axes(device_mesh: Any, axes: Sequence[str] | str) -> tuple[str, ...]:
    """The present axes of size > 1: the ones a batch must be broadcast across."""
    return tuple(a for a in present_axes(device_mesh, axes) if _axis_size(device_mesh, a) > 1)


def is_dp_source_rank(device_mesh: Any, axes: Sequence[str] | str = ("cp", "tp")) -> bool:
    """Whether this rank builds the real loader for its DP slot.

    True when ``device_mesh`` is None, when none of ``axes`` is in the mesh, or when every
    named axis present has size 1; otherwise True only at coordinate 0 along every present
    named axis.
    """
    present = present_axes(device_mesh, axes)
    if not present or all(_axis_size(device_mesh, a) == 1 for a in present):
        return True
    coords = device_mesh.get_coordinate()
    if coords is None:
        raise ValueError(f"this rank is not part of the device mesh {device_mesh}")
    names = tuple(device_mesh.mesh_dim_names)
    return all(coords[names.index(a)] == 0 for a in present)


def _submesh_rows(device_mesh: Any, spanning: tuple[str, ...]) -> list[list[int]]:
    """Every sub-mesh's global ranks: one row per DP slot, the source first."""
    names = tuple(device_mesh.mesh_dim_names)
    mesh = device_mesh.mesh
    keep = [names.index(a) for a in spanning]
    rest = [i for i in range(mesh.dim()) if i not in keep]
    size = 1
    for i in keep:
        size *= mesh.size(i)
    return mesh.permute(*rest, *keep).reshape(-1, size).tolist()


def resolve_submesh(device_mesh: Any, axes: Sequence[str] | str) -> SubMesh:
    """The group spanning this rank's sub-mesh; created once per mesh, by every rank.

    Must be called by every rank of the default group the first time (group creation is
    collective); later calls return the cached groups without communicating.
    """
    spanning = spanning_axes(device_mesh, axes)
    if not spanning:
        raise ValueError(f"no axis of {normalize_axes(axes)} with size > 1 in the mesh")
    world = dist.distributed_c10d._get_default_group()
    with _lock:
        cache: dict[tuple[str, ...], SubMesh] = device_mesh.__dict__.setdefault(_ATTR, {})
        hit = cache.get(spanning)
        if hit is not None and hit.world() is world:
            return hit
        rank = dist.get_rank()
        rows = _submesh_rows(device_mesh, spanning)
        mine = next((r for r in rows if rank in r), None)
        if mine is None:
            raise ValueError(f"rank {rank} is not part of the device mesh {device_mesh}")
        if len(spanning) == 1:
            group = device_mesh.get_group(spanning[0])  # the mesh already owns this group
        else:
            group, _ = dist.new_subgroups_by_enumeration(rows)
        sub = SubMesh(group, mine[0], tuple(mine), spanning, weakref.ref(world))
        cache[spanning] = sub
        return sub
