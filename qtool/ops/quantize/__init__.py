"""`qtool quantize`: layer-streamed quantization of a BF16 Qwen3.5-MoE checkpoint by a recipe.

plan (qtool.ops.quantize.plan) -> validate -> execute (qtool.ops.quantize.execute); codecs in
qtool.formats.nvfp4 and qtool.formats.awq (+ the AWQ search in qtool.ops.quantize.awq_search); peer backends
in qtool.ops.quantize.backends (mtq.quantize / llm-compressor observers on one decoder layer at a time).
"""

from __future__ import annotations

from qtool.ops.quantize.execute import execute, run
from qtool.ops.quantize.plan import QuantizeOptions, plan

__all__ = ["QuantizeOptions", "execute", "plan", "run"]
