"""A real, single-machine Slurm for the tests: munged, slurmctld and slurmd (one or two emulated nodes) in a tmp folder.

`make test` installs slurm-wlm and munge where apt-get and root allow; `start_slurm` writes a minimal
slurm.conf for this machine (every node's CPUs from nproc, Features a100,p100 so a heterogeneous job can ask
for both), starts the daemons, waits until sinfo shows the nodes idle, and `SlurmCluster.stop` ends them
by their process ids. `unavailable` says why no Slurm can run here, for the skip reason.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from conftest import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel")
"""The programs the harness needs on PATH (or in /usr/sbin)."""
FEATURES = "a100,p100"
"""Every emulated node has both features, so a job pinning either lands on it."""


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)),
                                      None)


def unavailable() -> str | None:
    """Why no Slurm can be started here (missing programs, not root), or None."""
    missing = [d for d in DAEMONS if _which(d) is None]
    if missing:
        return f"Slurm not installed ({', '.join(missing)} missing; `make test` installs slurm-wlm and munge as root)"
    if os.geteuid() != 0:
        return "the Slurm tests run slurmd, which needs root (not root here)"
    return None


def slurm_conf(root: Path, host: str, cpus: int, nodes: list[str], ports: dict[str, int]) -> str:
    """A minimal slurm.conf: state and logs under `root`, no accounting, job completions in a text file."""
    lines = [f"ClusterName=haptest", f"SlurmctldHost={host}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
             f"SlurmctldPort={ports['ctld']}", "AuthType=auth/munge", f"StateSaveLocation={root}/state",
             f"SlurmdSpoolDir={root}/spool-%n", f"SlurmctldPidFile={root}/slurmctld.pid",
             f"SlurmdPidFile={root}/slurmd-%n.pid", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
             "JobAcctGatherType=jobacct_gather/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
             "SchedulerType=sched/backfill", "JobCompType=jobcomp/filetxt", f"JobCompLoc={root}/jobcomp.txt",
             "ReturnToService=2", "MpiDefault=none", f"SlurmctldLogFile={root}/slurmctld.log",
             f"SlurmdLogFile={root}/slurmd-%n.log", "KillWait=5", "MinJobAge=600", "SlurmctldTimeout=30",
             "SlurmdTimeout=30", "InactiveLimit=0", "Waittime=0"]
    for name in nodes:
        lines.append(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[name]} CPUs={cpus} "
                     f"Features={FEATURES} State=UNKNOWN")
    lines.append(f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES")
    return "\n".join(lines) + "\n"


@dataclass
class SlurmCluster:
    """A running Slurm: its conf, its environment for the client commands, and the daemons it started."""

    root: Path
    env: dict[str, str]
    nodes: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def cmd(self, *args: str, cwd: Path | None = None, check: bool = True) -> str:
        """A Slurm client command's stdout (SLURM_CONF pointing at this cluster)."""
        res = subprocess.run(list(args), env=self.env, cwd=cwd, capture_output=True, text=True, timeout=60)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({res.returncode}): {res.stderr.strip()[:500]}")
        return res.stdout

    def sbatch(self, bundle: Path, *args: str) -> str:
        """Submit slurm.sbatch from the bundle folder as its README says; the job id."""
        out = self.cmd("sbatch", "--parsable", "slurm.sbatch", *args, cwd=bundle)
        return out.strip().split(";")[0]

    def state(self, job: str) -> str:
        """The job's state (COMPLETED, FAILED, CANCELLED, ...; RUNNING or PENDING while it is on)."""
        text = self.cmd("scontrol", "show", "job", job, check=False)
        states = re.findall(r"JobState=(\S+)", text)
        if states:  # a heterogeneous job shows one record per component: the worst one counts
            for bad in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                if bad in states:
                    return bad
            return states[0]
        done = self.root / "jobcomp.txt"
        lines = [ln for ln in (done.read_text().splitlines() if done.exists() else []) if f"JobId={job} " in ln]
        found = re.findall(r"JobState=(\S+)", lines[-1]) if lines else []
        return found[0] if found else "UNKNOWN"

    def wait(self, job: str, timeout: float = 240, until: tuple[str, ...] = ()) -> str:
        """Poll until the job ends (or reaches one of `until`); its state."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self.state(job)
            if st in until or st not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "UNKNOWN", "SUSPENDED"):
                if st != "COMPLETING":
                    return st
            time.sleep(0.5)
        self.cmd("scancel", job, check=False)
        raise TimeoutError(f"job {job} still {self.state(job)} after {timeout:.0f} s\n{self.logs()}")

    def logs(self) -> str:
        """The daemons' logs' tails, for a failure message."""
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                         for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        """Cancel every job, then end the daemons this harness started (by pid) and wait for them."""
        self.cmd("scancel", "--user=root", check=False)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def start_slurm(root: Path, nodes: int = 1) -> SlurmCluster:
    """munged, slurmctld and one slurmd per node, on this machine; RuntimeError naming the daemon that did not come up."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "state").mkdir(exist_ok=True)
    host = socket.gethostname().split(".")[0]
    names = [host, "localhost"][:nodes]
    ports = {"ctld": free_port(), **{n: free_port() for n in names}}
    cpus = os.cpu_count() or 1
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, host, cpus, names, ports))
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": f"{os.environ.get('PATH', '')}:/usr/sbin"}
    for var in [v for v in env if v.startswith(("SLURM_", "SBATCH_", "SRUN_")) and v != "SLURM_CONF"]:
        env.pop(var)
    cluster = SlurmCluster(root, env, names)
    sock = root / "munge.socket"
    munge_dir = root / "munge"
    munge_dir.mkdir(exist_ok=True)
    cluster.procs.append(_start([_which("munged") or "munged", "-F", "--force", f"--socket={sock}",
                                 f"--pid-file={munge_dir}/munged.pid", f"--log-file={root}/munged.log",
                                 f"--seed-file={munge_dir}/seed"], root / "munged.out", env))
    try:
        _wait_for(lambda: sock.exists(), 15, "munged did not create its socket", cluster)
        # slurm reads the munge socket from its auth plugin option
        with conf.open("a") as f:
            f.write(f"AuthInfo=socket={sock}\n")
        cluster.procs.append(_start([_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(conf)],
                                    root / "slurmctld.out", env))
        for n in names:
            cluster.procs.append(_start([_which("slurmd") or "slurmd", "-D", "-f", str(conf), "-N", n],
                                        root / f"slurmd-{n}.out", env))
        _wait_for(lambda: _idle(cluster) >= len(names), 60, "the Slurm nodes never became idle", cluster)
    except Exception:
        cluster.stop()
        raise
    return cluster


def _idle(cluster: SlurmCluster) -> int:
    res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=cluster.env, capture_output=True, text=True,
                         timeout=30)
    return sum(1 for line in res.stdout.splitlines() if line.split()[-1:] == ["idle"])


def _wait_for(ready, timeout: float, what: str, cluster: SlurmCluster) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ready():
            return
        for p in cluster.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: {p.args[0]} exited {p.returncode}\n{cluster.logs()}")
        time.sleep(0.3)
    raise RuntimeError(f"{what} within {timeout:.0f} s\n{cluster.logs()}")
