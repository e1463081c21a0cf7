"""The job's shape as a rank sees it: dp x pp x tp, its own coordinates, its DeviceMesh.

The scheduler maps ranks to (dp, pp, tp) coordinates with tp varying fastest:

    rank = (dp_i * pp + pp_i) * tp + tp_i

which is the row-major order of a ("dp", "pp", "tp") mesh, so the DeviceMesh over
`arange(world).view(dp, pp, tp)` puts every rank where the scheduler placed it: a TP
group inside one node, a pipeline's stages next, data-parallel replicas outermost. The
agent gives every rank PITSTOP_DP, PITSTOP_PP, PITSTOP_TP (the sizes) and
PITSTOP_DP_RANK, PITSTOP_PP_RANK, PITSTOP_TP_RANK (its coordinates), for scripts that
build their own groups; a Reconfigure carries the new rank map, from which a survivor
takes its new shape and coordinates. Without them (torchrun, off-cluster) the shape is
pure data parallel: dp = WORLD_SIZE.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from pitstop.v1 import common_pb2

DIM_NAMES = ("dp", "pp", "tp")
"""The mesh's dimension names, outermost first."""
SIZE_VARIABLES = ("PITSTOP_DP", "PITSTOP_PP", "PITSTOP_TP")
RANK_VARIABLES = ("PITSTOP_DP_RANK", "PITSTOP_PP_RANK", "PITSTOP_TP_RANK")


class ShapeError(ValueError):
    """A shape or coordinates that do not fit the world; the message names the fix."""


@dataclass(frozen=True)
class Shape:
    """dp x pp x tp, with one rank's coordinates in it."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    dp_rank: int = 0
    pp_rank: int = 0
    tp_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def sizes(self) -> tuple[int, int, int]:
        return self.dp, self.pp, self.tp

    @property
    def coordinates(self) -> tuple[int, int, int]:
        return self.dp_rank, self.pp_rank, self.tp_rank

    @property
    def rank(self) -> int:
        """The global rank at these coordinates."""
        return (self.dp_rank * self.pp + self.pp_rank) * self.tp + self.tp_rank

    @classmethod
    def data_parallel(cls, rank: int, world_size: int) -> Shape:
        """Every rank a replica: the shape of a script without model parallelism."""
        return cls(dp=world_size, dp_rank=rank)

    @classmethod
    def of_rank(cls, rank: int, dp: int, pp: int, tp: int) -> Shape:
        """The shape dp x pp x tp with `rank`'s coordinates in it (tp fastest)."""
        if rank >= dp * pp * tp:
            raise ShapeError(f"rank {rank} is outside a {dp}x{pp}x{tp} (dp x pp x tp) mesh")
        rest, tp_rank = divmod(rank, tp)
        dp_rank, pp_rank = divmod(rest, pp)
        return cls(dp, pp, tp, dp_rank, pp_rank, tp_rank)

    @classmethod
    def from_env(cls, env: Mapping[str, str], rank: int, world_size: int) -> Shape:
        """The shape the agent gave this rank (PITSTOP_DP/PP/TP and their _RANK), else
        pure data parallel. Raises ShapeError naming the variables when they disagree
        with RANK and WORLD_SIZE."""
        given = [env.get(name, "").strip() for name in SIZE_VARIABLES]
        if not any(given):
            return cls.data_parallel(rank, world_size)
        if not all(text.isdecimal() and int(text) > 0 for text in given):
            shown = ", ".join(f"{n}={t!r}" for n, t in zip(SIZE_VARIABLES, given, strict=True))
            raise ShapeError(f"{shown}: set all three to whole numbers >= 1, or none")
        dp, pp, tp = (int(text) for text in given)
        if dp * pp * tp != world_size:
            raise ShapeError(
                f"PITSTOP_DP x PITSTOP_PP x PITSTOP_TP = {dp}x{pp}x{tp} = {dp * pp * tp} is not "
                f"WORLD_SIZE={world_size}; give the job's shape or unset them"
            )
        shape = cls.of_rank(rank, dp, pp, tp)
        stated = [env.get(name, "").strip() for name in RANK_VARIABLES]
        if any(stated) and tuple(int(t) if t.isdecimal() else -1 for t in stated) != (
            shape.coordinates
        ):
            raise ShapeError(
                f"{'/'.join(RANK_VARIABLES)}={'/'.join(stated)} are not RANK={rank}'s "
                f"coordinates {shape.coordinates} in {dp}x{pp}x{tp} (tp varies fastest)"
            )
        return shape

    @classmethod
    def from_rank_map(cls, rank_map: common_pb2.RankMap, rank: int) -> Shape:
        """`rank`'s shape in a scheduler's rank map (a new generation's)."""
        if not rank_map.ranks:
            raise ShapeError("the rank map is empty")
        world = rank_map.world_size or len(rank_map.ranks)
        mine = next((a for a in rank_map.ranks if a.rank == rank), None)
        if mine is None:
            raise ShapeError(f"rank {rank} is not in the rank map")
        if rank_map.dp_size:  # the job's sizes, given (a node's share of the map)
            dp, pp, tp = rank_map.dp_size, rank_map.pp_size, rank_map.tp_size
        elif rank_map.node_local:  # a share without sizes: no coordinates
            return cls.data_parallel(rank, world)
        else:  # the whole map: its coordinates span it
            dp = 1 + max(a.dp for a in rank_map.ranks)
            pp = 1 + max(a.pp for a in rank_map.ranks)
            tp = 1 + max(a.tp for a in rank_map.ranks)
        if dp * pp * tp != world:  # an old scheduler: no coordinates
            return cls.data_parallel(rank, world)
        return cls(dp, pp, tp, mine.dp, mine.pp, mine.tp)

    def to_json(self) -> str:
        """The shape as a snapshot's metadata keeps it."""
        return json.dumps({"sizes": self.sizes, "coordinates": self.coordinates})

    @classmethod
    def from_json(cls, text: str) -> Shape:
        """The inverse of `to_json`; ShapeError when `text` is not one."""
        try:
            given = json.loads(text)
            (dp, pp, tp), (dp_rank, pp_rank, tp_rank) = given["sizes"], given["coordinates"]
            return cls(int(dp), int(pp), int(tp), int(dp_rank), int(pp_rank), int(tp_rank))
        except (ValueError, KeyError, TypeError) as exc:
            raise ShapeError(f"{text[:80]!r} is not a shape: {exc}") from exc

    def at(self, dp_rank: int) -> Shape:
        """The same shape, at data-parallel coordinate `dp_rank` (pp and tp kept)."""
        return replace(self, dp_rank=dp_rank)

    def env(self) -> dict[str, str]:
        """The variables that carry this shape to a rank."""
        values = (*self.sizes, *self.coordinates)
        return {
            name: str(value)
            for name, value in zip(SIZE_VARIABLES + RANK_VARIABLES, values, strict=True)
        }


def build_mesh(shape: Shape, device: torch.device) -> torch.distributed.device_mesh.DeviceMesh:
    """The ("dp", "pp", "tp") DeviceMesh of `shape` on the formed default group, with its
    sub-groups. Every rank of the group must call it (it creates the sub-groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, shape.sizes, mesh_dim_names=DIM_NAMES)
    found = tuple(int(mesh.get_local_rank(name)) for name in DIM_NAMES)
    if found != shape.coordinates:  # the mesh's order is the scheduler's: never happens
        raise ShapeError(f"the mesh put this rank at {found}, the scheduler at {shape.coordinates}")
    return mesh
