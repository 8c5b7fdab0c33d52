"""The agreement before anything collective: ranks compare their setups in the store.

# NOTE [ Agreement before anything collective ]
Before a loader or a broadcast channel makes its group, the ranks of that group compare
their setups through the c10d store, within the timeout: a disagreement (axes, mesh shape
or rank layout, source, ``prefetch``, versions) is a ``DesyncError`` on every rank that
meets it, never a hang inside group creation. Setups are numbered per *scope* (the ranks
that build together) and written under each rank's own key, but read only by the group a
rank believes it is in, so a rank with other axes writes where its real group looks.
Round two settles one outcome per group with ``compare_set``, so a late or paused rank
reads why the others gave up. Cost per rank: a constant plus the group's size. Why, and
the cost in all: ``docs/design.md``, section 3. Keys (``<g>`` names the group)::

    agree/<scope>/<seq>/<rank>       round one: the rank's setup and what it tells
    agree/<scope>/<seq>/<g>/ready    round two: the ranks that confirmed, appended
    agree/<scope>/<seq>/<g>/count    round two: how many confirmed (``add``)
    agree/<scope>/<seq>/<g>/go       the outcome, set once (``compare_set``): "ok" or why not
    agree/<scope>/<seq>/<g>/done     how many are through; the last deletes every key
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tensorcast._errors import DesyncError

__all__ = ["EXITED", "Agreement", "mark_exit", "ranks_name"]

log = logging.getLogger("tensorcast")

#: set in the default store (no prefix) by a process that exits with the group up
EXITED = "tensorcast/exited/"


def ranks_name(ranks: Sequence[int]) -> str:
    text = "-".join(map(str, ranks))
    return text if len(text) <= 48 else hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def report_every(timeout_s: float) -> float:
    """Seconds between two "still waiting" lines: a fifth of the timeout, 1 to 60 s."""
    return min(60.0, max(1.0, timeout_s / 5))


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


class Agreement:
    """Setups compared among the ranks of a group; see NOTE [ Agreement before anything
    collective ].

    Args:
        store: tensorcast's prefix of the default store (or any store-like with ``set``,
            ``wait``, ``multi_get``, ``check``, ``add``, ``append``, ``compare_set``).
        rank: this rank's global rank.
        timeout: the default wait.
        exits: where processes mark that they exited (:data:`EXITED`), None for none.
        pause: called between the rounds (a seam for tests of a rank paused there).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        timeout: datetime.timedelta,
        *,
        exits: Any = None,
        pause: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.timeout = timeout
        self._exits = exits
        self._pause = pause
        self._lock = threading.Lock()
        self._seq: dict[str, int] = {}  # by scope name: one entry per mesh or group used
        #: scopes whose agreement an interrupt broke off on this rank: their numbers no
        #: longer pair with the other ranks', so no later agreement there may start
        self._interrupted: dict[str, str] = {}

    def agree(
        self,
        scope: str,
        group: Sequence[int],
        what: str,
        setup: dict[str, Any],
        extra: dict[str, Any] | None = None,
        *,
        first: tuple[int, int] | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> tuple[int, dict[int, dict[str, Any]]]:
        """Compare ``setup`` with the other ranks of ``group`` (and the scope's first).

        Args:
            scope: names the ranks that number their setups together (:func:`ranks_name`
                of a mesh's ranks, or of a group's).
            group: this rank's group, global ranks in mesh order (this one included).
            what: names the thing being built, in errors.
            setup: what must be equal on every rank (JSON-able values); the group is added.
            extra: what each rank tells the others without comparing (e.g. a length).
            first: where the scope is more than the group (a mesh): the scope's first
                rank and its number of ranks. Every rank also compares its setup (but for
                the group) with that rank's, so that a mesh whose rank layout differs is
                caught on every rank whose setup is not the first rank's.
            timeout: bounds each round's wait; None means the default.

        Returns:
            A number every rank of ``group`` agrees on for this setup, and every rank's
            ``extra`` by global rank.

        Raises:
            DesyncError: a rank disagrees, or did not come or confirm within the timeout;
                or an earlier agreement of ``scope`` was interrupted on this rank.
        """
        broken = self._interrupted.get(scope)
        if broken is not None:
            raise DesyncError(
                f"rank {self.rank}: an earlier setup among {_ranks(sorted(group))} was "
                f"interrupted on this rank ({broken}), so its agreements no longer pair with "
                f"the other ranks'; {what} cannot be set up. Restart the job (the other ranks "
                f"fail within their timeout)"
            )
        try:
            return self._agree(scope, group, what, setup, extra, first, timeout)
        except DesyncError:  # raised on every rank of the agreement alike
            raise
        except BaseException as e:  # e.g. a signal handler's, on this rank only
            self._interrupted[scope] = f"{type(e).__name__} in the setup of {what}"
            raise

    def _agree(
        self,
        scope: str,
        group: Sequence[int],
        what: str,
        setup: dict[str, Any],
        extra: dict[str, Any] | None,
        first: tuple[int, int] | None,
        timeout: datetime.timedelta | None,
    ) -> tuple[int, dict[int, dict[str, Any]]]:
        timeout = timeout or self.timeout
        with self._lock:
            seq = self._seq[scope] = self._seq.get(scope, 0) + 1
        base = f"agree/{scope}/{seq}/"
        mine = {**setup, "group": list(group)}
        text = json.dumps({"setup": mine, "extra": extra or {}}, sort_keys=True)
        mine = json.loads(text)["setup"]  # compared as every rank reads it: tuples as lists
        ours = base + ranks_name(sorted(group)) + "/"
        self.store.set(base + str(self.rank), text)
        if first is not None and first[0] == self.rank:
            self.store.set(base + "first", text)
        ranks = [*group, *([first[0]] if first is not None else [])]
        keys = [base + str(r) for r in group] + ([base + "first"] if first is not None else [])
        self._round_one(keys, ranks, what, ours, timeout)
        values = [json.loads(v) for v in self.store.multi_get(keys)]
        theirs = dict(zip(group, values))
        anchor = (first[0], values[-1]["setup"]) if first is not None else None
        self._compare(base, what, mine, theirs, anchor)
        if self._pause is not None:
            self._pause()
        self._round_two(ours, list(group), what, timeout)
        done = [ours + "ready", ours + "count", ours + "go"]
        self._forget(ours + "done", [*keys[: len(group)], *done], len(group))
        if first is not None:
            self._forget(base + "first/done", [base + "first"], first[1])
        digest = hashlib.blake2b(ours.encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little"), {r: v["extra"] for r, v in theirs.items()}

    def _compare(
        self,
        base: str,
        what: str,
        mine: dict[str, Any],
        theirs: dict[int, dict[str, Any]],
        first: tuple[int, dict[str, Any]] | None,
    ) -> None:
        """Raise on the first of the group's setups (or the mesh's first rank's, but for
        its group) that differs from this rank's."""
        for r, other in theirs.items():
            if other["setup"] != mine:
                self._disagree(base, what, mine, r, other["setup"])
        if first is not None:
            anchor = {**first[1], "group": mine["group"]}
            if anchor != mine:
                self._disagree(base, what, mine, first[0], anchor, "the mesh's first rank")

    def _round_one(
        self, keys: list[str], group: list[int], what: str, ours: str, timeout: datetime.timedelta
    ) -> None:
        """Wait for every key of the group, saying every few seconds who is missing."""
        total = timeout.total_seconds()
        start = time.monotonic()
        every = report_every(total)
        while True:
            step = min(every, total - (time.monotonic() - start))
            began = time.monotonic()
            try:
                self.store.wait(keys, datetime.timedelta(seconds=max(step, 0.001)))
                return
            except RuntimeError:
                if time.monotonic() - began < step / 2:
                    raise  # the store itself failed, well before the wait's end
            missing = sorted({r for r, k in zip(group, keys) if not self.store.check([k])})
            waited = time.monotonic() - start
            if not missing:
                return
            if total - waited < 0.05:  # the last slice ran out
                self._give_up_waiting(missing, group, what, ours, total)
            log.warning(
                "rank %d: still waiting for %s to build %s: %.0f s (of %g s)%s",
                self.rank, _ranks(missing), what, waited, total, self._gone(missing),
            )  # fmt: skip

    def _give_up_waiting(
        self, missing: list[int], group: list[int], what: str, ours: str, total: float
    ) -> None:
        gone = self._gone(missing)
        self.store.compare_set(
            ours + "go",
            "",
            f"rank {self.rank} gave up waiting for {_ranks(missing)} to set up {what} (it came "
            f"before them, and they did not come within {total:g} s){gone}",
        )
        raise DesyncError(
            f"rank {self.rank}: rank(s) {missing} did not set up {what} within {total:g} s"
            f"{gone}; every rank of {group} must build it together, in the same order as "
            f"its other tensorcast loaders"
        )

    def _gone(self, missing: list[int]) -> str:
        """What the store says of missing ranks: that their process exited, where it did."""
        if self._exits is None:
            return ""
        gone = [r for r in missing if self._exits.check([f"{EXITED}{r}"])]
        if not gone:
            return ""
        late = [r for r in missing if r not in gone]
        tail = f"; {_ranks(late)} not exited: late or stuck" if late else ""
        return f" ({_ranks(gone)} exited: its process is gone{tail})"

    def _disagree(
        self,
        base: str,
        what: str,
        mine: dict[str, Any],
        r: int,
        other: dict[str, Any],
        who: str = "",
    ) -> None:
        message = (
            f"rank {self.rank} and rank {r}{f' ({who})' if who else ''} disagree on the "
            f"setup of {what}: "
            f"{_differences(mine, other, self.rank, r)}. Every rank must build it with the "
            f"same arguments, on the same mesh"
        )
        theirs = other.get("group")
        if isinstance(theirs, list) and sorted(theirs) != sorted(mine["group"]):
            # the ranks of the group that rank believes in stop too, not only this one's
            key = base + ranks_name(sorted(int(x) for x in theirs)) + "/go"
            self.store.compare_set(key, "", message)
        raise DesyncError(message)

    def _round_two(
        self, ours: str, group: list[int], what: str, timeout: datetime.timedelta
    ) -> None:
        """Every rank confirms; the outcome is set once, and every rank reads it."""
        go = ours + "go"
        self.store.append(ours + "ready", f"{self.rank},")
        if self.store.add(ours + "count", 1) == len(group):
            self.store.compare_set(go, "", "ok")
        try:
            self.store.wait([go], timeout)
            outcome = self.store.get(go).decode()
        except RuntimeError:
            ready = self.store.get(ours + "ready").decode().split(",")
            missing = [r for r in group if str(r) not in ready]
            outcome = self.store.compare_set(
                go,
                "",
                f"rank {self.rank} gave up waiting for {_ranks(missing)} to confirm {what} "
                f"(they agreed, then did not confirm within {timeout.total_seconds():g} s)",
            ).decode()
            if outcome.startswith(f"rank {self.rank} gave up"):
                raise DesyncError(
                    f"rank {self.rank}: rank(s) {missing} agreed on {what} but did not "
                    f"confirm within {timeout.total_seconds():g} s{self._gone(missing)}"
                ) from None
        if outcome != "ok":
            raise DesyncError(f"rank {self.rank}: {outcome}")

    def _forget(self, done: str, keys: list[str], ranks: int) -> None:
        """Delete ``keys`` once all their ``ranks`` are through (counted in ``done``):
        the one that counts last does it."""
        if self.store.add(done, 1) != ranks:
            return
        for key in [*keys, done]:
            with contextlib.suppress(RuntimeError):  # a store that cannot delete keeps them
                self.store.delete_key(key)


def _differences(mine: dict[str, Any], theirs: dict[str, Any], me: int, other: int) -> str:
    keys = sorted(set(mine) | set(theirs))
    return "; ".join(
        f"{k}={mine.get(k)!r} on rank {me}, {theirs.get(k)!r} on rank {other}"
        for k in keys
        if mine.get(k) != theirs.get(k)
    )


def mark_exit() -> None:
    """At exit, with the default group still up: say in the store that this process is
    gone, so that ranks waiting for it to set something up can tell it from a late one."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{EXITED}{dist.get_rank()}", "exited")
    except Exception:  # at exit, a store that is gone is no one's problem
        return


atexit.register(mark_exit)
