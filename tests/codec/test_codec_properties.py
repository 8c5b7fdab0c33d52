"""Property tests of the codec: each test states the law it checks."""

from __future__ import annotations

import dataclasses
import struct
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import assert_same, is_view_into, tensors_of

import tensorcast as tc
from tensorcast.codec import flatten as _flatten
from tensorcast.codec import schema as _schema
from tensorcast.codec.dtypes import NUMPY_CODES, TORCH_CODES
from tensorcast.codec.encode import Encoder, encode
from tensorcast.codec.flatten import INLINE_LIMIT

SETTINGS = settings(deadline=None, print_blob=True, max_examples=150)


class PropPair(NamedTuple):
    first: Any
    second: Any


@dataclasses.dataclass
class PropRecord:
    data: Any
    note: Any = None


tc.register_type(PropPair, name="tests.properties.PropPair")
tc.register_type(PropRecord, name="tests.properties.PropRecord")

# --------------------------------------------------------------------------- strategies

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """A tensor of any table dtype holding arbitrary bit patterns, maybe non-contiguous."""
    code = draw(st.sampled_from(sorted(TORCH_CODES)))
    dtype = TORCH_CODES[code]
    shape = draw(shapes)
    layout = draw(st.sampled_from(["contiguous", "transposed", "stepped"]))
    if layout == "stepped":
        shape = [*shape[:-1], 2 * shape[-1]] if shape else [2]
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
    # bool bytes other than 0 / 1 included: masks made with .view(torch.bool) hold them
    t = torch.frombuffer(bytearray(raw) or bytearray(1), dtype=torch.uint8)[: len(raw)]
    t = t.view(dtype).reshape(shape)
    if layout == "transposed" and t.dim() >= 2:
        t = t.transpose(0, -1)
    elif layout == "stepped":
        t = t[..., ::2]
    return t


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    """An ndarray of any table dtype holding arbitrary bit patterns, maybe non-contiguous."""
    code = draw(st.sampled_from(sorted(NUMPY_CODES)))
    dtype = NUMPY_CODES[code]
    shape = draw(shapes)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    a = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if draw(st.booleans()) and a.ndim >= 2:
        a = a.T
    return a


def _bits_to_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


any_float = st.one_of(st.floats(), st.integers(0, 2**64 - 1).map(_bits_to_float))
any_text = st.text(st.characters(blacklist_categories=()), max_size=20)
long_text = st.builds(lambda s, n: (s or "x") * n, any_text, st.integers(1, 600))
long_bytes = st.builds(lambda b, n: (b or b"y") * n, st.binary(max_size=8), st.integers(100, 700))


@st.composite
def numpy_scalars(draw: st.DrawFn) -> np.generic:
    kind = draw(st.sampled_from(["number", "str", "bytes"]))
    if kind == "str":
        return np.str_(draw(st.text(max_size=8)))
    if kind == "bytes":
        return np.bytes_(draw(st.binary(max_size=8)))
    dtype = NUMPY_CODES[draw(st.sampled_from(sorted(NUMPY_CODES)))]
    raw = draw(st.binary(min_size=dtype.itemsize, max_size=dtype.itemsize))
    if dtype == np.bool_:
        raw = bytes(b & 1 for b in raw)
    return np.frombuffer(raw, dtype=dtype)[0]


small_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    any_float,
    st.builds(complex, any_float, any_float),
    any_text,
    st.binary(max_size=20),
    long_text,
    long_bytes,
    numpy_scalars(),
)
leaves = st.one_of(tensors(), arrays(), small_leaves)
keys = st.one_of(st.text(max_size=6), st.integers(), st.booleans(), st.none())


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(keys, children, max_size=4).map(lambda d: OrderedDict(d.items())),
        st.builds(PropPair, children, children),
        st.builds(PropRecord, children, children),
    )


trees = st.recursive(leaves, _containers, max_leaves=12)
aligns = st.sampled_from([2**k for k in range(13)])

# --------------------------------------------------------------------------- expected leaves


def _buffer_leaves(tree: Any) -> list[tuple[str, str, str, tuple[int, ...], int]]:
    """``(path, kind, dtype, shape, nbytes)`` of every buffer leaf, in preorder."""
    out: list[tuple[str, str, str, tuple[int, ...], int]] = []
    stack: list[tuple[Any, str]] = [(tree, "")]
    while stack:
        obj, path = stack.pop()
        if type(obj) is torch.Tensor:
            code = next(c for c, d in TORCH_CODES.items() if d == obj.dtype)
            out.append((path, "tensor", code, tuple(obj.shape), obj.numel() * obj.element_size()))
        elif type(obj) is np.ndarray:
            code = next(c for c, d in NUMPY_CODES.items() if d == obj.dtype)
            out.append((path, "ndarray", code, obj.shape, obj.nbytes))
        elif type(obj) is str and len(obj) > INLINE_LIMIT:
            n = len(obj.encode("utf-8", "surrogatepass"))
            out.append((path, "str", "U8", (n,), n))
        elif type(obj) is bytes and len(obj) > INLINE_LIMIT:
            out.append((path, "bytes", "U8", (len(obj),), len(obj)))
        elif type(obj) in (dict, OrderedDict):
            stack.extend((v, f"{path}[{k!r}]") for k, v in reversed(obj.items()))
        elif type(obj) in (PropPair, PropRecord):
            names = (
                [f.name for f in dataclasses.fields(obj)]
                if type(obj) is PropRecord
                else list(PropPair._fields)
            )
            stack.extend((getattr(obj, n), f"{path}.{n}") for n in reversed(names))
        elif type(obj) in (list, tuple):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(obj))))
    return out


# --------------------------------------------------------------------------- laws


@SETTINGS
@given(trees, aligns)
def test_unpack_inverts_pack_bit_for_bit(tree: Any, align: int) -> None:
    """``unpack(pack(t)) == t``: same types, structure and key order; tensors, arrays and
    floats bit for bit (NaN payloads, -0.0); non-contiguous tensors arrive contiguous."""
    out = tc.unpack(tc.pack(tree, align=align))
    assert_same(out, tree)
    for t in tensors_of(out):
        assert t.is_contiguous()


@SETTINGS
@given(trees, aligns)
def test_every_offset_is_aligned(tree: Any, align: int) -> None:
    """Every buffer leaf's offset is a multiple of ``align`` (and of its item size)."""
    schema = tc.read_header(tc.pack(tree, align=align).header)
    assert schema.align == align
    for leaf in schema.leaves:
        assert leaf.offset % align == 0, leaf
        itemsize = max(1, leaf.nbytes // max(1, int(np.prod(leaf.shape, dtype=np.int64))))
        assert leaf.offset % itemsize == 0, leaf


@SETTINGS
@given(trees)
def test_tensor_leaves_are_views_into_the_buffer(tree: Any) -> None:
    """Every tensor leaf ``unpack`` returns lives inside the packed buffer (no copy)."""
    packed = tc.pack(tree)
    for t in tensors_of(tc.unpack(packed)):
        if t.numel():
            assert is_view_into(t, packed)


@SETTINGS
@given(trees, aligns)
def test_read_header_describes_exactly_the_buffer_leaves(tree: Any, align: int) -> None:
    """``read_header(pack(t).header)`` lists exactly t's buffer leaves in preorder, with
    their paths, kinds, dtypes, shapes and byte sizes; the leaves are in increasing,
    non-overlapping order and fit in the buffer, whose size the schema states."""
    packed = tc.pack(tree, align=align)
    schema = tc.read_header(packed.header)
    got = [(x.path, x.kind, x.dtype, x.shape, x.nbytes) for x in schema.leaves]
    assert got == _buffer_leaves(tree)
    assert schema.nbytes == packed.nbytes
    assert schema.version == tc.FORMAT_VERSION
    assert sum(x.nbytes for x in schema.leaves) <= packed.nbytes
    end = 0
    for x in schema.leaves:
        assert x.offset >= end
        end = x.offset + x.nbytes
    assert end == packed.nbytes


@SETTINGS
@given(trees, aligns)
def test_header_is_deterministic(tree: Any, align: int) -> None:
    """Packing the same tree twice gives the same header bytes."""
    assert tc.pack(tree, align=align).header == tc.pack(tree, align=align).header


@SETTINGS
@given(trees, aligns)
def test_buffer_is_deterministic(tree: Any, align: int) -> None:
    """Packing the same tree twice gives the same buffer bytes, padding included: the
    padding between leaves is zeros, never leftover memory of the sending process."""
    first = tc.pack(tree, align=align).buffer.clone()
    # Fill freed memory with a pattern, so uninitialised padding cannot look like zeros.
    junk = [torch.full((n,), 0xA5, dtype=torch.uint8) for n in (64, 256, 4096, first.numel() + 64)]
    del junk
    second = tc.pack(tree, align=align).buffer
    assert bytes(first.numpy()) == bytes(second.numpy())


def _swap_leaves(tree: Any) -> Any:
    """A tree like ``tree`` but with bools and ints traded places: the shape of change
    that ``==`` on token lists cannot see (``True == 1``)."""
    if isinstance(tree, list):
        return [_swap_leaves(x) for x in reversed(tree)]
    if type(tree) is dict:
        return {(not k if type(k) is bool else k): _swap_leaves(v) for k, v in tree.items()}
    return tree


@SETTINGS
@given(trees, trees)
def test_reusing_a_previous_layout_never_changes_the_header(first: Any, second: Any) -> None:
    """Law: an encoder that encoded ``a`` encodes ``b`` to encode(b)'s header, for any a, b.

    The sender's encoder skips laying a batch out when it repeats the previous one's
    structure, and encoding its header when it repeats its small values too; those
    shortcuts must be invisible on the wire.
    """
    for a, b in (
        (first, second),
        (first, first),
        (first, _swap_leaves(first)),
        ([True, torch.ones(1)], [torch.ones(1), True]),
        ({1: 0}, {True: 0}),
    ):
        encoder = Encoder()
        encoder.encode(a)
        assert encoder.encode(b).header == encode(b).header


def _revalue(tree: Any, draw: st.DrawFn) -> Any:
    """``tree`` with every small leaf replaced by a freshly drawn one: the batch of a next
    step, same containers and buffer leaves, new step numbers and ids."""
    t = type(tree)
    if t in (list, tuple):
        return t(_revalue(x, draw) for x in tree)
    if t in (dict, OrderedDict):
        return t((k, _revalue(v, draw)) for k, v in tree.items())
    if t is PropPair:
        return PropPair(_revalue(tree.first, draw), _revalue(tree.second, draw))
    if t is PropRecord:
        return PropRecord(_revalue(tree.data, draw), _revalue(tree.note, draw))
    if t in (torch.Tensor, np.ndarray):
        return tree
    return draw(small_leaves)


@SETTINGS
@given(trees, st.data())
def test_a_known_structure_changes_nothing_but_speed(tree: Any, data: st.DataObject) -> None:
    """Law: for a batch ``a`` and a next batch ``b`` of its structure with new small
    values, ``unpack(pack(b)) == b`` after ``a`` went through the decoder, and the
    sender's header for ``b`` is the same whether or not it starts from ``a``'s layout.

    Receivers read a header that repeats a known structure by parsing its values alone;
    senders encode the values alone. Neither shortcut may show in the result.
    """
    nxt = _revalue(tree, data.draw)
    assert_same(tc.unpack(tc.pack(tree)), tree)
    packed = tc.pack(nxt)
    assert_same(tc.unpack(packed), nxt)
    encoder = Encoder()
    encoder.encode(tree)
    assert encoder.encode(nxt).header == packed.header


@SETTINGS
@given(trees)
def test_the_per_step_values_encoder_writes_what_json_writes(tree: Any) -> None:
    """Law: for any tree's small values, the encoder made once for every step writes the
    very text of the reference ``JSONEncoder``: the header's bytes do not depend on which
    of the two a Python has."""
    values = _flatten.flatten(tree)[1]
    assert _schema._encode_values(values) == _schema._dumps(values)
