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
    # data, the process's exit, qtool's cache folder.
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
        ("qtool.ops.quantize.schemes", "qtool.formats.fp8"),  # (fp8 imports torch at its top)
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

# NOT DONE YET in editable files (the same rules, the same exactness): qtool's own imports still inside
# functions, and the in-function imports that close the remaining cycles (io: files/index_file/jsonio/
# safetensors_header <-> writer through copy_range; digest_cache <-> manifest; hub: resolve <-> download,
# remote_safetensors, tensor_fetch). Moving one to the top makes its entry fail here: delete the entry.
# Where the imported module imports torch at its top (qtool.formats.nvfp4, fp8, awq), it must import torch
# lazily first, so that `qtool --help` stays without torch.
NOT_YET_IN_FUNCTION = frozenset(
    {
        ("qtool.arch.model_map", "qtool.io.checkpoint"),
        ("qtool.arch.model_map", "qtool.io.reader"),
        ("qtool.build_recipes", "qtool.hub.resolve"),
        ("qtool.build_with", "qtool.formats.naming"),
        ("qtool.build_with", "qtool.io.files"),
        ("qtool.build_with", "qtool.io.writer"),
        ("qtool.build_with", "qtool.ops.assemble.model"),
        ("qtool.build_with", "qtool.ops.patch_config"),
        ("qtool.build_with", "qtool.ops.verify"),
        ("qtool.build_with", "qtool.ops.verify.memory_fit"),
        ("qtool.cli.assemble_cmd", "qtool.hub.resolve"),
        ("qtool.cli.assemble_cmd", "qtool.io.writer"),
        ("qtool.cli.assemble_cmd", "qtool.ops.assemble"),
        ("qtool.cli.assemble_cmd", "qtool.ops.assemble.execute"),
        ("qtool.cli.assemble_cmd", "qtool.ops.assemble.model"),
        ("qtool.cli.build_cmd", "qtool.build_recipes"),
        ("qtool.cli.build_cmd", "qtool.fixtures.builtin"),
        ("qtool.cli.build_cmd", "qtool.ops.pipeline"),
        ("qtool.cli.build_cmd", "qtool.ops.pipeline.plan"),
        ("qtool.cli.build_cmd", "qtool.ops.pipeline.steps"),
        ("qtool.cli.calibrate_kv_cmd", "qtool.ops.calibrate_kv"),
        ("qtool.cli.common", "qtool.dist.launch"),
        ("qtool.cli.common", "qtool.errors"),
        ("qtool.cli.common", "qtool.hub.headers"),
        ("qtool.cli.common", "qtool.hub.resolve"),
        ("qtool.cli.common", "qtool.io.manifest"),
        ("qtool.cli.common", "qtool.stream.warm_import"),
        ("qtool.cli.convert_cmd", "qtool.ops.convert"),
        ("qtool.cli.download_cmd", "qtool.hub.resolve"),
        ("qtool.cli.download_cmd", "qtool.ops.download"),
        ("qtool.cli.eval_cmd", "qtool.ops.kld"),
        ("qtool.cli.inspect_cmd", "qtool.ops.inspect"),
        ("qtool.cli.main", "qtool.cli.common"),
        ("qtool.cli.main", "qtool.dist"),
        ("qtool.cli.main", "qtool.dist.launch"),
        ("qtool.cli.main", "qtool.errors"),
        ("qtool.cli.main", "qtool.io.files"),
        ("qtool.cli.main", "qtool.io.manifest"),
        ("qtool.cli.main", "qtool.io.output"),
        ("qtool.cli.main", "qtool.notices"),
        ("qtool.cli.main", "qtool.process_exit"),
        ("qtool.cli.main", "qtool.quiet"),
        ("qtool.cli.patch_config_cmd", "qtool.errors"),
        ("qtool.cli.patch_config_cmd", "qtool.ops.patch_config"),
        ("qtool.cli.plan_cmd", "qtool.cli.verify_cmd"),
        ("qtool.cli.plan_cmd", "qtool.ops.sensitivity.plan_hybrid"),
        ("qtool.cli.quantize_cmd", "qtool.ops.quantize"),
        ("qtool.cli.quantize_cmd", "qtool.recipes"),
        ("qtool.cli.recipes_cmd", "qtool.build_recipes"),
        ("qtool.cli.recipes_cmd", "qtool.errors"),
        ("qtool.cli.recipes_cmd", "qtool.io.yamlio"),
        ("qtool.cli.recipes_cmd", "qtool.recipes"),
        ("qtool.cli.report_cmd", "qtool.cli.eval_cmd"),
        ("qtool.cli.report_cmd", "qtool.cli.verify_cmd"),
        ("qtool.cli.report_cmd", "qtool.errors"),
        ("qtool.cli.report_cmd", "qtool.ops.kld"),
        ("qtool.cli.report_cmd", "qtool.ops.report"),
        ("qtool.cli.report_cmd", "qtool.ops.report.data"),
        ("qtool.cli.sensitivity_cmd", "qtool.ops.sensitivity"),
        ("qtool.cli.serve_config_cmd", "qtool.cli.verify_cmd"),
        ("qtool.cli.serve_config_cmd", "qtool.hub.headers"),
        ("qtool.cli.serve_config_cmd", "qtool.hub.resolve"),
        ("qtool.cli.serve_config_cmd", "qtool.ops.serve_config"),
        ("qtool.cli.verify_cmd", "qtool.ops.verify"),
        ("qtool.dist", "qtool.process_exit"),
        ("qtool.dist.launch", "qtool.notices"),
        ("qtool.engines.decide", "qtool.engines.patterns"),
        ("qtool.engines.patterns", "qtool.engines.base"),
        ("qtool.fixtures.bf16", "qtool.io.dtypes"),
        ("qtool.fixtures.bf16", "qtool.io.safetensors_header"),
        ("qtool.fixtures.broken", "qtool.io.safetensors_header"),
        ("qtool.fixtures.builtin", "qtool.cache"),
        ("qtool.fixtures.builtin", "qtool.notices"),
        ("qtool.fixtures.proxy", "qtool.fixtures.tokenizer"),
        ("qtool.fixtures.sparse", "qtool.fixtures.tokenizer"),
        ("qtool.fixtures.sparse", "qtool.io.writer"),
        ("qtool.fixtures.synthetic", "qtool.io.dtypes"),
        ("qtool.fixtures.tiny_config", "qtool.io.jsonio"),
        ("qtool.formats.nvfp4_triton", "qtool.cache"),
        ("qtool.hub.download", "qtool.cache"),
        ("qtool.hub.download", "qtool.hub.resolve"),
        ("qtool.hub.download", "qtool.io.output"),
        ("qtool.hub.headers", "qtool.cache"),
        ("qtool.hub.headers", "qtool.hub.download"),
        ("qtool.hub.headers", "qtool.hub.remote_safetensors"),
        ("qtool.hub.headers", "qtool.io.files"),
        ("qtool.hub.headers", "qtool.io.jsonio"),
        ("qtool.hub.headers", "qtool.io.output"),
        ("qtool.hub.headers", "qtool.io.safetensors_header"),
        ("qtool.hub.resolve", "qtool.cache"),
        ("qtool.hub.resolve", "qtool.hub.download"),
        ("qtool.hub.resolve", "qtool.hub.remote_safetensors"),
        ("qtool.hub.resolve", "qtool.hub.tensor_fetch"),
        ("qtool.hub.resolve", "qtool.io.in_place"),
        ("qtool.hub.resolve", "qtool.io.output"),
        ("qtool.hub.tensor_fetch", "qtool.io.apply"),
        ("qtool.hub.tensor_fetch", "qtool.io.checkpoint"),
        ("qtool.hub.tensor_fetch", "qtool.io.manifest"),
        ("qtool.hub.tensor_fetch", "qtool.io.plan"),
        ("qtool.io.digest_cache", "qtool.cache"),
        ("qtool.io.files", "qtool.errors"),
        ("qtool.io.files", "qtool.io.writer"),
        ("qtool.io.identity", "qtool.io.tensor_table"),
        ("qtool.io.index_file", "qtool.io.files"),
        ("qtool.io.jsonio", "qtool.io.files"),
        ("qtool.io.manifest", "qtool.__init__"),
        ("qtool.io.manifest", "qtool.errors"),
        ("qtool.io.manifest", "qtool.io.files"),
        ("qtool.io.manifest", "qtool.io.jsonio"),
        ("qtool.io.manifest", "qtool.io.output"),
        ("qtool.io.manifest", "qtool.io.writer"),
        ("qtool.io.plan", "qtool.errors"),
        ("qtool.io.plan", "qtool.io.checkpoint"),
        ("qtool.io.plan", "qtool.io.safetensors_header"),
        ("qtool.io.plan", "qtool.io.tensor_table"),
        ("qtool.io.plan", "qtool.io.writer"),
        ("qtool.io.safetensors_header", "qtool.io.files"),
        ("qtool.ops.assemble.model", "qtool.io.writer"),
        ("qtool.ops.assemble.patterns", "qtool.engines"),
        ("qtool.ops.assemble.patterns", "qtool.engines.decide"),
        ("qtool.ops.assemble.patterns", "qtool.engines.patterns"),
        ("qtool.ops.assemble.plan", "qtool.arch.model_map"),
        ("qtool.ops.assemble.plan", "qtool.ops.assemble.patterns"),
        ("qtool.ops.calibrate_kv.calibrate", "qtool.formats.fp8"),
        ("qtool.ops.calibrate_kv.calibrate", "qtool.stream.calib_data"),
        ("qtool.ops.calibrate_kv.execute", "qtool.dist"),
        ("qtool.ops.calibrate_kv.plan", "qtool.dist"),
        ("qtool.ops.calibrate_kv.plan", "qtool.io.output"),
        ("qtool.ops.calibrate_kv.plan", "qtool.ops.calibrate_kv.write"),
        ("qtool.ops.calibrate_kv.plan", "qtool.stream.calib_data"),
        ("qtool.ops.calibrate_kv.plan", "qtool.stream.layer_stream"),
        ("qtool.ops.checks", "qtool.errors"),
        ("qtool.ops.checks", "qtool.io.checkpoint"),
        ("qtool.ops.checks", "qtool.io.plan"),
        ("qtool.ops.checks", "qtool.io.quant_config"),
        ("qtool.ops.checks", "qtool.ops.inspect"),
        ("qtool.ops.contract", "qtool.errors"),
        ("qtool.ops.convert", "qtool.__init__"),
        ("qtool.ops.convert", "qtool.formats.naming"),
        ("qtool.ops.convert", "qtool.io.apply"),
        ("qtool.ops.convert", "qtool.io.manifest"),
        ("qtool.ops.convert", "qtool.io.plan"),
        ("qtool.ops.convert", "qtool.io.quant_config"),
        ("qtool.ops.convert", "qtool.ops.inspect"),
        ("qtool.ops.convert", "qtool.ops.quantize.configs"),
        ("qtool.ops.convert", "qtool.recipes"),
        ("qtool.ops.download", "qtool.hub.tensor_fetch"),
        ("qtool.ops.download", "qtool.io.apply"),
        ("qtool.ops.download", "qtool.io.plan"),
        ("qtool.ops.inspect", "qtool.engines"),
        ("qtool.ops.inspect", "qtool.engines.decide"),
        ("qtool.ops.inspect", "qtool.hub.headers"),
        ("qtool.ops.inspect", "qtool.io.reader"),
        ("qtool.ops.inspect", "qtool.ops.verify.mixed_precision"),
        ("qtool.ops.kld.evaluate", "qtool.dist"),
        ("qtool.ops.kld.evaluate", "qtool.io.jsonio"),
        ("qtool.ops.kld.evaluate", "qtool.io.manifest"),
        ("qtool.ops.kld.evaluate", "qtool.io.output"),
        ("qtool.ops.kld.evaluate", "qtool.ops.kld.windows"),
        ("qtool.ops.kld.evaluate", "qtool.stream.calib_data"),
        ("qtool.ops.kld.evaluate", "qtool.stream.warm_import"),
        ("qtool.ops.kld.sources", "qtool.dist"),
        ("qtool.ops.kld.sources", "qtool.stream.dequant"),
        ("qtool.ops.kld.sources", "qtool.stream.layer_stream"),
        ("qtool.ops.kld.sources", "qtool.stream.memory_plan"),
        ("qtool.ops.kld.windows", "qtool.io.files"),
        ("qtool.ops.kld.windows", "qtool.stream.calib_data"),
        ("qtool.ops.patch_config", "qtool.engines.decide"),
        ("qtool.ops.patch_config", "qtool.io.apply"),
        ("qtool.ops.patch_config", "qtool.io.in_place"),
        ("qtool.ops.patch_config", "qtool.io.manifest"),
        ("qtool.ops.patch_config", "qtool.io.output"),
        ("qtool.ops.patch_config", "qtool.ops.inspect"),
        ("qtool.ops.pipeline.plan", "qtool.__init__"),
        ("qtool.ops.pipeline.plan", "qtool.hub.download"),
        ("qtool.ops.pipeline.plan", "qtool.hub.resolve"),
        ("qtool.ops.pipeline.plan", "qtool.io.manifest"),
        ("qtool.ops.pipeline.run", "qtool.io.jsonio"),
        ("qtool.ops.pipeline.steps", "qtool.hub.download"),
        ("qtool.ops.pipeline.steps", "qtool.hub.headers"),
        ("qtool.ops.pipeline.steps", "qtool.hub.resolve"),
        ("qtool.ops.pipeline.steps", "qtool.io.files"),
        ("qtool.ops.pipeline.steps", "qtool.io.output"),
        ("qtool.ops.pipeline.steps", "qtool.io.writer"),
        ("qtool.ops.pipeline.steps", "qtool.ops.assemble.model"),
        ("qtool.ops.report", "qtool.__init__"),
        ("qtool.ops.report", "qtool.hub.headers"),
        ("qtool.ops.report", "qtool.io.checkpoint"),
        ("qtool.ops.report", "qtool.io.files"),
        ("qtool.ops.report", "qtool.io.jsonio"),
        ("qtool.ops.report", "qtool.io.output"),
        ("qtool.ops.report", "qtool.ops.kld"),
        ("qtool.ops.report", "qtool.ops.report.data"),
        ("qtool.ops.report", "qtool.ops.report.page"),
        ("qtool.ops.report", "qtool.ops.sensitivity"),
        ("qtool.ops.report", "qtool.ops.verify"),
        ("qtool.ops.report", "qtool.ops.verify.memory_fit"),
        ("qtool.ops.report.data", "qtool.hub.headers"),
        ("qtool.ops.report.data", "qtool.ops.inspect"),
        ("qtool.ops.report.data", "qtool.ops.serve_config"),
        ("qtool.ops.report.data", "qtool.ops.verify"),
        ("qtool.ops.sensitivity", "qtool.arch.layer_grid"),
        ("qtool.ops.sensitivity", "qtool.arch.model_map"),
        ("qtool.ops.sensitivity", "qtool.dist.launch"),
        ("qtool.ops.sensitivity", "qtool.errors"),
        ("qtool.ops.sensitivity", "qtool.io.apply"),
        ("qtool.ops.sensitivity", "qtool.io.jsonio"),
        ("qtool.ops.sensitivity", "qtool.io.manifest"),
        ("qtool.ops.sensitivity", "qtool.io.output"),
        ("qtool.ops.sensitivity", "qtool.io.plan"),
        ("qtool.ops.sensitivity", "qtool.ops.sensitivity.measure"),
        ("qtool.ops.sensitivity", "qtool.stream.calib_data"),
        ("qtool.ops.sensitivity", "qtool.stream.layer_stream"),
        ("qtool.ops.sensitivity", "qtool.stream.memory_plan"),
        ("qtool.ops.sensitivity.measure", "qtool.io.identity"),
        ("qtool.ops.sensitivity.measure", "qtool.io.output"),
        ("qtool.ops.sensitivity.measure", "qtool.stream.calib_data"),
        ("qtool.ops.sensitivity.plan_hybrid", "qtool.arch.model_map"),
        ("qtool.ops.sensitivity.plan_hybrid", "qtool.findings"),
        ("qtool.ops.sensitivity.plan_hybrid", "qtool.io.checkpoint"),
        ("qtool.ops.sensitivity.plan_hybrid", "qtool.io.jsonio"),
        ("qtool.ops.sensitivity.plan_hybrid", "qtool.io.output"),
        ("qtool.ops.sensitivity.plan_hybrid", "qtool.ops.sensitivity"),
        ("qtool.ops.sensitivity.plan_hybrid", "qtool.ops.sensitivity.units"),
        ("qtool.ops.sensitivity.plan_hybrid", "qtool.ops.verify"),
        ("qtool.ops.sensitivity.plan_hybrid", "qtool.ops.verify.memory_fit"),
        ("qtool.ops.sensitivity.plan_hybrid", "qtool.sizes"),
        ("qtool.ops.sensitivity.units", "qtool.ops.verify.memory_fit"),
        ("qtool.ops.verify", "qtool.arch.model_map"),
        ("qtool.ops.verify", "qtool.arch.qwen35"),
        ("qtool.ops.verify", "qtool.findings"),
        ("qtool.ops.verify", "qtool.io.checkpoint"),
        ("qtool.ops.verify", "qtool.io.quant_config"),
        ("qtool.ops.verify", "qtool.ops.verify.deep"),
        ("qtool.ops.verify", "qtool.ops.verify.engine_rules"),
        ("qtool.ops.verify", "qtool.ops.verify.memory_fit"),
        ("qtool.ops.verify", "qtool.ops.verify.refusals"),
        ("qtool.ops.verify", "qtool.ops.verify.structure"),
        ("qtool.ops.verify.deep", "qtool.io.reader"),
        ("qtool.ops.verify.engine_rules", "qtool.ops.verify.mixed_precision"),
        ("qtool.ops.verify.structure", "qtool.io.jsonio"),
        ("qtool.ops.verify.structure", "qtool.io.safetensors_header"),
        ("qtool.ops.verify.structure", "qtool.ops.checks"),
        ("qtool.ops.verify.structure", "qtool.ops.inspect"),
        ("qtool.quiet", "qtool.stream.warm_import"),
        ("qtool.stream.calib_data", "qtool.errors"),
        ("qtool.stream.calib_data", "qtool.extras"),
        ("qtool.stream.calib_data", "qtool.hub.resolve"),
        ("qtool.stream.calib_data", "qtool.io.plan"),
        ("qtool.stream.calib_data", "qtool.quiet"),
        ("qtool.stream.calib_data", "qtool.stream.warm_import"),
        ("qtool.stream.dequant", "qtool.formats.awq"),
        ("qtool.stream.dequant", "qtool.formats.fp8"),
        ("qtool.stream.dequant", "qtool.formats.nvfp4"),
        ("qtool.stream.dequant", "qtool.io.dtypes"),
        ("qtool.stream.dequant", "qtool.io.input_files"),
        ("qtool.stream.dequant", "qtool.stream.layer_read"),
        ("qtool.stream.package_map", "qtool.cache"),
        ("qtool.stream.package_map", "qtool.errors"),
        ("qtool.stream.package_map", "qtool.io.files"),
        ("qtool.stream.package_map", "qtool.io.jsonio"),
        ("qtool.stream.token_cache", "qtool.cache"),
        ("qtool.stream.token_cache", "qtool.errors"),
        ("qtool.stream.token_cache", "qtool.hub.resolve"),
        ("qtool.stream.token_cache", "qtool.io.files"),
        ("qtool.stream.token_cache", "qtool.io.jsonio"),
        ("qtool.stream.token_cache", "qtool.stream.calib_sources"),
        ("qtool.stream.warm_import", "qtool.stream.kernels"),
        ("qtool.stream.warm_import", "qtool.stream.package_map"),
    }
)
NOT_YET_CYCLES = frozenset(
    {
        ("qtool.hub.download", "qtool.hub.resolve"),
        ("qtool.hub.resolve", "qtool.hub.download"),
        ("qtool.hub.resolve", "qtool.hub.remote_safetensors"),
        ("qtool.hub.resolve", "qtool.hub.tensor_fetch"),
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
