"""scripts/check_layout.py, the size and import-cycle rules `make check` keeps: it finds a
cycle through a TYPE_CHECKING import and through a package's __init__, and counts
``from a import b`` as importing the module a.b where there is one."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.check_layout import find_cycles, imported, module_name


def graph_of(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    known = set(sources)
    return {
        name: {
            t for t in imported(ast.parse(text), name, package, known) if t in known and t != name
        }
        for name, (text, package) in sources.items()
    }


def test_a_type_checking_import_closes_a_cycle() -> None:
    graph = graph_of(
        {
            "pitstop.x.a": ("from pitstop.x.b import B\n", False),
            "pitstop.x.b": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pitstop.x.a import A\n",
                False,
            ),
            "pitstop.x.c": ("from pitstop.x import b\n", False),
        }
    )
    assert find_cycles(graph) == [["pitstop.x.a", "pitstop.x.b"]]


def test_a_package_init_and_its_module_form_a_cycle_only_through_names() -> None:
    through_module = graph_of(
        {
            "pitstop.x": ("from pitstop.x.loop import Loop\n", True),
            "pitstop.x.loop": ("from pitstop.x import commands\n", False),
            "pitstop.x.commands": ("", False),
        }
    )
    assert find_cycles(through_module) == []
    through_name = graph_of(
        {
            "pitstop.x": ("from pitstop.x.loop import Loop\nHELPER = 1\n", True),
            "pitstop.x.loop": ("from .. import x\nfrom . import HELPER\n", False),
        }
    )
    assert find_cycles(through_name) == [["pitstop.x", "pitstop.x.loop"]]


def test_module_names_come_from_the_parts() -> None:
    assert module_name("agent/pitstop/agent/link.py") == "pitstop.agent.link"
    assert module_name("agent/pitstop/agent/__init__.py") == "pitstop.agent"
    assert module_name("bench/scale.py") is None
