"""A sender and a receiver over a fake wire: how frames are cut, checked and rebuilt.

The library's fake (``tensorcast.transport.testing.FakeWire``) stands in for the ``Wire``
interface, so these run in one process with no process group: the receiver runs in a thread, as it
would on its own rank.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from subprocs import run_killable
from taps import first_message_problems
from trees import (
    STEADY_STEPS,
    assert_same,
    big_header,
    every_kind,
    padded_audio,
    payload_batch,
    steady_batch,
    tiny,
)

from tensorcast._errors import DesyncError, HeaderError, PeerError, SourceError
from tensorcast.transport import frame as _frame
from tensorcast.transport.frame import Kind, Stamp
from tensorcast.transport.groups import Group
from tensorcast.transport.lane import Lane
from tensorcast.transport.receiver import END, Receiver
from tensorcast.transport.sender import Sender
from tensorcast.transport.testing import FakeWire

TIMEOUT = datetime.timedelta(seconds=10)


def pair(
    *,
    verify: bool = False,
    promises: bool = False,
    receiver_promises: bool | None = None,
    channel_id: int = 1,
) -> tuple[Sender, Receiver, FakeWire, FakeWire, Group]:
    wires = FakeWire.pair()
    groups = [Group((0, 1), w, Lane(f"fake{w.rank}", w.abort)) for w in wires]
    sender = Sender(groups[0], 0, channel_id, verify=verify, promises=promises)
    receiver = Receiver(
        groups[1],
        0,
        rank=1,
        channel_id=channel_id,
        promises=promises if receiver_promises is None else receiver_promises,
        diagnose=lambda *_: "the fake source is fine",
    )
    return sender, receiver, wires[0], wires[1], groups[1]


def transfer(sender: Sender, receiver: Receiver, tree: Any) -> tuple[Any, Any]:
    """Send ``tree`` as the sender's next frame; its own tree, and what the receiver got."""
    got: list[Any] = []

    def receive() -> None:
        try:
            got.append(receiver.recv(None, TIMEOUT))
        except BaseException as e:
            got.append(e)

    t = threading.Thread(target=receive)
    t.start()
    own = sender.send_batch(tree, None, TIMEOUT)
    t.join(20)
    if isinstance(got[0], BaseException):
        raise got[0]
    return own, got[0]


def test_inline_separate_and_spilled_frames_rebuild_and_grow_alike() -> None:
    sender, receiver, src_wire, _, rgroup = pair()
    trees = [
        {"x": torch.arange(4.0)},  # inline: one message
        {"a": torch.arange(300_000, dtype=torch.int32)},  # a payload of its own
        {"names": [f"utterance {i:05d}" for i in range(800)]},  # a header that spills
        {"x": torch.arange(4.0), "names": [f"u{i}" for i in range(800)]},  # fits after growth
    ]
    for step, tree in enumerate(trees):
        src_wire.log.clear()
        own, got = transfer(sender, receiver, tree)
        for key, want in tree.items():
            if isinstance(want, torch.Tensor):
                assert torch.equal(got[key], want) and torch.equal(own[key], want)
            else:
                assert got[key] == want == own[key]
        kinds = [what for what, _ in src_wire.log]
        assert kinds == [["head"], ["head", "payload"], ["head", "head"], ["head"]][step]
        assert rgroup.capacity == sender.group.capacity
        assert sender.frames == receiver.frames == step + 1, "each role counts its frames"
        assert sender.stamp.step == receiver.stamp.step == step + 1, "outside a pass: its own"
    assert rgroup.capacity > _frame.INITIAL_CAPACITY


def test_a_side_let_go_of_is_freed_at_once_not_by_the_garbage_collector() -> None:
    # A side held its staging, which held a method of the side: a cycle, so a loader let go
    # of kept its shared-memory arena until a collection, and the next one's arena, over the
    # process's cap, sent everything on the wire.
    sender, receiver, *_ = pair()
    transfer(sender, receiver, {"a": torch.arange(300_000, dtype=torch.int32)})
    sides = [weakref.ref(sender), weakref.ref(receiver)]
    gc.disable()
    try:
        del sender, receiver, _
        assert [side() for side in sides] == [None, None]
    finally:
        gc.enable()


# Layouts of one payload size and one cut, so that each lands where the last one did.
_SAME_SIZE = [
    lambda v: {"a": torch.full((16,), float(v))},
    lambda v: {"a": torch.full((16,), v, dtype=torch.int32)},
    lambda v: {"a": torch.full((4, 4), float(v))},
    lambda v: {"b": torch.full((64,), v % 2 == 0)},
    lambda v: {"a": torch.full((8,), v, dtype=torch.int16), "b": torch.full((8,), float(v))},
]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_SAME_SIZE) - 1), st.booleans()), max_size=12))
def test_leaves_made_ahead_are_never_another_layouts_or_a_held_batchs(
    steps: list[tuple[int, bool]],
) -> None:
    """Law: whatever the order of layouts that share a first message, and whichever
    batches the caller keeps, both ranks get each batch as sent (dtype, shape, values), and
    a batch kept stays as it was while later frames go by."""
    sender, receiver, *_ = pair()
    held: list[tuple[Any, Any, Any]] = []
    for step, (layout, hold) in enumerate(steps):
        tree = _SAME_SIZE[layout](step)
        own, got = transfer(sender, receiver, tree)
        for out in (own, got):
            assert list(out) == list(tree)
            for key, want in tree.items():
                assert out[key].dtype == want.dtype and torch.equal(out[key], want)
        if hold:
            held.append((tree, own, got))
    for tree, own, got in held:
        for key, want in tree.items():
            assert torch.equal(own[key], want) and torch.equal(got[key], want)


def test_end_and_error_frames_are_an_end_marker_and_a_source_error() -> None:
    sender, receiver, *_ = pair(channel_id=2)
    for role in (sender, receiver):
        role.stamp = Stamp(1)
    got: list[Any] = []

    def receive() -> None:
        got.append(receiver.recv(None, TIMEOUT))
        with pytest.raises(SourceError) as error:
            receiver.recv(None, TIMEOUT)
        got.append(error.value)

    t = threading.Thread(target=receive)
    t.start()
    sender.send_end(TIMEOUT)
    sender.send_error("source iterator failed: ValueError: shard 3", TIMEOUT)
    t.join(20)
    assert got[0] is END
    assert str(got[1]) == "source rank 0 reported: source iterator failed: ValueError: shard 3"
    assert sender.frames == receiver.frames == 2, "both frames counted on both sides"
    assert receiver.group.lane.broken is None, "a source's failure is no broken lane"


def test_a_frame_of_another_step_is_a_desync_that_breaks_the_lane() -> None:
    sender, receiver, _, rwire, rgroup = pair(channel_id=7)
    receiver.stamp.step = 1  # a receiver that took one frame more than the source sent
    with pytest.raises(DesyncError, match="expected channel 0x7 pass 0 step 1"):
        transfer(sender, receiver, {"x": torch.ones(2)})
    assert rgroup.lane.broken is not None and rwire.aborted
    with pytest.raises(PeerError, match="failed earlier"):
        rgroup.lane.check()


def test_frames_of_interleaved_passes_carry_their_own_pass_and_step() -> None:
    """Two passes of one channel, their frames interleaved: each frame carries its own
    pass's number and step, and the role's count of frames only grows."""
    sender, receiver, *_ = pair(channel_id=3)
    sends = [Stamp(1), Stamp(2)]
    expects = [Stamp(1), Stamp(2)]
    got: list[Any] = []

    def receive() -> None:
        for k in (0, 1, 1, 0, 1):
            got.append(int(receiver.recv(None, TIMEOUT, expects[k])["k"]))

    t = threading.Thread(target=receive)
    t.start()
    for k in (0, 1, 1, 0, 1):
        sender.send_batch({"k": torch.tensor([k])}, None, TIMEOUT, sends[k])
    t.join(20)
    assert got == [0, 1, 1, 0, 1]
    assert [(s.step, e.step) for s, e in zip(sends, expects)] == [(2, 2), (3, 3)]
    assert sender.frames == receiver.frames == 5
    assert sender.stamp.step == receiver.stamp.step == 0, "the roles' own stamps unused"


def test_a_frame_of_another_pass_is_a_desync() -> None:
    sender, receiver, _, _, rgroup = pair(channel_id=3)
    got: list[Any] = []

    def receive() -> None:
        try:
            receiver.recv(None, TIMEOUT, Stamp(1))
        except BaseException as e:
            got.append(e)

    t = threading.Thread(target=receive)
    t.start()
    sender.send_batch({"x": torch.ones(2)}, None, TIMEOUT, Stamp(2))
    t.join(20)
    assert isinstance(got[0], DesyncError)
    message = str(got[0])
    assert "expected channel 0x3 pass 1 step 0" in message and "got channel 0x3 pass 2" in message
    assert rgroup.lane.broken is not None


def test_a_corrupted_payload_fails_its_step_only() -> None:
    sender, receiver, _, rwire, rgroup = pair(verify=True)
    big = {"a": torch.arange(100_000, dtype=torch.int64)}
    rwire.corrupt_next_payload = True
    with pytest.raises(HeaderError, match="CRC32"):
        transfer(sender, receiver, big)
    assert rgroup.lane.broken is None  # the frame was read whole: the stream is in step
    assert receiver.frames == receiver.stamp.step == 1, "the refused frame was this step's"
    _, got = transfer(sender, receiver, big)
    assert torch.equal(got["a"], big["a"])


class _EditsTrimTables:
    """A source's wire end that edits one hex digit of the first trimmed leaf's pad element
    in the next first message it posts: a header that stays valid, with another value."""

    def __init__(self, wire: FakeWire) -> None:
        self._wire = wire
        self.edited = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wire, name)

    def head(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Any:
        data = tensor.numpy()
        at = data.tobytes().find(b'"00000000"')
        if not self.edited and at >= 0:
            data[at + 7] = ord("1")  # the pad element 0.0 becomes another float
            self.edited = True
        return self._wire.head(tensor, root, timeout)


@pytest.mark.parametrize("verify", [False, True])
def test_verify_covers_the_trimmed_leaves_runs_in_the_header(verify: bool) -> None:
    wires = FakeWire.pair()
    edits = _EditsTrimTables(wires[0])
    groups = [Group((0, 1), w, Lane(f"fake{w.rank}", w.abort)) for w in (edits, wires[1])]
    sender = Sender(groups[0], 0, 1, verify=verify)
    receiver = Receiver(groups[1], 0, rank=1, channel_id=1, diagnose=lambda *_: "fine")
    audio = torch.randn(8, 100_000)
    audio[1:, 30_000:] = 0.0
    tree = {"audio": audio}
    if verify:
        with pytest.raises(HeaderError, match="CRC32"):
            transfer(sender, receiver, tree)
    else:  # unseen without it: the padding arrives with another value
        _, got = transfer(sender, receiver, tree)
        assert not torch.equal(got["audio"], audio)
    assert edits.edited
    _, got = transfer(sender, receiver, tree)  # the stream is in step
    assert torch.equal(got["audio"], audio)


# -- no stale bytes travel -----------------------------------------------------------------


class _Heads:
    """A fake wire's end that keeps a copy of every head it posts."""

    def __init__(self, wire: FakeWire) -> None:
        self._wire = wire
        self.heads: list[torch.Tensor] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wire, name)

    def head(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Any:
        self.heads.append(tensor.clone())
        return self._wire.head(tensor, root, timeout)

    def first_messages(self) -> list[torch.Tensor]:
        """The heads that are first messages (a spilled header follows its own)."""
        out, spilled = [], False
        for head in self.heads:
            if not spilled:
                out.append(head)
                prefix = _frame.Prefix.unpack(head.numpy().data, head.numel())
                spilled = bool(prefix.flags & _frame.Flags.SPILL)
            else:
                spilled = False
        return out


def test_first_messages_carry_no_stale_bytes() -> None:
    """Whatever the frames before it wrote (a longer header, a longer inline payload, a
    payload whose end moved within its alignment, a spilled header, the end of a pass, an
    error), in this first message or in another the consumer held while it was written, a
    first message is zero outside its prefix, its header and its inline payload."""
    wires = FakeWire.pair()
    tap = _Heads(wires[0])
    sender = Sender(Group((0, 1), tap, Lane("fake0", wires[0].abort)), 0)  # type: ignore[arg-type]
    frames: list[tuple[str, Any]] = []
    frames += [(f"steady {i}", steady_batch(i)) for i in range(STEADY_STEPS)]
    frames += [(f"payload {i}", payload_batch(i)) for i in range(3)]
    frames += [(f"every_kind {i}", every_kind()) for i in range(2)]
    frames += [("big_header", big_header()), ("tiny", tiny())]
    frames += [  # an inline payload whose last bytes stop short of where the last one's did
        (f"tail {k}", {"tail": torch.full((64 - k,), 255, dtype=torch.uint8)}) for k in range(4)
    ]
    sent: list[str] = []  # what each first message was, in order
    for name, tree in frames:  # batch after batch
        sender.send_batch(tree, None, TIMEOUT)
        sent.append(name)
    sender.stamp = Stamp(1)
    for step, (name, tree) in enumerate(frames):  # with the end of a pass, or a failure
        sender.send_batch(tree, None, TIMEOUT)
        sender.send_end(TIMEOUT)
        sender.send_batch(tree, None, TIMEOUT)
        sender.send_error("x" * (step % 7), TIMEOUT)
        sent += [f"{name}, pass 1", f"END after {name}", f"{name} after an END", "ERROR"]
    held: list[Any] = []  # batches kept a while, as a consumer may: first messages rotate
    for step, (name, tree) in enumerate(frames * 2):
        own = sender.send_batch(tree, None, TIMEOUT)
        sent.append(f"{name}, with {len(held)} batches held")
        held = [*held[-(step % 3) :], own] if step % 3 else [own]
    firsts = tap.first_messages()
    assert len(firsts) == len(sent)
    problems = [f"{what}: {p}" for what, m in zip(sent, firsts) for p in first_message_problems(m)]
    assert problems == []


def test_a_lying_prefix_is_a_header_error() -> None:
    capacity = 4096
    buf = bytearray(capacity)
    _frame.Prefix.write(buf, Kind.DATA, _frame.Flags.INLINE, 1, 0, 0, 10, 1 << 20, capacity)
    prefix = _frame.Prefix.unpack(bytes(buf), capacity)
    wires = FakeWire.pair()
    cutter = _frame.Cutter(Group((0, 1), wires[1], Lane("fake", wires[1].abort)), promises=False)
    with pytest.raises(HeaderError, match="cut as"):  # its sizes say: not inline
        cutter.read(prefix)
    for bad, match in (
        (b"XXXX" + bytes(buf[4:]), "not a tensorcast frame"),
        (bytes(buf[:4]) + b"\x63" + bytes(buf[5:]), "frame version 99"),
        (bytes(buf[:5]) + b"\x09" + bytes(buf[6:]), "unknown frame kind"),
        (bytes(64), "not a tensorcast frame"),
        (bytes(10), "no frame prefix"),
    ):
        with pytest.raises(HeaderError, match=match):
            _frame.Prefix.unpack(bad, capacity)


# -- promised payloads (NOTE [ Promised payloads ]) ----------------------------------------


def _audio(n: int, step: int) -> dict[str, Any]:
    return {"a": torch.arange(n, dtype=torch.int32) + step + 1, "step": step}


def _stream(sender: Sender, receiver: Receiver, items: list[Any]) -> list[Any]:
    """Send ``items`` (trees, or ``"END"``) as steps 0, 1, ... of one channel; what the
    receiver got for each."""
    got: list[Any] = []

    def receive() -> None:
        try:
            for _ in items:
                got.append(receiver.recv(None, TIMEOUT))
        except BaseException as e:
            got.append(e)

    t = threading.Thread(target=receive)
    t.start()
    for item in items:
        if item == "END":
            sender.send_end(TIMEOUT)
        else:
            sender.send_batch(item, None, TIMEOUT)
    t.join(20)
    return got


def test_a_promise_is_kept_when_the_size_repeats_and_zeros_go_where_it_is_not() -> None:
    """Steps whose payload has the size of the two before it go in the promised message,
    posted before the first; a frame that cannot keep its promise (another size, an
    inline payload, the END) sends that many zero bytes, then goes on as any other, and
    the next promise waits for a longer run."""
    a, b = 300_000, 200_000
    head, pa, pb = ("head", 4096), ("payload", 4 * a), ("payload", 4 * b)
    za, zb = ("zeros", 4 * a), ("zeros", 4 * b)
    streams = {
        "sizes": (
            [
                _audio(a, 0),
                _audio(a, 1),
                *[_audio(b, s) for s in range(2, 7)],
                {"x": torch.ones(3)},
            ],
            [
                *(head, pa),  # 0: nothing promised yet
                *(head, pa),  # 1: a second payload of that size
                *(za, head, pb),  # 2: promised a, not kept: the next needs a run of 4
                *(head, pb, head, pb, head, pb),  # 3-5
                *(pb, head),  # 6: promised b, kept
                *(zb, head),  # 7: inline: promised b, not kept
            ],
        ),
        "end": (
            [_audio(a, 0), _audio(a, 1), _audio(a, 2), "END"],
            [*(head, pa), *(head, pa), *(pa, head), *(za, head)],
        ),
    }
    for name, (items, want) in streams.items():
        sender, receiver, src_wire, _, _ = pair(promises=True)
        got = _stream(sender, receiver, items)
        for step, item in enumerate(items):
            if item == "END":
                assert got[step] is END
                continue
            tree = got[step]
            assert tree.keys() == item.keys(), (name, step)
            assert all(torch.equal(tree[k], v) for k, v in item.items() if k != "step")
        assert src_wire.log == want, name  # what each step sent, in the order it was posted


@pytest.mark.parametrize("source_promises", [True, False])
def test_ranks_that_disagree_on_promises_fail_loudly(source_promises: bool) -> None:
    sender, receiver, _, rwire, rgroup = pair(
        promises=source_promises, receiver_promises=not source_promises
    )
    got = _stream(sender, receiver, [_audio(100_000, s) for s in range(3)])
    assert all(isinstance(tree, dict) for tree in got[:2])
    assert isinstance(got[2], DesyncError), got[2]
    assert "TENSORCAST_PROMISES" in str(got[2])
    assert rgroup.lane.broken is not None and rwire.aborted


# -- trimmed leaves: re-padded into memory the caller let go of


def receive_into(got: list[Any], receiver: Receiver, timeout: datetime.timedelta) -> None:
    got.append(receiver.recv(None, timeout))


def test_sender_and_receiver_rebuild_trimmed_leaves_into_reused_memory() -> None:
    wires = FakeWire.pair()
    groups = [Group((0, 1), w, Lane(f"fake{w.rank}", w.abort)) for w in wires]
    sender = Sender(groups[0], 0, 1)
    receiver = Receiver(groups[1], 0, rank=1, channel_id=1, diagnose=lambda *_: "fine")
    timeout = datetime.timedelta(seconds=10)
    ptrs = []
    for step in range(4):
        tree = padded_audio(seed=step)
        got: list[Any] = []
        t = threading.Thread(target=receive_into, args=(got, receiver, timeout))
        t.start()
        own = sender.send_batch(tree, None, timeout, trim=step != 3)
        t.join(20)
        assert_same(got[0], tree)
        assert_same(own, tree)
        assert receiver.last_nbytes < tree["audio"].nbytes / 2 or step == 3
        ptrs.append(got[0]["audio"].data_ptr())
        del got, own  # the caller lets go of the batch
    assert ptrs[1] == ptrs[2] == ptrs[0], "a CPU receiver re-pads into reused memory"


_MOVED = """
import datetime, sys, threading
import numpy as np, torch
from tensorcast.transport.groups import Group
from tensorcast.transport.lane import Lane
from tensorcast.transport.receiver import Receiver
from tensorcast.transport.sender import Sender
from tensorcast.transport.testing import FakeWire

T = datetime.timedelta(seconds=10)
wires = FakeWire.pair()
groups = [Group((0, 1), w, Lane(f"fake{w.rank}", w.abort)) for w in wires]
sender = Sender(groups[0], 0, 1)
receiver = Receiver(groups[1], 0, rank=1, channel_id=1, diagnose=lambda *_: "fine")
kept = []
for step in range(6):
    tree = {"audio": torch.full((8, 40_000), float(step)), "ids": np.full(64, step, np.int64)}
    got = []
    t = threading.Thread(target=lambda: got.append(receiver.recv(None, T)))
    t.start()
    own = sender.send_batch(tree, None, T)
    t.join(20)
    for batch in (own, got[0]):
        batch["audio"].share_memory_()  # what a torch.multiprocessing queue does
        kept.append((step, batch["ids"]))
    del own, got, batch
    churn = [torch.full((1 << 20,), 255, dtype=torch.uint8) for _ in range(8)]
bad = [(s, int(ids[0])) for s, ids in kept if not (ids == s).all()]
print("changed:", bad)
sys.exit(1 if bad else 0)
"""


def test_numpy_leaves_outlive_a_tensor_leaf_moved_into_shared_memory(tmp_path: Path) -> None:
    """NOTE [ Numpy leaves beside tensors ]: a tensor leaf moved by ``share_memory_()`` frees
    the block the batch was rebuilt on; the batch's numpy leaves, kept, stay as they were,
    on the source's own tree and on the receiver's. (In a process of its own: they were
    left on the freed block, and reading them could segfault.)"""
    code, out = run_killable([sys.executable, "-c", _MOVED], tmp_path, dict(os.environ), 120)
    assert code == 0, out
