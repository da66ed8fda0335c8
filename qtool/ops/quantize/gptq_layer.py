"""GPTQ of one layer's routed experts (recipe `gptq: {enabled: true}`): the Hessians gathered in the layer's
forward (hessians.ExpertHessians, on calib.ExpertStats.hooks), the codes solved by qtool.ops.quantize.gptq
on the grid RTN would use, and handed to the layer's writer in the layout it writes for RTN.

NVFP4: each projection's block scales and global scale are those of the recipe's `nvfp4.weight_scale`
(max, mse, mse_sweep, four_over_six; layer.nvfp4_scales), from the weights, before any error compensation
(`gptq.scales: fixed`), or each block's chosen as GPTQ reaches it, from its error-updated weights, by max,
mse_sweep or local_hessian (`gptq.scales: updated`: UpdatedScales), with the max's global scale;
gate_proj and up_proj share their global scale and their Hessian (one input), and are solved as one
matrix (GPTQ treats every row alike). down_proj's Hessian is that of its input in the layer's forward,
act(gate) * up from the dense weights (as llm-compressor's sequential pipeline calibrates the whole layer
before it codes it).
W4A16: symmetric INT4 on RTN's group scales (layer._int4_expert_chunk); after an AWQ search the down_proj
input is x / s, so its Hessian is H / (s s^T).

An expert that saw no token, or too few (calib.ExpertStats.too_few where the coverage policy provides
it), or whose Hessian is not finite or cannot be factorised, is coded by RTN and named in the layer's
report (`rtn_experts`).

Several ranks (`--nproc`/`--devices`): every rank runs the layer's forward over every calibration window,
in one process's order (stage.QuantizeStage.every_window), and sums the Hessians of the experts it codes
only (layer.Share, whose chunk is a solve group here): each Hessian is the one process's, added in the
same order with the same shapes, so the bytes do not depend on the number of ranks. The solves, the cost
of a GPTQ layer, are split over the ranks, and so are the Hessians' memory; the forward is not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qtool.formats import awq, nvfp4, nvfp4_triton
from qtool.lazy import lazy_module
from qtool.ops.quantize import gptq, gptq_triton, hessians
from qtool.ops.quantize.awq_search import rtn
from qtool.ops.quantize.calib import ExpertStats
from qtool.ops.quantize.hessians import ExpertHessians
from qtool.ops.quantize.layer import NVFP4Experts, nvfp4_scales
from qtool.ops.quantize.local_hessian import hessian_block_scales, plain_blocks
from qtool.ops.quantize.nvfp4_mse import sweep_block_scales
from qtool.recipes import GptqOptions, GptqScales, Recipe, WeightScale

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from qtool.stream.experts import Recorder
else:
    torch = lazy_module("torch")


class GptqLayer:
    """A layer's GPTQ coder, made before its forward (`hooks` go on the layer's ExpertStats) and used by
    layer.write_layer_shard for its chunks of experts (`nvfp4_chunk`, `int4`), on the loop's thread."""

    def __init__(
        self,
        recipe: Recipe,
        stats: ExpertStats,
        inter: int,
        experts: torch.nn.Module,
        kept: Callable[[int], bool] | None = None,
    ) -> None:
        """`kept(e)`: whether this rank codes expert e (None: every expert); only those Hessians are summed."""
        self.recipe = recipe
        self.experts = experts  # the layer's Qwen3_5MoeExperts: a solve group's weights (nvfp4_chunk)
        self.n_experts = stats.n_experts
        self._solved: tuple[tuple[int, int], dict] | None = None
        self.options: GptqOptions = recipe.gptq
        self.stats = stats
        self.inter = inter
        self.kept = kept
        self.hessians = ExpertHessians(kept)
        self.hooks: list[Recorder] = [self.hessians.observe]
        self.batch_hooks: list = []
        self.rtn_experts: set[int] = set()
        self._gate_up: dict[tuple[int, int], gptq.Factor] = {}  # INT4: gate's factors, reused by up

    # ------------------------------------------------------------------ Hessians

    def _usable(self, experts: range) -> list[bool]:
        """Whether each expert has the tokens GPTQ needs (else RTN)."""
        too_few = getattr(self.stats, "too_few", None)  # the coverage policy's floor, where it is set
        return [int(self.stats.tokens[e]) > 0 and not (too_few is not None and too_few(e)) for e in experts]

    def _factor(
        self, experts: range, part: str, size: int, device: torch.device, s_in: torch.Tensor | None = None
    ) -> gptq.Factor:
        """The factored Hessians of `experts` for `part` ("gate_up" / "down"); an expert without usable
        tokens gets the identity (GPTQ on it is RTN, bit for bit: no error reaches another column)."""
        h = self.hessians.take(experts, part, size, device)
        usable = torch.tensor(self._usable(experts), device=device)
        usable &= h.isfinite().all(-1).all(-1)
        if s_in is not None:
            h = h / (s_in[:, :, None] * s_in[:, None, :])
        eye = torch.eye(size, dtype=h.dtype, device=device)
        h = torch.where(usable[:, None, None], h, eye)
        fac = gptq.factor(h, damp=self.options.damp, act_order=self.options.act_order)
        fac.failed = ~usable | fac.failed  # every expert GPTQ leaves to RTN (UpdatedScales: no Hessian there)
        # a solve group can hold another rank's experts (without Hessians here): their codes are not this rank's
        failed = zip(experts, fac.failed.tolist(), strict=True)
        self.rtn_experts.update(e for e, back in failed if back and (self.kept is None or self.kept(e)))
        return fac

    # ------------------------------------------------------------------ NVFP4

    def nvfp4_chunk(
        self,
        first_expert: int,
        end_expert: int,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        in_amax: torch.Tensor,
        mid_amax: torch.Tensor,
    ) -> dict[str, NVFP4Experts]:
        """Experts first_expert..end_expert-1 coded NVFP4 by GPTQ: {part: NVFP4Experts}, as layer.nvfp4_rtn
        returns them.
        Solved hessians.SOLVE_EXPERTS at a time (the writer's chunks are smaller): the solver's column loop costs
        the same kernels for 16 experts as for 32, so fewer, larger groups take less time on a GPU."""
        g0 = first_expert - first_expert % hessians.SOLVE_EXPERTS
        g1 = min(g0 + hessians.SOLVE_EXPERTS, self.n_experts)
        if end_expert > g1:  # a chunk across two groups (not the writer's chunking): solved alone
            g0, g1 = first_expert, end_expert
        if self._solved is None or self._solved[0] != (g0, g1):
            self._solved = None  # the previous group's codes go before the next group's are made
            if (g0, g1) == (first_expert, end_expert):
                self._solved = ((g0, g1), self._nvfp4_group(range(g0, g1), gate_up, down))
            else:
                gu_all, dn_all = self.experts.gate_up_proj.data, self.experts.down_proj.data
                self._solved = ((g0, g1), self._nvfp4_group(range(g0, g1), gu_all[g0:g1], dn_all[g0:g1]))
        (g0, _), solved = self._solved
        inter, k = self.inter, slice(first_expert - g0, end_expert - g0)
        res: dict[str, NVFP4Experts] = {}
        for name, in_amax_part in (("gate_up", in_amax), ("down", mid_amax)):
            packed, bs, ws2 = (t[k] for t in solved[name])
            input_scale = nvfp4.input_scale_from_amax(in_amax_part.float()).reshape(-1)
            if name == "down":
                res["down_proj"] = NVFP4Experts(packed, bs, ws2, input_scale)
                continue
            for part, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, None))):
                res[part] = NVFP4Experts(packed[:, rows].contiguous(), bs[:, rows].contiguous(), ws2, input_scale)
        return dict(sorted(res.items()))

    def _nvfp4_group(self, experts: range, gu: torch.Tensor, dn: torch.Tensor) -> dict[str, tuple]:
        """{"gate_up" | "down": (packed, block scales, weight_scale_2)} of `experts` (weights gu, dn)."""
        inter = self.inter
        method = self.recipe.nvfp4.weight_scale
        amax_gu = torch.maximum(nvfp4.matrix_amax(gu[:, :inter]), nvfp4.matrix_amax(gu[:, inter:]))
        out = {}
        for name, w, w_amax in (("gate_up", gu, amax_gu), ("down", dn, nvfp4.matrix_amax(dn))):
            fac = self._factor(experts, name, w.shape[-1], w.device)
            if self.options.scales is GptqScales.UPDATED:
                ws2 = nvfp4.weight_scale_2_from_amax(w_amax).reshape(-1).float()
                chosen = UpdatedScales(method, w_amax, ws2, ~fac.failed, w.shape[-2], fac.u)
                bs = chosen.block_scale
                # the grid's steps are placeholders: `chosen` sets each block's before its first column is coded
                grid = gptq.nvfp4_grid(torch.ones_like(bs), ws2)
                codes = gptq.solve(w, fac, grid, block_size=self.options.block_size, choose=chosen)
            else:
                bs, ws2 = nvfp4_scales(w, w_amax, method)
                ws2 = ws2.reshape(-1).float()
                if bs is None:
                    bs = nvfp4.block_scales(w, ws2)
                codes = gptq.solve(w, fac, gptq.nvfp4_grid(bs, ws2), block_size=self.options.block_size)
            del fac
            out[name] = (nvfp4.pack(codes), bs, ws2)
        return out

    # ------------------------------------------------------------------ INT4

    def int4(
        self,
        part: str,
        w: torch.Tensor,
        experts: range,
        s_in: torch.Tensor | None,
        group_size: int,
        scale_dtype: torch.dtype,
    ) -> awq.Int4Weight:
        """`part` of `experts` (weights w [k, out, in], AWQ scales folded in) coded INT4 by GPTQ on the
        grid RTN chooses; `s_in`: down_proj's AWQ input scales [k, in] (None: no AWQ)."""
        grid_of = rtn(w, group_size, scale_dtype)  # its scales: the stored ones
        key = (experts.start, experts.stop)
        if part == "down_proj":
            fac = self._factor(experts, "down", w.shape[-1], w.device, s_in)
        elif key in self._gate_up:  # up_proj after gate_proj: the same inputs, the same factor
            fac = self._gate_up.pop(key)
        else:
            fac = self._gate_up[key] = self._factor(experts, "gate_up", w.shape[-1], w.device)
        grid = gptq.int4_grid(grid_of.scales, grid_of.group_size)
        codes = gptq.solve(w, fac, grid, block_size=self.options.block_size)
        return awq.Int4Weight(codes, grid_of.scales, None, grid_of.group_size)

    def summary(self) -> dict:
        """The layer's GPTQ entry in the report: the options and the experts (of this rank) coded by RTN
        instead (`merged` joins the ranks' entries)."""
        self._solved = None
        return {**self.options.to_json(), "rtn_experts": sorted(self.rtn_experts)}


def merged(summaries: list[dict]) -> dict:
    """One layer's GPTQ entry from every rank's `summary()`: as one process writes it."""
    rtn_experts = sorted({e for summary in summaries for e in summary["rtn_experts"]})
    return {**summaries[0], "rtn_experts": rtn_experts}


_KERNEL_METHOD = {
    WeightScale.MAX: gptq_triton.CHOOSE_MAX,
    WeightScale.MSE_SWEEP: gptq_triton.CHOOSE_SWEEP,
    WeightScale.LOCAL_HESSIAN: gptq_triton.CHOOSE_HESSIAN,
}


class UpdatedScales:
    """`gptq.scales: updated`: each 16-column block's E4M3 scale chosen when GPTQ reaches the block, from its
    weights as the errors of the columns before have updated them, by the recipe's `nvfp4.weight_scale`
    (gptq.solve's `choose`). The global scale stays the max's, amax / (6 * 448) of the original weights
    (gate and up share it), so the output is plain NVFP4 with the max's weight_scale_2.

    - max: the block's amax / 6 (GPTQ's classic scale at group start);
    - mse_sweep: the E4M3 value with the least squared weight error of the block;
    - local_hessian: the E4M3 value with the least dwᵀ S dw, S the Hessian GPTQ leaves the block once the
      columns after it compensate its error: (U_bbᵀ U_bb)⁻¹, U_bb the block's diagonal block of the upper
      Cholesky factor of the damped H⁻¹ (the Schur complement of the later columns in H restricted to the
      columns not yet coded). An expert GPTQ leaves to RTN (no usable Hessian) takes mse_sweep's scale.

    `block_scale` (float8_e4m3fn [E, rows, cols / 16]) is filled block by block as GPTQ codes: by `__call__`,
    or, where the column loop runs as a Triton kernel, by that kernel (`kernel_choice`: the same rules and
    searches in one launch per block, no torch call in between)."""

    def __init__(
        self,
        method: WeightScale,
        global_amax: torch.Tensor,
        weight_scale_2: torch.Tensor,
        seen: torch.Tensor,
        rows: int,
        u: torch.Tensor,
    ) -> None:
        self.method, self.global_amax, self.ws2, self.seen = method, global_amax, weight_scale_2, seen
        n_exp, cols = u.shape[0], u.shape[-1]
        nb = cols // nvfp4.BLOCK_SIZE
        self.block_scale = torch.empty((n_exp, rows, nb), dtype=torch.float8_e4m3fn, device=u.device)
        self.schur: torch.Tensor | None = None
        self.schur_inverse_diagonal: torch.Tensor | None = None
        self.plain: torch.Tensor | bool = False
        in_kernel = gptq_triton.usable(u)  # the column loop's kernel runs here: it makes the choice itself
        if method is WeightScale.LOCAL_HESSIAN:
            # every block's (U_bbᵀ U_bb)⁻¹ at once: [E, blocks, 16, 16] from U's diagonal 16 x 16 blocks
            diag = u.reshape(n_exp, nb, nvfp4.BLOCK_SIZE, nb, nvfp4.BLOCK_SIZE).diagonal(dim1=1, dim2=3)
            diag = diag.permute(0, 3, 1, 2).reshape(-1, nvfp4.BLOCK_SIZE, nvfp4.BLOCK_SIZE)
            # row-major, as the searches read it (cholesky_inverse returns column-major matrices)
            schur = torch.cholesky_inverse(diag, upper=True).contiguous()
            self.schur = schur.reshape(n_exp, nb, nvfp4.BLOCK_SIZE, -1)
            searched_on_gpu = u.is_cuda or in_kernel
            self.schur_inverse_diagonal = (
                nvfp4_triton.hessian_inverse_diagonals(self.schur) if searched_on_gpu else None
            )
            plain = plain_blocks(self.schur, seen)
            if bool(plain.any()):  # one wait for the GPU per matrix, not one per block
                self.plain = plain
        self.kernel_choice: gptq_triton.KernelChoice | None = None
        if in_kernel:
            plain_bytes = self.plain.to(torch.uint8) if isinstance(self.plain, torch.Tensor) else None
            self.kernel_choice = gptq_triton.KernelChoice(
                _KERNEL_METHOD[method],
                self.block_scale,
                weight_scale_2.float().contiguous(),
                global_amax.float().reshape(n_exp).contiguous(),
                self.schur,
                self.schur_inverse_diagonal,
                torch.zeros((n_exp, nb), dtype=torch.uint8, device=u.device) if plain_bytes is None else plain_bytes,
            )

    def __call__(self, g: int, w: torch.Tensor) -> torch.Tensor:
        """The step [E, rows] of block g, from its updated weights w [E, rows, 16]."""
        if self.method is WeightScale.MAX:
            bs = nvfp4.block_scales(w.contiguous(), self.ws2)
        elif self.method is WeightScale.MSE_SWEEP:
            bs = sweep_block_scales(w.contiguous(), self.global_amax)
        else:
            assert self.schur is not None  # made in __init__ for local_hessian
            bs = hessian_block_scales(
                w.contiguous(),
                self.global_amax,
                self.schur[:, g : g + 1],
                self.seen,
                None if self.schur_inverse_diagonal is None else self.schur_inverse_diagonal[:, g : g + 1],
                self.plain[:, g : g + 1] if isinstance(self.plain, torch.Tensor) else False,
            )
        self.block_scale[:, :, g : g + 1] = bs
        return bs[:, :, 0].float() * self.ws2[:, None]
