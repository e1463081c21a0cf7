"""The Slurm commands the adapter runs (sinfo, scontrol, squeue, sbatch), through a runner
that a test can replace, and their output read into plain data. Nothing here decides."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# sinfo's long state names end in a flag: * not responding, ~ powered off, # powering
# up, ! pending power down, % powering down, $ maintenance, @ pending reboot, ^ rebooting,
# - planned by the backfill scheduler.
_STATE_FLAGS = "*~#!%$@^-+"
_SBATCH_ID = re.compile(r"^(?:Submitted batch job )?(\d+)(?:;\S+)?\s*$", re.MULTILINE)


@dataclass(frozen=True)
class CommandResult:
    """What a command printed and how it ended (127: it could not be run; 124: it ran
    past its timeout and was killed)."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        """One line for a log: the command, its exit and what it said."""
        said = " ".join((self.stderr or self.stdout).split())[:300]
        return f"{' '.join(self.argv)} exited {self.returncode}" + (f": {said}" if said else "")


class CommandRunner(Protocol):
    """Runs one command (argv, no shell) and returns how it went; never raises for the
    command's own failure."""

    async def __call__(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> CommandResult: ...


class SubprocessRunner:
    """The real runner: a child process with a timeout, killed when it runs over."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    async def __call__(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        args = tuple(argv)
        try:
            proc = await asyncio.create_subprocess_exec(
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=None if env is None else dict(env),
            )
        except OSError as exc:
            return CommandResult(args, 127, "", f"cannot run {args[0]}: {exc.strerror or exc}")
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return CommandResult(args, 124, "", f"no answer within {self.timeout:g} s")
        code = proc.returncode if proc.returncode is not None else -1
        return CommandResult(args, code, out.decode(errors="replace"), err.decode(errors="replace"))


@dataclass(frozen=True)
class SlurmNode:
    """A node as Slurm shows it: its state (sinfo's long name: idle, allocated, drained,
    draining, down, ...) and the reason set on it ("" for none)."""

    name: str
    state: str
    reason: str

    @property
    def drained(self) -> bool:
        """Drained, or draining (its jobs still run; nothing new lands on it)."""
        return self.state.rstrip(_STATE_FLAGS).lower() in ("drained", "draining", "drain")


def parse_sinfo(text: str) -> dict[str, SlurmNode]:
    """`sinfo --noheader --Node --format=%N|%T|%E` into nodes by name (a node in several
    partitions is listed once per partition; the reason, last, may hold anything)."""
    nodes: dict[str, SlurmNode] = {}
    for line in text.splitlines():
        parts = line.split("|", 2)
        if len(parts) != 3 or not parts[0].strip():
            continue
        name, state, reason = (p.strip() for p in parts)
        nodes[name] = SlurmNode(name, state, "" if reason == "none" else reason)
    return nodes


def parse_squeue(text: str) -> dict[str, str]:
    """`squeue --noheader --format=%j|%i` into job name -> job id (the newest id where
    one name is listed twice)."""
    jobs: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, job_id = line.strip().rpartition("|")
        newer = sep and name and job_id.isdigit()
        if newer and (name not in jobs or int(job_id) > int(jobs[name])):
            jobs[name] = job_id
    return jobs


@dataclass(frozen=True)
class Allocation:
    """A running Slurm job on a node: its id and its comment (where the recipe marks an
    allocation whose pitstop daemons are about to stop: ENDING_COMMENT)."""

    job_id: str
    comment: str


def parse_allocations(text: str) -> list[Allocation]:
    """`squeue --noheader --format=%i|%k` into the jobs listed."""
    jobs = []
    for line in text.splitlines():
        job_id, sep, comment = line.strip().partition("|")
        if sep and job_id:
            jobs.append(Allocation(job_id, "" if comment == "(null)" else comment))
    return jobs


def parse_sbatch(text: str) -> str | None:
    """The job id sbatch printed (`--parsable`: "123" or "123;cluster"; otherwise
    "Submitted batch job 123"), or None."""
    found = _SBATCH_ID.search(text)
    return found.group(1) if found else None


class SlurmUnavailable(Exception):
    """Slurm did not answer a query (slurmctld down, a command missing, a timeout)."""


class Slurm:
    """The commands, from `bin_dir` when given (else PATH), through `runner`."""

    def __init__(self, runner: CommandRunner, bin_dir: Path | None = None) -> None:
        self.runner = runner
        self.bin_dir = bin_dir

    def _command(self, name: str) -> str:
        return name if self.bin_dir is None else str(self.bin_dir / name)

    async def nodes(self, names: Sequence[str]) -> dict[str, SlurmNode]:
        """The named nodes Slurm knows (one it does not know is left out)."""
        if not names:
            return {}
        done = await self.runner(
            [
                self._command("sinfo"),
                "--noheader",
                "--Node",
                f"--nodes={','.join(sorted(set(names)))}",
                "--format=%N|%T|%E",
            ]
        )
        if not done.ok:
            raise SlurmUnavailable(done.describe())
        return parse_sinfo(done.stdout)

    async def allocations(self, name: str) -> list[Allocation]:
        """The running jobs on the node (none: no allocation holds it)."""
        done = await self.runner(
            [
                self._command("squeue"),
                "--noheader",
                "--states=RUNNING",
                f"--nodelist={name}",
                "--format=%i|%k",
            ]
        )
        if not done.ok:
            raise SlurmUnavailable(done.describe())
        return parse_allocations(done.stdout)

    async def drain(self, name: str, reason: str) -> CommandResult:
        """Ask Slurm to drain the node with the reason (its running jobs go on)."""
        return await self.runner(
            [
                self._command("scontrol"),
                "update",
                f"nodename={name}",
                "state=drain",
                f"reason={reason}",
            ]
        )

    async def jobs_named(self, names: Sequence[str]) -> dict[str, str]:
        """Job name -> id of the pending or running jobs with these names."""
        if not names:
            return {}
        done = await self.runner(
            [
                self._command("squeue"),
                "--noheader",
                f"--name={','.join(sorted(set(names)))}",
                "--format=%j|%i",
            ]
        )
        if not done.ok:
            raise SlurmUnavailable(done.describe())
        return parse_squeue(done.stdout)

    async def submit(self, argv: Sequence[str], env: Mapping[str, str]) -> CommandResult:
        """Run the configured submission command (sbatch ...), as it is given."""
        return await self.runner(argv, env=env)
