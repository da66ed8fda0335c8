"""Open a checkpoint directory reading only headers and configs.

A checkpoint is a directory with `model.safetensors.index.json` + shards, or with one or more
`*.safetensors` files and no index. `Checkpoint.open` validates every header and the index and
returns tensor name -> TensorInfo (file, dtype, shape, absolute byte range) as one column-stored
TensorTable (each shard header's `tensors` is a view of its rows). No tensor data is read.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from qtool.errors import CheckpointError, ConfigError
from qtool.io.index_file import read_index
from qtool.io.jsonio import JsonStyle, load_json
from qtool.io.safetensors_header import SafetensorsHeader, TensorInfo, read_header
from qtool.io.tensor_table import TensorTable, file_of, nbytes_of, no_cyclic_gc

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
GENERATION_CONFIG_NAME = "generation_config.json"


# Set by reuse_opened(): opened checkpoints (and their model maps, qtool.arch.model_map) by key.
_REUSED: ContextVar[dict | None] = ContextVar("qtool_reused_checkpoints", default=None)


# a Hub repository as a model card names it (ORG/NAME); qtool.hub.resolve parses hf: sources by it too
REPO_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def checkpoint_not_found(path: str | Path) -> CheckpointError:
    """The error for a checkpoint path that does not exist; where it is written like a Hub repository
    (ORG/NAME[@REV], as a model card names it), the fix is the hf: source."""
    text = str(path)
    repo = text.partition("@")[0]
    if REPO_NAME.match(repo) and not text.startswith("."):
        hint = f"did you mean hf:{text}? (a Hub repository is named with hf:; a local folder must exist)"
    else:
        hint = "check the path"
    return CheckpointError("checkpoint not found", path=path, hint=hint)


@contextmanager
def reuse_opened() -> Iterator[dict]:
    """A scope in which each checkpoint is opened (headers parsed, model map built) once: for a command
    that looks at one unchanging artifact several ways (`qtool report` runs inspect, verify and
    serve-config's verify per engine: ~1-2 s each on a 397B checkpoint). Nothing may write to the
    checkpoints inside the scope."""
    reused: dict = {}
    token = _REUSED.set(reused)
    try:
        yield reused
    finally:
        _REUSED.reset(token)


def _is_str_list(v: object) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _is_pos_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


_OBJECT = (lambda v: isinstance(v, dict), "an object")
_OBJECT_OR_NULL = (lambda v: v is None or isinstance(v, dict), "an object or null")
_STR = (lambda v: isinstance(v, str), "a string")
_STR_OR_NULL = (lambda v: v is None or isinstance(v, str), "a string or null")
_STR_LIST = (_is_str_list, "a list of strings")
_POS_INT = (_is_pos_int, "a positive integer")
_POS_INT_OR_NULL = (lambda v: v is None or _is_pos_int(v), "a positive integer or null")

# Every config field qtool reads, with the JSON type its producers write (transformers' Qwen3.5 configs,
# compressed-tensors' QuantizationConfig, ModelOpt's hf_quant_config.json): checked when the checkpoint is
# opened, so a wrong type is a named error before any plan.
CONFIG_TYPES = {
    "text_config": _OBJECT,
    "quantization_config": _OBJECT,
    "vision_config": _OBJECT_OR_NULL,
    "architectures": _STR_LIST,
    "model_type": _STR,
}
TEXT_CONFIG_TYPES = {
    "num_hidden_layers": _POS_INT,
    "hidden_size": _POS_INT,
    "num_attention_heads": _POS_INT,
    "num_key_value_heads": _POS_INT,
    "vocab_size": _POS_INT,
    "head_dim": _POS_INT_OR_NULL,
    "num_experts": _POS_INT_OR_NULL,
    "num_experts_per_tok": _POS_INT_OR_NULL,
    "moe_intermediate_size": _POS_INT_OR_NULL,
    "shared_expert_intermediate_size": _POS_INT_OR_NULL,
    "intermediate_size": _POS_INT_OR_NULL,
    "full_attention_interval": _POS_INT_OR_NULL,
    "mtp_num_hidden_layers": (
        lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
        "a non-negative integer or null",
    ),
    "linear_num_key_heads": _POS_INT_OR_NULL,
    "linear_num_value_heads": _POS_INT_OR_NULL,
    "linear_key_head_dim": _POS_INT_OR_NULL,
    "linear_value_head_dim": _POS_INT_OR_NULL,
    "layer_types": _STR_LIST,
    "model_type": _STR,
    "max_position_embeddings": _POS_INT_OR_NULL,
    "rope_parameters": _OBJECT_OR_NULL,
    "rope_scaling": _OBJECT_OR_NULL,
    "tie_word_embeddings": (lambda v: isinstance(v, bool), "true or false"),
}
# each entry of compressed-tensors' config_groups (compressed_tensors/quantization/quant_scheme.py)
CONFIG_GROUP_TYPES = {
    "targets": _STR_LIST,
    "weights": _OBJECT_OR_NULL,
    "input_activations": _OBJECT_OR_NULL,
    "output_activations": _OBJECT_OR_NULL,
    "format": _STR_OR_NULL,
}
# its QuantizationArgs (compressed_tensors/quantization/quant_args.py), for weights and activations
QUANT_ARGS_TYPES = {
    "num_bits": _POS_INT,
    "type": _STR,
    "symmetric": (lambda v: isinstance(v, bool), "true or false"),
    "strategy": _STR_OR_NULL,
    "group_size": _POS_INT_OR_NULL,
    "dynamic": (lambda v: isinstance(v, (bool, str)), 'true, false or a string such as "local"'),
}
QUANT_CONFIG_TYPES = {
    "quant_method": _STR,
    "format": _STR_OR_NULL,
    "config_groups": _OBJECT_OR_NULL,
    "kv_cache_scheme": _OBJECT_OR_NULL,
    "ignore": _STR_LIST,
    "modules_to_not_convert": _STR_LIST,
    "quant_algo": _STR_OR_NULL,
    "kv_cache_quant_algo": _STR_OR_NULL,
    "exclude_modules": _STR_LIST,
    "quantization_status": _STR_OR_NULL,
    "producer": _OBJECT_OR_NULL,
}
HF_QUANT_TYPES = {
    "quant_algo": _STR_OR_NULL,
    "kv_cache_quant_algo": _STR_OR_NULL,
    "exclude_modules": _STR_LIST,
    "ignore": _STR_LIST,
    "group_size": _POS_INT_OR_NULL,
    "producer": _OBJECT_OR_NULL,
}


def _checkpoints_inside(root: Path) -> str:
    """` (here: A, B)`: the folders in `root` that hold shards, for a user who named their parent."""
    inside = sorted(
        d.name for d in root.iterdir() if d.is_dir() and ((d / INDEX_NAME).is_file() or any(d.glob("*.safetensors")))
    )
    return f" (in this folder: {', '.join(inside[:5])}{', ...' if len(inside) > 5 else ''})" if inside else ""


IGNORE_LISTS = ("ignore", "modules_to_not_convert", "exclude_modules")


def check_ignore_patterns(file: Path, prefix: str, obj: dict) -> None:
    """Every `re:` entry of the ignore lists compiles (compressed-tensors' match_name and the engines run
    `re.match` on it, qtool.engines): the one place a bad pattern is caught, for every command that opens
    the checkpoint, as a named error rather than re.error from deep inside a plan."""
    for key in IGNORE_LISTS:
        for i, pattern in enumerate(obj.get(key) or []):
            if isinstance(pattern, str) and pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as e:
                    raise ConfigError(
                        f"{file.name}: {prefix}{key}[{i}] is not a valid regular expression ({e})",
                        path=file,
                        got=pattern[:200],
                        hint=f"fix the pattern in {file.name} (escape literal brackets and dots: "
                        "re:.*mlp\\.gate$), or restore the file from the source repository",
                    ) from None


@dataclass
class Checkpoint:
    root: Path
    tensors: Mapping[str, TensorInfo]  # a TensorTable when opened; any mapping works
    headers: dict[str, SafetensorsHeader]  # shard file name (relative) -> header
    # the parsed index JSON without its weight_map (that is each tensor's file in `tensors`), None for
    # unindexed checkpoints
    index: dict | None
    config: dict | None
    config_style: JsonStyle | None = None
    hf_quant_config: dict | None = None
    hf_quant_style: JsonStyle | None = None
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, path: str | Path, *, require_config: bool = False, check_file_sizes: bool = True) -> Checkpoint:
        """`check_file_sizes=False` reads headers of shards whose data may still be being written.
        Inside `reuse_opened()` the same directory opened the same way gives the same object."""
        memo = _REUSED.get()
        if memo is None:
            return cls._open(path, require_config=require_config, check_file_sizes=check_file_sizes)
        key = ("checkpoint", os.path.abspath(path), require_config, check_file_sizes)
        if key not in memo:
            memo[key] = cls._open(path, require_config=require_config, check_file_sizes=check_file_sizes)
        return memo[key]

    @classmethod
    def _open(cls, path: str | Path, *, require_config: bool, check_file_sizes: bool) -> Checkpoint:
        root = Path(path)
        if not root.exists():
            raise checkpoint_not_found(path)
        if root.is_file():
            if root.suffix != ".safetensors":
                raise CheckpointError("expected a checkpoint directory or a .safetensors file", path=root)
            files = [root.name]
            root = root.parent
            index = by_file = None
        else:
            index_path = root / INDEX_NAME
            if index_path.exists():
                index, by_file = read_index(index_path)
                files = None
            else:
                index = by_file = None
                files = sorted(p.name for p in root.glob("*.safetensors"))
                if not files:
                    raise CheckpointError(
                        "no *.safetensors files and no model.safetensors.index.json",
                        path=root,
                        hint="point at the directory that holds the model's shards" + _checkpoints_inside(root),
                    )
        config = config_style = hq = hq_style = None
        if (root / CONFIG_NAME).exists():
            config, config_style = load_json(root / CONFIG_NAME, what="config.json")
        elif require_config:
            raise CheckpointError("config.json not found", path=root / CONFIG_NAME)
        if (root / HF_QUANT_CONFIG_NAME).exists():
            hq, hq_style = load_json(root / HF_QUANT_CONFIG_NAME, what="hf_quant_config.json")
        cls.check_config_types(root, config, hq, index)

        with no_cyclic_gc():  # ~1M small objects of a 397B header set, none in a cycle
            if index is not None:
                tensors, headers = _load_indexed(root, by_file, check_file_sizes)
            else:
                tensors, headers = _load_files(root, files or [], check_file_sizes)
        return cls(root, tensors, headers, index, config, config_style, hq, hq_style)

    @staticmethod
    def check_config_types(
        root: Path, config: dict | None, hf_quant_config: dict | None, index: dict | None = None
    ) -> None:
        """The config values qtool relies on have the JSON types the producers write; anything else is a
        clear error naming the file and the key (not a TypeError deep inside a plan, and not a wrong value
        carried into an output). The table is CONFIG_TYPES below."""

        def check(file: str, obj: dict, prefix: str, rules: dict) -> None:
            for key, (ok, want) in rules.items():
                if key in obj and not ok(obj[key]):
                    got = obj[key]
                    raise ConfigError(
                        f"{file}: {prefix}{key} must be {want}",
                        path=root / file,
                        got=f"{type(got).__name__} {got!r}"[:200],
                        hint=f"fix {prefix}{key} in {file} (or restore the file from the source repository)",
                    )

        if config is not None:
            check(CONFIG_NAME, config, "", CONFIG_TYPES)
            text = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
            check(CONFIG_NAME, text or config, "text_config." if text else "", TEXT_CONFIG_TYPES)
            qc = config.get("quantization_config")
            if qc is not None:
                check(CONFIG_NAME, qc, "quantization_config.", QUANT_CONFIG_TYPES)
                groups = qc.get("config_groups") or {}
                for name, g in groups.items():
                    where = f"quantization_config.config_groups.{name}"
                    check(CONFIG_NAME, {name: g}, "quantization_config.config_groups.", {name: _OBJECT})
                    check(CONFIG_NAME, g, where + ".", CONFIG_GROUP_TYPES)
                    for part in ("weights", "input_activations", "output_activations"):
                        if isinstance(g.get(part), dict):
                            check(CONFIG_NAME, g[part], f"{where}.{part}.", QUANT_ARGS_TYPES)
                kv = qc.get("kv_cache_scheme")
                if isinstance(kv, dict):
                    check(CONFIG_NAME, kv, "quantization_config.kv_cache_scheme.", QUANT_ARGS_TYPES)
            if isinstance(qc, dict):
                check_ignore_patterns(root / CONFIG_NAME, "quantization_config.", qc)
        if hf_quant_config is not None:
            check(HF_QUANT_CONFIG_NAME, hf_quant_config, "", {"quantization": _OBJECT})
            nested = hf_quant_config.get("quantization")
            body: dict = nested if isinstance(nested, dict) else hf_quant_config
            check(HF_QUANT_CONFIG_NAME, body, "quantization." if body is not hf_quant_config else "", HF_QUANT_TYPES)
            check_ignore_patterns(
                root / HF_QUANT_CONFIG_NAME, "quantization." if body is not hf_quant_config else "", body
            )
        if index is not None:
            check(INDEX_NAME, index, "", {"metadata": _OBJECT_OR_NULL})

    # ---- conveniences -------------------------------------------------------------------------
    @property
    def text_config(self) -> dict:
        cfg = self.config or {}
        return cfg.get("text_config", cfg)

    @property
    def quantization_config(self) -> dict | None:
        return (self.config or {}).get("quantization_config")

    def total_bytes(self) -> int:
        by_column = getattr(self.tensors, "total_bytes", None)  # a TensorTable: no TensorInfo per tensor
        return by_column() if by_column is not None else sum(t.nbytes for t in self.tensors.values())

    def weight_map(self) -> dict[str, str]:
        """name -> shard file name of every tensor, as an index's weight_map: one name per shard, not a
        lookup per tensor (~370k for the 397B)."""
        out: dict[str, str] = {}
        for h in self.headers.values():  # in the table's order: a name in two shards maps to the later one
            out.update(dict.fromkeys(h.tensors, os.path.basename(h.path)))
        return out

    def tensor_bytes(self, name: str) -> int:
        """A tensor's byte count (from the table's columns where there is one: no TensorInfo made)."""
        return nbytes_of(self.tensors, name)

    def shard_of(self, name: str) -> str:
        return os.path.basename(file_of(self.tensors, name))  # no TensorInfo: plans ask it of many tensors


def check_checkpoint_dir(
    path: str | Path, flag: str, *, hint: str | None = None, missing: str = "checkpoint not found"
) -> None:
    """`path` (given as `flag`) is a checkpoint directory: config.json and safetensors shards (an index or
    *.safetensors files). A named error before a plan names a file such as /etc/passwd as a source."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"{flag}: {missing}", path=root, hint=hint or "check the path")
    if not root.is_dir():
        raise CheckpointError(
            f"{flag}: not a checkpoint directory (a file)",
            path=root,
            hint=hint or "pass the directory that holds config.json and the *.safetensors shards",
        )
    if not (root / CONFIG_NAME).is_file() or not ((root / INDEX_NAME).is_file() or any(root.glob("*.safetensors"))):
        raise CheckpointError(
            f"{flag}: not a checkpoint directory (no config.json and *.safetensors shards)",
            path=root,
            hint=hint or "pass the directory that holds config.json and the shards",
        )


def _safe_shard_path(root: Path, rel: str, index_path: Path) -> Path:
    """Refuse index entries that escape the checkpoint directory (absolute, '..', symlink outside)."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in Path(rel).parts:
        raise CheckpointError(
            "index names a shard outside the checkpoint directory",
            path=index_path,
            got=rel,
            hint="shard names in weight_map must be plain file names inside the directory",
        )
    p = root / rel
    real_root = Path(os.path.realpath(root))
    target = Path(os.path.realpath(p))  # not Path.resolve(): a symlink loop is read_header's named error
    if real_root not in target.parents and not _in_hf_cache_blobs(root, target):
        raise CheckpointError(
            "index names a shard that resolves outside the checkpoint directory (symlink)",
            path=index_path,
            got=f"{rel} -> {target}",
            hint="replace the symlink by the file itself, or by a link inside the directory",
        )
    return p


def _in_hf_cache_blobs(root: Path, target: Path) -> bool:
    """huggingface_hub cache snapshots (models--ORG--NAME/snapshots/<commit>/) hold symlinks into the
    same repo's blobs/ folder (huggingface_hub file_download.py, `_create_symlink`): those are inside."""
    if root.parent.name != "snapshots":
        return False
    blobs = (root.parent.parent / "blobs").resolve()
    return target.parent == blobs


def _load_indexed(
    root: Path, by_file: dict[str, list[str]] | None, check_file_sizes: bool = True
) -> tuple[TensorTable, dict[str, SafetensorsHeader]]:
    """`by_file`: the index's weight_map as shard -> names (qtool.io.index_file). Each shard's names are
    dropped as soon as it is validated, so they never coexist in full with the table's own (the table
    says which shard holds each tensor)."""
    index_path = root / INDEX_NAME
    if not by_file:
        raise CheckpointError("index has no weight_map", path=index_path, hint="the index is corrupt; re-download it")
    headers: dict[str, SafetensorsHeader] = {}
    tensors = TensorTable()
    for rel in sorted(by_file):
        shard = _safe_shard_path(root, rel, index_path)
        if not os.path.lexists(shard):
            raise CheckpointError(
                f"index names a shard that does not exist ({len(by_file[rel])} tensors)",
                path=shard,
                hint="the download is incomplete; fetch the missing shard",
            )
        header = read_header(shard, check_file_size=check_file_sizes)
        h = header.tensors
        for name in by_file[rel]:
            if name not in h:
                raise CheckpointError(
                    "index maps a tensor to a shard that does not contain it",
                    path=root / rel,
                    tensor=name,
                    hint="the index and the shards come from different revisions; re-download both",
                )
        if len(h) != len(by_file[rel]):
            mapped = set(by_file[rel])
            extra = [n for n in h if n not in mapped]
            raise CheckpointError(
                f"shard holds {len(extra)} tensor(s) the index does not map to it",
                path=root / rel,
                tensor=extra[0] if extra else None,
                hint="the index and the shards come from different revisions; re-download both",
            )
        del by_file[rel]
        headers[rel] = merge_header(tensors, header)
    return tensors, headers


def _load_files(
    root: Path, files: list[str], check_file_sizes: bool = True
) -> tuple[TensorTable, dict[str, SafetensorsHeader]]:
    tensors = TensorTable()
    headers: dict[str, SafetensorsHeader] = {}
    for rel in files:
        try:
            rel.encode("utf-8")
        except UnicodeEncodeError:
            raise CheckpointError(
                "a shard's file name is not UTF-8",
                path=root / rel.encode("utf-8", "replace").decode(),
                got=ascii(rel),
                hint="rename the file (safetensors indexes and the engines use UTF-8 names)",
            ) from None
        header = read_header(root / rel, check_file_size=check_file_sizes)
        for name in header.tensors:
            if name in tensors:
                raise CheckpointError(
                    "tensor appears in two shards and there is no index to choose",
                    path=root / rel,
                    tensor=name,
                    hint=f"also in {os.path.basename(tensors[name].file)}; remove the stray shard",
                )
        headers[rel] = merge_header(tensors, header)
    return tensors, headers


def merge_header(table: TensorTable, header: SafetensorsHeader) -> SafetensorsHeader:
    """Append the shard's rows to the checkpoint's table; the header keeps a view of them (and the shard's
    own table, with its per-row objects, is dropped)."""
    rows = table.extend(cast(TensorTable, header.tensors))  # (a header just read holds a table of its own)
    return dataclasses.replace(header, tensors=table.slice(rows))
