"""`qtool patch-config`: named, idempotent fixes to config.json, hf_quant_config.json and
generation_config.json, each written in the schema the file really uses, atomically, with a diff.

Every fix edits copies of the three files; `apply` writes only files that changed (temp + rename).
A fix that does not apply to this checkpoint says why and changes nothing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from qtool.arch.model_map import Format, ModelMap, build_map
from qtool.arch.qwen35 import Group
from qtool.engines import Flavour
from qtool.engines.decide import ignore_patterns_for
from qtool.errors import ConfigError, UsageError, WriteError
from qtool.io import quant_config as qcfg
from qtool.io.apply import OutputJob, write_output
from qtool.io.checkpoint import CONFIG_NAME, GENERATION_CONFIG_NAME, HF_QUANT_CONFIG_NAME, Checkpoint
from qtool.io.in_place import InPlaceDir
from qtool.io.jsonio import JsonStyle, dumps, load_json, unified_diff
from qtool.io.manifest import previous_head, read_manifest
from qtool.io.output import MANIFEST_NAME, OutputDir
from qtool.io.plan import Json, OutputPlan, unchanged_files
from qtool.ops.contract import Report
from qtool.ops.inspect import kv_scheme_strategy

# The router pattern. The field report (docs/formats.md §6, §12) uses "model.language_model.layers..mlp.gate", but
# the real matching code of vLLM 0.33.0 and SGLang 0.5.23 (modelopt.py is_layer_excluded; checked with
# tests/engines/test_oracle.py) matches nothing with it: the double dot never occurs in a mapped name.
# "*.mlp.gate" is an fnmatch/glob full match on every layer's router in both engines and cannot reach
# mlp.gate_up_proj or mlp.shared_expert_gate. Newer vLLM hard-codes the router as BF16 (PR 35156);
# older vLLM (0.16) needs this entry.
ROUTER_GLOB = "*.mlp.gate"
SEED_ROUTER_LITERAL = "model.language_model.layers..mlp.gate"
ROUTER_REGEX = r"re:.*\.mlp\.gate$"  # compressed-tensors ignore entries are exact names or `re:` regexes
MTP_FC_GLOB, MTP_ALL_GLOB = "mtp.fc", "mtp*"
MTP_FC_REGEX, MTP_ALL_REGEX = r"re:^mtp\.fc$", r"re:^mtp.*"

# The Qwen3.5 model card's sampling values (docs/formats.md §12).
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}


class Fix(str, Enum):
    ROUTER_IGNORE = "router-ignore"
    MTP_IGNORE = "mtp-ignore"
    IGNORE_FROM_TENSORS = "ignore-from-tensors"
    KV_SCHEME_FROM_TENSORS = "kv-scheme-from-tensors"


@dataclass
class ConfigFile:
    name: str
    original: dict | None
    style: JsonStyle
    data: dict | None

    @property
    def changed(self) -> bool:
        return self.data != self.original

    def diff(self) -> str:
        old = "" if self.original is None else dumps(self.original, self.style)
        new = "" if self.data is None else dumps(self.data, self.style)
        return unified_diff(old, new, self.name)


@dataclass
class FixResult:
    fix: str
    applied: bool
    message: str


@dataclass
class PatchPlan:
    root: Path
    files: dict[str, ConfigFile]
    results: list[FixResult] = field(default_factory=list)
    options: PatchOptions | None = None

    @property
    def changed(self) -> bool:
        return any(f.changed for f in self.files.values())

    def output(self) -> OutputPlan:
        """The patched checkpoint as data: the changed files (Json in each file's own formatting). In place
        the rest stays as it is (qtool.io.in_place.InPlaceDir links every other file); with -o the other
        files are Links."""
        changed = [f for f in self.files.values() if f.changed and f.data is not None]
        files: list = []
        if self.options is not None and self.options.out is not None:
            files += unchanged_files(self.root, {f.name for f in changed})
        files += [Json(f.name, f.data, f.style) for f in changed]
        return OutputPlan(
            "patch-config",
            files,
            sources={"checkpoint": self.root},
            inputs=[str(self.root / f.name) for f in changed if (self.root / f.name).is_file()],
            summary={"fixes": [r.__dict__ for r in self.results], "written": [f.name for f in changed]},
            extra=self._kept_sections(),
        )

    def _kept_sections(self) -> dict:
        """Every tensor stays as it was: the input manifest's tensor origins (`shards`, assemble's) still
        describe the output, and its head says what made it (in place the executor records it)."""
        try:
            shards = read_manifest(self.root / MANIFEST_NAME).get("shards")
        except (OSError, ValueError):
            shards = None
        out = {}
        if self.options is not None and self.options.out is not None and previous_head(self.root):
            out["previous"] = previous_head(self.root)
        if shards:
            out["shards"] = shards
        return out

    def to_json(self) -> dict:
        return {
            "checkpoint": str(self.root),
            "fixes": [r.__dict__ for r in self.results],
            "files": {n: {"changed": f.changed, "diff": f.diff()} for n, f in self.files.items()},
        }


def _load_optional(root: Path, name: str) -> ConfigFile:
    path = root / name
    if path.exists():
        data, style = load_json(path, what=name)
        return ConfigFile(name, data, style, copy.deepcopy(data))
    return ConfigFile(name, None, JsonStyle(indent=2), None)


class _IgnoreLists:
    """The exclusion lists of both files, each with its pattern dialect."""

    def __init__(self, files: dict[str, ConfigFile]):
        self.config = files[CONFIG_NAME].data
        self.hq = files[HF_QUANT_CONFIG_NAME].data
        qc = (self.config or {}).get("quantization_config")
        self.config_quantized = isinstance(qc, dict)
        self.config_regex = self.config_quantized and qc.get("quant_method") == "compressed-tensors"

    @property
    def any(self) -> bool:
        return self.config_quantized or self.hq is not None

    def add(self, glob: str, regex: str) -> list[str]:
        """Add the pattern (in each file's dialect) where missing; returns what was added, per file."""
        added = []
        if self.config_quantized:
            pat = regex if self.config_regex else glob
            lst = qcfg.config_ignore(self.config) or []
            if pat not in lst:
                qcfg.set_config_ignore(self.config, lst + [pat])
                added.append(f"{CONFIG_NAME}: {pat}")
        if self.hq is not None:
            lst = qcfg.hf_quant_exclude(self.hq) or []
            if glob not in lst:
                qcfg.set_hf_quant_exclude(self.hq, lst + [glob])
                added.append(f"{HF_QUANT_CONFIG_NAME}: {glob}")
        return added

    def remove(self, pattern: str) -> list[str]:
        removed = []
        if self.config_quantized:
            lst = qcfg.config_ignore(self.config) or []
            if pattern in lst:
                qcfg.set_config_ignore(self.config, [p for p in lst if p != pattern])
                removed.append(CONFIG_NAME)
        if self.hq is not None:
            lst = qcfg.hf_quant_exclude(self.hq) or []
            if pattern in lst:
                qcfg.set_hf_quant_exclude(self.hq, [p for p in lst if p != pattern])
                removed.append(HF_QUANT_CONFIG_NAME)
        return removed

    @property
    def flavours(self) -> tuple[Flavour, ...]:
        """The pattern dialects `replace` writes: ModelOpt's globs, compressed-tensors' `re:` patterns."""
        out = []
        if self.hq is not None or (self.config_quantized and not self.config_regex):
            out.append(Flavour.MODELOPT)
        if self.config_quantized and self.config_regex:
            out.append(Flavour.COMPRESSED_TENSORS)
        return tuple(out)

    def replace(self, globs: list[str], regexes: list[str]) -> None:
        if self.config_quantized:
            qcfg.set_config_ignore(self.config, regexes if self.config_regex else globs)
        if self.hq is not None:
            qcfg.set_hf_quant_exclude(self.hq, globs)


@dataclass(frozen=True)
class PatchOptions:
    """patch-config's options: the one place their defaults live (CLI, build steps, library)."""

    checkpoint: Path
    fixes: tuple = ()  # Fix values (strings from a recipe are accepted)
    ignore_add: tuple = ()
    ignore_remove: tuple = ()
    yarn: float | None = None
    original_max_position: int | None = None
    sampling_defaults: bool = False
    out: Path | None = None  # -o: a patched copy (unchanged files linked); None: the checkpoint in place
    force: bool = False
    resume: bool = False
    command: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fixes", tuple(Fix(f) for f in self.fixes))


def plan(opts: PatchOptions) -> PatchPlan:
    fixes, ignore_add, ignore_remove = opts.fixes, opts.ignore_add, opts.ignore_remove
    yarn, original_max_position, sampling_defaults = opts.yarn, opts.original_max_position, opts.sampling_defaults
    root = Path(opts.checkpoint)
    files = {n: _load_optional(root, n) for n in (CONFIG_NAME, HF_QUANT_CONFIG_NAME, GENERATION_CONFIG_NAME)}
    if files[CONFIG_NAME].data is None:
        raise ConfigError("config.json not found", path=root / CONFIG_NAME, hint="point at a model directory")
    p = PatchPlan(root, files, options=opts)
    mm: ModelMap | None = None
    if opts.out is not None:
        # a copy must hold every shard: read their headers now (a missing, truncated, FIFO or non-file
        # shard is a named error here, not a copy that silently lacks it)
        Checkpoint.open(root)

    def model_map() -> ModelMap:
        nonlocal mm
        if mm is None:
            mm = build_map(Checkpoint.open(root))
        return mm

    lists = _IgnoreLists(files)
    for fix in fixes:
        if fix is Fix.ROUTER_IGNORE:
            p.results.append(_router_ignore(lists))
        elif fix is Fix.MTP_IGNORE:
            p.results.append(_mtp_ignore(lists, model_map()))
        elif fix is Fix.IGNORE_FROM_TENSORS:
            p.results.append(_ignore_from_tensors(lists, model_map()))
        elif fix is Fix.KV_SCHEME_FROM_TENSORS:
            p.results.append(_kv_scheme_from_tensors(files[CONFIG_NAME].data, model_map()))
    for pat in ignore_add:
        p.results.append(_ignore_add(lists, pat))
    for pat in ignore_remove:
        removed = lists.remove(pat)
        msg = f"removed {pat!r} from {', '.join(removed)}" if removed else f"{pat!r} is in no exclusion list"
        p.results.append(FixResult("ignore-remove", bool(removed), msg))
    if yarn is not None:
        p.results.append(_yarn(files[CONFIG_NAME].data, yarn, original_max_position))
    if sampling_defaults:
        p.results.append(_sampling(files[GENERATION_CONFIG_NAME]))
    return p


def apply(p: PatchPlan, *, command: str | None = None) -> list[str]:
    """Write the changed files; returns their names. In place, the checkpoint changes as a whole: its new
    state is built beside it and swapped in (qtool.io.in_place.InPlaceDir); with -o OUT a new checkpoint is
    built in OUT.partial/ (qtool.io.output.OutputDir). Both are written by the shared executor
    (qtool.io.apply), so a kill never leaves config.json and hf_quant_config.json disagreeing."""
    opts = p.options or PatchOptions(p.root)
    command = command if command is not None else opts.command
    output = p.output()
    written = [e.name for e in output.entries(Json)]
    if opts.out is not None:
        with OutputDir(opts.out, sources=[p.root], force=opts.force, resume=opts.resume) as tx:
            write_output(output, tx, OutputJob(command=command))
        return written
    if not written:
        InPlaceDir.tidy(p.root)
        return []
    with InPlaceDir(p.root, keep_partial=False) as tx:
        # the plan read the configs before the lock: another run may have changed them since
        for f in p.files.values():
            path = p.root / f.name
            now = load_json(path)[0] if path.exists() else None
            if now != f.original:
                raise WriteError(
                    "the checkpoint's config changed while this run was planning",
                    path=path,
                    hint="run the command again (it re-reads the current files)",
                )
        write_output(output, tx, OutputJob(command=command))
    return written


def execute(p: PatchPlan) -> Report:
    """The op contract's execute: apply the plan in place (atomically); the report is the plan plus the
    files written."""
    return Report({**p.to_json(), "written": apply(p)})


def _ignore_add(lists: _IgnoreLists, pattern: str) -> FixResult:
    if not lists.any:
        return FixResult("ignore-add", False, "the checkpoint is not quantized: there is no exclusion list")
    # A user pattern is taken as written for both files (glob for ModelOpt lists; a `re:` entry is
    # only meaningful in a compressed-tensors ignore list).
    added = lists.add(pattern, pattern)
    return FixResult("ignore-add", bool(added), f"added {added}" if added else f"{pattern!r} already present")


def _router_ignore(lists: _IgnoreLists) -> FixResult:
    if not lists.any:
        return FixResult(Fix.ROUTER_IGNORE.value, False, "not quantized: the router is BF16 already")
    added = lists.add(ROUTER_GLOB, ROUTER_REGEX)
    return FixResult(Fix.ROUTER_IGNORE.value, bool(added), f"added {added}" if added else "already excluded")


def _mtp_ignore(lists: _IgnoreLists, mm: ModelMap) -> FixResult:
    mtp = [m for m in mm.modules.values() if m.group is Group.MTP and m.format is not None]
    if not mtp:
        return FixResult(Fix.MTP_IGNORE.value, False, "the checkpoint has no MTP head (no mtp.* tensors)")
    if not lists.any:
        return FixResult(Fix.MTP_IGNORE.value, False, "not quantized: the MTP head is BF16 already")
    all_bf16 = all(m.format is Format.BF16 for m in mtp)
    added = lists.add(MTP_ALL_GLOB, MTP_ALL_REGEX) if all_bf16 else lists.add(MTP_FC_GLOB, MTP_FC_REGEX)
    what = "the whole MTP head is BF16" if all_bf16 else "mtp.fc only (parts of the MTP head are quantized)"
    return FixResult(
        Fix.MTP_IGNORE.value, bool(added), f"{what}: " + (f"added {added}" if added else "already excluded")
    )


def _ignore_from_tensors(lists: _IgnoreLists, mm: ModelMap) -> FixResult:
    if not lists.any:
        return FixResult(Fix.IGNORE_FROM_TENSORS.value, False, "not quantized: nothing to exclude")

    # only the dialects this checkpoint's lists use: each list is verified against every engine release
    made = dict(zip(lists.flavours, ignore_patterns_for(mm, lists.flavours), strict=True))
    globs, regexes = made.get(Flavour.MODELOPT, []), made.get(Flavour.COMPRESSED_TENSORS, [])
    before = (qcfg.config_ignore(lists.config), qcfg.hf_quant_exclude(lists.hq))
    lists.replace(globs, regexes)
    after = (qcfg.config_ignore(lists.config), qcfg.hf_quant_exclude(lists.hq))
    changed = before != after
    return FixResult(
        Fix.IGNORE_FROM_TENSORS.value,
        changed,
        f"exclusion lists now say exactly which modules are BF16: {globs or regexes}" if changed else "already exact",
    )


def _kv_scheme_from_tensors(config: dict, mm: ModelMap) -> FixResult:
    """compressed-tensors `kv_cache_scheme.strategy` as the KV-scale tensors are: "attn_head" for
    [num_kv_heads] scales (vllm PR 30141), "tensor" for scalars."""
    want = kv_scheme_strategy(mm, qcfg.summarize(config, None))
    if want is None:
        return FixResult(
            Fix.KV_SCHEME_FROM_TENSORS.value,
            False,
            "nothing to correct: no compressed-tensors kv_cache_scheme with KV scales, or its strategy "
            "already matches them",
        )
    scheme = config["quantization_config"]["kv_cache_scheme"]
    old, scheme["strategy"] = scheme.get("strategy"), want
    return FixResult(Fix.KV_SCHEME_FROM_TENSORS.value, True, f"kv_cache_scheme.strategy {old!r} -> {want!r}")


def _yarn(config: dict, factor: float, original: int | None) -> FixResult:
    """YaRN rope scaling as the field report's --hf-overrides does (docs/formats.md §12), keeping the mrope settings."""
    if factor <= 1:
        raise UsageError("--yarn FACTOR must be greater than 1", got=factor)
    text = config.get("text_config", config)
    rope = dict(text.get("rope_parameters") or {})
    if original is None:
        # Re-applying keeps the first original length, so the fix is idempotent.
        original = rope.get("original_max_position_embeddings") or text.get("max_position_embeddings")
    if not original:
        raise ConfigError("config has no max_position_embeddings; pass --original-max-position N")
    rope.update({"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)})
    new_max = int(original * factor)
    changed = text.get("rope_parameters") != rope or text.get("max_position_embeddings") != new_max
    text["rope_parameters"] = rope
    text["max_position_embeddings"] = new_max
    return FixResult("yarn", changed, f"YaRN factor {factor:g} over {original} -> max_position_embeddings {new_max}")


def _sampling(gen: ConfigFile) -> FixResult:
    if gen.data is None:
        gen.data = {}
    before = dict(gen.data)
    gen.data.update(SAMPLING_DEFAULTS)
    return FixResult("sampling-defaults", gen.data != before, f"generation_config.json: {SAMPLING_DEFAULTS}")
