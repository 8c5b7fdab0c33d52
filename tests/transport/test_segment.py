"""One segment as a process sees it (``transport.segment``): private views whose writes
stay in their process, and what is dropped before a slot is handed out again (NOTE
[ Private views of a slot ])."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from shm_slots import shm_left_as_it_was
from subprocs import run_killable

from tensorcast.transport import shm
from tensorcast.transport.shm import Reader, Writer, new_token

pytestmark = pytest.mark.usefixtures(shm_left_as_it_was.__name__)


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
