"""`pitstop cluster ...` as a person runs it, for the tests of the local cluster's CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from kit.stores import StoreUrls, unique
from pitstop.client.launch import binary, clean_env

PITSTOP = binary("pitstop")
CLI_TIMEOUT = 100.0


def cli_environment(stores: StoreUrls) -> dict[str, str]:
    """This process's environment without PITSTOP_* settings, on a Redis prefix of its
    own, and wide enough that tables do not wrap."""
    return clean_env(
        PITSTOP_REDIS_PREFIX=f"{stores.redis_prefix}{unique('cluster')}:", COLUMNS="200"
    )


def pitstop_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The `pitstop` binary with `args`: its exit status and output, whatever they are."""
    return subprocess.run(
        [str(PITSTOP), *args],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=CLI_TIMEOUT,
        check=False,
    )


def cluster_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return pitstop_cli(env, "cluster", *args)


def status_json(env: dict[str, str], state_dir: Path) -> Any:
    """`pitstop cluster status --json` of the cluster in `state_dir`, which must answer."""
    done = cluster_cli(env, "status", "--state-dir", str(state_dir), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
