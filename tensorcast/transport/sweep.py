"""Who may unlink a segment of the shared-memory lane (``transport.shm``), and the sweep of
what the dead left in ``/dev/shm``.

A segment's name starts with its arena's token, which names the writer's PID namespace
and pid (:func:`new_token`); a segment names its readers' pids in their cells (NOTE
[ Shared-memory slots ]). An arena unlinks its segments as they are mapped, as it goes
and when its lane breaks (``transport.shm``); what none of that unlinks, because every
process that could was killed, or because a reader still has to map it (NOTE [ An arena
that ends before its readers read ]), is judged here, by those pids alone: local file
operations that wait on nothing.
"""

from __future__ import annotations

import os
import secrets
import stat
import struct
from typing import Any

from tensorcast.transport.segment import HEAD, LINE, MAGIC, SHM_DIR, data_at

__all__ = ["PID_AT", "alive", "awaited", "new_token", "pid_namespace", "pid_of", "sweep_dead"]

#: where a reader's pid sits in its line of cells: after mapped and released (u64, 0:
#: unknown), written by the writer as it makes the segment
PID_AT = 16
_CELLS = struct.Struct("<QQQ")  # mapped, released, pid
_MAX_READERS = 1 << 16  # more in a file's head: no segment of ours (a sweep reads no more)


def pid_namespace() -> int:
    """This process's PID namespace (the inode of ``/proc/self/ns/pid``), 0 if unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def new_token() -> str:
    """A name no other channel, job or host's arena has: its segments' common prefix. It
    names the writer's PID namespace and pid (:func:`sweep_dead`)."""
    return f"tensorcast-{pid_namespace()}-{os.getpid()}-{secrets.token_hex(6)}"


def sweep_dead() -> None:
    """Unlink the segments in ``/dev/shm`` whose writer is dead: those it made that not
    every reader had mapped when every rank was killed, or that it left to a reader that
    then ended without mapping them. Only a writer of this PID namespace is judged
    (another namespace's pids mean nothing here), and one whose pid names a process,
    alive or a zombie (even another process that took the pid), is left alone, as is a
    segment that a running reader other than this process has yet to map (:func:`awaited`);
    only files of this user's (``/dev/shm`` is sticky: another user's are theirs to
    sweep). Local, and never raises: it runs as an arena is made and at exit, and a name
    anyone can make in ``/dev/shm`` must not stop either."""
    namespace = pid_namespace()
    if not namespace:
        return
    prefix = f"tensorcast-{namespace}-"
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        pid = name[len(prefix) :].partition("-")[0] if name.startswith(prefix) else ""
        if not (pid.isascii() and pid.isdigit() and len(pid) <= 10):
            continue
        path = f"{SHM_DIR}/{name}"
        try:
            st = os.lstat(path)
            if (
                stat.S_ISREG(st.st_mode)
                and st.st_uid == os.geteuid()
                and not alive(int(pid))
                and not awaited(_cells_of(path))
            ):
                os.unlink(path)
        except (OSError, OverflowError):  # gone meanwhile, not ours, a pid past any
            continue


def _cells_of(path: str) -> list[tuple[int, int, int]]:
    """A segment's readers' cells (mapped, released, pid), read from its file; none where
    it is no segment of tensorcast's (nothing then awaits it)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        head = os.pread(fd, HEAD.size, 0)
        if len(head) < HEAD.size:
            return []
        magic, at, _capacity, readers = HEAD.unpack(head)
        if magic != MAGIC or readers > _MAX_READERS or at != data_at(readers):
            return []
        lines = os.pread(fd, LINE * readers, LINE)
    finally:
        os.close(fd)
    return [_CELLS.unpack_from(lines, LINE * i) for i in range(len(lines) // LINE)]


def alive(pid: int) -> bool:
    """Whether ``pid`` names a process: alive, a zombie, or another user's that took it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's process has the pid
        return True
    return True


# NOTE [ An arena that ends before its readers read ]
# A source's call returns once its frame's first message went out, and its receivers map
# the slot when they read that message: a source that ends its program at once (a
# ``tensorcast.broadcast``, then exit) may end before they have. So a segment names its
# readers' pids (in their cells, from the tokens they told at setup), and it is unlinked
# neither by its arena as it goes nor by a sweep (:func:`sweep_dead`) while a reader that
# has not mapped it is alive: the last reader to map it unlinks it as always, and one that
# ends first sweeps it at its exit, as a process sweeps everything of dead writers that no
# other live process awaits. A reader of another PID namespace is not waited for (its pid
# means nothing here), nor is a zombie. What is left when the last process of the
# namespace to end is such a reader, killed (SIGKILL) before it mapped it, the next process
# of the namespace that makes an arena or ends with one sweeps.


def pid_of(token: str) -> int | None:
    """The pid a :func:`new_token` of this PID namespace names, else None."""
    parts = token.split("-")
    namespace = pid_namespace()
    if len(parts) == 4 and namespace and parts[1] == str(namespace) and parts[2].isdigit():
        return int(parts[2])
    return None


def awaited(cells: Any) -> bool:
    """Whether a segment whose readers' cells are ``cells`` (mapped, released, pid rows)
    is awaited by a reader that has not mapped it and is still running (not this
    process: a process sweeps as it starts, before anything names it, and as it ends)."""
    me = os.getpid()
    return any(not mapped and pid and pid != me and _running(int(pid)) for mapped, _, pid in cells)


def _running(pid: int) -> bool:
    """Whether ``pid`` names a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return alive(pid)  # no /proc: a signal 0 tells alive from gone
