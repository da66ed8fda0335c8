"""qtool's import graph, read from the source with `ast`: every `import` / `from ... import` of a qtool module,
at any depth (inside functions, relative imports too). A newcomer reads the graph from the top of each file:

(a) no cycles among qtool's modules (a cycle is one module in two files: neither can be read, tested or
    imported first on its own);
(b) no import from a lower floor to a higher one (FLOORS below: a floor builds only on the floors under it);
(c) qtool's own modules are imported at the top of the file, never inside a function (a function-local import
    hides a dependency from the reader and from (a) and (b)). Deferred imports stay for torch, transformers,
    triton, the quantization libraries and other heavy third-party modules, so `qtool --help` and the light
    commands start without them (tests/cli/test_cli_basics.py).

Imports under `if TYPE_CHECKING:` run only in a type checker: they count for the floors, not for (a) or (c).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qtool"

# The floors, lowest first: a module may import modules of its own floor or of a floor below it. A name
# covers the module and everything under it.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Base: what every floor uses and that knows nothing of checkpoints: the version (qtool/__init__.py),
    # the error types, redaction of secrets, notices to the user, optional-dependency checks, findings as
    # data, the process's exit, qtool's cache folder, the lazy import of a heavy module (torch).
    (
        "base",
        (
            "qtool.__init__",
            "qtool.errors",
            "qtool.redact",
            "qtool.notices",
            "qtool.extras",
            "qtool.findings",
            "qtool.process_exit",
            "qtool.cache",
            "qtool.sizes",
            "qtool.lazy",
        ),
    ),
    # Formats: pure tensor codecs (NVFP4, FP8, AWQ INT4) and their naming; no file IO, so nothing of io.
    ("formats", ("qtool.formats",)),
    # io: safetensors headers, lazy reads, byte-range copies, the output transaction and its manifest; the
    # local files every higher floor reads and writes.
    ("io", ("qtool.io",)),
    # hub: the Hugging Face Hub as a source: it downloads and fetches tensors through io's output
    # transaction, and io's checkpoint reader never needs it.
    ("hub", ("qtool.hub",)),
    # arch: model-family knowledge as data (Qwen3.5 tensor names, module groups); its model map is built
    # from a checkpoint's headers (io) and names each tensor's format (formats).
    ("arch", ("qtool.arch",)),
    # engines: what vLLM and SGLang do with a checkpoint, read from its model map (arch) and quant config (io).
    ("engines", ("qtool.engines",)),
    # stream: the layer pipeline several ops share (streaming, dequantization, calibration data), the ranks
    # that run it (dist), and the silencing of the producer libraries it drives (quiet joins stream's
    # background transformers import before it touches transformers' logging).
    ("stream", ("qtool.stream", "qtool.dist", "qtool.quiet")),
    # fixtures: tiny checkpoints in every real format, made by the real producers (quietly) and written with
    # io; for the tests and `qtool build`'s builtin demo. No op needs them.
    ("fixtures", ("qtool.fixtures",)),
    # ops: one module or package per operation, and the recipes they run (quantization recipes; build
    # recipes, whose steps' `with:` blocks are the ops' own options).
    ("ops", ("qtool.ops", "qtool.recipes", "qtool.build_recipes", "qtool.build_with")),
    # cli: one module per command: parse flags, call the op, report. Nothing imports it.
    ("cli", ("qtool.cli", "qtool.__main__")),
)

# The shared layer pipeline's remaining violations (qtool/ops/quantize/*, qtool/stream/layer_stream.py,
# qtool/stream/layer_read.py, qtool/io/writer.py), edge by edge (importer, imported): each imports a module
# that imports torch at its top (kept out of `qtool --help` and the plans' --dry-run) or that would close an
# import cycle at the top. Each entry must still be a violation (the test fails on one that is gone).
IN_FUNCTION_EXCEPTIONS = frozenset(
    {
        ("qtool.io.writer", "qtool.io.files"),
        ("qtool.ops.quantize.calib", "qtool.stream.experts"),
        ("qtool.ops.quantize.configs", "qtool.engines"),
        ("qtool.ops.quantize.configs", "qtool.engines.decide"),
        ("qtool.ops.quantize.configs", "qtool.formats.awq"),
        ("qtool.ops.quantize.configs", "qtool.ops.calibrate_kv"),
        ("qtool.ops.quantize.execute", "qtool.ops.quantize.stage"),  # (stage imports torch at its top)
        ("qtool.ops.quantize.layer", "qtool.formats.nvfp4_triton"),
        ("qtool.ops.quantize.plan", "qtool.formats.awq"),
        ("qtool.ops.sensitivity.formats", "qtool.ops.quantize.layer"),  # (layer imports torch at its top)
        ("qtool.stream.layer_read", "qtool.io.dtypes"),
        ("qtool.stream.layer_stream", "qtool.stream.experts"),
    }
)
UPWARD_EXCEPTIONS: frozenset[tuple[str, str]] = frozenset()
# an edge listed here is taken out of the graph before cycles are looked for (each is an in-function import
# that closes a cycle: moved to the top, it would fail at import time)
CYCLE_EXCEPTIONS = frozenset(
    {
        ("qtool.io.writer", "qtool.io.files"),
    }
)

# NOT DONE YET in editable files (the same rules, the same exactness): the in-function imports that close
# the one remaining cycle, io: files -> writer (files' copies use writer.copy_range) -> index_file / jsonio /
# safetensors_header -> files. It goes when copy_range moves down into io.files (writer then imports it from
# there, an edit of io/writer.py, listed above): files stops importing writer, these four imports move to the
# top, and CYCLE_EXCEPTIONS' (writer, files) goes too. Moving one to the top makes its entry fail here.
NOT_YET_IN_FUNCTION = frozenset(
    {
        ("qtool.io.files", "qtool.io.writer"),
        ("qtool.io.index_file", "qtool.io.files"),
        ("qtool.io.jsonio", "qtool.io.files"),
        ("qtool.io.safetensors_header", "qtool.io.files"),
    }
)
NOT_YET_CYCLES = frozenset(
    {
        ("qtool.io.files", "qtool.io.writer"),
        ("qtool.io.index_file", "qtool.io.files"),
        ("qtool.io.jsonio", "qtool.io.files"),
        ("qtool.io.safetensors_header", "qtool.io.files"),
    }
)


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    in_function: bool
    type_only: bool

    def where(self) -> str:
        return f"{self.source} (line {self.line}) imports {self.target}"


def _module_files() -> dict[str, tuple[Path, bool]]:
    """Every qtool module's dotted name -> (file, is a package's __init__). A package's __init__ is named by
    the package (`qtool.engines`), except the top one, which is `qtool.__init__` so that its floor (base)
    does not cover every module under it."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package and len(parts) > 2:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


MODULES = _module_files()


def _canonical(name: str) -> str:
    return "qtool.__init__" if name == "qtool" else name


def _targets(source: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The qtool modules an import statement imports: `from pkg import name` is the module pkg.name where
    one exists, else pkg (name is an attribute of it)."""
    if isinstance(node, ast.Import):
        return [_canonical(a.name) for a in node.names if a.name == "qtool" or a.name.startswith("qtool.")]
    if node.level:
        package = source.removesuffix(".__init__").split(".")
        if not is_package:
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([node.module] if node.module else [])])
    else:
        base = node.module or ""
    if base != "qtool" and not base.startswith("qtool."):
        return []
    out = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        out.append(submodule if submodule in MODULES else _canonical(base))
    return out


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name | ast.Attribute) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def _edges_of(source: str, path: Path, is_package: bool) -> list[Edge]:
    edges: list[Edge] = []

    def walk(node: ast.AST, in_function: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                for target in _targets(source, is_package, child):
                    if target != source:
                        edges.append(Edge(source, target, child.lineno, in_function, type_only))
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            walk(child, inside, type_only or (isinstance(child, ast.If) and _is_type_checking(child)))

    walk(ast.parse(path.read_text(), str(path)), False, False)
    return edges


EDGES = [edge for name, (path, is_package) in MODULES.items() for edge in _edges_of(name, path, is_package)]


def floor_of(module: str) -> int:
    for level, (_name, prefixes) in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{module} is on no floor: add it to FLOORS in {__file__}")


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One cycle through the component's first module, as the modules it passes (a shortest one)."""
    start = component[0]
    members = set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    return [*paths[node], start]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def _runtime_graph(skip: frozenset[tuple[str, str]] = frozenset()) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for edge in EDGES:
        if not edge.type_only and (edge.source, edge.target) not in skip:
            graph[edge.source].add(edge.target)
    return graph


def test_every_module_has_a_floor():
    for name in MODULES:
        floor_of(name)


def test_no_import_cycles():
    cycles = [
        _cycle_in(c, _runtime_graph(CYCLE_EXCEPTIONS | NOT_YET_CYCLES))
        for c in _components(_runtime_graph(CYCLE_EXCEPTIONS | NOT_YET_CYCLES))
    ]
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)
    in_cycles = {m: i for i, c in enumerate(_components(_runtime_graph())) for m in c}
    gone = sorted(e for e in CYCLE_EXCEPTIONS | NOT_YET_CYCLES if in_cycles.get(e[0], -1) != in_cycles.get(e[1], -2))
    assert not gone, f"no longer part of a cycle, remove from CYCLE_EXCEPTIONS / NOT_YET_CYCLES: {gone}"


def test_no_import_from_a_lower_floor_to_a_higher_one():
    upward = [e for e in EDGES if floor_of(e.source) < floor_of(e.target)]
    found = {(e.source, e.target) for e in upward}
    bad = [
        f"{e.where()}: floor {FLOORS[floor_of(e.source)][0]} below {FLOORS[floor_of(e.target)][0]}"
        for e in upward
        if (e.source, e.target) not in UPWARD_EXCEPTIONS
    ]
    assert not bad, "imports from a lower floor to a higher one:\n" + "\n".join(sorted(bad))
    gone = sorted(UPWARD_EXCEPTIONS - found)
    assert not gone, f"no longer an upward import, remove from UPWARD_EXCEPTIONS: {gone}"


def test_qtool_modules_are_imported_at_the_top_of_the_file():
    local = [e for e in EDGES if e.in_function and not e.type_only]
    found = {(e.source, e.target) for e in local}
    allowed = IN_FUNCTION_EXCEPTIONS | NOT_YET_IN_FUNCTION
    bad = sorted({e.where() + " inside a function" for e in local if (e.source, e.target) not in allowed})
    assert not bad, "qtool modules imported inside functions (import them at the top):\n" + "\n".join(bad)
    gone = sorted(allowed - found)
    assert not gone, f"no longer imported inside a function, remove from the exceptions: {gone}"
