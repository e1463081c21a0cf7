"""The chaos benchmark's step reader follows a rank's log when a standby on the same
node takes the rank over and starts the log anew (the old one kept as rank-N.1.log):
the new file's steps are seen from its first line, not from the old file's length."""

from __future__ import annotations

from pathlib import Path

from bench._chaos_watch import Steps


def step_lines(rank: int, steps: range) -> str:
    return "".join(f'{{"rank": {rank}, "step": {s}, "loss": 1.0, "at": 0}}\n' for s in steps)


def test_a_log_started_anew_is_read_from_its_start(tmp_path: Path) -> None:
    folder = tmp_path / "nodes" / "n1" / "agent" / "ranks" / "j-1"
    folder.mkdir(parents=True)
    log = folder / "rank-0.log"
    log.write_text(step_lines(0, range(1, 200)))
    steps = Steps(tmp_path, "j-1")
    steps.poll()
    assert steps.newest == 199
    log.rename(folder / "rank-0.1.log")  # the standby's log, shorter than the old one
    log.write_text("--- pitstop: standby on GPU 0 ---\n" + step_lines(0, range(200, 203)))
    steps.poll()
    assert steps.newest == 202
    with log.open("a") as more:
        more.write(step_lines(0, range(203, 205)))
    steps.poll()
    assert steps.newest == 204
    assert [s for _, s in steps.firsts][-3:] == [202, 203, 204]
