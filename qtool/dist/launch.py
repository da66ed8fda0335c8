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

from qtool.errors import UsageError

GRACE_S = 10.0  # how long the other ranks get to stop on their own after one failed


def rank_devices(nproc: int | None, devices: str | None, device: str) -> list[str]:
    """The device of each rank: --devices as given; --nproc N on cuda: cuda:0..N-1; on cpu: N x cpu."""
    if devices:
        out = [d.strip() for d in devices.split(",") if d.strip()]
        if nproc not in (None, len(out)):
            raise UsageError(f"--nproc {nproc} but --devices names {len(out)} devices", hint="give one of them")
        if len(set(out)) != len(out) and not all(d == "cpu" for d in out):
            raise UsageError(f"--devices names a GPU twice: {devices}", hint="one rank per GPU")
        return out
    n = nproc or 1
    if n < 1:
        raise UsageError("--nproc must be at least 1")
    if device.startswith("cuda"):
        if ":" in device and n > 1:
            raise UsageError(f"--device {device} with --nproc {n}", hint="use --devices cuda:0,cuda:1,... instead")
        return [f"cuda:{i}" for i in range(n)] if n > 1 else [device]
    return [device] * n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: list[str], devices: list[str]) -> int:
    """Run `qtool argv` once per device as ranks 0..N-1; returns the run's exit code."""
    world = len(devices)
    base = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "QTOOL_DEVICES": ",".join(devices)}
    procs = []
    for r in range(world):
        env = {**base, "RANK": str(r), "LOCAL_RANK": str(r)}
        # rank 0 speaks for the run (its report, progress, errors); the others only report errors
        procs.append(subprocess.Popen([sys.executable, "-m", "qtool", *argv], env=env,
                                      stdout=None if r == 0 else subprocess.DEVNULL))
    try:
        return _watch(procs)
    except KeyboardInterrupt:
        _stop(procs)
        print("interrupted", file=sys.stderr)
        return 130


def _watch(procs: list[subprocess.Popen]) -> int:
    failed: tuple[int, int] | None = None
    deadline = None
    while True:
        codes = [p.poll() for p in procs]
        if failed is None:
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                deadline = time.monotonic() + GRACE_S
        if all(c is not None for c in codes):
            break
        if deadline is not None and time.monotonic() > deadline:
            _stop(procs)
            break
        time.sleep(0.1)
    if failed is None:
        return 0
    rank, code = failed
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    print(f"qtool: rank {rank} of {len(procs)} {how}; the run stopped on every rank. The partial output is kept: "
          f"re-run the same command with --resume (any number of ranks) to continue.", file=sys.stderr)
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
