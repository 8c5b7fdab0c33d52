"""Who may unlink a segment, and the sweep of what the dead left (``transport.sweep``;
NOTE [ An arena that ends before its readers read ])."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from shm_slots import mine, send, shm_left_as_it_was
from subprocs import run_killable

from tensorcast.transport import shm, sweep
from tensorcast.transport.shm import Reader, Writer, new_token

pytestmark = pytest.mark.usefixtures(shm_left_as_it_was.__name__)


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    return int(done.stdout)


def _token_of(pid: int) -> str:
    """A token as the process ``pid`` would make it."""
    return new_token().replace(f"-{os.getpid()}-", f"-{pid}-")


@pytest.fixture
def reader_process() -> Iterator[subprocess.Popen[bytes]]:
    """Another live process, standing in for a reader rank."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield process
    process.kill()
    process.wait()


def test_an_arena_let_go_of_leaves_a_sent_slot_to_a_live_reader_that_has_not_mapped_it(
    reader_process: subprocess.Popen[bytes],
) -> None:
    token = new_token()
    writer = Writer(token, 1, 1 << 24, [_token_of(reader_process.pid)])
    ref = send(writer, b"a" * 5000) or pytest.fail("no slot")
    writer.take(5000) or pytest.fail("no slot")  # taken, its frame never sent
    del writer  # the source's program ended before its reader read
    assert sorted(n for n in mine() if n.startswith(token)) == [f"{token}-1"]
    shm.sweep_dead()  # another process's sweep leaves it too, writer dead or alive
    reader = Reader(token, 0)
    assert bytes(reader.payload(ref, 5000).numpy()) == b"a" * 5000
    assert f"{token}-1" not in mine()  # the last reader to map it unlinked it


def test_a_sweep_takes_a_dead_writers_segment_once_no_live_reader_awaits_it(
    reader_process: subprocess.Popen[bytes],
) -> None:
    token = _token_of(_dead_pid())  # the arena of a writer that has ended
    writer = Writer(token, 1, 1 << 24, [_token_of(reader_process.pid)])
    send(writer, b"a" * 5000) or pytest.fail("no slot")
    writer._cleanup.detach()  # as if its process had ended with the segment awaited
    del writer
    shm.sweep_dead()
    assert f"{token}-1" in mine(), "its reader lives and has not mapped it"
    reader_process.kill()  # killed before it mapped it
    reader_process.wait()
    shm.sweep_dead()
    assert f"{token}-1" not in mine()


def test_an_arena_let_go_of_unlinks_what_only_dead_or_unknown_readers_wait_for() -> None:
    for readers in ([_token_of(_dead_pid())], [new_token()], []):  # dead, itself, unknown
        token = new_token()
        writer = Writer(token, 1, 1 << 24, readers)
        send(writer, b"a" * 5000) or pytest.fail("no slot")
        del writer
        assert not [n for n in mine() if n.startswith(token)]


def test_a_reader_sweeps_what_a_dead_writer_left() -> None:
    token = new_token()
    writer = Writer(token, 2, 1 << 24)
    send(writer, b"s" * 5000)
    assert any(n.startswith(token) for n in mine())
    Reader(token, 0).sweep()
    assert not any(n.startswith(token) for n in mine())


def test_only_what_a_dead_writer_of_this_pid_namespace_left_is_swept() -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.strip()  # fmt: skip
    namespace = sweep.pid_namespace()
    assert namespace, "no /proc/self/ns/pid here"
    names = {
        "dead": f"tensorcast-{namespace}-{dead}-0a1b-1",
        "alive": f"tensorcast-{namespace}-{os.getpid()}-0a1b-1",
        "another namespace": f"tensorcast-{namespace + 1}-{dead}-0a1b-1",
        "not a token": f"tensorcast-{namespace}-x{dead}-0a1b-1",
        "past any pid": f"tensorcast-{namespace}-{'9' * 10}-0a1b-1",
        "digits of another script": f"tensorcast-{namespace}-\u00b2-0a1b-1",
        "a folder": f"tensorcast-{namespace}-{dead}-0a1b-2",
        "another user's": f"tensorcast-{namespace}-{dead}-0a1b-3",
    }
    if os.geteuid() != 0:  # only root can hand a file to another user
        del names["another user's"]
    try:
        for what, name in names.items():
            if what == "a folder":
                Path(shm.SHM_DIR, name).mkdir()
            else:
                Path(shm.SHM_DIR, name).write_bytes(b"x")
        if "another user's" in names:
            os.chown(Path(shm.SHM_DIR, names["another user's"]), 65534, 65534)
        shm.sweep_dead()  # never raises on what anyone can make in /dev/shm
        left = {what for what, name in names.items() if Path(shm.SHM_DIR, name).exists()}
        assert left == set(names) - {"dead"}
    finally:
        for what, name in names.items():
            if what == "a folder":
                Path(shm.SHM_DIR, name).rmdir()
            else:
                Path(shm.SHM_DIR, name).unlink(missing_ok=True)


_KILLED_WRITER = """
import os, signal, sys
from tensorcast.transport.shm import Writer, new_token
writer = Writer(new_token(), 1, 1 << 24)
got = writer.take(1 << 20)  # a new segment that its one reader never maps
writer.sent(got.ref)
print(writer.token, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


_NEXT_PROCESS = """
from tensorcast.transport.shm import Reader, new_token
Reader(new_token(), 0)  # the first arena this process makes
"""


def test_a_segment_no_survivor_swept_goes_with_the_next_process_that_makes_an_arena() -> None:
    """Every rank of the host killed while a segment waits for a reader to map it: no
    process alive can sweep it by its token; the next one that makes an arena does."""
    env = dict(os.environ)
    code, out = run_killable([sys.executable, "-c", _KILLED_WRITER], Path.cwd(), env, 120)
    token = out.strip().splitlines()[0]
    assert code == -9 and any(n.startswith(token) for n in mine()), out
    code, out = run_killable([sys.executable, "-c", _NEXT_PROCESS], Path.cwd(), env, 120)
    assert code == 0, out
    assert not any(n.startswith(token) for n in mine())


def test_a_forked_child_leaves_its_parents_segments() -> None:
    token = new_token()
    writer = Writer(token, 1, 1 << 24)
    send(writer, b"f" * 5000)
    pid = os.fork()  # as a DataLoader worker is made
    if pid == 0:
        writer._cleanup()  # what its exit would run
        os._exit(0)
    os.waitpid(pid, 0)
    assert any(n.startswith(token) for n in mine())
    writer.close()
    assert not any(n.startswith(token) for n in mine())
