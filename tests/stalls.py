"""Ways for a test to stall a process as real sources do."""

from __future__ import annotations

import ctypes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def hold_gil(seconds: float) -> None:
    """Hold the GIL for ``seconds``, letting no other thread in: one ``nanosleep`` called
    through ``ctypes.PyDLL``, which keeps the GIL across the call, as a C extension that
    blocks without releasing it does. (A loop of C calls, or of ``sum`` over a ``range``
    sized by a calibration run, lets a waiting thread in between two calls, or holds the
    GIL for less than asked when the machine slows down.)"""
    left = _Timespec(int(seconds), int(seconds % 1 * 1e9))
    while _LIBC.nanosleep(ctypes.byref(left), ctypes.byref(left)) != 0:  # a signal: the rest
        pass


_LIBC = ctypes.PyDLL(None)  # the process's own symbols (libc's nanosleep), called with the GIL
