"""A durable checkpoint leaves pitstop: torch.distributed.checkpoint loads it through
`DurableReader`, at the world size and mesh that saved it, at another, and in a single
process without a process group, bitwise.

`dcp_rank.py save` (4 gloo ranks, FSDP2 over dp=2 and tensor parallel over tp=2) flushes
step 3 as checkpointd does, one manifest per rank's node, and step 5 from two of the
four ranks only. The newest complete step is then 3.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kit.forking import ForkClient, run_mesh_ranks

pytest.importorskip("torch")

RANK = Path(__file__).with_name("dcp_rank.py")
JOB = "dcp-job"
WAIT = 120.0  # interpreters importing torch on two cores, then a few tiny steps


def run_ranks(
    mode: str, world: int, dp: int, tp: int, url: str, out: Path, forks: ForkClient
) -> None:
    assert world == dp * tp
    argv = [str(RANK), mode, "--url", url, "--job", JOB, "--out", str(out)]
    run_mesh_ranks(argv, dp, tp, WAIT, fork=forks)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_loads_the_newest_complete_durable_step_at_any_world_size(
    tmp_path: Path, mesh_forks: ForkClient
) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.api import CheckpointException

    from pitstop.trainer.dcp import DurableCheckpointError, DurableReader

    url = f"file://{tmp_path}/durable"
    run_ranks("save", 4, 2, 2, url, tmp_path, mesh_forks)
    full = load_file(str(tmp_path / "full.safetensors"))
    assert set(full) == {"up.weight", "up.bias", "down.weight", "down.bias"}

    # The same mesh: every rank gets back exactly the local shards it saved.
    run_ranks("load", 4, 2, 2, url, tmp_path, mesh_forks)
    for rank in range(4):
        record = json.loads((tmp_path / f"load-{rank}.json").read_text())
        assert record["step"] == 3, record
        assert len(record["local"]) == 4, record
        assert all(record["local"].values()), record
        assert all(record["full"].values()), record
        (tmp_path / f"load-{rank}.json").unlink()

    # Half the ranks, another mesh (dp=1, tp=2): DCP reshards, the whole tensors match.
    run_ranks("load", 2, 1, 2, url, tmp_path, mesh_forks)
    for rank in range(2):
        record = json.loads((tmp_path / f"load-{rank}.json").read_text())
        assert record["step"] == 3, record
        assert len(record["full"]) == 4, record
        assert all(record["full"].values()), record

    # One process, a plain model, no process group.
    model = torch.nn.ModuleDict({"up": torch.nn.Linear(16, 32), "down": torch.nn.Linear(32, 16)})
    state_dict = model.state_dict()
    dcp.load(state_dict, storage_reader=DurableReader(url, JOB), no_dist=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value.view(torch.uint8), full[key].view(torch.uint8)), key

    # Under another key: dcp.load({"model": ...}) with the prefix "model."; unverified
    # reads (only the chunks' bytes, no checksum over the whole file).
    nested = {
        "model": torch.nn.ModuleDict(
            {"up": torch.nn.Linear(16, 32), "down": torch.nn.Linear(32, 16)}
        ).state_dict()
    }
    unverified = DurableReader(url, JOB, prefix="model.", verify=False)
    dcp.load(nested, storage_reader=unverified, no_dist=True)
    for key, value in nested["model"].items():
        assert torch.equal(value.view(torch.uint8), full[key].view(torch.uint8)), key

    # Step 5 is incomplete; asking for it, or for a job with nothing durable, says so.
    with pytest.raises(DurableCheckpointError, match=r"step 5.*elements of"):
        DurableReader(url, JOB, step=5)
    with pytest.raises(DurableCheckpointError) as missing:
        DurableReader(url, "no-such-job")
    assert "'no-such-job'" in str(missing.value)
    assert url in str(missing.value)
    assert "any step" in str(missing.value)
    assert "durable_url" in str(missing.value)

    # A shard whose bytes no longer match its manifest's checksum is refused (DCP wraps a
    # reader's error in CheckpointException, a BaseException).
    reader = DurableReader(url, JOB)
    damaged = Path(reader.entries[0].path)
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(CheckpointException, match="damaged"):
        dcp.load(model.state_dict(), storage_reader=reader, no_dist=True)
