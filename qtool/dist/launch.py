"""`--nproc N` / `--devices a,b,...`: start the ranks of a data-parallel run as child processes of this
one (what `torchrun --nproc-per-node N` would do, without needing it), watch them, and end the run
cleanly when one fails: the others are stopped after a short grace period (they also stop on their own
when a collective loses its peer), so a dead rank never leaves the run hanging. The partial output is
kept by rank 0's transaction: `--resume` continues it, with any number of ranks.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import qtool
from qtool.errors import UsageError
from qtool.notices import tell

GRACE_S = 10.0  # how long the other ranks get to stop on their own after one failed


def rank_devices(nproc: int | None, devices: str | None, device: str, check_gpus: bool = True) -> list[str]:
    """The device of each rank: --devices as given; --nproc N on cuda: cuda:0..N-1; on cpu: N x cpu.
    check_gpus=False for a dry run, which may plan a GPU job on another machine."""
    if nproc is not None and nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {nproc}")
    if devices:
        out = [_indexed(d.strip()) for d in devices.split(",") if d.strip()]
        if nproc not in (None, len(out)):
            raise UsageError(f"--nproc {nproc} but --devices names {len(out)} devices", hint="give one of them")
        if len({d == "cpu" for d in out}) > 1:
            raise UsageError(
                f"--devices mixes CPU and GPU ranks: {devices}",
                hint="one kind of device for every rank (their numerics must agree)",
            )
        if len(set(out)) != len(out) and out[0] != "cpu":
            raise UsageError(f"--devices names a GPU twice: {devices}", hint="one rank per GPU")
        if check_gpus:
            _check_gpus(out)
        return out
    n = nproc or 1
    if device.startswith("cuda"):
        if ":" in device and n > 1:
            raise UsageError(f"--device {device} with --nproc {n}", hint="use --devices cuda:0,cuda:1,... instead")
        out = [f"cuda:{i}" for i in range(n)] if n > 1 else [device]
        if n > 1 and check_gpus:
            _check_gpus(out)
        return out
    return [device] * n


def _indexed(d: str) -> str:
    return "cuda:0" if d == "cuda" else d


def _check_gpus(devices: list[str]) -> None:
    """Before any rank starts: the GPUs named exist (else every rank would fail on its own)."""
    if devices[0] == "cpu":
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = max(int(d.partition(":")[2] or 0) for d in devices) + 1
    if have < need:
        raise UsageError(
            f"{len(devices)} GPU ranks ({', '.join(devices)}) but this machine has {have} CUDA device(s)",
            hint="use --nproc/--devices within the GPUs present, or --device cpu",
        )


def require_device(device: str, *, elsewhere: bool = False) -> None:
    """The CUDA device `--device` names (cuda, cuda:N) is on this machine: a usage error naming it
    otherwise, a --dry-run's too where this machine has CUDA devices. `elsewhere` (a --dry-run): a machine
    with none may plan a GPU job for another machine; it is said, not refused."""
    if not device.startswith("cuda"):
        return
    index = device.partition(":")[2]
    if index and not index.isdigit():
        raise UsageError("--device must be cpu, cuda or cuda:N", got=device)
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0 and elsewhere:
        tell(f"--device {device}: this machine has no CUDA device; the plan is for a machine that has one")
        return
    if have == 0:
        raise UsageError(f"--device {device} but no CUDA device is available", hint="use --device cpu")
    if int(index or 0) >= have:
        raise UsageError(
            f"--device {device} but this machine has {have} CUDA device(s)",
            hint=f"use --device cuda:0 to cuda:{have - 1}, or --device cpu",
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with(launcher: int):
    """A rank's pre-exec hook: the kernel sends it SIGKILL when the launcher dies (a kill -9 of the launcher
    alone must not leave ranks that go on and publish; the output contract makes it a resumable kill)."""

    def hook() -> None:
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            return  # not Linux: the launcher's SIGTERM handler is all there is
        if os.getppid() != launcher:  # the launcher died before the prctl took effect
            os._exit(1)

    return hook


def rank_command(argv: list[str]) -> list[str]:
    """The command line of one rank: this interpreter running the qtool package this process runs. Not
    `python -m qtool`: that puts the current folder first on sys.path, and a folder named `qtool` there (the
    parent of a clone, or any empty `qtool/`) shadows the package in every rank."""
    package_root = str(Path(qtool.__file__).resolve().parents[1])
    boot = f"import sys; sys.path[0] = {package_root!r}; from qtool.cli.main import console; console()"
    return [sys.executable, "-c", boot, *argv]


def spawn(argv: list[str], devices: list[str], resumable: bool = True) -> int:
    """Run `qtool argv` once per device as ranks 0..N-1; returns the run's exit code."""
    world = len(devices)
    base = {
        **os.environ,
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "QTOOL_DEVICES": ",".join(devices),
    }
    if "OMP_NUM_THREADS" not in os.environ:
        # the box's cores shared out (torchrun sets 1): N ranks of torch's default each would run N times
        # the cores' threads and slow every rank down
        base["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // world))
    procs = []
    for r in range(world):
        env = {**base, "RANK": str(r), "LOCAL_RANK": str(r)}
        # rank 0 speaks for the run (its report, progress, errors); the others only report errors
        procs.append(
            subprocess.Popen(
                rank_command(argv),
                env=env,
                stdout=None if r == 0 else subprocess.DEVNULL,
                preexec_fn=_die_with(os.getpid()),
            )
        )

    def terminate(signum, frame):  # a SIGTERM to the launcher stops the ranks too (no orphans)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        return _watch(procs, resumable)
    except KeyboardInterrupt:
        _stop(procs)  # each rank reports its own interruption
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _watch(procs: list[subprocess.Popen], resumable: bool) -> int:
    failed: list[tuple[int, int]] = []
    deadline = None
    while True:
        codes = [p.poll() for p in procs]
        if not failed:
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            # seen in one pass: a rank killed by a signal is the cause, the others' exits the effect (they
            # lost it: a rank exits as soon as its collective fails). Ranks that exited with a status in one
            # pass are all named: the one that failed exits only milliseconds before those that lose it, and
            # naming the lowest of them alone often named rank 0, whose error is only "lost the other ranks"
            killed = [rc for rc in bad if rc[1] < 0]
            failed = killed[:1] or bad
            if failed:
                deadline = time.monotonic() + GRACE_S
        if all(c is not None for c in codes):
            break
        if deadline is not None and time.monotonic() > deadline:
            _stop(procs)
            break
        time.sleep(0.1)
    if not failed:
        return 0
    if len(failed) == 1:
        rank, code = failed[0]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        who = f"rank {rank} of {len(procs)} {how} (its error is above)"
    else:
        ranks = ", ".join(f"{r} (status {c})" for r, c in failed)
        who = (
            f"ranks {ranks} of {len(procs)} exited at once (their errors are above: the one that does not "
            "say it lost the other ranks is the cause)"
        )
    then = (
        " If it had started writing, its partial output is kept: re-run the same command with --resume "
        "(any number of ranks) to continue."
        if resumable
        else ""
    )
    print(f"qtool: {who}; the run stopped on every rank.{then}", file=sys.stderr)
    rc0 = procs[0].returncode
    return rc0 if rc0 not in (None, 0) and rc0 > 0 else 1


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
