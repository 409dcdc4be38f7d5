"""Reading a launch bundle safely: a folder or a zip from `hap export`, as path -> bytes.

A bundle comes from someone else, so nothing here trusts it (issue 24). A zip is judged by its
directory before any entry is read: the size of the central directory (from the end record, before
`zipfile` parses it), the entry count, each entry's and the total unpacked size, the compression
ratio, encryption, the method (stored or deflated only), duplicate names, control characters and
names that would escape the folder (absolute, `..`, symbolic links). Entries are then read in
chunks, never past their declared size, and their CRC is checked. A folder is judged by `lstat`
before any file is opened: symbolic links, FIFOs, devices and sockets are refused by name. Every
failure is one `BundleError` line. Checking what the files *mean* (manifest, hashes, plan) is
`engine.bundle.archive`'s job.
"""
from __future__ import annotations

import os
import re
import stat
import struct
import zipfile
import zlib
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Iterator

from engine import limits
from engine.errors import BundleError

MANIFEST = "manifest.json"
EXECUTABLE = ("launch_node.sh", "slurm.sbatch")
"""Files written with the executable bit (in the folder and in the zip)."""

CHUNK_BYTES = 1 << 20
"""Bytes inflated or read per step: memory stays bounded by the entry, never by what a stream claims."""
DIRECTORY_BYTES_PER_ENTRY = 1024
"""Central-directory bytes allowed per permitted entry (a bundle's entries take about 100), bounding what
`zipfile` parses into memory before the entries can be counted."""
METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}
"""Compression methods `hap export` writes; anything else is refused from the directory."""
ENCRYPTED_FLAGS = 0x1 | 0x40
"""General-purpose flag bits of an encrypted entry (traditional and strong encryption)."""

_END = struct.Struct("<4s4H2LH")
"""End of central directory record: signature, disks, entries (this disk, all), directory size, offset, comment."""
_END64_LOCATOR = struct.Struct("<4sLQL")
_END64 = struct.Struct("<4sQ2H2L4Q")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def is_bundle(path: str | Path) -> bool:
    """A folder holding manifest.json, or a zip file."""
    p = Path(path)
    return (p.is_dir() and (p / MANIFEST).is_file()) or (p.is_file() and zipfile.is_zipfile(p))


def unsafe_member(info: zipfile.ZipInfo) -> str | None:
    """Why a zip entry would escape the extraction folder (absolute path, `..`, symlink), or None."""
    name = info.filename
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        return f"zip entry '{name}' is a symbolic link"
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or "\\" in name:
        return f"zip entry '{name}' has an absolute or Windows path"
    if ".." in PurePosixPath(name).parts:
        return f"zip entry '{name}' escapes the bundle folder ('..')"
    return None


# ----------------------------------------------------------------------------- zip: the directory


def check_zip(path: str | Path) -> None:
    """Refuse a bundle zip by its directory alone (nothing inflated): `hap run` calls this before importing torch."""
    with open_zip(path) as z:
        checked_entries(z, path)


@contextmanager
def open_zip(path: str | Path) -> Iterator[zipfile.ZipFile]:
    """The zip, opened once its end record bounds the directory; any zip failure in the block is one BundleError."""
    try:
        check_end_record(path)
        with zipfile.ZipFile(path) as z:
            yield z
    except BundleError:
        raise
    except (zipfile.BadZipFile, zlib.error, NotImplementedError, EOFError, OSError, ValueError, RuntimeError) as e:
        raise zip_failure(path, e) from None


def zip_failure(path: str | Path, e: BaseException) -> BaseException:
    """The one-line BundleError for an exception `zipfile` raised (RuntimeError only when it is about encryption)."""
    text = " ".join(str(e).split())[:200]
    if isinstance(e, RuntimeError) and not isinstance(e, NotImplementedError) and "encrypt" not in text:
        return e  # NotImplementedError is a RuntimeError: zipfile's "zip file version 18.5" must not pass as raw
    if isinstance(e, zipfile.BadZipFile) and "CRC" in text:
        what = "CRC mismatch (an entry's data changed)"
    elif isinstance(e, (EOFError, zlib.error)):
        what = "truncated or corrupt compressed data"
    elif isinstance(e, NotImplementedError):
        what = "unsupported zip feature"
    elif isinstance(e, RuntimeError):
        what = "encrypted entry"
    elif isinstance(e, OSError):
        what = "input/output error"
    else:
        what = "corrupt zip"
    detail = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return BundleError(f"{path}: not a readable zip: {what}: {detail}; "
                       "copy the bundle again or re-export it with `hap export --zip`")


def check_end_record(path: str | Path) -> None:
    """Refuse a zip whose file or central directory is larger than a bundle's could be, before `zipfile` reads it."""
    size = Path(path).stat().st_size
    if size > limits.MAX_BUNDLE_BYTES:
        raise BundleError(f"{path}: a zip of {size} bytes, more than a bundle holds ({limits.MAX_BUNDLE_BYTES} bytes); "
                          "refusing the zip")
    entries, directory = end_record(path, size)
    if entries > limits.MAX_BUNDLE_FILES or directory > limits.MAX_BUNDLE_FILES * DIRECTORY_BYTES_PER_ENTRY:
        raise BundleError(f"{path}: the zip's directory declares {entries} entries in {directory} bytes, more than a "
                          f"bundle holds ({limits.MAX_BUNDLE_FILES} entries); refusing the zip")


def end_record(path: str | Path, size: int) -> tuple[int, int]:
    """(entries, central directory bytes) that the zip's end record declares (its zip64 record when present)."""
    with open(path, "rb") as f:
        start = max(0, size - _END.size - 0xFFFF)
        f.seek(start)
        tail = f.read()
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or at + _END.size > len(tail):
            raise BundleError(f"{path}: not a readable zip: no end-of-directory record (truncated, or no zip at all); "
                              "copy the bundle again or re-export it with `hap export --zip`")
        _, _, _, _, entries, directory, _, _ = _END.unpack_from(tail, at)
        if entries != 0xFFFF and directory != 0xFFFFFFFF:
            return entries, directory
        locator = tail[at - _END64_LOCATOR.size:at] if at >= _END64_LOCATOR.size else b""
        if len(locator) != _END64_LOCATOR.size or not locator.startswith(b"PK\x06\x07"):
            return entries, directory  # no zip64 record: the 16/32-bit fields are the truth
        f.seek(min(_END64_LOCATOR.unpack(locator)[2], size))  # past the end: read nothing, refused below
        record = f.read(_END64.size)
    if len(record) != _END64.size or not record.startswith(b"PK\x06\x06"):
        raise BundleError(f"{path}: not a readable zip: its zip64 end record is missing or corrupt; "
                          "copy the bundle again or re-export it with `hap export --zip`")
    fields = _END64.unpack(record)
    return fields[7], fields[8]


def checked_entries(z: zipfile.ZipFile, path: str | Path) -> dict[str, zipfile.ZipInfo]:
    """The zip's files by their name in the bundle (its one top folder dropped), after every directory check."""
    infos = z.infolist()
    total = sum(i.file_size for i in infos)
    if len(infos) > limits.MAX_BUNDLE_FILES or total > limits.MAX_BUNDLE_BYTES:
        raise BundleError(f"{path}: {len(infos)} files of {total} bytes unpacked, more than a bundle holds "
                          f"({limits.MAX_BUNDLE_FILES} files, {limits.MAX_BUNDLE_BYTES} bytes); refusing the zip")
    seen: set[str] = set()
    for info in infos:
        why = entry_problem(info, seen)
        if why:
            raise BundleError(f"{path}: {why}; refusing the whole zip")
        seen.add(info.filename)
    return bundle_names([i for i in infos if not i.is_dir()])


def entry_problem(info: zipfile.ZipInfo, seen: set[str]) -> str | None:
    """Why one directory entry is refused (name, encryption, method, size, ratio), or None."""
    name = info.filename
    if _CONTROL.search(name):
        return f"zip entry {name!r} has a control character in its name"
    if name in seen:
        return f"zip entry '{name}' appears twice"
    why = unsafe_member(info)
    if why:
        return why
    if info.flag_bits & ENCRYPTED_FLAGS:
        return f"zip entry '{name}' is encrypted; a bundle is never encrypted"
    if info.compress_type not in METHODS:
        return (f"zip entry '{name}' uses compression method {info.compress_type}; a bundle uses "
                f"{' or '.join(METHODS.values())} only")
    return size_problem(info)


def size_problem(info: zipfile.ZipInfo) -> str | None:
    """Why an entry's declared size or compression ratio is more than a bundle file's (a zip bomb), or None."""
    name, size = info.filename, info.file_size
    if size > limits.MAX_BUNDLE_ENTRY_BYTES:
        return f"zip entry '{name}' unpacks to {size} bytes, more than a bundle file's {limits.MAX_BUNDLE_ENTRY_BYTES}"
    if size > limits.BUNDLE_RATIO_FLOOR_BYTES and size > limits.MAX_BUNDLE_RATIO * info.compress_size:
        ratio = size / max(1, info.compress_size)
        return (f"zip entry '{name}' inflates {ratio:.0f}-fold ({info.compress_size} -> {size} bytes), more than "
                f"a bundle file's {limits.MAX_BUNDLE_RATIO}-fold: a zip bomb")
    return None


def bundle_names(infos: list[zipfile.ZipInfo]) -> dict[str, zipfile.ZipInfo]:
    """Entries by name relative to the zip's one top folder, if every entry is inside the same one."""
    tops = {i.filename.split("/", 1)[0] for i in infos}
    if len(tops) == 1 and all("/" in i.filename for i in infos):
        return {i.filename.split("/", 1)[1]: i for i in infos}
    return {i.filename: i for i in infos}


# ----------------------------------------------------------------------------- zip: the entries


def entry_chunks(z: zipfile.ZipFile, info: zipfile.ZipInfo, path: str | Path) -> Iterator[bytes]:
    """An entry's bytes in chunks, refused the moment they differ from its declared size (CRC checked at the end)."""
    got = 0
    with z.open(info) as f:
        while chunk := f.read(CHUNK_BYTES):
            got += len(chunk)
            if got > info.file_size:
                break
            yield chunk
    if got != info.file_size:
        raise BundleError(f"{path}: zip entry '{info.filename}' holds {'more' if got > info.file_size else 'fewer'} "
                          f"bytes than the {info.file_size} its directory declares; refusing the whole zip")


def read_zip(path: str | Path) -> dict[str, bytes]:
    """The files of a bundle zip (relative to its one top folder, if it has one), each read within its checked size."""
    with open_zip(path) as z:
        return {name: b"".join(entry_chunks(z, info, path)) for name, info in checked_entries(z, path).items()}


def safe_extract(zip_path: str | Path, dest: str | Path) -> Path:
    """Extract a bundle zip into `dest`, streaming each checked entry to disk; returns the folder holding manifest.json."""
    root = Path(dest).resolve()
    with open_zip(zip_path) as z:
        for name, info in checked_entries(z, zip_path).items():
            target = (root / name).resolve()
            if root != target and root not in target.parents:
                raise BundleError(f"{zip_path}: zip entry '{name}' escapes the bundle folder; refusing the whole zip")
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as out:
                for chunk in entry_chunks(z, info, zip_path):
                    out.write(chunk)
            if name in EXECUTABLE:
                target.chmod(0o755)
    return root


# ----------------------------------------------------------------------------- folder


def read_folder(path: str | Path) -> dict[str, bytes]:
    """The files of a bundle folder, sized by lstat first (links, FIFOs, devices and sockets refused unopened)."""
    root = Path(path)
    return {rel: read_regular(root, rel, size) for rel, size in folder_files(root).items()}


def folder_files(root: Path) -> dict[str, int]:
    """Relative path -> size of every regular file under `root` (sorted), checked against the bundle limits."""
    sizes: dict[str, int] = {}
    count = total = 0
    for here, dirs, files in os.walk(root):  # never follows a link: every link is refused below
        dirs.sort()
        for name in sorted(dirs + files):
            rel = (Path(here) / name).relative_to(root).as_posix()
            mode = os.lstat(Path(here) / name)
            count += 1
            total += mode.st_size if stat.S_ISREG(mode.st_mode) else 0
            why = folder_problem(rel, mode)
            if why is None and (count > limits.MAX_BUNDLE_FILES or total > limits.MAX_BUNDLE_BYTES):
                why = (f"more than a bundle holds ({limits.MAX_BUNDLE_FILES} entries, {limits.MAX_BUNDLE_BYTES} "
                       f"bytes) by '{rel}'")
            if why:
                raise BundleError(f"{root}: {why}; a bundle holds a few plain files only")
            if stat.S_ISREG(mode.st_mode):
                sizes[rel] = mode.st_size
    return dict(sorted(sizes.items()))


def folder_problem(rel: str, mode: os.stat_result) -> str | None:
    """Why a folder entry has no place in a bundle (a link, a FIFO, a device, a socket, a file too large), or None."""
    kind = stat.S_IFMT(mode.st_mode)
    if kind == stat.S_IFDIR:
        return None
    if kind == stat.S_IFLNK:
        return f"'{rel}' is a symbolic link"
    if kind != stat.S_IFREG:
        names = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}
        return f"'{rel}' is {names.get(kind, 'no plain file')}"
    if mode.st_size > limits.MAX_BUNDLE_ENTRY_BYTES:
        return f"'{rel}' has {mode.st_size} bytes, more than a bundle file's {limits.MAX_BUNDLE_ENTRY_BYTES}"
    return None


def read_regular(root: Path, rel: str, size: int) -> bytes:
    """A file's bytes, opened without following a link or blocking on a FIFO swapped in since lstat; at most `size`."""
    fd = os.open(root / rel, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise BundleError(f"{root}: '{rel}' stopped being a plain file while it was read; refusing the bundle")
        data = f.read(size + 1)
    if len(data) != size:
        raise BundleError(f"{root}: '{rel}' changed size while it was read; check the bundle again when it is complete")
    return data
