"""A rank's side of the agent's local endpoint: a small synchronous RankControl client.

Training scripts are plain synchronous programs, so this client is too. It imports
neither torch nor anything of the agent beyond the wire types, so a trainer library
can use it directly.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from pitstop.v1 import agent_pb2, rank_pb2, rank_pb2_grpc

SOCKET_ENV = "PITSTOP_AGENT_SOCKET"
RANK_KEY_ENV = "PITSTOP_RANK_KEY"
"""A secret the agent gives each process it starts (a rank or a standby); every call
to its socket must carry it (RANK_KEY_METADATA): only what the agent started may talk."""
RANK_KEY_METADATA = "x-pitstop-rank-key"
FORK_SERVER_PID_ENV = "PITSTOP_FORK_SERVER_PID"
"""In each rank the agent's fork server forks: the server's pid, the rank's parent."""


class RankControlClient:
    """Talks to the agent over its Unix socket as rank `rank` of job `job_id`.

    Unary calls give up after `timeout` seconds and raise grpc.RpcError; the
    command stream lives until `close`. `generation` is what step reports carry: set
    by `attach`, and by the caller when the job moves to a new generation.
    """

    def __init__(
        self, socket_path: str | Path, job_id: str, rank: int, timeout: float = 5.0
    ) -> None:
        self.job_id = job_id
        self.rank = rank
        self.timeout = timeout
        self.generation = 0
        self.slow_multiplier = 1.0
        """How much slower the rank's GPU runs (the agent's answer to attach and to each
        step report); 1 except on a simulated slow GPU."""
        self.rank_fault = rank_pb2.RANK_FAULT_NONE
        """A fault injected on the rank's GPU for it to carry out at its next step (the
        agent's answer to a step report); the session takes it (`take_rank_fault`)."""
        self._channel: Any = grpc.insecure_channel(f"unix:{socket_path}")
        self._stub: Any = _Keyed(
            rank_pb2_grpc.RankControlStub(self._channel), os.environ.get(RANK_KEY_ENV, "")
        )
        self._streams: list[Any] = []
        self._closed = False

    @classmethod
    def from_env(cls) -> RankControlClient | None:
        """The client for the rank the agent started, from the environment it set;
        None off-cluster (PITSTOP_AGENT_SOCKET unset)."""
        socket_path = os.environ.get(SOCKET_ENV, "")
        if not socket_path:
            return None
        job_id = os.environ.get("PITSTOP_JOB_ID", "")
        rank = os.environ.get("RANK", "")
        if not job_id or not rank.isdecimal():
            raise ValueError(
                f"{SOCKET_ENV} is set but PITSTOP_JOB_ID={job_id!r} RANK={rank!r} are not "
                "a job id and a rank; start the rank through the pitstop agent"
            )
        client = cls(socket_path, job_id, int(rank))
        generation = os.environ.get("PITSTOP_GENERATION", "")
        client.generation = int(generation) if generation.isdecimal() else 0
        return client

    def attach(self, generation: int) -> rank_pb2.AttachResponse:
        """Introduce this rank, started in `generation`; waits up to `timeout` for the
        agent's socket to accept."""
        self.generation = generation
        request = rank_pb2.AttachRequest(
            job_id=self.job_id, rank=self.rank, generation=generation, pid=os.getpid()
        )
        response: rank_pb2.AttachResponse = self._stub.Attach(
            request, timeout=self.timeout, wait_for_ready=True
        )
        self.slow_multiplier = response.slow_multiplier or 1.0
        return response

    def report_step(
        self,
        step: int,
        step_seconds: float,
        loss: float = 0.0,
        tokens: int = 0,
        checkpoint_step: bool = False,
        model_flops: float = 0.0,
        peak_flops: float = 0.0,
        restored_at: float = 0.0,
        restored_from: str = "",
        grad_norm: float = 0.0,
    ) -> bool:
        """Report a finished step (`grad_norm`: its gradient norm, 0 when not stated); True
        when a command waits on the command stream.
        `model_flops`: the model FLOPs of the step's `tokens` on this rank; `peak_flops`:
        the peak FLOP/s of its accelerator (0: not stated; see StepSample). `restored_at`
        (epoch seconds, 0: not this step) and `restored_from`: on the first step after a
        restore, when and from where the rank loaded it."""
        now = Timestamp()
        now.FromNanoseconds(time.time_ns())
        sample = agent_pb2.StepSample(
            rank=self.rank,
            step=step,
            step_seconds=step_seconds,
            loss=loss,
            tokens=tokens,
            checkpoint_step=checkpoint_step,
            time=now,
            model_flops=model_flops,
            peak_flops=peak_flops,
            grad_norm=grad_norm,
        )
        if restored_at > 0:
            sample.restored_at.FromNanoseconds(int(restored_at * 1e9))
            sample.restored_from = restored_from
        request = rank_pb2.StepReport(
            job_id=self.job_id, rank=self.rank, generation=self.generation, sample=sample
        )
        response: rank_pb2.StepReportResponse = self._stub.ReportStep(request, timeout=self.timeout)
        self.slow_multiplier = response.slow_multiplier or 1.0
        if response.rank_fault:
            self.rank_fault = response.rank_fault
        return response.command_pending

    def take_rank_fault(self) -> int:
        """The injected fault waiting to be carried out (RANK_FAULT_NONE: none), once."""
        fault, self.rank_fault = self.rank_fault, rank_pb2.RANK_FAULT_NONE
        return int(fault)

    def report_finding(self, finding: agent_pb2.IntegrityFinding) -> None:
        """Report what this rank's integrity checks found (see pitstop.trainer.integrity)."""
        finding.job_id, finding.rank, finding.generation = self.job_id, self.rank, self.generation
        self._stub.ReportFinding(finding, timeout=self.timeout)

    def report_run_record(self, record: agent_pb2.RunRecord) -> None:
        """Report what this rank's generation runs (code, environment, data), for the
        job's record (see pitstop.trainer.runrecord)."""
        record.job_id, record.rank, record.generation = self.job_id, self.rank, self.generation
        self._stub.ReportRunRecord(record, timeout=self.timeout)

    def commands(self) -> Iterator[rank_pb2.RankCommand]:
        """Commands for this rank as they come, until the agent ends the stream (a newer
        stream of this rank replaced it) or `close` is called."""
        call = self._stub.Commands(
            rank_pb2.CommandStreamRequest(job_id=self.job_id, rank=self.rank)
        )
        self._streams.append(call)
        try:
            yield from call
        except grpc.RpcError as exc:
            if not (self._closed and exc.code() == grpc.StatusCode.CANCELLED):
                raise
        finally:
            self._streams.remove(call)

    def acknowledge(self, command_id: int, ok: bool = True, error: str = "", step: int = 0) -> None:
        """Answer command `command_id`: carried out (`ok`) or not (`error` says why);
        `step` is where the rank stands after acting."""
        ack = rank_pb2.RankAck(
            job_id=self.job_id,
            rank=self.rank,
            command_id=command_id,
            ok=ok,
            error=error,
            step=step,
        )
        self._stub.Acknowledge(ack, timeout=self.timeout)

    def report_result(self, result: Mapping[str, str]) -> None:
        """Report the rank's final result (e.g. "final_weights_sha256") before exiting."""
        request = rank_pb2.RankResult(job_id=self.job_id, rank=self.rank, result=dict(result))
        self._stub.ReportResult(request, timeout=self.timeout)

    def standby(self) -> rank_pb2.StandbyAssignment:
        """As a standby process for `job_id`, block until the agent hands over a rank;
        the caller then sets `rank` and `generation` from the assignment."""
        request = rank_pb2.StandbyRequest(job_id=self.job_id, pid=os.getpid())
        assignment: rank_pb2.StandbyAssignment = self._stub.Standby(request, wait_for_ready=True)
        return assignment

    def close(self) -> None:
        """End the command streams and the channel. Idempotent."""
        self._closed = True
        for call in list(self._streams):
            call.cancel()
        self._channel.close()

    def __enter__(self) -> RankControlClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class _Keyed:
    """The RankControl stub, its every call carrying the process's rank key (the agent
    refuses calls without)."""

    def __init__(self, stub: Any, key: str) -> None:
        self._stub = stub
        self._metadata = ((RANK_KEY_METADATA, key),) if key else ()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        return functools.partial(method, metadata=self._metadata)
