"""Cutting a tensor's new shard out of old shards placed by their offsets (the part of
a shrink's reshard that needs no process group)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from pitstop.trainer.reshard import _assemble  # noqa: E402
from pitstop.trainer.state import StateFormatError  # noqa: E402


def placed(whole: torch.Tensor, row: int, rows: int) -> tuple[dict, dict]:
    """Rows [row, row + rows) of `whole` as a snapshot holds an FSDP shard of it."""
    where = {"shape": list(whole.shape), "offset": [row, 0], "local": [rows, whole.shape[1]]}
    return {"w": whole[row : row + rows].clone()}, {"w": where}


def test_a_larger_shard_is_assembled_bitwise_from_the_old_ones_uneven_or_not() -> None:
    whole = torch.randn(7, 3)
    old = [placed(whole, 0, 4), placed(whole, 4, 3)]  # dp = 2 of 7 rows: 4 and 3
    assert torch.equal(_assemble("w", whole.dtype, [0, 0], [7, 3], old), whole)
    # Rows 2..5 overlap both old shards.
    assert torch.equal(_assemble("w", whole.dtype, [2, 0], [4, 3], old), whole[2:6])


def test_a_missing_old_shard_is_named_not_filled_with_garbage() -> None:
    whole = torch.randn(8, 2)
    with pytest.raises(StateFormatError, match=r"w: the snapshots read cover 8 of the 16"):
        _assemble("w", whole.dtype, [0, 0], [8, 2], [placed(whole, 0, 4)])
