"""Tests of the test helpers in ``trees.py``: the checks of every layer are only as strong
as they are."""

from __future__ import annotations

import numpy as np
import torch
from trees import digest, every_kind


def test_canon_tells_bit_patterns_apart() -> None:
    """The checks above are only as strong as ``canon``: it must see -0.0 and NaN payloads."""
    assert digest(every_kind()) == digest(every_kind())
    assert digest({"f": 0.0}) != digest({"f": -0.0})
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))
    assert digest([1]) != digest((1,))
    assert digest({"a": 1, "b": 2}) != digest({"b": 2, "a": 1})
    assert digest(np.float32(1)) != digest(np.float64(1))
