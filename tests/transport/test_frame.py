"""Pure tests of the frame: how ``cut_frame`` cuts a frame into messages, and how a
first message's ``Prefix`` is written, read back and refused. Nothing communicates.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import batch_past_4_gib

import tensorcast as tc
from tensorcast.codec import Encoder
from tensorcast.transport import frame as _frame
from tensorcast.transport.frame import (
    FRAMES_VERSION,
    INITIAL_CAPACITY,
    MAX_CAPACITY,
    MAX_ERROR_BYTES,
    MAX_HEADER_BYTES,
    PAYLOAD_ALIGN,
    PREFIX_SIZE,
    Cut,
    Flags,
    Kind,
    Prefix,
    Promises,
    cut_frame,
)

SETTINGS = settings(deadline=None, print_blob=True, max_examples=300)


def _align(n: int) -> int:
    return (n + PAYLOAD_ALIGN - 1) // PAYLOAD_ALIGN * PAYLOAD_ALIGN


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def first_message(plan: Cut) -> list[tuple[int, int, str]]:
    """The byte ranges of the first message that carry something, as the sender writes
    them: the prefix, the header unless it spilled, the payload when it is inline."""
    spans = [(0, PREFIX_SIZE, "prefix")]
    if not plan.spill:
        spans.append((PREFIX_SIZE, PREFIX_SIZE + plan.header_len, "header"))
    if plan.inline:
        spans.append((plan.payload_at, plan.payload_at + plan.payload_len, "payload"))
    return spans


def later_messages(plan: Cut) -> list[tuple[str, int]]:
    """The messages besides the first one, in order, and their sizes: the promised one
    (posted with the first), then what follows the first."""
    out = []
    if plan.promised:
        out.append(("payload" if plan.in_promise else "zeros", plan.promised))
    if plan.spill:
        out.append(("header", plan.header_len))
    if plan.separate_payload:
        out.append(("payload", plan.payload_len))
    return out


# -- cut_frame: worked examples --------------------------------------------------------


def test_a_small_frame_travels_in_its_first_message() -> None:
    plan = cut_frame(INITIAL_CAPACITY, 100, 200, host_payloads=True)
    assert plan.flags == Flags.INLINE and plan.inline and not plan.spill
    assert not plan.separate_payload and later_messages(plan) == []
    # The inline payload ends the message, aligned: where it starts depends on its length
    # alone, not on the header's.
    assert plan.payload_at == INITIAL_CAPACITY - _align(200)
    assert plan.payload_at == cut_frame(INITIAL_CAPACITY, 900, 200, host_payloads=True).payload_at
    assert plan.next_capacity == INITIAL_CAPACITY, "a frame that fits asks for no more room"


def test_frames_without_payload() -> None:
    for header_len in (0, 5, INITIAL_CAPACITY - PREFIX_SIZE):  # an END frame; an ERROR frame
        plan = cut_frame(INITIAL_CAPACITY, header_len, 0, host_payloads=True)
        assert not plan.spill and not plan.separate_payload and later_messages(plan) == []
        assert plan.next_capacity == INITIAL_CAPACITY


def test_a_header_that_does_not_fit_spills_and_the_next_capacity_grows() -> None:
    header_len = INITIAL_CAPACITY  # with the prefix, over the first message's capacity
    plan = cut_frame(INITIAL_CAPACITY, header_len, 0, host_payloads=True)
    assert plan.flags == Flags.SPILL and plan.spill and not plan.inline
    assert later_messages(plan) == [("header", header_len)]
    assert plan.next_capacity == 2 * INITIAL_CAPACITY
    again = cut_frame(plan.next_capacity, header_len, 0, host_payloads=True)
    assert not again.spill, "the next frame like this one fits in its first message"


def test_a_payload_that_does_not_fit_follows_and_the_next_capacity_grows() -> None:
    plan = cut_frame(INITIAL_CAPACITY, 100, 10_000, host_payloads=True)
    assert plan.flags == Flags.NONE and plan.separate_payload
    assert later_messages(plan) == [("payload", 10_000)]
    want = _align(PREFIX_SIZE + 100) + _align(10_000)
    assert plan.next_capacity == 16384 >= want > 8192  # the smallest power of two that fits
    again = cut_frame(plan.next_capacity, 100, 10_000, host_payloads=True)
    assert again.inline and later_messages(again) == []


def test_capacities_only_grow() -> None:
    plan = cut_frame(64 << 10, 10, 10, host_payloads=True)
    assert plan.inline and plan.next_capacity == 64 << 10


def test_growth_is_capped_at_max_capacity() -> None:
    # A payload larger than the cap always travels on its own; the next capacity grows
    # for the header alone.
    plan = cut_frame(INITIAL_CAPACITY, 10_000, MAX_CAPACITY, host_payloads=True)
    assert plan.spill and later_messages(plan) == [("header", 10_000), ("payload", MAX_CAPACITY)]
    assert plan.next_capacity == 16384
    big = cut_frame(MAX_CAPACITY, 100, 6 << 30, host_payloads=True)
    assert big.separate_payload and big.next_capacity == MAX_CAPACITY
    # A header larger than the cap spills every time and asks for nothing.
    huge = cut_frame(INITIAL_CAPACITY, MAX_CAPACITY, 0, host_payloads=True)
    assert huge.spill and huge.next_capacity == INITIAL_CAPACITY
    # A frame just under the cap grows the capacity to it, and fits there.
    near = cut_frame(INITIAL_CAPACITY, 100, MAX_CAPACITY - 1024, host_payloads=True)
    assert near.next_capacity == MAX_CAPACITY
    assert cut_frame(MAX_CAPACITY, 100, MAX_CAPACITY - 1024, host_payloads=True).inline


def test_payloads_never_go_inline_where_they_live_on_a_device() -> None:
    plan = cut_frame(INITIAL_CAPACITY, 100, 200, host_payloads=False)
    assert not plan.inline and plan.separate_payload
    assert later_messages(plan) == [("payload", 200)]
    assert plan.next_capacity == INITIAL_CAPACITY, "growth counts the header alone"
    spilled = cut_frame(INITIAL_CAPACITY, 5000, 1 << 20, host_payloads=False)
    assert spilled.spill and spilled.next_capacity == 8192


# -- cut_frame: laws --------------------------------------------------------------------

capacities = st.integers(12, 18).map(lambda k: 1 << k)  # INITIAL_CAPACITY .. MAX_CAPACITY
lengths = st.one_of(
    st.integers(0, 3 * MAX_CAPACITY),
    st.sampled_from([0, 1, 63, 64, 65, INITIAL_CAPACITY - PREFIX_SIZE, MAX_CAPACITY]),
    st.integers(0, 1 << 44),
)


@SETTINGS
@given(
    capacity=capacities,
    header_len=st.one_of(st.integers(0, 3 * MAX_CAPACITY), st.integers(0, MAX_HEADER_BYTES)),
    payload_len=lengths,
    host_payloads=st.booleans(),
    promise=st.one_of(st.sampled_from(["none", "kept"]), lengths),
)
def test_plans_carry_every_byte_once(
    capacity: int, header_len: int, payload_len: int, host_payloads: bool, promise: str | int
) -> None:
    """For any sizes and any promise, the frame's messages carry exactly ``header_len +
    payload_len`` bytes besides the prefix and a promise's zeros, the first message's
    pieces never overlap and stay inside it, an inline payload starts aligned, the
    payload is the promised message exactly when it is separate and of the promised
    size, and the next capacity is a power of two that only grows, up to the cap, and
    fits a frame like this one where the cap allows."""
    assert INITIAL_CAPACITY <= capacity <= MAX_CAPACITY
    promised = {"none": 0, "kept": payload_len}.get(promise, promise)  # type: ignore[call-overload]
    plan = cut_frame(
        capacity, header_len, payload_len, host_payloads=host_payloads, promised=promised
    )
    assert (plan.capacity, plan.header_len, plan.payload_len) == (
        capacity,
        header_len,
        payload_len,
    )
    spans = first_message(plan)
    carried = sum(end - start for start, end, what in spans if what != "prefix")
    carried += sum(n for what, n in later_messages(plan) if what != "zeros")
    assert carried == header_len + payload_len
    assert all(0 <= start <= end <= capacity for start, end, _ in spans), spans
    ordered = sorted(spans)
    for (_, end, a), (start, _, b) in itertools.pairwise(ordered):
        assert end <= start, f"{a} and {b} overlap in {spans}"
    if plan.inline:
        assert host_payloads and plan.payload_at % PAYLOAD_ALIGN == 0
    assert plan.spill == (PREFIX_SIZE + header_len > capacity)
    assert plan.promised == promised
    assert plan.in_promise == (promised > 0 and not plan.inline and payload_len == promised)
    assert plan.separate_payload == (payload_len > 0 and not plan.inline and not plan.in_promise)
    # The receiver reads the cut from the flags: they say exactly what the sizes say.
    assert plan.flags == (
        (Flags.INLINE if plan.inline else 0)
        | (Flags.SPILL if plan.spill else 0)
        | (Flags.PROMISED if promised else 0)
    )
    assert (
        plan.inline
        == cut_frame(capacity, header_len, payload_len, host_payloads=host_payloads).inline
    )

    nxt = plan.next_capacity
    assert _is_pow2(nxt) and capacity <= nxt <= MAX_CAPACITY
    again = cut_frame(nxt, header_len, payload_len, host_payloads=host_payloads)
    if PREFIX_SIZE + header_len <= MAX_CAPACITY:
        assert not again.spill, "the next capacity fits this frame's header"
    if host_payloads and _align(PREFIX_SIZE + header_len) + _align(payload_len) <= MAX_CAPACITY:
        assert again.inline, "the next capacity fits this whole frame"
    assert again.next_capacity == nxt, "a frame like the last one asks for nothing more"
    # The prefix a sender writes for this plan is one a receiver accepts.
    data = bytearray(PREFIX_SIZE)
    if header_len <= MAX_HEADER_BYTES:
        write(Prefix(Kind.DATA, plan.flags, 1, 0, 0, header_len, payload_len, nxt), data)
        got = Prefix.unpack(data, capacity)
        assert (got.flags, got.header_len, got.payload_len, got.next_capacity) == (
            plan.flags,
            header_len,
            payload_len,
            nxt,
        )


# -- Prefix ------------------------------------------------------------------------------


def write(prefix: Prefix, data: bytearray) -> None:
    """``prefix`` packed into ``data`` by the one writer, ``Prefix.write``."""
    Prefix.write(data, *dataclasses.astuple(prefix))


def raw(**fields: Any) -> bytes:
    """A prefix's bytes with any field set to anything, valid or not."""
    values: dict[str, Any] = {
        "magic": b"TCFR",
        "version": FRAMES_VERSION,
        "kind": int(Kind.DATA),
        "flags": int(Flags.INLINE),
        "channel": 7,
        "pass_index": 1,
        "step": 2,
        "header_len": 10,
        "payload_len": 20,
        "next_capacity": INITIAL_CAPACITY,
        "crc": 0,
    }
    values.update(fields)
    return _frame._STRUCT.pack(*(values[f] for f in _frame.PREFIX_FIELDS))


def test_prefix_round_trip_keeps_large_sizes_exact() -> None:
    prefixes = [
        Prefix(Kind.DATA, Flags.INLINE, 7, 1, 2, 10, 20, INITIAL_CAPACITY),
        Prefix(Kind.DATA, Flags.SPILL | Flags.CRC, 2**32 - 1, 2**32 - 1, 2**64 - 1,
               MAX_HEADER_BYTES, (6 << 30) + 3, MAX_CAPACITY, 0xDEADBEEF),
        Prefix(Kind.END, Flags.INLINE, 0, 0, 5, 0, 0, 8192),
        Prefix(Kind.CLOSE, Flags.INLINE, 0, 3, 7, 0, 0, INITIAL_CAPACITY),
        Prefix(Kind.ERROR, Flags.NONE, 3, 4, 5, MAX_ERROR_BYTES, 0, INITIAL_CAPACITY),
    ]  # fmt: skip
    for prefix in prefixes:
        data = bytearray(INITIAL_CAPACITY)
        write(prefix, data)
        assert data[:4] == b"TCFR" and data[4] == FRAMES_VERSION
        assert not any(data[PREFIX_SIZE:]), "the prefix writes its own bytes only"
        got = Prefix.unpack(memoryview(data), INITIAL_CAPACITY)
        assert got == prefix
        assert type(got.kind) is Kind and type(got.flags) is Flags
    assert PREFIX_SIZE == _frame._STRUCT.size == len(raw())


@SETTINGS
@given(
    kind=st.sampled_from(Kind),
    flags=st.sampled_from([Flags(f) for f in range(16)]),
    channel=st.integers(0, 2**32 - 1),
    pass_index=st.integers(0, 2**32 - 1),
    step=st.integers(0, 2**64 - 1),
    header_len=st.integers(0, MAX_ERROR_BYTES),
    payload_len=st.integers(0, 2**64 - 1),
    capacity=capacities,
    grow=st.integers(0, 6),
    crc=st.integers(0, 2**32 - 1),
)
def test_prefix_unpack_inverts_write(
    kind: Kind,
    flags: Flags,
    channel: int,
    pass_index: int,
    step: int,
    header_len: int,
    payload_len: int,
    capacity: int,
    grow: int,
    crc: int,
) -> None:
    """``Prefix.unpack(write(p)) == p`` for every prefix a sender can write."""
    if kind != Kind.DATA:
        payload_len = 0
    if kind in (Kind.END, Kind.CLOSE):
        header_len = 0
    nxt = min(capacity << grow, MAX_CAPACITY)
    prefix = Prefix(kind, flags, channel, pass_index, step, header_len, payload_len, nxt, crc)
    data = bytearray(PREFIX_SIZE)
    write(prefix, data)
    assert Prefix.unpack(bytes(data), capacity) == prefix


@pytest.mark.parametrize(
    ("fields", "capacity", "match"),
    [
        ({"magic": b"TCST"}, INITIAL_CAPACITY, "not a tensorcast frame"),
        ({"magic": b"\x80\x04\x95\x00"}, INITIAL_CAPACITY, "magic"),  # a pickle, say
        ({"version": FRAMES_VERSION - 1}, INITIAL_CAPACITY, f"frames v{FRAMES_VERSION}"),
        ({"version": FRAMES_VERSION + 1}, INITIAL_CAPACITY, "same tensorcast version"),
        ({"kind": 0}, INITIAL_CAPACITY, "unknown frame kind 0"),
        ({"kind": 9}, INITIAL_CAPACITY, "known kinds"),
        ({"flags": 32}, INITIAL_CAPACITY, "unknown frame flags"),
        ({"flags": 0x8001}, INITIAL_CAPACITY, "unknown frame flags"),
        ({"header_len": MAX_HEADER_BYTES + 1}, INITIAL_CAPACITY, "over the"),
        ({"header_len": 2**32 - 1}, INITIAL_CAPACITY, "limit"),
        ({"next_capacity": INITIAL_CAPACITY // 2}, INITIAL_CAPACITY, "next capacity"),
        ({"next_capacity": 8192}, 16384, "invalid next capacity"),  # capacities never shrink
        ({"next_capacity": 2 * MAX_CAPACITY}, INITIAL_CAPACITY, "next capacity"),
        ({"next_capacity": 3 * INITIAL_CAPACITY}, INITIAL_CAPACITY, "next capacity"),
        ({"next_capacity": 0}, INITIAL_CAPACITY, "next capacity"),
        ({"kind": int(Kind.END), "payload_len": 0}, INITIAL_CAPACITY, "END frame with a"),
        ({"kind": int(Kind.END), "header_len": 0}, INITIAL_CAPACITY, "END frame with a"),
        ({"kind": int(Kind.CLOSE), "payload_len": 0}, INITIAL_CAPACITY, "CLOSE frame with a"),
        ({"kind": int(Kind.ERROR), "header_len": 3}, INITIAL_CAPACITY, "ERROR frame with a"),
        (
            {"kind": int(Kind.ERROR), "header_len": MAX_ERROR_BYTES + 1, "payload_len": 0},
            INITIAL_CAPACITY,
            "error message of",
        ),
    ],
)
def test_prefix_unpack_refuses_what_no_sender_writes(
    fields: dict[str, Any], capacity: int, match: str
) -> None:
    data = raw(**fields) + bytes(64)
    with pytest.raises(tc.HeaderError, match=match):
        Prefix.unpack(data, capacity)


def test_prefix_unpack_refuses_a_truncated_prefix() -> None:
    data = raw()
    for n in (0, 4, PREFIX_SIZE - 1):
        with pytest.raises(tc.HeaderError, match=f"{n} bytes has no frame prefix"):
            Prefix.unpack(data[:n], INITIAL_CAPACITY)
    assert Prefix.unpack(data, INITIAL_CAPACITY).step == 2


def test_the_valid_corners_are_accepted() -> None:
    assert Prefix.unpack(raw(next_capacity=MAX_CAPACITY), INITIAL_CAPACITY).next_capacity
    assert Prefix.unpack(raw(header_len=MAX_HEADER_BYTES), INITIAL_CAPACITY)
    error = raw(kind=int(Kind.ERROR), header_len=MAX_ERROR_BYTES, payload_len=0)
    assert Prefix.unpack(error, INITIAL_CAPACITY).kind == Kind.ERROR
    end = raw(kind=int(Kind.END), header_len=0, payload_len=0)
    assert Prefix.unpack(end, INITIAL_CAPACITY).kind == Kind.END


@SETTINGS
@given(data=st.binary(max_size=2 * PREFIX_SIZE), capacity=capacities)
def test_prefix_unpack_of_any_bytes_returns_or_raises_header_error(
    data: bytes, capacity: int
) -> None:
    """Arbitrary bytes (a lying or garbled first message) never raise anything else."""
    try:
        prefix = Prefix.unpack(data, capacity)
    except tc.HeaderError:
        return
    assert capacity <= prefix.next_capacity <= MAX_CAPACITY


@SETTINGS
@given(data=st.binary(min_size=PREFIX_SIZE - 4, max_size=PREFIX_SIZE - 4), capacity=capacities)
def test_prefix_unpack_of_any_fields_returns_or_raises_header_error(
    data: bytes, capacity: int
) -> None:
    """The same with the magic and version right, so the other checks are reached."""
    head = b"TCFR" + bytes([FRAMES_VERSION])
    try:
        prefix = Prefix.unpack(head + data[1:], capacity)
    except tc.HeaderError:
        return
    assert prefix.header_len <= MAX_HEADER_BYTES
    assert _is_pow2(prefix.next_capacity)
    if prefix.kind != Kind.DATA:
        assert prefix.payload_len == 0


def test_a_frame_of_a_batch_past_4_gib_carries_its_sizes_exact() -> None:
    """The frame of a batch over 4 GiB (its layout: ``tests/codec``, the same name): the
    prefix carries its sizes without truncation. Stride-0 tensors keep it from allocating
    anything."""
    plan = Encoder().encode(batch_past_4_gib())
    n = plan.nbytes
    assert n > 6 << 30
    capacity = INITIAL_CAPACITY
    cut = cut_frame(capacity, len(plan.header), n, host_payloads=True)
    prefix = Prefix(
        Kind.DATA, cut.flags, 1, 2, 3, len(plan.header), n,
        cut.next_capacity, 0xFFFFFFFF,
    )  # fmt: skip
    first = bytearray(capacity)
    write(prefix, first)
    assert Prefix.unpack(first, capacity) == prefix
    # ... and the plan sends the payload whole, in one message of its own after the first.
    assert cut.separate_payload and not cut.inline and cut.payload_len == n
    assert capacity <= cut.next_capacity <= MAX_CAPACITY


# -- the promise rule (NOTE [ Promised payloads ]): what a channel promises, given the
# frames before, as the source and every receiver apply it ---------------------------------

# Payload sizes: none, inline at the initial capacity, and three that travel alone.
SIZES = [0, 64, 100_000, 300_000, 1 << 20]


def promised_cuts(sizes: list[int], *, on: bool = True) -> list[Cut]:
    """The cuts of a channel's frames of these payload sizes, cut as a source cuts them."""
    promises, plans = Promises(on), []
    for n in sizes:
        plan = cut_frame(INITIAL_CAPACITY, 40, n, host_payloads=True, promised=promises.next())
        assert promises.record(plan) == promises.next()  # what the next frame promises
        plans.append(plan)
    return plans


def test_fixed_size_payloads_are_promised_from_the_third_frame() -> None:
    plans = promised_cuts([300_000] * 6)
    assert [p.promised for p in plans] == [0, 0] + [300_000] * 4
    assert all(p.in_promise and not p.separate_payload for p in plans[2:])


def test_inline_and_empty_payloads_are_never_promised() -> None:
    assert not any(p.promised for p in promised_cuts([64] * 5 + [0] * 5))


def test_the_switch_turns_promises_off() -> None:
    assert not any(p.promised for p in promised_cuts([300_000] * 5, on=False))


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False)])
def test_the_environment_switch(
    monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool
) -> None:
    if value is None:
        monkeypatch.delenv("TENSORCAST_PROMISES", raising=False)
    else:
        monkeypatch.setenv("TENSORCAST_PROMISES", value)
    assert _frame.promises_enabled() is on


def test_a_promise_not_kept_doubles_the_run_the_next_one_needs() -> None:
    a, b = 300_000, 200_000
    sizes = [a, a, b, *[b] * 4, a, *[a] * 8, 0]
    promised = [p.promised for p in promised_cuts(sizes)]
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
    plans = promised_cuts(sizes)
    assert [p.promised for p in plans] == _oracle(sizes)
    for p in plans:
        assert p.in_promise == (p.promised > 0 and not p.inline and p.payload_len == p.promised)
    broken = [i for i, p in enumerate(plans) if p.promised and not p.in_promise]
    assert all(sizes[i] != sizes[i - 1] for i in broken)
    for j, i in enumerate(broken[3:], start=3):
        assert i >= 16 and len(set(sizes[i - 16 : i])) == 1, (j, i, sizes)
