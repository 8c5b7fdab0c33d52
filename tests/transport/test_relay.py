"""Several hosts (``transport.relay``): the route every rank makes alike, and a relayed
wait that fails naming its peer (NOTE [ Several hosts ])."""

from __future__ import annotations

import datetime
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from shm_slots import shm_left_as_it_was

import tensorcast as tc

pytestmark = pytest.mark.usefixtures(shm_left_as_it_was.__name__)


def _routes(hosts: list[str], src: int = 0) -> list[tuple[str, Any]]:
    """Every rank's side and route of a channel over ranks on ``hosts`` (by rank)."""
    from tensorcast.transport import relay

    group = SimpleNamespace(ranks=tuple(range(len(hosts))), wire=SimpleNamespace(streams=None))
    extras = {r: {"host": h, "shm_why_not": "", "shm_token": f"t{r}"} for r, h in enumerate(hosts)}
    out = []
    for rank in range(len(hosts)):
        side, route = relay.open_side(None, group, src, rank, extras, "x")  # type: ignore[arg-type]
        if side is None and route is not None:
            side = route.writer  # a leader's arena, for its host
        name = "" if side is None else f"{type(side).__name__}:{side.token}"
        out.append((name, None if route is None else route.route))
    return out


def test_a_route_over_hosts_takes_one_rank_per_remote_host() -> None:
    from tensorcast.transport.relay import Route

    assert _routes(["a", "a", "b", "b", "b"]) == [
        ("Writer:t0", Route(leaders=(2,), near=(1,))),
        ("Reader:t0", Route(upstream=0, near_source=True)),
        ("Writer:t2", Route(upstream=0, leads=True, followers=(3, 4))),
        ("Reader:t2", Route(upstream=2)),
        ("Reader:t2", Route(upstream=2)),
    ]
    # the source alone on its host, a leader alone on its own: no arena for either
    assert _routes(["a", "b", "b", "c"])[0] == ("", Route(leaders=(1, 3)))
    assert _routes(["a", "b", "b", "c"])[3] == ("", Route(upstream=0, leads=True))
    # one host: the arena alone; every rank on its own host: the wire alone
    assert [route for _, route in _routes(["a", "a"])] == [None, None]
    assert _routes(["a", "b", "c"]) == [("", None)] * 3


class _Wire:
    """A relayed wire whose receives or sends fail as a dead peer's do."""

    def __init__(self, failing: str) -> None:
        self.failing, self.now = failing, ""

    def send(self, tensor: torch.Tensor, peers: tuple[int, ...]) -> _Wire:
        self.now = "send"
        return self

    def recv(self, tensor: torch.Tensor, peer: int) -> _Wire:
        self.now = "recv"
        return self

    def wait(self, timeout: Any) -> None:
        if self.now == self.failing:
            raise RuntimeError("Connection closed by peer")


def test_a_relayed_wait_that_fails_names_the_peer_it_waited_on() -> None:
    """A host's leader or follower that fails in the relay names the peer it waited on
    (not the source), in the receiver's ``PeerError``."""

    from tensorcast.transport.pool import BufferPool
    from tensorcast.transport.receiver import Receiver
    from tensorcast.transport.relay import Relay, Route

    ranks, wait = (10, 11, 12, 13), datetime.timedelta(seconds=1)
    follower = Relay(Route(upstream=2), None, None, ranks)
    leader = Relay(Route(upstream=0, leads=True, followers=(3,)), None, None, ranks)
    for relay, failing, says in [
        (follower, "recv", "receiving the rest of a frame from this host's leader, rank 12"),
        (
            leader,
            "send",
            "passing the rest of a frame on to this host's ranks [13], as their leader",
        ),
    ]:
        with pytest.raises(RuntimeError) as caught:
            relay.receive(_Wire(failing), BufferPool(), None, 5000, wait)
        me = SimpleNamespace(
            group=SimpleNamespace(lane=SimpleNamespace(break_=lambda e: None), ranks=ranks),
            _relay=relay, _shm=None, src=10,
        )  # fmt: skip
        with pytest.raises(tc.PeerError, match=f"^{re.escape(says)} \\(the source is rank 10\\)"):
            Receiver._break(me, caught.value)  # type: ignore[arg-type]
