"""The read-ahead (qtool.stream.layer_read): a layer's tensors read in coalesced runs are the bytes the
one-tensor-at-a-time reader gives, a truncated shard is a named error at the layer that needs it, and a
streamed run with read-ahead equals one without."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from full_model import fixture_dir

from qtool.errors import PlanError
from qtool.io.safetensors_header import TensorInfo
from qtool.stream.dequant import TensorSource, layer_tensors
from qtool.stream.hidden_store import MemoryStore
from qtool.stream.layer_read import ALIGN, MAX_GAP, LayerBytes, Prefetcher, coalesce, read_pieces
from qtool.stream.layer_stream import LayerStreamer


def _info(name, file, start, end, dtype="U8"):
    return TensorInfo(name, file, dtype, [end - start], start, end)


def test_coalesce_merges_neighbours_per_file_and_splits_at_holes():
    infos = [
        _info("b", "s1", 100, 200),
        _info("a", "s1", 0, 100),
        _info("c", "s1", 200 + MAX_GAP, 300 + MAX_GAP),
        _info("d", "s1", 301 + 2 * MAX_GAP, 400 + 2 * MAX_GAP),
        _info("e", "s2", 0, 10),
    ]
    runs = coalesce(infos)
    assert [(r.file, r.start, r.end, [t.name for t in r.tensors]) for r in runs] == [
        ("s1", 0, 300 + MAX_GAP, ["a", "b", "c"]),  # a hole of exactly MAX_GAP is read through
        ("s1", 301 + 2 * MAX_GAP, 400 + 2 * MAX_GAP, ["d"]),
        ("s2", 0, 10, ["e"]),
    ]


@pytest.mark.parametrize("fixture", ["tiny_nvfp4_modelopt", "tiny_bf16", "tiny_nvfp4_ct"])
def test_layer_bytes_equal_the_per_tensor_reads(request, fixture):
    s = LayerStreamer(fixture_dir(request, fixture))
    one = TensorSource()
    try:
        for idx in (0, 3):
            infos = layer_tensors(s.model_map, idx)
            got = LayerBytes(infos).read()
            assert len(got.runs) < len(infos)  # coalesced
            for info in infos:
                a, b = got.get(info), one.get(info)
                assert (
                    a.dtype == b.dtype
                    and a.shape == b.shape
                    and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
                )
    finally:
        one.close()


def test_prefetched_run_equals_unprefetched(request):
    ckpt = fixture_dir(request, "tiny_nvfp4_modelopt")
    from qtool.stream.calib_data import build_calib_set

    ids = build_calib_set(ckpt, "builtin", 2, 16).ids
    out = []
    for prefetch in (True, False):
        s = LayerStreamer(ckpt)
        if not prefetch:
            s.prefetch = lambda idx: None
        mem = MemoryStore.empty((2, 16, s.hidden_size), s.dtype)
        s.embed_into(ids, mem, 2)
        s.run(mem, 16, batch=2)
        out.append(mem.read(0, 2))
    assert torch.equal(out[0], out[1])


def test_a_truncated_shard_is_named_when_its_layer_is_taken(request, tmp_path):
    import shutil

    src = fixture_dir(request, "tiny_bf16")
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    s = LayerStreamer(ck)
    infos = layer_tensors(s.model_map, 5)
    shard = ck / infos[-1].file.rpartition("/")[2]
    with open(shard, "r+b") as f:
        f.truncate(max(i.end for i in infos if i.file == infos[-1].file) - 1)
    r = Prefetcher()
    r.start(5, infos)
    with pytest.raises(PlanError) as e:
        r.take(5)
    assert "truncated" in e.value.hint and str(shard) in str(e.value.path)
    assert r.take(5) is None  # taken once; another layer's bytes are not handed out for it


def _own_copy(request, tmp_path: Path) -> Path:
    """tiny_bf16 copied: pages another test's open map holds stay in the page cache, whatever evicts them."""
    import shutil

    return Path(shutil.copytree(fixture_dir(request, "tiny_bf16"), tmp_path / "bf16"))


def _evict_or_skip(files) -> None:
    """Drop the files' pages, or skip where this filesystem keeps them (tmpfs) or has no direct reads."""
    from qtool.fixtures.page_cache import evict
    from qtool.io import page_cache

    evict(files)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            if page_cache.resident(fd, 0, os.path.getsize(f)):
                pytest.skip(f"{f}'s filesystem keeps its pages in memory (tmpfs): nothing to read from a disk")
        finally:
            os.close(fd)
        try:
            os.close(os.open(f, os.O_RDONLY | os.O_DIRECT))
        except OSError:
            pytest.skip(f"{f}'s filesystem has no direct reads")


def _reads_with_flags(monkeypatch) -> list[bool]:
    """Whether each preadv of the layer reader went around the page cache (O_DIRECT on its descriptor)."""
    import fcntl

    direct = []
    real = os.preadv

    def preadv(fd, buffers, offset, *args):
        direct.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", preadv)
    return direct


def _refuse_direct(monkeypatch, at: str) -> None:
    """A filesystem without direct reads: EINVAL at the open (tmpfs before Linux 6.6) or at the read."""
    import errno
    import fcntl

    real_open, real_preadv = os.open, os.preadv

    def refuse_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)

    def refuse_read(fd, buffers, offset, *args):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *args)

    if at == "open":
        monkeypatch.setattr(os, "open", refuse_open)
    else:
        monkeypatch.setattr(os, "preadv", refuse_read)


@pytest.mark.xdist_group("measure")  # measures reads or memory: not beside another such test
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("how", ["direct", "cached", "refused at open", "refused at read"])
def test_layers_are_read_around_the_page_cache_unless_it_holds_them(request, tmp_path, monkeypatch, how, device):
    """An 800 GB input does not fit the page cache: its layers are read with O_DIRECT, whole 64 MiB pieces
    (no page read for a call but dropped before it is copied out, read twice). Bytes the page cache holds
    (a re-run on an input that fits memory) are copied from there, a piece a call; a filesystem that refuses
    direct reads is read through the page cache. Each way the tensors are the file's bytes, and a run's
    blocks around its own bytes (a direct read's alignment) are not part of any tensor. On CUDA the pieces
    go through the pinned staging buffers (aligned for direct reads). Pieces of 3 blocks here, so that a
    run is several pieces, its first and last read beyond its own bytes."""
    from qtool.io import page_cache
    from qtool.stream import layer_read

    monkeypatch.setattr(layer_read, "CHUNK", 3 * ALIGN)
    s = LayerStreamer(_own_copy(request, tmp_path))
    infos = layer_tensors(s.model_map, 2) + layer_tensors(s.model_map, 5)
    shards = sorted({i.file for i in infos})
    if how == "cached":
        if not page_cache.available():
            pytest.skip("this kernel has no cachestat (Linux 6.5+): every piece is read around the page cache")
        for f in shards:
            Path(f).read_bytes()
    else:
        _evict_or_skip(shards)
    if how.startswith("refused"):
        _refuse_direct(monkeypatch, how.rpartition(" ")[2])
    flags = _reads_with_flags(monkeypatch)
    one = TensorSource()
    try:
        r = Prefetcher(device)
        got = r.read_now(infos)
        # a run that ends at its shard's end, inside a block: the direct read stops short there
        assert any(run.end == os.path.getsize(run.file) and run.end % ALIGN for run in got.runs)
        if how == "direct":
            assert flags and all(flags)
        elif how == "cached":
            assert not any(flags) and len(flags) == len(
                [p for run in got.runs for p in read_pieces(run.file, run.start, run.end)]
            )
        else:
            assert flags and not flags[-1]
        for info in infos:
            assert torch.equal(got.get(info).cpu().view(-1).view(torch.uint8), one.get(info).view(-1).view(torch.uint8))
        for k, run in enumerate(got.runs):
            assert got._bufs[k].numel() == run.end - run.start
    finally:
        one.close()


@pytest.mark.xdist_group("measure")  # measures reads or memory: not beside another such test
@pytest.mark.parametrize("room", [True, False])
def test_a_piece_the_input_digest_has_no_room_for_is_read_through_the_page_cache(request, tmp_path, monkeypatch, room):
    """The input's sha256 comes from the layer reader's reads (qtool.io.stream_digest). A piece its queue
    has no room for is dropped there and read again by the digest: read around the page cache, that second
    read would go to the disk, so such a piece is read through the page cache, where the digest finds it.
    Either way the digest is the file's."""
    import hashlib

    from qtool.io import stream_digest

    s = LayerStreamer(_own_copy(request, tmp_path))
    infos = layer_tensors(s.model_map, 2)
    _evict_or_skip(sorted({i.file for i in infos}))
    if not room:
        monkeypatch.setattr(stream_digest, "QUEUE_BYTES", 0)
    flags = _reads_with_flags(monkeypatch)
    with stream_digest.StreamDigests() as reg:
        digests = {f: reg.add(f) for f in {i.file for i in infos}}
        LayerBytes(infos, digests=reg).read()
        direct = list(flags)
        for f, d in digests.items():
            assert d.finish() == hashlib.sha256(Path(f).read_bytes()).hexdigest()
            assert (d.dropped == 0) == room
    assert direct and all(direct) == room and any(direct) == room


def _raw_file(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    data = os.urandom(size)
    f = tmp_path / "model-00001-of-00001.safetensors"
    f.write_bytes(data)
    return f, data


@pytest.mark.xdist_group("measure")  # measures reads or memory: not beside another such test
def test_a_tensor_at_an_odd_offset_is_its_bytes(tmp_path):
    """safetensors does not align offsets, and a CPU run's buffer starts inside an aligned block: a BF16
    tensor at an odd file offset is still a tensor of its bytes (found by review: a view of the buffer
    needs whole elements from the storage's start)."""
    f, data = _raw_file(tmp_path, 3 * ALIGN + 77)
    _evict_or_skip([str(f)])
    infos = [
        TensorInfo("a", str(f), "BF16", [100], 101, 301),
        TensorInfo("b", str(f), "F32", [50], 303, 503),
        TensorInfo("c", str(f), "U8", [77], 3 * ALIGN, 3 * ALIGN + 77),
    ]
    got = LayerBytes(infos).read()
    for info in infos:
        t = got.get(info)
        assert (
            list(t.shape) == info.shape
            and t.view(-1).view(torch.uint8).numpy().tobytes() == data[info.start : info.end]
        )


def test_each_piece_read_goes_to_the_digests_the_reader_is_given_and_nowhere_else(tmp_path):
    """The reader hands what it reads to the job's input digests it was given (an object, made by whoever
    opened the inputs), claimed first, each byte once; two jobs' readers in one process feed their own."""
    from qtool.io.stream_digest import NoDigests

    class Recording(NoDigests):
        def __init__(self) -> None:
            self.claimed: list[tuple[int, int]] = []
            self.offered: dict[int, bytes] = {}

        def claim(self, path: str, start: int, end: int) -> None:
            self.claimed.append((start, end))

        def offer(self, path: str, start: int, view: memoryview, keep=None) -> None:
            assert path == str(f) and (start, start + len(view)) in self.claimed
            self.offered[start] = bytes(view)

    f, data = _raw_file(tmp_path, 3 * ALIGN + 77)
    info = TensorInfo("t", str(f), "U8", [len(data) - 10], 5, len(data) - 5)
    mine, other = Recording(), Recording()
    LayerBytes([info], digests=mine).read()
    assert b"".join(mine.offered[k] for k in sorted(mine.offered)) == data[5:-5]
    assert not other.claimed and not other.offered
    LayerBytes([info]).read()  # a reader given no digests hashes nothing
    assert not other.offered


def test_a_reader_reads_the_input_files_it_is_handed_with_its_digests(tmp_path):
    """The job's input files travel with its digests (DigestSink.inputs), not through a process-wide
    registry: a reader handed them reads the file the job opened, even once another file is renamed over
    its path; a reader handed none (no job) opens the path, and two jobs' input files in one process stay
    their own."""
    from qtool.io.input_files import InputFiles
    from qtool.io.stream_digest import StreamDigests

    f, data = _raw_file(tmp_path, 3 * ALIGN + 77)
    info = TensorInfo("t", str(f), "U8", [len(data) - 10], 5, len(data) - 5)
    mine, other = InputFiles(), InputFiles()
    try:
        mine.open(f)
        new = tmp_path / "new.safetensors"
        new.write_bytes(bytes(len(data)))
        os.replace(new, f)  # another file at the job's input's path
        with StreamDigests(inputs=mine) as job:
            assert LayerBytes([info], digests=job).read().raw(info).numpy().tobytes() == data[5:-5]
        with StreamDigests(inputs=other) as job:
            assert LayerBytes([info], digests=job).read().raw(info).numpy().tobytes() == bytes(len(data) - 10)
        assert LayerBytes([info]).read().raw(info).numpy().tobytes() == bytes(len(data) - 10)
        assert not other.files
    finally:
        mine.close()


@pytest.mark.xdist_group("measure")  # measures reads or memory: not beside another such test
def test_a_short_direct_read_is_finished_not_called_truncated(tmp_path, monkeypatch):
    """A filesystem may return short counts from a direct read (FUSE, network filesystems) that are not a
    block's multiple: the piece's rest is read through the page cache, not reported as a truncated shard
    (found by review)."""
    import fcntl

    f, data = _raw_file(tmp_path, 5 * ALIGN + 1234)
    _evict_or_skip([str(f)])
    real = os.preadv

    def short(fd, buffers, offset, *args):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            buffers = [memoryview(buffers[0])[:12800]]  # a multiple of 512, not of ALIGN
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", short)
    info = TensorInfo("t", str(f), "U8", [len(data) - 10], 5, len(data) - 5)
    got = LayerBytes([info]).read()
    assert got.get(info).numpy().tobytes() == data[5:-5]


def test_cachestat_refused_for_one_file_still_answers_for_the_next(monkeypatch):
    """cachestat answers only a caller who may write the file or owns it (EPERM otherwise, as mincore):
    a checkpoint the user only reads must not turn the check off for every file (found by review). A
    kernel without it (ENOSYS) does."""
    import ctypes
    import errno

    from qtool.io import page_cache

    monkeypatch.setattr(page_cache, "_available", True)
    answer = {"errno": errno.EPERM}

    class Libc:
        @staticmethod
        def syscall(*args):
            ctypes.set_errno(answer["errno"])
            return -1

    monkeypatch.setattr(page_cache, "_libc", Libc)
    assert not page_cache.resident(0, 0, 1) and page_cache._available
    answer["errno"] = errno.ENOSYS
    assert not page_cache.resident(0, 0, 1) and not page_cache._available
