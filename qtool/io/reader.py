"""Lazy single-tensor reads. safetensors' safe_open memory-maps the shard: only the pages of the tensor
asked for are read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qtool.io.safetensors_header import TensorInfo

if TYPE_CHECKING:
    import torch


def read_bytes(info: TensorInfo) -> bytes:
    with open(info.file, "rb") as f:
        f.seek(info.start)
        return f.read(info.nbytes)


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """The tensor as a torch.Tensor (CPU). Imports torch lazily."""
    from safetensors import safe_open

    with safe_open(info.file, framework="pt") as f:
        return f.get_tensor(info.name)


def read_scalar(info: TensorInfo) -> float:
    """A one-element float tensor's value, read with a 2-8 byte read (no torch)."""
    if info.numel != 1:
        raise ValueError(f"{info.name} is not a scalar: shape {list(info.shape)}")
    return read_floats(info)[0]


def read_floats(info: TensorInfo) -> list[float]:
    """A small float tensor's values (a per-head KV scale: [num_kv_heads] float32), read without torch."""
    import struct

    fmt = {"F32": "f", "F64": "d", "F16": "e"}.get(info.dtype)
    raw = read_bytes(info)
    if fmt is not None:
        return list(struct.unpack(f"<{info.numel}{fmt}", raw))
    if info.dtype == "BF16":
        return [struct.unpack("<f", b"\x00\x00" + raw[i : i + 2])[0] for i in range(0, len(raw), 2)]
    raise ValueError(f"{info.name}: unsupported float dtype {info.dtype}")


def read_scalars(infos: list[TensorInfo]) -> list[float]:
    """Many scalar reads with one open per file (a 397B checkpoint has ~60k weight_scale_2 scalars)."""
    import os
    import struct

    out: list[float] = [0.0] * len(infos)
    by_file: dict[str, list[int]] = {}
    for i, info in enumerate(infos):
        by_file.setdefault(info.file, []).append(i)
    for file, idxs in by_file.items():
        fd = os.open(file, os.O_RDONLY)
        try:
            for i in idxs:
                info = infos[i]
                raw = os.pread(fd, info.nbytes, info.start)
                if info.dtype == "F32" and info.numel == 1:
                    out[i] = struct.unpack("<f", raw)[0]
                elif info.dtype == "BF16" and info.numel == 1:
                    out[i] = struct.unpack("<f", b"\x00\x00" + raw)[0]
                elif info.dtype == "F16" and info.numel == 1:
                    out[i] = struct.unpack("<e", raw)[0]
                else:
                    raise ValueError(f"{info.name} is not a float scalar ({info.dtype}{list(info.shape)})")
        finally:
            os.close(fd)
    return out
