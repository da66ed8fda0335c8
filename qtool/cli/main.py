"""`qtool` entry point. Commands are listed in one explicit table; each command module defines
`add_arguments(parser)` and `run(args) -> int` and keeps heavy imports (torch, transformers) inside
`run`, so `qtool --help` and `qtool CMD --help` start fast."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from qtool import __version__, dist, notices, process_exit, redact
from qtool.cli.common import as_user_named, check_batch_tokens
from qtool.dist.launch import rank_devices, spawn
from qtool.errors import QtoolError, UsageError
from qtool.io.files import write_error
from qtool.io.output import kept_partials
from qtool.quiet import pinned_pair_warnings_off
from qtool.redact import command_line

# name -> (module, one-line help). Sub-command groups (e.g. `assemble hybrid`) are handled by the module.
COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("qtool.cli.inspect_cmd", "summarise a checkpoint: groups, formats, layout, KV scales, problems"),
    "patch-config": ("qtool.cli.patch_config_cmd", "apply named fixes to config.json / hf_quant_config.json"),
    "assemble": ("qtool.cli.assemble_cmd", "assemble artifacts (hybrid: BF16 tensors spliced into NVFP4)"),
    "calibrate-kv": (
        "qtool.cli.calibrate_kv_cmd",
        "FP8 KV-cache scales for the full-attention layers (layer-streamed)",
    ),
    "download": ("qtool.cli.download_cmd", "download a Hub repo (verified), or just some tensors by range requests"),
    "build": ("qtool.cli.build_cmd", "run a build recipe: content-addressed steps, provenance manifest"),
    "eval": ("qtool.cli.eval_cmd", "evaluate a model against a reference (kld: KL divergence per token position)"),
    "verify": (
        "qtool.cli.verify_cmd",
        "check an artifact for vLLM/SGLang on the target GPUs: structure, engine rules, TP, memory fit",
    ),
    "serve-config": ("qtool.cli.serve_config_cmd", "launch command / docker-compose service for a verified artifact"),
    "quantize": ("qtool.cli.quantize_cmd", "quantize a BF16 checkpoint by a recipe (layer-streamed, NVFP4 / AWQ INT4)"),
    "convert": ("qtool.cli.convert_cmd", "convert NVFP4 between ModelOpt and compressed-tensors (lossless)"),
    "report": (
        "qtool.cli.report_cmd",
        "one self-contained HTML page of an artifact (or two, compared): formats per "
        "layer, engine findings, KV scales, memory fit, KLD, provenance",
    ),
    "sensitivity": (
        "qtool.cli.sensitivity_cmd",
        "measure each unit's quantization error against BF16 (layer-streamed): the table plan hybrid chooses from",
    ),
    "plan": ("qtool.cli.plan_cmd", "plan an artifact (hybrid: the BF16 units that fit and buy the most quality)"),
    "recipes": ("qtool.cli.recipes_cmd", "the shipped quantization and build recipes, and what each will do"),
}


def _load(name: str):
    return importlib.import_module(COMMANDS[name][0])


class _Parser(argparse.ArgumentParser):
    """argparse, with a "did you mean" for a mistyped flag, shown with the (sub)command's own usage:
    argparse reports unknown flags from the top-level parser, which knows none of the command's. No
    abbreviations: a prefix that works today would silently mean another flag once one is added."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            target = self._deepest(ns)
            options = [o for a in target._actions for o in a.option_strings]
            import difflib

            hints = []
            for x in redact.redact_argv(extras):  # a mistyped --token's value too (qtool.redact.is_secret_flag)
                close = difflib.get_close_matches(x.split("=", 1)[0], options, n=1, cutoff=0.6)
                hints.append(f"{x} (did you mean {close[0]}?)" if close else x)
            target.error("unrecognized argument(s): " + ", ".join(hints))
        return ns

    json_errors = False  # --json in this command line (set by _main): a usage error is JSON too

    def error(self, message: str):
        """argparse's usage error, with the --token value and anything shaped like a token redacted (an
        error never shows one); under --json the same error object as any other error, on stdout."""
        message = redact.redact_text(message)
        if _Parser.json_errors:
            err = UsageError(message, hint=f"see `{self.prog} --help`")
            print(json.dumps(err.to_json(), indent=2))
            self.exit(err.exit_code)
        super().error(message)

    def _deepest(self, ns) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = self
        for dest in ("command", "kind", "what"):
            name = getattr(ns, dest, None)
            subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if not name or not subs or name not in subs[0].choices:
                break
            parser = subs[0].choices[name]
        return parser


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every flag the parser (and its sub-commands) knows: a real flag is never taken for a mistyped --token."""
    out: set[str] = set()
    for action in parser._actions:
        out.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _option_strings(sub)
    return out


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="qtool",
        description="Turn huge MoE checkpoints (Qwen3.5-397B-A17B and siblings) into serving-ready, "
        "verified artifacts for vLLM and SGLang.",
    )
    parser.add_argument("--version", action="version", version=f"qtool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_mod, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only == name:
            _load(name).add_arguments(p)
    return parser


def _parallel(args, argv: list[str]) -> int | None:
    """`--nproc` / `--devices`: start the ranks here (qtool.dist.launch) and return the run's exit code; in a
    rank (WORLD_SIZE set by the launch or torchrun), take this rank's device and quiet its output. None:
    run the command in this process."""
    if not hasattr(args, "nproc"):
        return None
    check_batch_tokens(args.batch_tokens)

    dist.resumable = hasattr(args, "resume")  # what a lost rank (here or in the launcher) offers
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        devices = [d for d in os.environ.get("QTOOL_DEVICES", "").split(",") if d]
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        if devices:
            args.device = devices[local]
        elif args.device.startswith("cuda") and ":" not in args.device:
            args.device = f"cuda:{local}"  # torchrun: one GPU per local rank
        if int(os.environ.get("RANK", "0")) > 0:
            # rank 0 speaks for the run; the others' reports are discarded (also under torchrun, which
            # shows every rank's stdout), their errors still reach stderr (main() chose their format)
            args.quiet = True
            args.json = True
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (stdout for the rest of the process)
        return None

    devices = rank_devices(args.nproc, args.devices, args.device, check_gpus=not getattr(args, "dry_run", False))
    args.device = devices[0]  # (a dry run plans rank 0's device; the ranks set their own)
    if len(devices) == 1:
        return None
    if getattr(args, "dry_run", False):
        os.environ["QTOOL_PLANNED_RANKS"] = str(len(devices))  # the plan's memory is per rank
        return None

    # refusals every rank would make, made once here
    if getattr(args, "save_ref", None) or getattr(args, "emit_windows", None):
        raise UsageError(
            "--save-ref and --emit-windows run in one process",
            hint="drop --nproc/--devices for them; the KLD comparison itself runs on any number of ranks",
        )
    if getattr(args, "backend", None) not in (None, "rtn"):
        raise UsageError(
            f"--backend {args.backend} runs in one process (the peer library's calibration state is "
            "not reduced over ranks)",
            hint="use --backend rtn with --nproc/--devices, or one process",
        )
    return spawn(argv, devices, resumable=dist.resumable)


def console() -> None:
    """The `qtool` executable (and `python -m qtool`): main(), then the exit with Ctrl-C ignored. The
    command's work and exit code are settled by then; a Ctrl-C landing in torch's exit handlers would only
    print a KeyboardInterrupt traceback over a finished run. The exit skips the interpreter's teardown where
    nothing needs it (qtool.process_exit): 0.75 s of every command's end once torch and transformers are
    imported, after its output is complete."""
    import signal

    # a line at a time also into a file or a pipe (`qtool quantize ... > log`): a long job's plan and
    # progress reach the log as they are printed, not in one block at its end
    sys.stdout.reconfigure(line_buffering=True)
    code = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not process_exit.teardown_needed():
        process_exit.end_now(code)
    raise SystemExit(code)


# torch's CUDA caching allocator, unless the user configured it: segments that grow in place rather than a
# new block per size. A layer-streamed job allocates and frees a 13 GB layer, its read-ahead and ~25 GB of
# activations of varying shapes every layer; with fixed segments the allocator held 75.6 GB for 60.7 GB
# handed out (a 3-layer 397B quantize on the lent H200), with expandable ones 66.9 GB for 60.8.
ALLOCATOR_DEFAULT = "expandable_segments:True"


def gpu_allocator_defaults() -> None:
    """Set ALLOCATOR_DEFAULT before torch is imported (its allocator reads the variable once), where neither
    of the variables torch reads is set (PYTORCH_ALLOC_CONF, and its older name)."""
    if not any(os.environ.get(v) for v in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_DEFAULT


class StdoutUnwritable(Exception):
    """stdout refused a write (`qtool ... > out.json` on a full disk): the command's output is lost."""


class _Stdout(redact.RedactingStream):
    """stdout while a command runs. It is line-buffered (a long job's lines reach a log as they come), so a
    full disk under `> out.json` fails a write inside the command rather than Python's final flush: that
    ends the command as the final flush would (process_exit.UNWRITTEN), never as a traceback or as an
    error of the command's own."""

    def write(self, text: str) -> int:
        try:
            return super().write(text)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutUnwritable(e) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutUnwritable(e) from None


def main(argv: list[str] | None = None) -> int:
    # what a command prints (a report naming the paths the user typed, an error, a notice) is redacted
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Stdout(out), redact.RedactingStream(err)
    try:
        code = _main(argv)
    finally:
        sys.stdout, sys.stderr = out, err
        warm = sys.modules.get("qtool.stream.warm_import")
        if warm is not None:
            # a job that failed before its layers (a full disk, a lock held, a bug's traceback) may leave the
            # background import of transformers running: a daemon thread in torch's code at the
            # interpreter's exit aborts it (qtool.io.hashed_writes.HashedWrites.stop)
            warm.join()

    dist.end_rank(code)  # a rank of several ends here, without the interpreter's teardown
    return code


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Only the chosen command's module is imported, so `--help` stays cheap.
    chosen = next((a for a in argv if a in COMMANDS), None)
    _Parser.json_errors = "--json" in argv
    parser = build_parser(chosen)
    redact.learn_from_argv(argv, _option_strings(parser))
    first = next((a for a in argv if not a.startswith("-")), None)
    if chosen is None and first is not None:
        import difflib

        close = difflib.get_close_matches(first, COMMANDS, n=1, cutoff=0.6)
        parser.error(
            f"unknown command {first!r}"
            + (f" (did you mean {close[0]}?)" if close else f"; the commands: {', '.join(COMMANDS)}")
        )
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    want_json = bool(getattr(args, "json", False))

    notices.to_stderr(not getattr(args, "quiet", False))
    # transformers' notices (kernel fallbacks, standalone expert modules, long tokenizer inputs) are
    # expected when qtool runs decoder layers one at a time; it reads this variable at import time.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    pinned_pair_warnings_off()
    gpu_allocator_defaults()
    try:
        launched = _parallel(args, argv)
        if launched is not None:
            return launched
        return int(_load(args.command).run(args) or 0)
    except QtoolError as e:
        if os.environ.get("QTOOL_DEBUG"):
            raise

        for field in ("message", "path", "hint", "expected", "got"):
            setattr(e, field, as_user_named(getattr(e, field)))
        _print_error(e, want_json)
        return e.exit_code
    except KeyboardInterrupt as e:
        print(_interrupted(args, argv, e), file=sys.stderr)
        return 130
    except StdoutUnwritable as e:
        process_exit.drop_stdout()
        print(f"qtool: could not write the output to stdout ({e})", file=sys.stderr)
        return process_exit.UNWRITTEN
    except BrokenPipeError:
        # `qtool inspect ... | head`: the reader went away; exit quietly like other CLI tools (and keep
        # Python from complaining again while flushing stdout at exit)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:
        # an environment failure no op turned into a QtoolError (read-only or full disk, a vanished
        # file): still one clear message with the file and the fix, never a traceback
        if os.environ.get("QTOOL_DEBUG"):
            raise

        err = write_error(f"{e.strerror or type(e).__name__}", e, e.filename or "?")
        err.message = f"I/O error: {e.strerror or e}"
        _print_error(err, want_json)
        return 1


def _print_error(e: QtoolError, want_json: bool) -> None:
    """The error as JSON on stdout with --json, else as text on stderr. A rank other than rank 0 of several
    always writes text to stderr: its stdout is discarded (rank 0 speaks for the run, _parallel), and the
    launcher's last line says its error is above."""
    other_rank = int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) > 0
    if want_json and not other_rank:
        print(json.dumps(redact.redact_json(e.to_json()), indent=2))
    else:
        print(redact.redact_text(e.describe()), file=sys.stderr)


def _interrupted(args, argv: list[str], e: KeyboardInterrupt) -> str:
    """Ctrl-C's message: what was running, what was kept, and the command that continues it."""
    during = getattr(e, "during", None)
    lines = [f"interrupted{f' during {during}' if during else ''}"]
    kept = kept_partials()
    for p in kept:
        lines.append(f"  kept:     {p} (the work finished so far)")
    if kept and hasattr(args, "resume"):
        # a token is never printed, and `--token '***'` is no command to run: it is left out, and said so
        again, had_token = redact.without_secrets(argv)
        again = again if "--resume" in again else [*again, "--resume"]
        lines.append(f"  continue: {command_line(['qtool', *again])}")
        if had_token:
            lines.append("            (give the token again: set HF_TOKEN, or add --token TOKEN)")
    return "\n".join(lines)


if __name__ == "__main__":
    console()
