"""``BroadcastingDataLoader`` without a process group: a no-op over its source, and the
checks of its arguments. The loader across ranks is tested in ``tests/gloo``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from trees import assert_same

import tensorcast as tc

N = 6  # batches per pass


def batch(i: int) -> dict[str, Any]:
    return {"x": torch.arange(4, dtype=torch.float32) + i, "ids": [i, -(2**70)], "name": f"b{i}"}


class Stateful:
    """A resumable source: its state is the index of the next batch to yield."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.pos < self.n:
            self.pos += 1
            yield batch(self.pos - 1)

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = state["pos"]


class Numbers(Dataset[int]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        return i


def test_no_op_without_torch_distributed() -> None:
    assert not dist.is_initialized()
    items = [batch(i) for i in range(3)]

    class Mesh:  # would span 4 ranks if a process group existed
        mesh = torch.arange(4).reshape(2, 2)
        mesh_dim_names = ("cp", "tp")

    for prefetch in (0, 1):
        loader = tc.BroadcastingDataLoader(items, Mesh(), prefetch=prefetch)
        assert all(a is b for a, b in zip(loader, items, strict=True))
        assert len(loader) == 3
        assert loader.is_source
        assert list(tc.BroadcastingDataLoader(None, Mesh(), prefetch=prefetch)) == []
    loader = tc.BroadcastingDataLoader(Stateful(N))
    loader.load_state_dict({"pos": 4})
    assert loader.state_dict() == {"pos": 4}
    assert_same(list(loader), [batch(4), batch(5)], "no-op resume")


class Unknown:
    """A source whose ``__len__`` says it has none, as Lightning reads it."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(2))

    def __len__(self) -> int:
        raise NotImplementedError


def test_a_no_op_len_is_a_type_error_where_the_source_has_no_length() -> None:
    for source in (Unknown(), iter([1])):
        with pytest.raises(TypeError, match="has no len"):
            len(tc.BroadcastingDataLoader(source))


class Sampler:
    """A source that is a sampler itself, as a lhotse sampler is: it has ``set_epoch``."""

    def __init__(self) -> None:
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        return iter([self.epoch])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def test_a_source_that_is_a_sampler_is_the_loaders_sampler() -> None:
    """A framework's ``loader.sampler.set_epoch`` (Lightning's, every epoch) reaches it."""
    source = Sampler()
    loader = tc.BroadcastingDataLoader(source)
    assert loader.sampler is source and loader.batch_sampler is None
    loader.sampler.set_epoch(3)
    assert list(loader) == [3]
    assert tc.BroadcastingDataLoader([1, 2]).sampler is None  # no set_epoch: no sampler


def test_bad_arguments() -> None:
    for prefetch in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefetch"):
            tc.BroadcastingDataLoader([], prefetch=prefetch)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="src"):
        tc.BroadcastingDataLoader([], src=0)
    for align in (0, 3, 48, 1 << 17, 64.0, "64"):
        with pytest.raises(ValueError) as packed:
            tc.pack({"x": torch.ones(2)}, align=align)  # type: ignore[arg-type]
        with pytest.raises(ValueError) as loaded:
            tc.BroadcastingDataLoader([], align=align)  # type: ignore[arg-type]
        assert str(loaded.value) == str(packed.value), "the same check as tc.pack's"


def test_a_no_op_loader_gives_independent_passes_and_refuses_a_mid_pass_load() -> None:
    """The rules of a pass hold without a process group too: ``zip(loader, loader)`` yields
    pairs, and ``load_state_dict()`` while a pass is open raises, saying to call it before
    ``iter()``."""
    pairs = list(zip(*[tc.BroadcastingDataLoader([batch(i) for i in range(N)])] * 2))
    assert [(a["name"], b["name"]) for a, b in pairs] == [(f"b{i}", f"b{i}") for i in range(N)]
    loader = tc.BroadcastingDataLoader(Stateful(N))
    it = iter(loader)
    next(it)
    with pytest.raises(RuntimeError, match=r"Call load_state_dict\(\) before iter\(\)"):
        loader.load_state_dict({"pos": 0})
    del it  # dropped: no pass is open any more
    loader.load_state_dict({"pos": 4})
    assert_same(list(loader), [batch(4), batch(5)], "resumed after a dropped pass")


class Held:
    """A source whose first batch waits until the test lets it go: a second caller
    arrives while the first is inside ``next()``."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.go = threading.Event()

    def __iter__(self) -> Iterator[int]:
        self.inside.set()
        self.go.wait(30)
        yield from range(N)


def test_a_no_op_pass_serves_one_caller_at_a_time() -> None:
    """``next()`` while another thread is inside it raises a RuntimeError, as on a group;
    the pass goes on, skipping nothing; ``close()`` ends it."""
    source = Held()
    it = iter(tc.BroadcastingDataLoader(source))
    got: list[int] = []
    first = threading.Thread(target=lambda: got.append(next(it)))
    first.start()
    assert source.inside.wait(30)
    with pytest.raises(RuntimeError, match=r"already running on it") as refused:
        next(it)
    assert "pass 1" in str(refused.value)
    source.go.set()
    first.join(30)
    assert got == [0] and next(it) == 1
    it.close()  # type: ignore[attr-defined]
    assert list(it) == []


class Failing(Stateful):
    """A resumable source that raises at its third batch."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for item in super().__iter__():
            if self.pos == 3:
                raise ValueError("bad shard")
            yield item


def test_a_no_op_pass_ends_where_its_source_fails() -> None:
    """As on a group: the failure is raised once, then the pass is over (it draws no
    more, and a ``load_state_dict()`` is no longer refused as mid-pass)."""
    loader = tc.BroadcastingDataLoader(Failing(N))
    it = iter(loader)
    assert [next(it)["name"], next(it)["name"]] == ["b0", "b1"]
    with pytest.raises(ValueError, match="bad shard"):
        next(it)
    assert list(it) == []
    loader.load_state_dict({"pos": 4})
    assert_same(list(loader), [batch(4), batch(5)], "resumed after the failure")


def test_stateless_source_warns_once_without_a_process_group() -> None:
    """The no-op loader (no torch.distributed group here) delegates the same way."""
    loader = tc.BroadcastingDataLoader(DataLoader(Numbers(), batch_size=4))
    with pytest.warns(UserWarning, match="restarts the pass") as record:
        assert loader.state_dict() == {}
        assert loader.state_dict() == {}
    assert len(record) == 1
    assert len(loader) == 4
