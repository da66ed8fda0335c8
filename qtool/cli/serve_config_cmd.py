"""qtool serve-config CKPT --engine vllm|sglang [--tp 4] [--mtp N] [--port P] [--format shell|compose]"""

from __future__ import annotations

import dataclasses
import sys

from qtool.cli.common import add_json_flag, print_json
from qtool.cli.sources import headers_checkpoint
from qtool.cli.verify_cmd import add_common
from qtool.hub.headers import stand_in_commit
from qtool.hub.spec import is_hub_spec
from qtool.ops.serve_config import OutputFormat, ServeOptions, plan, render


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint directory (verified first; refused with exit 3 on errors)")
    p.add_argument("--engine", required=True, help="vllm or sglang, optionally with a version: vllm@0.17")
    add_common(p)
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument(
        "--format",
        choices=["shell", "compose"],
        default="shell",
        help="a shell command (default) or a docker-compose service",
    )
    p.add_argument(
        "--yarn",
        type=float,
        default=None,
        metavar="FACTOR",
        help="extend the context with YaRN (e.g. 4: 262144 -> 1048576) via engine overrides",
    )
    p.add_argument("--served-model-name", default=None, help="default: the directory name")
    add_json_flag(p)


def run(args) -> int:
    opts = ServeOptions(
        engine=args.engine,
        tp=args.tp,
        mtp=args.mtp,
        port=args.port,
        format=OutputFormat(args.format),
        gpus=args.gpus,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        yarn=args.yarn,
        served_model_name=args.served_model_name,
    )

    path = headers_checkpoint(args.checkpoint)
    if is_hub_spec(args.checkpoint):  # the launch names the repo and the commit verify read, not qtool's cache
        opts = dataclasses.replace(opts, hub=args.checkpoint, commit=stand_in_commit(path))
    launch = plan(path, opts)
    text = render(launch, opts)
    if args.json:
        print_json(
            {
                "engine": launch.engine,
                "env": launch.env,
                "argv": launch.argv,
                "format": opts.format.value,
                "text": text,
                "notes": launch.notes,
                "fit": launch.report.fit.to_json(),
            }
        )
        return 0
    print(text, end="")
    for note in launch.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0
