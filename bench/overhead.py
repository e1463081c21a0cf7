"""What a pitstop Session costs a training step.

The example job (pitstop.trainer.example, one process, CPU) runs two ways in the same
process, alternating in blocks so drift in the machine's speed hits both alike:

* bare: the training step in a plain loop, no Session;
* session: the same step under `Session.from_env()` with a snapshot into a real
  pitstop-checkpointd (a subprocess) after every step.

A step's time is the wall time from one iteration's start to the next's, so the
session's boundary work and commit are inside it. The snapshot stall is what
SnapshotWriter reports for each snapshot (the copy of what the next optimizer step
leaves alone) plus the time the next step's optimizer step waited for the copy of the
parameters and Adam's state, which runs beside its forward and backward
(`SnapshotWriter.copy_waited_seconds`): the rank's only stalls by design. The target:
the session's median step is at most 1.01 x (the bare median + the median stall), i.e.
everything else the session does costs under 1%.
"commit_bookkeeping" is the rest of each commit (capturing the state's tensors). The
*_cpu_* medians are the training thread's CPU time per step: unlike wall time they do
not grow when other processes (the daemon included) compete for the cores, so on a
busy machine they show the session's own cost apart from contention. What the
snapshots cost elsewhere, per snapshot, is measured too: the CPU of the daemon
(daemon_cpu_ms_per_snapshot: the SealSlot call, which also leases the next slot, the
header's check, the checksum) and of the rank's other threads
(seal_thread_cpu_ms_per_snapshot: that call, and gRPC's own threads). On 2 cores shared
with other work they compete with the training thread, which the 1% target leaves no
room for.

The integrity checks (pitstop.trainer.integrity) run inside the session's commit at
every snapshot: the state's digest, the verdict and what they add to the snapshot's
metadata are timed on their own here ("integrity_check_ms_median", one rank: no
exchange), and the exchange they add on a
data-parallel job (an all_gather of one 32-byte row per rank) is timed on a two-process
gloo group ("integrity_exchange_ms_median"); their sum against the bare step is
"integrity_share_of_step" (target <= 1%).

    .venv/bin/python bench/overhead.py [--steps 300] [--block 25]

Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pitstop.checkpointd.slots import remove_stale_segments, segment_prefix
from pitstop.client.launch import checkpointd_command
from pitstop.trainer import Session, TrainState
from pitstop.trainer.example import Job, parse_args


@contextmanager
def checkpointd() -> Iterator[tuple[str, int]]:
    """A pitstop-checkpointd subprocess without a scheduler; yields its address and
    process id."""
    node_id = f"bench-overhead-{uuid.uuid4().hex[:6]}"
    state_dir = tempfile.mkdtemp(prefix="pitstop-bench-")
    command = checkpointd_command(
        node_id=node_id,
        host="127.0.0.1",
        port=0,
        scheduler="",
        state_dir=state_dir,
        log_level="WARNING",
        as_module=True,
        extra=["--memory-budget-bytes", str(256 << 20), "--flush-every-steps", "100000"],
    )
    daemon = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert daemon.stdout is not None
        for line in daemon.stdout:
            if "listening on" in line:
                yield line.split("listening on ")[1].split()[0], daemon.pid
                break
        else:
            raise RuntimeError(f"checkpointd exited {daemon.wait()} before listening")
    finally:
        daemon.terminate()
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:  # a daemon that will not stop is not left behind
            daemon.kill()
            daemon.wait()
        remove_stale_segments(segment_prefix(node_id))
        shutil.rmtree(state_dir, ignore_errors=True)


def process_cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` so far (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """User and system CPU time of this process so far, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bare_block(
    job: Job, state: TrainState, steps: int, times: list[float], cpu: list[float]
) -> None:
    """`steps` training steps in a plain loop."""
    last, last_cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        job.train_step(state, state.step + 1, 0, 1)
        state.step += 1
        now, now_cpu = time.perf_counter(), time.thread_time()
        times.append(now - last)
        cpu.append(now_cpu - last_cpu)
        last, last_cpu = now, now_cpu


def session_block(
    job: Job,
    session: Session,
    state: TrainState,
    steps: int,
    times: list[float],
    cpu: list[float],
    stalls: list[float],
    bookkeeping: list[float],
) -> None:
    """`steps` training steps under the session, with each snapshot's stall and the
    rest of each commit (capturing the state, reporting)."""
    last, last_cpu = time.perf_counter(), time.thread_time()
    assert session.writer is not None
    waited = session.writer.copy_waited_seconds
    for step in session.steps(state, until=state.step + steps):
        loss = job.train_step(state, step, session.rank, session.world_size)
        before = time.perf_counter()
        session.commit(state, loss=loss)
        after = time.perf_counter()
        assert session.last_snapshot is not None
        stall = session.last_snapshot.stall_seconds
        stalls.append(stall + session.writer.copy_waited_seconds - waited)
        waited = session.writer.copy_waited_seconds
        bookkeeping.append(after - before - stall)
        now_cpu = time.thread_time()
        times.append(after - last)
        cpu.append(now_cpu - last_cpu)
        last, last_cpu = after, now_cpu


def _exchange_rank(rank: int, store_path: str, rounds: int, out: str) -> None:
    """One of two gloo ranks: `rounds` exchanges of an integrity row, timed."""
    import torch.distributed as dist
    from torch.distributed import FileStore  # type: ignore[attr-defined]

    from pitstop.trainer.integrity import Row, exchange

    store = FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    row, times = Row(digest=12345, loss=2.5, grad_norm=0.7), []
    try:
        for _ in range(rounds):
            began = time.perf_counter()
            exchange(row, 2, torch.device("cpu"))
            times.append(time.perf_counter() - began)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as file:
            json.dump(times, file)


def exchange_ms(rounds: int = 300) -> float:
    """Median seconds of the checks' all_gather between two gloo processes, in ms."""
    from torch.multiprocessing.spawn import spawn

    folder = tempfile.mkdtemp(prefix="pitstop-bench-")
    try:
        out = os.path.join(folder, "times.json")
        store = os.path.join(folder, "store")
        spawn(_exchange_rank, args=(store, rounds, out), nprocs=2)  # type: ignore[no-untyped-call]
        with open(out) as file:
            times = json.load(file)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return float(statistics.median(times[rounds // 10 :]) * 1e3)


def timed_checks(session: Session, into: list[float], kept: list[float]) -> None:
    """Time every integrity check the session runs (the digest and the verdict), and what
    the checks add to every snapshot's metadata (the loss window, the skipped steps)."""
    check, metadata = session.checks.check, session.checks.metadata

    def timed_check(*args: object, **kwargs: object) -> bool:
        began = time.perf_counter()
        try:
            return check(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            into.append(time.perf_counter() - began)

    def timed_metadata() -> dict[str, str]:
        began = time.perf_counter()
        try:
            return metadata()
        finally:
            kept.append(time.perf_counter() - began)

    session.checks.check = timed_check  # type: ignore[method-assign]
    session.checks.metadata = timed_metadata  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="measured steps per variant")
    parser.add_argument("--block", type=int, default=10, help="steps per alternating block")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured steps per variant")
    options = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    args = parse_args(["--steps", str(options.steps + options.warmup)])
    with checkpointd() as (address, daemon_pid):
        os.environ.update(PITSTOP_CHECKPOINTD=address, PITSTOP_JOB_ID="bench-overhead")
        os.environ["PITSTOP_SNAPSHOT_EVERY"] = "1"
        with Session.from_env() as session:
            job = Job(args, session.device)
            bare_state = job.make_state()
            session_state = session.restore(default=job.make_state)
            bare: list[float] = []
            timed: list[float] = []
            bare_cpu: list[float] = []
            timed_cpu: list[float] = []
            stalls: list[float] = []
            bookkeeping: list[float] = []
            checks: list[float] = []
            kept: list[float] = []
            timed_checks(session, checks, kept)
            bare_block(job, bare_state, options.warmup, [], [])
            session_block(job, session, session_state, options.warmup, [], [], [], [])
            if session.writer is not None:
                session.writer.settle()
            daemon_before, own_before = process_cpu_seconds(daemon_pid), own_cpu_seconds()
            main_before = time.thread_time()
            while len(bare) < options.steps:
                bare_block(job, bare_state, options.block, bare, bare_cpu)
                session_block(
                    job,
                    session,
                    session_state,
                    options.block,
                    timed,
                    timed_cpu,
                    stalls,
                    bookkeeping,
                )
                print(f"{len(bare)} steps per variant", file=sys.stderr)
            if session.writer is not None:
                session.writer.settle()
            daemon_cpu = process_cpu_seconds(daemon_pid) - daemon_before
            main_cpu = time.thread_time() - main_before
            others_cpu = own_cpu_seconds() - own_before - main_cpu
            snapshot_bytes = session.last_snapshot.size_bytes if session.last_snapshot else 0
    print("timing the checks' exchange on two gloo processes", file=sys.stderr)
    exchange = exchange_ms()
    check_ms = statistics.median(checks[options.warmup :]) * 1e3
    check_ms += statistics.median(kept[options.warmup :]) * 1e3
    bare_ms = statistics.median(bare) * 1e3
    session_ms = statistics.median(timed) * 1e3
    stall_ms = statistics.median(stalls) * 1e3
    print(
        json.dumps(
            {
                "bench": "trainer_overhead",
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "steps_per_variant": len(bare),
                "snapshot_bytes": snapshot_bytes,
                "bare_step_ms_median": round(bare_ms, 3),
                "session_step_ms_median": round(session_ms, 3),
                "snapshot_stall_ms_median": round(stall_ms, 3),
                "commit_bookkeeping_ms_median": round(statistics.median(bookkeeping) * 1e3, 3),
                "daemon_cpu_ms_per_snapshot": round(daemon_cpu / len(stalls) * 1e3, 3),
                "seal_thread_cpu_ms_per_snapshot": round(others_cpu / len(stalls) * 1e3, 3),
                "bare_step_cpu_ms_median": round(statistics.median(bare_cpu) * 1e3, 3),
                "session_step_cpu_ms_median": round(statistics.median(timed_cpu) * 1e3, 3),
                "load_average_1m": round(os.getloadavg()[0], 2),
                "ratio_session_to_bare": round(session_ms / bare_ms, 4),
                "ratio_session_to_bare_plus_stall": round(session_ms / (bare_ms + stall_ms), 4),
                "ratio_session_cpu_to_bare_cpu_plus_stall": round(
                    statistics.median(timed_cpu) / (statistics.median(bare_cpu) + stall_ms / 1e3),
                    4,
                ),
                "integrity_check_ms_median": round(check_ms, 4),
                "integrity_exchange_ms_median": round(exchange, 4),
                "integrity_share_of_step": round((check_ms + exchange) / bare_ms, 4),
                "integrity_target": "check + exchange <= 1% of the bare step",
                "integrity_target_met": check_ms + exchange <= 0.01 * bare_ms,
                "target": "session <= 1.01 x (bare + snapshot stall)",
                "target_met": session_ms <= 1.01 * (bare_ms + stall_ms),
            }
        )
    )


if __name__ == "__main__":
    main()
