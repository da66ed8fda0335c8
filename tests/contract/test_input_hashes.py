"""The manifest's input sha256: computed when nothing records it, taken from what the Hub recorded when
the file is unchanged (HF cache blob names, `hf download --local-dir` metadata)."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from qtool import cache
from qtool.io import manifest
from qtool.io.files import LinkMode, Placer
from qtool.io.manifest import InputHasher, hub_recorded_sha256


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path / "qtool-cache"))


def _local_dir_download(root, rel: str, data: bytes, etag: str | None = None, stamp: float | None = None):
    """A file as `hf download --local-dir root` leaves it (huggingface_hub _local_folder.py layout)."""
    f = root / rel
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(data)
    meta = root / ".cache" / "huggingface" / "download" / (rel + ".metadata")
    meta.parent.mkdir(parents=True, exist_ok=True)
    etag = etag or hashlib.sha256(data).hexdigest()
    meta.write_text(f"{'c' * 40}\n{etag}\n{stamp if stamp is not None else time.time()}\n")
    return f


def _digests(paths, monkeypatch, allow_hashing: bool) -> dict:
    if not allow_hashing:

        def refuse(self, real, *_):
            raise AssertionError(f"{real} was read to hash it")

        monkeypatch.setattr(InputHasher, "_hash", refuse)
    h = InputHasher()
    for p in paths:
        h.submit(str(p))
    return h.results()


def test_local_dir_record_is_used_without_reading(tmp_path, monkeypatch):
    data = os.urandom(1000)
    f = _local_dir_download(tmp_path / "bf16", "model-00001-of-00002.safetensors", data)
    g = _local_dir_download(tmp_path / "bf16", "sub/dir/x.safetensors", b"xyz")
    got = _digests([f, g], monkeypatch, allow_hashing=False)
    assert got == {str(f): hashlib.sha256(data).hexdigest(), str(g): hashlib.sha256(b"xyz").hexdigest()}


@pytest.mark.parametrize("case", ["modified-after", "git-sha1-etag", "no-record", "garbled"])
def test_otherwise_the_file_is_hashed(tmp_path, monkeypatch, case):
    data = b"weights" * 100
    root = tmp_path / "bf16"
    if case == "no-record":
        f = root / "a.safetensors"
        f.parent.mkdir(parents=True)
        f.write_bytes(data)
        (root / ".cache" / "huggingface" / "download").mkdir(parents=True)
    elif case == "modified-after":
        f = _local_dir_download(root, "a.safetensors", b"old content", stamp=time.time() - 3600)
        f.write_bytes(data)  # the record says "old content"'s digest; the file changed since
    elif case == "git-sha1-etag":  # regular (non-LFS) files have a git blob sha1 as etag
        f = _local_dir_download(root, "a.safetensors", data, etag="a" * 40)
    else:
        f = _local_dir_download(root, "a.safetensors", data)
        (root / ".cache" / "huggingface" / "download" / "a.safetensors.metadata").write_text("half a line")
    assert hub_recorded_sha256(str(f)) is None
    got = _digests([f], monkeypatch, allow_hashing=True)
    assert got == {str(f): hashlib.sha256(data).hexdigest()}


def test_hf_cache_blob_name_is_the_digest(tmp_path, monkeypatch):
    data = b"blob"
    digest = hashlib.sha256(data).hexdigest()
    blob = tmp_path / "models--org--m" / "blobs" / digest
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    snap = tmp_path / "models--org--m" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(blob)
    assert _digests([snap / "model.safetensors"], monkeypatch, allow_hashing=False) == {
        str(snap / "model.safetensors"): digest
    }


def test_hashes_are_cached_for_reruns(tmp_path, monkeypatch):
    f = tmp_path / "plain.safetensors"
    f.write_bytes(b"abc")
    want = {str(f): hashlib.sha256(b"abc").hexdigest()}
    assert _digests([f], monkeypatch, allow_hashing=True) == want
    assert (cache.cache_dir() / "sha256-cache.json").exists()
    assert _digests([f], monkeypatch, allow_hashing=False) == want


def test_the_cache_is_trusted_only_while_the_ctime_is_the_recorded_one(tmp_path, monkeypatch):
    """Issue 25: the cache was keyed by path, size, mtime and inode, so a same-size edit with the mtime put
    back kept the old digest; and (review) a link made or removed with such an edit must not bring the old
    digest back either. Links that a run itself makes are re-recorded at its end (`refresh`), so the re-run
    of an assemble that links its inputs reads nothing to hash them."""
    f = tmp_path / "shard.safetensors"
    f.write_bytes(b"a" * 5000)
    want = {str(f): hashlib.sha256(b"a" * 5000).hexdigest()}
    h = InputHasher()
    h.submit(str(f))
    placer = Placer(LinkMode.HARDLINK)  # what the run does while it hashes: a link of the file it checks
    placer.sources = h.files
    placer.place(f, tmp_path / "linked-into-the-output")
    assert h.results() == want
    assert _digests([f], monkeypatch, allow_hashing=False) == want  # the run's own link: still a hit
    st = f.stat()
    with open(f, "r+b") as w:  # a same-size edit with the mtime put back, and an old output removed
        w.write(b"b")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.unlink(tmp_path / "linked-into-the-output")
    with pytest.raises(AssertionError, match="was read to hash it"):
        _digests([f], monkeypatch, allow_hashing=False)
    monkeypatch.undo()
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path / "qtool-cache"))
    assert _digests([f], monkeypatch, allow_hashing=True) == {str(f): hashlib.sha256(b"b" + b"a" * 4999).hexdigest()}


def test_a_committed_outputs_digests_are_known_to_the_next_job(request, tmp_path, monkeypatch):
    """quantize's output is calibrate-kv's and eval kld's input: the digests quantize computed as it wrote
    its shards are in the cache under their final paths, so the next job reads nothing to hash them."""
    from full_model import fixture_dir

    from qtool.ops import quantize

    out = tmp_path / "nvfp4"
    from qtool.recipes import load_recipe

    quantize.run(
        fixture_dir(request, "tiny_bf16"), recipe=load_recipe("qwen35-nvfp4-experts"), out=out, samples=2, seq_len=32
    )
    shards = sorted(out.glob("*.safetensors"))
    got = _digests(shards, monkeypatch, allow_hashing=False)
    assert got == {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in shards}
    # an edit after the commit is not hidden by the cache (its ctime moved)
    with open(shards[0], "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x01")
    monkeypatch.undo()
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path / "qtool-cache"))
    assert (
        _digests(shards[:1], monkeypatch, allow_hashing=True)[str(shards[0])]
        == hashlib.sha256(shards[0].read_bytes()).hexdigest()
    )


@pytest.mark.slow
@pytest.mark.parametrize("where", ["-o OUT --force", "--in-place"])
def test_a_rerun_reads_nothing_to_hash_its_input(request, tmp_path, inputs_hashed, where):
    """calibrate-kv again and again, as a user tunes it. `-o OUT --force`: each run links SRC's unchanged
    shards into its output, and its commit removes the output it replaces, whose links into SRC move their
    ctime once more; that removal came after the run re-recorded its input digests, so every other run
    read SRC again (or hashed it from its reads) to hash it: at the 397B, minutes of sha256 on the layer
    path. `--in-place`: the run links the checkpoint's files into its scratch before it looks their digests
    up, so every run hashed the whole checkpoint. Only the first run may hash."""
    import shutil

    from full_model import fixture_dir

    from qtool.cli.main import main

    src = tmp_path / "src"
    shutil.copytree(fixture_dir(request, "tiny_nvfp4_modelopt"), src)  # its own inodes: links move its ctimes
    hashed = inputs_hashed
    out = ["-o", str(tmp_path / "kv"), "--force"] if where.startswith("-o") else ["--in-place"]
    argv = ["calibrate-kv", str(src), *out, "--replace-scales", "--samples", "2", "--seq-len", "32", "--quiet"]
    assert main(argv) == 0
    assert any(p.endswith(".safetensors") for p in hashed)  # the first run has no digest on record
    if where.startswith("-o"):
        assert [f for f in src.glob("*.safetensors") if f.stat().st_nlink > 1]  # the output links into SRC
    for _ in range(2):  # the second run replaces the first's output, the third the second's
        hashed.clear()
        assert main(argv) == 0
        assert [p for p in hashed if p.endswith(".safetensors")] == []


def test_two_jobs_saving_the_cache_keep_each_others_entries(tmp_path):
    """Each job (and a build's own fingerprints beside its steps) loads the cache, then saves it at its end:
    a save of the whole copy loaded took back out what the others had saved meanwhile, so after a build the
    cache held none of its steps' outputs, and the next build hashed them all again."""
    from qtool.io.digest_cache import DigestCache

    path = tmp_path / "sha256-cache.json"
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(b"a")
    b.write_bytes(b"b")
    first, second = DigestCache(path), DigestCache(path)  # both loaded before either saves
    first.store(str(a), hashlib.sha256(b"a").hexdigest(), os.stat(a))
    second.store(str(b), hashlib.sha256(b"b").hexdigest(), os.stat(b))
    first.save()
    second.save()
    again = DigestCache(path)
    assert again.lookup(str(a)) == hashlib.sha256(b"a").hexdigest()
    assert again.lookup(str(b)) == hashlib.sha256(b"b").hexdigest()


def test_the_cache_never_holds_a_job_up_nor_fails_it(tmp_path, monkeypatch):
    """Review: a save waits for another job's save under a lock; one holding it (a hung stat on a network
    mount while it prunes) must not stall every job, and a key no path can have must not fail one."""
    import fcntl

    from qtool.io import digest_cache
    from qtool.io.digest_cache import DigestCache

    monkeypatch.setattr(digest_cache, "LOCK_WAIT", 0.2)
    path = tmp_path / "sha256-cache.json"
    f = tmp_path / "a.safetensors"
    f.write_bytes(b"a")
    cache = DigestCache(path)
    cache.store(str(f), hashlib.sha256(b"a").hexdigest(), os.stat(f))
    held = os.open(tmp_path / "sha256-cache.json.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)  # another job's save
    t0 = time.monotonic()
    cache.save()
    assert time.monotonic() - t0 < 5 and not path.exists()  # gave up on its own save, kept its entries
    os.close(held)
    cache.save()
    assert DigestCache(path).lookup(str(f)) == hashlib.sha256(b"a").hexdigest()
    path.write_text('{"bad\\u0000key|0|0|0|0": {"sha256": "0", "ctime": 0}}')  # pruned: stat raises ValueError
    monkeypatch.setattr(digest_cache, "MAX_ENTRIES", 0)
    again = DigestCache(path)
    again.store(str(f), hashlib.sha256(b"a").hexdigest(), os.stat(f))
    again.save()  # no error
    with again.keeping([f]):
        pass


def test_keeping_never_gives_a_replaced_file_the_old_digest(tmp_path, monkeypatch):
    """Review: `keeping` looked the entry up with one stat and keyed it with another: a file replaced in
    between (an editor's write-and-rename of a config) was re-recorded with the old file's digest."""
    from qtool.io.digest_cache import DigestCache

    path = tmp_path / "sha256-cache.json"
    f = tmp_path / "config.json"
    f.write_text('{"a": 1}')
    cache = DigestCache(path)
    cache.record(str(f), hashlib.sha256(f.read_bytes()).hexdigest(), None)
    cache.save()
    cache = DigestCache(path)
    real_lookup = DigestCache.lookup

    def lookup_then_replaced(self, real, *a):
        found = real_lookup(self, real, *a)
        (tmp_path / "new").write_text('{"a": 2}')
        os.replace(tmp_path / "new", f)
        return found

    monkeypatch.setattr(DigestCache, "lookup", lookup_then_replaced)
    with cache.keeping([f]):
        pass
    monkeypatch.undo()
    assert DigestCache(path).lookup(str(f)) in (None, hashlib.sha256(f.read_bytes()).hexdigest())


def test_a_failed_job_does_not_wait_for_its_input_hashes_to_finish(tmp_path, monkeypatch):
    """The pool's threads are joined at the interpreter's exit: a failed or interrupted job would wait there
    for each input shard being hashed to be read to its end (seconds per 5 GB shard of a 397B). close()
    stops them within a chunk; the digest is then never given."""
    from concurrent.futures import wait

    from qtool.io import files

    big = tmp_path / "model-00001-of-00001.safetensors"
    with open(big, "wb") as f:
        f.truncate(4 << 30)  # sparse: reads at memory speed, still about 2 s to hash here
    hashing = []
    real = files.hash_fd
    monkeypatch.setattr(manifest, "hash_fd", lambda *a, **k: hashing.append(1) or real(*a, **k))
    h = InputHasher(workers=1)
    h.submit(str(big))
    while not hashing:
        time.sleep(0.001)
    h.close()
    (fut,) = h.futures.values()
    wait([fut], timeout=60)
    with pytest.raises(files.HashStopped):
        fut.result()


def test_the_digest_cache_keeps_what_can_still_match_and_stays_bounded(tmp_path, monkeypatch):
    """Unbounded, the cache grew by every file any run hashed (55k entries, 13 MB after a day of tests, 97%
    for files long gone), loaded and saved by every job. Past MAX_ENTRIES a save drops the entries that can
    never match again (file gone or replaced), then the least recently used."""
    from qtool.io import digest_cache
    from qtool.io.digest_cache import DigestCache

    monkeypatch.setattr(digest_cache, "MAX_ENTRIES", 4)
    path = tmp_path / "sha256-cache.json"
    files = []
    for i in range(3):
        f = tmp_path / f"model-{i}.safetensors"
        f.write_bytes(bytes([i]) * 10)
        files.append(f)
    c = DigestCache(path)
    for i in range(5):  # five files, since removed
        gone = tmp_path / f"gone-{i}"
        gone.write_bytes(b"x")
        c.store(str(gone), "0" * 64, os.stat(gone))
        gone.unlink()
    for f in files:
        c.store(str(f), hashlib.sha256(f.read_bytes()).hexdigest(), os.stat(f))
    c.save()
    again = DigestCache(path)
    assert len(again.entries) == 3
    assert [again.lookup(str(f)) for f in files] == [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
    for i in range(3, 6):  # more live files than the cache keeps: the oldest goes
        f = tmp_path / f"model-{i}.safetensors"
        f.write_bytes(bytes([i]) * 10)
        again.store(str(f), hashlib.sha256(f.read_bytes()).hexdigest(), os.stat(f))
        files.append(f)
    again.save()
    last = DigestCache(path)
    assert len(last.entries) == 4
    assert last.lookup(str(files[0])) is None and last.lookup(str(files[1])) is None
    assert last.lookup(str(files[5])) is not None
