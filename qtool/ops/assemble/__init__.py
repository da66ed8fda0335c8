"""`qtool assemble hybrid`: BF16 shared experts (and chosen layers' routed experts, and the MTP head)
spliced into an NVFP4 checkpoint by byte ranges (docs/formats.md §7).

    plan = plan_hybrid(HybridOptions(nvfp4=..., bf16=..., out=..., force=False, resume=False))  # headers
    result = execute(plan)                                                                        # + configs only
"""

from qtool.ops.assemble.execute import RunResult, execute, free_space
from qtool.ops.assemble.model import (
    HybridOptions,
    HybridPlan,
    LinkMode,
    MtpMode,
    PlannedShard,
    PlannedTensor,
    ShardAction,
)
from qtool.ops.assemble.plan import plan_hybrid


def assemble_hybrid(opts: HybridOptions, *, progress: bool = False) -> tuple[HybridPlan, RunResult]:
    plan = plan_hybrid(opts)
    return plan, execute(plan, progress=progress)


__all__ = [
    "HybridOptions",
    "HybridPlan",
    "LinkMode",
    "MtpMode",
    "PlannedShard",
    "PlannedTensor",
    "RunResult",
    "ShardAction",
    "assemble_hybrid",
    "execute",
    "free_space",
    "plan_hybrid",
]
