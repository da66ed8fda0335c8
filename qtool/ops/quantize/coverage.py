"""Expert coverage: which calibration tokens a routed expert's statistics come from, and what an expert
that saw too few of them is coded with.

The recipe's `calibration.experts` chooses the tokens: `natural` (the ones the model's router sends the
expert) or `all` (every token, as llm-compressor's `moe_calibrate_all_experts`; qtool.stream.every_token
records them while the layer's output stays the routed computation). `calibration.min_expert_tokens` is
the floor: an expert that saw fewer tokens does not use statistics of its own but the fallback rule
`layer_amax`, decided once per expert by `ExpertStats.too_few(e)` (every method asks it):

- NVFP4 input scales (`input_scale: per_expert`): the layer's largest input amax (qtool.ops.quantize.layer
  input_amaxes); with `layer_max` every expert has that already;
- AWQ: no search (the expert's down_proj scales stay 1: plain RTN, as for an expert without rows);
- a method that needs an expert's own tokens (GPTQ, a Hessian-weighted block-scale search): its
  weight-only path for that expert (RTN / the block scale from the weights alone).

Under `all` every statistic recorded through ExpertStats.record, its hooks included (a Hessian's), sees
every token, with no change on the method's side. Weight-only block scales (max, mse, mse_sweep,
four_over_six) need no token: the fallback changes nothing there. The per-layer entry of the report, the
journal and the manifest records the decision (`coverage_json`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qtool.errors import UsageError
from qtool.recipes import Backend, ExpertTokens, Recipe

if TYPE_CHECKING:
    from qtool.ops.quantize.calib import ExpertStats

FALLBACK_RULE = "layer_amax"


def stats_options(recipe: Recipe) -> dict:
    """ExpertStats' coverage fields for a layer of `recipe`."""
    cover = recipe.expert_coverage
    return {"min_tokens": cover.min_tokens, "every_token": cover.experts is ExpertTokens.ALL}


def coverage_json(stats: ExpertStats) -> dict:
    """The layer's coverage decision, for its report / journal / manifest entry."""
    return {
        "expert_tokens": (ExpertTokens.ALL if stats.every_token else ExpertTokens.NATURAL).value,
        "min_expert_tokens": stats.min_tokens,
        "fallback_rule": FALLBACK_RULE,
        "experts_fallback": [int(e) for e in stats.below_floor().nonzero().flatten().tolist()],
    }


def floor_warning(recipe: Recipe, tokens: int, top_k: int, n_experts: int) -> str | None:
    """A plan note where the recipe's floor is above what an expert sees on average with this run's tokens
    (`all`: every token): most experts would be coded by the fallback rule."""
    floor = recipe.expert_coverage.min_tokens
    every = recipe.expert_coverage.experts is ExpertTokens.ALL
    mean = tokens if every else tokens * top_k / max(1, n_experts)
    if floor <= 1 or mean >= floor:
        return None
    return (
        f"calibration.min_expert_tokens {floor} is above the {mean:.0f} tokens an expert sees on average in this "
        f"run ({tokens} tokens{'' if every else f', top {top_k} of {n_experts} experts'}): most experts will be "
        f"coded by the fallback rule {FALLBACK_RULE}; pass more --samples / --seq-len"
    )


def refuse_peer_backend(recipe: Recipe, backend: Backend) -> None:
    """`experts: all` is qtool's own calibration: a peer library calibrates its own way (ModelOpt on the
    routed tokens; llm-compressor's observers already see every token)."""
    if recipe.expert_coverage.experts is ExpertTokens.ALL and backend is not Backend.RTN:
        raise UsageError(
            f"calibration.experts: all is qtool's own calibration: --backend {backend.value} calibrates its own way",
            hint="use --backend rtn (the default), or drop `experts: all` from the recipe's calibration",
        )
