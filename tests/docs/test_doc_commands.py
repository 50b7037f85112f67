"""Every command the docs show runs the program they name with flags it accepts.

What is checked: each fenced code block of README.md, docs/*.md and examples/**/README.md
whose fence says `bash`, `sh`, `shell` or `console` (every line is a command), and the
`$ `-prompted lines of any other block (`text`, plain: the rest is output). A line is cut
at `&&`, `||`, `;` and `|`, a trailing `# comment` is dropped, `for X in A B; do CMD;
done` is checked as CMD with X=A, and `[--flag VALUE]` (an optional part, as in a usage
line) is checked as `--flag VALUE`. Of the commands, these are checked; all others (`pip`,
`ray`, `curl`, `python -m pytest` ...) are not:

- `kvstrata ...` and `python -m kvstrata[.cli] ...`: `kvstrata.cli.build_parser()`;
- `python benchmarks/X.py ...`, `python scripts/X.py ...`, `python examples/.../X.py ...`
  (any python: `.venv/bin/python`, `python3`): the file exists, and its `build_parser()`
  (every such script has one, importable without running the job) parses the arguments
  shown: a removed or renamed flag, a value of the wrong type or outside its choices
  fails here, naming the doc and line;
- `bash scripts/X.sh ...`: the file exists and each `--flag` shown is a `case` pattern in it.

Nothing is run and no subprocess is started: each script is imported once (its
environment, `sys.path` and script-local modules are put back afterwards).

A block shown on purpose for another commit (a figure's reproduction at an old commit)
is skipped when the line just before its opening fence, blank lines aside, is the marker

    <!-- doc-check: historical -->

(an HTML comment: Markdown renders nothing). docs/operations.md says the same for writers.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HISTORICAL = "<!-- doc-check: historical -->"
SHELL_FENCES = {"bash", "sh", "shell", "console"}
SCRIPT_FOLDERS = ("benchmarks/", "scripts/", "examples/")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```", re.S | re.M)
DEFAULTS_COMMENT = re.compile(r"#\s*defaults:\s*([^#]*)")
FOR_LOOP = re.compile(r"^for (?P<var>\w+) in (?P<first>\S+)[^;]*; do (?P<body>.*?);? done\b")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("**/README.md"))]


@dataclass(frozen=True)
class DocCommand:
    """One command as a doc shows it: where, and its words after shell splitting.
    `defaults` marks the flags of a `# defaults: --flag VALUE ...` comment after the
    command: each must be the program's default."""

    where: str
    argv: tuple[str, ...]
    defaults: bool = False

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def fenced_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(fence language, line number of the block's first line, lines) of every block not
    marked historical."""
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        if before == HISTORICAL:
            continue
        first_line = text.count("\n", 0, match.start("body")) + 1
        blocks.append((match.group("lang").lower(), first_line, match.group("body").splitlines()))
    return blocks


def command_lines(lang: str, first_line: int, lines: list[str]) -> list[tuple[int, str]]:
    """(line number, command text) of each command of a block: continuation lines joined,
    and for a non-shell block only its `$ ` lines."""
    commands: list[tuple[int, str]] = []
    pending = ""
    for offset, raw in enumerate(lines):
        line = raw.strip()
        if lang not in SHELL_FENCES:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        line = line.removeprefix("$ ")
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        commands.append((first_line + offset, pending + line))
        pending = ""
    return commands


def segments(command: str) -> list[list[str]]:
    """The simple commands of a line, each as its words."""
    loop = FOR_LOOP.match(command)
    if loop:
        command = loop.group("body").replace(f"${loop.group('var')}", loop.group("first"))
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    parts: list[list[str]] = [[]]
    for word in lexer:
        if word in {";", "&&", "||", "|", "&", ";;"}:
            parts.append([])
        else:
            parts[-1].append(word)
    return [part for part in parts if part]


def checked_argv(words: list[str]) -> tuple[str, ...] | None:
    """The words from the program on, as ("kvstrata" | a script path, *arguments), or
    None for a command this test does not check."""
    while words and re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0]):
        words = words[1:]
    if not words:
        return None
    program, rest = Path(words[0]).name, words[1:]
    if program == "kvstrata":
        return ("kvstrata", *unbracket(rest))
    if program == "bash" and rest and rest[0].startswith("scripts/"):
        return (rest[0], *unbracket(rest[1:]))
    if not re.fullmatch(r"python(3(\.\d+)?)?", program) or not rest:
        return None
    if rest[0] == "-m" and len(rest) > 1 and rest[1] in {"kvstrata", "kvstrata.cli"}:
        return ("kvstrata", *unbracket(rest[2:]))
    if rest[0].startswith(SCRIPT_FOLDERS):
        return (rest[0], *unbracket(rest[1:]))
    return None


def unbracket(words: list[str]) -> list[str]:
    """`[--watch]` -> `--watch`, `[--namespace NS]` -> `--namespace NS`: a usage line's
    optional parts are checked as given."""
    return [word.strip("[]") for word in words if word.strip("[]") not in {"", "..."}]


def doc_commands() -> list[DocCommand]:
    found = []
    for path in doc_files():
        for lang, first_line, lines in fenced_blocks(path.read_text()):
            for number, command in command_lines(lang, first_line, lines):
                where = f"{path.relative_to(ROOT)}:{number}"
                for words in segments(command):
                    argv = checked_argv(words)
                    if argv:
                        found.append(DocCommand(where, argv))
                defaults = DEFAULTS_COMMENT.search(command)
                if defaults and argv:
                    found.append(DocCommand(where, (argv[0], *shlex.split(defaults.group(1))), defaults=True))
    return found


@contextlib.contextmanager
def isolated_import(folder: Path):
    """Import a script as a test would run it, then put back what importing it changed:
    the environment (some scripts set vLLM/Ray variables at import), `sys.path`, and the
    script-local modules (`plotting`, `tier_throughput` ...) it pulled in."""
    environ, path, modules = dict(os.environ), list(sys.path), set(sys.modules)
    sys.path[:0] = [str(folder), str(ROOT)]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        local = tuple(str(ROOT / name) for name in SCRIPT_FOLDERS)
        for name in set(sys.modules) - modules:
            if (getattr(sys.modules[name], "__file__", None) or "").startswith(local):
                del sys.modules[name]


@functools.cache
def parser_of(program: str) -> argparse.ArgumentParser:
    """The argparse parser of `kvstrata` or of a script (by its path from the repository root)."""
    if program == "kvstrata":
        from kvstrata.cli import build_parser

        return build_parser()
    path = ROOT / program
    assert path.is_file(), f"{program} does not exist"
    with isolated_import(path.parent):
        spec = importlib.util.spec_from_file_location(f"_doc_check_{path.stem}", path)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(module)
        assert hasattr(module, "build_parser"), f"{program} has no build_parser(): give it one (see this test's docstring)"
        parser = module.build_parser()
    parser.prog = program  # argparse's messages name the script, not pytest
    return parser


def check(command: DocCommand) -> None:
    """Raise AssertionError naming the doc line and argparse's complaint, if any."""
    program, arguments = command.argv[0], list(command.argv[1:])
    if program.endswith(".sh"):
        path = ROOT / program
        assert path.is_file(), f"{command}: {program} does not exist"
        text = path.read_text()
        for flag in (word.split("=", 1)[0] for word in arguments if word.startswith("-")):
            assert re.search(rf"^\s*(\S+\|)*{re.escape(flag)}(\|\S+)*\)", text, re.M), f"{command}: {program} has no {flag}"
        return
    parser = parser_of(program)
    complaint = io.StringIO()
    with contextlib.redirect_stderr(complaint), contextlib.redirect_stdout(io.StringIO()):
        try:
            parsed = vars(parser.parse_args(arguments))
        except SystemExit as exit_:
            if exit_.code:
                raise AssertionError(f"{command}\n  is refused by {program}: {complaint.getvalue().strip()}") from None
            return
    if command.defaults:
        for word in arguments:
            action = parser._option_string_actions.get(word)
            if action is not None and parsed[action.dest] != action.default:
                raise AssertionError(f"{command}\n  {program}'s default {word} is {action.default!r}, not {parsed[action.dest]!r}")


COMMANDS = doc_commands()


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_doc_command_is_accepted(command: DocCommand) -> None:
    check(command)


def test_the_docs_show_commands_of_each_kind() -> None:
    """The extractor finds what the docs hold (a broken extractor would pass everything)."""
    programs = {command.argv[0] for command in COMMANDS}
    assert "kvstrata" in programs
    assert {"scripts/setup.sh", "benchmarks/manager_overhead.py", "examples/quickstart.py"} <= programs
    assert len(COMMANDS) >= 40, [str(c) for c in COMMANDS]


def test_a_removed_flag_fails() -> None:
    """The check refuses a flag the program lacks, a value of the wrong type and a wrong choice."""
    for argv in (
        ("kvstrata", "status", "--no-such-flag"),
        ("benchmarks/manager_overhead.py", "--prefix-chunks", "32"),
        ("benchmarks/held_pins.py", "--pins", "many"),
        ("benchmarks/tier_throughput.py", "--tier", "tape"),
        ("scripts/setup.sh", "--no-such-flag"),
    ):
        with pytest.raises(AssertionError, match="no-such-flag|refused"):
            check(DocCommand("synthetic:1", argv))
    with pytest.raises(AssertionError, match="default --forward-ms is 2.0, not 5.0"):
        check(DocCommand("synthetic:1", ("benchmarks/manager_overhead.py", "--forward-ms", "5"), defaults=True))


def test_extraction_rules() -> None:
    text = "\n".join(
        [
            "```bash",
            "$ kvstrata up --config X.yaml  # a comment --not-a-flag",
            "for c in 16 32; do python benchmarks/peer_fetch.py --rounds $c; done",
            ".venv/bin/python -m pytest -q && python3 scripts/soak.py \\",
            "  --minutes 1",
            "```",
            "```text",
            "kvstrata tier throughput (output, not a command)",
            "$ kvstrata status [--node ID]",
            "```",
            HISTORICAL,
            "",
            "```bash",
            "python benchmarks/gone.py --old-flag",
            "```",
        ]
    )
    found = [
        (number, argv)
        for lang, first, lines in fenced_blocks(text)
        for number, command in command_lines(lang, first, lines)
        for argv in filter(None, map(checked_argv, segments(command)))
    ]
    assert found == [
        (2, ("kvstrata", "up", "--config", "X.yaml")),
        (3, ("benchmarks/peer_fetch.py", "--rounds", "16")),
        (5, ("scripts/soak.py", "--minutes", "1")),
        (9, ("kvstrata", "status", "--node", "ID")),
    ]
