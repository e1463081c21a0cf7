"""The agent's watch over its node's checkpoint daemon.

Every `checkpointd_probe_seconds` the agent calls grpc.health.v1.Health/Check on the
daemon at `checkpointd_address`, with a short deadline. SERVING is an answer, and so is
UNIMPLEMENTED: the daemon's gRPC server answered, it only serves no health service. A
dead daemon gives UNAVAILABLE, a hung one DEADLINE_EXCEEDED. While the daemon is down
every heartbeat carries a condition naming it, with the WARNING verdict (there is no
milder one that the scheduler acts on): without it, snapshots and restores on this node
fail, so the node must not be trusted with a recovery. An outage that ends between two
heartbeats is still reported, once, in the next.

With `checkpointd_command` the agent owns the daemon: it starts it where nothing listens
at the address (a daemon left by an earlier agent is probed, never doubled: two would
share the port), starts it again with backoff when its process exits, kills and
restarts it when it has not answered for `checkpointd_hang_seconds` (or, still starting,
for START_TIMEOUT_SECONDS), and stops it when the agent stops. Its output goes to
<state_dir>/checkpointd.log. Without a command the daemon belongs to systemd or the
local cluster: it is only probed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from pitstop.agent.checkpointd_probe import HealthProbe
from pitstop.agent.conditions import NodeCondition
from pitstop.agent.config import AgentSettings
from pitstop.agent.liveness import DaemonLiveness, Liveness, RestartBackoff
from pitstop.agent.metrics import AgentMetrics
from pitstop.common.tls import NodeIdentity
from pitstop.v1 import common_pb2

log = logging.getLogger(__name__)

START_GRACE_SECONDS = 15.0
"""How long a daemon that never answered yet may take to start before it counts as down."""
START_TIMEOUT_SECONDS = 60.0
"""How long a daemon the agent started may take to answer before it is killed as hung."""
STOP_GRACE_SECONDS = 5.0
KILL_WAIT_SECONDS = 10.0
DOWN_VERDICT = common_pb2.HEALTH_VERDICT_DEGRADED
LOG_NAME = "checkpointd.log"


def _nothing() -> None:
    return None


class CheckpointdWatch:
    """Probes the node's checkpoint daemon and, when the agent owns it, keeps it running.
    `start` it on the agent's event loop; `close` stops the probes and an owned daemon.
    `on_change` is called whenever the daemon goes up or down."""

    def __init__(
        self,
        settings: AgentSettings,
        metrics: AgentMetrics,
        *,
        on_change: Callable[[], None] = _nothing,
        clock: Callable[[], float] = time.monotonic,
        backoff: RestartBackoff | None = None,
        identity: NodeIdentity | None = None,
    ) -> None:
        self.address = settings.checkpointd_address
        self._argv = settings.checkpointd_argv
        self._interval = settings.checkpointd_probe_seconds
        self._misses_to_down = settings.checkpointd_probe_misses
        self._hang_seconds = settings.checkpointd_hang_seconds
        self._prober = HealthProbe(self.address, settings.token, identity)
        self.log_path = settings.state_dir / LOG_NAME
        self._node_id = settings.node_id
        self._metrics = metrics
        self._on_change = on_change
        self._clock = clock
        self._backoff = backoff or RestartBackoff()
        self.liveness = DaemonLiveness(self._misses_to_down, START_GRACE_SECONDS, clock())
        self.starts = 0
        """Times the agent started the daemon's process."""
        self._process: asyncio.subprocess.Process | None = None
        self._killed: int | None = None  # pid of a hung process killed, until it is reaped
        self._exit_watcher: asyncio.Task[None] | None = None
        self._next_start_at = 0.0
        self._down_since: float | None = None
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()

    @property
    def owned(self) -> bool:
        """Whether the agent starts and restarts the daemon itself."""
        return bool(self._argv)

    @property
    def pid(self) -> int | None:
        """Process id of the daemon the agent runs now, if any."""
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Probe from now on (and start an owned daemon that does not answer)."""
        self.liveness = DaemonLiveness(self._misses_to_down, START_GRACE_SECONDS, self._clock())
        self._task = asyncio.create_task(self._run(), name=f"checkpointd watch {self.address}")
        log.info(
            "watching the checkpoint daemon at %s (%s), a probe every %.1f s",
            self.address,
            f"owned: {shlex.join(self._argv)}" if self.owned else "external: probed only",
            self._interval,
        )

    async def close(self, grace_seconds: float = STOP_GRACE_SECONDS) -> None:
        """Stop probing and stop an owned daemon (SIGTERM, SIGKILL after the grace)."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._stop_process(grace_seconds)
        if self._exit_watcher is not None:
            self._exit_watcher.cancel()
            await asyncio.gather(self._exit_watcher, return_exceptions=True)
        await self._prober.close()

    def conditions(self) -> list[NodeCondition]:
        """The daemon's condition for this heartbeat: down now, or down since the last."""
        cause = self.liveness.report()
        if not cause:
            return []
        reason = f"checkpoint daemon at {self.address} is down: {cause}"
        return [NodeCondition(DOWN_VERDICT, reason)]

    async def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Whether `predicate` holds, looked at after every change, within `timeout` s."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return True

    async def _run(self) -> None:
        while True:
            try:
                await self._tick()
            except Exception:  # a bug here must not end the watch
                log.exception("watching the checkpoint daemon at %s failed", self.address)
            await self._pause()

    async def _tick(self) -> None:
        why, unreachable = await self._prober.probe()
        now = self._clock()
        if why is None:
            changed = self.liveness.answered(now)
            if changed and self.owned and self._process is None and self.starts == 0:
                log.warning(
                    "a checkpoint daemon this agent did not start answers at %s (left by an "
                    "earlier agent?): it is probed, and the agent starts its own only once "
                    "it stops answering",
                    self.address,
                )
        else:
            changed = self.liveness.missed(now, why)
            log.debug("checkpoint daemon at %s: probe unanswered: %s", self.address, why)
        if changed:
            self._announce(now)
        if not self.owned or self._closing:
            return
        if changed and why is not None and not unreachable and self._process is None:
            log.warning(
                "something listens at %s but does not answer (a hung checkpoint daemon this "
                "agent did not start?): the agent starts its own only once nothing listens "
                "there, since two would share the port",
                self.address,
            )
        if self._process is not None:
            hung = self.liveness.hung(now, self._hang_seconds, START_TIMEOUT_SECONDS)
            if hung and self._killed != self._process.pid:
                self._killed = self._process.pid
                silent = self.liveness.silent_for(now)
                log.error(
                    "checkpoint daemon at %s (pid %d) has not answered for %.0f s: killing it "
                    "to start it again",
                    self.address,
                    self._process.pid,
                    silent,
                )
                # SIGKILL at once: a hung daemon would not act on SIGTERM, and the next
                # one removes the shared memory this one leaves. Its exit is seen as any.
                _signal_group(self._process.pid, signal.SIGKILL)
        elif unreachable and now >= self._next_start_at:
            await self._start_process(now)

    async def _pause(self) -> None:
        timeout = self._interval
        until_start = self._next_start_at - self._clock()
        if self.owned and self._process is None and until_start > 0:
            timeout = min(timeout, until_start)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)
        self._wake.clear()

    def _announce(self, now: float) -> None:
        gauge = self._metrics.checkpointd_up.labels(self._node_id, self.address)
        if self.liveness.state is Liveness.DOWN:
            gauge.set(0)
            self._down_since = now
            log.warning(
                "checkpoint daemon at %s is down: %s; the node reports itself degraded until "
                "it answers again",
                self.address,
                self.liveness.cause,
            )
        elif self.liveness.state is Liveness.UP:
            gauge.set(1)
            if self._down_since is not None:
                log.info(
                    "checkpoint daemon at %s answers again after %.1f s down",
                    self.address,
                    now - self._down_since,
                )
            else:
                log.info("checkpoint daemon at %s answers", self.address)
            self._down_since = None
        self._on_change()
        self._notify()

    async def _start_process(self, now: float) -> None:
        try:
            output = _open_log(self.log_path)
            try:
                process = await asyncio.create_subprocess_exec(
                    *self._argv,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own group: stopped with what it forks
                )
            finally:
                output.close()  # the child holds its own descriptor
        except OSError as exc:
            delay = self._backoff.after_exit(0.0)
            self._next_start_at = now + delay
            log.error(
                "cannot start the checkpoint daemon with %r: %s; trying again in %.1f s; "
                "fix checkpointd_command",
                shlex.join(self._argv),
                exc.strerror or exc,
                delay,
            )
            if self.liveness.exited(now, f"its command cannot be started: {exc.strerror or exc}"):
                self._announce(now)
            return
        if self.starts:
            self._metrics.checkpointd_restarts.labels(self._node_id).inc()
        self.starts += 1
        self._process = process
        self.liveness.started(now)
        self._exit_watcher = asyncio.create_task(self._await_exit(process, now))
        log.info(
            "started the checkpoint daemon for %s as pid %d (start %d; output in %s)",
            self.address,
            process.pid,
            self.starts,
            self.log_path,
        )
        self._notify()

    async def _await_exit(self, process: asyncio.subprocess.Process, started_at: float) -> None:
        returncode = await process.wait()
        _signal_group(process.pid, signal.SIGKILL)  # what it forked goes with it
        if self._process is process:
            self._process = None
        if self._closing:
            log.info("checkpoint daemon (pid %d) stopped", process.pid)
            self._notify()
            return
        now = self._clock()
        delay = self._backoff.after_exit(now - started_at)
        self._next_start_at = now + delay
        how = _exit_words(returncode)
        log.warning(
            "checkpoint daemon for %s (pid %d) %s after %.1f s; starting it again in %.1f s "
            "(its output: %s)",
            self.address,
            process.pid,
            how,
            now - started_at,
            delay,
            self.log_path,
        )
        if self.liveness.exited(now, f"its process {how}"):
            self._announce(now)
        self._wake.set()
        self._notify()

    async def _stop_process(self, grace_seconds: float) -> None:
        process, watcher = self._process, self._exit_watcher
        if process is None or watcher is None or watcher.done():
            return
        _signal_group(process.pid, signal.SIGTERM)
        done, _ = await asyncio.wait({watcher}, timeout=max(grace_seconds, 0.0))
        if done:
            return
        log.warning(
            "checkpoint daemon (pid %d) outlived SIGTERM by %.1f s: SIGKILL",
            process.pid,
            grace_seconds,
        )
        _signal_group(process.pid, signal.SIGKILL)
        done, _ = await asyncio.wait({watcher}, timeout=KILL_WAIT_SECONDS)
        if not done:
            log.error(
                "checkpoint daemon (pid %d) survives SIGKILL: stuck in the kernel?", process.pid
            )

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def _exit_words(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _open_log(path: Path) -> BinaryIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    output: BinaryIO = path.open("ab")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    output.write(f"--- pitstop-agent: checkpoint daemon starting at {stamp} ---\n".encode())
    output.flush()
    return output
