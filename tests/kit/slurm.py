"""A small, real Slurm cluster for tests: munged, slurmctld and one slurmd per node, on
this host, in Slurm's multiple-slurmd mode (Debian's slurm-wlm 22.05 has it: every node
is `slurmd -N <name>` on a port of its own, `Port=` per node in slurm.conf, all at
127.0.0.1). No cgroups: proctrack/linuxproc and task/none. Everything (slurm.conf,
topology.conf, the munge key and socket, state and spool directories, pid files, logs)
lives in one directory, and `running_slurm(...)` stops every daemon and every process of
its jobs however its block ends.

    with running_slurm(tmp_path, ["n1", "n2"], {"rack-a": ["n1", "n2"]}) as slurm:
        job = slurm.sbatch(["--nodes=2", "script.sh"])
        slurm.wait_job(job)

Needs root (slurmd runs jobs as their user, munged and slurmctld as root here) and the
Debian packages slurm-wlm and munge; `missing()` says which is lacking, for a skip."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kit.ports import free_listen_port

COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
START_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0
POLL = 0.1


def missing() -> str | None:
    """Why no Slurm cluster can run here, or None when one can."""
    if os.geteuid() != 0:
        return (
            f"the Slurm tests start munged, slurmctld and slurmd, which needs root (uid is "
            f"{os.geteuid()})"
        )
    absent = [name for name in COMMANDS if shutil.which(name, path=SEARCH_PATH) is None]
    if absent:
        return (
            f"Slurm is not installed here ({', '.join(absent)} not found): install the Debian "
            "packages slurm-wlm and munge (scripts/system_packages.sh does, as root)"
        )
    return None


@dataclass(frozen=True)
class SlurmNode:
    """A node as `sinfo` shows it: its state (idle, allocated, drained, ...) and reason."""

    name: str
    state: str
    reason: str


@dataclass
class SlurmCluster:
    """The cluster's files and daemons, and the Slurm commands run against it."""

    root: Path
    nodes: list[str]
    switches: dict[str, list[str]] = field(default_factory=dict)
    """topology.conf: leaf switch name -> its nodes (one top switch joins them)."""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment every Slurm command (and so every job) gets: SLURM_CONF."""
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": SEARCH_PATH}

    def run(self, argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm command against this cluster; its output as text."""
        done = subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=30, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr}")
        return done

    def sbatch(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
        """Submit a batch job; its id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *argv],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(argv)} failed: {done.stderr}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList, ...); {} when gone."""
        done = self.run(["scontrol", "show", "job", "--oneliner", job_id], check=False)
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout)) if done.returncode == 0 else {}

    def jobs(self) -> dict[str, str]:
        """Job id -> name of every job Slurm still lists as pending or running."""
        out = self.run(["squeue", "--noheader", "--format=%i %j"]).stdout
        return dict(line.split(" ", 1) for line in out.splitlines() if line.strip())

    def cancel_all(self) -> None:
        """Cancel every job and wait until Slurm lists none (their processes ended)."""
        jobs = list(self.jobs())
        if jobs:
            self.run(["scancel", *jobs], check=False)
        deadline = time.monotonic() + STOP_TIMEOUT
        while self.jobs() and time.monotonic() < deadline:
            time.sleep(POLL)

    def sinfo(self) -> dict[str, SlurmNode]:
        out = self.run(["sinfo", "--noheader", "--Node", "--format=%N|%T|%E"]).stdout
        found = {}
        for line in out.splitlines():
            name, state, reason = line.split("|", 2)
            found[name] = SlurmNode(name, state, reason)
        return found

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        """The job once it ended (JobState COMPLETED, FAILED, CANCELLED, ...)."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm job {job_id} still {job.get('JobState')}: {job}")
            time.sleep(POLL)

    def log(self, name: str) -> str:
        path = self.root / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- start and stop --------------------------------------------------------------

    def start(self) -> None:
        for sub in ("munge", "state", "spool", "run", "log"):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        self._start_munge()
        self._write_config()
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._await_nodes_idle()

    def stop_controller(self) -> None:
        """Stop slurmctld (its state is saved; jobs and slurmd go on without it)."""
        proc = self.procs["slurmctld"]
        proc.terminate()
        proc.wait(STOP_TIMEOUT)

    def start_controller(self) -> None:
        """Start slurmctld again from its saved state; back once it answers."""
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._until(
            lambda: self.run(["sinfo", "--noheader"], check=False).returncode == 0,
            "slurmctld answered again",
        )

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",  # root, and a socket directory only root can reach
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
            ],
        )
        self._until(lambda: self.munge_socket.exists(), "munged made its socket")

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    def _write_config(self) -> None:
        root = self.root
        lines = [
            "ClusterName=pitstoptest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={free_listen_port()}",
            f"SlurmdPort={free_listen_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}/%n",
            f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log'}/slurmd-%n.log",
            # No cgroups here: processes are tracked by parentage, tasks are not bound.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "KillWait=5",
            "TopologyPlugin=topology/tree" if self.switches else "TopologyPlugin=topology/none",
        ]
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 "
                f"Port={free_listen_port()} CPUs=1 State=UNKNOWN"
            )
        lines.append("PartitionName=pitstop Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        if self.switches:
            topology = [f"SwitchName={s} Nodes={','.join(n)}" for s, n in self.switches.items()]
            topology.append(f"SwitchName=top Switches={','.join(self.switches)}")
            (self.root / "topology.conf").write_text("\n".join(topology) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        with (self.root / "log" / f"{name}.out").open("ab") as out:
            self.procs[name] = subprocess.Popen(
                argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )

    def _until(self, ready: Callable[[], bool], what: str, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    out = (self.root / "log" / f"{name}.out").read_text(errors="replace")
                    raise RuntimeError(f"{name} exited ({proc.returncode}) before {what}: {out}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"not in {timeout:g} s: {what}")
            time.sleep(POLL)

    def _await_nodes_idle(self) -> None:
        def idle() -> bool:
            done = self.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], check=False)
            states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
            return done.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes)

        self._until(idle, f"every node ({', '.join(self.nodes)}) idle in sinfo")

    def stop(self) -> None:
        """Cancel every job and wait for its processes, stop the daemons (SIGTERM, then
        SIGKILL), then kill whatever process still carries this cluster's SLURM_CONF in
        its environment (a job's process that outlived its step)."""
        with contextlib.suppress(Exception):
            if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
                self.cancel_all()
        for name in [n for n in self.procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_TIMEOUT)
        for pid in self.leftover_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def leftover_pids(self) -> list[int]:
        """Processes (other than this one) whose environment names this cluster's conf."""
        tag = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if tag in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
        return found


@contextlib.contextmanager
def running_slurm(
    root: Path, nodes: Sequence[str], switches: Mapping[str, Sequence[str]] | None = None
) -> Iterator[SlurmCluster]:
    """A Slurm cluster of `nodes` in `root`, up for the block and down after it."""
    cluster = SlurmCluster(root, list(nodes), {s: list(n) for s, n in (switches or {}).items()})
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
