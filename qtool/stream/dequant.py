"""Load one module's weights from any storage format as a dense tensor (the codecs are qtool.formats),
and a whole decoder layer as the state dict transformers' Qwen3_5MoeDecoderLayer expects.

Formats (qtool.arch.model_map.Format): BF16/F16/F32 as stored (cast to the compute dtype); NVFP4 with
ModelOpt names (weight, weight_scale, weight_scale_2) or compressed-tensors names (weight_packed,
weight_scale, weight_global_scale = 1 / weight_scale_2); FP8 (weight + weight_scale); AWQ GEMM
(qweight, qzeros, scales); compressed-tensors INT4 (weight_packed I32 + weight_scale).
Routed experts stored per expert are written into transformers' fused in-memory layout
(`mlp.experts.gate_up_proj` [E, 2I, H] = gate rows then up rows, `mlp.experts.down_proj` [E, H, I];
transformers models/qwen3_5_moe Qwen3_5MoeExperts), one expert at a time.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol, TypeAlias

from qtool.arch.model_map import Format, ModelMap, Module
from qtool.arch.qwen35 import Group, layer_prefix
from qtool.errors import PlanError
from qtool.formats import awq, fp8, nvfp4
from qtool.formats.nvfp4 import BLOCK_SIZE
from qtool.io.dtypes import DTYPE_BITS, TORCH_DTYPE_NAMES
from qtool.io.input_files import open_for_reads
from qtool.io.safetensors_header import TensorInfo
from qtool.io.stream_digest import NO_DIGESTS, DigestSink
from qtool.stream import layer_read

if TYPE_CHECKING:
    import torch

    from qtool.stream.layer_read import LayerBytes

Device: TypeAlias = "str | torch.device"


class TensorBytes(Protocol):
    """Where a layer's tensors come from: a TensorSource (read now) or a layer_read.LayerBytes (read ahead)."""

    def get(self, info: TensorInfo) -> torch.Tensor: ...

    def close(self) -> None: ...


# Parameters that belong to a quantized format's storage or to calibration, never to the dense module.
_AUX_PARAMS = frozenset(
    {
        "weight_scale",
        "weight_scale_2",
        "weight_global_scale",
        "input_scale",
        "input_global_scale",
        "weight_packed",
        "weight_shape",
        "weight_zero_point",
        "qweight",
        "qzeros",
        "scales",
        "k_scale",
        "v_scale",
        "q_scale",
        "weight_scale_inv",
        "output_scale",
    }
)


def dense_numel(mod: Module) -> int:
    """Elements of the module's tensors once dense, from the header's byte counts and the module's
    signature (param, dtype, rank) alone: no TensorInfo is made (layer_sizes asks this of every module,
    ~93k in a 397B map). Packed 4-bit weights hold two elements a byte (NVFP4's U8, the INT4 formats'
    I32 words of eight)."""
    nbytes = mod.param_nbytes
    dtypes = {param: dtype for param, dtype, _ in mod.signature}
    plain = sum(
        nbytes(n) * 8 // DTYPE_BITS[dt]
        for n, dt in dtypes.items()
        if n not in _AUX_PARAMS and not (n == "weight" and dt in ("U8", "F8_E4M3", "F8_E5M2"))
    )
    fmt = mod.format
    if fmt in (Format.NVFP4, Format.NVFP4_CT):
        return nbytes("weight" if "weight" in dtypes else "weight_packed") * 2 + plain
    if fmt is Format.INT4_CT:
        return nbytes("weight_packed") * 2 + plain
    if fmt is Format.AWQ:
        return nbytes("qweight") * 2 + plain
    return plain + (nbytes("weight") if fmt is Format.FP8 else 0)


class TensorSource:
    """Reads tensors with pread into private memory, one open fd per shard while a layer is read
    (thousands of expert tensors). Not mmap: mapped shard pages would count towards the process's
    resident memory and double the peak of a layer load. Its reads are handed to `digests` (the job's
    inputs hashed from its reads: qtool.io.stream_digest)."""

    def __init__(self, digests: DigestSink = NO_DIGESTS) -> None:
        self._fds: dict[str, int] = {}
        self.digests = digests

    def get(self, info: TensorInfo) -> torch.Tensor:
        import torch

        fd = self._fds.get(info.file)
        if fd is None:
            fd = self._fds[info.file] = open_for_reads(info.file, self.digests.inputs)
        buf = bytearray(info.nbytes)
        layer_read.pread_exact(fd, memoryview(buf), info.start, info.file, tensor=info.name, digests=self.digests)
        dtype = getattr(torch, TORCH_DTYPE_NAMES[info.dtype])
        if info.nbytes == 0:
            return torch.empty(tuple(info.shape), dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(tuple(info.shape))

    def close(self) -> None:
        import os

        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


QUANTIZED = (Format.NVFP4, Format.NVFP4_CT, Format.FP8, Format.AWQ, Format.INT4_CT)


def stored_dense(model_map: ModelMap, name: str) -> bool:
    """Whether the tensor `name` is stored as its own dense values (not a quantized module's weight)."""
    mod = model_map.modules.get(name.rpartition(".")[0])
    return name in model_map.ckpt.tensors and (mod is None or mod.format not in QUANTIZED)


def load_param(
    model_map: ModelMap,
    name: str,
    dtype: torch.dtype,
    device: Device = "cpu",
    read: LayerBytes | None = None,
    digests: DigestSink = NO_DIGESTS,
) -> torch.Tensor:
    """The tensor `name` dense in `dtype` on `device` (a quantized weight dequantized); `read`: a
    qtool.stream.layer_read.LayerBytes that holds its bytes already (read ahead), else it is read here
    (handed to `digests`)."""
    info = model_map.ckpt.tensors.get(name)
    if info is None:
        raise PlanError("tensor missing from the checkpoint", path=model_map.ckpt.root, tensor=name)
    if not stored_dense(model_map, name):
        return dense_weight(model_map.modules[name.rpartition(".")[0]], dtype, device, TensorSource(digests))
    if read is not None and read.has(info):
        return read.get(info).to(device=device, dtype=dtype)
    src = TensorSource(digests)
    try:
        return src.get(info).to(device=device, dtype=dtype)
    finally:
        src.close()


EMBED_GAP = 1 << 20  # bytes of unused rows read through rather than split into another read


def embedding_rows(
    model_map: ModelMap,
    name: str,
    ids: torch.Tensor,
    dtype: torch.dtype,
    every_id: torch.Tensor | None = None,
    digests: DigestSink = NO_DIGESTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(table, lookup) with table[lookup[ids]] == load_param(mm, name, dtype)[ids]: the rows of the
    embedding matrix the token ids use, read alone (runs of nearby rows read together). A calibration set
    uses ~1-5% of the 397B's 248,320 rows, so its 2 GB table is not read to make the first layer's input
    (what the input's sha256 needs besides, the digest reads itself). A quantized embedding is dequantized
    whole, as load_param does. every_id: the ids of every rank (checked, so that a bad one stops them all
    with the same error, not one rank while the others wait at a barrier); default `ids`. The rows read are
    handed to `digests` (the job's inputs hashed from its reads)."""
    import torch

    info = model_map.ckpt.tensors.get(name)
    mod = model_map.modules.get(name.rpartition(".")[0])
    quantized = mod is not None and mod.format in (
        Format.NVFP4,
        Format.NVFP4_CT,
        Format.FP8,
        Format.AWQ,
        Format.INT4_CT,
    )
    if info is None or quantized or len(info.shape) != 2:
        w = load_param(model_map, name, dtype, digests=digests)
        return w, torch.arange(w.shape[0])
    rows, width = info.shape
    used = torch.unique(ids.reshape(-1)).tolist()  # sorted
    every = ids if every_id is None else every_id
    lo, hi = (int(every.min()), int(every.max())) if every.numel() else (0, 0)
    if lo < 0 or hi >= rows:
        bad = hi if hi >= rows else lo
        raise PlanError(
            f"token id {bad} is outside the embedding's {rows} rows",
            path=info.file,
            tensor=name,
            hint="the tokenizer does not belong to this checkpoint: use the model's own tokenizer.json",
        )
    row_bytes = info.nbytes // rows if rows else 0
    gap = EMBED_GAP // max(1, row_bytes)  # unused rows read through between two used ones
    runs: list[list[int]] = []  # [first, end) of the rows read
    for r in used:
        if runs and r - runs[-1][1] <= gap:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    n = sum(b - a for a, b in runs)
    buf = bytearray(n * row_bytes)
    view = memoryview(buf)
    lookup = torch.full((rows,), -1, dtype=torch.int64)
    fd = open_for_reads(info.file, digests.inputs)
    try:
        at = 0
        for a, b in runs:
            rows_view = view[at * row_bytes : (at + b - a) * row_bytes]
            layer_read.pread_exact(fd, rows_view, info.start + a * row_bytes, info.file, tensor=name, digests=digests)
            lookup[a:b] = torch.arange(at, at + b - a)
            at += b - a
    finally:
        os.close(fd)
    src_dtype = getattr(torch, TORCH_DTYPE_NAMES[info.dtype])
    table = torch.frombuffer(buf, dtype=src_dtype).reshape(n, width) if n else torch.empty(0, width, dtype=src_dtype)
    return table.to(dtype), lookup


def dense_weight(
    mod: Module, dtype: torch.dtype, device: Device = "cpu", src: TensorBytes | None = None
) -> torch.Tensor:
    """The module's weight matrix [out, in] as a dense `dtype` tensor on `device`."""

    source = src or TensorSource()
    p = mod.params

    def t(name: str) -> torch.Tensor:
        return source.get(p[name]).to(device)

    fmt = mod.format
    if fmt is Format.NVFP4:
        return nvfp4.dequantize(t("weight"), t("weight_scale"), t("weight_scale_2").float(), dtype=dtype)
    if fmt is Format.NVFP4_CT:
        # compressed-tensors stores the reciprocal global scale (docs/formats.md §4).
        ws2 = 1.0 / t("weight_global_scale").float().reshape(())
        return nvfp4.dequantize(t("weight_packed"), t("weight_scale"), ws2, dtype=dtype)
    if fmt is Format.FP8:
        return fp8.dequantize(t("weight"), t("weight_scale"), dtype=dtype)
    if fmt is Format.AWQ:
        return awq.from_awq(t("qweight"), t("qzeros"), t("scales")).dequantize(dtype)
    if fmt is Format.INT4_CT:
        if "weight_shape" in p:
            shape = t("weight_shape")
        else:
            wp = p["weight_packed"]
            shape = (*wp.shape[:-1], wp.shape[-1] * 8)
        zp = t("weight_zero_point") if "weight_zero_point" in p else None
        return awq.from_compressed_tensors(t("weight_packed"), t("weight_scale"), shape, zp).dequantize(dtype)
    if "weight" in p:
        return t("weight").to(dtype)
    raise PlanError(f"module has no weight matrix ({fmt})", tensor=mod.name)


def _in_layer(m: Module, idx: int, prefix: str) -> bool:
    """Whether decoder layer `idx` (named `prefix`) builds module `m` (the MTP head's layers are not theirs)."""
    return m.layer == idx and not m.is_mtp and m.name.startswith(prefix)


def missing_layer(model_map: ModelMap, idx: int) -> PlanError:
    """The error for a decoder layer without tensors (a truncated or mislabelled checkpoint)."""
    return PlanError(
        f"no tensors for decoder layer {idx}",
        path=model_map.ckpt.root,
        expected=layer_prefix(idx, model_map.naming) + "*",
    )


def _layer_modules(mm: ModelMap, idx: int) -> list[Module]:
    pre = layer_prefix(idx, mm.naming)
    mods = [m for m in mm.modules.values() if _in_layer(m, idx, pre)]
    if not mods:
        raise missing_layer(mm, idx)
    return mods


def modules_by_layer(model_map: ModelMap) -> list[list[Module]]:
    """Every decoder layer's modules (`_layer_modules` of each; an empty list where a layer has none), in one
    pass over the map's modules: for what looks at all layers at once (the 397B's ~95k modules, 60 layers)."""
    prefixes = [layer_prefix(i, model_map.naming) for i in range(model_map.num_layers)]
    out: list[list[Module]] = [[] for _ in prefixes]
    for m in model_map.modules.values():
        i = m.layer
        if i is not None and 0 <= i < len(out) and _in_layer(m, i, prefixes[i]):
            out[i].append(m)
    return out


def layer_tensors(model_map: ModelMap, idx: int) -> list[TensorInfo]:
    """Every tensor `layer_state_dict` reads for decoder layer `idx` (what the read-ahead fetches)."""
    return [info for m in _layer_modules(model_map, idx) if m.group is not Group.KV_SCALE for info in m.params.values()]


def layer_state_dict(
    model_map: ModelMap,
    idx: int,
    dtype: torch.dtype,
    device: Device,
    want: dict[str, tuple[tuple, object]],
    src: TensorBytes | None = None,
) -> dict:
    """State dict for transformers' decoder layer `idx` (local names, e.g. `mlp.experts.gate_up_proj`),
    every tensor dense in `dtype` on `device`; `want` = local name -> (shape, dtype) of the module.
    `src`: where the tensors come from (a qtool.stream.layer_read.LayerBytes read ahead; default: read
    now, one tensor at a time)."""
    import torch

    pre = layer_prefix(idx, model_map.naming)
    source: TensorBytes = src or TensorSource()
    sd: dict = {}
    mods = _layer_modules(model_map, idx)
    experts: dict[int, dict[str, Module]] = {}
    try:
        for mod in mods:
            if mod.group is Group.KV_SCALE:
                continue
            local = mod.name[len(pre) :]
            if mod.inner is Group.ROUTED_EXPERTS and mod.expert is not None:
                experts.setdefault(mod.expert, {})[local.rpartition(".")[2]] = mod
                continue
            if mod.format is not None and mod.format is not Format.BF16:
                _put(sd, want, local + ".weight", dense_weight(mod, dtype, device, source), mod.name)
                for name, info in mod.params.items():
                    if name == "bias":
                        _put(sd, want, local + ".bias", source.get(info).to(device, dtype), mod.name)
                continue
            for name, info in mod.params.items():
                if name in _AUX_PARAMS:
                    continue
                key = f"{local}.{name}"
                if key not in want:
                    raise PlanError(
                        "checkpoint tensor has no place in transformers' decoder layer",
                        tensor=info.name,
                        hint="is config.json's text_config from the same model as the weights?",
                    )
                _put(sd, want, key, source.get(info).to(device, dtype), info.name)
        if experts:
            _fill_experts(sd, want, experts, dtype, device, source)
    finally:
        source.close()
    missing = sorted(set(want) - set(sd))
    if missing:
        raise PlanError(
            f"decoder layer {idx} lacks {len(missing)} tensor(s)",
            path=model_map.ckpt.root,
            tensor=pre + missing[0],
            hint="the checkpoint is incomplete or its config does not match its weights",
        )
    del torch
    return sd


def _put(sd: dict, want: dict, key: str, tensor: torch.Tensor, origin: str) -> None:
    shape, _ = want.get(key, (None, None))
    if shape is None:
        raise PlanError("checkpoint tensor has no place in transformers' decoder layer", tensor=origin)
    if tuple(tensor.shape) != tuple(shape):
        raise PlanError(
            "tensor shape differs from the config's", tensor=origin, expected=list(shape), got=list(tensor.shape)
        )
    sd[key] = tensor


EXPERT_BATCH = 32  # experts dequantized by one batched call (a 397B batch: ~1 GB of float32 temporaries)


def _dense_experts(
    mods: list[Module], dtype: torch.dtype, device: Device, src: TensorBytes, want: tuple[int, int]
) -> torch.Tensor:
    """The same projection of several experts, dense [k, out, in]. NVFP4 (both namings) is dequantized in
    one batched call: per expert, ~10 small kernels x 1,536 matrices cost ~0.6 s of a 397B layer on a
    GPU. Element-wise the same arithmetic as one matrix at a time, so the values are identical."""
    import torch

    fmt = mods[0].format
    codes, scale, glob = (
        ("weight", "weight_scale", "weight_scale_2")
        if fmt is Format.NVFP4
        else ("weight_packed", "weight_scale", "weight_global_scale")
    )
    batched = fmt in (Format.NVFP4, Format.NVFP4_CT) and all(
        m.format is fmt
        and tuple(m.params[codes].shape) == (want[0], want[1] // 2)
        and tuple(m.params[scale].shape) == (want[0], want[1] // BLOCK_SIZE)
        for m in mods
    )
    if batched:

        def stacked(name: str) -> torch.Tensor:
            return torch.stack([src.get(m.params[name]).to(device) for m in mods])

        g = torch.stack([src.get(m.params[glob]).to(device).float().reshape(()) for m in mods])
        ws2 = g if fmt is Format.NVFP4 else 1.0 / g  # compressed-tensors stores the reciprocal
        return nvfp4.dequantize(stacked(codes), stacked(scale), ws2, dtype=dtype)
    dense = []
    for m in mods:  # one at a time: any format, and the expert whose shape is off is named
        w = dense_weight(m, dtype, device, src)
        if tuple(w.shape) != tuple(want):
            raise PlanError(
                "expert weight shape differs from the config's", tensor=m.name, expected=list(want), got=list(w.shape)
            )
        dense.append(w)
    return torch.stack(dense)


def _fill_experts(
    sd: dict,
    want: dict,
    experts: dict[int, dict[str, Module]],
    dtype: torch.dtype,
    device: Device,
    src: TensorBytes,
) -> None:
    import torch

    gu_shape = want["mlp.experts.gate_up_proj"][0]
    dn_shape = want["mlp.experts.down_proj"][0]
    n_exp, two_i, _h = gu_shape
    inter = two_i // 2
    if sorted(experts) != list(range(n_exp)):
        missing = sorted(set(range(n_exp)) - set(experts))
        raise PlanError(f"routed experts missing: {missing[:8]}", expected=f"{n_exp} experts", got=len(experts))
    gate_up = torch.empty(gu_shape, dtype=dtype, device=device)
    down = torch.empty(dn_shape, dtype=dtype, device=device)
    for e0 in range(0, n_exp, EXPERT_BATCH):
        es = range(e0, min(n_exp, e0 + EXPERT_BATCH))
        for part, dst in (
            ("gate_proj", gate_up[es.start : es.stop, :inter]),
            ("up_proj", gate_up[es.start : es.stop, inter:]),
            ("down_proj", down[es.start : es.stop]),
        ):
            mods = [experts[e][part] for e in es]
            dst.copy_(_dense_experts(mods, dtype, device, src, tuple(dst.shape[1:])))
    sd["mlp.experts.gate_up_proj"] = gate_up
    sd["mlp.experts.down_proj"] = down
