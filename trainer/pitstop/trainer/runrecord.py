"""What a generation of a job runs, for the job's record (`pitstop job record`): rank 0
reports its code (the git tree of its working directory), its software environment
and the data digest the script stated (`Session.record_data`), once per generation,
as its first step of that generation begins.

The environment variables the job's spec set are not reported from here: a rank cannot
tell them from the agent's and its own, and the scheduler has them in the spec (the
agent starts every rank with them, and a spec may not set a name pitstop sets), so the
scheduler fills them in when it stores the report.

Nothing here ends a run: a report that cannot be sent is logged.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import platform
import threading

import torch

from pitstop.common.codeversion import code_version
from pitstop.rankside.rankclient import RankControlClient
from pitstop.v1 import agent_pb2

log = logging.getLogger(__name__)

IMAGE_ENV = "PITSTOP_IMAGE"
"""Where a launcher (a container image's entrypoint, the Helm chart) says which image runs."""
MAX_TEXT = 4096
"""The longest data digest or source a script may state."""


def environment_version() -> agent_pb2.EnvironmentVersion:
    """This process's Python, torch, pitstop, CUDA and NCCL versions and its image."""
    found = agent_pb2.EnvironmentVersion(
        python=platform.python_version(),
        torch=str(torch.__version__),
        cuda=torch.version.cuda or "",
        image=os.environ.get(IMAGE_ENV, ""),
    )
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        found.pitstop = importlib.metadata.version("pitstop")
    try:
        if torch.cuda.is_available():
            nccl = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
            found.nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception as exc:  # no NCCL in this build, or a driver that is not there
        log.debug("no NCCL version: %s", exc)
    return found


def checked_text(name: str, value: str) -> str:
    """`value` when a script may state it as `name`; else ValueError saying why."""
    if not isinstance(value, str):
        raise TypeError(f"Session.record_data {name} must be a str, not {type(value).__name__}")
    if "\x00" in value or len(value) > MAX_TEXT:
        raise ValueError(
            f"Session.record_data {name}={value[:40]!r}...: give at most {MAX_TEXT} "
            "characters and no NUL, e.g. a hex SHA-256 of the dataset's manifest"
        )
    return value


class RunRecorder:
    """Rank 0's reports, one per generation. Code and environment are looked at once
    per process, in a thread started with the session: git on a large tree takes a
    while, and a replacement rank 0's first step, on a recovery's critical path, must not
    wait for it (it runs beside the restore and the rendezvous). The data digest is
    whatever was stated last."""

    def __init__(self, *, look_now: bool = True) -> None:
        """`look_now`: start looking at once (rank 0); else only if this process ever
        reports (a rank renumbered to 0)."""
        self.data_digest = ""
        self.data_source = ""
        self._reported = -1  # the generation last reported
        self._code = agent_pb2.CodeVersion()
        self._environment = agent_pb2.EnvironmentVersion()
        self._looking = threading.Thread(target=self._look, name="run-record", daemon=True)
        if look_now:
            self._looking.start()

    def _look(self) -> None:
        try:
            self._code = code_version(os.getcwd())
            self._environment = environment_version()
        except Exception as exc:  # never the run's: the record says less
            log.warning("the code and environment of this run could not be read: %s", exc)

    def due(self, generation: int) -> bool:
        """Whether `generation` has not been reported yet."""
        return generation != self._reported

    def record(self, generation: int, start_step: int) -> agent_pb2.RunRecord:
        """The report of `generation`, started from `start_step` (once the look at the
        code and environment is done: at most git's bound, 10 s, and long done by the
        first step in practice)."""
        if self._looking.ident is None:
            self._looking.start()
        self._looking.join()
        return agent_pb2.RunRecord(
            generation=generation,
            code=self._code,
            environment=self._environment,
            data_digest=self.data_digest,
            data_source=self.data_source,
            start_step=start_step,
        )

    def report(self, control: RankControlClient, generation: int, start_step: int) -> None:
        """Send `generation`'s report through the agent (once; a failure is logged and
        not tried again)."""
        self._reported = generation
        try:
            control.report_run_record(self.record(generation, start_step))
        except Exception as exc:  # grpc.RpcError, or git/torch trouble: never the run's
            log.warning(
                "rank %d: the run record of generation %d was not reported: %s",
                control.rank,
                generation,
                exc,
            )
