"""`nvfp4.weight_scale: local_hessian`: each 16-element block's E4M3 scale chosen to minimise the block's
output error under the calibration activations, dwᵀ H_b dw, rather than its weight error |dw|².

dw is the block's quantization error (w - its NVFP4 value) and H_b the 16x16 block of the second-moment
matrix (1/n) Σ x xᵀ of the expert's own inputs over the block's 16 input columns: the routed hidden states
for gate_proj / up_proj, act(gate) * up for down_proj. dwᵀ H_b dw is the mean squared change of the block's
contribution to the output over the calibration tokens.

This is ModelOpt 0.47's NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG (modelopt/torch/quantization/model_calib.py
`local_hessian_calibrate`, `_LocalHessianAccumulator`; calib/mse.py `NVFP4MSECalibrator`;
kernels/quantization/gemm/nvfp4_fp8_sweep.py `nvfp4_fp8_scale_sweep_hessian`):
- H per expert and projection from the tokens routed to that expert (fused gate_up: one H from x), in
  float32, divided by the expert's token count;
- the candidates of `mse_sweep`: all 126 finite positive E4M3 values as the block scale, with the global
  scale amax / (6 * 448) (gate and up share the larger amax), so the output is plain NVFP4 with the
  max's weight_scale_2; the first (smallest) candidate kept on a tie;
- the loss measured with the divisor the codec writes, float(e4m3 scale) * weight_scale_2 (ModelOpt's
  kernel uses its fake-quant of the same scale: the two part only on a near-tie).
Where qtool differs, on purpose and recorded in the layer's report:
- an expert that saw no calibration token has no H: its blocks take `mse_sweep`'s scale (ModelOpt: the
  plain MSE sweep too, as an expert without an accumulator has no error function);
- a block whose 16 input columns were zero on every token (H_b = 0: every candidate ties at 0) takes
  `mse_sweep`'s scale, not ModelOpt's first candidate (the smallest scale, which would flatten the block's
  weights for inputs calibration never showed);
- the Hessians come from qtool's BF16 forward; ModelOpt's forward fake-quantizes the experts' inputs to
  NVFP4 while it gathers them, which changes act(gate) * up, so down_proj's H, slightly.
Several ranks: every rank runs the layer's forward over every window and sums the Hessians of the experts
it codes (stage.QuantizeStage.every_window), so they are one process's sums, bit for bit; none is reduced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from qtool.formats import nvfp4, nvfp4_triton
from qtool.lazy import lazy_module
from qtool.ops.quantize.nvfp4_mse import fp8_scale_values, sweep_block_scales
from qtool.recipes import Recipe, WeightScale

if TYPE_CHECKING:
    import torch

    from qtool.ops.quantize.calib import ExpertStats
else:
    torch = lazy_module("torch")

BLOCK = nvfp4.BLOCK_SIZE
SEARCH_ELEMS = 1 << 22  # weight elements per step of the search: bounds its float32 temporaries (~16 MB each)


class LocalHessians:
    """Per expert, Σ x xᵀ over each 16-column block of the inputs of gate/up (x) and of down (mid), gathered
    by an ExpertStats hook during the layer's forward, on the forward's device."""

    def __init__(self, n_experts: int, kept: Callable[[int], bool] | None = None) -> None:
        self.n_experts = n_experts
        self.kept = kept  # the experts this rank codes (None: all); the others' sums stay zero, never read
        self.gate_up: torch.Tensor | None = None  # float32 [E, hidden/16, 16, 16]
        self.down: torch.Tensor | None = None  # float32 [E, inter/16, 16, 16]
        self.plain_mse: list[int] = []  # experts coded with mse_sweep's scales (no token), for the report

    def record(self, e: int, x: torch.Tensor, mid: torch.Tensor) -> None:
        """ExpertStats hook: expert e's routed rows x [n, hidden] and its down_proj input mid [n, inter]."""
        if self.gate_up is None or self.down is None:
            self.gate_up = self._empty(x)
            self.down = self._empty(mid)
        if self.kept is not None and not self.kept(e):
            return  # another rank codes it
        _accumulate(self.gate_up[e], x)
        _accumulate(self.down[e], mid)

    def _empty(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.n_experts, rows.shape[-1] // BLOCK, BLOCK, BLOCK, device=rows.device)

    def normalized(self, part: str, e0: int, e1: int, tokens: torch.Tensor) -> torch.Tensor | None:
        """H / tokens of experts e0..e1-1 for `part` (an expert without tokens: zeros), None if the layer
        saw no token at all."""
        sums = self.down if part == "down_proj" else self.gate_up
        if sums is None:
            return None
        n = tokens[e0:e1].to(sums.device, torch.float32).clamp(min=1).reshape(-1, 1, 1, 1)
        return sums[e0:e1] / n  # ModelOpt divides the same way (`normalized_hessian`)


def _accumulate(into: torch.Tensor, rows: torch.Tensor) -> None:
    """into [nb, 16, 16] += the blocks' Σ x xᵀ of rows [n, nb * 16], in float32 (ModelOpt: the same GEMM)."""
    blocks = rows.reshape(-1, into.shape[0], BLOCK).float().transpose(0, 1)  # [nb, n, 16]
    into.add_(blocks.transpose(1, 2) @ blocks)


def attach(stats: ExpertStats, recipe: Recipe, kept: Callable[[int], bool] | None = None) -> None:
    """Gather the Hessians in the layer's forward when the recipe asks for local_hessian scales (with gptq,
    GPTQ's own full Hessians choose them: qtool.ops.quantize.gptq_layer.UpdatedScales); those of the experts
    `kept(e)` says this rank codes."""
    if recipe.nvfp4.weight_scale is WeightScale.LOCAL_HESSIAN and not recipe.gptq.enabled:
        stats.local_hessians = LocalHessians(stats.n_experts, kept)
        stats.hooks.append(stats.local_hessians.record)


def plain_mse(stats: ExpertStats) -> list[int] | None:
    """The experts this rank coded with mse_sweep's scales (no token), None without local_hessian."""
    hessians = getattr(stats, "local_hessians", None)
    return None if hessians is None else list(hessians.plain_mse)


def report(plain_mse: list[int] | None) -> dict:
    """The layer report's entry: which experts fell back to plain MSE (saw no calibration token), from every
    rank's `plain_mse`."""
    if plain_mse is None:
        return {}
    return {"local_hessian": {"experts_plain_mse": sorted(set(plain_mse))}}


def chunk_block_scales(
    stats: ExpertStats, e0: int, e1: int, part: str, w: torch.Tensor, global_amax: torch.Tensor
) -> torch.Tensor:
    """The local_hessian block scales of experts e0..e1-1 (w [k, out, in]) for one projection."""
    hessians: LocalHessians = stats.local_hessians
    seen = stats.tokens[e0:e1] > 0  # TODO(expert coverage): ExpertStats.too_few(e) once it lands
    hessians.plain_mse += [e0 + k for k in range(e1 - e0) if not bool(seen[k])]
    h = hessians.normalized(part, e0, e1, stats.tokens)
    if h is None:
        return sweep_block_scales(w, global_amax)
    return hessian_block_scales(w, global_amax, h, seen.to(w.device))


def hessian_block_scales(
    w: torch.Tensor,
    global_amax: torch.Tensor,
    hessian: torch.Tensor,
    seen: torch.Tensor | None = None,
    inverse_diagonal: torch.Tensor | None = None,
    plain: torch.Tensor | bool | None = None,
) -> torch.Tensor:
    """float8_e4m3fn [E, out, in/16]: per block the E4M3 scale with the smallest dwᵀ H_b dw.

    w [E, out, in]; global_amax [E] (gate and up pass the larger of their two); hessian float32
    [E, in/16, 16, 16]; seen bool [E] (default all): an expert not seen, and a block whose H_b is zero,
    take `sweep_block_scales`' scale. A caller that searches the same Hessians block by block (GPTQ's
    updated scales) passes what it keeps: `inverse_diagonal`, the GPU search's bound
    (nvfp4_triton.hessian_inverse_diagonals of `hessian`), and `plain`, those blocks (`plain_blocks`:
    bool [E, in/16]; False: none), so that no call waits for the GPU to learn whether there are any."""
    nvfp4.check_weight(w)
    n_exp, out, n_in = w.shape
    nb = n_in // BLOCK
    ws2 = nvfp4.weight_scale_2_from_amax(torch.as_tensor(global_amax, device=w.device).float().reshape(n_exp))
    h = hessian.to(w.device, torch.float32).reshape(n_exp * nb, BLOCK, BLOCK)
    if w.is_cuda and nvfp4_triton.triton_available():
        scales = nvfp4_triton.hessian_block_scales_triton(w, ws2, h, inverse_diagonal=inverse_diagonal)
    else:
        scales = _searched_scales(w, ws2, h, fp8_scale_values(w.device))
    if plain is None:
        found = plain_blocks(h.reshape(n_exp, nb, BLOCK, BLOCK), seen)
        plain = found if bool(found.any()) else False
    if isinstance(plain, torch.Tensor):
        mask = plain.to(w.device).unsqueeze(1).expand(-1, out, -1)
        scales = torch.where(mask, sweep_block_scales(w, global_amax).float(), scales.float())
        scales = scales.to(torch.float8_e4m3fn)
    return scales.contiguous()


def _searched_scales(w: torch.Tensor, ws2: torch.Tensor, h: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The torch search (CPU, or no triton): float8_e4m3fn [E, out, in/16]; h [E * in/16, 16, 16]."""
    n_exp, out, n_in = w.shape
    nb = n_in // BLOCK
    # one batch item per (expert, column block): its rows [out, 16] and its H_b [16, 16]
    blocks = w.reshape(n_exp, out, nb, BLOCK).transpose(1, 2).reshape(n_exp * nb, out, BLOCK)
    item_ws2 = ws2.repeat_interleave(nb).reshape(-1, 1, 1)
    best = torch.empty(n_exp * nb, out, dtype=torch.long, device=w.device)
    step = max(1, SEARCH_ELEMS // (out * BLOCK))
    for i0 in range(0, blocks.shape[0], step):
        best[i0 : i0 + step] = _search(
            blocks[i0 : i0 + step].float(), h[i0 : i0 + step], item_ws2[i0 : i0 + step], values
        )
    return values[best].reshape(n_exp, nb, out).transpose(1, 2).to(torch.float8_e4m3fn)


def _search(x: torch.Tensor, h: torch.Tensor, ws2: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Index of the best candidate per row of each item: x [B, out, 16], h [B, 16, 16], ws2 [B, 1, 1]."""
    best_loss = torch.full(x.shape[:2], float("inf"), device=x.device)
    best = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
    for k in range(values.numel()):
        denom = values[k] * ws2  # as the codec divides: float(e4m3 scale) * weight_scale_2 (nvfp4.quantize)
        dw = x - nvfp4.decode_e2m1(nvfp4.encode_e2m1(x / denom)) * denom  # signed: H's cross terms see it
        loss = ((dw @ h) * dw).sum(dim=-1)  # dwᵀ H dw per row (H symmetric)
        better = loss < best_loss  # strict: the first (smallest) scale kept on a tie
        best_loss = torch.where(better, loss, best_loss)
        best = torch.where(better, k, best)
    return best


def plain_blocks(hessian: torch.Tensor, seen: torch.Tensor | None) -> torch.Tensor:
    """bool [E, nb]: the blocks that take the plain MSE sweep's scale (no token, or H_b = 0)."""
    empty = hessian.diagonal(dim1=-2, dim2=-1).sum(-1) == 0  # [E, nb]: PSD, so a zero trace is H_b = 0
    if seen is not None:
        empty = empty | ~seen.to(empty.device).reshape(-1, 1)
    return empty
