"""Host staging of device frames (``transport.staging``): pinned buffers reused only once
their upload is seen done, the leaves that are not tensors travelling as a host block
beside a device payload, and a host wire's tree on a device read from the host."""

from __future__ import annotations

import gc
import threading
from typing import Any

import numpy as np
import pytest
import torch
from device_frames import TIMEOUT, device_pair, run_both, same

from tensorcast.transport import staging
from tensorcast.transport.groups import Group
from tensorcast.transport.lane import Lane
from tensorcast.transport.receiver import Receiver
from tensorcast.transport.sender import Sender
from tensorcast.transport.testing import FakeStreams, FakeWire


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
