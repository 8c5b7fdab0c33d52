"""The encode side: a batch encoded (flattened, laid out, its header made), then
written into any buffer large enough.

An :class:`Encoder` encodes one source's batches, reusing the last one's layout
(``codec.layout``) while the structure repeats, so a steady-state step flattens the tree
and encodes its small values, nothing more. An :class:`Encoded` touches no buffer until
it is written, so the caller picks the buffer (pooled, pinned, on a GPU) once it knows the
size. Writing hands back the tree the receivers will rebuild from the header, made from
what the encoder already knows: the source never decodes the header it has just encoded.

With ``trim=True`` the encoder asks ``codec.trim.plan`` of each leaf that could pay
(``Layout.candidates``) how to trim it, and the batch gets a layout of its own where one
is trimmed; writing then copies a trimmed leaf's prefixes alone (``trim.compact_into``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tensorcast.codec import schema as _schema
from tensorcast.codec import trim as _trim
from tensorcast.codec.build import compile_tokens, run
from tensorcast.codec.decode import leaf_views
from tensorcast.codec.flatten import BufferLeaf, flatten
from tensorcast.codec.layout import DEFAULT_ALIGN, KIND, Layout, lay_out
from tensorcast.codec.paths import render_path
from tensorcast.codec.repad import Repad, Trim
from tensorcast.codec.views import Reuses

__all__ = ["Encoded", "Encoder", "check_trim", "encode"]

_MEMSET_BELOW = 1 << 20
_MEMSET_ABOVE_LEAVES = 64
_CPU = torch.device("cpu")


class Encoded:
    """A batch flattened, laid out and its header encoded, ready to be written into any
    large-enough buffer."""

    __slots__ = ("header", "layout", "leaves", "nbytes", "trims", "value_tokens")

    def __init__(
        self,
        leaves: list[BufferLeaf],
        value_tokens: list[Any],
        layout: Layout,
        header: bytes,
        trims: dict[int, Trim] | None = None,
    ) -> None:
        self.leaves = leaves
        #: the trimmed leaves' side tables by leaf index; None when none is trimmed
        self.trims = trims
        #: the small values' tokens, as the header carries them
        self.value_tokens = value_tokens
        #: the leaves' places and the structure, reused by the next batch when it matches
        self.layout = layout
        self.header = header
        self.nbytes = layout.nbytes

    @property
    def device(self) -> torch.device:
        """The device of the batch's tensors (cpu when it has none). Asked only where it
        matters (large or CUDA batches): a tiny batch's step does not pay for it."""
        # flatten checked that every tensor shares the first one's device
        return next((leaf[3].device for leaf in self.leaves if leaf[0] == "tensor"), _CPU)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The batch's tensor leaves, in leaf order: what writing the batch reads."""
        return tuple(leaf[3] for leaf in self.leaves if leaf[0] == "tensor")

    def write(
        self, buffer: torch.Tensor, views: list[torch.Tensor] | None = None, *, others: bool = True
    ) -> list[torch.Tensor]:
        """Copy every leaf's bytes into ``buffer[:self.nbytes]`` at its offset.

        Tensor leaves are copied by one batched ``_foreach_copy_`` into typed views of
        the buffer: per-leaf Python work is what dominates batches of many small leaves.

        Args:
            buffer: at least ``nbytes`` bytes, on any device.
            views: what an earlier call returned for this layout and this very buffer
                (the tensor views to write through), to save making them again.
            others: write the leaves that are not tensors too (a GPU buffer gets them
                from their host block instead: :meth:`upload_others`).

        Returns:
            The typed views the tensor leaves were copied into, in leaf order: the
            sender's own rebuilt tree can use them (see :meth:`values`).
        """
        layout = self.layout
        spec = layout.write_spec
        leaves = self.leaves
        host: np.ndarray | None = None  # the buffer's host view, made once if needed
        # Alignment gaps are zeroed: the bytes are deterministic, and no stale memory of
        # this process travels to the peers. Small or many-leaf buffers get one memset;
        # large ones (where a second pass over the data would cost) get one per gap.
        if layout.has_gaps:
            if self.nbytes > _MEMSET_BELOW and len(leaves) <= _MEMSET_ABOVE_LEAVES:
                host = _zero_each_gap(buffer, layout)
            else:
                buffer[: self.nbytes].zero_()
        if views is None:
            views = spec.tensor_views(buffer)
        srcs = [leaves[i][3] for i in spec.tensor_index]
        for j in spec.bools:
            # As bytes: a bool copy would turn bytes other than 0 / 1 (masks made with
            # .view(torch.bool)) into 1, and the bytes must arrive as they are.
            srcs[j] = srcs[j].view(torch.uint8)
        if len(views) == 1:
            views[0].copy_(srcs[0])
        elif views:
            torch._foreach_copy_(views, srcs)
        if spec.others and others:
            _write_others(buffer, spec.others, leaves, host)
        for i, (kind, _code, _shape, off, n) in spec.trimmed:
            if others or kind != "ndarray":  # else from the host block (upload_others)
                self._compact(buffer[off : off + n], i)
        return views

    def _compact(self, out: torch.Tensor, i: int) -> None:
        """Write trimmed leaf ``i``'s prefixes into ``out``; an error names the leaf."""
        try:
            _trim.compact_into(out, self.leaves[i][3], self.trims[i].prefix_lens)  # type: ignore[index]
        except (RuntimeError, ValueError) as e:
            _, paths = compile_tokens(self.layout.tokens, len(self.leaves), want_paths=True)
            where = render_path(paths[i]) if paths else f"leaf {i}"
            raise type(e)(f"writing the trimmed leaf at {where} failed: {e}") from e

    @property
    def host_nbytes(self) -> int | None:
        """The size of the host block of the leaves that are not tensors (numpy arrays,
        bytes, str) and of trimmed ndarray leaves, which travels beside a buffer on a GPU;
        None when there is none (every leaf a tensor)."""
        spec = self.layout.write_spec
        return spec.host_nbytes if spec.host_spans else None

    def write_tree(
        self, buffer: torch.Tensor, reuse: Reuses | None = None
    ) -> tuple[Any, list[Repad]]:
        """Write the batch into ``buffer`` and return its tree as the receivers rebuild
        it: leaves that view ``buffer`` (fresh tensors on views ``reuse`` keeps, when
        ``buffer`` came from there), plain tensors even for leaves that require grad;
        trimmed leaves re-padded from ``buffer`` into ``reuse``'s memory, if given. Their
        re-pads are returned with the tree, their memory taken, for the caller to run
        before anyone reads it (``codec.repad.Repad``)."""
        spec = self.layout.write_spec
        with torch.no_grad():  # copies of leaves that require grad stay out of autograd
            tensor_views = self.write(buffer, views=spec.kept_views(buffer, reuse))
        values, repads = self._leaf_values(buffer, tensor_views, reuse)
        return self._tree(values), repads

    def host_block(self, out: torch.Tensor) -> torch.Tensor:
        """The bytes of the leaves that are not tensors (numpy arrays, bytes, str), alone,
        and the stored bytes of trimmed ndarray leaves, written into the host tensor
        ``out`` as ``codec.decode.leaf_views`` reads a host block: what travels beside a
        buffer on a GPU."""
        spec = self.layout.write_spec
        dst = out.numpy()
        for (i, _row), (_off, n, pos) in zip(spec.others, spec.host_spans):
            data = self.leaves[i][3]
            if n:
                src = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
                dst[pos : pos + n].view(src.dtype).reshape(src.shape)[...] = src
        for i, (pos, n) in spec.host_trimmed.items():  # a trimmed ndarray: its prefixes
            self._compact(out[pos : pos + n], i)
        return out[: spec.host_nbytes]

    def device_tree(
        self, buffer: torch.Tensor, host: torch.Tensor | None
    ) -> tuple[Any, list[Repad]]:
        """The tree of a device buffer this batch is (being) written into, read nowhere
        but on the device: tensor leaves view ``buffer``, the others come from ``host``,
        its host block (:meth:`host_block`); and the re-pads of its trimmed leaves, to
        run before it is read (``codec.repad.Repad``)."""
        values, repads = leaf_views(self.layout.read_spec(), buffer, host=host, trims=self.trims)
        return self._tree(values), repads

    def upload_others(self, buffer: torch.Tensor, host: torch.Tensor) -> None:
        """Copy the leaves that are not tensors (and trimmed ndarrays' stored bytes) from
        their host block (pinned) into their places in the device ``buffer``,
        asynchronously."""
        for off, n, pos in self.layout.write_spec.host_spans:
            if n:
                buffer[off : off + n].copy_(host[pos : pos + n], non_blocking=True)

    def _tree(self, leaf_values: list[Any]) -> Any:
        program, consts = self.layout.compiled(self.value_tokens)
        return run(program, leaf_values, consts)

    def _leaf_values(
        self,
        buffer: torch.Tensor,
        tensor_views: list[torch.Tensor],
        reuse: Reuses | None = None,
    ) -> tuple[list[Any], list[Repad]]:
        """The leaf values the receivers will see, built from what :meth:`write` returned,
        and the re-pads of the trimmed ones."""
        spec = self.layout.write_spec
        out: list[Any] = list(tensor_views)
        for j in spec.bools:
            out[j] = out[j].view(torch.bool)  # written as bytes
        if not spec.others and not spec.trimmed:
            return out, []
        values = spec.placed(out)
        repads = []
        for i, (kind, code, shape, off, n) in spec.trimmed:
            stored = buffer[off : off + n]
            trim = self.trims[i]  # type: ignore[index]
            repad = Repad.taken(kind, code, shape, stored, trim, reuse, i)
            values[i] = repad.value
            repads.append(repad)
        host: np.ndarray | None = None
        for i, (kind, _code, shape, off, _n) in spec.others:
            data = self.leaves[i][3]
            if kind == "bytes":
                values[i] = data
            elif kind == "str":
                values[i] = data.decode("utf-8", "surrogatepass")
            else:
                if host is None:  # one holder view: it keeps the storage's use count up
                    host = (
                        buffer[:].numpy() if buffer.device.type == "cpu" else buffer.cpu().numpy()
                    )
                values[i] = host[off : off + data.nbytes].view(data.dtype).reshape(shape)
        return values, repads


def _zero_each_gap(buffer: torch.Tensor, layout: Layout) -> np.ndarray | None:
    """Zero the gaps between ``layout``'s leaves in ``buffer``, one by one; returns the
    host view of ``buffer`` made for it, when it is on the CPU."""
    host: np.ndarray | None = None
    on_cpu = buffer.is_cpu
    for start, stop in layout.gaps():
        if on_cpu:
            host = buffer.numpy() if host is None else host
            host[start:stop] = 0
        else:
            buffer[start:stop].zero_()
    return host


def _write_others(
    buffer: torch.Tensor,
    others: list[tuple[int, Any]],
    leaves: list[BufferLeaf],
    host: np.ndarray | None,
) -> None:
    """Write the ndarray, bytes and str leaves; ``host``: the buffer's host view, if made."""
    on_cpu = buffer.is_cpu
    for i, (kind, _code, _shape, off, _n) in others:
        data = leaves[i][3]
        if kind == "ndarray":
            src = data
            n = data.nbytes
        else:  # bytes / str, already encoded
            src = np.frombuffer(data, dtype=np.uint8)
            n = len(data)
        if n == 0:
            continue
        if on_cpu:
            host = buffer.numpy() if host is None else host
            host[off : off + n].view(src.dtype).reshape(src.shape)[...] = src
        else:
            staged = torch.empty(n, dtype=torch.uint8)
            staged.numpy().view(src.dtype).reshape(src.shape)[...] = src
            buffer[off : off + n].copy_(staged)


def check_trim(trim: object) -> bool:
    """``trim`` itself when it is a ``bool``, what every entry point accepts.

    Raises:
        TypeError: anything else (None, 0, a string), with what was given.
    """
    if type(trim) is not bool:
        raise TypeError(f"trim must be True or False, got {trim!r} of type {type(trim).__name__}")
    return trim


class Encoder:
    """Encodes one source's batches, one after another: while their structure repeats,
    the last batch's layout is reused and only the small values are encoded anew.

    Args:
        align: every leaf's offset is a multiple of this (a power of two).
        trim: what :meth:`encode` does when not told.

    Raises:
        ValueError: ``align`` is not a power of two the format allows.
        TypeError: ``trim`` is not a bool.
    """

    __slots__ = ("_align", "_layout", "_trim")

    def __init__(self, *, align: int = DEFAULT_ALIGN, trim: bool = True) -> None:
        if type(align) is not int or not 1 <= align <= _schema.MAX_ALIGN or align & (align - 1):
            raise ValueError(
                f"align must be a power of two in [1, {_schema.MAX_ALIGN}], got {align!r}"
            )
        self._align = align
        self._trim = check_trim(trim)
        #: the last batch's layout; it holds no tensors, so it keeps no batch alive
        self._layout: Layout | None = None

    def encode(
        self, tree: Any, *, trim: bool | None = None, receiver: str | None = None
    ) -> Encoded:
        """Flatten ``tree`` and lay its leaves out; no buffer is touched yet.

        Args:
            tree: the batch.
            trim: trim the leaves where it pays (NOTE [ Trimmed leaves ], ``codec.trim``);
                None: as the encoder was made.
            receiver: where the receivers rebuild, ``"host"`` or ``"device"``
                (``codec.trim.decide``); None: where the batch's tensors are (a batch on a
                GPU is rebuilt on GPUs, one on the host on hosts).

        Raises:
            UnsupportedLeafError: a leaf, key or container cannot travel.
            ValueError: tensors on more than one device, a cyclic tree, a buffer over the
                format's limit.
        """
        tokens, values, leaves, loose = flatten(tree)
        # A leaf's (kind, code, shape) fixes its size, so equal kinds and tokens mean an
        # equal layout: steady state compares them instead of laying the leaves out, and
        # encodes only the small values.
        kinds = list(map(KIND, leaves))
        layout = self._layout
        if (
            layout is None
            or loose
            or not layout.comparable
            or layout.tokens != tokens
            or layout.kinds != kinds
        ):
            layout = self._layout = lay_out(leaves, kinds, tokens, self._align, not loose)
        if self._trim if trim is None else check_trim(trim):
            # unknown receivers: the looser floor's candidates, then decided by the batch
            candidates = layout.candidates(receiver or "device")
            if candidates:
                trims = _find_trims(leaves, candidates, receiver)
                if trims:
                    layout = layout.trimmed_layout(leaves, trims)
                    return Encoded(leaves, values, layout, layout.header(values, trims), trims)
        return Encoded(leaves, values, layout, layout.header(values))


def _find_trims(
    leaves: list[BufferLeaf], candidates: list[int], receiver: str | None
) -> dict[int, Trim] | None:
    """The side tables of the ``candidates`` that trimming pays for, by leaf index.

    A tensor on a GPU is sent whole: deciding its trim reads it back to the host, 2 to
    8 host syncs a leaf and a batch, each one draining the device's queue (and refused
    inside a CUDA graph capture), which the bytes saved on NVLink do not repay. Host
    leaves (an ndarray beside a GPU batch too) are decided as ever."""
    if receiver is None:
        first = next((leaf[3] for leaf in leaves if leaf[0] == "tensor"), None)
        receiver = "device" if first is not None and first.device.type == "cuda" else "host"
    trims = {}
    for i in candidates:
        kind, code, shape, leaf = leaves[i]
        if kind == "tensor" and not leaf.is_cpu:
            continue  # deciding a device leaf's trim would sync the host: it travels whole
        try:
            found = _trim.plan(leaf, receiver=receiver)  # a copy made once, if one is
        except (RuntimeError, ValueError, TypeError):
            continue  # trimming is an optimisation: a leaf it cannot read travels whole
        if found is not None:
            trims[i], copy = found
            if copy is not leaf:
                leaves[i] = (kind, code, shape, copy)
    return trims or None


def encode(
    tree: Any, *, align: int = DEFAULT_ALIGN, trim: bool = True, receiver: str | None = None
) -> Encoded:
    """Flatten ``tree`` and lay its leaves out, with nothing reused from another batch
    (``trim`` and ``receiver`` as for :meth:`Encoder.encode`).

    Raises:
        UnsupportedLeafError: a leaf, key or container cannot travel.
        ValueError: bad ``align``, tensors on more than one device, a cyclic tree.
        TypeError: ``trim`` is not a bool.
    """
    return Encoder(align=align).encode(tree, trim=check_trim(trim), receiver=receiver)
