"""Pure tests of the promise rule (NOTE [ Promised payloads ]): what a channel promises,
given the frames before, as the source and every receiver apply it. Nothing communicates.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorcast.transport import promise as _promise
from tensorcast.transport.frame import INITIAL_CAPACITY, FramePlan, plan_frame
from tensorcast.transport.promise import Promises

# Payload sizes: none, inline at the initial capacity, and three that travel alone.
SIZES = [0, 64, 100_000, 300_000, 1 << 20]


def run(sizes: list[int], *, on: bool = True) -> list[FramePlan]:
    """The plans of a channel's frames of these payload sizes, cut as a source cuts them."""
    promises, plans = Promises(on), []
    for n in sizes:
        plan = plan_frame(INITIAL_CAPACITY, 40, n, inline_ok=True, promised=promises.next())
        assert promises.record(plan) == promises.next()  # what the next frame promises
        plans.append(plan)
    return plans


def test_fixed_size_payloads_are_promised_from_the_third_frame() -> None:
    plans = run([300_000] * 6)
    assert [p.promised for p in plans] == [0, 0] + [300_000] * 4
    assert all(p.in_promise and not p.separate_payload for p in plans[2:])


def test_inline_and_empty_payloads_are_never_promised() -> None:
    assert not any(p.promised for p in run([64] * 5 + [0] * 5))


def test_the_switch_turns_promises_off() -> None:
    assert not any(p.promised for p in run([300_000] * 5, on=False))


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False)])
def test_the_environment_switch(
    monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool
) -> None:
    if value is None:
        monkeypatch.delenv("TENSORCAST_PROMISES", raising=False)
    else:
        monkeypatch.setenv("TENSORCAST_PROMISES", value)
    assert _promise.enabled() is on


def test_a_promise_not_kept_doubles_the_run_the_next_one_needs() -> None:
    a, b = 300_000, 200_000
    sizes = [a, a, b, *[b] * 4, a, *[a] * 8, 0]
    promised = [p.promised for p in run(sizes)]
    # a a | b: a not kept -> need 4 | b b b: 3 in a row | b: kept | a: b not kept -> need 8
    assert promised[:8] == [0, 0, a, 0, 0, 0, b, b]
    # eight a's in a row (the one that broke b's promise included): the ninth is promised,
    # kept; the empty frame after it promises a too, and breaks it
    assert promised[8:] == [0] * 7 + [a, a]


def _oracle(sizes: list[int]) -> list[int]:
    """The rule of NOTE [ Promised payloads ], written from its text: what each frame
    promises."""
    out: list[int] = []
    need = 2
    for i, n in enumerate(sizes):
        before = [0 if s <= 64 else s for s in sizes[max(i - need, 0) : i]]
        promise = before[0] if len(before) == need and len(set(before)) == 1 else 0
        out.append(promise)
        if promise and promise != (0 if n <= 64 else n):
            need = min(2 * need, 16)
    return out


@settings(deadline=None, max_examples=300)
@given(st.lists(st.sampled_from(SIZES), max_size=60))
def test_promises_follow_the_rule_and_break_at_most_once_per_change(sizes: list[int]) -> None:
    """For any stream of sizes: a frame promises what the rule's text says; a promise is
    kept exactly when the frame's payload is separate and of that size; a promise not kept
    (its zeros sent for nothing) needs the size to have changed at that frame, and once
    three were broken the next needs a run of 16."""
    plans = run(sizes)
    assert [p.promised for p in plans] == _oracle(sizes)
    for p in plans:
        assert p.in_promise == (p.promised > 0 and not p.inline and p.payload_len == p.promised)
    broken = [i for i, p in enumerate(plans) if p.promised and not p.in_promise]
    assert all(sizes[i] != sizes[i - 1] for i in broken)
    for j, i in enumerate(broken[3:], start=3):
        assert i >= 16 and len(set(sizes[i - 16 : i])) == 1, (j, i, sizes)
