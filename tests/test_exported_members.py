"""The public surface: ``tensorcast.__all__`` is exactly the documented names."""

from __future__ import annotations

import importlib

import pytest

import tensorcast

DOCUMENTED = {
    "FORMAT_VERSION",
    "BroadcastingDataLoader",
    "DesyncError",
    "HeaderError",
    "LeafSpec",
    "LoaderStats",
    "Packed",
    "PeerError",
    "Schema",
    "SourceError",
    "TensorcastError",
    "Timings",
    "UnsupportedLeafError",
    "broadcast",
    "broadcast_batch",
    "dp_rank_and_size",
    "is_dp_source_rank",
    "pack",
    "packed_collate",
    "read_header",
    "register_type",
    "unpack",
}


def test_all_is_exactly_the_documented_surface() -> None:
    assert set(tensorcast.__all__) == DOCUMENTED
    assert len(tensorcast.__all__) == len(DOCUMENTED), "duplicate names in __all__"


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_every_documented_name_is_importable(name: str) -> None:
    module = importlib.import_module("tensorcast")
    assert getattr(module, name) is not None
    # Public objects say they come from the package, or from one of its private modules.
    obj = getattr(module, name)
    if hasattr(obj, "__module__"):
        assert obj.__module__.startswith("tensorcast")


def test_star_import_gives_the_surface() -> None:
    namespace: dict[str, object] = {}
    exec("from tensorcast import *", namespace)
    assert set(namespace) - {"__builtins__"} == DOCUMENTED


def test_format_version_is_a_positive_int() -> None:
    assert type(tensorcast.FORMAT_VERSION) is int
    assert tensorcast.FORMAT_VERSION >= 1


def test_error_hierarchy() -> None:
    tc = tensorcast
    assert issubclass(tc.TensorcastError, RuntimeError)
    for cls in (tc.SourceError, tc.HeaderError, tc.PeerError, tc.DesyncError):
        assert issubclass(cls, tc.TensorcastError), cls
        assert not issubclass(cls, TypeError), cls
    assert issubclass(tc.UnsupportedLeafError, TypeError)
    # An encoding-side type problem is not a runtime error of the library.
    assert not issubclass(tc.UnsupportedLeafError, tc.TensorcastError)
    # The leaf classes are siblings: catching one never catches another.
    siblings = (tc.SourceError, tc.HeaderError, tc.PeerError, tc.DesyncError)
    for a in siblings:
        for b in siblings:
            assert issubclass(a, b) == (a is b), (a, b)


def test_errors_carry_their_message() -> None:
    for cls in (
        tensorcast.TensorcastError,
        tensorcast.SourceError,
        tensorcast.HeaderError,
        tensorcast.PeerError,
        tensorcast.DesyncError,
        tensorcast.UnsupportedLeafError,
    ):
        with pytest.raises(cls, match="what went wrong"):
            raise cls("what went wrong")


def test_public_dataclasses_are_frozen() -> None:
    import dataclasses

    for cls in (tensorcast.Packed, tensorcast.Schema, tensorcast.LeafSpec):
        assert dataclasses.is_dataclass(cls), cls
        assert cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]


@pytest.mark.parametrize("face", ["tensorcast.codec", "tensorcast.transport"])
def test_a_layers_face_lists_what_it_exports(face: str) -> None:
    """What the layers above may import of a layer (``make lint`` checks they import
    nothing else) is its ``__all__``, each name there."""
    module = importlib.import_module(face)
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
