"""Token datasets (runner.data) and `hap data prepare` (runner.prepare): packing, the seeded order, every
refusal by name, the CLI end to end on the shipped text, and bench/data.py run tiny so it cannot rot."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import load_bench

from runner.data import DataError, TokenDataset, batch_indices, eval_batch, global_batch
from runner.hap import main as hap

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "examples" / "data" / "kjv_genesis_exodus.txt"


def write_parquet(path: Path, column, *, row_group_size: int | None = None, metadata=None, name="input_ids") -> Path:
    table = pa.table({name: column})
    if metadata:
        table = table.replace_schema_metadata(metadata)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_arrow(path: Path, column, *, batch_rows: int, stream: bool = False) -> Path:
    table = pa.table({"input_ids": column})
    opener = pa.ipc.new_stream if stream else pa.ipc.new_file
    with opener(str(path), table.schema) as w:
        for batch in table.to_batches(max_chunksize=batch_rows):
            w.write_batch(batch)
    return path


def rows(ds: TokenDataset) -> list[list[int]]:
    return ds.samples(range(len(ds))).tolist()


# packing


def test_fixed_rows_of_the_plans_length_are_the_samples(tmp_path):
    data = [[i * 8 + j for j in range(8)] for i in range(5)]
    ds = TokenDataset.open(write_parquet(tmp_path / "t.parquet", data, row_group_size=2), seq_len=8)
    assert (len(ds), ds.row_len) == (5, 8)
    assert rows(ds) == data
    assert ds.sample(3).dtype == torch.int64 and ds.sample(3).tolist() == data[3]


def test_longer_rows_are_cut_into_samples_and_their_remainder_unused(tmp_path):
    data = [list(range(r * 10, r * 10 + 10)) for r in range(3)]  # rows of 10 tokens, seq_len 4: 2 samples a row
    ds = TokenDataset.open(write_parquet(tmp_path / "t.parquet", data), seq_len=4)
    assert len(ds) == 6
    assert rows(ds)[:3] == [[0, 1, 2, 3], [4, 5, 6, 7], [10, 11, 12, 13]]


def test_an_integer_column_is_a_stream_packed_across_row_groups_with_the_tail_dropped(tmp_path):
    ds = TokenDataset.open(write_parquet(tmp_path / "t.parquet", pa.array(range(27), pa.int32()), row_group_size=7),
                           seq_len=5)
    assert (len(ds), ds.row_len, ds.num_tokens) == (5, None, 27)
    assert rows(ds) == [list(range(k, k + 5)) for k in range(0, 25, 5)]  # samples span row groups of 7


def test_list_rows_of_varying_length_are_concatenated_in_order(tmp_path):
    data = [[0, 1, 2], [3], [4, 5, 6, 7, 8], [], [9, 10]]
    ds = TokenDataset.open(write_parquet(tmp_path / "t.parquet", data, row_group_size=2), seq_len=4)
    assert rows(ds) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 11 tokens: two samples, 3 dropped


def test_arrow_ipc_files_and_streams_read_like_parquet(tmp_path):
    data = [[0, 1, 2], [3], [4, 5, 6, 7, 8], [9, 10]]
    want = rows(TokenDataset.open(write_parquet(tmp_path / "t.parquet", data), seq_len=3))
    for name, stream in (("t.arrow", False), ("s.feather", False), ("t.ipc", True)):
        ds = TokenDataset.open(write_arrow(tmp_path / name, data, batch_rows=1, stream=stream), seq_len=3)
        assert rows(ds) == want == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_a_folder_is_its_token_files_in_name_order(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    write_parquet(folder / "b.parquet", pa.array([4, 5, 6, 7], pa.int64()))
    write_arrow(folder / "a.arrow", pa.array([0, 1, 2, 3], pa.int16()), batch_rows=3)
    (folder / "notes.txt").write_text("not read")
    ds = TokenDataset.open(folder, seq_len=2)
    assert [p.name for p in ds.files] == ["a.arrow", "b.parquet"]
    assert rows(ds) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_the_row_group_cache_stays_bounded_and_reads_stay_right(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", pa.array(range(1000), pa.int32()), row_group_size=100)
    ds = TokenDataset.open(path, seq_len=10, cache_bytes=1)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))
    got = ds.samples(order)
    assert got.tolist() == [list(range(i * 10, i * 10 + 10)) for i in order.tolist()]
    assert len(ds._cache) == 1


def test_a_folder_of_many_files_keeps_few_open(tmp_path, monkeypatch):
    import runner.data

    monkeypatch.setattr(runner.data, "OPEN_FILES", 2)
    folder = tmp_path / "d"
    folder.mkdir()
    for k in range(6):
        write_parquet(folder / f"{k:02d}.parquet", [[k * 4 + j for j in range(4)]])
    ds = TokenDataset.open(folder, seq_len=4, cache_bytes=1)
    assert rows(ds) == [[k * 4 + j for j in range(4)] for k in range(6)]
    assert sum(s._file is not None for s in ds._sources) == 2


# the order


def small(tmp_path: Path, n: int = 10, seq_len: int = 2) -> TokenDataset:
    return TokenDataset.open(write_parquet(tmp_path / "t.parquet", pa.array(range(n * seq_len), pa.int32())), seq_len)


def test_a_global_batch_is_a_pure_function_of_seed_and_index(tmp_path):
    a, b = small(tmp_path), small(tmp_path)
    for k in (7, 0, 3, 7):  # any order, a fresh dataset: the same batch
        assert torch.equal(global_batch(a, k, seed=5, batch=3), global_batch(b, k, seed=5, batch=3))
    seeds = {tuple(batch_indices(a, 0, seed=s, batch=10).tolist()) for s in range(4)}
    assert len(seeds) == 4  # different seeds, different orders
    assert global_batch(a, 0, 5, 3).shape == (3, 2)


def test_every_sample_appears_once_per_epoch_and_epochs_differ(tmp_path):
    ds = small(tmp_path, n=10)
    stream = torch.cat([batch_indices(ds, k, seed=1, batch=3) for k in range(10)]).tolist()  # 30 positions: 3 epochs
    epochs = [stream[0:10], stream[10:20], stream[20:30]]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1]
    assert stream[9:12] == batch_indices(ds, 3, seed=1, batch=3).tolist()  # batch 3 straddles epochs 0 and 1


def test_evaluation_batches_are_the_samples_in_file_order(tmp_path):
    ds = small(tmp_path, n=10)
    assert eval_batch(ds, 1, batch=4).tolist() == [[8, 9], [10, 11], [12, 13], [14, 15]]
    with pytest.raises(DataError, match="evaluation batch 2 out of range: .* holds 2 batches of 4"):
        eval_batch(ds, 2, batch=4)


def test_a_dataset_smaller_than_one_batch_is_refused_with_both_numbers(tmp_path):
    with pytest.raises(DataError, match=r"holds 10 samples of 2 tokens, fewer than the 12 of one global batch"):
        global_batch(small(tmp_path), 0, 0, batch=12)


# refusals, each by name


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(DataError, match=r"nope\.parquet: no such file or folder.*hap data prepare"):
        TokenDataset.open(tmp_path / "nope.parquet", 8)


@pytest.mark.parametrize("name", ["t.parquet", "t.arrow", "t.bin"])
def test_a_file_that_is_not_parquet_or_arrow_is_refused(tmp_path, name):
    path = tmp_path / name
    path.write_text("just some text, no columns")
    with pytest.raises(DataError, match=rf"{name} is (not a Parquet|not an Arrow IPC|neither Parquet nor Arrow)"):
        TokenDataset.open(path, 8)


def test_a_parquet_file_of_another_suffix_is_known_by_its_magic_bytes(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", pa.array(range(6), pa.int32())).rename(tmp_path / "tokens.data")
    assert rows(TokenDataset.open(path, 3)) == [[0, 1, 2], [3, 4, 5]]


def test_a_folder_without_token_files_is_refused(tmp_path):
    with pytest.raises(DataError, match="holds no .parquet, .arrow or .feather file"):
        TokenDataset.open(tmp_path, 8)


def test_a_missing_input_ids_column_lists_the_columns_there_are(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", [[1, 2]], name="tokens")
    with pytest.raises(DataError, match=r"t\.parquet has no column 'input_ids' \(its columns: tokens\)"):
        TokenDataset.open(path, 2)


def test_a_non_integer_column_is_refused_with_its_type(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", pa.array([[0.5, 1.5]], pa.list_(pa.float32())))
    with pytest.raises(DataError, match=r"t\.parquet: column input_ids has type list<\w+: float>; token ids must be "
                                        r"integers"):
        TokenDataset.open(path, 2)


def test_an_empty_dataset_is_refused(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", pa.array([], pa.int32()))
    with pytest.raises(DataError, match=r"t\.parquet is empty: it holds no token ids"):
        TokenDataset.open(path, 2)


def test_fewer_tokens_than_one_sample_are_refused(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", pa.array([1, 2, 3], pa.int32()))
    with pytest.raises(DataError, match=r"holds 3 tokens, fewer than one sample of the plan's seq_len 16"):
        TokenDataset.open(path, 16)


def test_sequences_shorter_than_the_plans_are_refused(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", [[1] * 8, [2] * 8])
    with pytest.raises(DataError, match=r"sequences of 8 tokens, shorter than the plan's 16 \(sequences shorter than "
                                        r"the plan's\); prepare it with --seq-len 16"):
        TokenDataset.open(path, 16)


def test_a_null_row_is_refused_by_row(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", [[1, 2], None, [3]])
    with pytest.raises(DataError, match=r"row 1 of .*t\.parquet is null"):
        TokenDataset.open(path, 2)


def test_a_token_id_at_or_above_the_vocabulary_is_named_with_its_row(tmp_path):
    ids = np.arange(2000, dtype=np.int32) % 250
    ids[1234] = 300
    path = write_parquet(tmp_path / "tokens.parquet", pa.array(ids), row_group_size=500)  # found by the statistics
    ds = TokenDataset.open(path, 8)
    assert ds.max_token_id() == 300
    with pytest.raises(DataError, match=r"row 1234 of .*tokens\.parquet has token id 300 but the model's vocabulary "
                                        r"has 256 ids"):
        ds.check_vocab(256)
    ds.check_vocab(301)


def test_a_bad_id_in_list_rows_of_an_arrow_file_names_its_row(tmp_path):
    data = [[1, 2, 3], [4], [5, 6, 999, 7], [8, 9]]
    ds = TokenDataset.open(write_arrow(tmp_path / "t.arrow", data, batch_rows=2), seq_len=2)  # no statistics: a pass
    with pytest.raises(DataError, match=r"row 2 of .*t\.arrow has token id 999 but the model's vocabulary has 100 ids"):
        ds.check_vocab(100)


def test_a_negative_token_id_is_refused(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", pa.array([1, 2, -3, 4], pa.int64()))
    with pytest.raises(DataError, match=r"row 2 of .*t\.parquet has token id -3; token ids must be >= 0"):
        TokenDataset.open(path, 2).check_vocab(256)


def test_a_byte_level_dataset_refuses_a_vocabulary_under_256(tmp_path):
    meta = {"hap.tokenizer": "bytes", "hap.vocab_size": "256"}
    path = write_parquet(tmp_path / "t.parquet", pa.array([1, 2, 3, 4], pa.int32()), metadata=meta)
    ds = TokenDataset.open(path, 2)
    assert (ds.tokenizer, ds.vocab_size) == ("bytes", 256)
    with pytest.raises(DataError, match=r"the model's vocab_size is 100, smaller than the 256 ids of the byte-level "
                                        r"tokenizer"):
        ds.check_vocab(100)  # every id here is < 100: the tokenizer's vocabulary is what is refused


# hap data prepare


def piece(tmp_path: Path, nbytes: int = 20_000) -> Path:
    """The first lines of the shipped text, about nbytes of it."""
    text = TEXT.read_bytes()[:nbytes]
    path = tmp_path / "piece.txt"
    path.write_bytes(text[:text.rindex(b"\n") + 1])
    return path


def test_prepare_packs_the_shipped_text_byte_level_with_an_eval_split(tmp_path, capsys):
    assert 300_000 < TEXT.stat().st_size < 500_000
    text = piece(tmp_path)
    out, held = tmp_path / "tokens.parquet", tmp_path / "eval.parquet"
    rc = hap(["data", "prepare", str(text), "--out", str(out), "--eval-fraction", "0.1", "--eval-out", str(held),
              "--row-group-tokens", "4096"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}:" in printed and "a token stream in 5 row groups" in printed and f"wrote {held}:" in printed
    train, evl = TokenDataset.open(out, 1), TokenDataset.open(held, 1)
    raw = text.read_bytes()
    got = [bytes(ds.samples(range(len(ds))).flatten().tolist()) for ds in (train, evl)]
    assert got[0] + got[1] == raw  # every byte, in order: the training part, then the held-out tail
    assert 0.08 < len(got[1]) / len(raw) < 0.12 and got[0].endswith(b"\n")  # split between lines
    assert (train.tokenizer, train.vocab_size) == ("bytes", 256)
    train.check_vocab(256)


def test_prepare_with_seq_len_writes_rows_of_samples(tmp_path, capsys):
    out = tmp_path / "tokens.arrow"
    assert hap(["data", "prepare", str(piece(tmp_path, 5000)), "--out", str(out), "--seq-len", "64"]) == 0
    ds = TokenDataset.open(out, 64)
    assert ds.row_len == 64 and len(ds) == ds.num_tokens // 64
    assert "samples of 64 tokens" in capsys.readouterr().out
    assert bytes(ds.sample(0).tolist()) == TEXT.read_bytes()[:64]


def tiny_tokenizer(folder: Path) -> Path:
    """A byte-level BPE of 300 ids trained on a few lines, saved as a transformers tokenizer (offline)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXT.read_text().splitlines()[:100], vocab_size=300, min_frequency=2,
                            special_tokens=["<eos>"], show_progress=False)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>").save_pretrained(str(folder))
    return folder


def test_prepare_with_a_local_transformers_tokenizer(tmp_path, capsys):
    from transformers import AutoTokenizer

    folder = tiny_tokenizer(tmp_path / "tok")
    text, out = piece(tmp_path, 3000), tmp_path / "tokens.parquet"
    assert hap(["data", "prepare", str(text), str(text), "--out", str(out), "--tokenizer", str(folder)]) == 0
    assert "tokenizer " + str(folder.resolve()) in capsys.readouterr().out
    ds = TokenDataset.open(out, 1)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert (ds.tokenizer, ds.vocab_size) == (str(folder.resolve()), len(tok))
    ids = ds.samples(range(len(ds))).flatten().tolist()
    one = tok(text.read_text(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids == one + one  # each file, then the end-of-sequence id
    assert tok.decode(ids[:len(one) - 1]) == text.read_text()
    with pytest.raises(DataError, match=rf"smaller than the {len(tok)} ids of the tokenizer {folder.resolve()}"):
        ds.check_vocab(256)


@pytest.mark.parametrize("case", ["missing", "empty", "no-folder", "bad-suffix", "eval-alone", "no-tokenizer",
                                  "eval-empty", "short"])
def test_prepare_refuses_bad_input_with_one_line_and_exit_2(tmp_path, capsys, case):
    text = piece(tmp_path, 2000)
    empty, line = tmp_path / "empty.txt", tmp_path / "line.txt"
    empty.write_text("")
    line.write_text("one line only\n")
    out = str(tmp_path / "t.parquet")
    argv, says = {
        "missing": ([str(tmp_path / "gone.txt"), "--out", out], "gone.txt: no such text file"),
        "empty": ([str(empty), "--out", out], "empty.txt is empty"),
        "no-folder": ([str(text), "--out", str(tmp_path / "no" / "t.parquet")], "the folder .* does not exist"),
        "bad-suffix": ([str(text), "--out", str(tmp_path / "t.csv")], "give a name ending .parquet"),
        "eval-alone": ([str(text), "--out", out, "--eval-fraction", "0.1"],
                       "--eval-fraction and --eval-out go together"),
        "no-tokenizer": ([str(text), "--out", out, "--tokenizer", str(tmp_path / "tok")],
                         "--tokenizer .*: no such folder"),
        "eval-empty": ([str(line), "--out", out, "--eval-fraction", "0.5", "--eval-out", str(tmp_path / "e.parquet")],
                       "--eval-out .*e.parquet would hold less than one token; .* a larger --eval-fraction"),
        "short": ([str(line), "--out", out, "--seq-len", "64"], "--out .* would hold less than one sample of "
                                                                 "--seq-len 64"),
    }[case]
    assert hap(["data", "prepare", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hap data prepare: error: ")
    assert __import__("re").search(says, err), err
    assert not list(tmp_path.glob("*.parquet")) and not list(tmp_path.glob(".*tmp"))  # nothing half written


def test_prepare_refuses_an_unwritable_out_folder(tmp_path, capsys):
    import os

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere: nothing to refuse here
        pytest.skip("this user can write into a read-only folder (root)")
    assert hap(["data", "prepare", str(piece(tmp_path, 2000)), "--out", str(locked / "t.parquet")]) == 2
    assert "cannot write in" in capsys.readouterr().err


# bench/data.py


def test_the_data_bench_runs_tiny(tmp_path, capsys):
    bench = load_bench("data")
    out = tmp_path / "data.json"
    assert bench.main(["--size-gb", "0.001", "--batches", "5", "--seq-len", "64", "--out", str(out)]) == 0
    import json

    figures = json.loads(out.read_text())
    for fmt in ("parquet", "arrow"):
        assert figures["results"][fmt]["shape"]["tokens_per_s"] > 0
    assert "RssAnon" in capsys.readouterr().out
