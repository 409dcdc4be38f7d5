"""Run a bundle's launch scripts with a PATH of stubs only, and see every command they call and every file they make.

The stubs record their argv as JSON lines in one log: `torchrun` (records, starts nothing), the few
commands the scripts are meant to call (`dirname` and `head` record and then run the real program;
`scontrol show hostnames` and `srun` are emulated: srun runs its command once per task with
SLURM_NODEID set, and a heterogeneous step's components (`--het-group=K ... : --het-group=K ...`) one after
another, each once, with SLURM_HET_GROUP=K so the stub torchrun's log can tell them apart), and traps for commands an injected value would reach for (`touch`, `rm`, `sh`,
`curl`, ...), which only record. A run is safe when the log holds exactly the expected calls, no
"command not found" was printed, and no file appeared anywhere the script could write (its working
folder, the bundle, HOME and TMPDIR). Shared by tests/bundle/test_launch_safety.py and the hostile-bundle
fuzzing of tests/fuzzing.py.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

MEANT = ("torchrun", "dirname", "head", "scontrol", "srun")
"""Commands the launch files are meant to call."""
TRAPS = ("touch", "rm", "sh", "bash", "curl", "wget", "id", "cat", "python", "python3", "nc", "chmod", "cp", "mv",
         "ls", "env", "tee", "mkdir", "whoami", "uname", "date", "sleep", "xargs", "perl")
"""Commands an injected value might call; none may ever be called."""

_STUB = """#!{python} -IS
import json, os, sys
name = {name!r}
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps([name, sys.argv[1:]]) + "\\n")
if name in ("dirname", "head"):
    os.execv({real!r}[name], [name, *sys.argv[1:]])
if name == "scontrol":
    if sys.argv[1:3] == ["show", "hostnames"]:
        print("\\n".join(os.environ.get("STUB_HOSTS", "n0").split(",")))
    sys.exit(0)
if name == "srun":
    import subprocess
    components, part = [], []
    for arg in sys.argv[1:]:
        if arg == ":":  # as srun reads it: every bare ':' starts the next component
            components.append(part)
            part = []
        else:
            part.append(arg)
    components.append(part)
    status = 0
    for args in components:
        tasks, group = 1, None
        while args and args[0].startswith("-"):
            if args[0].startswith("--ntasks="):
                tasks = int(args[0].split("=", 1)[1])
            if args[0].startswith("--het-group="):
                group = args[0].split("=", 1)[1]
            args = args[1:]
        if args and args[0] == "bash":
            args = ["/bin/bash", *args[1:]]
        extra = {{}} if group is None else {{"SLURM_HET_GROUP": group}}
        for node in range(tasks):
            status |= subprocess.run(args, env={{**os.environ, "SLURM_NODEID": str(node), **extra}}).returncode
    sys.exit(status)
sys.exit(0)
"""


@dataclass
class StubRun:
    """What one script run did."""

    returncode: int
    calls: list[tuple[str, list[str]]]
    """(command, argv) of every stub called, in order."""
    created: list[str]
    """Paths that appeared during the run (relative to the watched folders)."""
    stderr: str

    def calls_of(self, name: str) -> list[list[str]]:
        return [argv for cmd, argv in self.calls if cmd == name]

    def unexpected(self) -> list[str]:
        """Why this run was not safe: trap commands called, commands not found, files created."""
        out = [f"called {cmd} {argv}" for cmd, argv in self.calls if cmd not in MEANT]
        if "command not found" in self.stderr or "No such file or directory" in self.stderr:
            out.append(f"stderr: {self.stderr.strip()[:300]}")
        return out + [f"created {p}" for p in self.created]


def stub_dir(root: Path) -> Path:
    """A folder of stub commands (made once per root)."""
    stubs = root / "stubs"
    if stubs.is_dir():
        return stubs
    stubs.mkdir(parents=True)
    real = {name: shutil.which(name) or f"/usr/bin/{name}" for name in ("dirname", "head")}
    for name in MEANT + TRAPS:
        path = stubs / name
        path.write_text(_STUB.format(python=sys.executable, name=name, real=real))
        path.chmod(0o755)
    return stubs


def _listing(folders: list[Path]) -> set[str]:
    return {f"{i}:{p.relative_to(folder)}" for i, folder in enumerate(folders) for p in folder.rglob("*")}


def run_script(script: Path, args: list[str], root: Path, env: dict[str, str] | None = None,
               timeout: float = 30) -> StubRun:
    """`/bin/bash SCRIPT ARGS` with PATH = the stubs only, cwd, HOME and TMPDIR fresh folders under `root`."""
    stubs = stub_dir(root)
    work = Path(tempfile.mkdtemp(dir=root, prefix="run-"))
    home, tmp, log = work / "home", work / "tmp", work / "stub.log"
    cwd = work / "cwd"
    for folder in (home, tmp, cwd):
        folder.mkdir()
    log.touch()
    watched = [cwd, home, tmp, script.parent]
    before = _listing(watched)
    full_env = {"PATH": str(stubs), "HOME": str(home), "TMPDIR": str(tmp), "STUB_LOG": str(log), **(env or {})}
    res = subprocess.run(["/bin/bash", str(script), *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                         timeout=timeout)
    created = sorted(_listing(watched) - before)
    calls = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    shutil.rmtree(work, ignore_errors=True)
    return StubRun(res.returncode, calls, created, res.stderr)  # type: ignore[arg-type]


def expected_torchrun(nnodes: int, node_rank: int, nproc: int, endpoint: str, rdzv_id: str, bundle: str,
                      args: list[str], join_timeout: int | None = None) -> list[str]:
    """The argv a bundle's launch line gives torchrun (launch_node.sh also passes the rendezvous join timeout)."""
    conf = [] if join_timeout is None else [f"--rdzv-conf=join_timeout={join_timeout}"]
    return [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}", *conf, "-m", "runner.launch", bundle, *args]


def slurm_env(bundle: Path, hosts: list[str], job_id: str = "42") -> dict[str, str]:
    """What Slurm sets for a batch script (the parts slurm.sbatch reads)."""
    het = {f"SLURM_JOB_NODELIST_HET_GROUP_{k}": host for k, host in enumerate(hosts)}
    return {"SLURM_SUBMIT_DIR": str(bundle), "SLURM_JOB_NODELIST": ",".join(hosts), "SLURM_JOB_ID": job_id,
            "STUB_HOSTS": ",".join(hosts), **het}

