"""Which ranks of a hung job are stuck where the others are not, from their stacks.

In synchronous training a rank that stops (a deadlock in its data loader, a wait that
never ends, a GPU kernel that never returns) leaves every other rank waiting for it in
the next collective. So the ranks whose stacks are inside a collective are the ones
waiting; the rank (or ranks) that are not are the cause. When every rank is inside a
collective, the ones in another collective than the rest are named (a mismatched
collective: a rank that took another branch). Pure: text in, ranks and reasons out.

Stacks are as py-spy dump or Python's faulthandler print them: one frame per line,
innermost first (py-spy) or last (faulthandler); only which functions appear matters.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "barrier",
    "monitored_barrier",
    "gather",
    "scatter",
    "reduce",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "wait",
)
"""torch.distributed functions a rank waits in for its peers."""

_PY_SPY_FRAME = re.compile(r"^\s+([\w.<>]+) \(([^)]*)\)")
_FAULTHANDLER_FRAME = re.compile(r'^\s+File "([^"]*)", line \d+ in ([\w.<>]+)')


@dataclass(frozen=True)
class HangVerdict:
    """The ranks named, and why (for the event and `pitstop job stacks`)."""

    ranks: tuple[int, ...]
    reason: str


def frames(text: str) -> list[tuple[str, str]]:
    """(function, file) of every frame the stacks show, in the order printed."""
    found = []
    for line in text.splitlines():
        if m := _PY_SPY_FRAME.match(line):
            found.append((m.group(1).rpartition(".")[2], m.group(2)))
        elif m := _FAULTHANDLER_FRAME.match(line):
            found.append((m.group(2).rpartition(".")[2], m.group(1)))
    return found


def collective(text: str) -> str:
    """The torch.distributed collective the stacks wait in ("" when none)."""
    for function, path in frames(text):
        if function in COLLECTIVES and "distributed" in path:
            return function
    return ""


def locate(stacks: Mapping[int, str]) -> HangVerdict:
    """The ranks not where the others wait, from each rank's stacks (ranks whose stacks
    could not be taken are left out)."""
    waiting = {rank: collective(text) for rank, text in stacks.items() if text}
    if not waiting:
        return HangVerdict((), "no rank's stacks could be taken")
    outside = sorted(rank for rank, where in waiting.items() if not where)
    inside = sorted(rank for rank, where in waiting.items() if where)
    if outside and inside:
        where = Counter(waiting[r] for r in inside).most_common(1)[0][0]
        return HangVerdict(
            tuple(outside),
            f"ranks {outside} are outside any collective while ranks {inside} wait in {where}",
        )
    if not outside:
        counts = Counter(waiting.values())
        if len(counts) > 1:
            common, _ = counts.most_common(1)[0]
            odd = sorted(rank for rank, where in waiting.items() if where != common)
            others = sorted(set(waiting) - set(odd))
            return HangVerdict(
                tuple(odd),
                f"ranks {odd} wait in {sorted({waiting[r] for r in odd})} while ranks {others} "
                f"wait in {common}",
            )
        return HangVerdict((), f"every rank waits in {next(iter(counts))}: no rank stands apart")
    return HangVerdict((), "no rank waits in a collective: no rank stands apart")
