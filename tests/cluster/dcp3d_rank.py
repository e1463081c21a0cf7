"""A rank of a script that leaves pitstop: it builds the 3D example's model on its own
mesh (any dp; pp and tp as the job's), loads the job's newest complete durable step
with torch.distributed.checkpoint through `DurableReader`, and writes to OUT (rank 0)
the step loaded and the weights' hash the example reports (`weights_sha256`: every
stage's whole parameters, so the same at any dp).

    python dcp3d_rank.py --url URL --job JOB --out OUT.json [the example's model flags]
    (RANK, WORLD_SIZE, MASTER_*, PITSTOP_DP/PP/TP set)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from pitstop.trainer import Session
from pitstop.trainer.dcp import DurableReader
from pitstop.trainer.example3d import Job, parse_args, weights_sha256


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args, model = parser.parse_known_args()  # the rest: the job's --layers and such
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    with Session.from_env() as session:
        job = Job(parse_args(model), session)  # the job's model
        state = job.make_state(session.mesh)
        with torch.no_grad():
            for tensor in state.model.state_dict().values():
                tensor.zero_()
        reader = DurableReader(args.url, args.job)
        state_dict = state.model.state_dict()
        dcp.load(state_dict, storage_reader=reader)
        digest = weights_sha256(state, session)
        if session.rank == 0:
            record = {"step": reader.step, "final_weights_sha256": digest}
            args.out.write_text(json.dumps(record))
        torch.distributed.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
