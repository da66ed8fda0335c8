import json

import pytest

from qtool.errors import ConfigError
from qtool.io.jsonio import load_json, unified_diff, write_json, dumps


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
