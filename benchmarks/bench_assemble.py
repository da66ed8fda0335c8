#!/usr/bin/env python
"""Benchmark `qtool assemble hybrid` against `cp -r` of the NVFP4 source + `sync`, each timed with its own `sync`
and against the naive approach (safetensors load_file each shard, replace, save_file), on a synthetic
Qwen3.5-MoE pair with real tensor names and dtypes, random data and a scaled-down config. Reports wall
time (median, min, max of --repeat interleaved rounds), peak RSS and the ratio to `cp -r + sync` (median over
rounds of the ratio within a round). The row "shared experts only" is the issue's speed target: every shard
changes, so every byte is rewritten.

    python benchmarks/bench_assemble.py --workdir /tmp/qbench [--hidden 2048 --layers 12 --experts 128]

Fairness: before every timed run, `sync` and drop the page cache (root: /proc/sys/vm/drop_caches; otherwise
every input file's pages are evicted with posix_fadvise(DONTNEED), which needs no root; the mode used is
printed), then re-import the programs' code (untimed). Every run is timed as the user waits for it: the
whole command from a fresh interpreter, then `sync`.

The issue's target row is a user's first run: `shared experts only, first run` clears qtool's sha256 cache
before each run, so the inputs are hashed (every NVFP4 shard and the BF16 files the output takes from) as
they would be on a first assemble of a local checkpoint; `... hashes cached` is the same job run again.

The pair generator (`build_pair`, qtool.fixtures.synthetic) is shared with tests/ops/test_assemble*.py.
The BF16 source's routed experts are written as holes (sparse files) except for layer 0's and the MTP
head's (what the run takes from it), so the BF16 side stays small on disk while its layout is the real one. By default
the runs use a subset of it holding only what assemble takes (`write_bf16_subset`), which is what `--bf16 hf:...`
range-fetches (an HF cache snapshot costs no hashing at all: blob names are the sha256); `--bf16-full`
times against the full sparse source instead. The cold-hash figure for the other source is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from qtool.fixtures.page_cache import evict
from qtool.fixtures.synthetic import build_pair, tensor_list, write_checkpoint  # noqa: F401 (used by main)
from qtool.io.writer import FileRange, OutTensor

GB = 10**9


# ---- measurement --------------------------------------------------------------------------------

_MEASURE = (
    "import resource, subprocess, sys, time, json\n"
    "t = time.perf_counter(); rc = subprocess.run(sys.argv[1:]).returncode; w = time.perf_counter() - t\n"
    "print(json.dumps({'rc': rc, 'wall': w, 'rss_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))\n"
)


def measure(cmd: list[str]) -> dict:
    """Wall time and peak RSS of `cmd`, measured in a fresh helper process (RUSAGE_CHILDREN is a max over
    that helper's children only)."""
    res = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True)
    line = res.stdout.strip().splitlines()[-1]
    d = json.loads(line)
    if d["rc"] != 0:
        raise SystemExit(f"{cmd[:3]} failed:\n{res.stdout}\n{res.stderr}")
    return d


# The programs' own code is re-read after each cache drop (not timed), so runs time data movement, not
# cold imports of torch/safetensors.
_WARM_CODE = (
    "import qtool.cli.main, qtool.cli.assemble_cmd, qtool.ops.assemble.execute, qtool.ops.checks, "
    "qtool.io.manifest, safetensors.torch"
)


def _read_all(paths: list[Path]) -> None:
    buf = bytearray(64 << 20)
    for root in paths:
        for f in sorted(root.rglob("*")):
            if f.is_file():
                with open(f, "rb", buffering=0) as fh:
                    while fh.readinto(buf):
                        pass


def reset_cache(inputs: list[Path], mode: str) -> str:
    """`sync`, then drop the page cache (mode "drop": the whole cache where /proc/sys/vm/drop_caches is
    writable, else every input file's pages with posix_fadvise(DONTNEED), which needs no root) so every run
    starts with cold inputs; mode "warm": read all inputs once so every run starts warm. Returns the mode
    used ("drop", "evict" or "warm")."""
    subprocess.run(["sync"], check=True)
    if mode == "drop":
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError:
            mode = "evict"
    if mode == "evict":
        evict(f for root in inputs for f in sorted(root.rglob("*")) if f.is_file())
    if mode == "warm":
        _read_all(inputs)
    subprocess.run([sys.executable, "-c", _WARM_CODE], check=True)
    return mode


def write_bf16_subset(bf: Path, out: Path, layers: list[int], mtp: str = "auto") -> Path:
    """What `--bf16 hf:...` gives qtool: a checkpoint holding only the tensors assemble takes
    (`bf16_source_patterns`), in shards named like the source's, with an index and the side files;
    tensor bytes are byte ranges of `bf`."""
    from qtool.hub.remote_safetensors import matcher
    from qtool.io.safetensors_header import read_header
    from qtool.io.writer import index_json, write_shard
    from qtool.ops.assemble.model import bf16_source_patterns

    match = matcher(bf16_source_patterns(layers, mtp))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shards = sorted(set(json.loads((bf / "model.safetensors.index.json").read_text())["weight_map"].values()))
    weight_map, total = {}, 0
    for shard in shards:
        h = read_header(bf / shard)
        ts = sorted((t for n, t in h.tensors.items() if match(n)), key=lambda t: t.start)
        if not ts:
            continue
        write_shard(
            out / shard,
            [OutTensor(t.name, t.dtype, t.shape, FileRange(t.file, t.start, t.end)) for t in ts],
            h.metadata or {"format": "pt"},
        )
        weight_map.update({t.name: shard for t in ts})
        total += sum(t.nbytes for t in ts)
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json(weight_map, total), indent=2) + "\n")
    for f in bf.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copyfile(f, out / f.name)
    return out


NAIVE = r"""
import json, os, shutil, sys
from pathlib import Path
from safetensors import safe_open
from safetensors.torch import load_file, save_file
nv, bf, out = map(Path, sys.argv[1:4])
layers0 = [int(x) for x in sys.argv[4].split(",") if x]
out.mkdir()
bidx = json.loads((bf / "model.safetensors.index.json").read_text())["weight_map"]
def bget(name):
    with safe_open(bf / bidx[name], "pt") as f:
        return f.get_tensor(name)
idx = json.loads((nv / "model.safetensors.index.json").read_text())["weight_map"]
wm = {}
for shard in sorted(set(idx.values())):
    d = load_file(nv / shard)
    mods = sorted({k.rsplit(".", 1)[0] for k in d if ".mlp.shared_expert." in k})
    for m in mods:
        for k in [k for k in d if k.startswith(m + ".")]:
            del d[k]
        d[m + ".weight"] = bget(m + ".weight")
    for L in layers0:
        p = f"model.language_model.layers.{L}.mlp.experts"
        ks = [k for k in d if k.startswith(p + ".")]
        if ks:
            for k in ks:
                del d[k]
            gu, dn = bget(p + ".gate_up_proj"), bget(p + ".down_proj")
            I = gu.shape[1] // 2
            for e in range(gu.shape[0]):
                d[f"{p}.{e}.gate_proj.weight"] = gu[e, :I].clone()
                d[f"{p}.{e}.up_proj.weight"] = gu[e, I:].clone()
                d[f"{p}.{e}.down_proj.weight"] = dn[e].clone()
    save_file(d, out / shard, metadata={"format": "pt"})
    wm.update({k: shard for k in d})
    del d
mtp = {k: bget(k) for k in bidx if k.startswith("mtp.")}
if mtp:
    save_file(mtp, out / "model-mtp.safetensors")
    wm.update({k: "model-mtp.safetensors" for k in mtp})
(out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
for f in nv.iterdir():
    if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
        shutil.copyfile(f, out / f.name)
"""


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _uptime() -> str:
    try:
        return "load average " + ", ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "load average unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/qtool-bench")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--shard-size", default="256MB")
    ap.add_argument("--bf16-expert-layers", default="0")
    ap.add_argument(
        "--bf16-full",
        action="store_true",
        help="time every run against the full-size (sparse) BF16 source instead of the subset "
        "checkpoint `--bf16 hf:...` would fetch (the cold run then hashes all of it)",
    )
    ap.add_argument(
        "--repeat", type=int, default=3, help="interleaved rounds (every job once per round; median, min, max reported)"
    )
    ap.add_argument(
        "--cache",
        choices=["drop", "warm"],
        default="drop",
        help="before every run: drop the page cache (the whole cache as root, else the inputs' pages with "
        "posix_fadvise) or read all inputs once (warm)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the generated pair for the next run")
    ap.add_argument(
        "--settle",
        type=float,
        default=5.0,
        help="seconds to wait after dropping the cache, before each timed run: on this VM's "
        "thin-provisioned disk a job right after another one's output was deleted ran up to 2x "
        "slower while the backend digested the discards",
    )
    ap.add_argument(
        "--prime",
        action="store_true",
        help="run every job once untimed right before its timed run, so that each timed run "
        "follows a run of the same job (on this VM a job after assemble's output was deleted ran "
        "slower, `cp -r` up to 1.6x, than after cp's own)",
    )
    ap.add_argument(
        "--target-only",
        action="store_true",
        help="run only the baseline and the shared-experts-only job (more rounds in less time)",
    )
    args = ap.parse_args(argv)
    from qtool.io.writer import parse_size

    wd = Path(args.workdir)
    nv, bf_full = wd / "nvfp4", wd / "bf16"
    if not (nv / "config.json").exists():
        shutil.rmtree(wd, ignore_errors=True)
        t = time.perf_counter()
        build_pair(
            wd,
            hidden=args.hidden,
            layers=args.layers,
            experts=args.experts,
            inter=args.inter,
            shared=args.inter,
            vocab=32768,
            shard_bytes=parse_size(args.shard_size),
            sparse_bf16_experts=True,
        )
        print(f"built the pair in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    layers = [int(x) for x in args.bf16_expert_layers.split(",") if x]
    bf_sub = write_bf16_subset(bf_full, wd / "bf16-subset", layers)
    bf, bf_other = (bf_full, bf_sub) if args.bf16_full else (bf_sub, bf_full)
    src_bytes = _du(nv)
    n_shards = len(list(nv.glob("*.safetensors")))
    load0 = _uptime()
    results: dict[str, list[dict]] = {}
    modes: set[str] = set()
    env_cache = wd / "hash-cache"
    os.environ["QTOOL_CACHE_DIR"] = str(env_cache)

    def fresh(p: Path) -> Path:
        for q in (p, p.with_name(p.name + ".partial")):
            shutil.rmtree(q, ignore_errors=True)
        return p

    def qtool(src: Path, out: Path, link: str, layers: str = args.bf16_expert_layers, mtp: str = "auto") -> list[str]:
        return [
            sys.executable,
            "-m",
            "qtool",
            "assemble",
            "hybrid",
            "--nvfp4",
            str(nv),
            "--bf16",
            str(src),
            "--bf16-expert-layers",
            layers,
            "--mtp",
            mtp,
            "--json",
            "--quiet",
            "-o",
            str(out),
            "--link",
            link,
        ]

    def waited(cmd: list[str]) -> list[str]:
        """What a user waits for: the command, then `sync` (as the baseline's `cp -r && sync`): a job that
        left its writes to the kernel's write-back is charged for them here."""
        return ["sh", "-c", f"{shlex.join(cmd)} >/dev/null && sync"]

    # (label, command, output dir, inputs, drop the sha256 cache first). Runs are interleaved: round r runs
    # every job once, in this order, so a drift in the disk's speed (this VM's varies up to 2x within
    # minutes) hits every job alike; ratios are taken within a round. Cached-hash jobs follow a cold one on
    # the same inputs.
    kind = "full sparse" if args.bf16_full else "subset"
    other = "subset" if args.bf16_full else "full sparse"
    out_cp, out, nout = wd / "out-cp", wd / "out-qtool", wd / "out-naive"
    base_label = "cp -r + sync (baseline)"
    shared_label = "qtool copy, shared experts only (all change)"
    first_label = "qtool copy, shared experts only, first run"
    # every job is timed with its `sync`, the page cache dropped before it (--cache drop): what a user waits for
    jobs = [
        (base_label, ["sh", "-c", f"cp -r '{nv}' '{out_cp}' && sync"], out_cp, [nv], False),
        ("cp -r (no sync)", ["cp", "-r", str(nv), str(out_cp)], out_cp, [nv], False),
        (f"qtool copy, sha256 cold ({kind})", waited(qtool(bf, out, "copy")), out, [nv, bf], True),
        ("qtool copy, sha256 cached", waited(qtool(bf, out, "copy")), out, [nv, bf], False),
        ("qtool --link auto, cached", waited(qtool(bf, out, "auto")), out, [nv, bf], False),
        (shared_label, waited(qtool(bf, out, "copy", layers="none", mtp="drop")), out, [nv, bf], False),
        (first_label, waited(qtool(bf, out, "copy", layers="none", mtp="drop")), out, [nv, bf], True),
        (f"qtool copy, sha256 cold ({other} BF16)", waited(qtool(bf_other, out, "copy")), out, [nv, bf_other], True),
        (
            "naive load_file/save_file + sync",
            waited([sys.executable, "-c", NAIVE, str(nv), str(bf), str(nout), args.bf16_expert_layers]),
            nout,
            [nv, bf],
            False,
        ),
    ]
    if args.target_only:
        jobs = [j for j in jobs if j[0] in (base_label, first_label, shared_label)]
    subprocess.run(qtool(bf, fresh(out), "copy"), capture_output=True, check=True)  # untimed: fills the hash cache
    fresh(out)
    for r in range(args.repeat):
        # with --target-only the jobs run in reverse order every other round, so none always runs right after
        # the same other's writes (the full job list keeps its order: cached-hash jobs must follow a cold one)
        for label, cmd, dst, inputs, cold_hashes in jobs[::-1] if args.target_only and r % 2 else jobs:
            fresh(dst)
            if cold_hashes:
                shutil.rmtree(env_cache, ignore_errors=True)
            if args.prime:  # an untimed run of the same job first: each timed run follows its own kind
                modes.add(reset_cache(inputs, args.cache))
                measure(cmd)
                fresh(dst)
            modes.add(reset_cache(inputs, args.cache))
            time.sleep(args.settle)
            results.setdefault(label, []).append(measure(cmd))
            fresh(dst)
        print(
            f"round {r + 1}/{args.repeat}: "
            + ", ".join(f"{k.split(',')[0][:24]} {v[-1]['wall']:.2f}s" for k, v in results.items()),
            file=sys.stderr,
        )
    res = subprocess.run(qtool(bf, fresh(out), "auto"), capture_output=True, text=True, check=True)
    rep = json.loads(res.stdout)
    out_bytes = _du(out)
    fresh(out)
    res = subprocess.run(qtool(bf, out, "copy", layers="none", mtp="drop"), capture_output=True, text=True, check=True)
    shared_plan = json.loads(res.stdout)["plan"]
    fresh(out)
    load1 = _uptime()

    def med(v: list[dict]) -> float:
        return statistics.median(r["wall"] for r in v)

    base = results[base_label]
    plan = rep["plan"]
    mode = {
        frozenset({"drop"}): "page cache dropped before every run",
        frozenset({"evict"}): "inputs' pages evicted (posix_fadvise DONTNEED) before every run",
        frozenset({"warm"}): "inputs read once before every run",
    }.get(frozenset(modes), f"mixed {modes}")
    print(
        f"NVFP4 source: {src_bytes / GB:.2f} GB in {n_shards} shards; BF16 source: {kind} "
        f"({_du(bf) / GB:.2f} GB apparent; the other: {_du(bf_other) / GB:.2f} GB); output {out_bytes / GB:.2f} GB; "
        f"shards: {plan['shards']}; linked with --link auto: {rep['result']['shards_linked']}"
    )
    print(
        f"bytes: reused {plan['bytes']['reused'] / GB:.3f} GB, rewritten {plan['bytes']['rewritten'] / GB:.3f} GB, "
        f"new {plan['bytes']['new'] / GB:.3f} GB"
    )
    print(f"shared experts only: shards {shared_plan['shards']}, output {shared_plan['bytes']['output'] / GB:.2f} GB")
    print(f"cache mode: {mode}; {args.repeat} interleaved rounds; {os.cpu_count()} CPUs; {load0} before, {load1} after")
    print(f"{'run':<46} {'wall s med':>10} {'min':>7} {'max':>7} {'x cp+sync':>10} {'peak RSS MB':>12}")
    for k, v in results.items():
        # the ratio: median over rounds of (this run / the baseline run of the same round)
        ratio = statistics.median(a["wall"] / b["wall"] for a, b in zip(v, base, strict=True))
        print(
            f"{k:<46} {med(v):>10.2f} {min(r['wall'] for r in v):>7.2f} {max(r['wall'] for r in v):>7.2f} "
            f"{ratio:>10.2f} {max(r['rss_kb'] for r in v) / 1024:>12.0f}"
        )
    if not args.keep:
        shutil.rmtree(wd, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
