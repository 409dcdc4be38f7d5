"""Token datasets for `hap run --data` (issue 27): Parquet or Arrow IPC files read with pyarrow, never whole.

    ds = TokenDataset.open("tokens.parquet", seq_len=128)   # a file, or a folder of them (sorted by name)
    ds.check_vocab(model_vocab_size)                        # before training: every id fits the model
    x = global_batch(ds, index=k, seed=0, batch=8)          # LongTensor[8, 128], a pure function of (ds, seed, k)

The column `input_ids` is read in one of two layouts, decided at open:

* **samples**: list rows all of one length L (`hap data prepare --seq-len L` writes them). L == seq_len is used
  as is; a longer row is cut into floor(L / seq_len) samples, its last L mod seq_len tokens unused (so data
  prepared for 2048 tokens trains a 512-token plan, four samples a row); L < seq_len is refused.
* **a token stream**: an integer column, or list rows of varying length (documents). The rows are
  concatenated in file order and cut into samples of seq_len tokens; the tail shorter than one sample is dropped.

A Parquet file is read one row group at a time, on demand, through a small LRU cache bounded in bytes; an Arrow
IPC file is memory-mapped (`pyarrow.memory_map`) and sliced, so its pages belong to the kernel's page cache,
not to the process's heap (a compressed IPC file is the exception: its batches are decompressed at open). A
random sample of a Parquet file costs decoding its row group: `hap data prepare` writes row groups of 64K
tokens; a big dataset with large row groups reads faster converted to Arrow IPC.

The order: global batch k holds the samples at positions k*batch .. (k+1)*batch - 1 of the concatenation of
one seeded permutation of the samples per epoch (`torch.randperm` seeded from (seed, epoch), 4 bytes a
sample). No state beyond k, so a resumed run and the single-device reference of `--verify` read the same batches.

Causal-LM labels are the input ids themselves (the model shifts them, as `transformers` does): a batch is
only the ids. `hap data prepare` (runner.prepare) records its tokenizer and vocabulary size in the schema
metadata (`hap.tokenizer`, `hap.vocab_size`), which `check_vocab` compares with the model's.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from engine.errors import HapError

TOKEN_COLUMN = "input_ids"
PARQUET_SUFFIXES = (".parquet", ".pq")
IPC_SUFFIXES = (".arrow", ".feather", ".ipc")
META_TOKENIZER = "hap.tokenizer"
META_VOCAB_SIZE = "hap.vocab_size"
BYTES_TOKENIZER = "bytes"
BYTES_VOCAB_SIZE = 256
CACHE_BYTES = 64 << 20
"""Decoded Parquet row groups kept (LRU); the last one read is always kept, whatever its size."""
OPEN_FILES = 16
"""Parquet files of a folder kept open at once (LRU): a folder of thousands of files uses no more handles."""
ORDERS_CACHED = 2
"""Epoch permutations kept: a batch spans at most two epochs."""
PREPARE_HINT = "`hap data prepare TEXT --out tokens.parquet` writes one"


class DataError(HapError, ValueError):
    """A token dataset cannot be used: missing, not Parquet/Arrow, wrong column or dtype, too small, bad ids."""


def require_pyarrow() -> Any:
    """pyarrow with its compute, IPC and Parquet modules, or a one-line DataError saying how to install it."""
    try:
        import pyarrow
        import pyarrow.compute  # noqa: F401
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError("reading token datasets needs pyarrow: pip install 'hap-workbench[data]'") from None
    return pyarrow


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


@dataclass(frozen=True)
class Chunk:
    """One piece read at once: a Parquet row group or an Arrow record batch of one file."""

    file: int
    """Index of the file in TokenDataset.files."""
    index: int
    """Row group (Parquet) or record batch (Arrow) number in the file."""
    first_row: int
    """Row number in the file of the chunk's first row."""
    num_rows: int
    num_tokens: int
    min_len: int
    """Shortest and longest row in tokens (1 for an integer column)."""
    max_len: int


class _ParquetSource:
    """A Parquet file: its metadata at open, one row group of the token column on demand."""

    def __init__(self, path: Path):
        pq = require_pyarrow().parquet
        try:
            self.metadata = pq.read_metadata(path)
            self.schema = self.metadata.schema.to_arrow_schema()
        except (OSError, require_pyarrow().ArrowException) as e:
            raise DataError(f"{path} is not a Parquet file ({_first_line(e)}); give a Parquet or Arrow IPC file of "
                            f"token ids ({PREPARE_HINT})") from None
        self.path = path
        self._file: Any = None

    def num_chunks(self) -> int:
        return self.metadata.num_row_groups

    def chunk_rows(self, i: int) -> int:
        return self.metadata.row_group(i).num_rows

    def read(self, i: int) -> Any:
        """Row group `i`'s token column, decoded on this thread (training owns the other cores)."""
        if self._file is None:
            self._file = require_pyarrow().parquet.ParquetFile(self.path, metadata=self.metadata)
        table = self._file.read_row_group(i, columns=[TOKEN_COLUMN], use_threads=False)
        return table.column(TOKEN_COLUMN).combine_chunks()

    def close(self) -> None:
        """Close the file handle (reopened on the next read)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def statistics(self, i: int) -> tuple[int, int] | None:
        """The row group's smallest and largest token id from its statistics; None where it has none."""
        rg = self.metadata.row_group(i)
        for j in range(rg.num_columns):
            col = rg.column(j)
            if col.path_in_schema.split(".")[0] == TOKEN_COLUMN:
                stats = col.statistics
                if stats is not None and stats.has_min_max:
                    return int(stats.min), int(stats.max)
        return None


class _IpcSource:
    """An Arrow IPC file (or stream) memory-mapped: its batches are zero-copy views of the mapping."""

    def __init__(self, path: Path):
        pa = require_pyarrow()
        try:
            mapped = pa.memory_map(str(path))
            try:
                reader = pa.ipc.open_file(mapped)
                self.batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            except pa.ArrowInvalid:  # the stream format (what `datasets` caches): one pass, still zero-copy
                mapped.seek(0)
                reader = pa.ipc.open_stream(mapped)
                self.batches = list(reader)
            self.schema = reader.schema
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{path} is not an Arrow IPC file ({_first_line(e)}); give a Parquet or Arrow IPC file "
                            f"of token ids ({PREPARE_HINT})") from None
        self.path = path

    def num_chunks(self) -> int:
        return len(self.batches)

    def chunk_rows(self, i: int) -> int:
        return self.batches[i].num_rows

    def read(self, i: int) -> Any:
        return self.batches[i].column(TOKEN_COLUMN)

    def close(self) -> None:
        """Nothing to close: the mapping lives as long as the batches."""

    def statistics(self, i: int) -> tuple[int, int] | None:
        return None


Source = _ParquetSource | _IpcSource


def _files(path: Path) -> list[Path]:
    """The file, or the folder's Parquet and Arrow files sorted by name."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in PARQUET_SUFFIXES + IPC_SUFFIXES)
        if not files:
            raise DataError(f"{path} holds no .parquet, .arrow or .feather file; give a folder of token files "
                            f"({PREPARE_HINT})")
        return files
    if not path.exists():
        raise DataError(f"{path}: no such file or folder; give a Parquet or Arrow IPC file of token ids, or a folder "
                        f"of them ({PREPARE_HINT})")
    return [path]


def _source(path: Path) -> Source:
    """Parquet by its suffix or its magic bytes, Arrow IPC otherwise."""
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return _ParquetSource(path)
    if path.suffix.lower() in IPC_SUFFIXES:
        return _IpcSource(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PAR1":
        return _ParquetSource(path)
    try:
        return _IpcSource(path)
    except DataError:
        raise DataError(f"{path} is neither Parquet nor Arrow IPC; give a .parquet, .arrow or .feather file of token "
                        f"ids ({PREPARE_HINT})") from None


def _check_column(source: Source) -> Any:
    """The type of the token column: integers, or lists of integers."""
    pa = require_pyarrow()
    names = source.schema.names
    if TOKEN_COLUMN not in names:
        raise DataError(f"{source.path} has no column '{TOKEN_COLUMN}' (its columns: {', '.join(names) or 'none'}); "
                        f"name the token column {TOKEN_COLUMN} or write the file with `hap data prepare`")
    kind = source.schema.field(TOKEN_COLUMN).type
    element = kind.value_type if _is_list(kind) else kind
    if not pa.types.is_integer(element):
        raise DataError(f"{source.path}: column {TOKEN_COLUMN} has type {kind}; token ids must be integers "
                        f"(int32 or int64) or lists of them")
    return kind


def _is_list(kind: Any) -> bool:
    types = require_pyarrow().types
    return types.is_list(kind) or types.is_large_list(kind) or types.is_fixed_size_list(kind)


def _chunks(file: int, source: Source) -> list[Chunk]:
    """Rows and tokens of each chunk: from the metadata for integer and fixed-size-list columns, from the list
    offsets (one row group at a time) for lists of any length."""
    kind = source.schema.field(TOKEN_COLUMN).type
    chunks, first = [], 0
    for i in range(source.num_chunks()):
        rows = source.chunk_rows(i)
        if not _is_list(kind):
            lo = hi = 1
            total = rows
        elif require_pyarrow().types.is_fixed_size_list(kind):
            lo = hi = kind.list_size
            total = rows * hi
        else:
            lo, hi, total = _row_lengths(source, i, first) if rows else (0, 0, 0)
        chunks.append(Chunk(file, i, first, rows, total, lo, hi))
        first += rows
    return chunks


def _row_lengths(source: Source, i: int, first: int) -> tuple[int, int, int]:
    """Shortest row, longest row and tokens of chunk `i` of a list column, from its offsets (Arrow touches no
    token; Parquet decodes this one row group)."""
    compute = require_pyarrow().compute
    column = source.read(i)
    if column.null_count:
        raise DataError(f"row {first + _first_null(column)} of {source.path} is null; every row of {TOKEN_COLUMN} "
                        f"must hold token ids")
    lengths = compute.list_value_length(column)
    span = compute.min_max(lengths)
    return span["min"].as_py(), span["max"].as_py(), int(compute.sum(lengths).as_py())


def _first_null(column: Any) -> int:
    return int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])


def _tokenizer(sources: Sequence[Source]) -> tuple[str | None, int | None]:
    """The tokenizer and vocabulary size `hap data prepare` recorded; the files must agree."""
    seen: dict[tuple[str, int], Path] = {}
    for s in sources:
        meta = s.schema.metadata or {}
        name = meta.get(META_TOKENIZER.encode())
        if name is not None:
            vocab = meta.get(META_VOCAB_SIZE.encode(), b"0")
            seen.setdefault((name.decode(), int(vocab)), s.path)
    if len(seen) > 1:
        (a, pa_), (b, pb) = list(seen.items())[:2]
        raise DataError(f"{pa_} and {pb} were prepared with different tokenizers ({a[0]} with {a[1]} ids, {b[0]} with "
                        f"{b[1]} ids); prepare every file with the same tokenizer")
    if not seen:
        return None, None
    (name, vocab), = seen
    return name, vocab


class TokenDataset:
    """Samples of `seq_len` token ids from Parquet / Arrow files, read on demand (see the module docstring)."""

    def __init__(self, name: str, sources: Sequence[Source], chunks: Sequence[Chunk], seq_len: int,
                 row_len: int | None, cache_bytes: int = CACHE_BYTES):
        self.name = name
        self.files = [s.path for s in sources]
        self.seq_len = seq_len
        self.row_len = row_len
        """Tokens per row in the samples layout; None for a token stream."""
        self.tokenizer, self.vocab_size = _tokenizer(sources)
        self._sources = list(sources)
        self._chunks = list(chunks)
        self._starts = np.cumsum([0] + [c.num_tokens for c in chunks], dtype=np.int64)
        self._per_row = row_len // seq_len if row_len else 0
        total_rows = sum(c.num_rows for c in chunks)
        self._len = total_rows * self._per_row if row_len else int(self._starts[-1]) // seq_len
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_bytes, self._cached = cache_bytes, 0
        self._open: OrderedDict[int, None] = OrderedDict()
        self._ranges: dict[int, tuple[int, int]] = {}
        self._orders: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()

    @classmethod
    def open(cls, path: str | Path, seq_len: int, *, cache_bytes: int = CACHE_BYTES) -> TokenDataset:
        """Open a Parquet or Arrow IPC file, or a folder of them, as samples of `seq_len` tokens; a DataError
        names the file and what to do when it cannot be used."""
        if seq_len < 1:
            raise DataError(f"seq_len must be at least 1, not {seq_len}")
        files = _files(Path(path))
        sources = [_source(f) for f in files]
        kinds = [_check_column(s) for s in sources]
        chunks = [c for i, s in enumerate(sources) for c in _chunks(i, s)]
        for s in sources:  # reopened on demand, at most OPEN_FILES at once
            s.close()
        name = str(path)
        row_len = _row_len(kinds, chunks)
        tokens = sum(c.num_tokens for c in chunks)
        if tokens == 0:
            raise DataError(f"{name} is empty: it holds no token ids; prepare it from a non-empty text "
                            f"({PREPARE_HINT})")
        if row_len is not None and row_len < seq_len:
            raise DataError(f"{name} holds sequences of {row_len} tokens, shorter than the plan's {seq_len} "
                            f"(sequences shorter than the plan's); prepare it with --seq-len {seq_len} or more, "
                            f"or without --seq-len (a token stream)")
        if row_len is None and tokens < seq_len:
            raise DataError(f"{name} holds {tokens} tokens, fewer than one sample of the plan's seq_len {seq_len}; "
                            f"give it more text")
        return cls(name, sources, chunks, seq_len, row_len, cache_bytes)

    def __len__(self) -> int:
        return self._len

    @property
    def num_tokens(self) -> int:
        """Token ids in the files (including those no sample uses)."""
        return int(self._starts[-1])

    def describe(self) -> str:
        """One line for a run's log."""
        layout = f"rows of {self.row_len} tokens" if self.row_len else "a token stream"
        tok = f", tokenizer {self.tokenizer} ({self.vocab_size} ids)" if self.tokenizer else ""
        return (f"{self.name}: {len(self)} samples of {self.seq_len} tokens from {self.num_tokens} tokens "
                f"({layout}, {len(self.files)} file{'s' * (len(self.files) != 1)}){tok}")

    def __repr__(self) -> str:
        return f"TokenDataset({self.describe()})"

    # reading

    def sample(self, i: int) -> torch.Tensor:
        """Sample `i` as a LongTensor[seq_len]."""
        return self.samples([i])[0]

    def samples(self, indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The samples at `indices` as a LongTensor[n, seq_len], read in file order (each chunk once)."""
        idx = indices.numpy() if isinstance(indices, torch.Tensor) else np.asarray(list(indices))
        idx = idx.astype(np.int64, copy=False)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            bad = int(idx[(idx < 0) | (idx >= len(self))][0])
            raise IndexError(f"sample {bad} out of range: {self.name} has {len(self)} samples")
        starts = self._sample_starts(idx)
        out = np.empty((idx.size, self.seq_len), dtype=np.int64)
        for k in np.argsort(starts, kind="stable"):
            self._read(int(starts[k]), out[k])
        return torch.from_numpy(out)

    def _sample_starts(self, idx: np.ndarray) -> np.ndarray:
        """Offset of each sample in the concatenated token stream of all rows."""
        if self.row_len is None:
            return idx * self.seq_len
        return (idx // self._per_row) * self.row_len + (idx % self._per_row) * self.seq_len

    def _read(self, start: int, out: np.ndarray) -> None:
        """Tokens start .. start + seq_len of the stream into `out` (a sample of a stream may span chunks)."""
        pos, end = start, start + out.size
        while pos < end:
            c = int(np.searchsorted(self._starts, pos, side="right")) - 1
            values = self._values(c)
            offset = pos - int(self._starts[c])
            take = min(end - pos, values.size - offset)
            out[pos - start:pos - start + take] = values[offset:offset + take]
            pos += take

    def _values(self, c: int) -> np.ndarray:
        """Chunk `c`'s token ids flattened (rows concatenated), through the LRU cache."""
        if c in self._cache:
            self._cache.move_to_end(c)
            return self._cache[c]
        chunk = self._chunks[c]
        column = self._source(chunk.file).read(chunk.index)
        if column.null_count:
            raise DataError(f"row {chunk.first_row + _first_null(column)} of {self.files[chunk.file]} is null; every "
                            f"row of {TOKEN_COLUMN} must hold token ids")
        flat = column.flatten() if _is_list(column.type) else column
        if flat.null_count:
            raise DataError(f"{self.files[chunk.file]} has a null token id in row group/batch {chunk.index}; "
                            f"every token id must be set")
        values = flat.to_numpy(zero_copy_only=False)
        self._cache[c] = values
        self._cached += values.nbytes
        while len(self._cache) > 1 and self._cached > self._cache_bytes:
            self._cached -= self._cache.popitem(last=False)[1].nbytes
        return values

    def _source(self, file: int) -> Source:
        """File `file`'s reader, keeping at most OPEN_FILES of them open."""
        self._open[file] = None
        self._open.move_to_end(file)
        while len(self._open) > OPEN_FILES:
            self._sources[self._open.popitem(last=False)[0]].close()
        return self._sources[file]

    # the vocabulary

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a model whose vocabulary is smaller than the recorded tokenizer's, and any token id outside
        0 .. vocab_size - 1, naming its file and row (the first one in file order)."""
        if self.tokenizer is not None and self.vocab_size is not None and vocab_size < self.vocab_size:
            which = ("the byte-level tokenizer" if self.tokenizer == BYTES_TOKENIZER
                     else f"the tokenizer {self.tokenizer}")
            raise DataError(f"the model's vocab_size is {vocab_size}, smaller than the {self.vocab_size} ids of "
                            f"{which} that prepared {self.name}; plan a model with vocab_size >= {self.vocab_size}")
        for c in range(len(self._chunks)):
            lo, hi = self._range(c)
            if lo < 0 or hi >= vocab_size:
                self._refuse_id(c, vocab_size)

    def max_token_id(self) -> int:
        """The largest token id in the files (row-group statistics where present, else one pass)."""
        return max(self._range(c)[1] for c in range(len(self._chunks)) if self._chunks[c].num_tokens)

    def _range(self, c: int) -> tuple[int, int]:
        """Smallest and largest id of chunk `c`: Parquet statistics, else computed from its values once."""
        if c not in self._ranges:
            chunk = self._chunks[c]
            stats = self._sources[chunk.file].statistics(chunk.index)
            if stats is None and chunk.num_tokens:
                values = self._values(c)
                stats = (int(values.min()), int(values.max()))
            self._ranges[c] = stats or (0, 0)
        return self._ranges[c]

    def _refuse_id(self, c: int, vocab_size: int) -> None:
        values = self._values(c)
        bad = np.flatnonzero((values < 0) | (values >= vocab_size))
        if not bad.size:  # statistics may bound loosely: the values themselves are all in range
            return
        chunk, pos = self._chunks[c], int(bad[0])
        row, tid = chunk.first_row + self._row_of(c, pos), int(values[pos])
        where = f"row {row} of {self.files[chunk.file]}"
        if tid < 0:
            raise DataError(f"{where} has token id {tid}; token ids must be >= 0 (rewrite the file with `hap data "
                            f"prepare`)")
        raise DataError(f"{where} has token id {tid} but the model's vocabulary has {vocab_size} ids; prepare the data "
                        f"with the model's tokenizer or plan a model with vocab_size > {tid}")

    def _row_of(self, c: int, pos: int) -> int:
        """The row (in the chunk) that holds flat position `pos` of chunk `c`."""
        chunk = self._chunks[c]
        if chunk.min_len == chunk.max_len:
            return pos // max(chunk.max_len, 1)
        column = self._source(chunk.file).read(chunk.index)
        ends = np.cumsum(require_pyarrow().compute.list_value_length(column).to_numpy(zero_copy_only=False))
        return int(np.searchsorted(ends, pos, side="right"))

    # the order

    def permutation(self, seed: int, epoch: int) -> torch.Tensor:
        """The order of the samples in `epoch` for `seed`: torch.randperm from a generator seeded by both."""
        key = (seed, epoch)
        if key in self._orders:
            self._orders.move_to_end(key)
            return self._orders[key]
        g = torch.Generator().manual_seed(_order_seed(seed, epoch))
        order = torch.randperm(len(self), generator=g, dtype=torch.int32 if len(self) < 2**31 else torch.int64)
        self._orders[key] = order
        while len(self._orders) > ORDERS_CACHED:
            self._orders.popitem(last=False)
        return order


def _row_len(kinds: Sequence[Any], chunks: Sequence[Chunk]) -> int | None:
    """L when every file has list rows all of length L (the samples layout); None for a token stream."""
    if not all(_is_list(k) for k in kinds):
        return None
    lengths = {c.min_len for c in chunks if c.num_rows} | {c.max_len for c in chunks if c.num_rows}
    return lengths.pop() if len(lengths) == 1 else None


def _order_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch), different for every pair (a hash, so nearby seeds share nothing)."""
    digest = hashlib.blake2b(f"hap.data.order:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def batch_indices(ds: TokenDataset, index: int, seed: int, batch: int) -> torch.Tensor:
    """The sample indices of global batch `index`: positions index*batch .. (index+1)*batch - 1 of the
    concatenated per-epoch permutations (epoch = position // len(ds)). A LongTensor[batch]."""
    if batch > len(ds):
        raise DataError(f"{ds.name} holds {len(ds)} samples of {ds.seq_len} tokens, fewer than the {batch} of one "
                        f"global batch; give more data or plan a smaller batch")
    if index < 0:
        raise DataError(f"batch index must be >= 0, not {index}")
    first = index * batch
    epoch, offset = divmod(first, len(ds))
    head = ds.permutation(seed, epoch)[offset:offset + batch]
    rest = batch - head.numel()  # the batch runs into the next epoch
    parts = [head, ds.permutation(seed, epoch + 1)[:rest]] if rest else [head]
    return torch.cat(parts).to(torch.int64)


def global_batch(ds: TokenDataset, index: int, seed: int, batch: int) -> torch.Tensor:
    """Global batch number `index` as a LongTensor[batch, seq_len]: a pure function of (dataset, seed, index)."""
    return ds.samples(batch_indices(ds, index, seed, batch))


def eval_batch(ds: TokenDataset, index: int, batch: int) -> torch.Tensor:
    """Evaluation batch `index` as a LongTensor[batch, seq_len]: samples index*batch .. (index+1)*batch - 1 in file
    order (no shuffle: every evaluation sees the same batches); there are len(ds) // batch of them."""
    if batch > len(ds):
        raise DataError(f"{ds.name} holds {len(ds)} samples of {ds.seq_len} tokens, fewer than the {batch} of one "
                        f"evaluation batch; give more held-out data or plan a smaller batch")
    if not 0 <= index < len(ds) // batch:
        raise DataError(f"evaluation batch {index} out of range: {ds.name} holds {len(ds) // batch} batches of {batch}")
    return ds.samples(range(index * batch, (index + 1) * batch))
