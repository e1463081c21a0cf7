"""A rank for the agent's tests: a real process that behaves as told, without torch.

Run by the rank supervisor as `python fake_rank.py [options]`. With --notify it
connects to a test's Unix socket and sends one JSON line when ready (its pid, its
child's pid, its environment, what Attach answered) and one per command it obeys;
with --wait-go it then waits for the test to answer "go" before going on.

The tests' side is in the test kit (tests/kit/ranks.py: `RankNotices`, `ExitLog`,
`start_command`); the rank imports only the standard library, and the rank client when
it attaches.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
from typing import Any

ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "PITSTOP_JOB_ID",
    "PITSTOP_GENERATION",
    "PITSTOP_NODE_ID",
    "PITSTOP_AGENT_SOCKET",
    "PITSTOP_RESTORE_STEP",
    "PITSTOP_CHECKPOINTD",
    "PITSTOP_STANDBY",
    "FAKE_RANK_EXTRA",
)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--notify", help="Unix socket of the test's RankNotices")
    parser.add_argument("--attach", action="store_true", help="attach to the agent socket")
    parser.add_argument("--steps", type=int, default=0, help="steps to report (with --attach)")
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--noise", type=float, default=0.0, help="uniform +- share, seeded")
    parser.add_argument("--flops-per-token", type=float, default=0.0, help="model FLOPs stated")
    parser.add_argument("--peak-flops", type=float, default=0.0, help="peak FLOP/s stated")
    parser.add_argument("--result", action="append", default=[], help="KEY=VALUE to report")
    parser.add_argument("--wait-commands", action="store_true", help="obey commands until stop")
    parser.add_argument("--wait-go", action="store_true", help="wait for 'go' once ready")
    parser.add_argument("--hold", action="store_true", help="stay alive until signalled")
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--spawn-child", action="store_true", help="fork a child into the group")
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument(
        "--standby",
        action="store_true",
        help="under PITSTOP_STANDBY=1: say so, wait to be handed a rank, then say which",
    )
    return parser.parse_args()


def main() -> int:
    args = _parse()
    rank = int(os.environ.get("RANK", "0"))
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The child inherits the ignored SIGTERM: only the group's SIGKILL ends it.
    child = (
        subprocess.Popen([sys.executable, "-c", "import signal\nwhile True: signal.pause()"])
        if args.spawn_child
        else None
    )
    notify = socket.socket(socket.AF_UNIX) if args.notify else None
    if notify is not None:
        notify.connect(args.notify)

    def send(**notice: Any) -> None:
        if notify is not None:
            notify.sendall(json.dumps({"rank": rank, **notice}).encode() + b"\n")

    ready: dict[str, Any] = {
        "pid": os.getpid(),
        "child_pid": child.pid if child is not None else 0,
        "cwd": os.getcwd(),
        "env": {key: os.environ.get(key) for key in ENV_KEYS},
    }
    client = None
    standing_by = args.standby and os.environ.get("PITSTOP_STANDBY") == "1"

    def attach_and_step(client: Any, generation: int) -> None:
        """Attach as the rank at `generation`, report --steps steps and the result."""
        attached = client.attach(generation)
        multiplier = attached.slow_multiplier
        noise = random.Random(rank)  # seeded: a run is repeatable
        for step in range(1, args.steps + 1):
            seconds = args.step_seconds * multiplier * (1 + noise.uniform(-args.noise, args.noise))
            client.report_step(
                step,
                seconds,
                loss=1.0 / step,
                tokens=64,
                model_flops=64 * args.flops_per_token,
                peak_flops=args.peak_flops,
            )
        if args.result:
            client.report_result(dict(item.split("=", 1) for item in args.result))
        ready.update(
            generation=attached.generation,
            restore_step=attached.restore_step,
            checkpointd=attached.checkpointd_address,
            slow_multiplier=multiplier,
        )

    if args.attach and not standing_by:
        from pitstop.rankside.rankclient import RankControlClient

        client = RankControlClient.from_env()
        assert client is not None, "PITSTOP_AGENT_SOCKET is unset"
        attach_and_step(client, int(os.environ["PITSTOP_GENERATION"]))
    if standing_by:
        from pitstop.rankside.rankclient import RankControlClient

        standby = RankControlClient(
            os.environ["PITSTOP_AGENT_SOCKET"], os.environ["PITSTOP_JOB_ID"], 0
        )
        send(standby=True, **ready)
        assignment = standby.standby()
        rank = assignment.rank  # its notices come as that rank from now on
        ready.update(
            adopted=True,
            generation=assignment.reconfigure.generation,
            restore_step=assignment.reconfigure.restore_step,
            gpu_index=assignment.gpu_index,
        )
        if args.attach:  # the rank it became, from its new generation on
            standby.rank = assignment.rank
            client = standby
            attach_and_step(client, assignment.reconfigure.generation)
    send(**ready)
    if args.wait_commands and client is not None:
        for command in client.commands():
            kind = command.WhichOneof("body")
            client.acknowledge(command.command_id, ok=True, step=args.steps)
            send(command_id=command.command_id, kind=kind)
            if kind == "stop":
                break
    if args.wait_go and notify is not None:
        with notify.makefile("rb") as answers:
            answers.readline()
    while args.hold:
        signal.pause()
    if client is not None:
        client.close()
    if notify is not None:
        notify.close()
    print(f"fake rank {rank} exiting with {args.exit_code}", file=sys.stderr, flush=True)
    return int(args.exit_code)


if __name__ == "__main__":
    sys.exit(main())
