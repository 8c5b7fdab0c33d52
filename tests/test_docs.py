"""Every fenced ``python`` block of README.md and docs/*.md runs, as a reader would run it.

A block is marked by an HTML comment on the line right before its fence:

- no mark: the block runs alone, in a fresh namespace, with warnings as errors. One
  subprocess runs every such block (each in a module of its own), so the interpreter
  starts once;
- ``<!-- doc-test: ranks=N -->``: on N gloo ranks of the shared rank pool (N = 2, 4 or 8),
  after ``init_process_group``, with warnings as errors;
- ``<!-- doc-test: torchrun=N -->``: a whole script, under
  ``torchrun --standalone --nproc_per_node N``;
- ``<!-- doc-test: skip (the reason) -->``: not run; a skip without a reason is an error.

A block whose top-level imports name lhotse or Lightning is skipped where that package is
not installed.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
import traceback
import types
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from subprocs import LAUNCHER_ENV, run_killable

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT = 180.0
OPTIONAL = (
    "lhotse",
    "lightning",
    "torchdata",
)  # extras: a block that imports one needs it installed
_FENCE = re.compile(r"^```python\s*$")
_MARK = re.compile(r"^<!--\s*doc-test:\s*(?P<body>.*?)\s*-->\s*$")
_RANKS = re.compile(r"^(?P<kind>ranks|torchrun)=(?P<n>\d+)$")
_SKIP = re.compile(r"^skip\s*\((?P<reason>.*\S.*)\)$")


@dataclass(frozen=True)
class Block:
    """One fenced python block: where it is, how to run it, its code."""

    name: str  # "docs/guide.md:42", the fence's line
    kind: str  # "plain", "ranks", "torchrun" or "skip"
    ranks: int
    reason: str
    code: str


def _parse_mark(body: str, where: str) -> tuple[str, int, str]:
    if m := _RANKS.match(body):
        return m["kind"], int(m["n"]), ""
    if m := _SKIP.match(body):
        return "skip", 0, m["reason"].strip()
    raise ValueError(
        f"{where}: unknown doc-test mark {body!r}; use ranks=N, torchrun=N or skip (reason)"
    )


def collect(path: Path) -> list[Block]:
    """The python blocks of one Markdown file, with their marks.

    Raises:
        ValueError: a mark that is unknown, or that no python fence follows.
    """
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        mark = _MARK.match(line)
        if mark and not (i + 1 < len(lines) and _FENCE.match(lines[i + 1])):
            raise ValueError(f"{rel}:{i + 1}: a doc-test mark must sit right before a python fence")
        if _FENCE.match(line):
            start = i + 1
            end = start
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if end == len(lines):
                raise ValueError(f"{rel}:{i + 1}: the python block is never closed")
            kind, ranks, reason = "plain", 0, ""
            prev = _MARK.match(lines[i - 1]) if i else None
            if prev:
                kind, ranks, reason = _parse_mark(prev["body"], f"{rel}:{i}")
            code = "\n".join(lines[start:end]) + "\n"
            blocks.append(Block(f"{rel}:{i + 1}", kind, ranks, reason, code))
            i = end
        i += 1
    return blocks


BLOCKS = [block for path in DOCS for block in collect(path)]


def _needs(code: str) -> list[str]:
    return [
        pkg for pkg in OPTIONAL if re.search(rf"^(import|from)\s+{pkg}\b", code, flags=re.MULTILINE)
    ]


def _skip_without_extras(block: Block) -> None:
    for pkg in _needs(block.code):
        pytest.importorskip(pkg, reason=f"{block.name} needs {pkg}")


def _module_name(name: str) -> str:
    return "doc_block_" + re.sub(r"\W", "_", name)


def run_code(name: str, code: str) -> None:
    """Run one block in a module of its own, with warnings as errors."""
    module = types.ModuleType(_module_name(name))
    sys.modules[module.__name__] = module  # so its classes pickle and register by name
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            exec(compile(code, name, "exec"), module.__dict__)
    finally:
        sys.modules.pop(module.__name__, None)


def _rank_block(rank: int, world: int, name: str, code: str) -> None:
    run_code(name, code)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    return env


def _run(args: list[str], cwd: Path) -> tuple[int, str]:
    return run_killable(args, cwd, _env(), TIMEOUT)


_PLAIN_RUNNER = f"""
import json, sys, traceback
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from test_docs import run_code
blocks = json.load(open(sys.argv[1]))
results = {{}}
for name, code in blocks:
    try:
        run_code(name, code)
        results[name] = None
    except BaseException:
        results[name] = traceback.format_exc()
json.dump(results, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="session")
def plain_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """Every runnable plain block, run once in one subprocess: its traceback or None."""
    tmp = tmp_path_factory.mktemp("doc-blocks")
    runnable = []
    for b in BLOCKS:
        if b.kind == "plain" and all(_importable(p) for p in _needs(b.code)):
            runnable.append((b.name, b.code))
    (tmp / "blocks.json").write_text(json.dumps(runnable))
    rc, out = _run(
        [sys.executable, "-c", _PLAIN_RUNNER, str(tmp / "blocks.json"), str(tmp / "out.json")],
        tmp,
    )
    assert rc == 0, f"the plain-block runner exited with {rc}:\n{out[-6000:]}"
    results: dict[str, str | None] = json.loads((tmp / "out.json").read_text())
    return results


def _importable(pkg: str) -> bool:
    try:
        __import__(pkg)
    except ImportError:
        return False
    return True


def _param(block: Block) -> Any:
    marks = [pytest.mark.dist] if block.kind in ("ranks", "torchrun") else []
    return pytest.param(block, id=block.name, marks=marks)


def test_the_docs_have_blocks_and_every_mark_is_valid() -> None:
    assert {b.name.split(":")[0] for b in BLOCKS} >= {"README.md", "docs/guide.md"}
    for block in BLOCKS:
        if block.kind in ("ranks", "torchrun"):
            assert block.ranks >= 2, f"{block.name}: a multi-rank block needs 2 ranks or more"
        if block.kind == "ranks":
            assert block.ranks in (2, 4, 8), f"{block.name}: the rank pools have 2, 4 or 8 ranks"


def test_a_mark_without_a_reason_or_fence_is_refused(tmp_path: Path) -> None:
    bad = {
        "<!-- doc-test: skip -->\n```python\npass\n```\n": "unknown doc-test mark",
        "<!-- doc-test: skip () -->\n```python\npass\n```\n": "unknown doc-test mark",
        "<!-- doc-test: ranks=2 -->\n\n```python\npass\n```\n": "right before a python fence",
        "```python\npass\n": "never closed",
    }
    for i, (text, error) in enumerate(bad.items()):
        doc = tmp_path / f"bad-{i}.md"
        doc.write_text(text)
        with pytest.raises(ValueError, match=error):
            collect(doc)


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_doc_block(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if block.kind == "skip":
        pytest.skip(f"{block.name}: {block.reason}")
    _skip_without_extras(block)
    if block.kind == "plain":
        error = request.getfixturevalue("plain_results")[block.name]
        assert error is None, f"{block.name} failed:\n{block.code}\n{error}"
    elif block.kind == "ranks":
        pool = request.getfixturevalue(f"pool{block.ranks}")
        pool.run(_rank_block, block.name, block.code, timeout=TIMEOUT)
    else:
        script = tmp_path / (_module_name(block.name) + ".py")
        script.write_text(block.code)
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        args = [torchrun, "--standalone", "--nproc_per_node", str(block.ranks), str(script)]
        rc, out = _run(args, tmp_path)
        assert rc == 0, (
            f"{block.name} exited with {rc} under torchrun:\n{block.code}\n{out[-6000:]}"
        )


def test_run_code_reports_the_block_and_line() -> None:
    with pytest.raises(ZeroDivisionError) as info:
        run_code("docs/x.md:7", "a = 1\nb = a / 0\n")
    frames = traceback.extract_tb(info.value.__traceback__)
    assert (frames[-1].filename, frames[-1].lineno) == ("docs/x.md:7", 2)


# -- the README's API table, from the signatures ---------------------------------------------

_CALL = re.compile(r"`((?:tc|loader)\.\w+)\(([^`]*)\)`")


def rendered(fn: Any) -> str:
    """A signature as the README writes it: no annotations, ``*`` before keyword-only
    parameters, defaults in double quotes, no ``self`` and no ``/``."""
    out: list[str] = []
    star = False
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        text = p.name if p.default is p.empty else f"{p.name}={p.default!r}"
        out.append(text.replace("'", '"'))
    return ", ".join(out)


def _api_rows() -> dict[str, list[str]]:
    """The README API table's calls: by name, the parameter lists written there."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("## API", 1)[1].split("\n## ", 1)[0]
    calls: dict[str, list[str]] = {}
    for line in table.splitlines():
        cell = line.split(" | ")[0]
        for name, params in _CALL.findall(cell):
            calls.setdefault(name, []).append(params)
    return calls


def test_the_readme_api_table_says_what_the_signatures_say() -> None:
    import tensorcast as tc

    calls = _api_rows()
    public = {n for n in tc.__all__ if callable(getattr(tc, n)) and n[0].islower()}
    assert {n.removeprefix("tc.") for n in calls if n.startswith("tc.")} >= public | {
        "BroadcastingDataLoader"
    }
    for name, written in calls.items():
        owner, attr = name.split(".")
        fn = getattr(tc if owner == "tc" else tc.BroadcastingDataLoader, attr)
        forms = [rendered(f) for f in typing.get_overloads(fn)] or [rendered(fn)]
        assert written == forms, f"README's {name}: {written} != the code's {forms}"
    version = re.search(r"`tc.FORMAT_VERSION` \| [^|]*\((\d+)\)", (ROOT / "README.md").read_text())
    assert version is not None and int(version[1]) == tc.FORMAT_VERSION


def test_the_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 220
