import json

import pytest

from qtool.errors import ConfigError
from qtool.io.jsonio import dumps, load_json, unified_diff, write_json


def test_round_trip_keeps_order_indent_and_newline(tmp_path):
    text = '{\n    "z": 1,\n    "a": {\n        "k": [1, 2]\n    },\n    "m": "\\u00e9"\n}'
    p = tmp_path / "config.json"
    p.write_text(text)
    obj, style = load_json(p)
    assert list(obj) == ["z", "a", "m"] and style.indent == 4 and not style.trailing_newline
    write_json(p, obj, style)
    again = p.read_text()
    assert json.loads(again) == obj and list(json.loads(again)) == ["z", "a", "m"]
    assert again.startswith('{\n    "z": 1') and not again.endswith("\n")
    obj["a"]["k"].append(3)
    d = unified_diff(dumps(json.loads(text), style), dumps(obj, style), "config.json")
    assert d.count("\n+") >= 1 and "a/config.json" in d


def test_malformed_json_names_file_and_position(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"a": 1,,}')
    with pytest.raises(ConfigError) as e:
        load_json(p, what="config.json")
    assert "line 1 column" in e.value.message and e.value.path == str(p)
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="object"):
        load_json(p)


@pytest.mark.parametrize(
    "text",
    [
        '{\n    "a": {\n        "b": "\\u00e9"\n    }\n}',
        '{"a": 1}\n',
        '{\n\t"a": [\n\t\t1\n\t]\n}\n',
        '{\n  "weight_map": {\n    "x": "é"\n  }\n}\n',
    ],
)
def test_file_style_is_load_jsons_style_without_the_parse(tmp_path, text):
    """calibrate-kv and convert keep their source index's style: read from its text (a 397B index is 41 MB),
    the same style load_json finds; a missing file is named."""
    from qtool.io.jsonio import file_style

    p = tmp_path / "model.safetensors.index.json"
    p.write_text(text, encoding="utf-8")
    assert file_style(p) == load_json(p)[1]
    obj, style = load_json(p)
    assert dumps(obj, file_style(p)) == text
    with pytest.raises(ConfigError) as e:
        file_style(tmp_path / "missing.json", what="safetensors index")
    assert "missing.json" in str(e.value.path)
