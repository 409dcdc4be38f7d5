"""`hap data prepare TEXT... --out tokens.parquet [--tokenizer DIR] [--seq-len N] [--eval-fraction F --eval-out E]`

Packs text files into the token files `hap run --data` reads (runner.data):

* the tokenizer is byte-level by default (a token is a byte: vocabulary 256, no special tokens), or, with
  `--tokenizer DIR`, a `transformers` tokenizer saved in a local folder (`save_pretrained`), loaded with
  `local_files_only` and HF_HUB_OFFLINE=1: nothing is downloaded. Its end-of-sequence token, where it has one,
  follows each text file (no other special token is added);
* the files are read in the order given, line by line in blocks of about 1 MiB, and the token ids written as
  they come (`pyarrow.parquet.ParquetWriter`, row groups of 64K tokens; Arrow IPC for an --out ending .arrow or
  .feather), so a big text never sits in memory whole. The output is written under a temporary name and
  renamed when complete: a failure leaves no half file;
* without --seq-len the file holds a token stream (an int32 column `input_ids`) that `hap run` packs to the
  plan's sequence length; with --seq-len N it holds rows of N tokens (samples; the last partial one dropped);
* --eval-fraction F sends the last F of the text (from the first line that starts past that share of the
  bytes) to --eval-out, a held-out file in the same format;
* the schema metadata records the tokenizer (`hap.tokenizer`: "bytes" or the tokenizer folder's absolute
  path) and its vocabulary size (`hap.vocab_size`), which `hap run` checks against the model's.

Bad input (a missing or empty text file, an --out that cannot be written, a bad option) stops with one line
and exit status 2 (a runner.data.DataError through the `hap` entry).
"""
from __future__ import annotations

import argparse
import codecs
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from runner.data import (BYTES_TOKENIZER, BYTES_VOCAB_SIZE, IPC_SUFFIXES, META_TOKENIZER, META_VOCAB_SIZE,
                         PARQUET_SUFFIXES, TOKEN_COLUMN, DataError, require_pyarrow)

BLOCK_BYTES = 1 << 20
"""Text tokenized at once: whole lines up to about this many bytes."""
ROW_GROUP_TOKENS = 1 << 16
"""Tokens per Parquet row group / Arrow batch: a random sample decodes one (runner.data)."""


@dataclass(frozen=True)
class Tokenizer:
    """Text to token ids, with what the dataset records about it."""

    name: str
    """"bytes", or the absolute path of a transformers tokenizer folder."""
    vocab_size: int
    encode: Callable[[bytes, Any], np.ndarray]
    """(block of UTF-8 lines, the file's incremental decoder) -> int32 ids."""
    eos: int | None
    """Appended after each text file (None: nothing)."""


def byte_tokenizer() -> Tokenizer:
    """A token per byte: vocabulary 256, no special tokens, any bytes (UTF-8 or not)."""
    def encode(block: bytes, _decoder: Any) -> np.ndarray:
        return np.frombuffer(block, np.uint8).astype(np.int32)

    return Tokenizer(BYTES_TOKENIZER, BYTES_VOCAB_SIZE, encode, None)


def transformers_tokenizer(path: str | Path) -> Tokenizer:
    """`AutoTokenizer.from_pretrained` of a local folder, never a download."""
    folder = Path(path)
    if not folder.is_dir():
        raise DataError(f"--tokenizer {path}: no such folder; give a local folder a transformers tokenizer was saved "
                        f"to with save_pretrained (nothing is downloaded)")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("--tokenizer needs transformers: pip install 'hap-workbench[hf]'") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise DataError(f"--tokenizer {path}: transformers cannot load a tokenizer from it "
                        f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from None

    def encode(block: bytes, decoder: Any) -> np.ndarray:
        ids = tok(decoder.decode(block), add_special_tokens=False, verbose=False)["input_ids"]
        return np.asarray(ids, dtype=np.int32)

    return Tokenizer(str(folder.resolve()), len(tok), encode, tok.eos_token_id)


@dataclass(frozen=True)
class Written:
    """What one output file holds."""

    path: Path
    tokens: int
    """Token ids stored."""
    samples: int | None
    """Rows of --seq-len tokens; None for a token stream."""
    dropped: int
    """Tokens at the end that did not fill a sample."""
    groups: int
    """Row groups (Parquet) or record batches (Arrow)."""
    size: int
    """Bytes on disk."""

    def line(self, seq_len: int | None, tokenizer: Tokenizer) -> str:
        """What `hap data prepare` prints for this file."""
        what = (f"{self.samples:,} samples of {seq_len} tokens" if seq_len else "a token stream")
        drop = f", the last {self.dropped} tokens dropped" if self.dropped else ""
        parquet = self.path.suffix.lower() in PARQUET_SUFFIXES
        unit = ("row group" if parquet else "batch") + ("" if self.groups == 1 else "s" if parquet else "es")
        return (f"wrote {self.path}: {self.tokens:,} tokens, {what} in {self.groups} {unit}{drop} "
                f"({self.size / 1e6:.2f} MB; tokenizer {tokenizer.name}, {tokenizer.vocab_size} ids)")


class TokenWriter:
    """Token ids streamed into a Parquet or Arrow IPC file in groups of bounded size, under a temporary name
    renamed at close (`abort` removes it)."""

    def __init__(self, out: Path, tokenizer: Tokenizer, *, seq_len: int | None = None,
                 group_tokens: int = ROW_GROUP_TOKENS):
        pa = require_pyarrow()
        self.out, self.seq_len = out, seq_len
        self._group = max(1, group_tokens // seq_len) * seq_len if seq_len else group_tokens
        self._type = pa.list_(pa.int32(), seq_len) if seq_len else pa.int32()
        meta = {META_TOKENIZER: tokenizer.name, META_VOCAB_SIZE: str(tokenizer.vocab_size)}
        schema = pa.schema([pa.field(TOKEN_COLUMN, self._type, nullable=False)], metadata=meta)
        self._tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        self._ipc = out.suffix.lower() in IPC_SUFFIXES
        self._schema = schema
        self._writer = pa.ipc.new_file(str(self._tmp), schema) if self._ipc else pa.parquet.ParquetWriter(
            str(self._tmp), schema)
        self._buf: list[np.ndarray] = []
        self._buffered = self.tokens = self.groups = 0

    def write(self, ids: np.ndarray) -> None:
        self._buf.append(ids)
        self._buffered += ids.size
        while self._buffered >= self._group:
            self._flush(self._group)

    def _flush(self, n: int) -> None:
        """Write the first n buffered tokens as one row group / batch."""
        flat = np.concatenate(self._buf) if len(self._buf) > 1 else self._buf[0]
        head, rest = flat[:n], flat[n:]
        self._buf, self._buffered = ([rest] if rest.size else []), rest.size
        pa = require_pyarrow()
        values = pa.array(head, pa.int32())
        column = pa.FixedSizeListArray.from_arrays(values, self.seq_len) if self.seq_len else values
        batch = pa.record_batch([column], schema=self._schema)
        if self._ipc:
            self._writer.write_batch(batch)
        else:
            self._writer.write_table(pa.Table.from_batches([batch]))
        self.tokens += n
        self.groups += 1

    def finish(self) -> Written:
        """Write what is buffered (whole samples only) and close the temporary file; `commit` renames it."""
        tail = self._buffered % self.seq_len if self.seq_len else 0
        if self._buffered - tail:
            self._flush(self._buffered - tail)
        self._writer.close()
        samples = self.tokens // self.seq_len if self.seq_len else None
        return Written(self.out, self.tokens, samples, tail, self.groups, self._tmp.stat().st_size)

    def commit(self) -> None:
        """Move the finished file into place."""
        os.replace(self._tmp, self.out)

    def close(self) -> Written:
        """finish, then commit."""
        written = self.finish()
        self.commit()
        return written

    def abort(self) -> None:
        """Close and remove the temporary file: nothing half written stays behind."""
        try:
            self._writer.close()
        except Exception:  # already closed by finish, or failing as it was when we abort: the file goes anyway
            pass
        self._tmp.unlink(missing_ok=True)


def check_texts(texts: Sequence[str]) -> list[Path]:
    """Every text file exists and holds something."""
    if not texts:
        raise DataError("give at least one text file to tokenize")
    paths = [Path(t) for t in texts]
    for p in paths:
        if p.is_dir():
            raise DataError(f"{p} is a folder; give the text files themselves")
        if not p.is_file():
            raise DataError(f"{p}: no such text file")
        if p.stat().st_size == 0:
            raise DataError(f"{p} is empty; give a text file with something to tokenize")
    return paths


def check_out(out: str, flag: str, texts: Sequence[Path]) -> Path:
    """An output name Parquet or Arrow by its suffix, in a folder that exists and can be written, not an input."""
    path = Path(out)
    if path.suffix.lower() not in PARQUET_SUFFIXES + IPC_SUFFIXES:
        raise DataError(f"{flag} {out}: give a name ending .parquet (or .arrow / .feather for Arrow IPC)")
    if path.is_dir():
        raise DataError(f"{flag} {out} is a folder; give a file name ending .parquet")
    parent = path.parent
    if not parent.is_dir():
        raise DataError(f"{flag} {out}: the folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise DataError(f"{flag} {out}: cannot write in {parent} (no permission); choose another folder")
    if any(path.resolve() == t.resolve() for t in texts):
        raise DataError(f"{flag} {out} is one of the text files; give another name")
    return path


def blocks(paths: Sequence[Path], cut: int | None) -> Iterator[tuple[int, bytes, bool]]:
    """(file number, whole lines of about BLOCK_BYTES, held out) in order; lines starting at byte `cut` or later
    of the concatenated files are held out (the eval split)."""
    pos = 0
    for n, path in enumerate(paths):
        with open(path, "rb") as f:
            block, held = [], False
            size = 0
            while line := f.readline(BLOCK_BYTES):
                line_held = cut is not None and pos >= cut
                if block and (line_held != held or size >= BLOCK_BYTES):
                    yield n, b"".join(block), held
                    block, size = [], 0
                block.append(line)
                held, size, pos = line_held, size + len(line), pos + len(line)
            if block:
                yield n, b"".join(block), held


def prepare(texts: Sequence[str], out: str, *, tokenizer: str | None = None, seq_len: int | None = None,
            eval_fraction: float | None = None, eval_out: str | None = None,
            group_tokens: int = ROW_GROUP_TOKENS) -> tuple[Tokenizer, list[Written]]:
    """Tokenize `texts` into `out` (and the held-out tail into `eval_out`); what was written, training file first."""
    paths = check_texts(texts)
    if seq_len is not None and seq_len < 1:
        raise DataError(f"--seq-len must be at least 1, not {seq_len}")
    if (eval_fraction is None) != (eval_out is None):
        raise DataError("--eval-fraction and --eval-out go together: give both (e.g. --eval-fraction 0.05 "
                        "--eval-out eval.parquet) or neither")
    if eval_fraction is not None and not 0 < eval_fraction < 1:
        raise DataError(f"--eval-fraction must be between 0 and 1 (exclusive), not {eval_fraction}")
    outs = [check_out(out, "--out", paths)] + ([check_out(eval_out, "--eval-out", paths)] if eval_out else [])
    if len(outs) == 2 and outs[0].resolve() == outs[1].resolve():
        raise DataError(f"--out and --eval-out are the same file {out}; give two names")
    tok = transformers_tokenizer(tokenizer) if tokenizer else byte_tokenizer()
    total = sum(p.stat().st_size for p in paths)
    cut = round(total * (1 - eval_fraction)) if eval_fraction is not None else None
    writers = [TokenWriter(o, tok, seq_len=seq_len, group_tokens=group_tokens) for o in outs]
    try:
        _tokenize(paths, tok, cut, writers)
        written = [_finish(w, f) for w, f in zip(writers, ("--out", "--eval-out"))]
        for w in writers:  # only once every file is complete: a refusal leaves none of them
            w.commit()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    return tok, written


def _tokenize(paths: Sequence[Path], tok: Tokenizer, cut: int | None, writers: Sequence[TokenWriter]) -> None:
    """Every block into the training writer or the held-out one; the end-of-sequence id after each file."""
    current, decoder, held = -1, None, False
    for n, block, block_held in blocks(paths, cut):
        if n != current:
            _end_file(paths, current, tok, decoder, writers[held])
            current, decoder = n, codecs.getincrementaldecoder("utf-8")()
        held = block_held
        try:
            writers[held].write(tok.encode(block, decoder))
        except UnicodeDecodeError as e:
            raise _not_utf8(paths[n], e) from None
    _end_file(paths, current, tok, decoder, writers[held])


def _end_file(paths: Sequence[Path], n: int, tok: Tokenizer, decoder: Any, writer: TokenWriter) -> None:
    """After file `n`: its text must end on a whole UTF-8 character (for a transformers tokenizer), then the
    end-of-sequence id where the tokenizer has one."""
    if decoder is None:
        return
    if tok.name != BYTES_TOKENIZER:
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise _not_utf8(paths[n], e) from None
    if tok.eos is not None:
        writer.write(np.array([tok.eos], np.int32))


def _not_utf8(path: Path, e: UnicodeDecodeError) -> DataError:
    return DataError(f"{path} is not UTF-8 text ({e.reason}); convert it to UTF-8, or use the byte-level tokenizer "
                     f"(no --tokenizer), which takes any bytes")


def _finish(writer: TokenWriter, flag: str) -> Written:
    """The finished file, refused when it holds nothing usable."""
    written = writer.finish()
    if written.tokens == 0:
        need = f"one sample of --seq-len {writer.seq_len}" if writer.seq_len else "one token"
        raise DataError(f"{flag} {writer.out} would hold less than {need}; give more text"
                        + (" or a larger --eval-fraction" if flag == "--eval-out" else ""))
    return written


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `hap data prepare`."""
    p.add_argument("texts", nargs="+", metavar="TEXT", help="text files, tokenized in this order")
    p.add_argument("--out", required=True, help="token file to write: .parquet, or .arrow / .feather for Arrow IPC")
    p.add_argument("--tokenizer", metavar="DIR", help="a local transformers tokenizer folder (save_pretrained); "
                   "default: byte-level (a token per byte, vocabulary 256)")
    p.add_argument("--seq-len", type=int, metavar="N", help="write rows of N tokens (samples); default: a token "
                   "stream packed to the plan's sequence length by `hap run --data`")
    p.add_argument("--eval-fraction", type=float, metavar="F", help="hold out the last F of the text (0 < F < 1)")
    p.add_argument("--eval-out", metavar="FILE", help="where the held-out text's tokens go (with --eval-fraction)")
    p.add_argument("--row-group-tokens", type=int, default=ROW_GROUP_TOKENS, metavar="N",
                   help=f"tokens per row group or batch (default {ROW_GROUP_TOKENS}; smaller reads random samples "
                        f"faster, larger compresses better)")


def run(args: argparse.Namespace) -> int:
    """`hap data prepare` with parsed options: write, then print one line per file written."""
    if args.row_group_tokens < 1:
        raise DataError(f"--row-group-tokens must be at least 1, not {args.row_group_tokens}")
    tok, written = prepare(args.texts, args.out, tokenizer=args.tokenizer, seq_len=args.seq_len,
                           eval_fraction=args.eval_fraction, eval_out=args.eval_out,
                           group_tokens=args.row_group_tokens)
    for w in written:
        print(w.line(args.seq_len, tok))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hap data prepare", description="Tokenize text files into a Parquet or Arrow "
                                "token file for `hap run --data` (see runner/prepare.py).")
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`hap data prepare ...`: one line and exit status 2 on bad input."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except DataError as e:
        print(f"hap data prepare: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a text that cannot be read, a disk that fills up
        where = f"{e.filename}: " if e.filename else ""
        print(f"hap data prepare: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
