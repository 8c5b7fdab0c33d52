"""BroadcastingDataLoader: one real loader per DP slot, its batches broadcast to its peers.

How a pass runs on each rank::

    source:    next(source) -> encode -> send frame ------\\
    receivers:                          recv frame <-------/ -> rebuild tree
    every rank: yield the rebuilt tree; END frame -> StopIteration together

With ``prefetch=k > 0`` a background thread runs the producer up to ``k`` batches ahead of
the consumer, so the broadcast of batch i+1 overlaps the caller's work on batch i. The
lookahead is bounded by credits that only the consumer hands out, so every rank posts
exactly the same messages: a loop broken on every rank after the same batch leaves
no message pending. ``state_dict()`` then describes the position after the last batch
*yielded*, from a snapshot taken right after that batch was pulled from the source.

This module knows nothing of byte layouts (``_codec``) or frame formats (``_transport``).
"""

from __future__ import annotations

import copy
import datetime
import queue
import threading
import weakref
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorcast import _mesh, _transport
from tensorcast._broadcast import unpack_if_packed
from tensorcast._codec import resolve_device
from tensorcast._errors import PeerError, SourceError
from tensorcast._transport import Channel

__all__ = ["BroadcastingDataLoader"]


class _End:
    """The source is exhausted."""


_END = _End()


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class _Item:
    __slots__ = ("state", "tree")

    def __init__(self, tree: Any, state: Any):
        self.tree = tree
        self.state = state

    def hand_out(self) -> Any:
        """The tree, which this item then lets go of: the loader must not keep a batch
        alive after the caller drops it, or its pooled buffer could not be reused (and
        it would be freed inside the next ``next()``)."""
        tree, self.tree = self.tree, None
        return tree


class _Prefetcher:
    """Runs ``produce`` in a thread, exactly ``depth`` items ahead of ``take``.

    "Exactly" is what keeps ranks in lockstep: every rank whose consumer took k items
    produces item k + depth, stop or no stop, because its peers do too. ``close`` only
    wakes a thread that is already ``depth`` ahead, so it can leave.

    Something else about to use the group (``tc.broadcast``, another loader) closes the
    thread first (see ``_transport.drain``); the consumer then takes the items made
    before, and a ``take`` that finds none left starts the thread again. Every rank does
    both at the same point, so their collectives stay in the same order.
    """

    def __init__(self, produce: Any, depth: int, join_timeout: float, group: Any):
        self._group = group
        self._produce = produce
        self._depth = depth
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._taken = 0
        self._produced = 0
        self._ended = False  # the last item made was the end of the pass or a failure
        self._join_timeout = join_timeout
        self._start()

    def _start(self) -> None:
        self._closed = False
        self._stop = False
        self._credits = threading.Semaphore(self._depth)
        self._thread = threading.Thread(target=self._run, name="tensorcast-prefetch", daemon=True)
        _transport.register_producer(self._group, self)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._credits.acquire()
            if self._stop and self._produced >= self._taken + self._depth:
                return
            try:
                item = self._produce()
            except BaseException as e:  # handed to the consumer, never swallowed
                item = _Failure(e)
            self._produced += 1
            if not isinstance(item, _Item):
                self._ended = True
            self._items.put(item)
            if self._ended:
                return

    def take(self) -> Any:
        if (
            self._closed
            and not self._ended
            and self._taken == self._produced
            and not self._thread.is_alive()  # a thread stuck in a collective is not restarted
        ):
            # Closed for another user of the group; the pass goes on, after whatever
            # other producer is running on the group now has finished what it owes.
            _transport.drain(self._group)
            self._start()
        item = self._items.get()
        self._taken += 1
        self._credits.release()
        return item

    def close(self) -> None:
        """Finish the batches owed to the peers, then stop. Safe to call again."""
        if self._closed:
            return
        self._closed = True
        self._stop = True
        self._credits.release()
        self._thread.join(self._join_timeout)
        _transport.unregister_producer(self._group, self)
        if self._thread.is_alive():
            raise PeerError(
                "the prefetch thread is still inside a collective after the loop ended: the "
                "ranks did not stop after the same batch. Break out of the loop on every rank "
                "of the group after the same batch."
            )


class BroadcastingDataLoader:
    """Iterate a loader on one source rank per DP slot; every peer gets the same batches.

    Args:
        source: the real loader (any iterable) on the source rank; ``None`` on the others
            (a loader passed on a receiver is never iterated).
        device_mesh: a ``DeviceMesh`` whose ``axes`` span the ranks that share batches.
        axes: the mesh dimensions to broadcast across.
        prefetch: how many batches are broadcast ahead of the consumer; 0 = none.
        device: where output tensors land (default: the group's transfer device).
        group: instead of a mesh, the process group to broadcast on...
        src: ...and the *global* rank of its source.
        timeout: seconds (or a timedelta) any rank waits for one message before raising
            ``PeerError``; None means the process group's timeout.
        verify: carry a CRC32 of every buffer and check it on receivers.

    Raises:
        ValueError: on a source rank whose ``source`` is None; on bad arguments.
    """

    def __init__(
        self,
        source: Iterable[Any] | None = None,
        device_mesh: Any = None,
        axes: Sequence[str] | str = ("cp", "tp"),
        prefetch: int = 1,
        device: torch.device | str | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        src: int | None = None,
        timeout: float | datetime.timedelta | None = None,
        verify: bool = False,
    ) -> None:
        if type(prefetch) is not int or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        if device_mesh is not None and group is not None:
            raise ValueError("pass either device_mesh= or group= (with src=), not both")
        if (group is None) != (src is None):
            raise ValueError(
                "group= and src= go together: src is the group's source, a global rank"
            )
        self.source = source
        self.prefetch = prefetch
        self.device = resolve_device(device)
        self.axes = _mesh.normalize_axes(axes)
        self._channel: Channel | None = None
        self._pass = 0
        self._active: weakref.ReferenceType[Generator[Any, None, None]] | None = None
        self._state: Any = None
        self._noop = True
        self._is_source = True
        if not (dist.is_available() and dist.is_initialized()):
            return
        if group is not None:
            assert src is not None
            if dist.get_world_size(group) == 1:
                return
            self._channel = Channel(group, src, timeout=timeout, verify=verify)
        elif _mesh.spanning_axes(device_mesh, self.axes):
            sub = _mesh.resolve_submesh(device_mesh, self.axes)
            self._channel = Channel(
                sub.group, sub.src, axes=sub.axes, timeout=timeout, verify=verify
            )
        else:
            return
        self._noop = False
        self._is_source = self._channel.is_source
        if self._is_source and source is None:
            raise ValueError(
                f"rank {dist.get_rank()} is the source of its group (global ranks "
                f"{list(self._channel.ranks)}) but source is None; build the real loader on "
                f"this rank, e.g. source=loader if tensorcast.is_dp_source_rank(mesh) else None"
            )
        self._join_timeout = (
            self._channel.timeout.total_seconds() if self._channel.timeout is not None else 1800.0
        )

    # -- iteration -----------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self._noop:
            return map(unpack_if_packed, self.source if self.source is not None else ())
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._pass += 1
        self._state = None
        run = self._run_pass(self._pass)
        # Held weakly: a `for ... break` drops the last reference and closes the pass.
        self._active = weakref.ref(run)
        return run

    def _run_pass(self, pass_index: int) -> Generator[Any, None, None]:
        channel = self._channel
        assert channel is not None
        # Every rank reaches this point together: finish what earlier passes (of any
        # loader on this group) still owe before this pass's first collective.
        _transport.drain(channel.group)
        channel.start_pass(pass_index)
        if self._is_source:
            assert self.source is not None
            snapshot = self.prefetch > 0 and hasattr(self.source, "state_dict")
            try:
                it = iter(self.source)
                if snapshot:
                    self._state = copy.deepcopy(self.source.state_dict())  # type: ignore[attr-defined]
            except BaseException as e:  # e.g. DataLoader workers that fail to start
                channel.send(
                    channel.error_frame(f"source iterator failed: {type(e).__name__}: {e}")
                )
                raise

            def produce() -> Any:
                return self._produce_source(it, snapshot)
        else:

            def produce() -> Any:
                return self._produce_receiver()

        prefetcher = (
            _Prefetcher(produce, self.prefetch, self._join_timeout, channel.group)
            if self.prefetch
            else None
        )
        try:
            while True:
                item = prefetcher.take() if prefetcher is not None else produce()
                if isinstance(item, _End):
                    return
                if isinstance(item, _Failure):
                    raise item.error
                if item.state is not None:
                    self._state = item.state
                yield item.hand_out()
        finally:
            if prefetcher is not None:
                prefetcher.close()  # after END or a failure its thread has already left

    def _produce_source(self, it: Iterator[Any], snapshot: bool) -> Any:
        channel = self._channel
        assert channel is not None and self.source is not None
        try:
            batch = next(it)
        except StopIteration:
            channel.send(channel.end_frame())
            return _END
        except BaseException as e:
            channel.send(channel.error_frame(f"source iterator failed: {type(e).__name__}: {e}"))
            return _Failure(e)
        # A deep copy: the prefetch thread keeps advancing the source after this batch.
        state = copy.deepcopy(self.source.state_dict()) if snapshot else None  # type: ignore[attr-defined]
        # An unencodable batch is announced to the receivers, then raised here.
        return _Item(channel.send_batch(batch, device=self.device), state)

    def _produce_receiver(self) -> Any:
        channel = self._channel
        assert channel is not None
        kind, value = channel.recv(device=self.device)
        if kind == "end":
            return _END
        if kind == "error":
            return _Failure(SourceError(f"source rank {channel.src} reported: {value}"))
        return _Item(value, None)

    # -- length and checkpoints ----------------------------------------------------

    def __len__(self) -> int:
        if self._noop:
            return 0 if self.source is None else len(self.source)  # type: ignore[arg-type]
        if not self._is_source:
            raise TypeError(
                "len() of a BroadcastingDataLoader is known only on the source rank of each "
                "group; receivers learn the end of an epoch when the source stops"
            )
        if not hasattr(self.source, "__len__"):
            raise TypeError(f"the source loader ({type(self.source).__name__}) has no len()")
        return len(self.source)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        """The source's state after the last batch yielded; ``{}`` on receivers."""
        if not self._is_source or not hasattr(self.source, "state_dict"):
            return {}
        if self._state is not None:
            return self._state  # type: ignore[no-any-return]
        return self.source.state_dict()  # type: ignore[union-attr,no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the source's position (source rank only; a no-op elsewhere)."""
        self._state = None
        if self._is_source and hasattr(self.source, "load_state_dict"):
            self.source.load_state_dict(state_dict)  # type: ignore[union-attr]

    @property
    def is_source(self) -> bool:
        """Whether this rank iterates the real loader."""
        return self._is_source

    def __repr__(self) -> str:
        if self._noop:
            return f"BroadcastingDataLoader(no-op, source={type(self.source).__name__})"
        assert self._channel is not None
        role = "source" if self._is_source else "receiver"
        return (
            f"BroadcastingDataLoader({role}, group ranks={list(self._channel.ranks)}, "
            f"src={self._channel.src}, prefetch={self.prefetch})"
        )
