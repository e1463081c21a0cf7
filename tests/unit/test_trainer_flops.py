"""A training script states its model FLOPs per token and its accelerator's peak FLOP/s
through the Session (for the job's MFU); a figure that is no such number is refused
with its name, its value and what to give."""

from __future__ import annotations

import math

import pytest

from pitstop.trainer import Session


def test_an_off_cluster_session_keeps_the_stated_flops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PITSTOP_AGENT_SOCKET", raising=False)
    with Session.from_env(model_flops_per_token=6e9, peak_flops=989e12) as session:
        assert (session.model_flops_per_token, session.peak_flops) == (6e9, 989e12)
        session.set_flops(model_flops_per_token=1e9)
        assert (session.model_flops_per_token, session.peak_flops) == (1e9, 0.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("model_flops_per_token", -1.0), ("peak_flops", math.inf), ("peak_flops", "fast")],
)
def test_a_bad_flops_figure_is_refused_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"Session {field}=.*give a finite number of FLOPs"):
        Session.from_env(**{field: value})  # type: ignore[arg-type]
