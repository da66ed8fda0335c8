"""qtool.io.output: the one output transaction every writing command uses."""

from __future__ import annotations

import os
import stat

import pytest

from qtool.errors import UsageError, WriteError
from qtool.io.files import LinkMode, Placer, new_file
from qtool.io.identity import input_identity
from qtool.io.in_place import InPlaceDir, exchange_paths
from qtool.io.jsonio import write_json
from qtool.io.manifest import write_manifest
from qtool.io.output import OutputDir, check_no_overlap, lock_for, output_files
from qtool.redact import command_line


def _done(tx: OutputDir, files: dict[str, str]) -> None:
    for name, text in files.items():
        with new_file(tx.partial / name) as f:
            f.write(text.encode())
    write_manifest(
        tx.partial / "qtool-manifest.json",
        kind="test",
        command=None,
        sources={},
        summary={},
        checks={},
        files=output_files(tx.partial),
    )
    tx.commit()


def test_commit_refuses_existing_and_force_replaces_only_qtool_outputs(tmp_path):
    out = tmp_path / "out"
    with OutputDir(out) as tx:
        (tx.partial / "f").write_text("x")
        assert not out.exists()
        _done(tx, {})
    assert (out / "f").read_text() == "x" and not (tmp_path / "out.partial").exists()
    with pytest.raises(WriteError, match="already exists"):
        OutputDir(out).__enter__()
    with OutputDir(out, force=True) as tx:
        _done(tx, {"g": "y"})
    assert sorted(os.listdir(out)) == ["g", "qtool-manifest.json"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data").write_text("keep")
    with pytest.raises(WriteError, match="not made by qtool"):
        OutputDir(mine, force=True).__enter__()
    assert (mine / "data").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]  # no lock file left behind


def test_new_files_never_write_through_a_hard_link(tmp_path):
    src = tmp_path / "src.safetensors"
    src.write_bytes(b"input bytes")
    out = tmp_path / "o"
    out.mkdir()
    os.link(src, out / "shard")
    with new_file(out / "shard") as f:  # what a resumed run does where a crashed one left a link
        f.write(b"new")
    assert src.read_bytes() == b"input bytes" and (out / "shard").read_bytes() == b"new"
    os.link(src, out / "copy")
    Placer(LinkMode.COPY).place(src, out / "copy")
    assert os.stat(out / "copy").st_ino != os.stat(src).st_ino and src.read_bytes() == b"input bytes"
    assert Placer(LinkMode.AUTO).place(src, out / "auto") in ("reflink", "hardlink")


def test_overlap_in_every_direction_and_through_symlinks(tmp_path):
    src = tmp_path / "P" / "model"
    src.mkdir(parents=True)
    (tmp_path / "link").symlink_to(src)
    for out in (src, src.parent, src / "sub", tmp_path / "link", tmp_path / "link" / "x"):
        with pytest.raises(UsageError, match="overlaps"):
            check_no_overlap(out, [src])
    check_no_overlap(tmp_path / "elsewhere", [src])


def test_lock_names_the_holder_and_is_removed(tmp_path):
    out = tmp_path / "out"
    with lock_for(out), pytest.raises(WriteError, match=f"pid {os.getpid()}"):
        OutputDir(out).__enter__()
    assert list(tmp_path.iterdir()) == []
    with OutputDir(out):
        pass


def _edit_keeping_mtime(f, offset: int) -> None:
    st = f.stat()
    with open(f, "r+b") as h:
        h.seek(offset)
        h.write(b"\x01")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_size == st.st_size


def test_identity_sees_a_same_size_edit_with_the_mtime_put_back(tmp_path):
    f = tmp_path / "shard.safetensors"
    f.write_bytes(bytes(8 << 20))
    before = input_identity([f])
    _edit_keeping_mtime(f, 100)  # the header or first tensors: seen by the quick identity
    assert input_identity([f]) != before


def test_recorded_input_digests_catch_an_edit_the_samples_miss(tmp_path):
    from qtool.io.manifest import InputHasher

    f = tmp_path / "shard.safetensors"
    f.write_bytes(bytes(8 << 20))
    record = tmp_path / "digests.jsonl"
    first = InputHasher(trust_cache=False, record=record)
    first.submit(str(f))
    first.results()
    before = input_identity([f])
    _edit_keeping_mtime(f, 5 << 20)  # between two sampled blocks
    assert input_identity([f]) == before
    resumed = InputHasher(trust_cache=False, record=record)
    resumed.submit(str(f))
    with pytest.raises(WriteError, match="changed since the interrupted run"):
        resumed.results()


def test_commit_sweeps_temporary_files_and_gives_one_mode(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"x")
    os.chmod(src / "model.safetensors", 0o600)
    out = tmp_path / "out"
    with OutputDir(out, sources=[src]) as tx:
        tx.placer.place(src / "model.safetensors", tx.partial / "model.safetensors")
        write_json(tx.partial / "config.json", {"a": 1})
        (tx.partial / ".config.json.abc.qtool-tmp").write_text("{")  # a kill inside write_json
        _done(tx, {"b.json": "{}"})
    assert sorted(os.listdir(out)) == ["b.json", "config.json", "model.safetensors", "qtool-manifest.json"]
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o600}


def test_in_place_is_swapped_in_whole(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text("old")
    (root / "model.safetensors").write_bytes(b"weights")
    ino = os.stat(root / "model.safetensors").st_ino
    tx = InPlaceDir(root).begin()
    write_json(tx.partial / "config.json", {"new": True})
    assert (root / "config.json").read_text() == "old"  # nothing visible before the swap
    tx.commit()
    assert (root / "config.json").read_text().startswith("{") and os.stat(root / "model.safetensors").st_ino == ino
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_exchange_paths(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    if not exchange_paths(a, b):
        pytest.skip("renameat2 RENAME_EXCHANGE is not available here")
    assert (b / "x").read_text() == "a" and not (a / "x").exists()


def test_secrets_never_reach_the_command_line():
    line = command_line(
        [
            "qtool",
            "build",
            "r.yaml",
            "--token",
            "hf_abcdefghijkl",
            "--token=hf_zzzzzzzzzz",
            "--source",
            "x=https://u:hf_secretsecret@host/x",
        ]
    )
    assert "hf_" not in line and line.count("***") == 3


def test_open_lists_only_the_transactions_still_open(tmp_path):
    """Issue 26: OPEN (what Ctrl-C lists as kept) was never pruned: every transaction of the process stayed,
    and an output begun again after an interruption was listed twice. Committed or removed, it leaves OPEN;
    interrupted, it stays (its partial is what --resume continues) until the same output is begun again."""
    from qtool.io.output import OPEN, kept_partials

    done = OutputDir(tmp_path / "done").begin()
    done.commit()
    assert done not in OPEN
    with pytest.raises(KeyboardInterrupt), OutputDir(tmp_path / "cut") as cut:
        raise KeyboardInterrupt
    assert cut in OPEN and cut.partial in kept_partials()
    again = OutputDir(tmp_path / "cut").begin()  # the same output once more, in the same process
    assert cut not in OPEN and kept_partials().count(again.partial) == 1
    again.commit()
    assert again not in OPEN and again.partial not in kept_partials()
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text("{}")
    with pytest.raises(KeyboardInterrupt), InPlaceDir(root, keep_partial=False) as gone:  # its partial is removed
        raise KeyboardInterrupt
    assert gone not in OPEN and not gone.partial.exists()
