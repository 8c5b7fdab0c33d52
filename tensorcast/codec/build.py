"""The last step of unpacking: a header's tokens compiled into a program that builds the tree.

A structure is compiled once (validating every token) and its :class:`Program` run for
each batch of that structure, with that batch's buffer leaves and small values.
``_tree`` describes the tokens.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Sequence
from typing import Any

from tensorcast._errors import HeaderError
from tensorcast.codec import registry as _registry
from tensorcast.codec.paths import Path, render_path
from tensorcast.codec.values import decode_key

__all__ = ["Program", "compile_tokens", "run"]

_OrderedDict = collections.OrderedDict
_CONTAINER_TAGS = frozenset("ltdorx")

# A container step while compiling: (tag, extra, path, child references).
_Step = tuple[str, Any, Path, list[tuple[int, int]]]


class Program:
    """A compiled tree: how to rebuild it from its buffer leaves' values.

    A program depends on the tree's structure only: every batch of that structure runs
    it, with its own small values.

    ``run`` lays out one list of values: the buffer leaves, then the small values, then
    each container as it is built. Containers are built children first, each from its
    children's values picked out of that list by one ``itemgetter`` call, so rebuilding
    costs a few C calls per container, none per leaf.

    Attributes:
        steps: per container, children first: ``(tag, extra, path, pick, n)``; ``pick``
            is an ``itemgetter`` of the ``n`` children's places when ``n > 1``, the one
            child's place when ``n == 1``.
        root: the root's place.
        n_values: how many small values the tree holds.
    """

    __slots__ = ("n_values", "root", "steps")

    def __init__(self, steps: list[tuple[Any, ...]], root: int, n_values: int):
        self.steps = steps
        self.root = root
        self.n_values = n_values


def compile_tokens(
    tokens: Any, n_leaves: int, *, want_paths: bool = False
) -> tuple[Program, list[Path] | None]:
    """Validate ``tokens`` completely and compile them into a :class:`Program`.

    Returns:
        ``(program, paths)``, ``paths[i]`` the path of buffer leaf ``i`` when asked for.

    Raises:
        HeaderError: the tokens are not a valid tree for ``n_leaves`` buffer leaves.
    """
    if type(tokens) is not list or not tokens:
        raise HeaderError("the header's tree is missing or not a token list")
    used = bytearray(n_leaves)
    paths: list[Path] = [None] * n_leaves
    # A value is referenced as (0, leaf), (1, small value) or (2, container step) until
    # the number of small values is known; then as its place in run()'s list of values.
    n_values = 0
    steps: list[_Step] = []
    stack: list[_Frame] = []
    root: tuple[int, int] | None = None
    total = len(tokens)
    for i, tok in enumerate(tokens):
        if not stack and root is not None:
            raise HeaderError(f"trailing tokens after the root, at token {i}")
        path = _child_path(stack[-1]) if stack else None
        t = type(tok)
        if t is int:
            if not 0 <= tok < n_leaves or used[tok]:
                raise HeaderError(f"buffer leaf reference {tok} is out of range or repeated")
            used[tok] = 1
            paths[tok] = path
            ref = (0, tok)
        elif tok is None:
            ref = (1, n_values)
            n_values += 1
        elif t is list and tok and type(tok[0]) is str and tok[0] in _CONTAINER_TAGS:
            frame = _open(tok, total - i - 1, path)
            if frame.n:
                stack.append(frame)
                continue
            ref = (2, len(steps))
            steps.append((frame.tag, frame.extra, path, []))
        else:
            raise HeaderError(f"invalid token {tok!r:.80} at position {i}")
        # The value is complete: add it to its parent, closing every parent it completes.
        while stack:
            top = stack[-1]
            top.children.append(ref)
            if len(top.children) < top.n:
                break
            stack.pop()
            ref = (2, len(steps))
            steps.append((top.tag, top.extra, top.path, top.children))
        else:
            root = ref
    if stack or root is None:
        raise HeaderError("the header's tree is truncated: a container is missing children")
    return _link(steps, root, used, n_values), paths if want_paths else None


def _link(steps: list[_Step], root: tuple[int, int], used: bytearray, n_values: int) -> Program:
    """The program of ``steps``, once every buffer leaf is known to be ``used``: each
    reference made a place in run()'s list of values."""
    n_leaves = len(used)
    if n_leaves and not all(used):
        raise HeaderError("the header lists buffer leaves that the tree never references")
    base = (0, n_leaves, n_leaves + n_values)
    compiled = []
    for tag, extra, path, children in steps:
        places = [base[kind] + k for kind, k in children]
        pick: Any = (
            operator.itemgetter(*places) if len(places) > 1 else places[0] if places else None
        )
        compiled.append((tag, extra, path, pick, len(places)))
    return Program(compiled, base[root[0]] + root[1], n_values)


def run(program: Program, leaf_values: Sequence[Any], small_values: Sequence[Any]) -> Any:
    """Rebuild a tree from a compiled program, the buffer leaves' values and the small
    values (as ``decode_values`` returns them; their count is the program's)."""
    values = [*leaf_values, *small_values]
    add = values.append
    for tag, extra, path, pick, n in program.steps:
        items = pick(values) if n > 1 else (values[pick],) if n else ()
        if tag == "d":
            add(dict(zip(extra, items)))
        elif tag == "l":
            add(list(items))
        elif tag == "t":
            add(items)
        elif tag == "o":
            add(_OrderedDict(zip(extra, items)))
        else:
            add(_make(tag, list(items), extra, path))
    return values[program.root]


class _Frame:
    """An open container while compiling."""

    __slots__ = ("children", "extra", "n", "path", "tag")

    def __init__(self, tag: str, n: int, extra: Any, path: Path):
        self.tag = tag
        self.n = n
        self.extra = extra
        self.path = path
        self.children: list[tuple[int, int]] = []  # value references, see compile_tokens


def _child_path(frame: _Frame) -> Any:
    """(parent, key, style, depth): the depth keeps ``render_path`` bounded per leaf."""
    i = len(frame.children)
    tag = frame.tag
    parent = frame.path
    depth = parent[3] + 1 if parent is not None else 1
    if tag == "d" or tag == "o":
        return (parent, frame.extra[i], 0, depth)
    if tag == "r":
        return (parent, frame.extra.fields[i], 1, depth)
    if tag == "x":
        return (parent, frame.extra.name, 2, depth)
    return (parent, i, 0, depth)


def _open(tok: list[Any], remaining: int, path: Path) -> _Frame:
    tag = tok[0]
    if tag == "l" or tag == "t":
        if len(tok) != 2 or type(tok[1]) is not int or not 0 <= tok[1] <= remaining:
            raise HeaderError(f"invalid container token {tok!r:.80}")
        return _Frame(tag, tok[1], None, path)
    if tag == "d" or tag == "o":
        if (
            len(tok) != 3
            or type(tok[1]) is not int
            or not 0 <= tok[1] <= remaining
            or type(tok[2]) is not list
            or len(tok[2]) != tok[1]
        ):
            raise HeaderError(f"invalid dict token {tok!r:.80}")
        keys = tuple(decode_key(k) for k in tok[2])
        if len(dict.fromkeys(keys)) != len(keys):
            raise HeaderError(f"duplicate dict keys in {tok[2]!r:.120}")
        return _Frame(tag, tok[1], keys, path)
    if tag == "r":
        if len(tok) != 3 or type(tok[1]) is not str or type(tok[2]) is not list:
            raise HeaderError(f"invalid registered-type token {tok!r:.80}")
        entry = _registry.by_name(tok[1])
        if entry is None or entry.kind == "codec":
            raise HeaderError(
                f"the header holds a `{tok[1]}` container but no such type is registered "
                f"on this rank; call tensorcast.register_type on every rank"
            )
        if tuple(tok[2]) != entry.fields:
            raise HeaderError(
                f"registered type `{entry.name}` has fields {list(entry.fields)} on this rank "
                f"but {tok[2]!r:.200} on the sender; register the same definition everywhere"
            )
        return _Frame(tag, len(entry.fields), entry, path)
    if tag == "x":
        if len(tok) != 2 or type(tok[1]) is not str:
            raise HeaderError(f"invalid codec token {tok!r:.80}")
        entry = _registry.by_name(tok[1])
        if entry is None or entry.kind != "codec":
            raise HeaderError(f"the header holds a `{tok[1]}` object but no codec for it exists")
        return _Frame(tag, 1, entry, path)
    raise HeaderError(f"invalid token {tok!r:.80}")


def _make(tag: str, items: list[Any], extra: Any, path: Path) -> Any:
    if tag == "l":
        return items
    if tag == "t":
        return tuple(items)
    if tag == "d":
        return dict(zip(extra, items))
    if tag == "o":
        return _OrderedDict(zip(extra, items))
    try:
        if tag == "x":
            return extra.from_tree(items[0])
        if extra.kind == "namedtuple":
            return extra.cls._make(items)
        values = dict(zip(extra.fields, items))
        obj = extra.cls(**{k: v for k, v in values.items() if k in extra.init_fields})
        for k, v in values.items():
            if k not in extra.init_fields:
                object.__setattr__(obj, k, v)
        return obj
    except HeaderError:
        raise
    except Exception as e:
        raise HeaderError(
            f"cannot rebuild `{extra.name}` at `{render_path(path, 'batch')}`: "
            f"{type(e).__name__}: {e}"
        ) from e
