"""The agreement before anything collective: ranks compare their setups in the store.

# NOTE [ Agreement before anything collective ]
Before a loader or a broadcast channel makes its group, the ranks that build it together
(its *scope*: a mesh's ranks, or a group's) compare their setups through the c10d store,
within the timeout: a disagreement (axes, mesh shape or rank layout, source, ``prefetch``,
versions) is a ``DesyncError`` on every rank of the scope, whichever of a mesh's groups
holds it, never a hang inside group creation. Setups are numbered per scope and written
under each rank's own key, but read only by the group a rank believes it is in (and
compared with the scope's first rank's), so a rank with other axes writes where its real
group looks. The outcome is one key per scope, set once with ``compare_set``: "ok" by the
rank whose confirmation completes the scope's count, or why not by the first rank that
finds a disagreement or gives up waiting. Every rank waits for it, so a disagreement in
one DP slot fails every slot, and a late or paused rank reads why the others gave up.
Waits poll with ``check``, never a blocking ``wait`` that can time out (c10d logs every
one that does). Cost per rank: a constant plus its group's size, plus polls that grow
with the wait, never with the world. Why, and the cost in all: ``docs/design.md``,
"Agreement before anything collective". Keys::

    agree/<scope>/<seq>/<rank>   round one: the rank's setup and what it tells
    agree/<scope>/<seq>/first    round one: the scope's first rank's setup (a mesh's)
    agree/<scope>/<seq>/ready    round two: the ranks that confirmed, appended
    agree/<scope>/<seq>/count    round two: how many confirmed (``add``)
    agree/<scope>/<seq>/go       the outcome, set once (``compare_set``): "ok" or why not
    agree/<scope>/<seq>/done     how many read "ok"; the last deletes the scope's keys

A rank deletes its own round-one key once it reads "ok": every rank has read it by then.
A store that fails during the setup (its host exited) is a ``PeerError`` naming the
store and its host (:func:`store_failed`), never torch's raw ``DistNetworkError``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tensorcast._errors import DesyncError, PeerError, TensorcastError

__all__ = ["EXITED", "Agreement", "host_id", "ranks_name", "store_failed"]

log = logging.getLogger("tensorcast")

#: set in the default store (no prefix) by a process that exits with the group up (NOTE
#: [ Interpreter exit ] in ``transport.exits``, step 3)
EXITED = "tensorcast/exited/"

_POLL_FIRST_S = 0.005  # a wait's first pause between two checks; each next one doubles
_POLL_MAX_S = 1.0  # ... up to this: a wait of w seconds costs about 8 + w checks
_NAMED_MAX = 16  # ranks named in a message about a whole scope, at most


def host_id() -> str:
    """Which host this process is on, for the shared-memory lane: ``TENSORCAST_HOST_ID`` when
    set (containers that share ``/dev/shm`` under other host names; tests), else the boot id,
    the host name and the device of ``/dev/shm`` (two containers of one machine with
    ``--net=host`` share the first two, each with a ``/dev/shm`` of its own). Told to the
    other ranks as an ``extra`` of the agreement."""
    told = os.environ.get("TENSORCAST_HOST_ID", "").strip()
    if told:
        return told
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        shm = os.stat("/dev/shm").st_dev
    except OSError:
        shm = -1
    return f"{boot}/{os.uname().nodename}/{shm}"


def ranks_name(ranks: Sequence[int]) -> str:
    text = "-".join(map(str, ranks))
    return text if len(text) <= 48 else hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def report_every(timeout_s: float) -> float:
    """Seconds between two "still waiting" lines: a fifth of the timeout, 1 to 60 s."""
    return min(60.0, max(1.0, timeout_s / 5))


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > _NAMED_MAX:
        return f"ranks {list(ranks[:_NAMED_MAX])} and {len(ranks) - _NAMED_MAX} more"
    return f"ranks {list(ranks)}"


def store_failed(store: Any, rank: int, doing: str, error: BaseException) -> PeerError:
    """The error for a store request that failed, or was not answered in time (not a
    wait's timeout: tensorcast polls): names the store and the process that hosts it."""
    base = getattr(store, "_underlying_non_prefix_store", store)
    if hasattr(base, "host") and hasattr(base, "port"):
        where = f"the c10d store (a TCPStore at {base.host}:{base.port})"
    else:
        where = f"the c10d store (a {type(base).__name__})"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        host = "torchrun's agent on the master node hosts it: find why that agent stopped"
    else:
        host = (
            "rank 0's process hosts it (init_process_group made it there, unless a store was "
            "passed in): it most likely exited on an error of its own, which its output shows"
        )
    said = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return PeerError(
        f"rank {rank}: {where} failed while {doing}: {type(error).__name__}: {said}. "
        f"Its host exited or stopped answering; {host}. Restart the job once it is fixed"
    )


class Agreement:
    """Setups compared among the ranks of a group; see NOTE [ Agreement before anything
    collective ].

    Args:
        store: tensorcast's prefix of the default store (or any store-like with ``set``,
            ``get``, ``multi_get``, ``check``, ``add``, ``append``, ``compare_set``,
            ``delete_key``).
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
            scope: names the ranks that build together and number their setups together
                (:func:`ranks_name` of a mesh's ranks, or of a group's).
            group: this rank's group, global ranks in mesh order (this one included).
            what: names the thing being built, in errors.
            setup: what must be equal on every rank (JSON-able values); the group is added.
            extra: what each rank tells the others without comparing (e.g. a length).
            first: where the scope is more than the group (a mesh): the scope's first
                rank (global) and its number of ranks. Every rank also compares its setup
                (but for the group) with that rank's, so that a mesh whose rank layout
                differs is caught on every rank whose setup is not the first rank's; and
                every rank of the scope waits for the scope's one outcome.
            timeout: bounds each round's wait; None means the default.

        Returns:
            A number every rank of ``group`` agrees on for this setup, and every rank's
            ``extra`` by global rank.

        Raises:
            DesyncError: a rank of the scope disagrees, or did not come or confirm within
                the timeout; or an earlier agreement of ``scope`` was interrupted on this
                rank.
            PeerError: the store failed (its host exited): see :func:`store_failed`.
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
        except RuntimeError as e:
            self._interrupted[scope] = f"{type(e).__name__} in the setup of {what}"
            if isinstance(e, TensorcastError):
                raise
            raise store_failed(self.store, self.rank, f"setting up {what}", e) from e
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
        start = time.monotonic()
        with self._lock:
            seq = self._seq[scope] = self._seq.get(scope, 0) + 1
        base = f"agree/{scope}/{seq}/"
        mine = {**setup, "group": list(group)}
        text = json.dumps({"setup": mine, "extra": extra or {}}, sort_keys=True)
        mine = json.loads(text)["setup"]  # compared as every rank reads it: tuples as lists
        own = base + str(self.rank)
        self.store.set(own, text)
        if first is not None and first[0] == self.rank:
            self.store.set(base + "first", text)
        ranks = [*group, *([first[0]] if first is not None else [])]
        keys = [base + str(r) for r in group] + ([base + "first"] if first is not None else [])
        self._round_one(base, keys, ranks, what, timeout)
        values = [json.loads(v) for v in self.store.multi_get(keys)]
        theirs = dict(zip(group, values))
        anchor = (first[0], values[-1]["setup"]) if first is not None else None
        self._compare(base, what, mine, theirs, anchor)
        if self._pause is not None:
            self._pause()
        scope_ranks = first[1] if first is not None else len(group)
        # both rounds within about the timeout (not twice it), and min(1 s, a quarter) to confirm
        total = timeout.total_seconds()
        until = max(start + total, time.monotonic() + min(1.0, 0.25 * total))
        self._round_two(base, list(group), scope_ranks, what, total, until)
        # "ok": every rank of the scope has read the keys it needed, so each deletes its own
        # and the last one through deletes the scope's
        with contextlib.suppress(RuntimeError):  # a store that cannot delete keeps them
            self.store.delete_key(own)
        if self.store.add(base + "done", 1) == scope_ranks:
            for key in [*(["first"] if first is not None else []), "ready", "count", "go", "done"]:
                with contextlib.suppress(RuntimeError):
                    self.store.delete_key(base + key)
        ours = base + ranks_name(sorted(group)) + "/"
        digest = hashlib.blake2b(ours.encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little"), {r: v["extra"] for r, v in theirs.items()}

    def _poll(self, keys: list[str], until: float) -> bool:
        """Whether every key of ``keys`` is in the store by ``until`` (monotonic seconds).

        A ``check`` now and then, never a blocking ``wait``: TCPStore's client logs two
        warnings (``waitForInput ... timed out``) for every wait that times out, and a
        rank that waits for a late one would print them every few seconds. The pauses
        double from 5 ms up to 1 s: a wait of ``w`` seconds costs about ``8 + w`` checks,
        whatever the world size, and sees the keys about as late as it had waited at most
        (5 ms at least, 1 s at most).
        """
        pause = _POLL_FIRST_S
        while True:
            if self.store.check(keys):
                return True
            left = until - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX_S)

    def _outcome_so_far(self, base: str) -> None:
        """Raise what the scope's outcome says, if a rank already set it (to why not: it
        cannot be "ok" before this rank confirmed)."""
        go = base + "go"
        if self.store.check([go]):
            raise DesyncError(f"rank {self.rank}: {self.store.get(go).decode()}")

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
        self, base: str, keys: list[str], ranks: list[int], what: str, timeout: datetime.timedelta
    ) -> None:
        """Wait for every key of the group (and the scope's first), saying every few
        seconds who is missing; stop early when the scope's outcome is already set."""
        total = timeout.total_seconds()
        start = time.monotonic()
        every = report_every(total)
        reports = 0
        while True:
            reports += 1
            if self._poll(keys, start + min(total, reports * every)):
                return
            missing = sorted({r for r, k in zip(ranks, keys) if not self.store.check([k])})
            waited = time.monotonic() - start
            if not missing:
                return
            if total - waited < 0.05:  # the last slice ran out
                self._give_up_waiting(base, missing, ranks, what, total)
            self._outcome_so_far(base)
            log.warning(
                "rank %d: still waiting for %s to set up %s: %.0f s (of %g s)%s",
                self.rank, _ranks(missing), what, waited, total, self._gone(missing),
            )  # fmt: skip

    def _give_up_waiting(
        self, base: str, missing: list[int], ranks: list[int], what: str, total: float
    ) -> None:
        gone = self._gone(missing)
        self.store.compare_set(
            base + "go",
            "",
            f"rank {self.rank} gave up waiting for {_ranks(missing)} to set up {what} (it came "
            f"before them, and they did not come within {total:g} s){gone}",
        )
        error = DesyncError(
            f"rank {self.rank}: rank(s) {missing} did not set up {what} within {total:g} s"
            f"{gone}; every rank of the mesh or group (this rank waited for "
            f"{sorted(set(ranks))}: its group, and the mesh's first rank if any) must set it "
            f"up together, in the same order as its other tensorcast loaders and broadcasts"
        )
        # whether they come to it late (they write their keys as they enter: then they are
        # told, and skip it as this rank did), read at this rank's next job over them
        arrived = [base + str(r) for r in missing]
        error.came = functools.partial(self.store.check, arrived)  # type: ignore[attr-defined]
        raise error

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
            f"{_differences(mine, other, self.rank, r)}. Every rank must set it up with the "
            f"same arguments, on the same mesh"
        )
        self.store.compare_set(base + "go", "", message)  # every rank of the scope stops
        raise DesyncError(message)

    def _round_two(
        self, base: str, group: list[int], scope_ranks: int, what: str, total: float, until: float
    ) -> None:
        """Every rank confirms; the scope's outcome is set once, and every rank reads it.
        Waits until ``until`` (monotonic; see ``_agree``) for ``total`` seconds' setup."""
        go = base + "go"
        self.store.append(base + "ready", f"{self.rank},")
        if self.store.add(base + "count", 1) == scope_ranks:
            self.store.compare_set(go, "", "ok")
        if self._poll([go], until):
            outcome = self.store.get(go).decode()
        else:
            outcome = self._give_up_confirming(base, group, scope_ranks, what, total)
        if outcome != "ok":
            raise DesyncError(f"rank {self.rank}: {outcome}")

    def _give_up_confirming(
        self, base: str, group: list[int], scope_ranks: int, what: str, total: float
    ) -> str:
        """Set the outcome to why this rank stops waiting (unless another rank set it
        first: then that is the outcome); raise if it is this rank's."""
        go = base + "go"
        if self.store.check([go]):
            return self.store.get(go).decode()
        if scope_ranks != len(group) and _appears(self.store, go, min(1.0, 0.25 * total)):
            # A rank of a group short of a member gives up at the same deadline and knows
            # better whom it waited for: its outcome, if it comes within a short grace, wins.
            return self.store.get(go).decode()
        # Read once, by the ranks that time out: the scope's confirmed ranks.
        ready = sorted(int(r) for r in self.store.get(base + "ready").decode().split(",") if r)
        missing, why, raised = _unconfirmed(ready, group, scope_ranks, what)
        outcome = self.store.compare_set(
            go, "", f"rank {self.rank} gave up waiting for {why} within {total:g} s)"
        ).decode()
        if outcome.startswith(f"rank {self.rank} gave up"):
            raise DesyncError(
                f"rank {self.rank}: {raised} within {total:g} s{self._gone(missing)}"
            ) from None
        return outcome


def _unconfirmed(
    ready: list[int], group: list[int], scope_ranks: int, what: str
) -> tuple[list[int], str, str]:
    """Who did not confirm ``what`` (when known), why a rank gave up, and what it raises."""
    if scope_ranks == len(group):
        missing = [r for r in group if r not in ready]
        why = f"{_ranks(missing)} to confirm {what} (they agreed, then did not confirm"
        return missing, why, f"rank(s) {missing} agreed on {what} but did not confirm"
    # the mesh's ranks are not known here: the ranks of this rank's group are
    why = (
        f"{scope_ranks - len(ready)} of the mesh's {scope_ranks} ranks to confirm "
        f"{what} (only {_ranks(ready)} confirmed; the others never came, with none "
        f"of their group, or stopped between the rounds"
    )
    raised = (
        f"{scope_ranks - len(ready)} of the mesh's {scope_ranks} ranks did not "
        f"confirm {what} (only {_ranks(ready)} did; every rank of the mesh must "
        f"build it together)"
    )
    return [], why, raised


def _appears(store: Any, key: str, within_s: float) -> bool:
    """Whether ``key`` is set within ``within_s`` seconds (polled: no c10d wait logs)."""
    deadline = time.monotonic() + within_s
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _differences(mine: dict[str, Any], theirs: dict[str, Any], me: int, other: int) -> str:
    keys = sorted(set(mine) | set(theirs))
    return "; ".join(
        f"{k}={mine.get(k)!r} on rank {me}, {theirs.get(k)!r} on rank {other}"
        for k in keys
        if mine.get(k) != theirs.get(k)
    )
