"""Per-expert Hessians of the routed experts, gathered during the layer's streamed forward (GPTQ:
qtool.ops.quantize.gptq_layer).

`ExpertHessians.observe` is registered on calib.ExpertStats.hooks, which calls it for every routed batch
of every expert with x (the expert's input rows, the tokens routed to it) and mid (its down_proj input,
act(gate) * up from the dense weights, as the forward computed it). It adds, in float32 on the forward's
device:

    gate_up[e] += x^T x      [hidden, hidden]   (gate_proj and up_proj read the same x: one Hessian)
    down[e]    += mid^T mid  [inter, inter]

The sums are not divided by the token count: GPTQ's damping is relative to mean(diag H) and its solution
does not change when H is scaled.

Memory: one Hessian pair per expert that saw a token, created at its first token, held on the forward's
device until its expert is coded, then dropped (`take`): at most n_experts * (hidden^2 + inter^2) * 4
bytes for a layer. At the 397B's size (512 experts, hidden 4096, moe_intermediate 1024) that is
512 * (64 + 4) MiB = 34 GiB, beside the layer's 13 GB of BF16 weights: it fits on one 80 GB GPU. A GPTQ
layer is therefore coded on the loop's thread, not behind the next layer's forward (which would hold a
second layer's Hessians), and its experts are solved a group at a time (SOLVE_EXPERTS), whose stacked copies
and factors add ~8 GB at the 397B's size. The plan counts both in its memory fit (`gptq_memory_bytes`).

Several ranks: each runs the forward over every window and keeps the Hessians of the experts it codes only
(`kept`: whole solve groups, layer.Share), so each sum is one process's, added in the same order with the same
shapes, and a rank holds 1/N of them (17 GiB at the 397B's size with 2 ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from qtool.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # the plan reads gptq_memory_bytes without torch

# experts solved at once (gptq_layer: NVFP4): at the 397B's size their stacked Hessians, factors and float32
# weights are ~8 GB of transients on the device, beside the layer's Hessians
SOLVE_EXPERTS = 32


def gptq_memory_bytes(n_experts: int, hidden: int, inter: int, ranks: int = 1) -> int:
    """What GPTQ keeps on the forward's device beside the layer (the plan's memory fit): the two Hessians of
    every expert a rank codes (with `ranks`: at most whole solve groups of its share, layer.Share), and one
    solve group's transients (the stacked Hessians, their damped copy, the Cholesky factor and the inverse's
    factor; the group's float32 weights, twice: their copy and its transpose)."""
    held = min(n_experts, -(-n_experts // (SOLVE_EXPERTS * ranks)) * SOLVE_EXPERTS)
    hessians = held * (hidden * hidden + inter * inter) * 4
    group = SOLVE_EXPERTS * (4 * hidden * hidden + 2 * 2 * inter * hidden) * 4
    return hessians + group


class ExpertHessians:
    """The routed experts' input second moments of one layer (see the module docstring), of the experts
    `kept(e)` says this rank codes (default: all)."""

    def __init__(self, kept: Callable[[int], bool] | None = None) -> None:
        self.gate_up: dict[int, torch.Tensor] = {}
        self.down: dict[int, torch.Tensor] = {}
        self.kept = kept

    def observe(self, e: int, x: torch.Tensor, mid: torch.Tensor) -> None:
        """calib.ExpertStats hook: expert e's routed rows x [n, hidden] and down_proj input mid [n, inter]."""
        if self.kept is not None and not self.kept(e):
            return  # another rank codes it (and sums its Hessians)
        _accumulate(self.gate_up, e, x)
        _accumulate(self.down, e, mid)

    def take(self, experts: range, part: str, size: int, device: torch.device) -> torch.Tensor:
        """The Hessians of `experts` for `part` ("gate_up" or "down") stacked [k, size, size] on `device`,
        and dropped here (each is used once). An expert that saw no token gets zeros."""
        held = self.gate_up if part == "gate_up" else self.down
        out = torch.zeros((len(experts), size, size), dtype=torch.float32, device=device)
        for k, e in enumerate(experts):
            h = held.pop(e, None)
            if h is not None:
                out[k].copy_(h)
        return out


def _accumulate(held: dict[int, torch.Tensor], e: int, rows: torch.Tensor) -> None:
    rows = rows.detach().float()
    h = held.get(e)
    if h is None:
        h = held[e] = torch.zeros((rows.shape[-1], rows.shape[-1]), dtype=torch.float32, device=rows.device)
    h.addmm_(rows.t(), rows)
