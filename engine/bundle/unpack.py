"""Reading a launch bundle safely: a folder or a zip from `hap export`, as path -> bytes.

A bundle comes from someone else, so nothing here trusts it: a zip entry that would escape the
folder (absolute path, `..`, symbolic link) refuses the whole zip, and sizes are checked against
`engine.limits` before anything is inflated. Checking what the files *mean* (manifest, hashes, plan)
is `engine.bundle.archive`'s job.
"""
from __future__ import annotations

import re
import stat
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from engine import limits
from engine.errors import BundleError

MANIFEST = "manifest.json"
EXECUTABLE = ("launch_node.sh", "slurm.sbatch")
"""Files written with the executable bit (in the folder and in the zip)."""


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


def read_zip(path: str | Path) -> dict[str, bytes]:
    """The files of a bundle zip (relative to its one top folder, if it has one); refuses unsafe entries."""
    try:
        with zipfile.ZipFile(path) as z:
            infos = [i for i in z.infolist() if not i.is_dir()]
            declared = sum(i.file_size for i in infos)
            if len(infos) > limits.MAX_BUNDLE_FILES or declared > limits.MAX_BUNDLE_BYTES:
                raise BundleError(f"{path}: {len(infos)} files of {declared} bytes unpacked, more than a bundle holds "
                                  f"({limits.MAX_BUNDLE_FILES} files, {limits.MAX_BUNDLE_BYTES} bytes); refusing the zip")
            for info in infos:
                why = unsafe_member(info)
                if why:
                    raise BundleError(f"{path}: {why}; refusing the whole zip")
            data = {i.filename: z.read(i) for i in infos}
    except BundleError:
        raise
    except (zipfile.BadZipFile, zlib.error, NotImplementedError, EOFError, OSError, ValueError) as e:
        # a damaged or foreign zip: a bad header, corrupt deflate data, an unsupported method or version
        raise BundleError(f"{path}: not a readable zip: {type(e).__name__}: {' '.join(str(e).split())}") from None
    tops = {n.split("/", 1)[0] for n in data}
    if len(tops) == 1 and all("/" in n for n in data):
        data = {n.split("/", 1)[1]: b for n, b in data.items()}
    return data


def read_folder(path: str | Path) -> dict[str, bytes]:
    """The files of a bundle folder (symbolic links refused)."""
    root = Path(path)
    out: dict[str, bytes] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            raise BundleError(f"{root}: '{rel}' is a symbolic link; a bundle holds plain files only")
        if p.is_file():
            out[rel] = p.read_bytes()
    return out


def safe_extract(zip_path: str | Path, dest: str | Path) -> Path:
    """Extract a bundle zip into `dest` (checked entry by entry); returns the folder holding manifest.json."""
    files = read_zip(zip_path)
    root = Path(dest).resolve()
    for name, data in files.items():
        target = (root / name).resolve()
        if root != target and root not in target.parents:
            raise BundleError(f"{zip_path}: zip entry '{name}' escapes the bundle folder; refusing the whole zip")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        if name in EXECUTABLE:
            target.chmod(0o755)
    return root
