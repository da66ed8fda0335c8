"""Quantize one decoder layer's routed experts from the dense in-memory layer + its calibration stats,
and stream the layer's shard (header first, then tensors in header order, experts in chunks)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import torch

from qtool.io.writer import FileRange, InlineBytes, OutTensor, build_header, copy_range
from qtool.recipes import InputScale, OutFormat, Scheme, WeightScale

CHUNK_EXPERTS = 16
_LAYER_FALLBACK_AMAX = 1.0  # a layer that saw no token at all (cannot happen with >= 1 window)


class _Pending:
    def __init__(self, n: int):
        self.nbytes = n


def _b(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn):
        t = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int16)
    return t.numpy().tobytes()


def _f32(x: float) -> bytes:
    return struct.pack("<f", x)


def input_amaxes(stats, mode: InputScale) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert (gate/up input amax, down input amax). layer_max: ModelOpt's one input quantizer per
    projection shared by all experts (modelopt/torch/quantization/plugins/huggingface.py
    _QuantFusedExperts). per_expert: the expert's own amax; an expert that saw no token takes the layer max."""
    lmax_in = float(stats.in_amax.max()) or _LAYER_FALLBACK_AMAX
    lmax_mid = float(stats.mid_amax.max()) or _LAYER_FALLBACK_AMAX
    e = stats.n_experts
    if mode is InputScale.LAYER_MAX:
        return torch.full((e,), lmax_in), torch.full((e,), lmax_mid)
    seen = stats.tokens > 0
    return (torch.where(seen, stats.in_amax, torch.full((e,), lmax_in)),
            torch.where(seen, stats.mid_amax, torch.full((e,), lmax_mid)))


def _nvfp4_expert_chunk(gu, down, inter, in_amax, mid_amax, recipe, fmt, overrides) -> dict[str, list[bytes]]:
    """Returns part -> per-expert list of the params' bytes in QUANT_PARAMS order."""
    from qtool.formats import nvfp4
    from qtool.ops.quantize.nvfp4_mse import search_block_scales

    gate, up = gu[:, :inter], gu[:, inter:]
    ws2_gu = nvfp4.shared_weight_scale_2(gate, up)
    ws2_dn = nvfp4.weight_scale_2_from_amax(nvfp4.matrix_amax(down))
    if overrides is not None:  # backend-provided amaxes (ModelOpt quantizers)
        ws2_gu, ws2_dn = overrides["ws2_gu"], overrides["ws2_dn"]
    res: dict[str, list] = {}
    for part, w, ws2, amax in (("down_proj", down, ws2_dn, mid_amax), ("gate_proj", gate, ws2_gu, in_amax),
                               ("up_proj", up, ws2_gu, in_amax)):
        bs = None
        if overrides is not None and overrides.get(part) is not None:
            bs = overrides[part]
        elif recipe.nvfp4.weight_scale is WeightScale.MSE:
            bs = search_block_scales(w, ws2)
        q = nvfp4.quantize(w, weight_scale_2=ws2, block_scale=bs)
        in_scale = nvfp4.input_scale_from_amax(amax.float())
        rows = []
        for k in range(w.shape[0]):
            if fmt is OutFormat.MODELOPT:
                rows.append([_b(in_scale[k]), _b(q.packed[k]), _b(q.block_scale[k]), _b(q.weight_scale_2[k])])
            else:
                # compressed-tensors stores the reciprocal global scales (formats doc section 4); taking
                # 1/weight_scale_2 keeps the CT output equal to `qtool convert` of the ModelOpt output.
                gs_w = torch.tensor(1.0, dtype=torch.float32) / q.weight_scale_2[k]
                gs_in = torch.tensor(1.0, dtype=torch.float32) / in_scale[k]
                rows.append([_b(gs_in.reshape(1)), _b(gs_w.reshape(1)), _b(q.packed[k]), _b(q.block_scale[k])])
        res[part] = rows
    return res


def _int4_expert_chunk(gu, down, inter, stats, e0, recipe, fmt, report) -> dict[str, list]:
    from qtool.ops.quantize import int4

    g = recipe.int4.group_size
    res: dict[str, list] = {p: [] for p in ("down_proj", "gate_proj", "up_proj")}
    for k in range(gu.shape[0]):
        e = e0 + k
        gate, up, dn = gu[k, :inter], gu[k, inter:], down[k]
        if recipe.int4.awq and stats is not None:
            s, alpha, mse, rtn = int4.awq_down_scales(stats.rows(e), dn, g, recipe.int4.awq_grid)
            # fold: down columns * s, up rows / s (exact in real arithmetic)
            dn = (dn.float() * s).to(dn.dtype)
            up = (up.float() / s.unsqueeze(-1)).to(up.dtype)
            report.append({"expert": e, "alpha": alpha, "down_mse": mse, "down_mse_rtn": rtn})
        for part, w in (("down_proj", dn), ("gate_proj", gate), ("up_proj", up)):
            q = int4.quantize(w, g)
            if fmt is OutFormat.COMPRESSED_TENSORS:
                shape = torch.tensor(list(w.shape), dtype=torch.int64)
                res[part].append([_b(int4.pack_ct(q.q)), _b(q.scale.to(torch.bfloat16)), _b(shape)])
            else:
                qw, qz, sc = int4.pack_awq(q)
                res[part].append([_b(qw), _b(qz), _b(sc)])
    return res


def write_layer_shard(path: Path, lp, layer, stats, kv, p, overrides=None) -> dict:
    """Write `lp.specs` to `path` (tmp + rename). `layer`: the dense transformers layer; `stats`:
    ExpertStats; `kv`: (k_amax, v_amax) or None; overrides: backend amaxes per expert chunk fn."""
    from qtool.ops.calibrate_kv import LayerStat

    experts = layer.mlp.experts
    inter = p.inter
    report: dict = {"awq": []}
    in_amax, mid_amax = input_amaxes(stats, p.recipe.nvfp4.input_scale)
    header = build_header([OutTensor(s.name, s.dtype, s.shape, _Pending(_nbytes(s))) for s in lp.specs])
    tmp = path.with_name("." + path.name + ".tmp")
    fds: dict[str, int] = {}
    n_exp = p.n_experts
    quantized = lp.scheme is not Scheme.BF16
    per_expert_specs = 0
    if quantized:
        from qtool.ops.quantize.plan import QUANT_PARAMS

        per_expert_specs = len(QUANT_PARAMS[(lp.scheme, p.format)])
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.flush()
            dst = f.fileno()
            chunk: dict = {}
            chunk_start = -1
            for s in lp.specs:
                if s.source is not None:
                    if s.source.file not in fds:
                        fds[s.source.file] = os.open(s.source.file, os.O_RDONLY)
                    copy_range(fds[s.source.file], dst, s.source.start, s.source.nbytes)
                    continue
                if s.name.endswith(("k_scale", "v_scale")):
                    st = LayerStat(lp.index, kv[0], kv[1], 0)
                    _write_all(dst, _f32(st.k_scale if s.name.endswith("k_scale") else st.v_scale))
                    continue
                # a quantized expert param: ...experts.{E}.{part}.{param}
                mod, _, param = s.name.rpartition(".")
                rest = mod.rpartition(".mlp.experts.")[2]
                e = int(rest.partition(".")[0])
                part = rest.partition(".")[2]
                if not (chunk_start <= e < chunk_start + CHUNK_EXPERTS) or chunk_start < 0:
                    chunk_start = (e // CHUNK_EXPERTS) * CHUNK_EXPERTS
                    e1 = min(n_exp, chunk_start + CHUNK_EXPERTS)
                    gu = experts.gate_up_proj.data[chunk_start:e1]
                    dn = experts.down_proj.data[chunk_start:e1]
                    if lp.scheme is Scheme.NVFP4:
                        ov = overrides(chunk_start, e1) if overrides is not None else None
                        chunk = _nvfp4_expert_chunk(gu, dn, inter, in_amax[chunk_start:e1], mid_amax[chunk_start:e1],
                                                    p.recipe, p.format, ov)
                    else:
                        chunk = _int4_expert_chunk(gu, dn, inter, stats, chunk_start, p.recipe, p.format, report["awq"])
                from qtool.ops.quantize.plan import QUANT_PARAMS

                names = [n for n, _, _ in QUANT_PARAMS[(lp.scheme, p.format)]]
                data = chunk[part][e - chunk_start][names.index(param)]
                if len(data) != _nbytes(s):
                    raise AssertionError(f"{s.name}: {len(data)} bytes, planned {_nbytes(s)}")
                _write_all(dst, data)
            os.fsync(dst)
        os.replace(tmp, path)
    finally:
        for fd in fds.values():
            os.close(fd)
        if tmp.exists():
            tmp.unlink()
    del per_expert_specs
    return report


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _nbytes(s) -> int:
    from qtool.io.dtypes import nbytes_for

    return nbytes_for(s.dtype, s.shape)


def write_rest_shard(path: Path, specs) -> None:
    from qtool.io.writer import write_shard

    tmp = path.with_name("." + path.name + ".tmp")
    write_shard(tmp, [OutTensor(s.name, s.dtype, s.shape, s.source) for s in specs])
    os.replace(tmp, path)


__all__ = ["write_layer_shard", "write_rest_shard", "input_amaxes", "FileRange", "InlineBytes"]
