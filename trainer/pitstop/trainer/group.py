"""The rank's torch.distributed process group: formed at start, dropped and re-formed on
a Reconfigure, always with a bounded timeout so a collective with a dead peer errors
instead of hanging.

gloo on CPU, NCCL when CUDA is available. The first group forms over env://
(MASTER_ADDR/MASTER_PORT, as the agent and torchrun set them); a re-formed group over
tcp://<rendezvous_address>, where the new rank 0 serves the store.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_PEER_LOSS_MARKERS = (
    "gloo",
    "connection reset",
    "connection closed",
    "connection refused",
    "broken pipe",
    "timed out",
    "timeout",
    "nccl",
    "socket",
)


def backend() -> str:
    """NCCL with a GPU, gloo without."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for(local_rank: int) -> torch.device:
    """The device this rank computes on: its GPU (the one the agent made visible, or the
    LOCAL_RANK-th under torchrun), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = local_rank if local_rank < torch.cuda.device_count() else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def form(
    rank: int,
    world_size: int,
    timeout: timedelta,
    rendezvous_address: str = "",
    device: torch.device | None = None,
    wait: timedelta | None = None,
) -> None:
    """Form the default process group at `rendezvous_address` (else MASTER_ADDR and
    MASTER_PORT). Collectives time out after `timeout`; forming waits up to `wait`
    for every rank to arrive (a replacement may still be starting), so the collective
    timeout can be short. Under torchrun the group forms over env://, on the store its
    agent serves. A group the script formed itself is kept (and dropped on a
    Reconfigure)."""
    if dist.is_initialized():
        log.info("process group already formed by the script: using it")
        return
    device_id = device if device is not None and device.type == "cuda" else None
    if not rendezvous_address and os.environ.get("TORCHELASTIC_RUN_ID"):
        dist.init_process_group(
            backend(),
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device_id,
        )
        log.info("process group formed: rank %d of %d via torchrun's store", rank, world_size)
        return
    host, _, port = rendezvous_address.rpartition(":")
    if not rendezvous_address:
        host, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        raise RuntimeError(
            f"rank {rank} of {world_size}: MASTER_ADDR/MASTER_PORT are not set; start the "
            "ranks through the pitstop agent or torchrun, or set them"
        )
    store = dist.TCPStore(  # type: ignore[attr-defined]
        host, int(port), world_size, is_master=rank == 0, timeout=max(wait or timeout, timeout)
    )
    dist.init_process_group(
        backend(),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )
    log.info("process group formed: rank %d of %d via %s:%s", rank, world_size, host, port)


def drop() -> None:
    """Destroy the default process group, whatever state its peers are in."""
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # a group with a dead peer may fail to close cleanly
        log.warning("destroying the process group failed (dropped anyway): %s", exc)


def is_peer_loss(exc: BaseException) -> bool:
    """Whether `exc` says a collective failed because a peer is gone or hung, rather
    than a bug in the training step."""
    if isinstance(exc, dist.DistError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _PEER_LOSS_MARKERS)
