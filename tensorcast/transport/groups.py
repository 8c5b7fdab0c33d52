"""tensorcast's own process groups, and the agreement that comes before them.

Everything tensorcast sends travels on groups it creates itself, one per set of ranks,
never on the mesh's or the caller's group: the model's collectives and the loader's
cannot then meet, whatever either does (see NOTE [ One ordered lane ] in ``transport.lane``).

# NOTE [ Agreement before anything collective ]
Before a loader or a broadcast channel makes its group, the ranks that build it
together compare their setups through the c10d store: each rank writes its own under a
key numbered by how many setups that set of ranks has agreed on, then reads everyone
else's, within the timeout. Ranks that disagree (other axes, mesh, source, ``prefetch``,
format version) all raise ``DesyncError`` naming both sides; a rank that never comes is
named too. Only then are groups created, so a disagreement never hangs inside group
creation. The last rank through an agreement deletes its keys (every rank has read them
by then), so a job that builds a loader per epoch does not grow the store. The store is
also where a source keeps its heartbeat (see ``transport.liveness``).

The groups are raw c10d backends over a prefix of the default store, owned here and torn
down with the default group: a loader built per epoch makes no new group or thread.
State lives on a :class:`World`, one per default process group (a job that destroys and
re-initialises the default group gets a new one).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorcast._errors import DesyncError
from tensorcast.transport.frame import INITIAL_CAPACITY
from tensorcast.transport.lane import Lane
from tensorcast.transport.liveness import Heartbeat
from tensorcast.transport.wire import GlooWire, NcclWire, Wire

__all__ = ["Group", "World", "world"]

_lock = threading.Lock()
_worlds: weakref.WeakKeyDictionary[Any, World] = weakref.WeakKeyDictionary()


def world() -> World:
    """tensorcast's state for the current default process group (made on first use)."""
    default = dist.distributed_c10d._get_default_group()
    with _lock:
        state = _worlds.get(default)
        if state is None:
            state = _worlds[default] = World(default)
        return state


def _ready_keys(base: str, scope: tuple[int, ...]) -> list[str]:
    """The keys of an agreement's second round, one per rank."""
    return [base + f"ready/{r}" for r in scope]


def _ranks_name(ranks: Sequence[int]) -> str:
    text = "-".join(map(str, ranks))
    return text if len(text) <= 48 else hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class Group:
    """One of tensorcast's groups: its global ranks, its wire and its lane."""

    def __init__(self, ranks: tuple[int, ...], wire: Wire, lane: Lane) -> None:
        self.ranks = ranks
        self.wire = wire
        self.lane = lane
        #: the size of the next first message; only the lane's worker reads or sets it,
        #: frame after frame, so it is the same on every rank (see ``transport.frame``)
        self.capacity = INITIAL_CAPACITY

    def local(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


class World:
    """The default group's store, the setups agreed on, and tensorcast's groups."""

    def __init__(self, default: Any) -> None:
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.backend = str(dist.get_backend()).lower()
        self.timeout = _default_timeout(default)
        base = dist.distributed_c10d._get_default_store()
        # A store outlives a re-initialised group in some launchers: number this world's
        # keys by how many worlds this rank has made on it.
        generation = base.add(f"tensorcast/generation/{self.rank}", 1)
        self.store = dist.PrefixStore(f"tensorcast/{generation}/", base)
        self._agreed: dict[tuple[int, ...], int] = {}
        #: scopes whose agreement an interrupt broke off on this rank: their numbers no
        #: longer pair with the other ranks', so no later agreement among them may start
        self._interrupted: dict[tuple[int, ...], str] = {}
        self._groups: dict[tuple[int, ...], Group] = {}
        self._lock = threading.Lock()
        default_ref = weakref.ref(default)
        self.heartbeat = Heartbeat(
            self.store, self.rank, self.timeout.total_seconds(), lambda: default_ref() is not None
        )
        #: channels of ``tensorcast.broadcast``, by (group ranks, source)
        self.broadcast_channels: dict[tuple[tuple[int, ...], int], Any] = {}

    # -- agreement -----------------------------------------------------------------

    def agree(
        self,
        scope: Sequence[int],
        what: str,
        setup: dict[str, Any],
        extra: dict[str, Any] | None = None,
        *,
        timeout: datetime.timedelta | None = None,
    ) -> tuple[int, dict[int, dict[str, Any]]]:
        """Compare ``setup`` with every other rank of ``scope`` (global ranks, this one
        included); see NOTE [ Agreement before anything collective ].

        Args:
            scope: the ranks that build this together.
            what: names the thing being built, in errors.
            setup: what must be equal on every rank (JSON-able values).
            extra: what each rank tells the others without comparing (e.g. a length).
            timeout: how long to wait for the others; None means the default group's.

        Returns:
            A number every rank of ``scope`` agrees on for this setup, and every rank's
            ``extra`` by global rank.

        Raises:
            DesyncError: a rank disagrees, or did not come within the timeout; or an
                earlier agreement among ``scope`` was interrupted on this rank.
        """
        scope = tuple(scope)
        if scope in self._interrupted:
            raise DesyncError(
                f"rank {self.rank}: an earlier setup among ranks {list(scope)} was "
                f"interrupted on this rank ({self._interrupted[scope]}), so its agreements "
                f"no longer pair with the other ranks'; {what} cannot be set up. Restart the "
                f"job (the other ranks fail within their timeout)"
            )
        try:
            return self._agree(scope, what, setup, extra, timeout)
        except DesyncError:  # raised on every rank of the agreement alike
            raise
        except BaseException as e:  # e.g. a signal handler's, on this rank only
            self._interrupted[scope] = f"{type(e).__name__} in the setup of {what}"
            raise

    def _agree(
        self,
        scope: tuple[int, ...],
        what: str,
        setup: dict[str, Any],
        extra: dict[str, Any] | None,
        timeout: datetime.timedelta | None,
    ) -> tuple[int, dict[int, dict[str, Any]]]:
        timeout = timeout or self.timeout
        with self._lock:
            seq = self._agreed[scope] = self._agreed.get(scope, 0) + 1
        base = f"agree/{_ranks_name(scope)}/{seq}/"
        text = json.dumps({"setup": setup, "extra": extra or {}}, sort_keys=True)
        setup = json.loads(text)["setup"]  # compared as every rank reads it: tuples as lists
        self.store.set(base + str(self.rank), text)
        keys = [base + str(r) for r in scope]
        try:
            self.store.wait(keys, timeout)
        except RuntimeError as e:
            missing = [r for r, k in zip(scope, keys) if not self.store.check([k])]
            self.store.set(base + "abandoned", str(self.rank))  # for a rank that comes late
            raise DesyncError(
                f"rank {self.rank}: rank(s) {missing} did not set up {what} within "
                f"{timeout.total_seconds():g} s; every rank of {list(scope)} must build it "
                f"together, in the same order as its other tensorcast loaders ({e})"
            ) from None
        theirs = {r: json.loads(self.store.get(k)) for r, k in zip(scope, keys)}
        for r, other in theirs.items():
            if other["setup"] != setup:
                raise DesyncError(
                    f"rank {self.rank} and rank {r} disagree on the setup of {what}: "
                    f"{_differences(setup, other['setup'], self.rank, r)}. Every rank must "
                    f"build it with the same arguments"
                )
        self._ready(base, scope, what, timeout)
        self._forget(base, [*keys, *_ready_keys(base, scope)], len(scope))
        digest = hashlib.blake2b(base.encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little"), {r: v["extra"] for r, v in theirs.items()}

    def _ready(
        self, base: str, scope: tuple[int, ...], what: str, timeout: datetime.timedelta
    ) -> None:
        """The agreement's second round: every rank says it agreed, so that none goes on to
        make groups with a rank that gave up waiting for the first (it says so instead)."""
        self.store.set(base + f"ready/{self.rank}", "1")
        ready = _ready_keys(base, scope)
        abandoned = base + "abandoned"
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.store.check(ready):
            if self.store.check([abandoned]):
                who = self.store.get(abandoned).decode()
                raise DesyncError(
                    f"rank {self.rank}: rank {who} gave up waiting for the others to set up "
                    f"{what} (it came first, and the others did not within the timeout)"
                )
            if time.monotonic() > deadline:
                missing = [r for r, k in zip(scope, ready) if not self.store.check([k])]
                raise DesyncError(
                    f"rank {self.rank}: rank(s) {missing} agreed on {what} but did not "
                    f"confirm within {timeout.total_seconds():g} s"
                )
            time.sleep(0.002)

    def _forget(self, base: str, keys: list[str], ranks: int) -> None:
        """Delete an agreement's ``keys`` once all its ``ranks`` are through it: the one
        that counts last does it. A failed agreement keeps its keys (they name who was
        missing, for a rank that comes late)."""
        done = base + "done"
        if self.store.add(done, 1) != ranks:
            return
        for key in [*keys, done]:
            with contextlib.suppress(RuntimeError):  # a store that cannot delete keeps them
                self.store.delete_key(key)

    # -- groups ----------------------------------------------------------------------

    def group(self, ranks: tuple[int, ...]) -> Group:
        """tensorcast's group over ``ranks`` (global, sorted), made on first use.

        Every rank of ``ranks`` must ask together the first time (the group connects
        them); call it only after an agreement among them.
        """
        with self._lock:
            group = self._groups.get(ranks)
            if group is None:
                group = self._groups[ranks] = self._make_group(ranks)
            return group

    def _make_group(self, ranks: tuple[int, ...]) -> Group:
        local = ranks.index(self.rank)
        name = _ranks_name(ranks)
        store = dist.PrefixStore(f"group/{name}/", self.store)
        gloo = dist.ProcessGroupGloo(
            dist.PrefixStore("gloo/", store), local, len(ranks), self.timeout
        )
        wire: Wire
        cuda: int | None = None
        if "nccl" in self.backend:
            cuda = torch.cuda.current_device()
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), local, len(ranks), opts)
            wire = NcclWire(gloo, nccl, local, torch.device("cuda", cuda))
        else:
            wire = GlooWire(gloo, local)
        return Group(ranks, wire, Lane(name, wire.abort, cuda))


def _default_timeout(default: Any) -> datetime.timedelta:
    """The timeout given to ``init_process_group`` (torch keeps it on the backend)."""
    for device in ("cpu", "cuda"):
        try:
            timeout = default._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return dist.default_pg_timeout


def _differences(mine: dict[str, Any], theirs: dict[str, Any], me: int, other: int) -> str:
    keys = sorted(set(mine) | set(theirs))
    return "; ".join(
        f"{k}={mine.get(k)!r} on rank {me}, {theirs.get(k)!r} on rank {other}"
        for k in keys
        if mine.get(k) != theirs.get(k)
    )
