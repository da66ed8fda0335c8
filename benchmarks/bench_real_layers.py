#!/usr/bin/env python3
"""Layer-streamed jobs at the real Qwen3.5-397B layer size, timed next to `cat` of the same bytes.

Builds a checkpoint whose every tensor has the 397B's real shape (hidden 4096, 512 experts x 1024 per
expert, shared expert 1024, GDN 16/64 heads of 128, attention 32/2 heads of 256, vocab 248320; random
BF16; N decoder layers, the last one full attention, no MTP head; a 13 GB BF16 layer; `--model 122b` /
`35b`: the siblings' shapes) on the local disk, then runs, each as a user would (`python -m qtool ...`,
its own process, or `--nproc N` ranks: one row per rank count of `--nproc 1,2,4`, the scaling table):
  quantize --recipe qwen35-nvfp4-experts     (BF16 -> NVFP4 routed experts + calibrated scales)
  awq: quantize --recipe qwen35-awq-int4     (BF16 -> INT4 routed experts, AWQ scale search)
  calibrate-kv --replace-scales              (on quantize's output)
  eval-kld --save-ref                        (on quantize's output; one process only)
  eval-kld-pair: eval kld --ref BF16 --test NVFP4   (both sides streamed: sensitivity's inputs)
  sensitivity BF16 NVFP4                     (every unit's error, measured; compare with eval-kld-pair)
cold (page cache dropped, where the kernel lets root do it) and warm (the same run again), and `cat` of the
job's input files once, in the same run. Prints per job: wall, layer loop, seconds per layer, time before
the first layer, the ratio of the layer loop to `cat`, peak host RSS (the job's process) and peak GPU
memory (nvidia-smi, sampled), and the projection to all the model's layers (60 for the 397B) on this disk and on a
14 GB/s one.

    python3 benchmarks/bench_real_layers.py --workdir /tmp/brl --layers 2 --samples 16 --seq-len 2048
    python3 benchmarks/bench_real_layers.py --smoke --workdir /tmp/brl-smoke   # tiny shapes on CPU (CI smoke)
    python3 benchmarks/bench_real_layers.py --workdir /tmp/brl --jobs awq,calibrate-kv --nproc 1,2,4 --samples 64
        # several GPUs: per-layer seconds at 1, 2 and 4 ranks (cuda:0..N-1)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REAL_LAYERS = {"397b": 60, "122b": 48, "35b": 40}
FAST_DISK = 14e9  # bytes/s: the users' NVMe RAID0


def _random_bytes(n_elems: int, device: str) -> bytes:
    import torch

    t = (torch.randn(n_elems, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    return t.view(torch.int16).cpu().numpy().tobytes()


def build_real(out: Path, layers: int, device: str, model: str = "397b") -> None:
    """A real-shape BF16 checkpoint of `layers` decoder layers (the last one full attention)."""
    from qtool.fixtures.sparse import tensor_specs
    from qtool.fixtures.sparse_config import Flavour, real_config
    from qtool.fixtures.tokenizer import save_tokenizer_files
    from qtool.io.writer import InlineBytes, OutTensor, index_json, write_shard

    if (out / "model.safetensors.index.json").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(model, Flavour.BF16_PER_EXPERT, mtp=False, vision=True)
    # decoder layers: linear-attention layers 0..layers-2, then the real layer 3 (full attention) as the last
    pick = {i: i for i in range(layers - 1)} | {3: layers - 1}
    chosen = []
    for t in specs:
        if ".layers." in t.name and t.name.startswith("model.language_model.layers."):
            idx = int(t.name.split(".")[3])
            if idx not in pick:
                continue
            t = t._replace(name=t.name.replace(f".layers.{idx}.", f".layers.{pick[idx]}.", 1))
        chosen.append(t)
    cfg = real_config(model, Flavour.BF16_PER_EXPERT)
    text = cfg["text_config"]
    text["num_hidden_layers"] = layers
    text["layer_types"] = ["linear_attention"] * (layers - 1) + ["full_attention"]
    text["mtp_num_hidden_layers"] = 0
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_tokenizer_files(out)
    shards: list[list] = [[]]
    size = 0
    for t in chosen:  # 5 GB shards in module order, like save_pretrained
        if size + t.nbytes > 5e9 and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    weight_map = {}
    for k, group in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        items = [
            OutTensor(
                t.name,
                t.dtype,
                t.shape,
                InlineBytes(
                    t.value
                    if t.value is not None and t.dtype != "BF16"
                    else (_random_bytes(t.nbytes // 2, device) if t.dtype == "BF16" else bytes(t.nbytes))
                ),
            )
            for t in group
        ]
        write_shard(out / name, items, {"format": "pt"})
        weight_map.update({t.name: name for t in group})
        del items
    (out / "model.safetensors.index.json").write_text(
        json.dumps(index_json(weight_map, sum(t.nbytes for t in chosen)), indent=2) + "\n"
    )
    record_as_downloaded(out)
    if device.startswith("cuda"):
        import torch

        # the random weights' cached blocks (~8 GB: the embedding's float32 draw) would stay held by this
        # process through every timed job: a GPTQ layer, which needs most of an 80 GB card, ran out of memory
        torch.cuda.empty_cache()


def record_as_downloaded(root: Path) -> None:
    """Leave what `hf download --local-dir` leaves beside each shard (huggingface_hub's
    `.cache/huggingface/download/<file>.metadata`: commit, the LFS sha256 as etag, time): a user's 397B comes
    from the Hub, so its digests are known and a job reads nothing to hash them (qtool.io.manifest)."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    from qtool.io.files import hash_file

    files = shard_files(root)
    with ThreadPoolExecutor(max_workers=8) as pool:
        digests = list(pool.map(hash_file, files))
    meta = root / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True, exist_ok=True)
    commit = hashlib.sha1(b"bench").hexdigest()
    for f, d in zip(files, digests, strict=True):
        (meta / (f.name + ".metadata")).write_text(f"{commit}\n{d}\n{time.time()}\n")


def build_smoke(out: Path) -> None:
    """The tiny BF16 fixture (CPU smoke mode: the same jobs and table, toy shapes)."""
    from qtool.cache import cache_dir
    from qtool.fixtures.builtin import FixtureCache

    if not out.exists():
        shutil.copytree(FixtureCache(cache_dir() / "fixtures").path("bf16"), out)


def write_dataset(path: Path, tokens: int) -> None:
    """A plain-text corpus giving at least `tokens` tokens with the checkpoint's tokenizer."""
    import random

    rng = random.Random(0)
    words = [
        "expert",
        "layer",
        "token",
        "scale",
        "cache",
        "route",
        "shared",
        "attention",
        "memory",
        "stream",
        "disk",
        "quantize",
        "calibrate",
        "window",
        "context",
        "the",
        "of",
        "and",
        "model",
        "serve",
    ]
    text = " ".join(rng.choice(words) for _ in range(int(tokens * 1.5) + 1000)) + "\n"
    # left as it is when unchanged: its mtime and ctime are part of qtool's token cache key, so a job run
    # again tokenizes nothing, as a user's repeated run (the first job of a fresh --workdir tokenizes it)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


# --cold-input: a cold run evicts only the job's input from the page cache, not the program's files: what
# a user's run of an 800 GB input sees once qtool has run on that machine (the input never fits the cache,
# Python, torch and transformers do)
COLD_INPUT_ONLY = False


def drop_caches(files: list[Path] | None = None) -> bool:
    """The page cache dropped (or, with --cold-input, `files`' pages evicted); False where not allowed."""
    try:
        os.sync()
        if COLD_INPUT_ONLY and files is not None:
            from qtool.fixtures.page_cache import evict

            evict(files)
            return True
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


class GpuPeak:
    """Peak GPU memory in use, sampled with nvidia-smi every 100 ms (None without one)."""

    def __init__(self) -> None:
        self.peak = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
                mib = max(int(x) for x in out.split())
                self.peak = max(self.peak or 0, mib)
            except (OSError, ValueError, subprocess.SubprocessError):
                return
            self.stop.wait(0.1)

    def __enter__(self) -> GpuPeak:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


RSS_WRAPPER = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
    "sys.exit(r.returncode)"
)


def run_job(argv: list[str], profile: Path | None = None, timeline: Path | None = None) -> dict:
    """One qtool command in its own process: wall seconds, its --json report, peak RSS and GPU memory
    (`profile`: under cProfile, its stats written there; `timeline`: under benchmarks/timeline.py, every
    thread's segments in order written there)."""
    prof = ["-m", "cProfile", "-o", str(profile)] if profile else []
    run = [str(ROOT / "benchmarks" / "timeline.py"), "--all-in-order", "--"] if timeline else [*prof, "-m", "qtool"]
    cmd = [sys.executable, "-c", RSS_WRAPPER, sys.executable, *run, *argv, "--json", "--quiet"]
    env = job_env()
    with GpuPeak() as gpu:
        launched = time.time()
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
    if timeline:
        timeline.write_text(p.stderr)
    if p.returncode != 0 or '"error"' in p.stdout[:200]:  # (under cProfile a failed run exits 0)
        raise SystemExit(f"{' '.join(argv)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    rss = next((int(line.split()[1]) for line in p.stderr.splitlines() if line.startswith("PEAK_RSS_KB")), 0)
    return {
        "wall": wall,
        "launched": launched,
        "report": json.loads(p.stdout),
        "rss_bytes": rss * 1024,
        "gpu_peak_bytes": gpu.peak * 2**20 if gpu.peak else None,
    }


def disk_read_bytes(path: Path) -> int | None:
    """Bytes the block device holding `path` has read so far (/sys/dev/block/M:m/stat, sectors read):
    the difference over a job is what it pulled from the disk, not from the page cache."""
    dev = path.stat().st_dev
    try:
        fields = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()
    except OSError:
        return None  # overlay or network filesystems have no block device
    return int(fields[2]) * 512


# the modules a job imports (their bytecode compiled before timing; loaded alone for the program's reads)
JOB_MODULES = (
    "qtool.cli.main, qtool.ops.quantize, qtool.ops.calibrate_kv, qtool.ops.kld, "
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
)
# what a job's process loads before it reads its input: Python, torch and its CUDA libraries (a matmul loads
# cuBLAS), qtool's and transformers' modules. Not Triton's: its compiled kernels are in qtool's cache dir.
PROGRAM_LOAD = (
    f"import sys, torch, {JOB_MODULES}\n"
    "x = torch.ones(64, 64, device=sys.argv[1], dtype=torch.bfloat16); (x @ x).float().sum().item()\n"
)


def job_env() -> dict:
    """The environment a job's process runs in: this checkout's qtool first on the path."""
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def program_read_bytes(where: Path, device: str) -> int | None:
    """Bytes the disk holding `where` reads, caches dropped, for a process that loads what a job loads and
    reads no input: a cold job's disk reads less this are its own (its input, hidden states and side files),
    not its program's. None where the disk's count cannot be read or the caches not dropped."""
    if not drop_caches():
        return None
    r0 = disk_read_bytes(where)
    env = job_env()
    subprocess.run([sys.executable, "-c", PROGRAM_LOAD, device], check=True, env=env)
    r1 = disk_read_bytes(where)
    return None if r0 is None or r1 is None else r1 - r0


def cat_seconds(files: list[Path]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def pread_seconds(files: list[Path]) -> float:
    """The job's input read as qtool's layer reader reads it (qtool.stream.layer_read: READERS threads,
    each with its share of the 64 MiB pieces, read around the page cache where the filesystem allows it).
    Where one `cat` stream leaves the device below its speed (a page cache, tmpfs, an NVMe array) this is
    the faster read, and so the job's read floor."""
    from qtool.stream.layer_read import CHUNK, READERS, ShardFiles, aligned_empty, read_pieces

    pieces = [p for f in files for p in read_pieces(str(f), 0, f.stat().st_size)]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        view, reader = memoryview(aligned_empty(CHUNK).numpy()), ShardFiles()
        try:
            for p in pieces[k::READERS]:
                if errors:
                    return
                reader.read(p, view[: p.end - p.start])
        except BaseException as e:
            errors.append(e)
        finally:
            reader.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(k,)) for k in range(READERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


DD_MAX = 4 << 30  # bytes dd writes at most (the time is scaled to the output's size): the disk stays free


def dd_seconds(where: Path, nbytes: int) -> float | None:
    """`dd` of the job's output size (at most DD_MAX, scaled) into a file beside its output, fsynced
    (conv=fsync): the disk's time to write what the job writes. With `cat` of its input, each job's floor
    max(read, write) in the same run. None if dd failed (a full disk)."""
    f = where / ".dd-floor"
    mib = max(1, min(nbytes, DD_MAX) >> 20)
    t0 = time.perf_counter()
    r = subprocess.run(
        ["dd", "if=/dev/zero", f"of={f}", "bs=1M", f"count={mib}", "conv=fsync"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    took = time.perf_counter() - t0
    f.unlink(missing_ok=True)
    if r.returncode != 0:
        print(f"dd failed: {r.stderr.strip()[-200:]}", file=sys.stderr)
        return None
    return took * max(1, nbytes >> 20) / mib


def mem_write_seconds(where: Path, nbytes: int) -> float | None:
    """The job's output size (at most DD_MAX, scaled) written into a file beside its output from 1 GiB of
    host memory in 128 MiB pieces, fsynced: what quantize's file thread does (its chunks are coded into
    page-locked memory that no CPU cache holds). `dd` writes one 1 MiB block again and again, from the
    CPU's cache: where a write is a copy (tmpfs, the page cache), this is the floor of writing bytes held
    in memory. None on an error (a full disk)."""
    piece = 128 << 20
    bufs = [memoryview(bytearray(os.urandom(1 << 20) * 128)) for _ in range(8)]  # 1 GiB: never all cached
    n = max(piece, min(nbytes, DD_MAX) // piece * piece)
    f = where / ".mem-write-floor"
    try:
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        t0 = time.perf_counter()
        try:
            for k in range(n // piece):
                view = bufs[k % len(bufs)]
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        took = time.perf_counter() - t0
    except OSError as e:
        print(f"memory write failed: {e}", file=sys.stderr)
        return None
    finally:
        f.unlink(missing_ok=True)
    return took * nbytes / n


def clear_output(argv: list[str]) -> None:
    """Remove the job's output of an earlier run before timing it: with --force the job would park the old
    output and delete it after its commit (1.8 s for quantize's 12 GB in /dev/shm on the H200 machine),
    which a user's first run does not do."""
    flag = "--save-ref" if "--save-ref" in argv else "-o"
    if flag in argv:
        shutil.rmtree(argv[argv.index(flag) + 1], ignore_errors=True)


def both_seconds(files: list[Path], where: Path, nbytes: int) -> float | None:
    """`cat` of the job's input and `dd` of its output's size (fsynced, in files of at most DD_MAX, each
    deleted once written: the disk stays free) at the same time: what reading and writing take together
    on one device, where they share its bandwidth (a job that reads one disk and writes it is bound by
    this, not by the longer of the two alone). None if dd failed."""
    failed = []

    def write() -> None:
        left, f = nbytes, where / ".dd-both"
        while left > 0 and not failed:
            mib = max(1, min(left, DD_MAX) >> 20)
            r = subprocess.run(
                ["dd", "if=/dev/zero", f"of={f}", "bs=1M", f"count={mib}", "conv=fsync"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            f.unlink(missing_ok=True)
            failed.extend([r.stderr.strip()[-200:]] if r.returncode != 0 else [])
            left -= mib << 20

    t0 = time.perf_counter()
    writer = threading.Thread(target=write)
    writer.start()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    writer.join()
    took = time.perf_counter() - t0
    if failed:
        print(f"dd (with cat) failed: {failed[0]}", file=sys.stderr)
        return None
    return took


def layer_bytes(files: list[Path]) -> int:
    """Bytes of the decoder layers' tensors in these shards (their headers), not the embedding, lm_head,
    vision or MTP tensors: a layer's share of a job's reads or writes is this over the layer count."""
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        total += sum(
            v["data_offsets"][1] - v["data_offsets"][0]
            for k, v in header.items()
            if k != "__metadata__" and ".layers." in k and ".mtp." not in k
        )
    return total


def output_bytes(argv: list[str]) -> tuple[Path, int]:
    """The job's output directory and the bytes it wrote (links to its input not counted; a job without
    one, an eval kld of two checkpoints, wrote none)."""
    flag = "--save-ref" if "--save-ref" in argv else "-o"
    if flag not in argv:
        return Path(os.getcwd()), 0
    out = Path(argv[argv.index(flag) + 1])
    seen, total = set(), 0
    for f in out.rglob("*"):
        st = f.lstat()
        if f.is_file() and st.st_nlink == 1 and st.st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_size
    return out, total


def shard_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors"))


def print_profile(path: Path, top: int = 25) -> None:
    import pstats

    print(f"\n--- {path.name}: top {top} by cumulative time")
    pstats.Stats(str(path)).sort_stats("cumulative").print_stats(top)


def one_job(
    name: str,
    argv: list[str],
    inputs: Path,
    layers: int,
    cold: bool,
    profile_dir: Path | None = None,
    ranks: int = 1,
    real_layers: int = REAL_LAYERS["397b"],
    device: str = "cuda",
    timeline_dir: Path | None = None,
) -> dict:
    files = shard_files(inputs)
    nbytes = sum(f.stat().st_size for f in files)
    clear_output(argv)
    dropped = drop_caches(files) if cold else False
    cat = cat_seconds(files)  # cold when dropped: the disk's time for these bytes
    if cold:
        drop_caches(files)
    pread = pread_seconds(files)  # as the layer reader reads (cold when dropped)
    program = program_read_bytes(inputs, device) if cold and not COLD_INPUT_ONLY else None
    if cold:
        drop_caches(files)
    prof = profile_dir / f"{name}-{ranks}-{'cold' if cold else 'warm'}.prof" if profile_dir else None
    read0 = disk_read_bytes(inputs)
    tl = timeline_dir / f"{name}-{ranks}-{'cold' if cold else 'warm'}.txt" if timeline_dir else None
    res = run_job([*argv, "--nproc", str(ranks)] if ranks > 1 else argv, prof, tl)
    read1 = disk_read_bytes(inputs)
    if prof is not None:
        print_profile(prof)
    out, written = output_bytes(argv)
    dd = dd_seconds(out.parent, written) if written else 0.0
    mem_write = mem_write_seconds(out.parent, written) if written else 0.0
    floor = max(cat, dd or 0)  # the floor: `cat` of the input, `dd` of the output
    read = min(cat, pread)  # the faster read of the input: what a layer's own read can take
    if cold:
        drop_caches(files)
    both = both_seconds(files, out.parent, written) if written else cat_seconds(files)
    # a steady layer's floor: its share of the input read at the faster of cat's and the parallel read's
    # rate, of the output written at dd's
    layer_in = layer_bytes(files) / layers
    layer_out = layer_bytes([f for f in shard_files(out) if f.lstat().st_nlink == 1]) / layers if written else 0
    layer_floor = max(read * layer_in / nbytes, (dd or 0) * layer_out / written if written else 0)
    clock = layer_clock(res["report"])
    if "layers_done" not in clock:  # eval kld of two checkpoints prints only its result: the wall clock
        clock = {
            "first_layer_start": res["launched"],
            "layers_done": [res["launched"] + res["wall"] * (k + 1) / layers for k in range(layers)],
        }
    done, first = clock["layers_done"], clock["first_layer_start"]
    # the layer loop: from the first layer's load to the last layer done (its shard written)
    loop = done[-1] - first
    per_layer, tail = steady_layer(done, first)
    before = first - res["launched"]
    after = res["launched"] + res["wall"] - done[-1]
    cache = ("cold in" if COLD_INPUT_ONLY else "cold") if dropped else ("warm" if not cold else "cold?")
    return {
        "job": name,
        "ranks": ranks,
        "cache": cache,
        "input_bytes": nbytes,
        "wall_s": res["wall"],
        "loop_s": loop,
        "per_layer_s": per_layer,
        "first_layer_s": done[0] - first,
        "before_first_layer_s": before,
        "after_last_layer_s": after,
        "last_layer_tail_s": tail,
        "cat_s": cat,
        "loop_over_cat": loop / cat if cat else None,
        "pread_s": pread,
        "output_bytes": written,
        "dd_s": dd,
        "mem_write_s": mem_write,
        "layer_mem_write_s": (mem_write or 0) * layer_out / written if written else 0,
        "floor_s": floor,
        "loop_over_floor": loop / floor if floor else None,
        "wall_over_floor": res["wall"] / floor if floor else None,
        "both_s": both,
        "loop_over_both": loop / both if both else None,
        "layer_in_bytes": layer_in,
        "layer_out_bytes": layer_out,
        "layer_floor_s": layer_floor,
        "per_layer_over_layer_floor": per_layer / layer_floor if layer_floor else None,
        # from the disk during the job (any process): with N ranks cold, ~input_bytes when the page
        # cache serves the other ranks' reads of each layer, ~N x when every rank reads the disk
        "disk_read_bytes": None if read0 is None or read1 is None else read1 - read0,
        # of those, what the job's program (libraries, modules) loads from that disk, measured alone
        "program_read_bytes": program,
        "peak_rss_bytes": res["rss_bytes"],
        "peak_gpu_bytes": res["gpu_peak_bytes"],
        # torch's allocator in the job: the most handed out and the most held (the layer loop's)
        "gpu_allocated_bytes": (clock.get("gpu_peak") or {}).get("allocated"),
        "gpu_reserved_bytes": (clock.get("gpu_peak") or {}).get("reserved"),
        "projected_all_layers_s": before + after + tail + per_layer * real_layers,
        # on a 14 GB/s disk a layer takes the longer of its host/GPU work (its time here less its read
        # at the faster of cat and pread) and its read there
        "projected_all_layers_fast_disk_s": before
        + after
        + tail
        + real_layers * max(per_layer - read / layers, (nbytes / layers) / FAST_DISK),
    }


def layer_clock(report: dict) -> dict:
    """A streamed job's layer clock from its --json report (first_layer_start, layers_done), {} if none:
    eval kld reports one clock per streamed side, and the first is taken."""
    clock = report.get("timing") or {}
    if "layers_done" not in clock and clock:
        clock = next(iter(clock.values()))
    return clock


def steady_layer(done: list[float], first: float) -> tuple[float, float]:
    """(seconds a steady layer takes, what the last layer took beyond one) from when each layer was done
    and the first began: between the first layer done and the last but one (the read-ahead overlaps from
    layer 1 on; quantize's last layer is done only once its shard is hashed, which no other layer waits for:
    qtool.io.hashed_writes.HashedWrites keep_pace), or the last where only two layers ran. The tail is part of
    every run's end."""
    steady = done[:-1] if len(done) > 2 else done
    per_layer = (steady[-1] - steady[0]) / (len(steady) - 1) if len(steady) > 1 else done[-1] - first
    return per_layer, max(0.0, done[-1] - done[-2] - per_layer) if len(done) > 2 else 0.0


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'job':13s} {'ranks':>5s} {'cache':7s} {'in GB':>6s} {'wall':>7s} {'loop':>7s} {'s/layer':>8s} "
        f"{'start':>6s} "
        f"{'end':>5s} {'tail':>5s} {'cat':>6s} {'dd':>6s} {'loop/floor':>10s} {'wall/floor':>10s} "
        f"{'RSS GB':>7s} {'GPU GB':>7s} "
        f"{'disk GB':>7s} {'all layers':>10s} {'@14GB/s':>8s} {'cat+dd':>6s} {'loop/both':>9s} "
        f"{'pread':>6s} {'layer floor':>11s} {'s/layer/lf':>10s} "
        f"{'prog GB':>7s} {'alloc/held GB':>13s} {'mem wr':>6s} {'layer wr':>8s}"
    )
    for r in rows:
        gpu = f"{r['peak_gpu_bytes'] / 1e9:7.1f}" if r["peak_gpu_bytes"] else "      -"
        disk = f"{r['disk_read_bytes'] / 1e9:7.1f}" if r["disk_read_bytes"] is not None else "      -"
        prog = f"{r['program_read_bytes'] / 1e9:6.1f}" if r.get("program_read_bytes") is not None else "     -"
        alloc = (
            f"{r['gpu_allocated_bytes'] / 1e9:.1f}/{r['gpu_reserved_bytes'] / 1e9:.1f}"
            if r.get("gpu_allocated_bytes")
            else "-"
        )
        print(
            f"{r['job']:13s} {r['ranks']:5d} {r['cache']:7s} {r['input_bytes'] / 1e9:6.1f} {r['wall_s']:7.1f} "
            f"{r['loop_s']:7.1f} "
            f"{r['per_layer_s']:8.2f} {r['before_first_layer_s']:6.1f} {r['after_last_layer_s']:5.1f} "
            f"{r.get('last_layer_tail_s') or 0:5.1f} {r['cat_s']:6.1f} "
            f"{r['dd_s'] or 0:6.1f} {r['loop_over_floor'] or 0:10.2f} {r['wall_over_floor'] or 0:10.2f} "
            f"{r['peak_rss_bytes'] / 1e9:7.1f} {gpu} {disk} "
            f"{r['projected_all_layers_s'] / 60:9.1f}m {r['projected_all_layers_fast_disk_s'] / 60:7.1f}m "
            f"{r['both_s'] or 0:6.1f} {r['loop_over_both'] or 0:9.2f} {r['pread_s']:6.1f} {r['layer_floor_s']:11.2f} "
            f"{r['per_layer_over_layer_floor'] or 0:10.2f} {prog:>7s} {alloc:>13s} {r.get('mem_write_s') or 0:6.1f} "
            f"{r.get('layer_mem_write_s') or 0:8.2f}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (what CI runs; not timed)")
    ap.add_argument("--jobs", default="quantize,calibrate-kv,eval-kld", help="of quantize,awq,calibrate-kv,eval-kld")
    ap.add_argument("--model", default="397b", choices=sorted(REAL_LAYERS), help="whose real layer shapes")
    ap.add_argument("--nproc", default="1", help="rank counts, e.g. 1,2,4: every job once per count (--nproc N)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--profile", type=Path, help="run each job under cProfile, stats into this folder (printed)")
    ap.add_argument(
        "--timeline",
        type=Path,
        help="run each job under benchmarks/timeline.py (every thread's segments in order) into this folder",
    )
    ap.add_argument(
        "--recipes",
        default="",
        metavar="PATH,...",
        help="also time quantize with each of these recipes (a job per file, named by its stem): e.g. a "
        "recipe with gptq or a block-scale search, next to the plain quantize job",
    )
    ap.add_argument("--warm-only", action="store_true", help="skip the cold runs")
    ap.add_argument(
        "--cold-only",
        action="store_true",
        help="skip the warm runs (a disk too small for a second output beside the first)",
    )
    ap.add_argument(
        "--tmpfs",
        action="store_true",
        help="input and outputs in /dev/shm/<workdir name>: a disk as fast as memory (the users' "
        "NVMe stands in), warm runs only",
    )
    ap.add_argument(
        "--cold-input",
        action="store_true",
        help="cold runs evict only the input's pages (posix_fadvise), not the program's files, as "
        "a user's run of an input larger than the page cache finds them once qtool has run there",
    )
    a = ap.parse_args()
    global COLD_INPUT_ONLY
    COLD_INPUT_ONLY = a.cold_input
    if a.tmpfs:
        a.workdir, a.warm_only = Path("/dev/shm") / a.workdir.name, True
    w = a.workdir
    w.mkdir(parents=True, exist_ok=True)
    src = w / "bf16"
    t0 = time.perf_counter()
    if a.smoke:
        a.device, a.samples, a.seq_len = "cpu", 2, 32
        build_smoke(src)
        layers = json.loads((src / "config.json").read_text())["text_config"]["num_hidden_layers"]
    else:
        build_real(src, a.layers, a.device, a.model)
        layers = a.layers
    print(
        f"checkpoint {src}: {sum(f.stat().st_size for f in shard_files(src)) / 1e9:.1f} GB, {layers} layers "
        f"(built in {time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    # bytecode: pip compiles an installed package's .py files; the GPU machine's image ships without .pyc
    # and sets PYTHONDONTWRITEBYTECODE, so each job would compile transformers anew (~7 s). Compile once,
    # into a cache of our own, before timing anything.
    os.environ["PYTHONPYCACHEPREFIX"] = str(w / "pycache")
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # set on these machines: no cache would ever be written
    subprocess.run([sys.executable, "-c", f"import {JOB_MODULES}"], check=True, env=job_env())
    data = w / "calib.txt"
    write_dataset(data, a.samples * a.seq_len)
    common = ["--dataset", str(data), "--samples", str(a.samples), "--seq-len", str(a.seq_len), "--device", a.device]
    rows = []
    jobs = [j for j in a.jobs.split(",") if j]  # "" with --recipes: the recipes alone
    unknown = set(jobs) - {"quantize", "awq", "calibrate-kv", "eval-kld", "sensitivity", "eval-kld-pair"}
    if unknown:
        raise SystemExit(f"--jobs: unknown {sorted(unknown)}")
    q = w / "nvfp4"
    for folder in (a.profile, a.timeline):
        if folder:
            folder.mkdir(parents=True, exist_ok=True)
    nvfp4 = ["quantize", str(src), "-o", str(q), "--recipe", "qwen35-nvfp4-experts", "--force", *common]
    if (
        "quantize" not in jobs
        and {"calibrate-kv", "eval-kld", "sensitivity", "eval-kld-pair"} & set(jobs)
        and not q.exists()
    ):
        run_job(nvfp4)  # their input (not timed)
    real_layers = REAL_LAYERS[a.model]
    for cold in (False,) if a.warm_only else (True,) if a.cold_only else (True, False):
        for ranks in (int(n) for n in a.nproc.split(",")):

            def job(name, argv, inputs, cold=cold, ranks=ranks):  # (called within this round)
                rows.append(
                    one_job(name, argv, inputs, layers, cold, a.profile, ranks, real_layers, a.device, a.timeline)
                )
                print_table(rows[-1:])  # as it comes: a later failure keeps the rows so far
                if a.out:
                    a.out.write_text(json.dumps(rows, indent=1))

            if "quantize" in jobs:
                job("quantize", nvfp4, src)
            for recipe in filter(None, a.recipes.split(",")):
                name = Path(recipe).stem
                argv = ["quantize", str(src), "-o", str(w / name), "--recipe", str(Path(recipe).resolve()), "--force"]
                job(name, [*argv, *common], src)
            if "awq" in jobs:
                job(
                    "awq",
                    ["quantize", str(src), "-o", str(w / "awq"), "--recipe", "qwen35-awq-int4", "--force", *common],
                    src,
                )
            if "calibrate-kv" in jobs:
                job(
                    "calibrate-kv",
                    ["calibrate-kv", str(q), "-o", str(w / "kv"), "--replace-scales", "--force", *common],
                    q,
                )
            if "eval-kld" in jobs and ranks == 1:  # one streamed side (the NVFP4 model) into a compact reference
                job(
                    "eval-kld",
                    [
                        "eval",
                        "kld",
                        "--ref",
                        str(q),
                        "--save-ref",
                        str(w / "ref"),
                        "--force",
                        "--dataset",
                        str(data),
                        "--windows",
                        str(a.samples),
                        "--seq-len",
                        str(a.seq_len),
                        "--device",
                        a.device,
                    ],
                    q,
                )
            if "eval-kld-pair" in jobs and ranks == 1:  # both sides streamed: sensitivity's inputs
                job(
                    "eval-kld-pair",
                    [
                        "eval",
                        "kld",
                        "--ref",
                        str(src),
                        "--test",
                        str(q),
                        "--dataset",
                        str(data),
                        "--windows",
                        str(a.samples),
                        "--seq-len",
                        str(a.seq_len),
                        "--device",
                        a.device,
                    ],
                    src,
                )
            if "sensitivity" in jobs and ranks == 1:  # BF16 vs its NVFP4: every unit's error
                job("sensitivity", ["sensitivity", str(src), str(q), "-o", str(w / "sens"), "--force", *common], src)
    print_table(rows)
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
