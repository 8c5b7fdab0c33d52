"""The shared-memory arena alone (``transport.shm``): slots, their release rule, the cap,
and the lane's arguments (NOTE [ Shared-memory slots ])."""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from shm_slots import mine, send, shm_left_as_it_was

import tensorcast as tc
from tensorcast.transport import relay as relays
from tensorcast.transport import shm
from tensorcast.transport.frame import SHM_REF_BYTES, Flags, cut_frame
from tensorcast.transport.shm import Reader, Ref, Writer, new_token

pytestmark = pytest.mark.usefixtures(shm_left_as_it_was.__name__)


def test_a_slot_is_unlinked_once_every_reader_mapped_it() -> None:
    token = new_token()
    writer, readers = Writer(token, 2, 1 << 24), [Reader(token, 0), Reader(token, 1)]
    ref = send(writer, b"a" * 5000) or pytest.fail("no slot")
    first = readers[0].payload(ref, 5000)
    assert f"{token}-1" in mine()  # one reader has not mapped it yet
    second = readers[1].payload(ref, 5000)
    assert f"{token}-1" not in mine()  # the last reader unlinked it
    assert bytes(first.numpy()) == bytes(second.numpy()) == b"a" * 5000


def test_a_slot_is_written_again_only_once_every_reader_and_the_writer_let_go() -> None:
    token = new_token()
    writer, reader = Writer(token, 1, 1 << 24), Reader(token, 0)
    got = writer.take(5000) or pytest.fail("no slot")
    own = got.seen[:10]  # the source's own tree views its slot too
    writer.sent(got.ref)
    ref = got.ref
    held = reader.payload(ref, 5000)[:10]  # a view the caller keeps
    reader.release()
    ref2 = send(writer, b"y" * 5000) or pytest.fail("no slot")
    assert ref2.slot != ref.slot  # the first slot is still seen by the reader
    del held
    reader.release()
    ref3 = send(writer, b"z" * 5000) or pytest.fail("no slot")
    assert ref3.slot not in (ref.slot, ref2.slot)  # the source still holds the first
    del got, own
    reader.release()
    ref4 = send(writer, b"w" * 5000) or pytest.fail("no slot")
    assert ref4.slot == ref.slot and ref4.generation == ref.generation + 1
    writer.close()


def test_the_writer_takes_the_smallest_free_slot_that_holds_the_payload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The law: a payload goes into the free slot of the least capacity that holds it, a
    larger one only while the smaller is seen; a take whose best slot is free asks the
    reuse rule once, not once a slot."""
    token = new_token()
    writer, reader = Writer(token, 1, 1 << 26), Reader(token, 0)
    big_ref = send(writer, b"b" * 3_000_000) or pytest.fail("no slot")
    big = reader.payload(big_ref, 3_000_000)  # seen: the next payload takes another slot
    small_ref = send(writer, b"s" * 300_000) or pytest.fail("no slot")
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
    ref = send(writer, b"t" * 200_000) or pytest.fail("no slot")
    assert ref.slot == small_ref.slot and len(checks) == 1
    held = reader.payload(ref, 200_000)
    checks.clear()
    ref = send(writer, b"u" * 200_000) or pytest.fail("no slot")
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
            ref = send(writer, b"q" * 600_000)
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
    ref = send(writer, b"h" * 600_000) or pytest.fail("no slot")
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
        ref = send(writer, bytes([i]) * 300_000) or pytest.fail("no slot")
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
    ref = send(writer, b"m" * 5000) or pytest.fail("no slot")
    payload = reader.payload(ref, 5000)
    array = payload[:2000].numpy()  # a numpy leaf: a raw pointer into the slot
    leaf = payload[2000:]
    del payload
    leaf.share_memory_()  # what a torch.multiprocessing queue does
    reader.release()
    for fill in b"nop":
        ref2 = send(writer, bytes([fill]) * 5000) or pytest.fail("no slot")
        assert ref2.slot != ref.slot
        assert bytes(reader.payload(ref2, 5000).numpy()) == bytes([fill]) * 5000
        reader.release()
    assert bytes(array) == b"m" * 2000 and bytes(leaf.numpy()) == b"m" * 3000
    del array, leaf
    reader.release()
    ref3 = send(writer, b"q" * 5000) or pytest.fail("no slot")
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
    ref = send(writer, b"a" * 5000) or pytest.fail("no slot")
    kept = reader.payload(ref, 5000).untyped_storage()
    reader.release()
    ref2 = send(writer, b"b" * 5000) or pytest.fail("no slot")
    assert ref2.slot != ref.slot
    assert bytes(torch.empty(0, dtype=torch.uint8).set_(kept)[:5000].numpy()) == b"a" * 5000
    kept.share_memory_()
    reader.release()
    for fill in b"cdefg":
        ref3 = send(writer, bytes([fill]) * 5000) or pytest.fail("no slot")
        assert bytes(reader.payload(ref3, 5000).numpy()) == bytes([fill]) * 5000
        reader.release()
    del kept
    writer.close()


def test_a_slot_is_released_once_nothing_sees_it_and_not_before() -> None:
    """Each way a caller can see a slot keeps it: a view, a numpy array, the storage
    object, a weak reference to it. Let go of, the slot comes back."""
    token = new_token()
    writer, reader = Writer(token, 1, 1 << 24), Reader(token, 0)
    ref = send(writer, b"r" * 5000) or pytest.fail("no slot")
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


def test_a_bad_ref_is_a_header_error() -> None:
    token = new_token()
    writer, reader = Writer(token, 1, 1 << 24), Reader(token, 0)
    ref = send(writer, b"b" * 5000) or pytest.fail("no slot")
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
