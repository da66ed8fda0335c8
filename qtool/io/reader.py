"""Lazy single-tensor reads. safetensors' safe_open memory-maps the shard: only the pages of the tensor
asked for are read."""

from __future__ import annotations

from qtool.io.safetensors_header import TensorInfo


def read_bytes(info: TensorInfo) -> bytes:
    with open(info.file, "rb") as f:
        f.seek(info.start)
        return f.read(info.nbytes)


def read_tensor(info: TensorInfo):
    """The tensor as a torch.Tensor (CPU). Imports torch lazily."""
    from safetensors import safe_open

    with safe_open(info.file, framework="pt") as f:
        return f.get_tensor(info.name)


def read_scalar(info: TensorInfo) -> float:
    """A one-element float tensor's value, read with a 2-8 byte read (no torch)."""
    import struct

    fmt = {"F32": "<f", "F64": "<d", "F16": "<e"}.get(info.dtype)
    raw = read_bytes(info)
    if info.numel != 1:
        raise ValueError(f"{info.name} is not a scalar: shape {list(info.shape)}")
    if fmt is not None:
        return struct.unpack(fmt, raw)[0]
    if info.dtype == "BF16":
        return struct.unpack("<f", b"\x00\x00" + raw)[0]
    raise ValueError(f"{info.name}: unsupported scalar dtype {info.dtype}")
