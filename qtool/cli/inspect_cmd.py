"""qtool inspect CKPT [--json]"""

from __future__ import annotations

from qtool.cli.common import add_json_flag, print_json
from qtool.cli.sources import headers_checkpoint
from qtool.ops.inspect import inspect_checkpoint
from qtool.sizes import human_bytes


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint directory (or a single .safetensors file)")
    add_json_flag(p)


def run(args) -> int:
    rep = inspect_checkpoint(headers_checkpoint(args.checkpoint))
    if args.json:
        print_json(rep)
        return 0
    print(f"{rep['path']}")
    print(f"  architecture   {rep['architecture']} ({rep['naming']} naming)")
    lt = rep["layer_types"]
    print(
        f"  layers         {rep['num_layers']} ({lt['linear_attention']} Gated DeltaNet, "
        f"{lt['full_attention']} full attention: {rep['full_attention_layers']})"
    )
    print(f"  tensors        {rep['num_tensors']} in {rep['num_shards']} shard(s), {human_bytes(rep['total_bytes'])}")
    print(f"  expert layout  {rep['expert_layout']}" + (f" (MTP: {rep['mtp_expert_layout']})" if rep["mtp"] else ""))
    print(f"  MTP head       {'yes' if rep['mtp'] else 'no'}; vision tower {'yes' if rep['vision'] else 'no'}")
    kv = rep["kv_scales"]
    if kv["layers"]:
        state = {True: "calibrated", False: "constant 1.0 (uncalibrated)", None: "?"}[kv["calibrated"]]
        print(f"  kv scales      {state}, {kv['naming']} naming, layers {kv['layers']}")
    else:
        print("  kv scales      none")
    q = rep["quantization"]
    if q["quant_method"] or q["hf_quant_config"]:
        print(f"  quantization   {q['quant_method']} {q['quant_algo'] or q['format'] or ''}".rstrip())
        print(f"  ignore         {_brief(q['ignore'])}")
        if q["hf_quant_config"]:
            h = q["hf_quant_config"]
            print(
                f"  hf_quant       {h['schema']}: exclude {_brief(h['exclude_modules'])}, kv {h['kv_cache_quant_algo']}"
            )
    else:
        print("  quantization   none")
    print("  groups:")
    for g, info in rep["groups"].items():
        # a group of no Linear (norms, KV scales) has no quantization format: its dtypes say what it is
        kind = info["format"] or "/".join(d.lower() for d in info["dtypes"])
        print(f"    {g:<20} {kind:<10} {info['tensors']:>8} tensors {human_bytes(info['bytes']):>12}")
    if rep["problems"]:
        print(f"  problems ({len(rep['problems'])}):")
        for p in rep["problems"]:
            print(f"    [{p['code']}] {p['message']}")
    else:
        print("  problems: none")
    for w in rep["warnings"]:  # not a problem of the checkpoint: what qtool did not check
        print(f"  warning        [{w['code']}] {w['message']}")
    return 0


def _brief(patterns: list[str] | None, most: int = 6) -> str:
    if patterns is None:
        return "none"
    if len(patterns) <= most:
        return str(patterns)
    return f"{patterns[:most]} ... ({len(patterns)} patterns; --json lists all)"
