"""The calibration set's token ids come from qtool's token cache where the same tokenizer tokenized the
same data before (qtool.stream.token_cache): the same ids as tokenizing afresh, and no tokenizer (no
transformers import) on a hit; any change to the tokenizer files, the data or the count asked for is a
miss; a cache that cannot be written or read leaves the ids as they are."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from qtool.stream import calib_data, token_cache
from qtool.stream.calib_data import build_calib_set


@pytest.fixture
def ckpt(tmp_path):
    from qtool.fixtures.tokenizer import save_tokenizer_files

    d = tmp_path / "ckpt"
    d.mkdir()
    save_tokenizer_files(d)
    (d / "config.json").write_text('{"model_type": "qwen3_5_moe"}')
    return d


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokens"


def _no_tokenizer(monkeypatch):
    def refuse(_):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(calib_data, "load_tokenizer", refuse)


def test_a_hit_gives_the_same_ids_without_the_tokenizer(ckpt, cache, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    data = tmp_path / "d.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    fresh = build_calib_set(ckpt, str(data), 4, 16)
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    assert fresh.ids.flatten().tolist() == tok(data.read_text(), add_special_tokens=False)["input_ids"][:64]
    assert len(list(cache.iterdir())) == 1
    _no_tokenizer(monkeypatch)
    hit = build_calib_set(ckpt, str(data), 4, 16)
    assert hit.ids.tolist() == fresh.ids.tolist() and hit.available_tokens == fresh.available_tokens
    assert hit.digest == fresh.digest
    at_most = build_calib_set(ckpt, str(data), 4, 16, at_most=True)  # the same tokens asked for
    assert at_most.digest == fresh.digest


@pytest.mark.parametrize("change", ["tokenizer", "template", "data", "count", "config"])
def test_a_change_is_a_miss(ckpt, cache, tmp_path, monkeypatch, change):
    data = tmp_path / "d.txt"
    data.write_text("alpha beta gamma delta " * 50)
    build_calib_set(ckpt, str(data), 2, 16)
    samples = 2
    if change == "tokenizer":
        tj = ckpt / "tokenizer.json"
        tj.write_text(tj.read_text().replace('"alpha"', '"alpha"', 1) + " ")  # same tokens, other bytes
    elif change == "template":
        (ckpt / "chat_template.jinja").write_text("{{ messages }}")
    elif change == "data":
        data.write_text("alpha beta gamma delta " * 50)  # same bytes, rewritten: the ctime moves
    elif change == "count":
        samples = 3
    else:
        (ckpt / "config.json").write_text('{"model_type": "qwen3_5_moe", "tokenizer_class": "Qwen2Tokenizer"}')
    calls = []
    real = calib_data.load_tokenizer
    monkeypatch.setattr(calib_data, "load_tokenizer", lambda d: calls.append(d) or real(d))
    build_calib_set(ckpt, str(data), samples, 16)
    assert calls, change


def test_the_builtin_sample_and_a_hub_commit_are_keyed(ckpt, cache):
    assert token_cache.key(ckpt, "builtin", 64) is not None
    assert token_cache.key(ckpt, "hf:org/chat:train_sft", 64) is None  # no resolved commit: not cached
    a = token_cache.key(ckpt, "hf:org/chat:train_sft", 64, revision="a" * 40)
    b = token_cache.key(ckpt, "hf:org/chat:train_sft", 64, revision="b" * 40)
    c = token_cache.key(ckpt, "hf:org/chat:test", 64, revision="a" * 40)
    assert None not in (a, b, c) and len({a, b, c}) == 3
    # offline, a branch stands for whatever the datasets cache holds: not a key
    assert token_cache.key(ckpt, "hf:org/chat@main:train_sft", 64, revision="main") is None


def test_a_broken_cache_is_ignored(ckpt, cache, tmp_path, monkeypatch):
    data = tmp_path / "d.txt"
    data.write_text("one two three four five six " * 30)
    fresh = build_calib_set(ckpt, str(data), 2, 16)
    (entry,) = cache.iterdir()
    whole = entry.read_bytes()
    for broken in (whole[:-4], whole[:-2], b"", whole[:60], whole[:-8] + b"\0" * 8):  # short, torn, damaged
        entry.write_bytes(broken)
        again = build_calib_set(ckpt, str(data), 2, 16, at_most=True)
        assert again.digest == fresh.digest and again.available_tokens == fresh.available_tokens
    shutil.rmtree(cache)
    monkeypatch.setenv("QTOOL_CACHE_DIR", "/proc/qtool-cannot-write-here")
    assert build_calib_set(ckpt, str(data), 2, 16).digest == fresh.digest


def test_a_tokenizer_side_file_that_is_not_regular_is_named_on_a_hit(ckpt, cache, tmp_path):
    from qtool.errors import QtoolError

    data = tmp_path / "d.txt"
    data.write_text("one two three four five six " * 30)
    build_calib_set(ckpt, str(data), 2, 16)
    os.unlink(ckpt / "chat_template.jinja")
    os.symlink(tmp_path / "nowhere", ckpt / "chat_template.jinja")
    with pytest.raises(QtoolError, match="chat_template.jinja"):
        build_calib_set(ckpt, str(data), 2, 16)


def test_a_hit_does_not_import_transformers(ckpt, tmp_path):
    """What the cache is for: the job's start does not import transformers' tokenizer machinery."""
    data = tmp_path / "d.txt"
    data.write_text("the quick brown fox " * 60)
    env = {**os.environ, "QTOOL_CACHE_DIR": str(tmp_path / "cache")}
    probe = (
        "import sys\nfrom qtool.stream.calib_data import build_calib_set\n"
        f"c = build_calib_set({str(ckpt)!r}, {str(data)!r}, 2, 16)\n"
        "print(c.digest, 'transformers' in sys.modules)\n"
    )
    runs = [
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
        for _ in range(2)
    ]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    (d1, t1), (d2, t2) = (r.stdout.split() for r in runs)
    assert d1 == d2 and t1 == "True" and t2 == "False"


def test_the_folder_keeps_the_entries_used_last(ckpt, cache, tmp_path, monkeypatch):
    """Every new dataset adds an entry: the folder keeps the KEEP_ENTRIES used last (a hit counts as a
    use), so a CI box that calibrates on many datasets does not fill its disk with token ids."""
    monkeypatch.setattr(token_cache, "KEEP_ENTRIES", 2)
    datasets = []
    for k in range(3):
        d = tmp_path / f"d{k}.txt"
        d.write_text(f"dataset {k}: the quick brown fox jumps over the lazy dog. " * 20)
        datasets.append(d)
    build_calib_set(ckpt, str(datasets[0]), 2, 16)
    build_calib_set(ckpt, str(datasets[1]), 2, 16)
    first, second = (token_cache.key(ckpt, str(d), 32) for d in datasets[:2])
    os.utime(token_cache._path(first), ns=(1, 1))  # written long ago ...
    os.utime(token_cache._path(second), ns=(2, 2))  # (after the first; the clock's tick may be coarse)
    assert token_cache.load(first) is not None  # ... but used now
    killed, saving = cache / ".a.i32.x.qtool-tmp", cache / ".b.i32.y.qtool-tmp"  # a killed run's, a running one's
    killed.write_bytes(b"torn")
    os.utime(killed, (1, 1))
    saving.write_bytes(b"being written")
    build_calib_set(ckpt, str(datasets[2]), 2, 16)  # a third entry: the one used longest ago goes
    kept = sorted(p.name for p in cache.iterdir())
    assert kept == sorted(
        [f"{token_cache.key(ckpt, str(d), 32)}.i32" for d in (datasets[0], datasets[2])] + [saving.name]
    )
