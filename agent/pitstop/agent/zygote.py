"""The agent's own fork server (its zygote): a process that imported torch and the
trainer once, from which every rank and standby of the node is forked in milliseconds
instead of starting as a fresh interpreter (2 to 5 CPU-seconds of imports each).

With `fork_server: auto` (the default) the agent starts `python -m
pitstop.agent.forkserver --preload <fork_preload> --parent <agent pid>` beside its
socket, and starts it again with backoff when it exits (what it forked dies with it:
those ranks' exits are reported, and their job recovers as from any rank's death).
Until it serves, and while it is down, ranks start as fresh processes: nothing waits
for it. A zygote that cannot import what it was told to preload (exit status 2) is not
started again: the agent says so once and starts its ranks fresh.

CUDA is never initialised in the zygote (pitstop.agent.forkserver); a forked rank
initialises it as a fresh process would. A script that cannot be forked (it reads
start-up environment variables the agent's own differ in, or needs a fresh
interpreter) runs with `fork_server: off`, or its job's command is refused by the
server and started fresh (logged with the reason)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pitstop.agent.config import ENV_PREFIX
from pitstop.agent.liveness import RestartBackoff

log = logging.getLogger(__name__)

BAD_PRELOAD_EXIT = 2
"""The fork server's exit status when a module to preload cannot be imported."""
STOP_GRACE_SECONDS = 5.0


def zygote_socket(agent_socket: Path) -> Path:
    """Where an agent's own fork server listens: beside the agent's socket."""
    return agent_socket.with_suffix(".zygote")


class Zygote:
    """Keeps the agent's fork server running (`run`) until `close`."""

    def __init__(
        self,
        socket_path: Path,
        preload: str,
        log_path: Path,
        *,
        backoff: RestartBackoff | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.preload = preload
        self.log_path = log_path
        self.starts = 0
        self._backoff = backoff or RestartBackoff(first=1.0, longest=30.0)
        self._process: asyncio.subprocess.Process | None = None
        self._closing = False
        self._gave_up = False

    @property
    def pid(self) -> int | None:
        """The running fork server's process id; None while none runs."""
        process = self._process
        return process.pid if process is not None and process.returncode is None else None

    @property
    def gave_up(self) -> bool:
        """It could not import what it was told to preload: not started again."""
        return self._gave_up

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "pitstop.agent.forkserver",
            "--socket",
            str(self.socket_path),
            "--preload",
            self.preload,
            "--parent",
            str(os.getpid()),
        ]

    async def run(self, stop: asyncio.Event) -> None:
        """Start the fork server, and again whenever it exits, until `stop` is set."""
        while not stop.is_set() and not self._closing:
            started = time.monotonic()
            try:
                returncode = await self._run_once(stop)
            except OSError as exc:
                log.error("cannot start the fork server: %s; ranks start fresh", exc)
                returncode = None
            if stop.is_set() or self._closing:
                return
            ran = time.monotonic() - started
            if returncode == BAD_PRELOAD_EXIT:
                self._gave_up = True
                log.error(
                    "the fork server cannot import %r (see %s): ranks start as fresh "
                    "processes; set fork_preload to importable modules, or fork_server: off",
                    self.preload,
                    self.log_path,
                )
                return
            delay = self._backoff.after_exit(ran)
            log.warning(
                "the fork server exited (%s) after %.1f s; what it forked died with it; "
                "starting it again in %.1f s (its output: %s)",
                "status unknown" if returncode is None else f"status {returncode}",
                ran,
                delay,
                self.log_path,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    async def _run_once(self, stop: asyncio.Event) -> int:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as output:
            process = await asyncio.create_subprocess_exec(
                *self.argv(),
                # A forked process's /proc/<pid>/environ is the server's: none of the
                # agent's own settings (a join token) in it.
                env={k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)},
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # not in the agent's group: stopped by close()
            )
        self._process = process
        self.starts += 1
        log.info(
            "started the fork server as pid %d (preloading %s; output in %s)",
            process.pid,
            self.preload,
            self.log_path,
        )
        waiting = asyncio.ensure_future(process.wait())
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not waiting.done():  # stopping: close() ends it
            waiting.cancel()
            return 0
        return waiting.result()

    async def close(self) -> None:
        """Stop the fork server (SIGTERM, SIGKILL after a grace); call after the ranks
        stopped."""
        self._closing = True
        process = self._process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), STOP_GRACE_SECONDS)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
