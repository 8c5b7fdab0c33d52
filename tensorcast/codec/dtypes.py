"""The closed table of dtype codes that travel in headers, and an element's bits.

Codes are short ASCII strings in the spirit of safetensors (``"F32"``, ``"BF16"``,
``"F8_E4M3"``). A header never carries ``repr(dtype)``; an unknown code is a
``HeaderError`` on the decoding side.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "CODE_ITEMSIZE",
    "CODE_OF_TORCH",
    "NUMPY_CODES",
    "TORCH_CODES",
    "WORD",
    "as_words",
    "numpy_code",
]

# code -> torch dtype. Optional dtypes are looked up by name so an older torch simply
# lacks the code instead of failing to import.
_TORCH_BY_NAME: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "C128": "complex128",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F4_E2M1_X2": "float4_e2m1fn_x2",
}

TORCH_CODES: dict[str, torch.dtype] = {
    code: getattr(torch, name) for code, name in _TORCH_BY_NAME.items() if hasattr(torch, name)
}
#: torch dtype -> code; the encoder looks dtypes up here directly (a hot path).
CODE_OF_TORCH: dict[torch.dtype, str] = {dtype: code for code, dtype in TORCH_CODES.items()}

# numpy has every one of these except bfloat16 and the float8 / float4 types, under the
# same names as torch.
NUMPY_CODES: dict[str, np.dtype] = {
    code: np.dtype(_TORCH_BY_NAME[code])
    for code in (
        *("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"),
        *("F16", "F32", "F64", "C64", "C128"),
    )
}
_CODE_OF_NUMPY: dict[np.dtype, str] = {dtype: code for code, dtype in NUMPY_CODES.items()}

CODE_ITEMSIZE: dict[str, int] = {
    code: torch.empty((), dtype=dtype).element_size() for code, dtype in TORCH_CODES.items()
}


def numpy_code(dtype: np.dtype) -> str | None:
    """The code of a native-byte-order numpy dtype, or None when it cannot travel."""
    return _CODE_OF_NUMPY.get(dtype) if dtype.isnative else None


#: an element's bits as an integer of its width
WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width, bit for bit: a view, any strides.
    A 16-byte element (complex128) becomes a trailing pair of int64."""
    isz = t.element_size()
    if isz == 16:
        return torch.view_as_real(t).view(torch.int64)
    return t.view(WORD[isz])
