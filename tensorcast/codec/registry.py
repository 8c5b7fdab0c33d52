"""The registry of container types that may travel: NamedTuples, dataclasses, codecs.

Both sides look a type up by its registered *name*, which travels in the header; the
class object itself never does. The registry is the one piece of module-level mutable
state in tensorcast, and it takes a lock.

Besides user types registered with :func:`register_type`, tensorcast keeps *codecs*:
a type that travels as a subtree of its own making (``to_tree``) and is rebuilt from it
(``from_tree``). lhotse cuts use this; their codec is registered lazily the first time a
lhotse object is met, so ``import tensorcast`` does not import lhotse.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["TypeEntry", "by_name", "by_type", "register_codec", "register_type"]

EntryKind = Literal["namedtuple", "dataclass", "codec"]


@dataclass(frozen=True, slots=True)
class TypeEntry:
    """How one registered type travels."""

    cls: type
    name: str
    kind: EntryKind
    fields: tuple[str, ...] = ()
    #: a dataclass's instance attributes that travel or need not: its fields, and its
    #: ``functools.cached_property`` names (computed again where they are read). Any
    #: other attribute in an instance's ``__dict__`` would be lost: the encoder refuses it.
    attrs: frozenset[str] = frozenset()
    #: a dataclass's slots (of it or a base) that are not fields: one that holds a value
    #: would be lost too
    slots: tuple[str, ...] = ()
    to_tree: Callable[[Any], Any] | None = None
    from_tree: Callable[[Any], Any] | None = None


_lock = threading.Lock()
_by_type: dict[type, TypeEntry] = {}
_by_name: dict[str, TypeEntry] = {}

# Types from these top-level packages get a built-in codec, imported on first use.
_LAZY_CODECS = {"lhotse": "tensorcast.codec.lhotse_cuts"}


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)


def _add(entry: TypeEntry) -> None:
    with _lock:
        old = _by_name.get(entry.name)
        if old is not None and old.cls is not entry.cls:
            raise ValueError(
                f"cannot register {entry.cls.__module__}.{entry.cls.__qualname__} as "
                f"{entry.name!r}: that name is already taken by "
                f"{old.cls.__module__}.{old.cls.__qualname__}; pass a different name="
            )
        old = _by_type.get(entry.cls)
        if old is not None and old.name != entry.name:
            raise ValueError(
                f"{entry.cls.__qualname__} is already registered as {old.name!r}; "
                f"a type travels under one name only"
            )
        _by_type[entry.cls] = entry
        _by_name[entry.name] = entry


def register_type(cls: type, *, name: str | None = None) -> type:
    """Let a NamedTuple or dataclass type travel as a container.

    Every rank must register the type under the same name before the first batch that
    holds it is sent or received. Registering the same type again is a no-op.

    A NamedTuple is rebuilt from its fields (``cls._make``). A dataclass is rebuilt as
    ``copy.copy`` and pickle rebuild one: a new instance with every field set to the value
    sent, without running ``__init__`` or ``__post_init__`` (which would run again on
    values that already went through them). Only fields travel: an instance attribute that
    is not a field (set in ``__post_init__`` or later) is refused on the sending side,
    naming it; a ``functools.cached_property`` is computed again where it is read.

    Args:
        cls: a ``typing.NamedTuple`` / ``collections.namedtuple`` class, or a dataclass.
        name: the name the type travels under. Defaults to ``module.QualName``.

    Returns:
        ``cls`` itself, so this can be used as a class decorator.

    Raises:
        TypeError: ``cls`` is neither a NamedTuple nor a dataclass type.
        ValueError: the name is taken by another type, or ``cls`` has another name.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_type expects a class, got {type(cls).__name__}: {cls!r}")
    name = name if name is not None else f"{cls.__module__}.{cls.__qualname__}"
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_type name= must be a non-empty str, got {name!r}")
    if _is_namedtuple(cls):
        fields = tuple(cls._fields)  # type: ignore[attr-defined]
        _add(TypeEntry(cls, name, "namedtuple", fields))
    elif dataclasses.is_dataclass(cls):
        fields = tuple(f.name for f in dataclasses.fields(cls))
        cached = {k for k in dir(cls) if isinstance(_static(cls, k), functools.cached_property)}
        slots = {n for b in cls.__mro__ for n in _slot_names(b)} - set(fields)
        slots -= {"__dict__", "__weakref__"}
        _add(TypeEntry(cls, name, "dataclass", fields, frozenset(fields) | cached, tuple(slots)))
    else:
        raise TypeError(
            f"register_type accepts NamedTuple and dataclass types only, got "
            f"{cls.__module__}.{cls.__qualname__}; convert other objects to a dict of "
            f"tensors and plain values"
        )
    return cls


def _slot_names(cls: type) -> tuple[str, ...]:
    slots = vars(cls).get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def _static(cls: type, name: str) -> Any:
    """``name`` on ``cls`` or a base, as stored (no descriptor runs), else None."""
    for base in cls.__mro__:
        if name in vars(base):
            return vars(base)[name]
    return None


def register_codec(
    cls: type, *, name: str, to_tree: Callable[[Any], Any], from_tree: Callable[[Any], Any]
) -> None:
    """Register a type that travels as a subtree (``to_tree``) and is rebuilt by ``from_tree``.

    ``to_tree`` must return something tensorcast can encode (containers, tensors, arrays,
    small leaves). ``from_tree`` receives the rebuilt subtree on the receiving side.
    """
    _add(TypeEntry(cls, name, "codec", to_tree=to_tree, from_tree=from_tree))


def _load_lazy(package: str) -> bool:
    module = _LAZY_CODECS.get(package)
    if module is None:
        return False
    importlib.import_module(module)
    return True


def by_type(cls: type) -> TypeEntry | None:
    """The entry for exactly ``cls`` (subclasses are not matched), loading lazy codecs."""
    entry = _by_type.get(cls)
    if entry is None and _load_lazy(cls.__module__.partition(".")[0]):
        entry = _by_type.get(cls)
    return entry


def by_name(name: str) -> TypeEntry | None:
    """The entry registered under ``name``, loading lazy codecs."""
    entry = _by_name.get(name)
    if entry is None and _load_lazy(name.partition(".")[0]):
        entry = _by_name.get(name)
    return entry
