"""The job's shape as a rank reads it: from the agent's variables or a new rank map."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
from pitstop.trainer.config import ConfigError, RankConfig
from pitstop.trainer.mesh import Shape, ShapeError
from pitstop.v1 import common_pb2


def test_coordinates_vary_tp_fastest_as_the_scheduler_places_them() -> None:
    shapes = [Shape.of_rank(rank, dp=2, pp=2, tp=2) for rank in range(8)]
    assert [s.coordinates for s in shapes] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)
    ]  # fmt: skip
    assert [s.rank for s in shapes] == list(range(8))


def test_the_agents_variables_give_the_shape_and_a_missing_one_is_pure_data_parallel() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "PITSTOP_DP": "2", "PITSTOP_PP": "2"}
    env |= {"PITSTOP_TP": "2", "PITSTOP_DP_RANK": "1", "PITSTOP_PP_RANK": "0"}
    env |= {"PITSTOP_TP_RANK": "1"}
    assert RankConfig.from_env(env).shape == Shape(2, 2, 2, 1, 0, 1)
    plain = RankConfig.from_env({"RANK": "3", "WORLD_SIZE": "4"}).shape
    assert (plain.sizes, plain.coordinates) == ((4, 1, 1), (3, 0, 0))
    assert Shape(2, 2, 2, 1, 0, 1).env()["PITSTOP_TP_RANK"] == "1"


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"PITSTOP_DP": "2", "PITSTOP_PP": "1"}, "set all three"),
        ({"PITSTOP_DP": "2", "PITSTOP_PP": "1", "PITSTOP_TP": "x"}, "set all three"),
        ({"PITSTOP_DP": "2", "PITSTOP_PP": "2", "PITSTOP_TP": "1"}, "is not WORLD_SIZE=8"),
        (
            {"PITSTOP_DP": "4", "PITSTOP_PP": "1", "PITSTOP_TP": "2", "PITSTOP_TP_RANK": "0"},
            "are not RANK=5's coordinates",
        ),
    ],
)
def test_a_shape_that_does_not_fit_the_world_is_refused_by_name(
    env: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        RankConfig.from_env({"RANK": "5", "WORLD_SIZE": "8", **env})


def test_a_new_rank_map_gives_a_survivor_its_new_shape() -> None:
    rank_map = common_pb2.RankMap(generation=3, world_size=4)
    for rank in range(4):
        dp, tp = divmod(rank, 2)
        rank_map.ranks.add(rank=rank, node_id=f"n{dp}", gpu_index=tp, dp=dp, tp=tp)
    assert Shape.from_rank_map(rank_map, 3) == Shape(2, 1, 2, 1, 0, 1)
    with pytest.raises(ShapeError, match="rank 7 is not in the rank map"):
        Shape.from_rank_map(rank_map, 7)


def test_a_snapshots_shape_round_trips_and_a_damaged_one_is_named() -> None:
    shape = Shape(2, 2, 2, 1, 0, 1)
    assert Shape.from_json(shape.to_json()) == shape
    assert shape.at(0) == Shape(2, 2, 2, 0, 0, 1)
    with pytest.raises(ShapeError, match="is not a shape"):
        Shape.from_json('{"sizes": [2, 2]}')


def test_a_nodes_share_of_the_map_gives_the_shape_from_the_sizes_it_carries() -> None:
    """A node's Reconfigure holds its own ranks only (the whole map is 2.4 MB at 99,968
    ranks): the job's sizes come with it."""
    share = common_pb2.RankMap(
        generation=3, world_size=8, dp_size=2, pp_size=2, tp_size=2, node_local=True
    )
    share.ranks.add(rank=6, node_id="n3", gpu_index=0, dp=1, pp=1, tp=0)
    share.ranks.add(rank=7, node_id="n3", gpu_index=1, dp=1, pp=1, tp=1)
    assert Shape.from_rank_map(share, 7) == Shape(2, 2, 2, 1, 1, 1)
    no_sizes = common_pb2.RankMap(generation=3, world_size=8, node_local=True)
    no_sizes.ranks.add(rank=6, node_id="n3")
    assert Shape.from_rank_map(no_sizes, 6).sizes == (8, 1, 1)  # pure data parallel
