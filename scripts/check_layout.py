"""The repository's size and import rules, checked: no file over 800 lines, no class over
300 lines, no import cycle between pitstop's modules (imports under ``if TYPE_CHECKING:``
and inside functions count too). Generated gRPC code and migrations are left out.

Run by ``make check``; prints each breach and exits 1, or one line saying all hold."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = (
    "proto",
    "common",
    "health",
    "scheduler",
    "agent",
    "checkpointd",
    "rankside",
    "trainer",
    "client",
    "data",
)
MAX_FILE_LINES = 800
MAX_CLASS_LINES = 300


def generated(path: str) -> bool:
    return path.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")) or "/migrations/versions/" in path


def python_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return [p for p in listed if not generated(p) and (ROOT / p).is_file()]


def module_name(path: str) -> str | None:
    """pitstop.x.y for a file of a part (``agent/pitstop/agent/link.py``), else None."""
    first, _, rest = path.partition("/")
    if first not in PARTS or not rest.startswith("pitstop/"):
        return None
    dotted = rest[: -len(".py")].replace("/", ".")
    return dotted.removesuffix(".__init__")


def imported(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """The modules `tree` imports. ``from a import b`` imports ``a.b`` where that is a
    module, else ``a`` (the name b is defined there), as import-linter counts it."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    breaches: list[str] = []
    trees: dict[str, tuple[ast.Module, bool]] = {}
    for path in python_files():
        text = (ROOT / path).read_text()
        lines = text.count("\n") + (not text.endswith("\n") and bool(text))
        if lines > MAX_FILE_LINES:
            breaches.append(f"{path}: {lines} lines (at most {MAX_FILE_LINES}): split it by theme")
        tree = ast.parse(text, filename=path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    breaches.append(
                        f"{path}:{node.lineno}: class {node.name} has {size} lines "
                        f"(at most {MAX_CLASS_LINES}): give a part of it a class of its own"
                    )
        name = module_name(path)
        if name is not None:
            trees[name] = (tree, path.endswith("__init__.py"))
    graph: dict[str, set[str]] = {name: set() for name in trees}
    for name, (module_tree, is_package) in trees.items():
        for target in imported(module_tree, name, is_package, set(trees)):
            if target in trees and target != name:
                graph[name].add(target)
    for cycle in find_cycles(graph):
        breaches.append("import cycle between " + ", ".join(cycle))
    for breach in breaches:
        print(breach)
    if breaches:
        return 1
    print(
        f"layout: {len(python_files())} files within {MAX_FILE_LINES} lines, classes within "
        f"{MAX_CLASS_LINES}, {len(trees)} modules without an import cycle"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
