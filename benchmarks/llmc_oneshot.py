"""llm-compressor's own GPTQ (and AWQ + GPTQ) on the proxy's routed experts: bench_quality's peer rows.

qtool's `--backend llmcompressor` borrows llm-compressor's observers and compressor inside qtool's layer
stream; GPTQ is an algorithm of llm-compressor's own pipeline, so these rows run it end to end the way a
user of llm-compressor would: the BF16 checkpoint loaded by transformers under llm-compressor's
`load_context` (its MoE mechanism: the routed experts as one Linear per expert and projection), `oneshot`
with the modifier(s) targeting those Linears only, `save_pretrained(save_compressed=True)`. The calibration
windows are the token ids qtool's quantize builds for the same dataset, samples and length
(qtool.stream.calib_data.build_calib_set), fed as they are: nothing re-tokenized, shuffled or truncated.

    python benchmarks/llmc_oneshot.py SRC OUT --scheme nvfp4 --samples 64 --seq-len 256
    python benchmarks/llmc_oneshot.py SRC OUT --scheme w4a16 --group-size 32 --awq

llm-compressor calibrates Qwen3.5's offset norms (`x * (1 + w)`) as standard norms and converts them back
after; in BF16 that round trip moves most norm weights by up to one BF16 step (0.002-0.008 here). The bench
compares the experts' quantization only, so every tensor outside the routed experts is put back to the
source's bytes after saving (`--as-saved` keeps llm-compressor's; the calibration itself ran on its norms).
Not with `--awq`: AWQ's smoothing divides the post-attention norm and multiplies the shared expert's inputs
(its mappings for Qwen3.5-MoE leave the router out, a Parameter): those rows keep everything as llm-compressor
saved it.

On a machine without an accelerator llm-compressor 0.14's AWQModifier fails ("Cannot access accelerator
device when none is available": it pins its cached activations, pipelines/cache.py, for faster copies to
the GPU); there the pinning is skipped (numerically nothing: pinning only speeds host-to-device copies).

Everything llm-compressor does not choose by a flag here is its default (GPTQ: block 128, dampening 0.01,
static activation ordering; every expert calibrated on all tokens, `moe_calibrate_all_experts`; each layer
calibrated on the outputs of the layers before it as already quantized, `propagate_error`, where qtool
calibrates every layer on the BF16 model's activations: `--bf16-propagation` runs llm-compressor that way).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qtool.stream.calib_data import build_calib_set  # noqa: E402 (after sys.path: the checkout's qtool)

# the routed experts of the decoder layers, as llm-compressor's linearized MoE names them
EXPERT_LINEARS = r"re:.*\.mlp\.experts\.\d+\.(gate|up|down)_proj$"
# files a checkpoint directory carries besides its weights (save_pretrained writes config and weights only)
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "calibration.txt", "heldout.txt")


def scheme(name: str, group_size: int):
    """The QuantizationScheme for the experts: weights only (the bench's evaluation keeps activations BF16)."""
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    if name == "nvfp4":
        return preset_name_to_scheme("NVFP4A16", [EXPERT_LINEARS])
    base = preset_name_to_scheme("W4A16", [EXPERT_LINEARS])  # symmetric INT4, one scale per group
    weights = base.weights.model_copy(update={"group_size": group_size})
    return QuantizationScheme(targets=[EXPERT_LINEARS], weights=weights)


def recipe(a: argparse.Namespace) -> list:
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier

    groups = {"experts": scheme(a.scheme, a.group_size)}
    mods: list = []
    if a.awq:
        mods.append(AWQModifier(config_groups=groups, ignore=["lm_head"]))
    actorder = {} if a.actorder == "default" else {"actorder": None if a.actorder == "none" else a.actorder}
    mods.append(GPTQModifier(config_groups=groups, ignore=["lm_head"], **actorder))
    return mods


def calibration(src: Path, samples: int, seq_len: int):
    from datasets import Dataset

    ids = build_calib_set(src, str(src / "calibration.txt"), samples, seq_len).ids
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seq_len] * samples})


def no_pinning_without_accelerator():
    """Skip llm-compressor's pinning of cached activations where torch has no accelerator (see the docstring)."""
    import torch
    from compressed_tensors.utils import patch_attr
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        return contextlib.nullcontext()
    return patch_attr(IntermediatesCache, "pin_memory", lambda self, batch_index, input_names=None: None)


def restore_rest(src: Path, out: Path) -> int:
    """Put every non-expert tensor of `out` back to the source's value; the number of tensors changed."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    source = {}
    for shard in sorted(src.glob("*.safetensors")):
        source.update(load_file(str(shard)))
    changed = 0
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            metadata = f.metadata()
        tensors = load_file(str(shard))
        moved = [
            k
            for k, t in tensors.items()
            if ".mlp.experts." not in k
            and k in source
            and not (t.dtype == source[k].dtype and torch.equal(t, source[k]))
        ]
        for k in moved:
            tensors[k] = source[k]
        if moved:
            save_file(tensors, str(shard), metadata=metadata)
        changed += len(moved)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="the BF16 checkpoint")
    ap.add_argument("out", type=Path, help="the compressed-tensors checkpoint (replaced)")
    ap.add_argument("--scheme", choices=["nvfp4", "w4a16"], required=True)
    ap.add_argument("--group-size", type=int, default=32, help="INT4 group (w4a16)")
    ap.add_argument("--awq", action="store_true", help="AWQModifier before GPTQModifier")
    ap.add_argument(
        "--actorder", default="default", help="GPTQ's activation ordering: default (static), none, group, weight"
    )
    ap.add_argument("--routed-only", action="store_true", help="each expert's Hessian from its routed tokens only")
    ap.add_argument("--as-saved", action="store_true", help="keep llm-compressor's non-expert tensors")
    ap.add_argument(
        "--bf16-propagation",
        action="store_true",
        help="each layer calibrated on the BF16 model's activations (propagate_error=False), as qtool calibrates",
    )
    ap.add_argument("--samples", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    a = ap.parse_args(argv)

    import torch
    from llmcompressor import oneshot
    from llmcompressor.utils import load_context
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    data = calibration(a.src, a.samples, a.seq_len)
    with load_context(AutoModelForImageTextToText):
        model = AutoModelForImageTextToText.from_pretrained(str(a.src), dtype=torch.bfloat16)
    with no_pinning_without_accelerator():
        oneshot(
            model=model,
            dataset=data,
            processor=AutoTokenizer.from_pretrained(str(a.src)),  # the ids are given: it tokenizes nothing
            recipe=recipe(a),
            num_calibration_samples=a.samples,
            max_seq_length=a.seq_len,
            shuffle_calibration_samples=False,
            moe_calibrate_all_experts=not a.routed_only,
            propagate_error=not a.bf16_propagation,
        )
    if a.out.exists():
        shutil.rmtree(a.out)
    model.save_pretrained(str(a.out), save_compressed=True)
    for name in SIDE_FILES:
        if (a.src / name).is_file():
            shutil.copy2(a.src / name, a.out / name)
    if not (a.as_saved or a.awq):
        print(f"non-expert tensors put back to the source's: {restore_rest(a.src, a.out)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
