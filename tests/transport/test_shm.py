"""The shared-memory arena alone (``transport.shm``): slots, their release rule, the cap,
and ``/dev/shm`` left as it was (NOTE [ Shared-memory slots ])."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from subprocs import run_killable

import tensorcast as tc
from tensorcast.transport import relay as relays
from tensorcast.transport import shm, sweep
from tensorcast.transport.frame import SHM_REF_BYTES, Flags, cut_frame
from tensorcast.transport.shm import Reader, Ref, Writer, new_token


def _mine() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith("tensorcast-")}


@pytest.fixture(autouse=True)
def shm_left_as_it_was() -> Iterator[None]:
    gc.collect()  # the arenas of earlier tests count against the process's cap until freed
    shm._wire_warned.clear()  # said once a process: each test is a process of its own here
    before = _mine()
    yield
    assert _mine() <= before, f"left in {shm.SHM_DIR}: {sorted(_mine() - before)}"


def _send(writer: Writer, data: bytes) -> Ref | None:
    """Write ``data`` into a slot as a source does, keeping no view of it."""
    got = writer.take(len(data))
    if got is None:
        return None
    got.into.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    writer.sent(got.ref)
    return got.ref


def test_a_slot_is_unlinked_once_every_reader_mapped_it() -> None:
    token = new_token()
    writer, readers = Writer(token, 2, 1 << 24), [Reader(token, 0), Reader(token, 1)]
    ref = _send(writer, b"a" * 5000) or pytest.fail("no slot")
    first = readers[0].payload(ref, 5000)
    assert f"{token}-1" in _mine()  # one reader has not mapped it yet
    second = readers[1].payload(ref, 5000)
    assert f"{token}-1" not in _mine()  # the last reader unlinked it
    assert bytes(first.numpy()) == bytes(second.numpy()) == b"a" * 5000


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
    ref = _send(writer, b"a" * 5000) or pytest.fail("no slot")
    writer.take(5000) or pytest.fail("no slot")  # taken, its frame never sent
    del writer  # the source's program ended before its reader read
    assert sorted(n for n in _mine() if n.startswith(token)) == [f"{token}-1"]
    shm.sweep_dead()  # another process's sweep leaves it too, writer dead or alive
    reader = Reader(token, 0)
    assert bytes(reader.payload(ref, 5000).numpy()) == b"a" * 5000
    assert f"{token}-1" not in _mine()  # the last reader to map it unlinked it


def test_a_sweep_takes_a_dead_writers_segment_once_no_live_reader_awaits_it(
    reader_process: subprocess.Popen[bytes],
) -> None:
    token = _token_of(_dead_pid())  # the arena of a writer that has ended
    writer = Writer(token, 1, 1 << 24, [_token_of(reader_process.pid)])
    _send(writer, b"a" * 5000) or pytest.fail("no slot")
    writer._cleanup.detach()  # as if its process had ended with the segment awaited
    del writer
    shm.sweep_dead()
    assert f"{token}-1" in _mine(), "its reader lives and has not mapped it"
    reader_process.kill()  # killed before it mapped it
    reader_process.wait()
    shm.sweep_dead()
    assert f"{token}-1" not in _mine()


def test_an_arena_let_go_of_unlinks_what_only_dead_or_unknown_readers_wait_for() -> None:
    for readers in ([_token_of(_dead_pid())], [new_token()], []):  # dead, itself, unknown
        token = new_token()
        writer = Writer(token, 1, 1 << 24, readers)
        _send(writer, b"a" * 5000) or pytest.fail("no slot")
        del writer
        assert not [n for n in _mine() if n.startswith(token)]


def test_a_slot_is_written_again_only_once_every_reader_and_the_writer_let_go() -> None:
    token = new_token()
    writer, reader = Writer(token, 1, 1 << 24), Reader(token, 0)
    got = writer.take(5000) or pytest.fail("no slot")
    own = got.seen[:10]  # the source's own tree views its slot too
    writer.sent(got.ref)
    ref = got.ref
    held = reader.payload(ref, 5000)[:10]  # a view the caller keeps
    reader.release()
    ref2 = _send(writer, b"y" * 5000) or pytest.fail("no slot")
    assert ref2.slot != ref.slot  # the first slot is still seen by the reader
    del held
    reader.release()
    ref3 = _send(writer, b"z" * 5000) or pytest.fail("no slot")
    assert ref3.slot not in (ref.slot, ref2.slot)  # the source still holds the first
    del got, own
    reader.release()
    ref4 = _send(writer, b"w" * 5000) or pytest.fail("no slot")
    assert ref4.slot == ref.slot and ref4.generation == ref.generation + 1
    writer.close()


@pytest.mark.parametrize("pagemap", [True, False])
def test_a_write_into_a_view_stays_in_its_process_and_the_slot_arrives_whole_again(
    monkeypatch: pytest.MonkeyPatch, pagemap: bool
) -> None:
    """NOTE [ Private views of a slot ]: a write into a reader's view, or into the writer's
    own tree, is seen by no one else (not another reader, not the segment); once the
    slot is released, its next payload arrives as written, the pages written included,
    whether ``/proc/self/pagemap`` says which pages were written or cannot be read."""
    if not pagemap:
        real_open = os.open

        def no_pagemap(path: str, *args: Any) -> int:
            if path == "/proc/self/pagemap":
                raise PermissionError(path)
            return real_open(path, *args)

        monkeypatch.setattr(shm.os, "open", no_pagemap)
    token = new_token()
    n = 3 * 4096
    writer, readers = Writer(token, 2, 1 << 24), [Reader(token, 0), Reader(token, 1)]
    got = writer.take(n) or pytest.fail("no slot")
    got.into.fill_(ord("a"))
    writer.sent(got.ref)
    one, two = (r.payload(got.ref, n) for r in readers)
    one[5000] = ord("1")
    got.seen[0] = ord("s")
    assert bytes(two.numpy()) == bytes(got.into.numpy()) == b"a" * n
    assert one[0] == ord("a") and got.seen[5000] == ord("a")
    first = got.ref
    del one, two, got
    for r in readers:
        r.release()
    again = writer.take(n) or pytest.fail("no slot")
    assert again.ref.slot == first.slot and again.ref.generation == first.generation + 1
    again.into.fill_(ord("b"))
    writer.sent(again.ref)
    assert bytes(again.seen.numpy()) == b"b" * n
    for r in readers:
        assert bytes(r.payload(again.ref, n).numpy()) == b"b" * n
    del again
    writer.close()


_LOCKED = """
import ctypes, sys, warnings
import torch
from tensorcast.transport.shm import Reader, Writer, new_token
if ctypes.CDLL(None, use_errno=True).mlockall(2):  # MCL_FUTURE
    sys.exit(3)  # not allowed here
writer = Writer(new_token(), 1, 1 << 26)
reader = Reader(writer.token, 0)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    for fill in (5, 6):
        got = writer.take(1 << 20)
        got.into.fill_(fill)
        writer.sent(got.ref)
        seen = reader.payload(got.ref, 1 << 20)
        assert got.seen[:4].tolist() == seen[-4:].tolist() == [fill] * 4, (got.seen[:4], seen[-4:])
        del got, seen
        reader.release()
writer.close()
assert len([w for w in said if "mlockall" in str(w.message)]) == 1, [str(w.message) for w in said]
print("ok")
"""


def test_a_process_that_locks_its_memory_reads_the_shared_pages_and_is_told_once() -> None:
    """Under ``mlockall(MCL_FUTURE)`` the kernel copies a private mapping's pages when it
    maps them, and they cannot be dropped: views go through the shared mapping, with
    one warning, and every frame arrives as written (else the source's own tree read
    the zeros of the mapping's first moment)."""
    code, out = run_killable([sys.executable, "-c", _LOCKED], Path.cwd(), dict(os.environ), 60)
    if code == 3:
        pytest.skip("mlockall is not allowed here")
    assert code == 0 and out.strip().endswith("ok"), out


def test_a_page_written_past_a_later_smaller_payload_is_dropped_too() -> None:
    """A page written in a large payload's views, past the end of the next, smaller
    payload in that slot, is dropped before the slot's views are handed out again."""
    token = new_token()
    big = 64 * 4096
    writer, reader = Writer(token, 1, 1 << 24), Reader(token, 0)
    for size, fill in ((big, b"a"), (4096, b"b"), (big, b"c")):
        got = writer.take(size) or pytest.fail("no slot")
        assert got.ref.slot == 0
        got.into.copy_(torch.frombuffer(bytearray(fill * size), dtype=torch.uint8))
        writer.sent(got.ref)
        assert bytes(got.seen.numpy()) == fill * size
        seen = reader.payload(got.ref, size)
        assert bytes(seen.numpy()) == fill * size
        got.seen[size - 1] = seen[size - 1] = ord("x")  # both ranks write their last page
        del got, seen
        reader.release()
    writer.close()


def test_the_writer_takes_the_smallest_free_slot_that_holds_the_payload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The law: a payload goes into the free slot of the least capacity that holds it, a
    larger one only while the smaller is seen; a take whose best slot is free asks the
    reuse rule once, not once a slot."""
    token = new_token()
    writer, reader = Writer(token, 1, 1 << 26), Reader(token, 0)
    big_ref = _send(writer, b"b" * 3_000_000) or pytest.fail("no slot")
    big = reader.payload(big_ref, 3_000_000)  # seen: the next payload takes another slot
    small_ref = _send(writer, b"s" * 300_000) or pytest.fail("no slot")
    small = reader.payload(small_ref, 300_000)
    assert small_ref.slot != big_ref.slot
    del big, small
    reader.release()
    checks: list[int] = []
    free = Writer._free

    def counted(self: Writer, slot: Any) -> bool:
        checks.append(slot.mapping.capacity)
        return free(self, slot)

    monkeypatch.setattr(Writer, "_free", counted)
    ref = _send(writer, b"t" * 200_000) or pytest.fail("no slot")
    assert ref.slot == small_ref.slot and len(checks) == 1
    held = reader.payload(ref, 200_000)
    checks.clear()
    ref = _send(writer, b"u" * 200_000) or pytest.fail("no slot")
    assert ref.slot == big_ref.slot and checks == sorted(checks) and len(checks) == 2
    assert bytes(reader.payload(ref, 200_000)[:3].numpy()) == b"uuu"
    del held
    reader.release()
    writer.close()


def test_the_writer_never_blocks_it_grows_within_its_cap_then_says_wire() -> None:
    token = new_token()
    writer, reader = Writer(token, 1, 3 * (1 << 20)), Reader(token, 0)
    held = []
    with pytest.warns(RuntimeWarning, match="hold .* bytes of their cap .* let go of batches"):
        for _ in range(8):
            ref = _send(writer, b"q" * 600_000)
            if ref is None:
                break
            held.append(reader.payload(ref, 600_000))
    assert 1 <= len(held) < 8 and writer.nbytes <= writer.cap
    del held
    reader.release()
    assert writer.take(600_000) is not None
    writer.close()


def test_a_payload_over_the_cap_warns_once_and_travels_on_the_wire() -> None:
    writer = Writer(new_token(), 1, 1 << 20)
    with pytest.warns(RuntimeWarning, match="--shm-size"):
        assert writer.take(2 << 20) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert writer.take(2 << 20) is None


def test_with_no_limit_set_an_arena_leaves_half_of_dev_shm_to_its_other_users(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Several sources on a host each take a share of the space free when they start: by
    default none grows past half of ``/dev/shm`` (DataLoader workers and NCCL use it too)."""
    monkeypatch.delenv("TENSORCAST_SHM_LIMIT", raising=False)
    page, real = 4096, os.statvfs
    fs = SimpleNamespace(f_frsize=page, f_blocks=(8 << 20) // page, f_bavail=(5 << 20) // page)
    monkeypatch.setattr(os, "statvfs", lambda path: fs if path == shm.SHM_DIR else real(path))
    token = new_token()
    writer, reader = Writer(token, 1, 1 << 30), Reader(token, 0)
    ref = _send(writer, b"h" * 600_000) or pytest.fail("no slot")
    held = reader.payload(ref, 600_000)
    with pytest.warns(RuntimeWarning, match="less than half of /dev/shm free"):
        assert writer.take(2 << 20) is None  # 5 MiB free of 8: 2 more would leave 3
    monkeypatch.setenv("TENSORCAST_SHM_LIMIT", str(1 << 30))  # set: the user's call
    assert writer.take(2 << 20) is not None
    del held
    writer.close()


def test_an_arena_whose_every_slot_is_held_says_so_once_and_uses_the_wire() -> None:
    token = new_token()
    writer, reader = Writer(token, 1, 1 << 30), Reader(token, 0)
    held = []
    for i in range(shm.MAX_SLOTS):
        ref = _send(writer, bytes([i]) * 300_000) or pytest.fail("no slot")
        held.append(reader.payload(ref, 300_000))
    with pytest.warns(RuntimeWarning, match=f"all {shm.MAX_SLOTS} slots .* still referenced"):
        assert writer.take(300_000) is None
    del held
    reader.release()
    assert writer.take(300_000) is not None
    writer.close()


def test_a_process_is_told_once_whichever_of_its_arenas_falls_back() -> None:
    one, two = Writer(new_token(), 1, 1 << 20), Writer(new_token(), 1, 1 << 20)
    with pytest.warns(RuntimeWarning, match="--shm-size") as said:
        assert one.take(2 << 20) is None and two.take(2 << 20) is None
        assert one.take(600_000) is not None and two.take(600_000) is None  # the cap is full
    assert len([w for w in said if "tensorcast" in str(w.message)]) == 1
    one.close()


def test_a_moved_storage_keeps_its_slot_while_it_lives() -> None:
    """A caller's ``share_memory_()`` of one leaf moves the whole storage off the slot,
    but a numpy leaf of the same batch, made before the move, still reads the slot's
    pages: the slot is not written again until the moved storage dies."""
    token = new_token()
    writer, reader = Writer(token, 1, 1 << 24), Reader(token, 0)
    ref = _send(writer, b"m" * 5000) or pytest.fail("no slot")
    payload = reader.payload(ref, 5000)
    array = payload[:2000].numpy()  # a numpy leaf: a raw pointer into the slot
    leaf = payload[2000:]
    del payload
    leaf.share_memory_()  # what a torch.multiprocessing queue does
    reader.release()
    for fill in b"nop":
        ref2 = _send(writer, bytes([fill]) * 5000) or pytest.fail("no slot")
        assert ref2.slot != ref.slot
        assert bytes(reader.payload(ref2, 5000).numpy()) == bytes([fill]) * 5000
        reader.release()
    assert bytes(array) == b"m" * 2000 and bytes(leaf.numpy()) == b"m" * 3000
    del array, leaf
    reader.release()
    ref3 = _send(writer, b"q" * 5000) or pytest.fail("no slot")
    assert ref3.slot == ref.slot  # the moved storage died: nothing sees the slot
    assert bytes(reader.payload(ref3, 5000).numpy()) == b"q" * 5000
    writer.close()


def test_a_storage_object_kept_alone_keeps_its_slot_then_moves_off_it() -> None:
    """A caller that keeps only a batch leaf's ``untyped_storage()`` keeps the slot's own
    storage object: the slot is not written again while it lives. Its ``share_memory_()``
    then moves that storage, the slot's view included, off the mapping: later frames in
    the slot still arrive as written."""
    token = new_token()
    writer, reader = Writer(token, 1, 1 << 24), Reader(token, 0)
    ref = _send(writer, b"a" * 5000) or pytest.fail("no slot")
    kept = reader.payload(ref, 5000).untyped_storage()
    reader.release()
    ref2 = _send(writer, b"b" * 5000) or pytest.fail("no slot")
    assert ref2.slot != ref.slot
    assert bytes(torch.empty(0, dtype=torch.uint8).set_(kept)[:5000].numpy()) == b"a" * 5000
    kept.share_memory_()
    reader.release()
    for fill in b"cdefg":
        ref3 = _send(writer, bytes([fill]) * 5000) or pytest.fail("no slot")
        assert bytes(reader.payload(ref3, 5000).numpy()) == bytes([fill]) * 5000
        reader.release()
    del kept
    writer.close()


def test_a_slot_is_released_once_nothing_sees_it_and_not_before() -> None:
    """Each way a caller can see a slot keeps it: a view, a numpy array, the storage
    object, a weak reference to it. Let go of, the slot comes back."""
    token = new_token()
    writer, reader = Writer(token, 1, 1 << 24), Reader(token, 0)
    ref = _send(writer, b"r" * 5000) or pytest.fail("no slot")
    payload = reader.payload(ref, 5000)
    holds: dict[str, Callable[[torch.Tensor], object]] = {
        "view": lambda t: t[3:7],
        "numpy": lambda t: t.numpy()[10:],
        "storage": lambda t: t.untyped_storage(),
        "weak reference": lambda t: weakref.ref(t.untyped_storage()),
    }
    for what, hold in holds.items():
        kept = hold(payload)
        del payload
        reader.release()
        assert reader._held, f"a {what} kept did not keep the slot"
        payload = reader.payload(ref, 5000)
        del kept
    del payload
    reader.release()
    assert not reader._held
    writer.close()


def test_a_reader_sweeps_what_a_dead_writer_left() -> None:
    token = new_token()
    writer = Writer(token, 2, 1 << 24)
    _send(writer, b"s" * 5000)
    assert any(n.startswith(token) for n in _mine())
    Reader(token, 0).sweep()
    assert not any(n.startswith(token) for n in _mine())


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
    assert code == -9 and any(n.startswith(token) for n in _mine()), out
    code, out = run_killable([sys.executable, "-c", _NEXT_PROCESS], Path.cwd(), env, 120)
    assert code == 0, out
    assert not any(n.startswith(token) for n in _mine())


def test_a_bad_ref_is_a_header_error() -> None:
    token = new_token()
    writer, reader = Writer(token, 1, 1 << 24), Reader(token, 0)
    ref = _send(writer, b"b" * 5000) or pytest.fail("no slot")
    with pytest.raises(tc.HeaderError):
        reader.payload(ref, 1 << 30)
    buf = bytearray(16)
    Ref(shm.MAX_SLOTS, 1, 1).pack_into(memoryview(buf), 0)
    with pytest.raises(tc.HeaderError):
        Ref.unpack(memoryview(buf), 0)
    writer.close()


def test_a_frame_in_shared_memory_carries_its_ref_in_the_first_message() -> None:
    cut = cut_frame(4096, 100, 1 << 20, host_payloads=True, shm=True)
    assert cut.shm and not cut.inline and not cut.separate_payload
    assert cut.flags & Flags.SHM and cut.payload_at == 4096 - SHM_REF_BYTES
    assert SHM_REF_BYTES == shm.REF_SIZE
    spilled = cut_frame(4096, 4096 - 40, 1 << 20, host_payloads=True, shm=True)
    assert spilled.spill


@pytest.mark.parametrize("bad", ["yes", 1, 0])
def test_shm_is_none_true_or_false(bad: object) -> None:
    with pytest.raises(TypeError, match="shm must be None"):
        tc.BroadcastingDataLoader([1], shm=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shm must be None"):
        tc.broadcast_batch({}, None, shm=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["-1", "lots", "1.5"])
def test_a_limit_that_is_no_number_of_bytes_is_refused(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENSORCAST_SHM_LIMIT", text)  # -1 used to turn the lane off unsaid
    with pytest.raises(ValueError, match="must be a number of bytes"):
        shm.limit()


def test_a_source_without_room_says_why_and_is_told_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "limit", lambda: 0)  # /dev/shm full: its free share is 0
    monkeypatch.setattr(shm, "available", lambda: None)

    def setup(src_told: dict[str, Any], *, rank: int = 0, host: str = "h") -> Any:
        receiver = {"host": host, "shm_why_not": "", "shm_error": "", "shm_token": new_token()}
        extras = {0: src_told, 1: receiver}
        return relays.arena(None, (0, 1), 0, rank, extras, True, "a setup")

    told = relays.told(True, None, None)
    assert told is not None and told["shm_why_not"] == "no free space in /dev/shm"
    told["host"] = "h"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert setup(told, host="elsewhere") is None  # no lane anyway: nothing to say
        assert setup(told, rank=1) is None  # a receiver: the source says it
    with pytest.warns(RuntimeWarning, match="no free space in /dev/shm, so payloads travel"):
        assert setup(told) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert setup(told) is None  # said once a process
        monkeypatch.setenv("TENSORCAST_SHM_LIMIT", "0")
        shm._wire_warned.clear()
        told = relays.told(True, None, None)  # the user turned it off: nothing to say
        assert told is not None and told["shm_why_not"] == "TENSORCAST_SHM_LIMIT=0 turns it off"
        told["host"] = "h"
        assert setup(told) is None


def test_a_forked_child_leaves_its_parents_segments() -> None:
    token = new_token()
    writer = Writer(token, 1, 1 << 24)
    _send(writer, b"f" * 5000)
    pid = os.fork()  # as a DataLoader worker is made
    if pid == 0:
        writer._cleanup()  # what its exit would run
        os._exit(0)
    os.waitpid(pid, 0)
    assert any(n.startswith(token) for n in _mine())
    writer.close()
    assert not any(n.startswith(token) for n in _mine())


def _routes(hosts: list[str], src: int = 0) -> list[tuple[str, Any]]:
    """Every rank's side and route of a channel over ranks on ``hosts`` (by rank)."""
    from tensorcast.transport import relay

    group = SimpleNamespace(ranks=tuple(range(len(hosts))), wire=SimpleNamespace(streams=None))
    extras = {r: {"host": h, "shm_why_not": "", "shm_token": f"t{r}"} for r, h in enumerate(hosts)}
    out = []
    for rank in range(len(hosts)):
        side, route = relay.open_side(None, group, src, rank, extras, "x")  # type: ignore[arg-type]
        if side is None and route is not None:
            side = route.writer  # a leader's arena, for its host
        name = "" if side is None else f"{type(side).__name__}:{side.token}"
        out.append((name, None if route is None else route.route))
    return out


def test_a_route_over_hosts_takes_one_rank_per_remote_host() -> None:
    from tensorcast.transport.relay import Route

    assert _routes(["a", "a", "b", "b", "b"]) == [
        ("Writer:t0", Route(leaders=(2,), near=(1,))),
        ("Reader:t0", Route(upstream=0, near_source=True)),
        ("Writer:t2", Route(upstream=0, leads=True, followers=(3, 4))),
        ("Reader:t2", Route(upstream=2)),
        ("Reader:t2", Route(upstream=2)),
    ]
    # the source alone on its host, a leader alone on its own: no arena for either
    assert _routes(["a", "b", "b", "c"])[0] == ("", Route(leaders=(1, 3)))
    assert _routes(["a", "b", "b", "c"])[3] == ("", Route(upstream=0, leads=True))
    # one host: the arena alone; every rank on its own host: the wire alone
    assert [route for _, route in _routes(["a", "a"])] == [None, None]
    assert _routes(["a", "b", "c"]) == [("", None)] * 3


class _Wire:
    """A relayed wire whose receives or sends fail as a dead peer's do."""

    def __init__(self, failing: str) -> None:
        self.failing, self.now = failing, ""

    def send(self, tensor: torch.Tensor, peers: tuple[int, ...]) -> _Wire:
        self.now = "send"
        return self

    def recv(self, tensor: torch.Tensor, peer: int) -> _Wire:
        self.now = "recv"
        return self

    def wait(self, timeout: Any) -> None:
        if self.now == self.failing:
            raise RuntimeError("Connection closed by peer")


def test_a_relayed_wait_that_fails_names_the_peer_it_waited_on() -> None:
    """A host's leader or follower that fails in the relay names the peer it waited on
    (not the source), in the receiver's ``PeerError``."""
    import datetime

    from tensorcast.transport.pool import BufferPool
    from tensorcast.transport.receiver import Receiver
    from tensorcast.transport.relay import Relay, Route

    ranks, wait = (10, 11, 12, 13), datetime.timedelta(seconds=1)
    follower = Relay(Route(upstream=2), None, None, ranks)
    leader = Relay(Route(upstream=0, leads=True, followers=(3,)), None, None, ranks)
    for relay, failing, says in [
        (follower, "recv", "receiving the rest of a frame from this host's leader, rank 12"),
        (
            leader,
            "send",
            "passing the rest of a frame on to this host's ranks [13], as their leader",
        ),
    ]:
        with pytest.raises(RuntimeError) as caught:
            relay.receive(_Wire(failing), BufferPool(), None, 5000, wait)
        me = SimpleNamespace(
            group=SimpleNamespace(lane=SimpleNamespace(break_=lambda e: None), ranks=ranks),
            _relay=relay, _shm=None, src=10,
        )  # fmt: skip
        with pytest.raises(tc.PeerError, match=f"^{re.escape(says)} \\(the source is rank 10\\)"):
            Receiver._break(me, caught.value)  # type: ignore[arg-type]
