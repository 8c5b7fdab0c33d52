"""Fuzz the header decoder: ``read_header`` and ``unpack`` must only succeed or raise
``HeaderError``, whatever bytes arrive.

A seeded mutator (stdlib ``random``, reproducible with ``--seed``) starts from valid
headers packed from assorted batches, plus the attack corpus in ``tests/codec/attacks`` when
present, and applies byte-level mutations (bit flips, interesting bytes, truncation,
insertion, deletion, splicing two headers), prefix mutations (version, flags, length)
and JSON-level mutations of the body (replace, drop, duplicate or swap a node; the
prefix's length is fixed up so the mutation reaches the validator). A share of inputs are
plain random bytes.

    python benchmarks/fuzz_header.py --seconds 60 --seed 1 --json fuzz.json

Exit status 1 when any exception other than ``HeaderError`` escaped; the first few are
printed with the input in hex.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import random
import resource
import struct
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

import tensorcast as tc

PREFIX = struct.Struct("<4sHHI")
INTERESTING_INTS = [
    0, 1, -1, 2, 3, 7, 8, 63, 64, 65, 255, 256, 4096, 65535, 65536, 2**31 - 1, 2**31,
    2**32 - 1, 2**32, 2**44, 2**44 + 1, 2**53, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63),
    10**30,
]  # fmt: skip
INTERESTING_BYTES = [0x00, 0x01, 0x7F, 0x80, 0xFF, ord("["), ord("]"), ord('"'), ord(","), ord("-")]
WORDS = ["tensor", "ndarray", "bytes", "str", "F32", "U8", "BF16", "F8_E4M3", "C128", "BOOL",
         "l", "t", "d", "o", "r", "x", "i", "I", "f", "c", "y", "s", "S", "U", "fuzz.Point",
         "lhotse.Evil", ""]  # fmt: skip
MAX_BUFFER = 1 << 20  # never allocate more than this for one input


class FuzzPoint(NamedTuple):
    x: Any
    y: Any


def seed_headers() -> list[bytes]:
    """Valid headers of assorted batches: every kind of leaf and container."""
    tc.register_type(FuzzPoint, name="fuzz.Point")
    trees: list[Any] = [
        None,
        {"x": torch.arange(4, dtype=torch.float32)},
        {
            "ids": torch.arange(6, dtype=torch.int16).reshape(2, 3),
            "mask": torch.ones(3, dtype=torch.bool),
        },
        [np.arange(5, dtype=np.float64), np.zeros((2, 0), dtype=np.int8), b"b" * 1100, "s" * 1100],
        {2: 2**80, None: -0.0, True: complex(1, -2), "n": np.float32(1.5), "u": np.str_("z")},
        [FuzzPoint(torch.zeros(2, dtype=torch.bfloat16), (1, "a")), FuzzPoint(None, [b"\x00"])],
        collections.OrderedDict(
            [("b", [[], (), {}]), ("a", torch.zeros((), dtype=torch.complex64))]
        ),
        [[[[torch.ones(1, dtype=torch.float8_e4m3fn)]]]],
    ]
    out = [tc.pack(t, align=a).header for t in trees for a in (1, 64)]
    return out


def corpus_headers() -> list[bytes]:
    folder = Path(__file__).resolve().parent.parent / "tests" / "codec" / "attacks"
    return [p.read_bytes() for p in sorted(folder.glob("*.bin")) if p.stat().st_size < 4096]


def frame(body: bytes, version: int = tc.FORMAT_VERSION, flags: int = 0) -> bytes:
    return PREFIX.pack(b"TCST", version, flags, len(body)) + body


def random_json(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 3 or roll < 0.55:
        choice = rng.randrange(6)
        if choice == 0:
            return rng.choice(INTERESTING_INTS)
        if choice == 1:
            return rng.choice(WORDS)
        if choice == 2:
            return rng.choice([None, True, False, 0.5, -0.0, 1e308])
        if choice == 3:
            return rng.randrange(-4, 200)
        if choice == 4:
            return "".join(
                rng.choice("0123456789abcdefxyz\u00e9\ud800") for _ in range(rng.randrange(6))
            )
        return [rng.choice(WORDS), rng.choice(INTERESTING_INTS)]
    if roll < 0.9:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {rng.choice(WORDS): random_json(rng, depth + 1) for _ in range(rng.randrange(3))}


def _nodes(body: Any) -> list[tuple[list[Any], int]]:
    """Every (parent list, index) slot of a parsed JSON body, found without recursion."""
    slots: list[tuple[list[Any], int]] = []
    stack = [body]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            for i, child in enumerate(node):
                slots.append((node, i))
                stack.append(child)
    return slots


def mutate_json(rng: random.Random, data: bytes) -> bytes | None:
    try:
        body = json.loads(data[PREFIX.size :].decode("ascii"))
    except (ValueError, RecursionError):
        return None
    slots = _nodes(body)
    if not slots:
        return None
    for _ in range(rng.randrange(1, 4)):
        parent, i = rng.choice(slots)
        if i >= len(parent):
            continue
        op = rng.randrange(6)
        if op == 0:
            parent[i] = random_json(rng)
        elif op == 1:
            del parent[i]
        elif op == 2:
            parent.insert(i, parent[i])
        elif op == 3 and isinstance(parent[i], int) and not isinstance(parent[i], bool):
            parent[i] = rng.choice([parent[i] + rng.choice([-1, 1]), -parent[i], parent[i] * 2**32])
        elif op == 4:
            j = rng.randrange(len(parent))
            parent[i], parent[j] = parent[j], parent[i]
        else:
            parent[i] = rng.choice(INTERESTING_INTS)
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=rng.random() < 0.95)
    return frame(text.encode("utf-8", "surrogatepass"))


def mutate_bytes(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randrange(1, 5)):
        op = rng.randrange(8)
        if op == 0 and buf:  # flip bits
            for _ in range(rng.randrange(1, 9)):
                p = rng.randrange(len(buf) * 8)
                buf[p // 8] ^= 1 << (p % 8)
        elif op == 1 and buf:
            buf[rng.randrange(len(buf))] = rng.choice(INTERESTING_BYTES)
        elif op == 2:  # truncate
            del buf[rng.randrange(len(buf) + 1) :]
        elif op == 3:  # insert
            at = rng.randrange(len(buf) + 1)
            buf[at:at] = rng.randbytes(rng.randrange(1, 16))
        elif op == 4 and buf:  # delete a range
            at = rng.randrange(len(buf))
            del buf[at : at + rng.randrange(1, 32)]
        elif op == 5:  # splice with another header
            other = rng.choice(pool)
            at, cut = rng.randrange(len(buf) + 1), rng.randrange(len(other) + 1)
            buf = buf[:at] + other[cut:]
        elif op == 6 and len(buf) >= PREFIX.size:  # prefix field
            field = rng.randrange(3)
            value = rng.choice(
                [0, 1, 2, 0xFFFF, 0xFFFFFFFF, len(buf) - PREFIX.size + rng.randrange(-2, 3)]
            )
            if field == 0:
                struct.pack_into("<H", buf, 4, value & 0xFFFF)
            elif field == 1:
                struct.pack_into("<H", buf, 6, value & 0xFFFF)
            else:
                struct.pack_into("<I", buf, 8, value & 0xFFFFFFFF)
        elif op == 7 and len(buf) >= PREFIX.size:  # fix up the length
            struct.pack_into("<I", buf, 8, len(buf) - PREFIX.size)
    return bytes(buf)


def next_input(rng: random.Random, pool: list[bytes]) -> bytes:
    roll = rng.random()
    if roll < 0.05:
        return rng.randbytes(rng.randrange(64))
    if roll < 0.10:
        return frame(rng.randbytes(rng.randrange(64)))
    base = rng.choice(pool)
    if roll < 0.55:
        mutated = mutate_json(rng, base)
        if mutated is not None:
            return mutated
    return mutate_bytes(rng, base, pool)


def buffer_for(data: bytes) -> torch.Tensor:
    """A buffer of the size the header claims, when that is small; else a tiny one."""
    try:
        n = tc.read_header(data).nbytes
    except tc.HeaderError:
        n = 16
    return torch.full((n if n <= MAX_BUFFER else 16,), 0xFF, dtype=torch.uint8)


def run_one(data: bytes) -> str:
    """ "accepted" or "rejected"; any other exception propagates."""
    try:
        tc.read_header(data)
        verdict = "accepted"
    except tc.HeaderError:
        verdict = "rejected"
    with contextlib.suppress(tc.HeaderError):
        tc.unpack(data, buffer_for(data))
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to fuzz")
    parser.add_argument("--seed", type=int, default=0, help="random seed (reproducible runs)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--show", type=int, default=5, help="escaped exceptions to print")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    pool = seed_headers() + corpus_headers()
    stats = collections.Counter[str]()
    escaped: list[dict[str, str]] = []
    escaped_types = collections.Counter[str]()
    slowest, slowest_hex = 0.0, ""
    start = time.perf_counter()
    deadline = start + args.seconds
    while time.perf_counter() < deadline:
        data = next_input(rng, pool)
        t0 = time.perf_counter()
        try:
            stats[run_one(data)] += 1
        except Exception as e:  # the point of the fuzzer: anything but HeaderError is a finding
            stats["other"] += 1
            escaped_types[type(e).__name__] += 1
            if len(escaped) < args.show:
                escaped.append({
                    "exception": f"{type(e).__name__}: {str(e)[:300]}",
                    "where": traceback.extract_tb(e.__traceback__)[-1].name,
                    "input_hex": data[:2048].hex(),
                    "input_len": str(len(data)),
                })  # fmt: skip
        dt = time.perf_counter() - t0
        if dt > slowest:
            slowest, slowest_hex = dt, data[:256].hex()
        stats["inputs"] += 1
        # Keep some accepted headers as new seeds: they reach deeper checks.
        if stats["inputs"] % 97 == 0 and len(pool) < 4000:
            pool.append(data)

    report = {
        "seed": args.seed,
        "seconds": round(time.perf_counter() - start, 1),
        "inputs": stats["inputs"],
        "accepted": stats["accepted"],
        "rejected_header_error": stats["rejected"],
        "other_exceptions": stats["other"],
        "other_exception_types": dict(escaped_types),
        "max_seconds_per_input": round(slowest, 4),
        "slowest_input_hex_prefix": slowest_hex,
        # ru_maxrss is KiB on Linux, bytes on macOS.
        "peak_rss_mib": round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            / (1 << 20 if sys.platform == "darwin" else 1 << 10),
            1,
        ),
        "first_escaped": escaped,
    }
    for key in ("seed", "seconds", "inputs", "accepted", "rejected_header_error", "other_exceptions",
                "other_exception_types", "max_seconds_per_input", "peak_rss_mib"):  # fmt: skip
        print(f"{key:>24}: {report[key]}")
    for item in escaped:
        print(f"\n{item['exception']} (in {item['where']}), input of {item['input_len']} bytes:")
        print(item["input_hex"])
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if stats["other"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
