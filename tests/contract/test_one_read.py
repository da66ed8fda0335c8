"""A layer-streamed job reads its input from the disk once, even when the page cache cannot hold it.

An 800 GB 397B does not fit the page cache: every byte read twice (once for the layers, once more to hash
the input for the manifest, or to copy a tensor the layer reader already had) is read twice from the disk.
Here a thread drops the input's pages (posix_fadvise DONTNEED) every 50 ms while the job runs, as the
kernel would for an input larger than memory, and the job's block reads (getrusage of the child:
`ru_inblock`, the kernel's read_bytes) must stay within 1.10x the input. The manifest's sha256 of every
input must still be the file's real digest.

The dropper itself races with the reads (a page the kernel has just read for a pending request can be
dropped before it is copied out: read twice, by the test's doing, up to ~15% on a busy 2-core box), so the
best of up to three runs counts: a job that really reads part of its input twice (qtool before this fix:
2.9-3.9x) never passes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from qtool.fixtures.page_cache import evict

# they measure reads or memory: run one after another on one worker, not beside each other
pytestmark = pytest.mark.xdist_group("measure")


def _shards(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors"))


def _run_dropping_pages(args: list[str], files: list[Path], env: dict) -> int:
    """Run `qtool args` in a child while the pages of `files` are dropped every 50 ms; the bytes it read
    from the disk."""
    stop = threading.Event()

    def drop() -> None:
        while not stop.is_set():
            evict(files)
            stop.wait(0.05)

    t = threading.Thread(target=drop, daemon=True)
    t.start()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "qtool", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        stop.set()
        t.join()
    assert proc.returncode == 0, out.decode()[-3000:]
    return usage.ru_inblock * 512


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> Path:
    """A BF16 Qwen3.5-MoE whose layers are most of its bytes (as the 397B's are): ~105 MB in two shards."""
    from qtool.fixtures.tiny import build_bf16
    from qtool.fixtures.tiny_config import tiny_config

    bf = tmp_path_factory.mktemp("one-read") / "bf16"
    cfg = tiny_config(
        hidden_size=256,
        num_hidden_layers=4,
        num_experts=64,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
    )
    return build_bf16(bf, config=cfg, mtp=False, max_shard_size="80MB")


def _best_of_three(args: list[str], files: list[Path], tmp: Path, out: Path) -> int:
    best = None
    for k in range(3):
        shutil.rmtree(out, ignore_errors=True)
        read = _run_dropping_pages(args, files, _env(tmp / f"cache-{out.name}-{k}"))
        best = read if best is None else min(best, read)
        if best <= 1.10 * sum(f.stat().st_size for f in files):
            break
    return best


def _env(cache: Path) -> dict:
    return {**os.environ, "QTOOL_CACHE_DIR": str(cache), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def _check_digests(out: Path, src: Path) -> None:
    m = json.loads((out / "qtool-manifest.json").read_text())
    files = m["sources"][next(iter(m["sources"]))]["files"]
    for f in _shards(src):
        assert files[f.name]["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest(), f.name


@pytest.mark.slow
def test_quantize_then_calibrate_kv_read_their_input_once(bf16, tmp_path):
    common = ["--samples", "4", "--seq-len", "64", "--quiet"]
    # a first run brings the libraries into the page cache (their reads are not the job's)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "qtool",
            "quantize",
            str(bf16),
            "--recipe",
            "qwen35-nvfp4-experts",
            "-o",
            str(tmp_path / "warm"),
            *common,
        ],
        env=_env(tmp_path / "c0"),
        check=True,
        capture_output=True,
    )

    size = sum(f.stat().st_size for f in _shards(bf16))
    nv = tmp_path / "nvfp4"
    read = _best_of_three(
        ["quantize", str(bf16), "--recipe", "qwen35-nvfp4-experts", "-o", str(nv), *common], _shards(bf16), tmp_path, nv
    )
    assert read <= 1.10 * size, f"quantize read {read / size:.2f}x its input ({read} of {size} bytes)"
    _check_digests(nv, bf16)

    # calibrate-kv -o of an NVFP4 checkpoint without KV scales (the recipe without them), with qtool's sha256
    # cache gone: hashed from its own reads too, its unchanged shards linked (never read)
    from qtool.recipes import recipes_dir

    recipe = tmp_path / "no-kv.yaml"
    text = (
        (recipes_dir() / "qwen35-nvfp4-experts.yaml")
        .read_text()
        .replace("kv_cache: fp8", "kv_cache: none")
        .replace("name: qwen35-nvfp4-experts", "name: no-kv")
    )
    recipe.write_text(text)
    nv = tmp_path / "nvfp4-no-kv"
    subprocess.run(
        [sys.executable, "-m", "qtool", "quantize", str(bf16), "--recipe", str(recipe), "-o", str(nv), *common],
        env=_env(tmp_path / "c3"),
        check=True,
        capture_output=True,
    )
    nv_size = sum(f.stat().st_size for f in _shards(nv))
    kv = tmp_path / "kv"
    read = _best_of_three(["calibrate-kv", str(nv), "-o", str(kv), *common], _shards(nv), tmp_path, kv)
    assert read <= 1.10 * nv_size, f"calibrate-kv read {read / nv_size:.2f}x its input ({read} of {nv_size} bytes)"
    _check_digests(kv, nv)


@pytest.mark.slow
def test_calibrate_kv_replace_scales_reads_its_input_once(bf16, tmp_path):
    """calibrate-kv --replace-scales of a checkpoint whose KV scales sit in the shards of their layers (as
    quantize writes them, and the exporters): the shards that held the old scales are rewritten without
    them; their other tensors must come from the bytes the layer reader read, not a second read of each
    shard (copied from the input, the medium NVFP4 fixture read 1.83x its input, this one 1.31x)."""
    common = ["--samples", "4", "--seq-len", "64", "--quiet"]
    nv = tmp_path / "nvfp4"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "qtool",
            "quantize",
            str(bf16),
            "--recipe",
            "qwen35-nvfp4-experts",
            "-o",
            str(nv),
            *common,
        ],
        env=_env(tmp_path / "c0"),
        check=True,
        capture_output=True,
    )
    nv_size = sum(f.stat().st_size for f in _shards(nv))
    kv = tmp_path / "kv"
    read = _best_of_three(
        ["calibrate-kv", str(nv), "-o", str(kv), "--replace-scales", "--device", "cpu", *common],
        _shards(nv),
        tmp_path,
        kv,
    )
    assert read <= 1.10 * nv_size, (
        f"calibrate-kv --replace-scales read {read / nv_size:.2f}x its input ({read} of {nv_size} bytes)"
    )
    _check_digests(kv, nv)


def _taken_digest(file: Path, tensors: set[str]) -> tuple[str, int]:
    """The sha256 of the named tensors' bytes in `file`, in file order, read from its safetensors header."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        spans = sorted(tuple(header[t]["data_offsets"]) for t in tensors)
        h = hashlib.sha256()
        for start, end in spans:
            f.seek(8 + n + start)
            h.update(f.read(end - start))
    return h.hexdigest(), sum(end - start for start, end in spans)


@pytest.mark.slow
def test_assemble_reads_of_its_bf16_donor_only_the_bytes_it_takes(tmp_path):
    """Found as: a first assemble of a local pair hashed, whole, every BF16 file the output takes a tensor
    from: taking the shared experts (about 1% of a 397B's 800 GB of BF16) read all of it, and on the
    benchmark's medium pair a first run took 1.10x `cp -r` + `sync`. A donor file's digest is now the
    sha256 of the bytes taken from it (`taken_sha256`); the NVFP4 shards it carries keep their whole sha256."""
    from qtool.fixtures.synthetic import build_pair

    nv, bf = build_pair(
        tmp_path / "pair", hidden=512, layers=4, experts=32, inter=256, shared=256, shard_bytes=32 << 20
    )
    out = tmp_path / "out"
    args = ["assemble", "hybrid", "--nvfp4", str(nv), "--bf16", str(bf), "--bf16-expert-layers", "none"]
    args += ["--mtp", "drop", "--link", "copy", "-o", str(out), "--quiet"]
    nv_bytes = sum(f.stat().st_size for f in _shards(nv))
    bf_bytes = sum(f.stat().st_size for f in _shards(bf))
    assert bf_bytes > 2 * nv_bytes  # reading the donor whole would show
    best = None
    for k in range(3):
        shutil.rmtree(out, ignore_errors=True)
        read = _run_dropping_pages(args, _shards(nv) + _shards(bf), _env(tmp_path / f"cache-{k}"))
        best = read if best is None else min(best, read)
        if best <= 1.10 * (nv_bytes + bf_bytes // 40):
            break
    # The NVFP4 shards are copied kernel-side and hashed by a reader of their own, which the dropped pages
    # can send to the disk a second time (1.2-1.3x here): at most twice. The donor's untaken bytes, never.
    m = json.loads((out / "qtool-manifest.json").read_text())
    taken: dict[str, set[str]] = {}
    for entry in m["shards"].values():
        for origin in entry["tensors"].values():
            if origin["source"] == "bf16":
                taken.setdefault(origin["file"], set()).add(origin["tensor"])
    donors = m["sources"]["bf16"]["files"]
    assert set(donors) == set(taken)
    taken_bytes = 0
    for rel, tensors in taken.items():
        digest, n = _taken_digest(bf / rel, tensors)
        assert donors[rel] == {"taken_sha256": digest, "taken_bytes": n, "bytes": (bf / rel).stat().st_size}
        taken_bytes += n
    _check_digests(out, nv)  # the carried NVFP4 shards: their whole digest
    assert best <= 2 * nv_bytes + 1.10 * taken_bytes + (4 << 20), (best, nv_bytes, taken_bytes, bf_bytes)
