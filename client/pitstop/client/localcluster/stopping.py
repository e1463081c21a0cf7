"""Stopping a local cluster: a node as a dying host would go (kill_node), or all of it
(down): the agents, then the checkpoint daemons, then the scheduler and its embedded
stores, then whatever else carries the cluster's tag, SIGTERM before SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence

from pitstop.client.localcluster.errors import ClusterError
from pitstop.client.localcluster.nodecommands import binary
from pitstop.client.localcluster.processes import (
    pid_alive,
    rank_pids,
    signal_group,
    signal_rank,
    store_processes,
    tagged_processes,
    wait_gone,
)
from pitstop.client.localcluster.settings import KILL_WAIT, LOCK_WAIT, STOP_TIMEOUT
from pitstop.client.localcluster.statefile import (
    ClusterProcess,
    ClusterState,
    locked,
    wipe_state_dir,
)
from pitstop.client.netns import destroy as destroy_network


class ClusterStopper:
    """Stops the daemons of the cluster `record`."""

    def __init__(self, record: ClusterState) -> None:
        self.record = record

    def kill_node(
        self, node_id: str, sig: signal.Signals = signal.SIGKILL, *, wait: bool = True
    ) -> list[int]:
        """Signal the node's agent, its checkpointd and its ranks (each a process group
        of its own), as a dying host would; return the pids signalled. With `wait`,
        return only once they are gone (ClusterError if they outlive KILL_WAIT s after
        SIGKILL; after another signal, wait for them to exit on their own)."""
        ranks = self.record.rank_pids(node_id)
        # The recorded daemons, and a checkpoint daemon its agent started again.
        daemons = self.record.daemon_pids(node_id, "agent") + self.record.daemon_pids(
            node_id, "checkpointd"
        )
        for pid in daemons:
            signal_group(pid, sig)
        for pid in ranks:
            signal_rank(pid, sig)
        pids = daemons + ranks
        if wait:
            limit = KILL_WAIT if sig == signal.SIGKILL else STOP_TIMEOUT
            left = wait_gone(pids, limit, self.record._pid_alive)
            if left:
                raise ClusterError(
                    f"node {node_id}: pids {', '.join(map(str, left))} outlived "
                    f"{sig.name} by {limit:.0f} s"
                )
        return pids

    def kill_scheduler(
        self, name: str, sig: signal.Signals = signal.SIGKILL, *, wait: bool = True
    ) -> None:
        """Signal the scheduler `name` (its process group); with `wait`, return once it
        is gone (ClusterError if it outlives KILL_WAIT s, or STOP_TIMEOUT s after
        another signal than SIGKILL)."""
        proc = self.record.process(name)
        if not self.record.is_alive(proc):
            return
        signal_group(proc.pid, sig)
        if wait:
            limit = KILL_WAIT if sig == signal.SIGKILL else STOP_TIMEOUT
            if wait_gone([proc.pid], limit, self.record._pid_alive):
                raise ClusterError(f"{name} (pid {proc.pid}) outlived {sig.name} by {limit:.0f} s")
        self.record._forget_children([proc.pid])

    def down(self, *, timeout: float = STOP_TIMEOUT, wipe: bool = False) -> list[ClusterProcess]:
        """Stop the agents, then the checkpoint daemons, then the scheduler: SIGTERM
        to each process group, SIGKILL after `timeout` s. Ranks left behind and the
        scheduler's embedded stores go too, and so does any process the cluster started
        that cluster.json does not name (found by `CLUSTER_ENV`). From then on this object
        starts nothing (a thread restarting a node is refused). Removes cluster.json, and
        with `wipe` the whole state dir. Returns the daemons that were running, recorded
        or not. ClusterError when a process survives SIGKILL (cluster.json is kept then)."""
        with self.record._lock:
            self.record._closed = True
        with locked(self.record.state_dir, wait=LOCK_WAIT):
            was_running = self.record.running()
            strays = self.stop_all(timeout)
            self.record.state_file.unlink(missing_ok=True)
        if wipe:
            wipe_state_dir(self.record.state_dir)
        return was_running + strays

    def stop_all(self, timeout: float) -> list[ClusterProcess]:
        """Stop every recorded process, stage by stage, then the unrecorded ones; returns
        the unrecorded daemons that were found."""
        sockets = {p.node_id: p.socket for p in self.record.processes if p.kind == "agent"}
        ranks = [pid for pids in rank_pids(sockets).values() for pid in pids]
        killed_checkpointds: list[ClusterProcess] = []
        for kind in ("agent", "checkpointd", "scheduler"):
            stage = [p for p in self.record.processes if p.kind == kind]
            dead_before = [p for p in stage if not self.record.is_alive(p)]
            killed = self.stop_processes(stage, timeout)
            if kind == "agent":
                for pid in ranks:
                    signal_rank(pid, signal.SIGKILL)
                ranks = wait_gone(ranks, KILL_WAIT, self.record._pid_alive)
            if kind == "checkpointd":
                killed_checkpointds = dead_before + killed
            if kind == "scheduler":
                self.stop_stores(timeout)
        strays = self.stop_strays(timeout)
        self.cleanup_segments(killed_checkpointds + [p for p in strays if p.kind == "checkpointd"])
        left = [p for p in self.record.processes if self.record.is_alive(p)]
        if left or ranks:
            names = [f"{p.name} (pid {p.pid})" for p in left] + [f"rank pid {r}" for r in ranks]
            raise ClusterError(
                f"{', '.join(names)} survived SIGKILL (stuck in the kernel?); "
                f"{self.record.state_file} is kept"
            )
        self.record._forget_children(list(self.record._children))
        self.remove_network()
        return strays

    def stop_strays(self, timeout: float) -> list[ClusterProcess]:
        """Whatever still runs with this cluster's `CLUSTER_ENV`: a daemon cluster.json
        does not name, and what it started. Session leaders (daemons, ranks) get SIGTERM
        to their group first, SIGKILL after `timeout`; returns the daemons among them."""
        found = tagged_processes(self.record.state_dir)
        if not found:
            return []
        strays = [
            ClusterProcess.from_tagged(t, self.record.log_dir) for t in found if t.is_daemon()
        ]
        leaders = [t.pid for t in found if t.session_leader]
        for pid in leaders:
            signal_group(pid, signal.SIGTERM)
        wait_gone(leaders, timeout, pid_alive)
        left = tagged_processes(self.record.state_dir)
        for tagged in left:
            if tagged.session_leader:
                signal_group(tagged.pid, signal.SIGKILL)
            else:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(tagged.pid, signal.SIGKILL)
        still = wait_gone([t.pid for t in left], KILL_WAIT, pid_alive)
        if still:
            raise ClusterError(
                f"pids {', '.join(map(str, still))} of the cluster in {self.record.state_dir} "
                "survived SIGKILL (stuck in the kernel?)"
            )
        if strays:  # an unrecorded scheduler may have left its embedded stores
            self.stop_stores(timeout)
        return strays

    def remove_network(self) -> None:
        """Remove the namespaces and the bridge (once nothing runs in them)."""
        if self.record.network is None:
            return
        problems = destroy_network(self.record.network)
        if problems:
            raise ClusterError(
                f"could not remove the cluster's network namespaces: {'; '.join(problems)}; "
                f"{self.record.state_file} is kept, run pitstop cluster down again"
            )

    def stop_processes(
        self, procs: Sequence[ClusterProcess], timeout: float = STOP_TIMEOUT
    ) -> list[ClusterProcess]:
        """SIGTERM each running process's group, SIGKILL after `timeout`; returns the
        processes that needed SIGKILL."""
        running = [p for p in procs if self.record.is_alive(p)]
        for proc in running:
            signal_group(proc.pid, signal.SIGTERM)
        left = set(wait_gone([p.pid for p in running], timeout, self.record._pid_alive))
        killed = [p for p in running if p.pid in left]
        for proc in killed:
            signal_group(proc.pid, signal.SIGKILL)
        wait_gone([p.pid for p in killed], KILL_WAIT, self.record._pid_alive)
        return killed

    def stop_stores(self, timeout: float) -> None:
        """Embedded PostgreSQL and Redis of a scheduler that did not stop them (it was
        killed): they run in sessions of their own, outside its process group."""
        stores = store_processes(self.record.state_dir / "scheduler")
        for pid, sig in stores:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        left = wait_gone([pid for pid, _ in stores], timeout, pid_alive)
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def cleanup_segments(self, procs: Sequence[ClusterProcess]) -> None:
        """Shared-memory segments a killed checkpointd left in /dev/shm (a daemon that
        stops on SIGTERM removes its own)."""
        for proc in procs:
            with contextlib.suppress(OSError, subprocess.SubprocessError, ClusterError):
                subprocess.run(
                    [binary("pitstop-checkpointd"), "cleanup", "--node-id", proc.node_id],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=30,
                    check=False,
                )

    def reap_leftovers(self) -> None:
        """After a cluster whose daemons are all gone (killed, host rebooted): its ranks
        and embedded stores, if anything of them is left."""
        sockets = {p.node_id: p.socket for p in self.record.processes if p.kind == "agent"}
        for pids in rank_pids(sockets).values():
            for pid in pids:
                signal_rank(pid, signal.SIGKILL)
        self.stop_stores(KILL_WAIT)
        self.stop_strays(KILL_WAIT)
        self.remove_network()
