"""Quantize one decoder layer's routed experts from the dense in-memory layer + its calibration stats,
and stream the layer's shard (header first, then tensors in header order, experts in chunks)."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from qtool.formats import awq, nvfp4
from qtool.formats.fp8 import W8A8_PARAMS
from qtool.formats.nvfp4_triton import quantize_fast  # Triton kernel on CUDA, torch codec elsewhere
from qtool.io.files import copy_range, open_new, tmp_path
from qtool.io.hashed_writes import HashedWrites
from qtool.io.in_order import InOrder
from qtool.io.plan import promised
from qtool.io.writer import FileRange, InlineBytes, build_header
from qtool.lazy import lazy_module
from qtool.ops.calibrate_kv.calibrate import LayerStat
from qtool.ops.quantize import awq_search, local_hessian
from qtool.ops.quantize.awq_search import awq_down_scales, rtn
from qtool.ops.quantize.calib import ExpertStats
from qtool.ops.quantize.nvfp4_mse import four_over_six_block_scales, search_block_scales, sweep_block_scales
from qtool.ops.quantize.plan import QUANT_PARAMS, LayerPlan, QuantizePlan, Spec
from qtool.ops.quantize.schemes import code_fp8_linear
from qtool.recipes import InputScale, OutFormat, Recipe, Scheme, WeightScale
from qtool.stream.device_copy import Download, download

if TYPE_CHECKING:
    from qtool.ops.quantize.backends import LayerCoder

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

CHUNK_EXPERTS = 16
# copied tensors read with the layer are written in pieces of at most this size (one larger tensor alone):
# on CUDA they go down through page-locked memory, which stays bounded (the writer queues two), where a
# layer kept in BF16 copies ~13 GB at the 397B
COPY_PIECE = 256 << 20
WRITE_BUFFER = 16 << 20
_LAYER_FALLBACK_AMAX = 1.0  # a layer that saw no token at all (cannot happen with >= 1 window)


def _f32(x: float) -> bytes:
    return struct.pack("<f", x)


def input_amaxes(stats: ExpertStats, mode: InputScale) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert (gate/up input amax, down input amax). layer_max: ModelOpt's one input quantizer per
    projection shared by all experts (modelopt/torch/quantization/plugins/huggingface.py
    _QuantFusedExperts). per_expert: the expert's own amax; an expert below the token floor (ExpertStats.too_few:
    one that saw none, by default) takes the layer max (qtool.ops.quantize.coverage's `layer_amax`)."""
    lmax_in = float(stats.in_amax.max()) or _LAYER_FALLBACK_AMAX
    lmax_mid = float(stats.mid_amax.max()) or _LAYER_FALLBACK_AMAX
    e = stats.n_experts
    if mode is InputScale.LAYER_MAX:
        return torch.full((e,), lmax_in), torch.full((e,), lmax_mid)
    seen = ~stats.below_floor()
    return (
        torch.where(seen, stats.in_amax, torch.full((e,), lmax_in)),
        torch.where(seen, stats.mid_amax, torch.full((e,), lmax_mid)),
    )


@dataclass
class NVFP4Experts:
    """One projection (gate/up/down) of a chunk of experts, quantized; leading dim = expert.

    ModelOpt convention: dequant = fp4 * block_scale * weight_scale_2, input_scale = amax / (6 * 448).
    compressed-tensors stores the reciprocals (weight_global_scale, input_global_scale;
    docs/formats.md §4); a producer that computes those natively (llm-compressor) passes them, else they are
    1 / the ModelOpt values (which keeps the CT output equal to `qtool convert` of the ModelOpt output)."""

    packed: torch.Tensor  # uint8 [E, out, in/2]
    block_scale: torch.Tensor  # float8_e4m3fn [E, out, in/16]
    weight_scale_2: torch.Tensor  # float32 [E]
    input_scale: torch.Tensor  # float32 [E]
    weight_global_scale: torch.Tensor | None = None  # float32 [E]
    input_global_scale: torch.Tensor | None = None  # float32 [E]

    def expert_tensors(self, fmt: OutFormat) -> list[list[torch.Tensor]]:
        """Per expert, the params in QUANT_PARAMS order of `fmt`, on the codes' device (written by
        `chunk_bytes` in one device->host copy per chunk, not one per expert and param)."""
        one = torch.tensor(1.0, dtype=torch.float32)
        dev = self.packed.device
        # the reciprocal scales on the host, as they always were computed (bit for bit), then to the device once
        cpu = {
            f: None if getattr(self, f) is None else getattr(self, f).cpu()
            for f in ("weight_scale_2", "input_scale", "weight_global_scale", "input_global_scale")
        }
        ws2, ins, gs_w, gs_in = (
            cpu["weight_scale_2"],
            cpu["input_scale"],
            cpu["weight_global_scale"],
            cpu["input_global_scale"],
        )
        assert ws2 is not None and ins is not None  # (fields without a default)
        if fmt is OutFormat.MODELOPT:
            a = (ins if gs_in is None else one / gs_in).to(dev)
            b = (ws2 if gs_w is None else one / gs_w).to(dev)
            return [[a[k], self.packed[k], self.block_scale[k], b[k]] for k in range(self.packed.shape[0])]
        a = (one / ins if gs_in is None else gs_in).to(dev)
        b = (one / ws2 if gs_w is None else gs_w).to(dev)
        return [
            [a[k].reshape(1), b[k].reshape(1), self.packed[k], self.block_scale[k]] for k in range(self.packed.shape[0])
        ]


def chunk_bytes(tensors: list[torch.Tensor]) -> Download:
    """The tensors' bytes back to back (their order in the shard), as a qtool.stream.device_copy.Download:
    one device concatenation and one non-blocking device->host copy into page-locked memory (torch's
    caching host allocator reuses it), instead of a `.cpu()` and a Python buffer per tensor."""

    dev = next((t.device for t in tensors if t.numel() > 1), tensors[0].device)
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8).to(dev) for t in tensors]
    return download(torch.cat(flat) if len(flat) > 1 else flat[0])


def copied_whole(layer_plan: LayerPlan) -> bool:
    """Whether every routed expert of layer plan `layer_plan` is copied unchanged (a layer kept in BF16: whole
    tensors of a per-expert source, byte slices of a fused one): its shard is then written from the bytes
    read, not from the dense layer."""
    return layer_plan.scheme is Scheme.BF16 and all(
        s.source is not None for s in layer_plan.specs if _expert_of(s.name)
    )


def release_dense_experts(layer: torch.nn.Module) -> None:
    """Drop the dense expert weights of a layer whose forward is done and whose experts are written from
    the bytes read with it (`copied_whole`): the write behind the next layer then holds those bytes on the
    device instead of both (~13 GB more at the 397B)."""
    experts = layer.mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        setattr(experts, name, None)


def _write_chunk(out: HashedWrites | BinaryIO, data: Download) -> None:
    out.write(memoryview(data.wait().numpy()))


def _position(f: BinaryIO, at: int, hashed: bool, name: str) -> None:
    """Move to where `name`'s bytes go (another rank's specs were skipped); one writer writes in order."""
    if f.tell() != at:
        if hashed:  # one writer writes the shard in order: the hash is of the bytes written
            raise AssertionError(f"{name}: written at {f.tell()}, planned at {at}")
        f.seek(at)


def _nvfp4_parts(
    gu: torch.Tensor, down: torch.Tensor, inter: int
) -> tuple[tuple[str, torch.Tensor, torch.Tensor], ...]:
    """(part, weight, per-matrix amax) of a chunk of experts: gate_proj and up_proj share one amax, so
    one weight_scale_2 (vLLM requirement; ModelOpt's `preprocess_linear_fusion` takes the larger)."""

    gate, up = gu[:, :inter], gu[:, inter:]
    amax_gu = torch.maximum(nvfp4.matrix_amax(gate), nvfp4.matrix_amax(up))
    amax_dn = nvfp4.matrix_amax(down)
    return (("down_proj", down, amax_dn), ("gate_proj", gate, amax_gu), ("up_proj", up, amax_gu))


def _block_scales(
    w: torch.Tensor, global_amax: torch.Tensor, weight_scale_2: torch.Tensor, method: WeightScale
) -> torch.Tensor | None:
    """The block scales a recipe's `nvfp4.weight_scale` asks for (None: round to nearest from the max)."""

    if method is WeightScale.MSE:
        return search_block_scales(w, weight_scale_2)
    if method is WeightScale.MSE_SWEEP:
        return sweep_block_scales(w, global_amax)
    return None


def nvfp4_scales(
    w: torch.Tensor, w_amax: torch.Tensor, method: WeightScale
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(block scales or None for round to nearest from the max, weight_scale_2) of weights `w` [E, out, in]
    with per-matrix amaxes `w_amax` [E], as the recipe's `nvfp4.weight_scale` chooses them (also the grid
    GPTQ codes on: qtool.ops.quantize.gptq_layer)."""
    if method is WeightScale.FOUR_OVER_SIX:  # its own global scale (amax / (6 * 256))
        return four_over_six_block_scales(w, w_amax)
    ws2 = nvfp4.weight_scale_2_from_amax(w_amax)
    return _block_scales(w, w_amax, ws2, method), ws2


def nvfp4_rtn(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    inter: int,
    in_amax: torch.Tensor,
    mid_amax: torch.Tensor,
    recipe: Recipe,
    searched: Any = None,
) -> dict[str, NVFP4Experts]:
    """qtool's own NVFP4 of a chunk of experts (ModelOpt numerics; MSE-searched block scales when the
    recipe asks). Every expert is coded on its own: the chunking does not change a byte. `searched`:
    fn(part, w, global_amax) -> block scales from the layer's statistics (local_hessian), else None."""
    res: dict[str, NVFP4Experts] = {}
    amaxes = {"down_proj": mid_amax, "gate_proj": in_amax, "up_proj": in_amax}
    for part, w, w_amax in _nvfp4_parts(gate_up, down, inter):
        amax = amaxes[part]
        if searched is None:
            bs, ws2 = nvfp4_scales(w, w_amax, recipe.nvfp4.weight_scale)
        else:  # local_hessian: the block scales from the layer's statistics, max's weight_scale_2
            ws2 = nvfp4.weight_scale_2_from_amax(w_amax)
            bs = searched(part, w, w_amax)
        q = quantize_fast(w, weight_scale_2=ws2, block_scale=bs)
        res[part] = NVFP4Experts(
            q.packed,
            q.block_scale,
            q.weight_scale_2.reshape(-1).float(),
            nvfp4.input_scale_from_amax(amax.float()).reshape(-1),
        )
    return res


def _int4_expert_chunk(
    gu: torch.Tensor,
    down: torch.Tensor,
    inter: int,
    stats: ExpertStats | None,
    e0: int,
    recipe: Recipe,
    fmt: OutFormat,
    report: list[dict],
    g: int,
    gptq: Any = None,
) -> dict[str, list]:
    """INT4 W4A16 of a chunk of experts with qtool.formats.awq (RTN, one group per row when in < group),
    after the AWQ down_proj scale search when the recipe asks for it; by GPTQ on RTN's grid where `gptq`
    (a gptq_layer.GptqLayer) is given. The chunk is coded as one batch
    (elementwise ops and group max/min: each expert's bytes are those of coding it alone), so the GPU
    sees a few large ops, not a Python loop of small ones, and the host waits once, for the report."""

    sdt = _int4_scale_dtype(fmt)
    gate, up, dn = gu[:, :inter], gu[:, inter:], down
    s = None
    searched = None
    if recipe.int4.awq and stats is not None:
        rows = [torch.empty(0) if stats.too_few(e) else stats.rows(e) for e in range(e0, e0 + gu.shape[0])]
        searched = awq_down_scales(rows, dn, g, recipe.int4.awq_grid, sdt)  # no rows: s = 1, plain RTN
        s = searched.s

    def folded(part: str, w: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
        """Experts k0..k1-1 of `w`, the AWQ scales folded in: down columns * s, up rows / s (exact in real
        arithmetic); a batch at a time, so the float32 copies stay within the batch's bound."""
        w = w[k0:k1]
        if s is None or part == "gate_proj":
            return w
        if part == "down_proj":
            return (w.float() * s[k0:k1, None, :]).to(w.dtype)
        return (w.float() / s[k0:k1, :, None]).to(w.dtype)

    res: dict[str, list] = {"down_proj": [], "gate_proj": [], "up_proj": []}
    for part, w in (("down_proj", dn), ("gate_proj", gate), ("up_proj", up)):
        per = max(1, awq_search.CANDIDATE_BYTES // (w[0].numel() * 4))  # the transients of a batch: as the search's
        per = w.shape[0] if gptq is not None else per  # GPTQ: the chunk at once (its column loop's kernels)
        shape = torch.tensor(w.shape[1:], dtype=torch.int64)
        for k0 in range(0, w.shape[0], per):
            wk = folded(part, w, k0, k0 + per)
            if gptq is None:
                q = rtn(wk, g, sdt)
            else:  # GPTQ codes on RTN's grid (the AWQ scales of down_proj's inputs go into its Hessian)
                s_in = s[k0 : k0 + per] if s is not None and part == "down_proj" else None
                q = gptq.int4(part, wk, range(e0 + k0, e0 + k0 + wk.shape[0]), s_in, g, sdt)
            if fmt is OutFormat.COMPRESSED_TENSORS:
                t = awq.to_compressed_tensors(q, sdt)
                res[part] += [[t["weight_packed"][k], t["weight_scale"][k], shape] for k in range(q.codes.shape[0])]
            else:
                t = awq.to_awq(q)
                res[part] += [[t["qweight"][k], t["qzeros"][k], t["scales"][k]] for k in range(q.codes.shape[0])]
    if searched is not None:
        report.extend(searched.report(e0))
    return res


def _int4_scale_dtype(fmt: OutFormat) -> torch.dtype:
    """INT4 scales are rounded to the stored dtype before the codes are computed (stored scales and
    codes agree): float16 in AutoAWQ's form, bfloat16 in compressed-tensors'."""
    return torch.float16 if fmt is OutFormat.AWQ else torch.bfloat16


@dataclass(frozen=True)
class Share:
    """The part of a layer shard one rank codes and writes: rank 0 writes the header, the copied tensors
    and the KV scales; the routed experts go by chunk (chunk k on rank k % world), so the codecs, AWQ's
    scale search and the MSE block-scale search are split over the ranks with nothing to gather: each
    rank writes its experts' bytes at their offsets in the one file (every rank sees the same disk)."""

    rank: int = 0
    world: int = 1
    # experts per chunk where every rank has work: GPTQ's is its solve group (hessians.SOLVE_EXPERTS), so that a
    # rank holds the Hessians of whole groups and solves them alone, in the groups one process solves
    unit: int = CHUNK_EXPERTS

    def chunk(self, n_experts: int) -> int:
        """Experts per chunk: `unit`, smaller where that leaves a rank without work."""
        return max(1, min(self.unit, -(-n_experts // self.world)))

    def owner(self, expert: int, n_experts: int) -> int:
        """The rank that codes `expert`."""
        return (expert // self.chunk(n_experts)) % self.world

    def owns(self, spec_expert: int | None, n_experts: int) -> bool:
        """Whether this rank writes a spec: of `spec_expert`, or (None) not an expert's."""
        if spec_expert is None:
            return self.rank == 0
        return self.owner(spec_expert, n_experts) == self.rank


def create_layer_tmp(path: Path, mode: int = 0o644) -> None:
    """The empty file the ranks write their shares into (rank 0, before the others open it)."""

    os.close(open_new(tmp_path(path), mode))


def _expert_of(name: str) -> tuple[int, str, str] | None:
    """(expert, part, param) of a quantized expert param `...experts.{E}.{part}.{param}`, else None."""
    if ".mlp.experts." not in name:
        return None
    mod, _, param = name.rpartition(".")
    rest = mod.rpartition(".mlp.experts.")[2]
    return int(rest.partition(".")[0]), rest.partition(".")[2], param


def write_layer_shard(
    path: Path,
    layer_plan: LayerPlan,
    layer: torch.nn.Module,
    stats: ExpertStats,
    kv_amax: tuple[float, float] | None,
    plan: QuantizePlan,
    backend: LayerCoder | None = None,
    mode: int = 0o644,
    share: Share = Share(),
    keep_pace: bool = False,
) -> dict:
    """Write `layer_plan.specs` to `path`. One rank: the whole shard to a tmp file renamed to `path`. Several:
    this rank's Share into the tmp file rank 0 made (create_layer_tmp), at the header's offsets, fsynced;
    rank 0 renames it (os.replace) once every rank's share is on disk. `layer`: the dense transformers
    layer; `stats`: ExpertStats; `kv_amax`: (k_amax, v_amax) or None; `backend`: a peer backend's per-layer
    state (qtool.ops.quantize.backends) that quantizes the NVFP4 experts instead of qtool's RTN.
    `keep_pace`: the job's last layer, whose write no layer waits for: the writer goes at the pace of the
    shard's sha256, which then hashes the written buffers at one core's full rate instead of reading the
    file back behind the writer (io.writer.HashedWrites), and the job ends when that digest does. The hash
    then holds two chunks (the one it hashes and one queued; a 397B chunk of 16 experts is ~108 MB, a
    128 MiB page-locked block) besides the pipeline's three (the one being written, one queued, the one
    coded): five, where a trailing hash's writer holds three in the steady state and up to seven before
    the hash falls behind. The others trail the file: layers in flight wait for their writes."""

    report: dict = {"awq": []}
    header = build_header([promised(s.name, s.dtype, s.shape, s.nbytes) for s in layer_plan.specs])
    names = (
        [n for n, _, _ in QUANT_PARAMS[(layer_plan.scheme, plan.format)]]
        if layer_plan.scheme is not Scheme.BF16
        else []
    )
    tmp = tmp_path(path)
    fds: dict[str, int] = {}
    out = None
    hashed = share.world == 1  # one writer, in file order: the shard's sha256 is computed as it is written
    kept = getattr(layer, "qtool_bytes", {})  # the copied tensors' file bytes, read with the layer
    try:
        fd = open_new(tmp, mode) if share.world == 1 else os.open(tmp, os.O_WRONLY)
        # buffered: the small tensors (norms, scales) become a few large writes
        with os.fdopen(fd, "wb", buffering=WRITE_BUFFER) as f:
            out = HashedWrites(f, path=tmp, keep_pace=keep_pace) if hashed else f
            ops = InOrder()  # the file's writes, in order, while the next chunk is coded
            try:
                _write_specs(
                    ops,
                    out,
                    f,
                    layer_plan,
                    layer,
                    stats,
                    kv_amax,
                    plan,
                    backend,
                    share,
                    header,
                    names,
                    kept,
                    fds,
                    hashed,
                    report,
                )
                ops.close()  # every write done; a write's error is raised here
            except BaseException:
                ops.abandon()  # nothing is left writing once the file closes (also after a partial close)
                raise
            if hashed:
                assert isinstance(out, HashedWrites)  # (what a hashed shard is written through)
                report["sha256"] = out.digest()  # a Future: the hash finishes on its own thread
            f.flush()
            os.fsync(f.fileno())
        if share.world == 1:
            os.replace(tmp, path)
    except BaseException:
        if isinstance(out, HashedWrites):
            out.stop()  # before or after digest() (a failed flush, fsync or rename): the hash ends here
        if tmp.exists():
            tmp.unlink()  # the layer is redone on resume (it was not journaled)
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    return report


def _write_specs(
    ops: InOrder,
    out: HashedWrites | BinaryIO,
    f: BinaryIO,
    layer_plan: LayerPlan,
    layer: torch.nn.Module,
    stats: ExpertStats,
    kv_amax: tuple[float, float] | None,
    plan: QuantizePlan,
    backend: LayerCoder | None,
    share: Share,
    header: bytes,
    names: list[str],
    kept: dict,
    fds: dict,
    hashed: bool,
    report: dict,
) -> None:
    """Code the layer's tensors in header order and queue their bytes on `ops` (coded here, written there)."""

    experts = layer.mlp.experts
    inter = plan.inter
    n_exp = plan.n_experts
    step = share.chunk(n_exp)
    specs = layer_plan.specs
    in_amax, mid_amax = input_amaxes(stats, plan.recipe.nvfp4.input_scale)
    coded: dict[str, dict] = {}  # FP8 linear -> its coded tensors by parameter name
    if share.rank == 0:
        ops.call(out.write, header)
    pos = len(header)  # where the next spec's bytes go; another rank's specs are skipped by seeking
    i = 0
    while i < len(specs):
        s = specs[i]
        i += 1
        at, pos = pos, pos + s.nbytes
        which = _expert_of(s.name) if s.source is None else None  # None: copied, or a KV scale
        if not share.owns(which[0] if which else None, n_exp):
            continue
        ops.call(_position, f, at, hashed, s.name)
        if s.source is not None:
            if s.name not in kept:  # not read with the layer: from its file
                ops.call(_copy_spec, s, out, f, fds, hashed, pos)
                continue
            # read with the layer (to the device, on CUDA): the copied tensors that follow in the header go
            # out together, in pieces of at most COPY_PIECE (through page-locked memory, behind the forward)
            group = [kept[s.name]]
            while (
                i < len(specs)
                and specs[i].source is not None
                and specs[i].name in kept
                and pos - at + specs[i].nbytes <= COPY_PIECE
            ):
                group.append(kept[specs[i].name])
                pos += specs[i].nbytes
                i += 1
            data = chunk_bytes(group)
            if data.host.numel() != pos - at:
                raise AssertionError(f"{s.name}: copied {data.host.numel()} bytes, planned {pos - at}")
            ops.call(_write_chunk, out, data)
            continue
        rel = _fp8_linear_of(s.name, layer_plan) if which is None else None
        if rel is not None:  # a dense linear the recipe codes FP8: its tensors in name order (one module)
            if rel not in coded:
                coded[rel] = code_fp8_linear(layer, rel, plan.format)
            ops.call(_write_chunk, out, chunk_bytes([coded[rel][s.name.rpartition(".")[2]]]))
            continue
        if which is None:
            assert kv_amax is not None  # a KV scale of a full-attention layer, whose amaxes were taken
            st = LayerStat(layer_plan.index, kv_amax[0], kv_amax[1], 0)
            ops.call(out.write, _f32(st.k_scale if s.name.endswith("k_scale") else st.v_scale))
            continue
        # the first param of a chunk of experts: the chunk's params follow it in the header (experts in
        # order), coded together and written as one buffer
        e0 = (which[0] // step) * step
        e1 = min(n_exp, e0 + step)
        members = [(s, which)]
        while i < len(specs) and specs[i].source is None:
            w = _expert_of(specs[i].name)
            if w is None or w[0] >= e1:
                break
            members.append((specs[i], w))
            pos += specs[i].nbytes
            i += 1
        gu = experts.gate_up_proj.data[e0:e1]
        dn = experts.down_proj.data[e0:e1]
        if layer_plan.scheme is Scheme.NVFP4:
            a_in, a_mid = in_amax[e0:e1], mid_amax[e0:e1]
            if backend is not None:
                parts = backend.nvfp4_chunk(e0, e1, gu, dn, a_in, a_mid)
            else:
                searched = None
                if stats.local_hessians is not None:
                    searched = partial(local_hessian.chunk_block_scales, stats, e0, e1)
                parts = nvfp4_rtn(gu, dn, inter, a_in, a_mid, plan.recipe, searched)
            chunk = {part: q.expert_tensors(plan.format) for part, q in parts.items()}
        else:
            chunk = _int4_expert_chunk(
                gu, dn, inter, stats, e0, plan.recipe, plan.format, report["awq"], plan.int4_group, backend
            )  # one group for every projection (engine rule)
        data = chunk_bytes([chunk[part][e - e0][names.index(param)] for _, (e, part, param) in members])
        if data.host.numel() != pos - at:
            raise AssertionError(
                f"{s.name}: experts {e0}-{e1 - 1} coded to {data.host.numel()} bytes, planned {pos - at}"
            )
        ops.call(_write_chunk, out, data)


def _fp8_linear_of(name: str, layer_plan: LayerPlan) -> str | None:
    """The FP8-coded linear (relative to the layer) a computed tensor `name` belongs to, else None."""
    module, _, param = name.rpartition(".")
    if not layer_plan.fp8 or param not in W8A8_PARAMS:  # (the KV scales sit on k_proj / v_proj too)
        return None
    rel = module.partition(f"layers.{layer_plan.index}.")[2]
    return rel if rel in layer_plan.fp8 else None


def _copy_spec(s: Spec, out: HashedWrites | BinaryIO, f: BinaryIO, fds: dict, hashed: bool, end: int) -> None:
    """Write a tensor copied unchanged from its source file (read, where the shard is being hashed; else
    copied in the kernel, below the buffer)."""
    assert s.source is not None  # a copied spec
    if s.source.file not in fds:
        fds[s.source.file] = os.open(s.source.file, os.O_RDONLY)
    if hashed:
        out.write(os.pread(fds[s.source.file], s.source.nbytes, s.source.start))
        return
    f.flush()
    copy_range(fds[s.source.file], f.fileno(), s.source.start, s.source.nbytes)
    f.seek(end)  # the descriptor moved under the buffer


__all__ = [
    "FileRange",
    "InlineBytes",
    "Share",
    "copied_whole",
    "create_layer_tmp",
    "input_amaxes",
    "release_dense_experts",
    "write_layer_shard",
]
