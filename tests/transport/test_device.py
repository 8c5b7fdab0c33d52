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

from tensorcast._errors import HeaderError, PeerError
from tensorcast.transport import staging
from tensorcast.transport.device import DevicePart, Inflight
from tensorcast.transport.groups import Group
from tensorcast.transport.lane import Job, Lane
from tensorcast.transport.receiver import Receiver
from tensorcast.transport.sender import Sender
from tensorcast.transport.testing import FakeStreams, FakeWire

TIMEOUT = datetime.timedelta(seconds=10)
DEVICE_CALLS = ("transfer", "empty", "payload", "record", "wait", "hand_over")


def device_pair(
    *, verify: bool = False, timeout: datetime.timedelta = TIMEOUT
) -> tuple[Sender, Receiver, Group, Group]:
    wires = FakeWire.pair(streams=True)
    groups = [Group((0, 1), w, Lane(f"dev{w.rank}", w.abort, idle_exit_s=0.2)) for w in wires]
    sender = Sender(groups[0], 0, verify=verify, timeout=timeout)
    receiver = Receiver(groups[1], 0, rank=1, timeout=TIMEOUT)
    return sender, receiver, groups[0], groups[1]


def batches() -> list[Any]:
    return [
        {"x": torch.arange(1000.0), "step": 0},
        {
            "audio": torch.randn(3, 5000),
            "names": ["a", "b"],
            "mask": torch.ones(7, dtype=torch.bool),
        },
        {"feats": np.arange(12, dtype=np.float32).reshape(3, 4), "ids": torch.arange(9)},
        {"x": torch.arange(1000.0), "step": 3},
        {"big": torch.arange(200_000, dtype=torch.int32), "s": "x" * 3000},
    ]


def run_both(
    sender: Sender,
    receiver: Receiver,
    trees: list[Any],
    *,
    ahead: int,
    source_device: torch.device | None = None,
) -> tuple[list[Any], list[Any]]:
    """Both ranks, each a consumer thread submitting ``ahead`` steps to its lane before it
    takes the first, then one more per step (a loader's ``prefetch``)."""
    out: dict[str, Any] = {}

    def consumer(name: str, lane: Lane, step_fn: Any) -> None:
        def submit(i: int) -> Job[Any]:
            job: Job[Any] = Job(lambda: step_fn(i))
            lane.enqueue(job)  # on the lane's worker, as a loader's prefetched steps
            return job

        try:
            jobs = [submit(i) for i in range(min(ahead, len(trees)))]
            taken = []
            for i in range(len(trees)):
                if len(jobs) <= i:
                    jobs.append(submit(i))
                part = jobs[i].result()
                assert isinstance(part, DevicePart), type(part)
                taken.append(part.take())
                if i + ahead < len(trees):
                    jobs.append(submit(i + ahead))
            out[name] = taken
        except BaseException as e:  # reported by the test
            out[name] = e

    def send(i: int) -> Any:
        return sender.send_batch(trees[i], source_device, TIMEOUT)

    def recv(i: int) -> Any:
        return receiver.recv(None, TIMEOUT)

    threads = [
        threading.Thread(
            target=consumer, args=("source", sender.group.lane, send), name="source-main"
        ),
        threading.Thread(
            target=consumer, args=("receiver", receiver.group.lane, recv), name="receiver-main"
        ),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for name in ("source", "receiver"):
        if isinstance(out.get(name), BaseException):
            raise out[name]
    return out["source"], out["receiver"]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


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


def test_pinned_staging_is_reused_only_once_its_upload_is_seen_done() -> None:
    sender, receiver, sgroup, _ = device_pair()
    streams = sgroup.wire.streams
    tree = {"x": torch.arange(50_000, dtype=torch.int32)}
    streams.hold = True  # the device does not finish the uploads

    def allocations() -> int:
        return sum(op == "host" for op, _ in streams.calls)

    run_both(sender, receiver, [tree, tree, tree], ahead=1)
    held = allocations()
    assert held == 3  # each frame's staging still read by the device: a buffer each
    streams.release()
    got: list[Any] = []

    def recv() -> None:
        for _ in range(3, 9):
            got.append(receiver.recv(None, TIMEOUT).take())

    t = threading.Thread(target=recv)
    t.start()
    for _ in range(3, 9):
        sender.send_batch(tree, None, TIMEOUT).take()
    t.join(20)
    assert len(got) == 6
    # The device's being done is seen at the next post, on the caller's thread: the
    # first frame after the release packs into one more buffer, and from then on the
    # buffers come back.
    assert allocations() == held + 1


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


def test_leaves_that_are_not_tensors_travel_on_the_host_beside_a_device_payload() -> None:
    """A device frame carries its numpy, bytes and str leaves in one more head message
    (their host block), so that no receiver copies them back from the GPU."""
    from tensorcast import pack
    from tensorcast.codec import decode

    sender, receiver, sgroup, _ = device_pair()
    tree = {
        "x": torch.arange(100.0),
        "feats": np.arange(30, dtype=np.float64).reshape(5, 6),
        "text": "é" * 2000,
        "raw": bytes(range(256)) * 8,
    }
    host_nbytes = decode(pack(tree).header).host_nbytes
    assert host_nbytes
    log = sgroup.wire.log
    own, got = run_both(sender, receiver, [tree, tree], ahead=1)
    assert same(tree, own[1]) and same(tree, got[1])
    heads = [n for kind, n in log if kind == "head"]
    assert heads.count(host_nbytes) == 2  # one host block per frame
    assert not got[1]["feats"].flags.owndata  # a view of the block it came in, no copy


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


def test_while_the_device_works_only_host_staging_is_held() -> None:
    """Through the real sender: a batch taken and dropped while its upload has not
    finished leaves its pinned staging held (it is reused only once seen done) and no
    device buffer."""
    sender, receiver, sgroup, _ = device_pair()
    streams = sgroup.wire.streams
    streams.hold = True
    t = threading.Thread(target=lambda: receiver.recv(None, TIMEOUT))
    t.start()
    own = sender.send_batch({"x": torch.arange(50_000, dtype=torch.int32)}, None, TIMEOUT).take()
    t.join(10)
    del own
    gc.collect()
    assert len(sgroup.lane.inflight) == 1
    assert all(buffer() is None for buffer in streams.buffers), "the device buffer is held"
    streams.release()


class _MetaStreams(FakeStreams):
    """A device whose memory the host cannot read (``meta``): a leaf copied back from it
    raises instead of syncing."""

    device = torch.device("meta")

    def empty(self, nbytes: int) -> torch.Tensor:
        self.log("empty")
        return torch.empty(nbytes, dtype=torch.uint8, device="meta")


def _meta_pair(monkeypatch: pytest.MonkeyPatch) -> tuple[_MetaStreams, Sender, Receiver]:
    """A sender and a receiver on a host wire whose output device is ``meta``, faked by
    the streams ``streams_for`` gives for it."""
    streams = _MetaStreams()
    monkeypatch.setattr(staging, "streams_for", lambda device: streams)
    wires = FakeWire.pair()
    groups = [Group((0, 1), w, Lane(f"meta{w.rank}", w.abort, idle_exit_s=0.2)) for w in wires]
    return (
        streams,
        Sender(groups[0], 0, timeout=TIMEOUT),
        Receiver(groups[1], 0, rank=1, timeout=TIMEOUT),
    )


def test_a_host_wire_to_a_device_reads_the_other_leaves_from_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gloo group with ``device="cuda"``: the payload is on the host, so the numpy, str
    and bytes leaves are read from there on both sides, never copied back from the
    device one leaf at a time (each copy a host sync). The device is faked by the streams
    ``streams_for`` gives for it."""
    streams, sender, receiver = _meta_pair(monkeypatch)
    meta = streams.device
    tree = {
        "x": torch.arange(100.0),
        "feats": np.arange(30, dtype=np.float64).reshape(5, 6),
        "text": "é" * 2000,
        "raw": bytes(range(256)) * 8,
    }
    for _ in range(2):  # an inline payload, then one in a buffer of its own
        own = sender.send_batch(tree, meta, TIMEOUT).take()
        got = receiver.recv(meta, TIMEOUT).take()
        for out in (own, got):
            assert out["x"].device == meta
            assert same({k: tree[k] for k in ("feats", "text", "raw")},
                        {k: out[k] for k in ("feats", "text", "raw")})  # fmt: skip
        tree["x"] = torch.arange(100_000.0)
    assert streams.threads("transfer") == {threading.current_thread().name}


def test_a_trimmed_ndarray_is_rebuilt_from_the_host_block_not_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trimmed ndarray leaf is a host result: its stored bytes travel in the host block
    beside a device payload and it is rebuilt from there on both sides, never copied back
    from the device (``meta`` memory raises where a GPU would sync); a trimmed tensor leaf
    is rebuilt on the device."""
    _, sender, receiver = _meta_pair(monkeypatch)
    meta = torch.device("meta")
    feats = np.full((4, 12_000, 8), -23.025850929940457, dtype=np.float32)
    audio = torch.zeros(4, 40_000)
    for row, n in enumerate((3_000, 1_800, 700, 90)):
        feats[row, :n] = np.arange(n * 8, dtype=np.float32).reshape(n, 8) / 7
        audio[row, : n * 10] = 1.5
    tree = {"feats": feats, "audio": audio, "text": "utt"}
    from tensorcast import pack, read_header

    assert [leaf.trimmed for leaf in read_header(pack(tree).header).leaves] == [True, True]
    own = sender.send_batch(tree, meta, TIMEOUT).take()
    got = receiver.recv(meta, TIMEOUT).take()
    for out in (own, got):
        assert isinstance(out["feats"], np.ndarray) and out["feats"].tobytes() == feats.tobytes()
        assert out["audio"].device == meta and out["audio"].shape == audio.shape
        assert out["text"] == "utt"


def test_a_trimmed_leaf_is_re_padded_on_the_transfer_stream_after_its_payload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The law: on both ranks a trimmed leaf's re-pad is device work of its frame, queued
    on the transfer stream after the payload and before the frame's event, by the
    consumer's thread; the rebuilt leaf is handed over to the consumer's stream with the
    buffer; both trees equal the source's batch, bit for bit."""
    from tensorcast.codec import repad as _repad

    sender, receiver, sgroup, rgroup = device_pair()
    groups = (sgroup, rgroup)
    real = _repad.repad

    def rebuild(*args: Any, **kwargs: Any) -> Any:
        for group in groups:
            if group.wire.streams.in_transfer:
                group.wire.streams.log("repad")
        return real(*args, **kwargs)

    monkeypatch.setattr(_repad, "repad", rebuild)
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
