"""qtool eval kld --ref REF [--test TEST] [--dataset D] [--windows N] [--seq-len L] [--stride S]
[--device DEV] [--save-ref OUT] [--emit-windows FILE.jsonl] [--tokenizer DIR] [--json] [--quiet]

REF / TEST are each a checkpoint directory (run in-process, layer-streamed), an engine dump directory
(0.safetensors, 1.safetensors, ... with `log_probs` [positions, vocab]) or, for REF only, a compact
reference written by --save-ref."""

from __future__ import annotations

from qtool.cli.common import (
    DATASET_HELP,
    add_json_flag,
    add_parallel_flags,
    check_device,
    eprint,
    human_bytes,
    memory_line,
    print_json,
    progress_lines,
    run_command_line,
    show_progress,
)
from qtool.cli.sources import local_checkpoint
from qtool.errors import UsageError
from qtool.ops.kld import RESULT_KEYS, KldOptions
from qtool.ops.kld import run as kld_run


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="what", metavar="WHAT")
    k = sub.add_parser(
        "kld",
        help="KL divergence of a test model from a reference, per token position",
        description="KLD(ref || test) per token position: mean, median, p95, p99, max, top-1 "
        "agreement. REF/TEST: checkpoint dir (in-process), engine dump dir, or (REF) a "
        "compact reference from --save-ref.",
    )
    k.add_argument("--ref", help="reference: checkpoint, dump directory or compact reference")
    k.add_argument("--test", help="model under test: checkpoint or dump directory")
    add_window_flags(k)
    k.add_argument(
        "--stride",
        type=int,
        default=None,
        help="sliding windows: window i starts at i*STRIDE (default: non-overlapping = calibrate-kv's)",
    )
    k.add_argument(
        "--tokenizer",
        default=None,
        help="directory with the tokenizer (default: the first checkpoint among --ref/--test)",
    )
    k.add_argument("--save-ref", metavar="OUT", help="write the reference's log-probs compactly to OUT/")
    k.add_argument("--topk", type=int, default=256, help="compact reference: exact top-k per position (256)")
    k.add_argument(
        "--tail-samples", type=int, default=256, help="compact reference: tail tokens sampled per position (256)"
    )
    k.add_argument("--seed", type=int, default=0, help="compact reference: sampling seed (0)")
    k.add_argument(
        "--emit-windows",
        metavar="FILE.jsonl",
        help="write the windows as /v1/completions request bodies (one JSON per line)",
    )
    k.add_argument("--model-name", default=None, help="`model` field of the emitted requests")
    k.add_argument("--chunk", type=int, default=256, help="positions per log-prob chunk (memory bound; 256)")
    k.add_argument("--work-dir", default=None, help="where large hidden states are spilled (default: $TMPDIR)")
    k.add_argument("--force", action="store_true", help="replace an existing --save-ref OUT that qtool made")
    k.add_argument(
        "--dry-run",
        action="store_true",
        help="check the inputs, make the windows, print the plan (memory per model); run nothing",
    )
    k.add_argument("--quiet", action="store_true", help="no progress bars")
    add_json_flag(k)
    add_parallel_flags(k)


def add_window_flags(k) -> None:
    """The flags that choose eval kld's token windows and device (shared with `qtool report --ref`)."""
    k.add_argument("--dataset", default="builtin", help=DATASET_HELP)
    k.add_argument("--windows", type=int, default=4, help="number of token windows (default 4)")
    k.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    k.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")


def run(args) -> int:
    if args.what != "kld":
        raise UsageError("say what to evaluate: `qtool eval kld ...`")
    check_device(args.device, present=not args.dry_run)
    if args.test is None and not args.save_ref and not args.emit_windows:
        raise UsageError("nothing to do: give --test, --save-ref or --emit-windows")

    opts = KldOptions(
        dataset=args.dataset,
        windows=args.windows,
        seq_len=args.seq_len,
        stride=args.stride,
        device=args.device,
        tokenizer=args.tokenizer,
        chunk=args.chunk,
        topk=args.topk,
        tail_samples=args.tail_samples,
        seed=args.seed,
        work_dir=args.work_dir,
        force=args.force,
        command=run_command_line(),
        batch_tokens=args.batch_tokens,
    )
    bars: dict = {}
    progress = None
    if show_progress(args):
        from tqdm import tqdm

        def progress(what, done, total):
            bar = bars.get(what)
            if bar is None:
                bar = bars[what] = tqdm(desc=what, total=total, unit="")
            bar.update(done - bar.n)
    elif progress_lines(args):
        shown: dict = {}

        def progress(what, done, total):
            tenth = 10 * done // max(1, total)  # a line per tenth of each stage: a log shows it moving
            if shown.get(what) != tenth:
                shown[what] = tenth
                eprint(f"{what}: {done}/{total} done")

    try:
        rep = kld_run(
            _local(args.ref),
            _local(args.test),
            opts=opts,
            save_ref=args.save_ref,
            emit_windows=args.emit_windows,
            model_name=args.model_name,
            progress=progress,
            dry_run=args.dry_run,
        )
    finally:
        for bar in bars.values():
            bar.close()
    if args.json:
        print_json({k: rep.result[k] for k in RESULT_KEYS} if rep.result else rep.to_json())
        return 0
    if args.dry_run and rep.plan:
        _print_plan(rep)
        return 0
    if rep.emitted:
        e = rep.emitted
        print(
            f"wrote {e['requests']} /v1/completions requests ({e['seq_len']} tokens each, "
            f"stride {e['stride'] or e['seq_len']}) -> {e['path']}  [tokens {e['token_digest']}]"
        )
    if rep.ref:
        print(f"ref   {rep.ref['path']} ({rep.ref['kind']}, vocab {rep.ref['vocab']})")
    if rep.test:
        print(f"test  {rep.test['path']} ({rep.test['kind']}, vocab {rep.test['vocab']})")
    if rep.result:
        r = rep.result
        print(
            f"  {r['positions']} positions in {rep.windows} windows"
            + (f" [tokens {rep.token_digest}]" if rep.token_digest else "")
        )
        print("        mean      median         p95         p99         max   top-1 agree")
        print(
            "  "
            + " ".join(f"{r[k]:>10.4g}" for k in ("mean", "median", "p95", "p99", "max"))
            + f"   {100 * r['top1_agreement']:>9.2f} %"
        )
    if rep.saved_ref:
        s = rep.saved_ref
        print(
            f"saved compact reference -> {s['path']}: {human_bytes(s['tensor_bytes'])} vs "
            f"{human_bytes(s['full_float32_bytes'])} float32 full-vocab ({s['size_ratio']:.3g}x smaller; "
            f"top-{s['topk']} + {s['samples']} tail samples)"
        )
        if "check" in s:
            c = s["check"]
            print(
                f"  check: compact mean KLD {c['compact_mean']:.6g} vs exact {c['exact_mean']:.6g} "
                f"({100 * c['relative_error']:+.3f} %)"
            )
    print(f"  {rep.seconds:.1f} s")
    for w in rep.warnings:
        eprint(f"warning: {w}")
    return 0


def _print_plan(rep) -> None:
    print(
        f"plan: {rep.windows} windows"
        + (f" of {rep.seq_len} tokens" if rep.seq_len else "")
        + (f", stride {rep.stride}" if rep.stride else "")
        + (f" [tokens {rep.token_digest}]" if rep.token_digest else "")
    )
    for role, side in (("ref", rep.ref), ("test", rep.test)):
        if side is None:
            continue
        p = rep.plan[role]
        line = f"  {role:<5}{side['path']} ({side['kind']}, vocab {side['vocab']})"
        if "memory" in p:
            m = p["memory"]
            line += (
                f": one layer {human_bytes(m['max_layer_bytes'])}, final hidden states "
                f"{human_bytes(m['hidden_bytes'])} ({'RAM' if m['hidden_in_ram'] else 'disk'}), "
                f"peak {memory_line(m['need'])}"
            )
        print(line)


def _local(spec):
    """`hf:` checkpoints are downloaded (verified) first; dumps and compact references are local paths."""
    return None if spec is None else local_checkpoint(spec, progress=False)
