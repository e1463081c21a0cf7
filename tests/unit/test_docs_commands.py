"""Every command the docs show exists, and every relative link points somewhere.

For README.md and each docs/*.md: the shell code blocks (```sh, ```bash, ```console, or
no language) are read line by line, continuation lines joined, comments dropped and
each line cut at pipes, `&&` and `;`. Of what is left:

- `pitstop`, `pitstop-scheduler`, `pitstop-agent`, `pitstop-checkpointd` (bare, or under
  `.venv/bin/`): the command path resolves in the real typer app (nothing is run) and
  every `--flag` is a parameter of the command it reaches;
- `make X`: X is a target of the Makefile;
- `python bench/X.py`, `python scripts/X.py`: the file exists and every `--flag` is one
  the script accepts (named in its source, else in its `--help`);
- `python -m MODULE`: the module can be found;
- `.venv/bin/pytest` / `python -m pytest`: every `tests/...` path exists.

`pitstop*` commands in running text (an inline code span on one line) are checked too.

Placeholders (UPPERCASE words, `<what>`, `[optional parts]`, `a|b` alternatives, `...`)
are read as such. Every `[text](path)` link that is not a URL names an existing file,
and a `#anchor` on a Markdown file names one of its headings. A failure names the doc,
the line and the command.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"", "sh", "bash", "console", "shell"}
ALT = "\x00"  # stands for a `|` between two words: `cancel|pause|resume`
TOP = (
    *("proto", "common", "health", "scheduler", "agent", "checkpointd", "rankside", "data"),
    *("trainer", "client", "tests", "bench", "scripts", "deploy", "examples", "docs"),
)
REPO_PATH = re.compile(rf"(?:{'|'.join(TOP)})/[\w./*-]*")
INLINE = re.compile(r"`((?:\.venv/bin/)?pitstop(?:-agent|-scheduler|-checkpointd)? [^`]*)`")
APPS = {
    "pitstop": "pitstop.client.cli",
    "pitstop-scheduler": "pitstop.scheduler.main",
    "pitstop-agent": "pitstop.agent.main",
    "pitstop-checkpointd": "pitstop.checkpointd.main",
}


@dataclass(frozen=True)
class Command:
    doc: Path
    line: int
    text: str
    words: tuple[str, ...]

    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}: {self.text.strip()}"


def shell_lines(doc: Path) -> Iterator[tuple[int, str]]:
    """(line number, logical line) of every shell code block, continuations joined."""
    fence: str | None = None
    pending: tuple[int, str] | None = None
    for number, raw in enumerate(doc.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            pending = None
            continue
        if fence is None or fence not in SHELL_LANGS:
            continue
        line = stripped
        if fence == "console" and line.startswith("$ "):
            line = line[2:]
        if pending is not None:
            start, text = pending
            line, number = text + " " + line, start
        if line.endswith("\\"):
            pending = (number, line[:-1])
            continue
        pending = None
        yield number, line


def words_of(line: str) -> list[list[str]]:
    """The line's simple commands (cut at `|`, `&&`, `;`, `&`, redirections), as words."""
    line = re.sub(r"<[a-z][a-z _-]*>", "PLACEHOLDER", line)  # <port it printed>
    line = re.sub(r"(?<=[\w\]-])\|(?=[\w\[-])", ALT, line)  # cancel|pause|resume
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: not a line of ours to judge
        return []
    redirected = False
    for token in tokens:
        if token and set(token) <= set("|&;()"):
            commands.append([])
            redirected = False
        elif token and set(token) <= set("<>"):
            redirected = True
        elif not redirected:
            commands[-1].append(token.strip("[]"))
    return [c for c in commands if c]


def program(words: list[str]) -> tuple[str, list[str]] | None:
    """The program a command runs (env assignments and sudo skipped), and its arguments."""
    while words and (words[0] == "sudo" or re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0])):
        words = words[1:]
    if not words:
        return None
    name = words[0].removeprefix(".venv/bin/")
    return name, words[1:]


def commands(doc: Path) -> Iterator[Command]:
    for number, line in shell_lines(doc):
        for words in words_of(line):
            if program(words) is not None:
                yield Command(doc, number, line, tuple(words))


def inline_commands(doc: Path) -> Iterator[Command]:
    """`pitstop ...` in running text, as an inline code span on one line."""
    fence = False
    for number, line in enumerate(doc.read_text().splitlines(), start=1):
        if line.strip().startswith("```"):
            fence = not fence
            continue
        for span in [] if fence else INLINE.findall(line):
            for words in words_of(span):
                found = program(words)
                if found is not None and found[0] in APPS:
                    yield Command(doc, number, span, tuple(words))


def alternatives(word: str) -> list[str]:
    return [w for w in word.split(ALT) if w]


@functools.cache
def click_command(name: str) -> Any:
    """The app's click command (typer's own copy of click: compared by what it has)."""
    module = importlib.import_module(APPS[name])
    command = typer.main.get_command(module.app)
    command.name = command.name or name
    return command


def is_group(command: Any) -> bool:
    return isinstance(getattr(command, "commands", None), dict)


def long_options(command: Any) -> set[str]:
    names = {"--help"}
    for param in command.params:
        names.update(o for o in (*param.opts, *param.secondary_opts) if o.startswith("--"))
    return names


def takes_value(command: Any, option: str) -> bool:
    for param in command.params:
        if option in (*param.opts, *param.secondary_opts):
            is_option = param.param_type_name == "option"
            return is_option and not param.is_flag and not getattr(param, "count", False)
    return False


def check_pitstop(name: str, args: list[str]) -> list[str]:
    """Problems with one `pitstop*` command line: its path, then its long flags."""
    paths: list[tuple[Any, list[str]]] = [(click_command(name), args)]
    problems: list[str] = []
    while paths:
        command, rest = paths.pop()
        index = 0
        while is_group(command) and index < len(rest):
            word = rest[index]
            if word.startswith("-"):
                option = word.split("=", 1)[0]
                if option.startswith("--") and option not in long_options(command):
                    problems.append(f"{command.name}: no option {option}")
                skip = "=" not in word and takes_value(command, option)
                index += 2 if skip else 1
                continue
            if word == "...":
                index += 1
                continue
            names = alternatives(word)
            missing = [n for n in names if n not in command.commands]
            if missing:
                problems.append(f"{command.name}: no command {', '.join(missing)}")
                break
            for other in names[1:]:
                paths.append((command.commands[other], rest[index + 1 :]))
            command = command.commands[names[0]]
            index += 1
        else:
            options = long_options(command)
            for word in rest[index:]:
                for alt in alternatives(word):
                    option = alt.split("=", 1)[0]
                    if option.startswith("--") and option not in options:
                        problems.append(f"{command.name}: no option {option}")
    return problems


@functools.cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.MULTILINE))


@functools.cache
def script_options(path: Path) -> frozenset[str]:
    named = set(re.findall(r"""["'](--[a-z0-9][a-z0-9-]*)["']""", path.read_text()))
    return frozenset(named | {"--help"})


@functools.cache
def script_help(path: Path) -> str:
    result = subprocess.run(
        [sys.executable, str(path), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.stdout + result.stderr


def check_python(args: list[str]) -> list[str]:
    if args[:2] == ["-m", "pytest"]:
        return check_pytest(args[2:])
    if args[:1] == ["-m"] and len(args) > 1:
        if importlib.util.find_spec(args[1]) is None:
            return [f"no module {args[1]}"]
        return []
    if not args or not args[0].startswith(("bench/", "scripts/")):
        return []
    path = ROOT / args[0]
    if not path.is_file():
        return [f"no file {args[0]}"]
    problems = []
    for word in args[1:]:
        for alt in alternatives(word):
            option = alt.split("=", 1)[0]
            if not option.startswith("--") or option in script_options(path):
                continue
            if not re.search(rf"{re.escape(option)}\b", script_help(path)):
                problems.append(f"{args[0]}: no option {option}")
    return problems


def check_pytest(args: list[str]) -> list[str]:
    return [
        f"no test path {word}"
        for word in args
        if word.startswith("tests/") and not (ROOT / word.split("::")[0]).exists()
    ]


def missing_paths(words: list[str]) -> list[str]:
    """The words that name a file or folder of the repository that is not there."""
    paths = [w.split("::")[0] for w in words if REPO_PATH.fullmatch(w)]
    return [f"no such path {p}" for p in paths if not any(ROOT.glob(p))]


def check(command: Command) -> list[str]:
    found = program(list(command.words))
    assert found is not None
    name, args = found
    problems = missing_paths(args)
    return problems + check_program(name, args)


def check_program(name: str, args: list[str]) -> list[str]:
    if name in APPS:
        return check_pitstop(name, args)
    if name == "make":
        targets = [w for w in args if not w.startswith("-") and "=" not in w]
        return [f"no make target {t}" for t in targets if t not in make_targets()]
    if name in ("python", "python3"):
        return check_python(args)
    if name == "pytest":
        return check_pytest(args)
    return []


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@functools.cache
def anchors(doc: Path) -> frozenset[str]:
    found = set()
    fence = False
    for line in doc.read_text().splitlines():
        if line.strip().startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return frozenset(found)


def link_problems(doc: Path) -> list[str]:
    problems = []
    fence = False
    for number, line in enumerate(doc.read_text().splitlines(), start=1):
        if line.strip().startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            path = (doc.parent / path_part).resolve() if path_part else doc
            where = f"{doc.relative_to(ROOT)}:{number}: link {target}"
            if not path.exists():
                problems.append(f"{where}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                problems.append(f"{where}: no heading #{anchor} in {path.name}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_command_the_doc_shows_exists(doc: Path) -> None:
    shown = [*commands(doc), *inline_commands(doc)]
    problems = [f"{c.where()}: {p}" for c in shown for p in check(c)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file(doc: Path) -> None:
    problems = link_problems(doc)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_repository_path_in_running_text_exists(doc: Path) -> None:
    """`tests/...`, `bench/...`, `deploy/...` and the like, as inline code spans."""
    problems = []
    for number, line in enumerate(doc.read_text().splitlines(), start=1):
        for span in re.findall(r"`([^`]+)`", line):
            for problem in missing_paths([span]):
                problems.append(f"{doc.relative_to(ROOT)}:{number}: {problem}")
    assert not problems, "\n".join(problems)


def test_the_docs_show_commands_at_all() -> None:
    """The extraction finds the commands it is meant to check (a guard on the parser)."""
    shown = [c for doc in DOCS for c in commands(doc)]
    names = {program(list(c.words))[0] for c in shown}  # type: ignore[index]
    assert {"pitstop", "pitstop-agent", "pitstop-scheduler", "make"} <= names
    readme = [c for c in shown if c.doc.name == "README.md"]
    assert any(c.words[:3] == ("pitstop", "cluster", "up") for c in readme)


def test_a_wrong_command_or_flag_is_caught() -> None:
    assert check_pitstop("pitstop", ["job", "submit", "-f", "x.yaml"]) == []
    assert check_pitstop("pitstop", ["job", "sumbit"]) == ["job: no command sumbit"]
    assert check_pitstop("pitstop", ["job", "list", "--sate", "x"]) == ["list: no option --sate"]
    assert check_pitstop("pitstop", ["--token", "T", "job", f"cancel{ALT}pause", "J"]) == []
    assert check_pitstop("pitstop", ["--nope", "job", "list"]) == ["pitstop: no option --nope"]
    words = words_of("pitstop job cancel|pause JOB [--reason R]   # a comment --bogus")
    assert words == [["pitstop", "job", f"cancel{ALT}pause", "JOB", "--reason", "R"]]
    assert words_of("a --x 1:<port it printed> | b > out") == [
        ["a", "--x", "1:PLACEHOLDER"],
        ["b"],
    ]
