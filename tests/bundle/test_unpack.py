"""Reading an untrusted bundle (issue 24): a zip judged by its directory before anything is inflated, entries
read within their declared size, a folder judged by lstat before any file is opened; every refusal one line."""
from __future__ import annotations

import io
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import warnings
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, sample_path

import engine
from engine import limits
from engine.bundle.archive import check_bundle, export_bundle
from engine.bundle.unpack import check_zip, read_folder, read_zip, safe_extract
from engine.errors import BundleError

SMALL_MLP = dict(layers=1, in_features=8, hidden=16, classes=4, batch=8)


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> Path:
    """A real export (folder + zip) of a dp-even zoo:mlp plan on sample_clusters/cpu_4_uneven.json."""
    cluster = sample_path("cpu_4_uneven")
    plan = engine.evaluate(engine.load_model("zoo:mlp", **SMALL_MLP), engine.load_cluster(cluster), "dp-even",
                           optimizer="sgd")
    return export_bundle(plan, None, tmp_path_factory.mktemp("real") / "b", zip=True)


def zip_of(files: dict[str, bytes] | list[tuple[str, bytes]], method: int = zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate names some tests write on purpose
        with zipfile.ZipFile(buf, "w", method) as z:
            for name, data in files.items() if isinstance(files, dict) else files:
                z.writestr(name, data)
    return buf.getvalue()


def forged(data: bytes, **fields: int) -> bytes:
    """`data` with fields of its first entry rewritten in both its local header and its central directory
    record: flags, method, crc, compressed, size (the declared unpacked size)."""
    out = bytearray(data)
    local, central = out.index(b"PK\x03\x04"), out.index(b"PK\x01\x02")
    offsets = {"flags": (6, 8, "<H"), "method": (8, 10, "<H"), "crc": (14, 16, "<L"), "compressed": (18, 20, "<L"),
               "size": (22, 24, "<L")}
    for name, value in fields.items():
        at_local, at_central, fmt = offsets[name]
        struct.pack_into(fmt, out, local + at_local, value)
        struct.pack_into(fmt, out, central + at_central, value)
    return bytes(out)


def write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "b.zip"
    path.write_bytes(data)
    return path


def refused(path: Path, match: str) -> str:
    """The one-line BundleError of reading `path`, also as `hap bundle check`'s one problem."""
    with pytest.raises(BundleError, match=match) as e:
        read_zip(path)
    assert "\n" not in str(e.value)
    report = check_bundle(path)
    assert not report.ok and len(report.problems) == 1 and "\n" not in report.problems[0]
    return str(e.value)


@pytest.fixture
def no_inflating(monkeypatch):
    """Any attempt to read an entry fails the test: the directory alone must refuse the zip."""
    writing = zipfile.ZipFile.open

    def open_for_writing_only(self, name, mode="r", *args, **kwargs):
        assert mode == "w", "an entry was read before the directory checks refused the zip"
        return writing(self, name, mode, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", open_for_writing_only)


# ----------------------------------------------------------------------------- directory checks


def test_too_many_entries_are_refused_from_the_end_record(tmp_path, monkeypatch, no_inflating):
    monkeypatch.setattr(limits, "MAX_BUNDLE_FILES", 3)
    path = write(tmp_path, zip_of({f"b/f{i}": b"x" for i in range(4)}))
    refused(path, r"declares 4 entries in \d+ bytes, more than a bundle holds \(3 entries\)")


def test_an_entry_declaring_3_gib_is_refused_without_inflating(tmp_path, no_inflating):
    data = forged(zip_of({"b/plan.json": b"{}", "b/zeros.bin": b"\0" * 4096}), size=3 << 30)
    message = refused(write(tmp_path, data), r"zip entry 'b/plan.json' unpacks to 3221225472 bytes|more than a bundle")
    assert "refusing" in message


def test_one_entry_over_its_limit_is_refused(tmp_path, monkeypatch, no_inflating):
    monkeypatch.setattr(limits, "MAX_BUNDLE_ENTRY_BYTES", 1000)
    path = write(tmp_path, zip_of({"b/plan.json": b"{}" * 1000, "b/x": b"1"}))
    refused(path, r"zip entry 'b/plan.json' unpacks to 2000 bytes, more than a bundle file's 1000")


def test_the_total_over_its_limit_is_refused(tmp_path, monkeypatch, no_inflating):
    monkeypatch.setattr(limits, "MAX_BUNDLE_BYTES", 1000)
    path = write(tmp_path, zip_of({"b/a": b"a" * 600, "b/b": b"b" * 600}))
    refused(path, r"2 files of 1200 bytes unpacked, more than a bundle holds")


def test_a_compression_ratio_of_a_zip_bomb_is_refused(tmp_path, monkeypatch, no_inflating):
    monkeypatch.setattr(limits, "BUNDLE_RATIO_FLOOR_BYTES", 1000)
    path = write(tmp_path, zip_of({"b/zeros.bin": bytes(200_000)}))
    refused(path, r"zip entry 'b/zeros.bin' inflates \d+-fold .*more than a bundle file's 200-fold: a zip bomb")


def test_small_entries_may_compress_by_any_ratio(tmp_path):
    assert read_zip(write(tmp_path, zip_of({"b/zeros.bin": bytes(100_000)}))) == {"zeros.bin": bytes(100_000)}


def test_the_real_export_stays_far_below_the_ratio_limit(real):
    with zipfile.ZipFile(real.with_name("b.zip")) as z:
        ratios = [i.file_size / i.compress_size for i in z.infolist() if i.compress_size]
    assert max(ratios) * 5 < limits.MAX_BUNDLE_RATIO


def test_an_encrypted_entry_is_refused(tmp_path, no_inflating):
    path = write(tmp_path, forged(zip_of({"b/plan.json": b"{}"}), flags=0x1))
    refused(path, r"zip entry 'b/plan.json' is encrypted")


@pytest.mark.parametrize("method", [99, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_a_compression_method_other_than_stored_or_deflated_is_refused(tmp_path, method, no_inflating):
    path = write(tmp_path, forged(zip_of({"b/plan.json": b"{}"}), method=method))
    refused(path, rf"uses compression method {method}; a bundle uses stored or deflated only")


def test_an_entry_needing_a_newer_zip_version_is_one_line(tmp_path):
    """zipfile raises NotImplementedError, a RuntimeError that is not about encryption (fuzzing found it raw)."""
    data = bytearray(zip_of({"b/plan.json": b"{}"}))
    struct.pack_into("<H", data, data.index(b"PK\x01\x02") + 6, 185)  # version needed to extract: 18.5
    refused(write(tmp_path, bytes(data)), r"not a readable zip: unsupported zip feature: NotImplementedError: zip file version 18.5")


def test_duplicate_names_are_refused(tmp_path, no_inflating):
    path = write(tmp_path, zip_of([("b/plan.json", b"{}"), ("b/plan.json", b"[]")]))
    refused(path, r"zip entry 'b/plan.json' appears twice")


def test_a_name_with_a_control_character_is_refused(tmp_path, no_inflating):
    path = write(tmp_path, zip_of({"b/plan\x1b[2J.json": b"{}"}))
    refused(path, r"has a control character in its name")


# ----------------------------------------------------------------------------- reading the entries


def test_a_crc_mismatch_is_one_line(tmp_path):
    data = bytearray(zip_of({"b/plan.json": b"plan" * 100}, zipfile.ZIP_STORED))
    data[data.index(b"planplan") + 3] ^= 0xFF
    refused(write(tmp_path, bytes(data)), r"not a readable zip: CRC mismatch")


def test_an_entry_larger_than_its_header_says_is_refused(tmp_path):
    """A lying header (declared 10 bytes, 4000 inside) stops reading at 10 bytes: the CRC then fails."""
    path = write(tmp_path, forged(zip_of({"b/plan.json": b"{}" * 2000}), size=10))
    refused(path, r"not a readable zip: CRC mismatch")


def test_an_entry_smaller_than_its_header_says_is_refused(tmp_path):
    path = write(tmp_path, forged(zip_of({"b/plan.json": b"p" * 100}, zipfile.ZIP_STORED), size=200, compressed=200))
    refused(path, r"not a readable zip|fewer bytes than the 200 its directory declares")


def test_corrupt_deflate_data_is_one_line(tmp_path):
    data = bytearray(zip_of({"b/plan.json": bytes(random.Random(1).randbytes(3000)).hex().encode()}))
    start = data.index(b"b/plan.json") + len("b/plan.json")
    data[start + 20:start + 60] = b"\xff" * 40
    refused(write(tmp_path, bytes(data)), r"not a readable zip")


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.95])
def test_a_truncated_zip_is_one_line(tmp_path, real, keep):
    data = real.with_name("b.zip").read_bytes()
    refused(write(tmp_path, data[:int(len(data) * keep)]), r"not a readable zip|truncated")


@pytest.mark.parametrize("seed", range(4))
def test_random_garbage_behind_a_valid_end_record_is_one_line(tmp_path, seed):
    rng = random.Random(seed)
    end = zip_of({"b/plan.json": b"{}"})[-22:]  # an end record pointing into the garbage
    refused(write(tmp_path, rng.randbytes(rng.randrange(10, 5000)) + end), r"not a readable zip")


def test_hap_run_refuses_a_bomb_before_importing_torch(tmp_path):
    path = write(tmp_path, forged(zip_of({"b/plan.json": b"{}"}), size=3 << 30))
    code = ("import sys; from runner.hap import main; rc = main(['run', sys.argv[1], '--steps', '1']); "
            "print(rc, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["2", "False"], r.stderr
    assert r.stderr.startswith("hap run: error: ") and "3221225472 bytes unpacked" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- the real bundle


def test_the_real_export_zip_reads_extracts_and_checks(real, tmp_path):
    z = real.with_name("b.zip")
    check_zip(z)
    files = read_zip(z)
    assert files == read_folder(real) and "manifest.json" in files
    root = safe_extract(z, tmp_path / "x")
    assert read_folder(root) == files and os.access(root / "launch_node.sh", os.X_OK)
    assert check_bundle(z).ok and check_bundle(root).ok


# ----------------------------------------------------------------------------- folders


def copy_of(real: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "copy"
    folder.mkdir()
    for p in real.iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    return folder


def test_a_fifo_in_a_folder_is_refused_by_name_without_blocking(real, tmp_path):
    folder = copy_of(real, tmp_path)
    os.mkfifo(folder / "pipe")
    got: list[BaseException] = []
    reader = threading.Thread(target=lambda: got.append(pytest.raises(BundleError, read_folder, folder).value),
                              daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "reading the folder blocked on the FIFO"
    assert "'pipe' is a FIFO" in str(got[0]) and "\n" not in str(got[0])
    assert "'pipe' is a FIFO" in check_bundle(folder).problems[0]


def test_a_socket_and_a_symbolic_link_in_a_folder_are_refused_by_name(real, tmp_path):
    folder = copy_of(real, tmp_path)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(folder / "sock"))
        with pytest.raises(BundleError, match="'sock' is a socket"):
            read_folder(folder)
    os.unlink(folder / "sock")
    (folder / "sub").mkdir()
    (folder / "sub" / "link").symlink_to("/etc/passwd")
    with pytest.raises(BundleError, match="'sub/link' is a symbolic link"):
        read_folder(folder)


def test_folder_limits_are_checked_by_lstat_before_reading(real, tmp_path, monkeypatch):
    folder = copy_of(real, tmp_path)
    monkeypatch.setattr("engine.bundle.unpack.read_regular", lambda *a: pytest.fail("a file was read"))
    monkeypatch.setattr(limits, "MAX_BUNDLE_ENTRY_BYTES", 100)
    with pytest.raises(BundleError, match=r"'\w+\.\w+' has \d+ bytes, more than a bundle file's 100"):
        read_folder(folder)
    monkeypatch.setattr(limits, "MAX_BUNDLE_ENTRY_BYTES", 2**27)
    monkeypatch.setattr(limits, "MAX_BUNDLE_FILES", 3)
    with pytest.raises(BundleError, match=r"more than a bundle holds \(3 entries"):
        read_folder(folder)
    monkeypatch.setattr(limits, "MAX_BUNDLE_FILES", 10_000)
    monkeypatch.setattr(limits, "MAX_BUNDLE_BYTES", 1000)
    with pytest.raises(BundleError, match=r"more than a bundle holds \(10000 entries, 1000 bytes\)"):
        read_folder(folder)
