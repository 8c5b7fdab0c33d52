"""The decode side: a header read into a :class:`Decoded`, and the tree rebuilt from a
buffer; the mirror of ``codec.encode``.

:func:`decode` checks a header (``codec.schema``, the wire format and its checks) and
keeps what it says but its small values as a :class:`Structure`, shared by the headers of
that structure: batches of fixed shapes repeat their header byte for byte, and a header
that starts with the bytes of a structure validated lately is read by parsing its values
alone. A :class:`Decoded` rebuilds its tree from a buffer: the structure's program
(``codec.build``, compiled once) run on the buffer seen as its leaves (:func:`leaf_views`,
through a ``codec.views.ViewSpec``), trimmed leaves re-padded (``codec.repad``).
A trimmed leaf's stored bytes change from batch to batch, and so do the offsets after
it: such headers are read whole, and share their tokens, whose compiled program is
found by their text.

# NOTE [ Numpy leaves beside tensors ]
A batch's leaves are views of one buffer, so they share one storage. ``share_memory_()``
on one tensor leaf (which a ``torch.multiprocessing`` queue runs) moves that storage, the
other tensor leaves with it, and frees the old block: an ndarray made before the move
would be left on freed memory, as any ``t.numpy()`` of a moved tensor is (a segfault, or
the next batch's bytes). So where a batch has tensor leaves on tensorcast's own host
memory (a pooled buffer, a first message, a shared-memory slot; the source's own tree as
a receiver's), its ndarray leaves are copies of their bytes: their own memory, which no
leaf's move can free. The cost is a copy of those bytes, on every rank; ndarray leaves
beside tensors are mostly small (ids, lengths). A batch of ndarray leaves alone, and a
caller's own buffer (``tc.unpack``), keep their views.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tensorcast._errors import HeaderError
from tensorcast.codec import schema as _schema
from tensorcast.codec.build import Program, compile_tokens, decode_values, run
from tensorcast.codec.dtypes import NUMPY_CODES
from tensorcast.codec.repad import Repad
from tensorcast.codec.views import MAX_ITEMSIZE, Reuses, ViewSpec

if TYPE_CHECKING:
    from tensorcast.codec.schema import Trim

__all__ = ["Decoded", "Structure", "decode", "host_block", "leaf_views"]

_PREFIX = _schema.PREFIX
_PREFIX_BYTES = _schema.PREFIX_BYTES
_MAGIC = _schema.MAGIC
_VERSION = _schema.FORMAT_VERSION
_NO_TRIMS = _schema.NO_TRIMS
_parse = _schema.parse
_dumps = _schema.dumps


def decode(header: bytes | bytearray | memoryview) -> Decoded:
    """Read a header: its prefix checked, its body parsed, its leaf table validated, in
    bounded time and memory for any input and before anything is allocated from it.

    Batches of fixed shapes repeat their header byte for byte, so small headers are
    decoded once and the validated result is reused (never mutated but for its caches).

    Args:
        header: the header's bytes.

    Returns:
        The :class:`Decoded` header, which validates its tokens and small values when it
        first rebuilds a tree (or when asked, ``Decoded.compiled``).

    Raises:
        HeaderError: the header is not valid for this version of tensorcast.
        TypeError: ``header`` is not bytes.
    """
    if not isinstance(header, (bytes, bytearray, memoryview)):
        raise TypeError(f"a header is bytes, got {type(header).__name__}")
    if type(header) is bytes and len(header) <= _CACHE_MAX_BYTES and header.endswith(_NO_TRIMS):
        return _decode_cached(header)
    return _decode(header)  # trims are checked against this moment's rebuild limit


_CACHE_MAX_BYTES = 16 << 10  # x 32 headers: a bounded few MB once compiled


# The structures read last, newest first: a header that starts with one's bytes needs
# only its values parsed. Replaced whole, never changed in place (prefetch threads read it).
# What a structure holds once compiled is a few dozen times its text, so the caches here
# are bounded by the text they hold in all, whatever the headers: _RECENT structures of
# _RECENT_MAX_BYTES of bytes in all, and _PROGRAMS programs of _PROGRAMS_MAX_BYTES.
_recent: tuple[Structure, ...] = ()
_RECENT = 4
_RECENT_MAX_BYTES = 1 << 20


def _decode(header: bytes | bytearray | memoryview) -> Decoded:
    if type(header) is bytes:
        known = _read_known(header)
        if known is not None:
            return known
    body = _schema.read_body(header)
    nbytes, align, leaves, tokens, trimmed = (
        body.nbytes,
        body.align,
        body.leaves,
        body.tokens,
        body.trimmed,
    )
    structure = Structure(nbytes, align, leaves, tokens, trimmed)
    if trimmed:
        structure.program = _program(tokens, len(leaves))
    # Larger structures are not kept for the next header, nor those of trimmed leaves,
    # whose stored sizes change from batch to batch (their program is kept: _program).
    if len(body.raw) <= _RECENT_MAX_BYTES and not trimmed:
        try:
            start: bytes | None = _schema.structure_bytes(nbytes, align, leaves, tokens)
        except (ValueError, RecursionError):  # not something this library writes
            start = None
        if start is not None and body.raw.startswith(start):
            # Written as this library writes it: later bodies can match its bytes.
            structure.structure_bytes = start
            _remember(structure)
    return Decoded(structure, body.values, body.trims)


_decode_cached = functools.lru_cache(maxsize=32)(_decode)


def _read_known(header: bytes) -> Decoded | None:
    """A header framed as this library frames one, whose body starts with the very bytes
    of a structure validated lately: its values alone are parsed. None for any other.

    Every step of a repeating batch comes here, so it is one function, not the several
    the general path calls (each costs a few microseconds when the step runs cold).
    """
    n = len(header)
    if not _PREFIX_BYTES < n <= _PREFIX_BYTES + _schema.MAX_HEADER_BYTES:
        return None  # the general path says what is wrong with it
    if header[:_PREFIX_BYTES] != _PREFIX.pack(_MAGIC, _VERSION, 0, n - _PREFIX_BYTES):
        return None
    for known in _recent:
        start = known.structure_bytes
        assert start is not None  # only structures with their bytes are remembered
        at = _PREFIX_BYTES + len(start)
        if n <= at or not header.startswith(start, _PREFIX_BYTES):
            continue
        if not header.endswith(_NO_TRIMS):  # structures with trims are not remembered
            return None
        values = _parse(header[at : -len(_NO_TRIMS)])  # one JSON value, then no trims
        if type(values) is not list:
            raise HeaderError("invalid tensorcast header: the small values are not a list")
        return Decoded(known, values)
    return None


# Compiled programs by their tokens' text: headers with trimmed leaves differ from batch
# to batch in the leaf table, not in the tokens. Replaced whole, never changed in place.
_programs: dict[bytes, Program] = {}
_PROGRAMS = 16
_PROGRAMS_MAX_BYTES = 1 << 20


def _program(tokens: Any, n_leaves: int) -> Program:
    """The compiled program of ``tokens`` (validated once per distinct text)."""
    global _programs
    try:
        key = _dumps([n_leaves, tokens]).encode("ascii")
    except (ValueError, RecursionError):  # not something this library writes
        return compile_tokens(tokens, n_leaves)[0]
    program = _programs.get(key)
    if program is None:
        program = compile_tokens(tokens, n_leaves)[0]
        if len(key) <= _PROGRAMS_MAX_BYTES:
            newest = [(key, program), *reversed(_programs.items())]
            n = _fitting([len(k) for k, _ in newest], _PROGRAMS, _PROGRAMS_MAX_BYTES)
            _programs = dict(reversed(newest[:n]))
    return program


def _remember(structure: Structure) -> None:
    global _recent
    newest = (structure, *_recent)
    sizes = [len(known.structure_bytes or b"") for known in newest]
    _recent = newest[: _fitting(sizes, _RECENT, _RECENT_MAX_BYTES)]


def _fitting(sizes: list[int], most: int, budget: int) -> int:
    """How many of a cache's entries to keep, newest first (``sizes``, in bytes of text):
    at most ``most``, of at most ``budget`` bytes in all."""
    total = 0
    for n, size in enumerate(sizes[:most]):
        total += size
        if total > budget:
            return n
    return min(most, len(sizes))


class Structure:
    """Everything a header says but its small values, validated except for the tokens
    (those are validated when compiled into ``program``), and what is made from it once
    for every batch of this structure. Never mutated but for filling in the caches."""

    __slots__ = (
        "align",
        "leaves",
        "nbytes",
        "program",
        "structure_bytes",
        "tokens",
        "trimmed",
        "view_spec",
    )

    def __init__(
        self,
        nbytes: int,
        align: int,
        leaves: list[list[Any]],
        tokens: list[Any],
        trimmed: frozenset[int] = frozenset(),
    ):
        self.nbytes = nbytes
        self.align = align
        self.leaves = leaves
        self.tokens = tokens
        #: the leaves the header trimmed: their side tables checked their sizes
        self.trimmed = trimmed
        #: the body's bytes up to the values, when they are what encode() writes
        self.structure_bytes: bytes | None = None
        self.program: Program | None = None  # compiled on first use
        self.view_spec: ViewSpec | None = None  # made on first use


class Decoded:
    """A header read and its leaf table validated (:func:`decode`): its
    structure, shared by the headers of that structure, and its own small values.

    The tokens are validated when first compiled, the small values when first decoded
    (:meth:`compiled`), both before any tree is built.

    Attributes:
        structure: everything the header says but its small values.
        values: the small values' tokens, as the header carries them.
        consts: the small values decoded, once :meth:`compiled` has run.
        trims: the trimmed leaves' side tables by leaf index, validated; None when no
            leaf is trimmed.
        nbytes: the size of the buffer the header describes.
    """

    __slots__ = ("consts", "nbytes", "structure", "trims", "values")

    def __init__(
        self, structure: Structure, values: list[Any], trims: dict[int, Trim] | None = None
    ) -> None:
        self.structure = structure
        self.values = values
        self.consts: list[Any] | None = None
        self.trims = trims
        self.nbytes = structure.nbytes

    @property
    def host_nbytes(self) -> int | None:
        """The size of the host block of the leaves that are not tensors (numpy arrays,
        bytes, str) and of trimmed ndarray leaves, which travels beside a buffer on a GPU;
        None when there is none (every leaf a tensor)."""
        spec = self._view_spec()
        return spec.host_nbytes if spec.host_spans else None

    def check_buffer(self, buffer: Any) -> None:
        """Check that ``buffer`` can be the buffer this header describes.

        Raises:
            TypeError: it is not a 1-D ``torch.uint8`` tensor.
            ValueError: it is not contiguous, or is a meta tensor.
            HeaderError: its size is not the header's.
        """
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
            kind = f"{type(buffer).__module__}.{type(buffer).__qualname__}"
            raise TypeError(
                f"the buffer must be a 1-D torch.uint8 tensor, got {kind} of "
                f"{getattr(buffer, 'dtype', 'no dtype')} with shape "
                f"{tuple(getattr(buffer, 'shape', ()))}"
                + (" (torch.from_numpy(array) makes one)" if kind == "numpy.ndarray" else "")
            )
        if not buffer.is_contiguous():
            raise ValueError("the buffer must be contiguous; call .contiguous() first")
        if buffer.is_meta:
            raise ValueError("the buffer is a meta tensor, which holds no data to rebuild from")
        nbytes = self.structure.nbytes
        if buffer.numel() != nbytes:
            raise HeaderError(
                f"the header describes a {nbytes}-byte buffer but the buffer has {buffer.numel()}"
            )

    def compiled(self) -> tuple[Program, list[Any]]:
        """The structure's program (compiled once per structure) and the small values
        decoded (once per header), both validated.

        Raises:
            HeaderError: the tokens or the small values are not a valid tree.
        """
        structure = self.structure
        program = structure.program
        if program is None:
            program, _ = compile_tokens(structure.tokens, len(structure.leaves))
            structure.program = program
        consts = self.consts
        if consts is None:
            consts = decode_values(self.values)
            if len(consts) != program.n_values:
                raise HeaderError(
                    f"the header's tree has {program.n_values} small values but "
                    f"{len(consts)} follow it"
                )
            self.consts = consts
        return program, consts

    def rebuild(
        self, buffer: torch.Tensor, reuse: Reuses | None = None, host: torch.Tensor | None = None
    ) -> Any:
        """The tree, its leaves viewing ``buffer`` (numpy leaves: CPU views of it), but
        for trimmed leaves: re-padded on ``buffer``'s device (arrays on the CPU).

        Args:
            buffer: the buffer of ``nbytes`` bytes, on any device.
            reuse: what keeps the views of ``buffer``, when it came from there (the
                tensor leaves are then fresh tensors on views it kept), and hands out
                the memory trimmed leaves are re-padded into (:class:`Reuses`); default
                views made anew and fresh memory.
            host: the host block of the leaves that are not tensors (:meth:`host_block`),
                when ``buffer`` is on a GPU: they are then read from it, not copied back.

        Raises:
            HeaderError: the tokens or the small values are not a valid tree.
        """
        tree, repads = self.rebuild_later(buffer, reuse, host)
        for repad in repads:
            repad()
        return tree

    def rebuild_later(
        self, buffer: torch.Tensor, reuse: Reuses | None = None, host: torch.Tensor | None = None
    ) -> tuple[Any, list[Repad]]:
        """:meth:`rebuild`, but for the re-pads of the trimmed leaves, whose memory is
        taken and which are returned for the caller to run before anyone reads the tree
        (``codec.repad.Repad``): a source runs its own while its payload travels, a
        device part on its stream.

        Raises:
            HeaderError: the tokens or the small values are not a valid tree.
        """
        structure = self.structure
        program, consts = structure.program, self.consts
        if program is None or consts is None:
            program, consts = self.compiled()
        spec = structure.view_spec or self._view_spec()
        leaves, repads = leaf_views(spec, buffer, reuse, host, self.trims)
        return run(program, leaves, consts), repads

    def host_block(self, buffer: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The bytes of the leaves that are not tensors, copied from the host ``buffer``
        into ``out`` (at least :attr:`host_nbytes` bytes) as :meth:`rebuild` reads them."""
        return host_block(self._view_spec(), buffer, out)

    def _view_spec(self) -> ViewSpec:
        """The structure's view spec, made once per structure."""
        structure = self.structure
        if structure.view_spec is None:
            structure.view_spec = ViewSpec(structure.leaves, trimmed=structure.trimmed)
        return structure.view_spec


def host_block(spec: ViewSpec, buffer: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy the bytes of the leaves that are not tensors from a host ``buffer`` into
    ``out`` (at least ``spec.host_nbytes`` bytes), as :func:`leaf_views` reads them."""
    src, dst = buffer.numpy(), out.numpy()
    for off, n, pos in spec.host_spans:
        dst[pos : pos + n] = src[off : off + n]
    return out[: spec.host_nbytes]


def leaf_views(
    spec: ViewSpec,
    buffer: torch.Tensor,
    reuse: Reuses | None = None,
    host: torch.Tensor | None = None,
    trims: Mapping[int, Trim] | None = None,
) -> tuple[list[Any], list[Repad]]:
    """The buffer leaves ``spec`` describes, as views into ``buffer`` (fresh tensors on
    views ``reuse`` keeps, when it came from there), and the re-pads of the trimmed ones.

    The leaves that are not tensors (numpy arrays, bytes, str) come from ``host`` when
    given: a host block of their bytes alone (``spec.host_spans``), which a buffer on a
    GPU travels with, so that they need no copy back from the device; so do the stored
    bytes of trimmed ndarray leaves, which are re-padded on the host.

    Trimmed leaves (``trims``, by leaf index) are re-padded from their stored bytes on
    ``buffer``'s device (arrays on the CPU), into ``reuse``'s memory when given: their
    memory is taken now, and their re-pads are returned, for the caller to run before
    the leaves are read (``codec.repad.Repad``).
    """
    if buffer.storage_offset() % MAX_ITEMSIZE:
        buffer = buffer.clone()  # a buffer sliced at an odd offset cannot be viewed as F64
    values, memory = spec.leaves(buffer, reuse)
    if not spec.others and not spec.trimmed:
        return values, []
    repads = []
    if spec.trimmed:
        if trims is None:
            raise ValueError("a layout with trimmed leaves needs their side tables")
        for i, (kind, code, shape, off, n) in spec.trimmed:
            if host is not None and i in spec.host_trimmed:  # an ndarray: from the host
                pos, _ = spec.host_trimmed[i]
                stored = host[pos : pos + n]
            else:
                stored = buffer[off : off + n]
            repad = Repad.taken(kind, code, shape, stored, trims[i], memory.get(i), i)
            values[i] = repad.value
            repads.append(repad)
    if spec.others:
        _read_others(spec, values, buffer, host, apart=reuse is not None and bool(spec.specs))
    return values, repads


def _read_others(
    spec: ViewSpec,
    values: list[Any],
    buffer: torch.Tensor,
    host: torch.Tensor | None,
    *,
    apart: bool = False,
) -> None:
    """Fill in ``values`` the leaves that are not tensors: from their ``host`` block when
    given, else from ``buffer`` (viewed on a host, copied back from a device). ``apart``:
    ndarray leaves of a host ``buffer`` are copies (NOTE [ Numpy leaves beside tensors ])."""
    if host is not None:
        block = host.numpy()
        for (i, (kind, code, shape, _off, n)), (_, _, pos) in zip(spec.others, spec.host_spans):
            values[i] = _other(kind, code, shape, block[pos : pos + n])
        return
    host_view: np.ndarray | None = None
    on_cpu = buffer.device.type == "cpu"
    for i, (kind, code, shape, off, n) in spec.others:
        if on_cpu:
            if host_view is None:
                # One holder view for all host leaves: it keeps the storage's use count up
                # while any array views it, so a pooled buffer is not reused under them.
                host_view = buffer[:].numpy()
            piece = host_view[off : off + n]
            if apart and kind == "ndarray":
                piece = piece.copy()
        else:
            piece = buffer[off : off + n].cpu().numpy()  # a copy back from the device
        values[i] = _other(kind, code, shape, piece)


def _other(kind: str, code: str, shape: Any, piece: np.ndarray) -> Any:
    """A leaf that is not a tensor, from its bytes."""
    if kind == "ndarray":
        return piece.view(NUMPY_CODES[code]).reshape(shape)
    if kind == "bytes":
        return piece.tobytes()
    try:
        return piece.tobytes().decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as e:
        raise HeaderError(f"a str leaf holds invalid UTF-8: {e}") from None
