"""Header metadata of many tensors, stored by column: a name -> TensorInfo mapping that keeps no
TensorInfo.

A 397B checkpoint has ~370k tensors. As a dict of TensorInfo tuples its headers cost ~450 B a tensor
(~166 MB); here a tensor costs its name, one dict slot and row number, and 23 bytes of columns (file, dtype
and shape as indexes into small tables of distinct values, start and end as 64-bit ints), ~200 B in all.
TensorInfo tuples are made when asked for and dropped by the caller.

Rows are numbered in insertion order (a checkpoint appends shard by shard), so one shard's tensors are a
contiguous run of rows: `TableSlice` is the per-shard view `SafetensorsHeader.tensors` gives.
"""

from __future__ import annotations

import gc
from array import array
from collections.abc import Callable, Iterable, Iterator, KeysView, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")


@contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Work that makes hundreds of thousands of small acyclic objects (a 397B header set, its model map,
    a TensorInfo per expert scale): without this the cyclic GC rescans its generations over and over
    (about half of Checkpoint.open's time; half of quantize's end check in a process holding its plan)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class TensorInfo(NamedTuple):
    """Where one tensor lives: absolute byte range [start, end) in `file`."""

    name: str
    file: str  # path of the shard
    dtype: str  # safetensors dtype name, e.g. "BF16", "F8_E4M3", "U8"
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first data byte
    end: int  # absolute file offset one past the last data byte

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def nbytes_of(tensors: Mapping[str, TensorInfo], name: str) -> int:
    """A tensor's byte count: from a TensorTable's columns (no TensorInfo made: plans ask it of each of a
    397B's ~370k tensors), else from the mapping's TensorInfo."""
    by_name = getattr(tensors, "nbytes_of", None)
    return by_name(name) if by_name is not None else tensors[name].nbytes


def file_of(tensors: Mapping[str, TensorInfo], name: str) -> str:
    """A tensor's file: from a TensorTable's columns (no TensorInfo made), else the mapping's TensorInfo."""
    by_name = getattr(tensors, "file_of", None)
    return by_name(name) if by_name is not None else tensors[name].file


def tensor_rows(tensors: Mapping[str, TensorInfo]) -> Iterator[tuple[str, str, str, tuple[int, ...]]]:
    """(name, file, dtype, shape) of every tensor, in order: from a TensorTable's columns (no TensorInfo
    made: a model map of the 397B's planned output reads 372k), else from the mapping's TensorInfo."""
    by_column = getattr(tensors, "rows", None)
    if by_column is not None:
        return by_column()
    return ((n, i.file, i.dtype, i.shape) for n, i in tensors.items())


class TensorTable(Mapping):
    __slots__ = (
        "_row",
        "_names",
        "_file",
        "_dtype",
        "_shape",
        "_start",
        "_end",
        "files",
        "dtypes",
        "shapes",
        "_file_ix",
        "_dtype_ix",
        "_shape_ix",
    )

    def __init__(self) -> None:
        self._row: dict[str, int] = {}  # name -> row
        self._names: list[str] = []
        self._file = array("I")
        self._dtype = array("B")
        self._shape = array("I")
        self._start = array("q")
        self._end = array("q")
        self.files: list[str] = []  # distinct values, indexed by the columns above
        self.dtypes: list[str] = []
        self.shapes: list[tuple[int, ...]] = []
        self._file_ix: dict[str, int] = {}
        self._dtype_ix: dict[str, int] = {}
        self._shape_ix: dict[tuple, int] = {}

    @classmethod
    def from_infos(cls, infos: Iterable[TensorInfo]) -> TensorTable:
        t = cls()
        for i in infos:
            t.add(i.name, i.file, i.dtype, i.shape, i.start, i.end)
        return t

    # ---- building ---------------------------------------------------------------------------------
    def _ix(self, table: dict[Any, int], values: list[Any], value: Any) -> int:
        i = table.get(value)
        if i is None:
            i = table[value] = len(values)
            values.append(value)
        return i

    def add(self, name: str, file: str, dtype: str, shape: tuple[int, ...], start: int, end: int) -> int:
        """Append a row (a name already present is re-pointed at the new row). Returns the row."""
        row = len(self._names)
        self._names.append(name)
        self._row[name] = row
        # the value indexes looked up inline: a planned 397B output adds 372k rows
        f = self._file_ix.get(file)
        self._file.append(f if f is not None else self._ix(self._file_ix, self.files, file))
        d = self._dtype_ix.get(dtype)
        self._dtype.append(d if d is not None else self._ix(self._dtype_ix, self.dtypes, dtype))
        sh = self._shape_ix.get(shape)
        self._shape.append(sh if sh is not None else self._ix(self._shape_ix, self.shapes, shape))
        self._start.append(start)
        self._end.append(end)
        return row

    def extend(self, other: TensorTable) -> range:
        """Append every row of `other` (keeping its name strings); returns the new rows."""
        base = len(self._names)
        fmap = [self._ix(self._file_ix, self.files, f) for f in other.files]
        dmap = [self._ix(self._dtype_ix, self.dtypes, d) for d in other.dtypes]
        smap = [self._ix(self._shape_ix, self.shapes, s) for s in other.shapes]
        self._names.extend(other._names)
        self._row.update(zip(other._names, range(base, base + len(other._names)), strict=True))
        # the other table's value indexes, renumbered into this one's value tables
        self._file.extend(fmap[i] for i in other._file)
        self._dtype.extend(dmap[i] for i in other._dtype)
        self._shape.extend(smap[i] for i in other._shape)
        self._start.extend(other._start)
        self._end.extend(other._end)
        return range(base, len(self._names))

    # ---- rows -------------------------------------------------------------------------------------
    def row(self, name: str) -> int:
        return self._row[name]

    def name_at(self, row: int) -> str:
        return self._names[row]

    def info(self, row: int) -> TensorInfo:
        return TensorInfo(
            self._names[row],
            self.files[self._file[row]],
            self.dtypes[self._dtype[row]],
            self.shapes[self._shape[row]],
            self._start[row],
            self._end[row],
        )

    def start_at(self, row: int) -> int:
        return self._start[row]

    def nbytes_at(self, row: int) -> int:
        return self._end[row] - self._start[row]

    def nbytes_of(self, name: str) -> int:
        """A tensor's byte count by name, without making its TensorInfo."""
        row = self._row[name]
        return self._end[row] - self._start[row]

    def file_of(self, name: str) -> str:
        """A tensor's file by name, without making its TensorInfo."""
        return self.files[self._file[self._row[name]]]

    def each(self, rows: Iterable[int], make: Callable[[str, str, str, tuple[int, ...], int, int], T]) -> list[T]:
        """[make(name, file, dtype, shape, start, end) for each row]: other tuples (a writer's OutTensor)
        straight from the columns, without a TensorInfo in between."""
        names, files, dtypes, shapes = self._names, self.files, self.dtypes, self.shapes
        fcol, dcol, scol, start, end = self._file, self._dtype, self._shape, self._start, self._end
        return [make(names[r], files[fcol[r]], dtypes[dcol[r]], shapes[scol[r]], start[r], end[r]) for r in rows]

    def rows(self) -> Iterator[tuple[str, str, str, tuple[int, ...]]]:
        """(name, file, dtype, shape) of every tensor, in order, from the columns (see `tensor_rows`)."""
        names, files, dtypes, shapes = self._names, self.files, self.dtypes, self.shapes
        fcol, dcol, scol = self._file, self._dtype, self._shape
        return ((names[r], files[fcol[r]], dtypes[dcol[r]], shapes[scol[r]]) for r in self._live_rows())

    def infos(self, rows: Iterable[int]) -> Iterator[TensorInfo]:
        info = self.info
        return (info(r) for r in rows)

    def slice(self, rows: range) -> TableSlice:
        return TableSlice(self, rows)

    def total_bytes(self) -> int:
        if len(self._row) == len(self._names):
            return sum(self._end) - sum(self._start)
        return sum(self._end[r] - self._start[r] for r in self._row.values())  # re-pointed names once

    # ---- Mapping ----------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> TensorInfo:
        return self.info(self._row[name])

    def get(self, name: str, default: TensorInfo | None = None) -> TensorInfo | None:  # type: ignore[override]
        r = self._row.get(name)
        return default if r is None else self.info(r)

    def __contains__(self, name: object) -> bool:
        return name in self._row

    def __iter__(self) -> Iterator[str]:
        # names whose row was re-pointed by a later `add` appear once, at their last row
        if len(self._row) == len(self._names):
            return iter(self._names)
        return iter(self._row)

    def __len__(self) -> int:
        return len(self._row)

    def keys(self) -> KeysView[str]:
        return self._row.keys()

    # light views of the rows (not the ABC's ValuesView/ItemsView, which would go through __getitem__)
    def values(self) -> _Values:  # type: ignore[override]
        return _Values(self, self._live_rows())

    def items(self) -> _Items:  # type: ignore[override]
        return _Items(self, self._live_rows())

    def _live_rows(self) -> Sequence[int]:
        if len(self._row) == len(self._names):
            return range(len(self._names))
        return list(self._row.values())

    def __repr__(self) -> str:
        return f"TensorTable({len(self)} tensors in {len(self.files)} files)"


class TableSlice(Mapping):
    """The rows `rows` of a table as a name -> TensorInfo mapping (one shard's tensors)."""

    __slots__ = ("table", "rows")

    def __init__(self, table: TensorTable, rows: range) -> None:
        self.table = table
        self.rows = rows

    def __getitem__(self, name: str) -> TensorInfo:
        r = self.table._row.get(name)
        if r is None or r not in self.rows:
            raise KeyError(name)
        return self.table.info(r)

    def get(self, name: str, default: TensorInfo | None = None) -> TensorInfo | None:  # type: ignore[override]
        r = self.table._row.get(name)
        return default if r is None or r not in self.rows else self.table.info(r)

    def __contains__(self, name: object) -> bool:
        r = self.table._row.get(name)  # type: ignore[call-overload]
        return r is not None and r in self.rows

    def __iter__(self) -> Iterator[str]:
        names = self.table._names
        return (names[r] for r in self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def values(self) -> _Values:  # type: ignore[override]
        return _Values(self.table, self.rows)

    def items(self) -> _Items:  # type: ignore[override]
        return _Items(self.table, self.rows)


class _Rows:
    __slots__ = ("table", "rows")

    def __init__(self, table: TensorTable, rows: Sequence[int]) -> None:
        self.table, self.rows = table, rows

    def __len__(self) -> int:
        return len(self.rows)


class _Values(_Rows):
    __slots__ = ()

    def __iter__(self) -> Iterator[TensorInfo]:
        return self.table.infos(self.rows)


class _Items(_Rows):
    __slots__ = ()

    def __iter__(self) -> Iterator[tuple[str, TensorInfo]]:
        info = self.table.info
        names = self.table._names
        return ((names[r], info(r)) for r in self.rows)
