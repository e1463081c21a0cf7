"""Job spec validation: pure, over the wire message. Every error names the field path,
the value and the fix; the accepted spec comes back with defaults filled in."""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import urlsplit

from pitstop.scheduler.errors import InvalidArgument
from pitstop.v1 import jobs_pb2

NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Set by the agent for every rank; a job may not override them.
RESERVED_ENV = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
        "GROUP_RANK",
        "ROLE_RANK",
        "TORCHELASTIC_RUN_ID",
    }
)
# The trainer's tunables a job may set (every other PITSTOP_* name is the agent's).
TUNABLE_ENV = frozenset(
    {
        "PITSTOP_COLLECTIVE_TIMEOUT",
        "PITSTOP_RECONFIGURE_TIMEOUT",
        "PITSTOP_COMMAND_WAIT",
        "PITSTOP_SNAPSHOT_COPY_THREADS",
    }
)
MAX_WORLD_SIZE = 1_000_000
MAX_ARGS = 256
MAX_STRING = 4096
MAX_PRELOAD_MODULES = 32
MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

DEFAULT_GPUS_PER_NODE = 8
DEFAULT_MAX_RESTARTS = 3
DEFAULT_KEEP_IN_MEMORY = 2
DEFAULT_KEEP_DURABLE = 3
DEFAULT_STRAGGLER_THRESHOLD = 5.0
DEFAULT_STRAGGLER_WINDOWS = 3
DEFAULT_STRAGGLER_WINDOW_STEPS = 20
DEFAULT_STRAGGLER_WARMUP = 10
DEFAULT_LOSS_WINDOW = 100
DEFAULT_SPIKE_SIGMA = 5.0
DEFAULT_MAX_ROLLBACKS = 3
DEFAULT_HANG_FLOOR_SECONDS = 10.0
DEFAULT_HANG_STEP_MULTIPLE = 10.0
DEFAULT_PROJECT = "default"
DEFAULT_MIN_RUN_SECONDS = 60
MAX_MIN_RUN_SECONDS = 7 * 24 * 3600


def check_project(field: str, value: str) -> str:
    """A project name (`field` names where it came from); InvalidArgument when bad."""
    check_text(field, value, max_len=63)
    if not NAME_RE.fullmatch(value):
        raise InvalidArgument(
            field, value, "use 1-63 lowercase letters, digits and '-', starting with a letter"
        )
    return value


def check_text(field: str, value: str, *, max_len: int = MAX_STRING) -> None:
    # PostgreSQL text cannot hold NUL; other control characters only confuse people.
    if "\x00" in value:
        raise InvalidArgument(field, value, "remove the NUL character")
    if len(value) > max_len:
        raise InvalidArgument(field, value, f"must be at most {max_len} characters")


def _at_least(field: str, value: int, low: int, fix: str) -> None:
    if value < low:
        raise InvalidArgument(field, value, fix)


def _at_most(field: str, value: int | float, high: int | float, fix: str) -> None:
    if value > high:
        raise InvalidArgument(field, value, fix)


def validate_job_spec(spec: jobs_pb2.JobSpec) -> jobs_pb2.JobSpec:
    """Check ``spec`` and return a copy with defaults filled in. Raises InvalidArgument."""
    out = jobs_pb2.JobSpec()
    out.CopyFrom(spec)

    if not out.name:
        raise InvalidArgument("spec.name", "", "give the job a name, e.g. name: llama-8b")
    check_text("spec.name", out.name, max_len=63)
    if not NAME_RE.fullmatch(out.name):
        raise InvalidArgument(
            "spec.name",
            out.name,
            "use 1-63 lowercase letters, digits and '-', starting with a letter",
        )

    if not out.command:
        raise InvalidArgument(
            "spec.command", [], "give the command each rank runs, e.g. [python, train.py]"
        )
    _at_most("spec.command", len(out.command), MAX_ARGS, f"use at most {MAX_ARGS} arguments")
    for i, arg in enumerate(out.command):
        check_text(f"spec.command[{i}]", arg)
    if not out.command[0].strip():
        raise InvalidArgument("spec.command[0]", out.command[0], "name the program to run")

    for name in ("tp", "pp", "dp"):
        if getattr(out, name) == 0:
            setattr(out, name, 1)  # unset means 1 (no parallelism along that axis)
    if out.gpus_per_node == 0:
        out.gpus_per_node = DEFAULT_GPUS_PER_NODE
    _at_most("spec.gpus_per_node", out.gpus_per_node, 64, "a node has at most 64 GPUs")
    _at_most(
        "spec.tp",
        out.tp,
        out.gpus_per_node,
        f"a TP group stays inside one node: use tp <= gpus_per_node ({out.gpus_per_node})",
    )
    if out.gpus_per_node % out.tp:
        raise InvalidArgument(
            "spec.tp", out.tp, f"tp must divide gpus_per_node ({out.gpus_per_node})"
        )
    world = out.tp * out.pp * out.dp
    _at_most(
        "spec.dp",
        world,
        MAX_WORLD_SIZE,
        f"tp*pp*dp = {world} ranks; at most {MAX_WORLD_SIZE} are supported",
    )

    if out.min_dp == 0:
        out.min_dp = out.dp
    _at_most("spec.min_dp", out.min_dp, out.dp, f"min_dp must be at most dp ({out.dp})")
    _at_most("spec.spares", out.spares, 10_000, "ask for at most 10000 spare nodes")
    if not -1000 <= out.priority <= 1000:
        raise InvalidArgument("spec.priority", out.priority, "use a priority from -1000 to 1000")
    if not out.HasField("max_restarts"):
        out.max_restarts = DEFAULT_MAX_RESTARTS
    _at_most("spec.max_restarts", out.max_restarts, 10_000, "use at most 10000 restarts")

    _validate_checkpoint(out.checkpoint)
    _validate_straggler(out.straggler)
    _validate_integrity(out.integrity)

    for key, value in out.env.items():
        field = f"spec.env.{key}" if len(key) <= 64 else "spec.env"
        if not ENV_KEY_RE.fullmatch(key):
            raise InvalidArgument(field, key, "environment names are letters, digits and '_'")
        if key in RESERVED_ENV or (key.startswith("PITSTOP_") and key not in TUNABLE_ENV):
            raise InvalidArgument(
                field,
                key,
                "set by pitstop for every rank; remove it from env (a job may set only "
                f"{', '.join(sorted(TUNABLE_ENV))})",
            )
        check_text(field, value)
    _at_most("spec.env", len(out.env), 1000, "use at most 1000 environment variables")
    check_text("spec.working_dir", out.working_dir)
    _validate_preload(out.preload_modules)
    out.project = check_project("spec.project", out.project or DEFAULT_PROJECT)
    if not out.HasField("min_run_seconds"):
        out.min_run_seconds = DEFAULT_MIN_RUN_SECONDS
    _at_most(
        "spec.min_run_seconds",
        out.min_run_seconds,
        MAX_MIN_RUN_SECONDS,
        f"use at most {MAX_MIN_RUN_SECONDS} (a week)",
    )
    return out


def _validate_preload(modules: Sequence[str]) -> None:
    _at_most(
        "spec.preload_modules",
        len(modules),
        MAX_PRELOAD_MODULES,
        f"name at most {MAX_PRELOAD_MODULES} modules (a package imports its own)",
    )
    for i, name in enumerate(modules):
        if len(name) > 200 or not MODULE_RE.fullmatch(name):
            raise InvalidArgument(
                f"spec.preload_modules[{i}]",
                name[:200],
                "name a module as `import` takes it, e.g. transformers or my_models.llama",
            )


def _validate_checkpoint(cp: jobs_pb2.CheckpointPolicy) -> None:
    if cp.snapshot_every_steps == 0:
        cp.snapshot_every_steps = 1
    _at_most(
        "spec.checkpoint.snapshot_every_steps",
        cp.snapshot_every_steps,
        1_000_000,
        "snapshot at least every 1000000 steps",
    )
    if cp.keep_in_memory == 0:
        cp.keep_in_memory = DEFAULT_KEEP_IN_MEMORY
    _at_most(
        "spec.checkpoint.keep_in_memory",
        cp.keep_in_memory,
        16,
        "keep at most 16 snapshots in memory (2 double-buffers)",
    )
    if cp.keep_durable == 0:
        cp.keep_durable = DEFAULT_KEEP_DURABLE
    _at_most("spec.checkpoint.keep_durable", cp.keep_durable, 1000, "keep at most 1000")
    if cp.durable_url:
        check_text("spec.checkpoint.durable_url", cp.durable_url)
        parts = urlsplit(cp.durable_url)
        if not parts.scheme or not (parts.netloc or parts.path):
            raise InvalidArgument(
                "spec.checkpoint.durable_url",
                cp.durable_url,
                "give an fsspec URL such as file:///var/lib/pitstop/ckpt or s3://bucket/prefix",
            )


def _validate_straggler(sp: jobs_pb2.StragglerPolicy) -> None:
    if sp.action == jobs_pb2.STRAGGLER_ACTION_UNSPECIFIED:
        sp.action = jobs_pb2.STRAGGLER_ACTION_REPORT
    if sp.action not in (jobs_pb2.STRAGGLER_ACTION_REPORT, jobs_pb2.STRAGGLER_ACTION_SWAP):
        raise InvalidArgument("spec.straggler.action", sp.action, "use report or swap")
    if sp.threshold == 0:
        sp.threshold = DEFAULT_STRAGGLER_THRESHOLD
    if not 0 < sp.threshold <= 1000:  # also rejects NaN
        raise InvalidArgument(
            "spec.straggler.threshold", sp.threshold, "use a positive number of deviations, e.g. 5"
        )
    if sp.windows == 0:
        sp.windows = DEFAULT_STRAGGLER_WINDOWS
    _at_most("spec.straggler.windows", sp.windows, 1000, "use at most 1000 windows")
    if sp.window_steps == 0:
        sp.window_steps = DEFAULT_STRAGGLER_WINDOW_STEPS
    _at_most("spec.straggler.window_steps", sp.window_steps, 100_000, "use at most 100000")
    if not sp.HasField("warmup_steps"):
        sp.warmup_steps = DEFAULT_STRAGGLER_WARMUP
    _at_most("spec.straggler.warmup_steps", sp.warmup_steps, 1_000_000, "use at most 1000000")


def _validate_integrity(policy: jobs_pb2.IntegrityPolicy) -> None:
    if policy.loss_window == 0:
        policy.loss_window = DEFAULT_LOSS_WINDOW
    if not 2 <= policy.loss_window <= 100_000:
        raise InvalidArgument(
            "spec.integrity.loss_window",
            policy.loss_window,
            "judge spikes against 2 to 100000 steps, e.g. 100",
        )
    if policy.spike_sigma == 0:
        policy.spike_sigma = DEFAULT_SPIKE_SIGMA
    if not 0 < policy.spike_sigma <= 1000:  # also rejects NaN
        raise InvalidArgument(
            "spec.integrity.spike_sigma",
            policy.spike_sigma,
            "use a positive number of standard deviations, e.g. 5",
        )
    if policy.max_rollbacks == 0:
        policy.max_rollbacks = DEFAULT_MAX_ROLLBACKS
    if policy.hang_floor_seconds == 0:
        policy.hang_floor_seconds = DEFAULT_HANG_FLOOR_SECONDS
    if not 1 <= policy.hang_floor_seconds <= 86_400:  # also rejects NaN
        raise InvalidArgument(
            "spec.integrity.hang_floor_seconds",
            policy.hang_floor_seconds,
            "use 1 to 86400 seconds, e.g. 10 (a job hangs after no step for this long at least)",
        )
    if policy.hang_step_multiple == 0:
        policy.hang_step_multiple = DEFAULT_HANG_STEP_MULTIPLE
    if not 2 <= policy.hang_step_multiple <= 10_000:
        raise InvalidArgument(
            "spec.integrity.hang_step_multiple",
            policy.hang_step_multiple,
            "use 2 to 10000 median step times, e.g. 10",
        )
    _at_most(
        "spec.integrity.max_rollbacks",
        policy.max_rollbacks,
        policy.loss_window,
        f"pause after at most loss_window ({policy.loss_window}) rollbacks in a window",
    )
