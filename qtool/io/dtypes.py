"""safetensors dtype names and their sizes (safetensors/src/tensor.rs `Dtype`)."""

from __future__ import annotations

from functools import lru_cache

# Bits per element. Sub-byte types (F4, F6_*) are packed; safetensors requires whole bytes per tensor.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}

FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}

# torch dtype names (attribute names on the torch module) for the dtypes torch can hold.
TORCH_DTYPE_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
}


def nbytes_for(dtype: str, shape: tuple[int, ...] | list[int]) -> int | None:
    """Byte length of a tensor, or None when the element count does not fill whole bytes."""
    return _nbytes(dtype, tuple(shape))


@lru_cache(maxsize=4096)
def _nbytes(dtype: str, shape: tuple[int, ...]) -> int | None:
    # cached: a 397B plan asks for the same few (dtype, shape) pairs ~750k times (every expert's tensors)
    n = 1
    for d in shape:
        n *= d
    bits = n * DTYPE_BITS[dtype]
    return bits // 8 if bits % 8 == 0 else None


def safetensors_dtype(torch_dtype: object) -> str:
    """The safetensors name of a torch dtype."""
    name = str(torch_dtype).removeprefix("torch.")
    for st, tn in TORCH_DTYPE_NAMES.items():
        if tn == name:
            return st
    raise KeyError(f"torch dtype {torch_dtype} has no safetensors name")
