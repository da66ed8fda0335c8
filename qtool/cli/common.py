"""Small helpers shared by the command modules (output only; no logic)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
from collections.abc import Callable

from qtool.sizes import human_bytes

# --dataset of every command that tokenizes text (qtool.stream.calib_data reads each of these)
DATASET_HELP = (
    "`builtin` (shipped corpus), FILE.txt, FILE.jsonl / FILE.parquet (a `text` or chat `messages` "
    "column), or a Hub dataset hf:ORG/NAME[@REV][:SPLIT] (e.g. hf:HuggingFaceH4/ultrachat_200k:train_sft)"
)


def add_json_flag(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print one machine-readable JSON object")


def add_output_flags(parser, *, output: str = "required", resume: bool = True, output_help: str | None = None) -> None:
    """The flags every writing command shares, with one meaning each (README "One contract"):
    -o/--output (`required`, `optional`, or `none` for commands that write in place), --force (replace an
    OUT that qtool made), --resume, --dry-run, --quiet and --json."""
    if output != "none":
        parser.add_argument(
            "-o",
            "--output",
            metavar="OUT",
            required=output == "required",
            help=output_help or "output directory (written as OUT.partial/, then renamed)",
        )
        parser.add_argument(
            "--force",
            action="store_true",
            help="replace an existing OUT that qtool made (any other directory is refused)",
        )
    if resume:
        parser.add_argument(
            "--resume", action="store_true", help="continue an interrupted run of the same command from OUT.partial/"
        )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan (headers and configs only); write nothing"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_json_flag(parser)


def add_parallel_flags(parser) -> None:
    """The data-parallel flags of the layer-streamed commands (quantize, calibrate-kv, eval kld), one
    meaning each (qtool.dist): ranks over the calibration windows, and the micro-batch they share."""
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="run N ranks (processes) over the windows: gloo on CPU, one GPU each with --device cuda",
    )
    parser.add_argument(
        "--devices",
        default=None,
        metavar="LIST",
        help="one rank per device, e.g. cuda:0,cuda:1,cuda:2,cuda:3 (NCCL + gloo)",
    )
    parser.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        metavar="T",
        help="tokens per micro-batch (default 4096 on CPU, 32768 on GPU); the unit the ranks share",
    )


_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def number(
    kind: type = float, *, low: float | None = None, high: float | None = None, low_open: bool = False
) -> Callable[[str], float]:
    """An argparse `type` for a numeric flag: `kind` (int or float), finite, within [low, high] (or
    (low, high] with low_open). A value outside is argparse's usage error, which names the flag and
    exits 2 (nan, inf and 1e308 are refused here, not turned into a traceback by the plan's arithmetic)."""
    if low_open:
        bounds = f"more than {low}" + ("" if high is None else f" and at most {high}")
    else:
        bounds = " and ".join(
            ([] if low is None else [f"at least {low}"]) + ([] if high is None else [f"at most {high}"])
        )
    want = ("a whole number" if kind is int else "a finite number") + (f" {bounds}" if bounds else "")

    spelling = _INT if kind is int else _FLOAT

    def parse(text: str):
        if not spelling.fullmatch(text.strip()):  # ASCII digits only: Python also reads "1_0" and "٣"
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        value = kind(text)
        if (
            not math.isfinite(value)
            or (low is not None and (value <= low if low_open else value < low))
            or (high is not None and value > high)
        ):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse's own messages name the type
    return parse


def path_arg(text: str) -> str:
    """An argparse `type` for a path flag: not empty (an empty -o would mean "no output" and exit 0)."""
    if not text:
        raise argparse.ArgumentTypeError("must be a path, got an empty string")
    return text


def run_command_line() -> str:
    """This process's qtool command line for a manifest, secrets redacted (qtool.io.manifest)."""
    from qtool.io.manifest import command_line

    return command_line(["qtool", *sys.argv[1:]])


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def layer_ranges(layers) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    out: list[list[int]] = []
    for n in sorted(layers):
        if out and n == out[-1][-1] + 1:
            out[-1].append(n)
        else:
            out.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out)


def memory_line(m: dict) -> str:
    """One line for the plan printout from MemoryNeed.to_json()."""
    per = f"host ~{human_bytes(m['host_bytes_per_rank'])}"
    if m["gpu_bytes_per_rank"] is not None:
        per += f", GPU ~{human_bytes(m['gpu_bytes_per_rank'])}"
    if m["ranks"] > 1:
        per += f" per rank x {m['ranks']}"
    verdict = {
        True: "fits this machine",
        False: "does NOT fit: " + "; ".join(m["problems"]),
        None: "fit unknown here (no limit readable for " + m["device"] + ")",
    }[m["fits"]]
    return f"{per}; {verdict}"


def eprint(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def local_checkpoint(spec, *, tensors=None, progress: bool | None = None):
    """A checkpoint argument (local path or `hf:ORG/NAME[@REV]`) -> a local directory; Hub sources are
    downloaded (verified) through qtool.hub, with progress bars when stderr is a terminal (progress=None).
    Imported lazily: huggingface_hub is not needed for --help."""
    import sys

    from qtool.hub.resolve import resolve_checkpoint

    return resolve_checkpoint(spec, tensors=tensors, progress=sys.stderr.isatty() if progress is None else progress)


# header-only stand-in directory -> the hf: source it stands for: what the user sees in messages and fixes
# (a fix naming qtool's cache would have the user patch the cache instead of their checkpoint)
STAND_INS: dict[str, str] = {}


def as_user_named(text):
    """`text` (a str, or None) with every header-only stand-in path replaced by its hf: source."""
    if not isinstance(text, str):
        return text
    for path, spec in STAND_INS.items():
        text = text.replace(path, spec)
    return text


def headers_checkpoint(spec, *, token=None):
    """For commands that read only headers and configs (inspect, verify without --deep, serve-config): a
    local path as it is; `hf:ORG/NAME[@REV]` as a header-only stand-in (qtool.hub.headers: configs and
    shard headers by range requests, cached by commit, offline when cached), its traffic on stderr."""
    from qtool.hub.resolve import is_hub_spec, parse_spec

    if not is_hub_spec(spec):
        return local_checkpoint(spec)
    from qtool.hub.headers import remote_headers

    path, got = remote_headers(parse_spec(str(spec)), token=token)
    STAND_INS[str(path)] = str(spec)
    how = (
        "from the cache, nothing fetched"
        if got["cached"]
        else (f"{human_bytes(got['bytes_moved'])} in {got['requests']} range request(s)")
    )
    print(f"{spec}: headers and configs of commit {got['commit'][:12]} ({how}); data not downloaded", file=sys.stderr)
    return path


def local_only(spec):
    """For commands that write into the checkpoint itself: a Hub source gets a clear error."""
    from qtool.hub.resolve import require_local

    return require_local(spec)


def check_device(device: str, *, present: bool = False) -> str:
    """--device's form, and the GPU it names: on this machine where it has CUDA devices (a dry run too);
    with `present` (a run that computes here) also where it has none. A dry run on a machine without CUDA
    may plan a GPU job for another machine: said, not refused. Checked at once, before the plan reads data."""
    from qtool.dist.launch import require_device
    from qtool.errors import UsageError

    if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise UsageError("--device must be cpu, cuda or cuda:N", got=device)
    require_device(device, elsewhere=not present)
    return device


def check_batch_tokens(value: int | None) -> None:
    """--batch-tokens, where a command has it: a micro-batch holds at least one token."""
    from qtool.errors import UsageError

    if value is not None and value < 1:
        raise UsageError(
            f"--batch-tokens must be at least 1, got {value}",
            hint="give a positive token count, or leave it out for the default",
        )


def show_progress(args) -> bool:
    """Progress bars only for a person watching: not with --quiet or --json, and not when stderr is a
    file or a pipe (a CI log would get a line per redraw)."""
    return not (getattr(args, "quiet", False) or getattr(args, "json", False)) and sys.stderr.isatty()


def progress_lines(args) -> bool:
    """A line per step of work instead of a bar: stderr is a file or a pipe (a log of a long job must show it
    moving), and neither --quiet nor --json was given."""
    return not (getattr(args, "quiet", False) or getattr(args, "json", False) or sys.stderr.isatty())


def plan_then_execute(op, opts, args, show_plan=None) -> dict:
    """A layer-streamed op from the CLI: `op.plan(opts)`, the plan shown (`show_plan(plan_json)`, unless
    --json) before any work starts, then (unless --dry-run) `op.execute` with a per-layer progress bar (or a
    line per layer when stderr is not a terminal); the report as `--json` prints it ({"plan": ...} for a
    dry run)."""
    from qtool.stream import warm_import

    with warm_import.overlapping(not args.dry_run):  # transformers' decoder module, imported while the job plans
        p = op.plan(opts)
    if show_plan is not None and not getattr(args, "json", False):
        show_plan(p.to_json())
        sys.stdout.flush()
    if args.dry_run:
        return {"plan": p.to_json()}
    mode = "bar" if show_progress(args) else "lines" if progress_lines(args) else None
    with layer_progress(mode, total=getattr(p, "layers_run", None)) as progress:
        return op.execute(p, progress=progress).to_json()


def dataset_supply(c: dict) -> str:
    """The text ` (the dataset gives N: up to W windows)` for a plan's calibration section, when counted."""
    if "available_tokens" not in c:
        return ""
    return f" (the dataset gives {c['available_tokens']}: up to {c['available_windows']} windows)"


@contextlib.contextmanager
def layer_progress(mode: str | None, total: int | None = None):
    """Per-layer progress for layer-streamed commands; yields the callback, given the index of the layer
    just finished (None when off). mode "bar": a tqdm bar with the total, percentage and ETA; "lines": a
    line per layer on stderr (`layers: 3/8 done`)."""
    if mode is None:
        yield None
        return
    if mode == "lines":
        yield lambda idx: eprint(f"layers: {idx + 1}/{total or '?'} done")
        return
    from tqdm import tqdm

    bar = tqdm(desc="layers", unit="layer", total=total)
    try:
        # set to the layer's position, not +1: a resumed run starts where its journal stopped
        yield lambda idx: bar.update(idx + 1 - bar.n)
    finally:
        bar.close()
