"""The "hostile bundle" fuzz kind (issue 24): what someone who hands over a bundle, a cluster spec or an export
option could do to whoever runs it. Shared by tests/test_fuzz.py and bench/fuzz.py through tests/fuzzing.py.

A case is one of:

* **a hostile string** (shell metacharacters, new lines, quotes, Unicode controls) in a value that reaches a
  generated file: a machine, a device name, a GPU type, the cluster or model name, a hand-given node, the
  rendezvous endpoint, the image, a runner word. The bundle is exported; when export accepts it, its
  `launch_node.sh` and `slurm.sbatch` are run by bash with a PATH of stubs (tests/launch_stubs.py) and must
  call torchrun with the expected argv, nothing else, and create no file; the bundle must also check OK.
* **a tampered bundle**: a generated file changed (a command line inserted, a byte changed) with every hash
  in the manifest re-signed, the recorded export settings edited, or a JSON file replaced by deep nesting or a
  long number; `check_files` must refuse it in one line.
* **a zip bomb**: a highly compressed entry, a central directory declaring huge sizes, too many entries.
* **a corrupt zip**: bytes overwritten, cut, the encryption flag or the compression method changed.

Anything a tampered bundle or a bomb gets past the checks counts as a raw outcome (a bug), as does a
generated script that runs anything but torchrun or makes a file.
"""
from __future__ import annotations

import dataclasses
import io
import json
import struct
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable

from launch_stubs import expected_torchrun, run_script, slurm_env

from engine.bundle.launch_files import DEFAULT_RDZV_TIMEOUT_S

PIECES = ("$(touch pwned)", "`touch pwned`", ";touch pwned", "&& touch pwned", "|touch pwned", ">pwned", "\ntouch pwned",
          "\r\ntouch pwned", "'", '"', "\\", "#", "*", "~", "{a,b}", "$HOME", "${IFS}", "\u2028", "\u202e", "é", "中",
          "\U0001F600", "\x00", "\t", "\x1b[31m", " ", "-", "--help", "..", "/", "%", "!", "&", "(", ")", "\u0085")
"""Pieces a hostile value is made of: command substitution, separators, redirections, new lines, quotes,
globs, variables, Unicode line separators and direction overrides, control characters, option-looking words."""
FIELDS = ("machine", "device_name", "gpu_model", "gpu_product", "cluster_name", "graph_name", "node_machine",
          "rdzv_endpoint", "image", "run_arg")
"""Every value from a spec, a plan or a flag that reaches a generated file."""
BASES = {"machine": "m0", "device_name": "cpu-0", "gpu_model": "cpu", "gpu_product": "A100-40GB", "cluster_name": "c",
         "graph_name": "mlp", "node_machine": "m0", "rdzv_endpoint": "m0:29500", "image": "hap:1", "run_arg": "--steps"}
RUN_ARGS = ["--steps", "3", "$(touch pwned)", "a;touch pwned", "x\ntouch pwned", "'\""]
"""Runner options given to the scripts at run time: data, whatever they hold."""

Chooser = Callable[[int], int]


def hostile_string(base: str, choose: Chooser) -> tuple[str, str]:
    """`base` with 1-3 hostile pieces put before, inside or after it, and a description."""
    text = base
    for _ in range(1 + choose(3)):
        piece = PIECES[choose(len(PIECES))]
        at = choose(len(text) + 1)
        text = text[:at] + piece + text[at:]
    return text, repr(text)


def hostile_case(fx: Any, choose: Chooser) -> tuple[Callable[[], Any], str]:
    """One hostile-bundle case (see the module docstring); four in ten are hostile strings."""
    pick = choose(10)
    if pick < 4:
        return string_case(fx, choose)
    if pick < 7:
        return tamper_case(fx, choose)
    if pick < 9:
        return bomb_case(fx, choose)
    from fuzzing import zip_case

    return corrupt_case(fx, choose) if choose(2) else zip_case(fx, choose)


# ----------------------------------------------------------------------------- hostile strings


def string_case(fx: Any, choose: Chooser) -> tuple[Callable[[], Any], str]:
    """A hostile string in one field; export, and when export accepts, run the scripts under stubs."""
    import engine
    from engine.bundle.archive import LaunchNode
    from engine.bundle.launch_files import ExportSettings

    field = FIELDS[choose(len(FIELDS))]
    value, shown = hostile_string(BASES[field], choose)
    cluster = json.loads(json.dumps(fx.clusters["cpu_4_uneven"]))
    graph, nodes, settings = fx.graph, None, ExportSettings()
    if field == "machine":
        for d in cluster["devices"]:
            d["machine"] = value
    elif field in ("device_name", "gpu_model", "gpu_product"):
        cluster["devices"][choose(len(cluster["devices"]))][{"device_name": "name"}.get(field, field)] = value
    elif field == "cluster_name":
        cluster["name"] = value
    elif field == "graph_name":
        graph = dataclasses.replace(graph, name=value)
    elif field == "node_machine":
        nodes = [LaunchNode(0, value, (0, 1)), LaunchNode(1, "m1", (2, 3))]
    elif field == "rdzv_endpoint":
        settings = ExportSettings(rdzv_endpoint=value)
    elif field == "image":
        settings = ExportSettings(image=value)
    else:
        words = ["--steps", "10"]
        words.insert(choose(3), value)
        settings = ExportSettings(run_args=tuple(words))

    def run() -> Any:
        from engine.bundle.archive import bundle_files, check_files

        spec = engine.load_cluster(cluster)
        plan = engine.evaluate(graph, spec, "dp-even", optimizer="sgd")
        files = bundle_files(plan, spec, nodes=nodes, settings=settings)
        report = check_files(files, "bundle")
        if not report.ok:
            return _outcome("raw", f"a bundle export wrote does not check: {report.problems[0][:200]}")
        return run_generated(fx, files)

    return run, f"{field} = {shown}"


def run_generated(fx: Any, files: dict[str, bytes]) -> Any:
    """Write the bundle and run launch_node.sh (every node) and slurm.sbatch under stubs; raw if anything but
    the expected torchrun lines ran or a file appeared."""
    manifest = json.loads(files["manifest.json"])
    nodes, job = manifest["nodes"], _job(files)
    endpoint = manifest["export"]["rdzv_endpoint"] or _default_endpoint(nodes[0]["machine"])
    with tempfile.TemporaryDirectory(dir=fx.workdir) as tmp:
        root = Path(tmp)
        bundle = root / "bundle"
        for rel, data in files.items():
            (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
            (bundle / rel).write_bytes(data)
        runs = []
        for n in nodes:
            run = run_script(bundle / "launch_node.sh", [str(n["node_rank"]), *RUN_ARGS], root)
            want = [expected_torchrun(len(nodes), n["node_rank"], n["nproc"], endpoint, job, str(bundle), RUN_ARGS,
                                      join_timeout=DEFAULT_RDZV_TIMEOUT_S)]
            runs.append(("launch_node.sh", run, want))
        hosts = [f"n{k}" for k in range(len(nodes))]
        run = run_script(bundle / "slurm.sbatch", RUN_ARGS, root, env=slurm_env(bundle, hosts))
        want = [expected_torchrun(len(nodes), k, n["nproc"], f"{hosts[0]}:29500", "42", str(bundle), RUN_ARGS)
                for k, n in enumerate(nodes)]
        runs.append(("slurm.sbatch", run, want))
    created = sum(len(r.created) for _, r, _ in runs)
    for name, r, want in runs:
        if r.unexpected() or r.calls_of("torchrun") != want:
            return _outcome("raw", f"{name} ran {r.calls[:4]} (unexpected: {r.unexpected()[:3]})", len(runs), created)
    return _outcome("accepted", "", len(runs), created)


def _job(files: dict[str, bytes]) -> str:
    for line in files["slurm.sbatch"].decode().splitlines():
        if line.startswith("#SBATCH --job-name="):
            return line.split("=", 1)[1]
    raise AssertionError("slurm.sbatch names no job")


def _default_endpoint(machine: str) -> str:
    from engine.bundle.launch_files import default_endpoint

    return default_endpoint(machine)


def _outcome(kind: str, detail: str, scripts: int = 0, created: int = 0) -> Any:
    from fuzzing import Outcome

    return Outcome(kind, detail, scripts=scripts, created=created)


# ----------------------------------------------------------------------------- tampered bundles


GENERATED_TEXT = ("launch_node.sh", "slurm.sbatch", "pytorchjob.yaml", "trainjob.yaml", "jobset.yaml", "README.md",
                  "model.json")


def tamper_case(fx: Any, choose: Chooser) -> tuple[Callable[[], Any], str]:
    """A generated file changed and every hash re-signed, or the recorded export settings edited."""
    from engine.bundle.archive import MANIFEST, sha256

    files = dict(fx.bundle_files)
    manifest = json.loads(files[MANIFEST])
    how = choose(5)
    if how == 1:  # a JSON file of the bundle made hostile (deep nesting, a long number), re-signed
        import hostile

        name = ("plan.json", "cluster.json", "model.json", MANIFEST)[choose(4)]
        text = hostile.deep(1000 + choose(200_000)) if choose(2) else f"[{hostile.long_number(300 + choose(20_000))}]"
        files[name] = text.encode()
        said = f"{name} replaced by {text[:12]}... ({len(text)} characters)"
        if name != MANIFEST:
            manifest["files"] = {n: {"sha256": sha256(b), "bytes": len(b)} for n, b in files.items() if n != MANIFEST}
            files[MANIFEST] = (json.dumps(manifest, indent=1) + "\n").encode()
        return _refused(files, said), said
    if how == 0:
        key = ("rdzv_endpoint", "image", "run_args", "annotations", "partition")[choose(5)]
        value: Any = hostile_string(BASES.get(key, "x"), choose)[0]
        if key == "run_args":
            value = ["--steps", value]
        elif key == "annotations":
            value = not manifest["export"]["annotations"]
        manifest["export"][key] = value
        said = f"manifest export.{key} = {value!r}"
    else:
        names = [n for n in GENERATED_TEXT if n in files]
        name = names[choose(len(names))]
        lines = files[name].decode().split("\n")
        at = choose(len(lines))
        how = choose(3)
        if how == 0:
            lines.insert(at, hostile_string("touch pwned", choose)[0])
        elif how == 1 and lines[at]:
            k = choose(len(lines[at]))
            lines[at] = lines[at][:k] + PIECES[choose(len(PIECES))] + lines[at][k + 1:]
        else:
            lines.append("touch pwned")
        files[name] = "\n".join(lines).encode()
        said = f"{name} line {at + 1} changed ({('inserted', 'edited', 'appended')[how]})"
        manifest["files"] = {n: {"sha256": sha256(b), "bytes": len(b)} for n, b in files.items() if n != MANIFEST}
    files[MANIFEST] = (json.dumps(manifest, indent=1) + "\n").encode()
    return _refused(files, said), said + " (manifest re-signed)"


def _refused(files: dict[str, bytes], said: str) -> Callable[[], Any]:
    """A run that checks the tampered files: refused in one line, or a raw outcome when they are accepted."""
    def run() -> Any:
        from engine.bundle.archive import check_files

        report = check_files(files, "bundle")
        if report.ok:
            return _outcome("raw", f"tampered bundle accepted: {said}")
        if "\n" in report.problems[0]:
            return _outcome("raw", f"bundle problem of several lines: {report.problems[0][:300]!r}")
        return _outcome("error", report.problems[0])

    return run


# ----------------------------------------------------------------------------- zips


def bomb_case(fx: Any, choose: Chooser) -> tuple[Callable[[], Any], str]:
    """The bundle's zip plus a bomb: a highly compressed entry, a directory declaring huge sizes, or too many entries."""
    from engine import limits
    from engine.bundle.archive import zip_bytes

    base = zip_bytes(fx.bundle_files, "bundle")
    how = choose(3)
    if how == 0:
        mib = 2 + choose(15)
        data, said = _with_entry(base, "bundle/zeros.bin", b"\0" * (mib << 20)), f"{mib} MiB of zeros added"
    elif how == 1:
        size = (limits.MAX_BUNDLE_BYTES + 1, 2**32 - 1, 2**31, 3 << 30)[choose(4)]
        data, said = _declared(_with_entry(base, "bundle/big.bin", b"\0" * 4096), size), f"an entry declaring {size} bytes"
    else:
        count = limits.MAX_BUNDLE_FILES + 1 + choose(100)
        buf = io.BytesIO(base)
        with zipfile.ZipFile(buf, "a") as z:
            for i in range(count):
                z.writestr(f"bundle/f{i}", b"")
        data, said = buf.getvalue(), f"{count} empty entries added"
    return _check_zip(fx, data, said, must_refuse=True), said


def corrupt_case(fx: Any, choose: Chooser) -> tuple[Callable[[], Any], str]:
    """The bundle's zip with its first entry marked encrypted, an unknown compression method, or a bad CRC."""
    from engine.bundle.archive import zip_bytes

    data = bytearray(zip_bytes(fx.bundle_files, "bundle"))
    how = choose(3)
    headers = [i for i in range(len(data) - 4) if data[i:i + 4] == b"PK\x01\x02"]  # central-directory entries
    target = headers[choose(len(headers))]
    if how == 0:
        data[target + 8] |= 0x01  # general purpose flag bit 0: encrypted
        said = "an entry marked encrypted"
    elif how == 1:
        struct.pack_into("<H", data, target + 10, (99, 12, 14, 93)[choose(4)])  # AES, bzip2, lzma, zstd
        said = "an entry's compression method changed"
    else:
        struct.pack_into("<I", data, target + 16, choose(2**31))
        said = "an entry's CRC changed"
    return _check_zip(fx, bytes(data), said, must_refuse=True), said


def _with_entry(base: bytes, name: str, payload: bytes) -> bytes:
    buf = io.BytesIO(base)
    with zipfile.ZipFile(buf, "a", zipfile.ZIP_DEFLATED) as z:
        z.writestr(name, payload, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return buf.getvalue()


def _declared(data: bytes, size: int) -> bytes:
    """`data` with the last central-directory entry's uncompressed size set to `size` (capped to 32 bits)."""
    out = bytearray(data)
    at = out.rfind(b"PK\x01\x02")
    struct.pack_into("<I", out, at + 24, min(size, 2**32 - 1))
    return bytes(out)


def _check_zip(fx: Any, data: bytes, said: str, must_refuse: bool) -> Callable[[], Any]:
    def run() -> Any:
        from engine.bundle.archive import check_bundle

        with tempfile.TemporaryDirectory(dir=fx.workdir) as folder:
            path = Path(folder) / "bundle.zip"
            path.write_bytes(data)
            report = check_bundle(path)
        if report.ok and must_refuse:
            return _outcome("raw", f"zip accepted: {said}")
        if not report.ok and "\n" in report.problems[0]:
            return _outcome("raw", f"bundle problem of several lines: {report.problems[0][:300]!r}")
        return _outcome("accepted") if report.ok else _outcome("error", report.problems[0])

    return run

