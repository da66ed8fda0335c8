"""model.safetensors.index.json read entry by entry: same result as parsing it whole, in every form a
JSON writer may produce; errors still name the file."""

from __future__ import annotations

import json

import pytest

from qtool.errors import CheckpointError, ConfigError
from qtool.io import index_file
from qtool.io.checkpoint import Checkpoint
from qtool.io.index_file import read_index

WM = {
    "b.weight": "model-00002-of-00002.safetensors",
    "a.weight": "model-00001-of-00002.safetensors",
    "c.bias": "model-00002-of-00002.safetensors",
}


def _by_file(wm: dict) -> dict:
    out: dict = {}
    for n, s in wm.items():
        out.setdefault(s, []).append(n)
    return out


@pytest.mark.parametrize("indent", [None, 2, "\t"])
@pytest.mark.parametrize("order", ["metadata-first", "weight_map-first"])
def test_same_as_a_whole_parse(tmp_path, indent, order):
    meta = {"total_size": 123, "note": "weight_map: {} in a string"}
    obj = {"metadata": meta, "weight_map": WM} if order == "metadata-first" else {"weight_map": WM, "metadata": meta}
    p = tmp_path / "model.safetensors.index.json"
    p.write_text(json.dumps(obj, indent=indent))
    index, by_file = read_index(p)
    assert index == {"metadata": meta} and by_file == _by_file(WM)
    assert index_file._fast(p.read_bytes()) is not None  # read entry by entry, not by the fallback
    # one str object per shard name, shared by every entry
    assert len({id(s) for s in by_file}) == 2


@pytest.mark.parametrize(
    "text",
    [
        # escapes in names: the JSON parser decodes them
        '{"weight_map": {"a\\u00e9.weight": "s1.safetensors", "b\\"q": "s1.safetensors"}}',
        # "weight_map" as a key inside metadata before the real one
        '{"metadata": {"weight_map": {"x": "y"}}, "weight_map": {"a": "s1.safetensors"}}',
    ],
)
def test_forms_outside_the_pattern_fall_back_to_the_parser(tmp_path, text):
    p = tmp_path / "i.json"
    p.write_text(text)
    want = json.loads(text)
    wm = want.pop("weight_map")
    index, by_file = read_index(p)
    assert index == want and by_file == _by_file(wm)


def test_non_string_shard_name_is_an_error_naming_the_tensor(tmp_path):
    from qtool.errors import ConfigError

    p = tmp_path / "i.json"
    p.write_text('{"weight_map": {"a": 3, "b": "s1.safetensors"}}')
    with pytest.raises(ConfigError, match="not a shard file name") as e:
        read_index(p)
    assert e.value.tensor == "a" and e.value.path == str(p)


@pytest.mark.parametrize("text", ['{"metadata": {}}', '{"weight_map": {}}', '{"weight_map": []}'])
def test_no_usable_weight_map(tmp_path, text):
    p = tmp_path / "i.json"
    p.write_text(text)
    assert read_index(p)[1] is None


def test_broken_json_names_the_file(tmp_path):
    p = tmp_path / "model.safetensors.index.json"
    p.write_text('{"weight_map": {"a": "s1.safetensors", "b": ')
    with pytest.raises(ConfigError) as e:
        read_index(p)
    assert e.value.path == str(p) and "not valid JSON" in str(e.value)


def test_open_with_index_errors(tiny_nvfp4_modelopt, tmp_path):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(tiny_nvfp4_modelopt, ck)
    idx_path = ck / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    shard_of = idx["weight_map"]
    name = next(n for n in shard_of if sum(s == shard_of[n] for s in shard_of.values()) > 1)
    idx["weight_map"][name + ".extra"] = idx["weight_map"][name]  # a name the shard does not hold
    idx_path.write_text(json.dumps(idx, indent=2))
    with pytest.raises(CheckpointError, match="does not contain it"):
        Checkpoint.open(ck)
    del idx["weight_map"][name + ".extra"]
    del idx["weight_map"][name]  # a tensor the index does not map
    idx_path.write_text(json.dumps(idx, indent=2))
    with pytest.raises(CheckpointError, match="does not map to it") as e:
        Checkpoint.open(ck)
    assert e.value.tensor == name
    idx_path.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="no weight_map"):
        Checkpoint.open(ck)


@pytest.mark.parametrize("n", [0, 3, 10_000])
def test_index_text_is_json_dumps_indent_2(n):
    from qtool.io.writer import index_text

    wm = {f'layers.{i}.w\u00e9"': f"s{i % 3}.safetensors" for i in range(n)}
    for meta in ({"total_size": 5}, {"total_parameters": 3, "total_size": 9}):
        want = json.dumps({"metadata": meta, "weight_map": dict(sorted(wm.items()))}, indent=2) + "\n"
        assert "".join(index_text(wm, meta)) == want
