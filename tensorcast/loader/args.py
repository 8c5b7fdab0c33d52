"""The arguments both entry points take alike: timeouts, output devices, packed batches."""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tensorcast.codec import Packed, resolve_device, unpack

__all__ = [
    "check_shm",
    "check_src",
    "distributed",
    "output_device",
    "to_timedelta",
    "unpack_if_packed",
]

_AVAILABLE = dist.is_available()  # fixed by how torch was built
_MAX_TIMEOUT_S = 10.0**9  # about 32 years: past it, a timedelta overflows
#: where output tensors may land
_OUTPUT_DEVICES = ("cpu", "cuda")


def distributed() -> bool:
    """Whether ``torch.distributed`` is built and initialized."""
    return _AVAILABLE and dist.is_initialized()


# The shortest timeout: the waits below count in milliseconds (a shorter one was 0, the
# default's, there).
_SHORTEST_S = 1e-3
_SHORTEST = datetime.timedelta(seconds=_SHORTEST_S)


def to_timedelta(timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    """A timeout in seconds (or a timedelta) as a timedelta; None stays None.

    Raises:
        ValueError: not a positive number of seconds.
    """
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        if not _SHORTEST <= timeout < datetime.timedelta(seconds=_MAX_TIMEOUT_S):
            raise ValueError(
                f"timeout must be a timedelta of 1 ms to {_MAX_TIMEOUT_S:.0e} s, got "
                f"{timeout!r} (None: the default process group's timeout)"
            )
        return timeout
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not _SHORTEST_S <= timeout < _MAX_TIMEOUT_S  # NaN too
    ):
        raise ValueError(
            f"timeout must be a positive number of seconds, 0.001 (1 ms: the waits' "
            f"resolution) or more, and finite, got {timeout!r} "
            f"(None: the default process group's timeout)"
        )
    return datetime.timedelta(seconds=timeout)


def check_src(src: Any) -> int:
    """``src`` as a plain int (a numpy integer too: it goes into the setup's JSON).

    Raises:
        TypeError: ``src`` is not an integer (a bool, a float, a str).
    """
    if isinstance(src, bool) or not isinstance(src, (int, np.integer)):
        raise TypeError(
            f"src must be an int, a global rank as in torch.distributed.broadcast, got "
            f"{type(src).__name__} {src!r}"
        )
    return int(src)


def check_shm(shm: object) -> None:
    """``shm=`` is None, True or False.

    Raises:
        TypeError: anything else.
    """
    if shm is not None and type(shm) is not bool:
        raise TypeError(f"shm must be None (automatic), True or False, got {shm!r}")


def output_device(device: torch.device | str | int | None) -> torch.device | None:
    """Where output tensors land: ``device`` normalised, a bare ``"cuda"`` meaning this
    rank's GPU: the one ``init_process_group(device_id=)`` bound, else the current one."""
    if device is None:
        return None
    dev = torch.device(device) if not isinstance(device, int) else None
    if dev is not None and dev.type not in _OUTPUT_DEVICES:  # before anything is sent
        raise ValueError(
            f"device={device!r}: a batch lands on the CPU or a CUDA device; pass device=None "
            f"(the group's transfer device), 'cpu' or 'cuda'"
        )
    if dev is not None and dev.type == "cuda" and dev.index is None and distributed():
        bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
        if bound is not None and bound.type == "cuda":
            return resolve_device(bound)
    return resolve_device(device)


def unpack_if_packed(batch: Any) -> Any:
    """A pre-packed batch rebuilt as a tree; anything else unchanged."""
    return unpack(batch) if isinstance(batch, Packed) else batch
