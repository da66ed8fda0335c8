"""Issue 52 (B2-B4, C1, C5): an input shard replaced, truncated, turned into a FIFO or a link to /dev/zero
while a job reads it. Each case is made the way it was found: `calibrate-kv -o` paused right after it read
its first layer (tests/killpoint.py PAUSE), the shard changed at that moment, the run let go. The job must
fail naming the shard, publish nothing, and teach the sha256 cache no digest of no file."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from in_process import run_cli
from killpoint import run_qtool, start_paused
from test_no_data_loss import biggest_shard, same_size_edit, unsampled_offset
from test_output_contract import KV, copy_of

from qtool.io.digest_cache import DigestCache

TIMEOUT = 120


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _wait_for(path: Path, proc, seconds: float = TIMEOUT) -> None:
    import time

    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < seconds, f"{path} did not appear"
        time.sleep(0.05)


def _replace_by_rename(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[unsampled_offset(shard)] ^= 0x01
    tmp = shard.with_name(shard.name + ".new")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, shard)


def _to_dev_zero(shard: Path) -> None:
    shard.unlink()
    shard.symlink_to("/dev/zero")


def _to_fifo(shard: Path) -> None:
    shard.unlink()
    os.mkfifo(shard)


CHANGES = {
    "renamed-over": _replace_by_rename,  # B2
    "edited-in-place-mtime-put-back": lambda s: same_size_edit(s, unsampled_offset(s)),  # B2
    "a-link-to-dev-zero": _to_dev_zero,  # B3
    "truncated": lambda s: os.truncate(s, s.stat().st_size // 2),  # B4
    "a-fifo": _to_fifo,  # C1
}


@pytest.mark.slow
@pytest.mark.parametrize("change", list(CHANGES))
def test_an_input_changed_while_calibrate_kv_reads_it_fails_the_job_naming_it(
    change, tiny_nvfp4_modelopt, tmp_path, monkeypatch
):
    """Found as: KV scales from neither input and a manifest sha256 that is no file's (which the cache
    kept and the next job copied), a 0-byte shard published with exit 0, the truncated hard link published
    beside the old file's sha256, a run blocked in open() for ever."""
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path / "cache"))
    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "src")
    shard = biggest_shard(src)
    out = tmp_path / "out"
    args = ["calibrate-kv", src, *KV, "--replace-scales", "-o", out, "--quiet"]
    marker = tmp_path / "m"
    p = start_paused("qtool.stream.layer_read:LayerBytes.read", 1, marker, args)
    try:
        _wait_for(Path(f"{marker}.paused"), p)
        CHANGES[change](shard)
    finally:
        Path(f"{marker}.go").touch()
    _, err = p.communicate(timeout=TIMEOUT)
    assert p.returncode == 1, err
    assert "changed while the job read it" in err and str(shard) in err, err
    assert "Traceback" not in err, err
    assert not out.exists()
    cache = DigestCache(tmp_path / "cache" / "sha256-cache.json")
    learned = {e["sha256"] for k, e in cache.entries.items() if k.startswith(f"{shard}|")}
    if shard.is_file() and not shard.is_symlink():
        assert learned <= {sha(shard)}, "the cache learned a digest of no file"
    else:
        assert not learned
    if change in ("renamed-over", "edited-in-place-mtime-put-back"):  # a valid shard still: the next job
        # records its own digest
        p = run_cli(args)
        assert p.returncode == 0, p.stderr
        m = json.loads((out / "qtool-manifest.json").read_text())
        assert m["sources"]["checkpoint" if "checkpoint" in m["sources"] else next(iter(m["sources"]))]["files"][
            shard.name
        ]["sha256"] == sha(shard)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_digest_cache_that_is_not_a_regular_file_is_ignored_with_a_warning(kind, tmp_path, caplog):
    """Found as: `$QTOOL_CACHE_DIR/sha256-cache.json` a FIFO blocked every job; a link to /dev/zero gave a
    MemoryError traceback."""
    path = tmp_path / "sha256-cache.json"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    with caplog.at_level("INFO", logger="qtool"):
        cache = DigestCache(path)
    assert cache.entries == {}
    assert "sha256 cache" in caplog.text and "ignored" in caplog.text


def test_a_job_runs_beside_a_fifo_digest_cache(tiny_nvfp4_modelopt, tmp_path, monkeypatch):
    """The same through a real command: it finishes (exit 0), saying the cache was ignored."""
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    os.mkfifo(tmp_path / "cache" / "sha256-cache.json")
    p = run_qtool(
        ["patch-config", tiny_nvfp4_modelopt, "--ignore-add", "lm_head", "-o", tmp_path / "out"], timeout=TIMEOUT
    )
    assert p.returncode == 0, p.stderr
    assert "sha256 cache" in p.stderr and "Traceback" not in p.stderr, p.stderr
