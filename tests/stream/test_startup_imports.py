"""A streamed job's start imports what it runs: transformers' tokenizer and decoder module without
scikit-learn (its assisted-generation candidate generator imports sklearn.metrics where scikit-learn is
installed: 1.8 s with scipy on the lent GPU machine), and transformers' map of the installed
distributions from qtool's cache (1.08 s there). scikit-learn is not a qtool dependency, so a stand-in
package that transformers detects as installed shows what a user's environment with it does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import sys
{prepare}
import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe
print("sklearn.metrics" in sys.modules)
"""


def _imports_sklearn(tmp_path, prepare: str, probe: str = PROBE) -> bool:
    pkg = tmp_path / "site" / "sklearn"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("__version__ = '1.7.0'\n")
    (pkg / "metrics.py").write_text("def roc_curve(*a, **k):\n    raise AssertionError('not for qtool')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, "-c", probe.format(prepare=prepare)], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.slow
def test_the_decoder_module_comes_without_scikit_learn(tmp_path):
    assert _imports_sklearn(tmp_path, "")  # the stand-in is what transformers would import
    assert not _imports_sklearn(
        tmp_path, "from qtool.stream.warm_import import skip_unused_imports\nskip_unused_imports()"
    )


def test_the_background_import_skips_it_too(tmp_path):
    assert not _imports_sklearn(
        tmp_path, "from qtool.stream import warm_import\nwarm_import.start(); warm_import.join()"
    )


MODULE_PROBE = """
import sys
{prepare}
import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe
print(sorted(m for m in ("scipy", "torchvision") if m in sys.modules))
"""


@pytest.mark.slow
def test_the_decoder_module_comes_without_scipy():
    """transformers' object-detection losses import scipy.optimize where scipy is installed (0.45 s of the
    decoder module's import on a 2-core CPU); a streamed job never computes them."""
    import importlib.util

    if importlib.util.find_spec("scipy") is None:
        pytest.skip("scipy is not installed: transformers would not import it either")

    def imported(prepare: str) -> str:
        r = subprocess.run(
            [sys.executable, "-c", MODULE_PROBE.format(prepare=prepare)], capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.strip().splitlines()[-1]

    assert "scipy" in imported("")  # what transformers alone imports
    assert imported("from qtool.stream.warm_import import skip_unused_imports\nskip_unused_imports()") == "[]"


def _stand_in_installed(tmp_path, name: str, version: str, modules: tuple[str, ...] = ()) -> dict:
    """The environment of a process in which a stand-in distribution `name` is installed, as transformers
    detects one (its package and its dist-info), with the empty `modules` (dotted, below the package) that
    transformers' own imports of it reach."""
    site = tmp_path / "site"
    package = site / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"__version__ = '{version}'\n")
    for module in modules:
        *folders, leaf = module.split(".")
        for k in range(1, len(folders) + 1):
            package.joinpath(*folders[:k]).mkdir(exist_ok=True)
            package.joinpath(*folders[:k], "__init__.py").touch()
        package.joinpath(*folders, leaf + ".py").touch()
    dist = site / f"{name}-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (dist / "top_level.txt").write_text(f"{name}\n")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "QTOOL_CACHE_DIR": str(tmp_path / "cache"),
    }


AUDIO_PROBE = """
import sys
{prepare}
import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe
print("torchaudio" in sys.modules)
"""


@pytest.mark.slow
def test_the_decoder_module_comes_without_torchaudio(tmp_path):
    """transformers' audio utilities (imported with the decoder module) import torchaudio where it is
    installed (with its wav2vec2 pipelines on the lent GPU machine); a streamed job loads no audio. A stand-in
    distribution that transformers detects as installed shows what a user's environment with it does."""
    env = _stand_in_installed(tmp_path, "torchaudio", "2.11.0")

    def imports_torchaudio(prepare: str) -> bool:
        r = subprocess.run(
            [sys.executable, "-c", AUDIO_PROBE.format(prepare=prepare)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.strip().splitlines()[-1] == "True"

    assert imports_torchaudio("")  # what transformers alone imports
    assert not imports_torchaudio("from qtool.stream import warm_import\nwarm_import.start(); warm_import.join()")


VISION_PROBE = """
import sys
{prepare}
from transformers.utils import import_utils
import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe
print(import_utils.is_torchvision_available(), sorted(m for m in sys.modules if m.split(".")[0] == "torchvision"))
"""


def test_the_decoder_module_comes_without_torchvision(tmp_path):
    """transformers' video processing utilities (imported with the decoder module) import torchvision's
    transforms where it is installed, through a check of their own (`is_torchvision_v2_available`): 0.20 s
    of the import on the lent GPU machine, whose image has torchvision; a streamed job processes no image
    or video. A stand-in distribution that transformers detects as installed shows what a user's
    environment with it does."""
    env = _stand_in_installed(tmp_path, "torchvision", "0.26.0", modules=("transforms.v2.functional",))
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            VISION_PROBE.format(
                prepare="from qtool.stream import warm_import\nwarm_import.start(); warm_import.join()"
            ),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "True []"  # installed as transformers sees it, and not imported


TOKENIZER_PROBE = """
import sys
{prepare}
print(len(load_tokenizer(sys.argv[1])("the quick brown fox")["input_ids"]) > 0)
print("sklearn.metrics" in sys.modules)
"""


@pytest.mark.slow
def test_the_tokenizer_comes_without_scikit_learn(tmp_path):
    """The tokenizer is a streamed job's first transformers import (the plan's): the skip applies there,
    not only to the decoder module imported after it."""
    from qtool.fixtures.tokenizer import save_tokenizer_files

    (tmp_path / "ckpt").mkdir()
    save_tokenizer_files(tmp_path / "ckpt")
    probe = TOKENIZER_PROBE.replace("sys.argv[1]", repr(str(tmp_path / "ckpt")))
    plain = "from transformers import AutoTokenizer\nload_tokenizer = AutoTokenizer.from_pretrained"
    assert _imports_sklearn(tmp_path, plain, probe)  # transformers alone imports the stand-in
    assert not _imports_sklearn(tmp_path, "from qtool.stream.calib_data import load_tokenizer", probe)


def test_the_distribution_map_is_the_standard_librarys(tmp_path, monkeypatch):
    """Served from the cache, the map is what importlib.metadata computes; a distribution installed since
    (a new dist-info in a sys.path directory) is in the next call's map; an unwritable cache is skipped."""
    import importlib.metadata

    from qtool.stream import package_map

    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path / "cache"))
    truth = package_map._ORIGINAL()
    assert package_map.packages_distributions() == truth  # computed, and written
    (entry,) = (tmp_path / "cache").glob(package_map.FILE + "-*.json")
    assert package_map.packages_distributions() == truth  # from the cache
    first = package_map.packages_distributions()
    first.clear()  # a caller's copy: the next caller's map is whole
    assert package_map.packages_distributions() == truth

    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    assert "qtool_probe_pkg" not in package_map.packages_distributions()
    dist = site / "qtool_probe_dist-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: qtool-probe-dist\nVersion: 1.0\n")
    (dist / "top_level.txt").write_text("qtool_probe_pkg\n")
    importlib.invalidate_caches()
    assert package_map.packages_distributions()["qtool_probe_pkg"] == ["qtool-probe-dist"]
    assert package_map.packages_distributions() == package_map._ORIGINAL()
    # a job's outputs in a sys.path directory (the working directory, under `python -m qtool`): still a hit
    scans = []
    original = package_map._ORIGINAL
    monkeypatch.setattr(package_map, "_ORIGINAL", lambda: scans.append(1) or original())
    (site / "out").mkdir()
    (site / "model.safetensors").write_bytes(b"x")
    assert package_map.packages_distributions()["qtool_probe_pkg"] == ["qtool-probe-dist"]
    assert scans == []
    # a run from another working directory (`python -m qtool` puts it on sys.path) without distributions
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    assert package_map.packages_distributions()["qtool_probe_pkg"] == ["qtool-probe-dist"]
    assert scans == []
    monkeypatch.setattr(package_map, "_ORIGINAL", original)
    # an unpacked egg put on sys.path is a distribution (through its EGG-INFO): the key sees it come
    egg = tmp_path / "qtool_probe_egg-1.0-py3.egg"
    (egg / "EGG-INFO").mkdir(parents=True)
    (egg / "EGG-INFO" / "PKG-INFO").write_text("Metadata-Version: 1.1\nName: qtool-probe-egg\nVersion: 1.0\n")
    (egg / "EGG-INFO" / "top_level.txt").write_text("qtool_probe_egg_pkg\n")
    monkeypatch.syspath_prepend(str(egg))
    importlib.invalidate_caches()
    assert package_map.packages_distributions()["qtool_probe_egg_pkg"] == ["qtool-probe-egg"]

    for entry in (tmp_path / "cache").glob(package_map.FILE + "-*.json"):
        entry.write_text("{torn")
    assert package_map.packages_distributions() == package_map._ORIGINAL()
    monkeypatch.setenv("QTOOL_CACHE_DIR", "/proc/qtool-cannot-write-here")
    assert package_map.packages_distributions() == package_map._ORIGINAL()


def test_transformers_sees_the_same_distributions_through_the_cache(tmp_path):
    """transformers' import-time map (what its `is_*_available` checks use) is the same with the cache
    installed, on the run that fills it and on the run that reads it."""
    probe = (
        "import sys\n{prepare}\nimport transformers.utils.import_utils as iu\n"
        "import json; print(json.dumps(iu.PACKAGE_DISTRIBUTION_MAPPING, sort_keys=True))\n"
    )
    env = {**os.environ, "QTOOL_CACHE_DIR": str(tmp_path / "cache")}

    def mapping(prepare: str) -> dict:
        r = subprocess.run(
            [sys.executable, "-c", probe.format(prepare=prepare)], capture_output=True, text=True, env=env, timeout=300
        )
        assert r.returncode == 0, r.stderr[-2000:]
        import json

        return json.loads(r.stdout.strip().splitlines()[-1])

    cached = "from qtool.stream.warm_import import skip_unused_imports\nskip_unused_imports()"
    plain = mapping("")
    assert mapping(cached) == plain  # fills the cache
    assert list((tmp_path / "cache").glob("packages-distributions-*.json"))
    assert mapping(cached) == plain  # read from it


def test_the_decoder_module_is_imported_while_the_job_plans(tiny_bf16, tmp_path, monkeypatch, capsys):
    """A quantize that will run starts transformers' decoder-module import before it plans (the H200's cold
    timeline: 9 s of the first layer's start was this import, begun only at the first read-ahead), and the
    plan's tokenizer joins it before its own transformers import; a dry run builds no layer and starts
    none; a plan that fails waits for it before the error leaves (an in-process caller may import
    transformers next)."""
    from qtool.cli.main import main
    from qtool.stream import calib_data, warm_import

    events: list[str] = []
    real_start, real_join, real_load = warm_import.start, warm_import.join, calib_data.load_tokenizer
    monkeypatch.setattr(warm_import, "start", lambda: (events.append("start"), real_start())[1])
    monkeypatch.setattr(warm_import, "join", lambda: (events.append("join"), real_join())[1])
    monkeypatch.setattr(calib_data, "load_tokenizer", lambda d: (events.append("tokenizer"), real_load(d))[1])
    real_skip = warm_import.skip_unused_imports  # the tokenizer's first step toward its transformers import
    monkeypatch.setattr(warm_import, "skip_unused_imports", lambda: (events.append("skip"), real_skip())[1])
    args = [
        "quantize",
        str(tiny_bf16),
        "--recipe",
        "qwen35-nvfp4-experts",
        "--samples",
        "2",
        "--seq-len",
        "16",
        "--json",
    ]

    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path / "cache-1"))  # no cached token ids: the plan tokenizes
    assert main([*args, "-o", str(tmp_path / "dry"), "--dry-run"]) == 0
    assert "start" not in events and "tokenizer" in events
    events.clear()
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path / "cache-2"))
    assert main([*args, "-o", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert events[0] == "start", events
    after = events[events.index("tokenizer") :]
    assert "join" in after and after.index("join") < after.index("skip"), events  # before its own import
    assert list((tmp_path / "out").glob("*.safetensors"))

    events.clear()
    monkeypatch.setattr(warm_import, "_started", None)  # a fresh process's state: nothing imported yet
    assert main([*args, "-o", str(tmp_path / "out")]) != 0  # refused by the plan: the output exists
    capsys.readouterr()
    assert events[0] == "start" and "join" in events, events


HANDOFF_PROBE = """
import json, sys, threading
from qtool.errors import PlanError
from qtool.stream import calib_data, warm_import

seen = []
real = calib_data.load_tokenizer
def load(d):
    seen.append([threading.current_thread().name, warm_import.MODULE in sys.modules])
    return real(d)
calib_data.load_tokenizer = load
warm_import.start()
ids = calib_data.build_calib_set(sys.argv[1], "builtin", 2, 16).ids.tolist()
try:
    calib_data.build_calib_set(sys.argv[2], "builtin", 2, 16)
    error = None
except PlanError as e:
    error = str(e)
warm_import.join()
direct = calib_data.build_calib_set(sys.argv[1], "builtin", 2, 16, tokenizer=real(sys.argv[1])).ids.tolist()
print(json.dumps({"seen": seen, "same": ids == direct, "error": error}))
"""


def test_the_plan_tokenizes_in_the_import_thread_before_the_decoder_module(tmp_path):
    """A streamed job's tokenizer runs in the background import's thread once the tokenizer's modules are
    in, before the decoder module (whose import then overlaps the rest of the plan): the same ids as the
    plan's own thread gives, and a tokenizer error still reaches the plan as its PlanError."""
    import json

    from qtool.fixtures.tokenizer import save_tokenizer_files

    good, bad = tmp_path / "ckpt", tmp_path / "no-tokenizer"
    good.mkdir()
    bad.mkdir()
    save_tokenizer_files(good)
    env = {**os.environ, "QTOOL_CACHE_DIR": str(tmp_path / "cache")}  # no cached ids: both tokenize
    r = subprocess.run(
        [sys.executable, "-c", HANDOFF_PROBE, str(good), str(bad)], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["seen"][0] == ["qtool-warm-import", False], got  # that thread, before the decoder module
    assert got["same"]
    assert got["error"] and "no tokenizer" in got["error"], got


def test_the_distribution_maps_of_old_environments_are_dropped(tmp_path, monkeypatch):
    """Every install into an environment keys a new map; the cache keeps the KEEP_MAPS newest, the one just
    written among them (a day of this project's tests had left ~300)."""
    import os

    from qtool.stream import package_map

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(cache))
    for i in range(12):
        old = cache / f"{package_map.FILE}-old{i:02d}.json"
        old.write_text("{}")
        os.utime(old, ns=(i * 10**9, i * 10**9))  # long ago, oldest first
    assert package_map.packages_distributions() == package_map._ORIGINAL()
    left = sorted(p.name for p in cache.glob(package_map.FILE + "-*.json"))
    assert len(left) == package_map.KEEP_MAPS
    assert [n for n in left if "old" not in n]  # the map just written is kept
    assert f"{package_map.FILE}-old11.json" in left and f"{package_map.FILE}-old00.json" not in left


def _run_python(code: str, timeout: int = 120):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_ctrl_c_while_the_background_thread_tokenizes_stops_the_tokenizing():
    """Found as: with the plan's tokenizing in the import thread, Ctrl-C left the plan only once all of it was
    done (a Hub dataset tokenized as it streams in: minutes, or never on a stalled network). The work is
    told to stop; the way out waits only for the import after it."""
    p = _run_python("""
import os, signal, time
from qtool.stream import warm_import as w
# Python's Ctrl-C handler, even where the test run was started in the background (SIGINT ignored, and
# Python then keeps SIG_IGN)
signal.signal(signal.SIGINT, signal.default_int_handler)
seen = []
def tokenize(stop):
    os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, while this runs
    t = time.monotonic()
    while not stop.is_set() and time.monotonic() - t < 100:
        time.sleep(0.01)
    seen.append(stop.is_set())
    return [1, 2, 3]
try:
    with w.overlapping(True):
        w.before_decoder(tokenize)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted", seen)
""")
    assert p.stdout.strip() == "interrupted [True]", p.stdout + p.stderr


def test_work_handed_to_a_background_thread_that_died_runs_in_the_caller():
    """A background import ended by a BaseException (a SystemExit raised inside an import) never ran the
    work queued for it: its caller waited for ever. It now runs in the caller's thread."""
    p = _run_python(
        """
from qtool.stream import warm_import as w
def boom():
    raise SystemExit("an import called sys.exit")
w.skip_unused_imports = boom
w.start()
print("result", w.before_decoder(lambda stop: 42))
""",
        timeout=120,
    )
    assert "result 42" in p.stdout, p.stdout + p.stderr
