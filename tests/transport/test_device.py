"""Device frames over a fake wire with NCCL's stream contract (``FakeWire.pair(streams=True)``).

The real ``Sender`` and ``Receiver`` run their jobs on real lanes (worker threads), and a
consumer thread per rank takes each batch, as ``next()`` would. The law: every device
call (the transfer stream, allocation, the payload's collective, events, stream waits)
is made by the consumer's thread, none by a lane's worker, and payloads are posted in
lane order (NOTE [ Device work at next() ]).
"""

from __future__ import annotations

import datetime
import gc
import threading
import time
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from device_frames import TIMEOUT, batches, device_pair, run_both, same

from tensorcast._errors import HeaderError, PeerError
from tensorcast.transport.device import DevicePart, Inflight
from tensorcast.transport.testing import FakeStreams

DEVICE_CALLS = ("transfer", "empty", "payload", "record", "wait", "hand_over")


@pytest.mark.parametrize("ahead", [1, 3])
def test_device_work_runs_on_the_consumer_thread_in_lane_order(ahead: int) -> None:
    sender, receiver, sgroup, rgroup = device_pair()
    trees = batches()
    own, got = run_both(sender, receiver, trees, ahead=ahead)
    for tree, mine, theirs in zip(trees, own, got):
        assert same(tree, mine) and same(tree, theirs)
    for group, consumer in ((sgroup, "source-main"), (rgroup, "receiver-main")):
        streams = group.wire.streams
        for operation in DEVICE_CALLS:
            assert streams.threads(operation) <= {consumer}, (operation, streams.threads(operation))
        assert streams.threads("payload") == {consumer}
        assert streams.threads("done") <= {consumer}  # the worker asked the device nothing
        assert group.wire.strays == 0  # every payload was posted inside the transfer stream
        # one upload or receive per batch: a payload each, in the lane's order
        assert [op for op, _ in streams.calls].count("payload") == len(trees)


def test_the_consumer_waits_on_each_batch_before_its_tree_exists() -> None:
    sender, receiver, sgroup, rgroup = device_pair()
    run_both(sender, receiver, batches()[:2], ahead=1)
    for group in (sgroup, rgroup):
        ops = [op for op, _ in group.wire.streams.calls if op in ("record", "wait", "hand_over")]
        # each batch: its event recorded after the work, then waited on and handed over
        assert ops == ["record", "wait", "hand_over"] * 2 or ops.count("wait") >= 2


def test_device_work_not_done_by_its_deadline_breaks_the_lane() -> None:
    sender, receiver, sgroup, _ = device_pair(timeout=datetime.timedelta(seconds=0.3))
    sgroup.wire.streams.hold = True  # a payload that never completes: a dead peer
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(receiver.recv(None, TIMEOUT).take()))
    t.start()
    sender.send_batch({"x": torch.arange(10_000.0)}, None).take()  # the role's 0.3 s
    t.join(10)
    deadline = time.monotonic() + 5
    while sgroup.lane.broken is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert isinstance(sgroup.lane.broken, TimeoutError), sgroup.lane.broken
    assert "deadline" in str(sgroup.lane.broken)
    with pytest.raises(PeerError, match="failed earlier"):
        sgroup.lane.check()
    assert sgroup.wire.aborted  # peers blocked on the group fail now


def test_a_bad_crc_of_a_device_payload_is_raised_at_take_and_again() -> None:
    sender, receiver, _, rgroup = device_pair(verify=True)
    rgroup.wire.corrupt_next_payload = True
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(receiver.recv(None, TIMEOUT)))
    t.start()
    sender.send_batch({"x": torch.arange(10_000.0)}, None, TIMEOUT).take()
    t.join(10)
    part = got[0]
    with pytest.raises(HeaderError, match="CRC32"):
        part.take()
    with pytest.raises(HeaderError, match="CRC32"):
        part.take()
    assert rgroup.lane.broken is None  # the frame is in whole: this step's error alone


def _part(streams: FakeStreams, inflight: Inflight, **work: Any) -> DevicePart:
    return DevicePart(
        streams, 64, lambda buffer: ({"x": buffer[:8]}, []), inflight=inflight, timeout_s=10.0,
        on_error=lambda error: None, **work,
    )  # fmt: skip


def test_device_tensors_a_part_reads_are_recorded_on_the_transfer_stream_never_held() -> None:
    """The source's CUDA batch: recorded on the transfer stream by the posting thread
    (before anything that could fail), then let go, so that the caller may drop it at
    once, and the failure paths that stop watching a part (``Inflight.clear``) drop
    nothing the device may still read. The device buffer is the allocator's: once taken
    and dropped, nothing holds it, though the device has not finished."""
    streams, inflight = FakeStreams(), Inflight()
    streams.hold = True  # the device never finishes: only references can be let go
    source = torch.arange(64, dtype=torch.uint8)
    staging = torch.zeros(64, dtype=torch.uint8)  # host memory the work reads
    part = _part(streams, inflight, reads=(source,), holds=staging,
                 fill=lambda buffer, src=source: buffer.copy_(src))  # fmt: skip
    part.post()
    (handed, on_transfer), *_ = streams.handed
    assert handed() is source and on_transfer, "recorded on the transfer stream"
    assert [op for op, _ in streams.calls][:3] == ["transfer", "hand_over", "empty"]
    assert streams.threads("hand_over") == {threading.current_thread().name}
    tree = part.take()
    source_ref, staging_ref = weakref.ref(source), weakref.ref(staging)
    del source, staging, part, tree
    gc.collect()
    assert source_ref() is None, "the caller's batch is held after its post"
    assert all(buffer() is None for buffer in streams.buffers), "the device buffer is held"
    assert staging_ref() is not None and len(inflight) == 1  # host staging: until seen done
    inflight.clear()  # a broken lane: deadlines no longer watched
    assert len(inflight) == 0 and staging_ref() is not None, "staging dropped under a copy"
    streams.release()
    inflight.reap()
    assert staging_ref() is None


def test_a_transfer_seen_done_at_its_take_lets_the_lane_worker_go() -> None:
    """A one-off transfer, done by the time it is taken: nothing stays in flight, and the
    lanes' workers leave at their idle exit, not at the 10 s deadline."""
    sender, receiver, sgroup, rgroup = device_pair()
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(receiver.recv(None, TIMEOUT).take()))
    t.start()
    own = sender.send_batch({"x": torch.arange(10_000.0)}, None, TIMEOUT).take()
    t.join(10)
    assert torch.equal(own["x"], got[0]["x"])
    assert len(sgroup.lane.inflight) == len(rgroup.lane.inflight) == 0
    names = {f"tensorcast-lane-{g.lane.name}" for g in (sgroup, rgroup)}
    deadline = time.monotonic() + 3  # idle_exit_s is 0.2
    while names & {t.name for t in threading.enumerate()} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not names & {t.name for t in threading.enumerate()}, "a worker waits for a deadline"


def test_a_trimmed_leaf_is_re_padded_on_the_transfer_stream_after_its_payload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The law: on both ranks a trimmed leaf's re-pad is device work of its frame, queued
    on the transfer stream after the payload and before the frame's event, by the
    consumer's thread; the rebuilt leaf is handed over to the consumer's stream with the
    buffer; both trees equal the source's batch, bit for bit."""
    from tensorcast.codec import Repad

    sender, receiver, sgroup, rgroup = device_pair()
    groups = (sgroup, rgroup)
    real = Repad.__call__

    def rebuild(self: Repad) -> None:
        for group in groups:
            if group.wire.streams.in_transfer:
                group.wire.streams.log("repad")
        real(self)

    monkeypatch.setattr(Repad, "__call__", rebuild)
    audio = torch.zeros(4, 200_000)
    for row, n in enumerate((200_000, 120_000, 60_000, 9_000)):
        audio[row, :n] = torch.randn(n, generator=torch.Generator().manual_seed(row))
    trees = [{"audio": audio, "lens": torch.tensor([200_000, 120_000, 60_000, 9_000])}] * 2
    own, got = run_both(sender, receiver, trees, ahead=1)
    for tree, mine, theirs in zip(trees, own, got):
        assert same(tree, mine) and same(tree, theirs)
    assert sender.group.wire.streams is not None
    for group, consumer in ((sgroup, "source-main"), (rgroup, "receiver-main")):
        streams = group.wire.streams
        ops = [op for op, _ in streams.calls if op in ("payload", "repad", "record", "hand_over")]
        # per frame: its payload, the re-pad, its event; the buffer and the leaf handed over
        frame = ["payload", "repad", "record"]
        assert ops == frame + frame + ["hand_over"] * 4 or ops == (
            frame + ["hand_over"] * 2 + frame + ["hand_over"] * 2
        ), ops
        assert streams.threads("repad") == {consumer}


def test_a_tree_asked_for_off_the_wire_s_device_hands_over_only_device_memory() -> None:
    """NCCL with ``device="cpu"``: the tree is built from a copy of the buffer elsewhere,
    so its trimmed leaves are rebuilt there, and ``record_stream`` (which takes the
    device's memory only) is made on the buffer alone. Faked the other way round: streams
    of the host, a tree asked for on ``meta``; a trimmed ndarray is rebuilt on the host."""
    sender, receiver, sgroup, rgroup = device_pair()
    meta = torch.device("meta")
    audio = torch.zeros(4, 40_000)
    feats = np.zeros((4, 6_000, 8), dtype=np.float32)
    for row, n in enumerate((40_000, 9_000, 700, 90)):
        audio[row, :n] = 1.5
        feats[row, : n // 10] = 0.5
    tree = {"audio": audio, "feats": feats}
    from tensorcast import pack, read_header

    assert [leaf.trimmed for leaf in read_header(pack(tree).header).leaves] == [True, True]
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(receiver.recv(meta, TIMEOUT).take()))
    t.start()
    own = sender.send_batch(tree, meta, TIMEOUT).take()
    t.join(10)
    for out in (own, got[0]):
        assert out["audio"].device == meta and out["audio"].shape == audio.shape
        assert out["feats"].tobytes() == feats.tobytes()
    for group in (sgroup, rgroup):
        handed = [ref() for ref, _ in group.wire.streams.handed]
        assert handed and all(h is None or h.device.type == "cpu" for h in handed)


def test_the_trim_decision_reads_nothing_of_a_leaf_on_the_device() -> None:
    """A source's leaf on a GPU is sent whole: deciding its trim would read it back, 2 to
    8 host syncs a leaf and a batch (``meta`` memory raises where a GPU would sync). A
    padded ndarray beside it is on the host, and trimmed as ever."""
    from tensorcast.codec import encode

    audio = torch.empty(8, 16_000, device="meta")  # padded or not: never looked at
    feats = np.zeros((8, 4_000, 8), dtype=np.float32)
    feats[:, :100] = 1.0
    leaves = [("tensor", "f4", audio.shape, audio), ("ndarray", "f4", feats.shape, feats)]
    for receiver in (None, "device", "host"):
        trims = encode._find_trims(leaves, [0, 1], receiver)
        assert trims is not None and list(trims) == [1], receiver
