"""Plan a hybrid assembly (docs/formats.md §7) from headers and configs only.

The plan says, for every output shard, whether it is the NVFP4 source's shard unchanged (linked), rebuilt
from byte ranges under its own name, or new; and for every output tensor where its bytes come from. Fused
BF16 routed experts are split into the per-expert layout by byte ranges: in `experts.gate_up_proj`
[E, 2I, H] expert e's gate rows are the contiguous bytes [e*2I*H, e*2I*H + I*H) and its up rows the next
I*H elements; `experts.down_proj` [E, H, I] holds expert e's [H, I] matrix contiguously (row-major).
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path

from qtool.arch.model_map import QUANTIZED_FORMATS, Format, build_map
from qtool.arch.qwen35 import MTP_PREFIX, TEXT_PREFIX, Group, Naming, engine_module
from qtool.errors import CheckpointError, PlanError, UsageError
from qtool.io.checkpoint import HF_QUANT_CONFIG_NAME, Checkpoint
from qtool.io.dtypes import DTYPE_BITS, FLOAT_DTYPES
from qtool.io.files import LinkMode
from qtool.io.output import check_no_overlap
from qtool.io.quant_config import config_ignore, hf_quant_exclude
from qtool.io.safetensors_header import TensorInfo
from qtool.io.writer import plan_shards
from qtool.ops.assemble.model import (
    NEW_SHARD_TEMPLATE,
    SKIP_DIRS,
    SKIP_FILES,
    HybridOptions,
    HybridPlan,
    MtpMode,
    Origin,
    PlannedShard,
    PlannedTensor,
    ShardAction,
    natural_key,
)
from qtool.ops.assemble.patterns import updated_configs
from qtool.ops.assemble.validate import ArchShapes, check_bf16_tensor, check_mtp_complete, check_same_model

# ---- planning ------------------------------------------------------------------------------------


def _origin(
    source: str, info: TensorInfo, sl: str | None = None, start: int | None = None, nbytes: int | None = None
) -> Origin:
    s = info.start if start is None else start
    e = info.end if nbytes is None else s + nbytes
    return Origin(source, info.file, info.name, s, e, sl)


def _whole(source: str, name: str, info: TensorInfo) -> PlannedTensor:
    return PlannedTensor(name, info.dtype, info.shape, _origin(source, info))


PROJS = ("gate_proj", "up_proj", "down_proj")


class _Planner:
    def __init__(self, opts: HybridOptions) -> None:
        self.opts = opts
        self.nv = Checkpoint.open(opts.nvfp4, require_config=True)
        self.bf = Checkpoint.open(opts.bf16)
        check_same_model(self.nv, self.bf)
        self.nv_map = build_map(self.nv)
        self.bf_map = build_map(self.bf)
        self.expect = ArchShapes(self.nv.text_config, self.nv.root)
        self.removed: set[str] = set()
        # additions: (home NVFP4 shard or None, tensor)
        self.additions: list[tuple[str | None, PlannedTensor]] = []
        self.missing: list[str] = []
        self.warnings: list[str] = []
        self.bf16_units: set[str] = set()
        # NVFP4 tensor names per layer: the per-layer removals below would otherwise scan all ~370k
        # roles of a 397B checkpoint once per layer
        self.names_by_layer: dict[int | None, list[str]] = {}
        for n, r in self.nv_map.roles.items():
            self.names_by_layer.setdefault(r.layer, []).append(n)

    # name translation: the output uses the NVFP4 source's naming
    def bf_name(self, out_name: str) -> str:
        a, b = TEXT_PREFIX[self.nv_map.naming], TEXT_PREFIX[self.bf_map.naming]
        return b + out_name[len(a) :] if a != b and out_name.startswith(a) else out_name

    def out_name(self, bf_name: str) -> str:
        a, b = TEXT_PREFIX[self.bf_map.naming], TEXT_PREFIX[self.nv_map.naming]
        return b + bf_name[len(a) :] if a != b and bf_name.startswith(a) else bf_name

    def flavour(self) -> str:
        fmts = {m.format for m in self.nv_map.modules.values() if m.format in QUANTIZED_FORMATS}

        if Format.NVFP4_CT in fmts:
            return "compressed-tensors"
        if Format.NVFP4 in fmts:
            return "modelopt"
        raise PlanError(
            "the --nvfp4 source holds no NVFP4 modules",
            path=self.nv.root,
            got=sorted(f.value for f in fmts) or "no quantized modules",
            hint="pass an NVFP4 checkpoint (ModelOpt or compressed-tensors naming)",
        )

    def home_of(self, names: list[str]) -> str | None:
        homes = sorted((self.nv.shard_of(n) for n in names if n in self.nv.tensors), key=natural_key)
        return homes[0] if homes else None

    def remove_where(self, pred, layer: int | None = None) -> list[str]:
        """Remove the NVFP4 tensors whose role satisfies `pred` (only among `layer`'s when given)."""
        roles = self.nv_map.roles
        names = roles if layer is None else self.names_by_layer.get(layer, [])
        gone = sorted((n for n in names if pred(roles[n])), key=natural_key)
        self.removed.update(gone)
        return gone

    def add(self, home: str | None, t: PlannedTensor) -> None:
        self.additions.append((home, t))

    def bf_info(self, name: str) -> TensorInfo | None:
        info = self.bf.tensors.get(self.bf_name(name))
        if info is None:
            self.missing.append(self.bf_name(name))
        return info

    # ---- the three kinds of replacement ----------------------------------------------------------
    def shared_experts(self) -> None:
        prefix = TEXT_PREFIX[self.nv_map.naming]
        modules = self.nv_map.modules
        already = [m for m in modules.values() if m.group is Group.SHARED_EXPERT and m.format is Format.BF16]
        splices = self.opts.bf16_shared_expert_layers is None or bool(self.opts.bf16_shared_expert_layers)
        if splices and already and len(already) == sum(1 for m in modules.values() if m.group is Group.SHARED_EXPERT):
            # ModelOpt's and Sehyo's exports keep the shared expert BF16: the splice then swaps BF16 for
            # the same BF16 weights (wanted for layers' experts and MTP; this part changes nothing)
            self.warnings.append(
                "the NVFP4 input's shared experts are BF16 already: they are replaced by the BF16 "
                "source's (the same weights, no quality or memory change)"
            )
        chosen = self.opts.bf16_shared_expert_layers
        for layer in chosen if chosen is not None else ():
            if not 0 <= layer < self.expect.L:
                raise UsageError(
                    f"--bf16-shared-experts names layer {layer}, the model has {self.expect.L}",
                    expected=f"0..{self.expect.L - 1}",
                    got=layer,
                )
        for layer in range(self.expect.L) if chosen is None else sorted(set(chosen)):
            gone = self.remove_where(lambda r, layer=layer: r.group is Group.SHARED_EXPERT and r.layer == layer, layer)
            base = f"{prefix}layers.{layer}.mlp.shared_expert."
            home = self.home_of(gone) or self.home_of(
                [n for n in self.names_by_layer.get(layer, []) if self.nv_map.roles[n].group is not Group.MTP]
            )
            for proj in PROJS:
                name = f"{base}{proj}.weight"
                info = self.bf_info(name)
                if info is None:
                    continue
                check_bf16_tensor(info.name, info, self.expect.shared(proj), f"layer {layer} shared expert")
                self.add(home, PlannedTensor(name, info.dtype, info.shape, _origin("bf16", info)))
                self.bf16_units.add(base + proj)

    def expert_layer(self, layer: int) -> None:
        if not 0 <= layer < self.expect.L:
            raise UsageError(
                f"--bf16-expert-layers names layer {layer}, the model has {self.expect.L}",
                expected=f"0..{self.expect.L - 1}",
                got=layer,
                hint=f"name layers 0 to {self.expect.L - 1} (`qtool inspect` of the BF16 checkpoint shows its layers)",
            )
        gone = self.remove_where(lambda r: r.group is Group.ROUTED_EXPERTS and r.layer == layer, layer)
        home = self.home_of(gone)
        base = f"{TEXT_PREFIX[self.nv_map.naming]}layers.{layer}.mlp.experts"
        for t in self.experts_from(self.bf, "bf16", base, self.bf_name(base), f"layer {layer} routed experts"):
            self.add(home, t)
        self.bf16_units.add(base)

    def experts_from(self, ck: Checkpoint, source: str, out_base: str, src_base: str, what: str) -> list[PlannedTensor]:
        """Per-expert tensors for `out_base` ('...mlp.experts') from `ck`, unfusing when it is fused."""
        E = self.expect.E
        fused_gu = ck.tensors.get(src_base + ".gate_up_proj")
        fused_d = ck.tensors.get(src_base + ".down_proj")
        out: list[PlannedTensor] = []
        if fused_gu is not None or fused_d is not None:
            if fused_gu is None or fused_d is None:
                self.missing.append(src_base + (".gate_up_proj" if fused_gu is None else ".down_proj"))
                return []
            H, inter = self.expect.H, self.expect.I
            check_bf16_tensor(fused_gu.name, fused_gu, (E, 2 * inter, H), what + " (fused gate_up_proj)")
            check_bf16_tensor(fused_d.name, fused_d, (E, H, inter), what + " (fused down_proj)")
            eb = DTYPE_BITS[fused_gu.dtype] // 8
            mat = inter * H * eb
            for e in range(E):
                base = fused_gu.start + e * 2 * mat
                out.append(
                    PlannedTensor(
                        f"{out_base}.{e}.gate_proj.weight",
                        fused_gu.dtype,
                        (inter, H),
                        _origin(source, fused_gu, f"[{e}, 0:{inter}, :]", base, mat),
                    )
                )
                out.append(
                    PlannedTensor(
                        f"{out_base}.{e}.up_proj.weight",
                        fused_gu.dtype,
                        (inter, H),
                        _origin(source, fused_gu, f"[{e}, {inter}:{2 * inter}, :]", base + mat, mat),
                    )
                )
                db = DTYPE_BITS[fused_d.dtype] // 8 * H * inter
                out.append(
                    PlannedTensor(
                        f"{out_base}.{e}.down_proj.weight",
                        fused_d.dtype,
                        (H, inter),
                        _origin(source, fused_d, f"[{e}, :, :]", fused_d.start + e * db, db),
                    )
                )
            return out
        for e in range(E):
            for proj in PROJS:
                src = f"{src_base}.{e}.{proj}.weight"
                info = ck.tensors.get(src)
                if info is None:
                    self.missing.append(src)
                    continue
                check_bf16_tensor(src, info, self.expect.expert(proj), what)
                out.append(
                    PlannedTensor(f"{out_base}.{e}.{proj}.weight", info.dtype, info.shape, _origin(source, info))
                )
        return out

    def mtp(self) -> str:
        nv_has = any(n.startswith(MTP_PREFIX) for n in self.nv.tensors)
        bf_has = any(n.startswith(MTP_PREFIX) for n in self.bf.tensors)
        mode = self.opts.mtp
        if mode is MtpMode.AUTO:
            mode = MtpMode.KEEP if nv_has else (MtpMode.FROM_BF16 if bf_has else MtpMode.KEEP)
            if not nv_has and not bf_has:
                self.warnings.append(
                    "neither source has an MTP head; the output has none (speculative decoding with MTP will not work)"
                )
        if mode is MtpMode.KEEP:
            if not nv_has:
                return "none"
            self.unfuse_kept_mtp()
            return "keep"
        gone = self.remove_where(lambda r: r.group is Group.MTP)
        if mode is MtpMode.DROP:
            return "drop" if gone else "none"
        if not bf_has:
            raise PlanError(
                "--mtp from-bf16: the BF16 source has no mtp.* tensors",
                path=self.bf.root,
                hint="use --mtp keep or --mtp drop",
            )
        home = self.home_of(gone)
        bf_mtp = sorted((n for n in self.bf.tensors if n.startswith(MTP_PREFIX)), key=natural_key)
        check_mtp_complete(bf_mtp, self.bf.root)
        fused_bases = sorted(
            {
                n.rsplit(".", 1)[0]
                for n in bf_mtp
                if self.bf_map.roles[n].inner is Group.ROUTED_EXPERTS and self.bf_map.roles[n].expert is None
            }
        )
        for n in bf_mtp:
            role = self.bf_map.roles[n]
            if role.inner is Group.ROUTED_EXPERTS and role.expert is None:
                continue
            self.add(home, _whole("bf16", n, self.bf.tensors[n]))
        for base in fused_bases:
            for t in self.experts_from(self.bf, "bf16", base, base, "MTP routed experts"):
                self.add(home, t)
        self.bf16_units.update({engine_module(self.bf_map.roles[n].module) for n in bf_mtp})
        return "graft" if not nv_has else "from-bf16"

    def unfuse_kept_mtp(self) -> None:
        modules = self.nv_map.modules
        fused = sorted(
            m.name
            for m in modules.values()
            if m.group is Group.MTP and m.inner is Group.ROUTED_EXPERTS and m.expert is None
        )
        for base in fused:
            names = [f"{base}.{p}" for p in modules[base].params]
            home = self.home_of(names)
            self.removed.update(names)
            for t in self.experts_from(self.nv, "nvfp4", base, base, "kept MTP routed experts"):
                self.add(home, t)

    # ---- shard layout ----------------------------------------------------------------------------
    def layout(self, limit: int) -> list[PlannedShard]:
        table = self.nv.tensors
        removed = self.removed
        adds: dict[str | None, list[PlannedTensor]] = {}
        for home, t in self.additions:
            adds.setdefault(home, []).append(t)
        shards: list[PlannedShard] = []
        overflow: list[PlannedTensor] = list(adds.pop(None, []))
        for rel in sorted(self.nv.headers, key=natural_key):
            header = self.nv.headers[rel]
            rows = header.tensors.rows  # this shard's rows of the table
            if not rows:
                continue
            kept = sorted((r for r in rows if table.name_at(r) not in removed), key=table.start_at)
            size = sum(map(table.nbytes_at, kept))
            extra = adds.pop(rel, [])
            if len(kept) == len(rows) and not extra:
                shards.append(
                    PlannedShard(
                        rel,
                        ShardAction.LINK,
                        array("I", kept),
                        [],
                        str(self.nv.root / rel),
                        header.metadata or None,
                        table,
                        size,
                    )
                )
                continue
            added: list[PlannedTensor] = []
            for t in extra:
                if size + t.nbytes <= limit or not (kept or added):
                    added.append(t)
                    size += t.nbytes
                else:
                    overflow.append(t)
            if kept or added:
                shards.append(
                    PlannedShard(
                        rel,
                        ShardAction.REBUILD,
                        array("I", kept),
                        added,
                        str(self.nv.root / rel),
                        header.metadata or None,
                        table,
                        size,
                    )
                )
        for rest in adds.values():  # homes that do not exist (cannot happen; kept for safety)
            overflow.extend(rest)
        if overflow:
            by_name = {t.name: t for t in overflow}
            groups = plan_shards([(t.name, t.nbytes) for t in overflow], limit)
            for i, g in enumerate(groups):
                name = NEW_SHARD_TEMPLATE.format(i=i + 1, n=len(groups))
                if name in self.nv.headers:
                    raise PlanError(
                        "the NVFP4 source already has a shard with the name qtool gives new shards",
                        path=self.nv.root / name,
                    )
                added = [by_name[n] for n in g]
                shards.append(
                    PlannedShard(
                        name,
                        ShardAction.NEW,
                        array("I"),
                        added,
                        metadata={"format": "pt"},
                        data_bytes=sum(t.nbytes for t in added),
                    )
                )
        return shards


def default_limit(nv: Checkpoint) -> int:
    largest = max((h.file_size for h in nv.headers.values()), default=0)
    return max(5 * 10**9, int(largest * 1.05))


def extra_files(root: Path) -> list[str]:
    """Every non-weight file of the source, relative, sorted (config.json and hf_quant_config.json are
    included: they are rewritten, not copied)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".partial"))
        for f in filenames:
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            if f.endswith(".safetensors") or rel in SKIP_FILES:
                continue
            out.append(rel)
    return sorted(out)


def plan_hybrid(opts: HybridOptions) -> HybridPlan:
    """Build and validate the plan. Reads headers and configs only; raises PlanError before any write."""
    if not opts.nvfp4.exists():
        raise CheckpointError("--nvfp4 source not found", path=opts.nvfp4)
    if not opts.bf16.exists():
        raise CheckpointError("--bf16 source not found", path=opts.bf16)
    check_no_overlap(opts.out, (opts.nvfp4, opts.bf16))
    opts.nvfp4, opts.bf16 = opts.nvfp4.resolve(), opts.bf16.resolve()
    p = _Planner(opts)
    flavour = p.flavour()
    p.shared_experts()
    for layer in sorted(set(opts.bf16_expert_layers)):
        p.expert_layer(layer)
    mtp_action = p.mtp()
    if p.missing:
        raise PlanError(
            f"the BF16 source lacks {len(p.missing)} tensor(s) the assembly needs",
            path=p.bf.root,
            tensor=p.missing[0],
            got=", ".join(p.missing[:5]) + (" ..." if len(p.missing) > 5 else ""),
            hint="check that --bf16 is the complete original checkpoint (all shards downloaded)",
        )
    _check_unchanged_shapes(p)
    limit = opts.max_shard_size or default_limit(p.nv)
    shards = p.layout(limit)

    config, hq, added = updated_configs(p.nv, flavour, shards, sorted(p.bf16_units, key=natural_key), p.nv_map.roles)
    files = [f for f in extra_files(p.nv.root)]
    return HybridPlan(
        opts,
        p.nv,
        p.bf,
        p.nv_map,
        flavour,
        shards,
        sorted(p.removed, key=natural_key),
        mtp_action,
        sorted(p.bf16_units, key=natural_key),
        config,
        hq,
        added,
        files,
        p.warnings,
    )


def _check_unchanged_shapes(p: _Planner) -> None:
    """Tensors both sources hold unquantized (norms, router, embeddings) must agree in shape: a cheap
    guard against pairing two different models whose configs do not say so."""
    for name, info in p.nv.tensors.items():
        if info.dtype not in FLOAT_DTYPES or name in p.removed:
            continue
        other = p.bf.tensors.get(p.bf_name(name))
        if other is not None and other.dtype in FLOAT_DTYPES and other.shape != info.shape:
            raise PlanError(
                "the two sources are different models: a tensor they both hold differs in shape",
                path=other.file,
                tensor=name,
                expected=f"{list(info.shape)} (NVFP4 source)",
                got=f"{list(other.shape)} (BF16 source)",
                hint="pass the BF16 original of the model the NVFP4 checkpoint was quantized from",
            )


__all__ = [
    "HF_QUANT_CONFIG_NAME",
    "HybridOptions",
    "HybridPlan",
    "LinkMode",
    "MtpMode",
    "Naming",
    "Origin",
    "PlannedShard",
    "PlannedTensor",
    "ShardAction",
    "plan_hybrid",
    "hf_quant_exclude",
    "config_ignore",
]
