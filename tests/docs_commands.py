"""The commands the README and the docs show, found and run as a reader would run them.

A *block* is a fenced code block of a Markdown file whose language is ``sh`` (``bash`` and ``shell`` too):
commands to paste. ``text`` blocks are output and ``python`` blocks code; neither is a command. Inline code
spans that start with ``fedsdk`` or ``python <script>.py`` are commands too, shown in prose.

Every block is either run by ``tests/test_docs.py`` (in a scenario: blocks pasted in order into one shell in
an empty folder where the repository's files are reachable by the same relative paths), or run by another
test named in the registry there, or named there with the reason it cannot run on this machine (a command
typed on a Raspberry Pi over ssh). Every ``fedsdk`` and ``python <script>.py`` command, in blocks and in
prose, is also parsed by the program's own argument parser (:func:`dry_parse`), so that an option renamed
in the code fails the docs test, whichever test runs the command.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELL_LANGS = {"sh", "bash", "shell"}
_FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_COMMAND_START = re.compile(r"^(?:\.venv/bin/)?(?:fedsdk\s|python3?\s+(?:-m\s+fedsdk\s|\S+\.py\b))")


def doc_files() -> list[Path]:
    """Every Markdown file a reader is pointed to: the README, docs/, the READMEs of examples and certs."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += sorted((ROOT / "examples").glob("*/README.md"))
    files.append(ROOT / "certs" / "README.md")
    return [f for f in files if f.is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository
    heading: str  # slug of the nearest heading above it ("" before the first)
    index: int  # 1-based among the shell blocks under that heading
    text: str
    line: int

    @property
    def key(self) -> str:
        base = f"{self.file}#{self.heading}"
        return base if self.index == 1 else f"{base}:{self.index}"


def blocks(files: list[Path] | None = None) -> list[Block]:
    """The shell blocks of ``files`` (default: :func:`doc_files`), in order."""
    found: list[Block] = []
    for path in files or doc_files():
        rel = path.relative_to(ROOT).as_posix()
        heading, counts = "", dict[str, int]()
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            fence = _FENCE.match(lines[i])
            if fence is None:
                m = _HEADING.match(lines[i])
                if m:
                    heading = slug(m.group(2))
                i += 1
                continue
            indent, ticks, lang = fence.groups()
            body, j = [], i + 1
            while j < len(lines) and not lines[j].strip().startswith(ticks):
                body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
                j += 1
            if lang in SHELL_LANGS:
                counts[heading] = counts.get(heading, 0) + 1
                found.append(Block(rel, heading, counts[heading], "\n".join(body) + "\n", i + 1))
            i = j + 1
    return found


def plain_block_commands(files: list[Path] | None = None) -> list[tuple[str, int, str]]:
    """``(file, line, command)`` for each command line in a fenced block without a language (a results
    page's reproduce line, shown beside its output): parsed, not run, since most take minutes."""
    found = []
    for path in files or doc_files():
        rel = path.relative_to(ROOT).as_posix()
        lines = path.read_text(encoding="utf-8").splitlines()
        fence_lang: str | None = None
        pending = ""
        for n, line in enumerate(lines, 1):
            fence = _FENCE.match(line)
            if fence:
                fence_lang = None if fence_lang is not None else fence.group(3)
                continue
            if fence_lang != "":
                continue
            text = pending + line.strip()
            if text.endswith("\\"):
                pending = text[:-1] + " "
                continue
            pending = ""
            if _COMMAND_START.match(text) and "…" not in text and "..." not in text:
                found.append((rel, n, text))
    return found


def inline_commands(files: list[Path] | None = None) -> list[tuple[str, int, str]]:
    """``(file, line, command)`` for each inline code span outside fences that is a command."""
    found = []
    for path in files or doc_files():
        rel = path.relative_to(ROOT).as_posix()
        in_fence = False
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _FENCE.match(line):
                in_fence = not in_fence
                continue
            if in_fence:
                continue
            for span in _INLINE.findall(line):
                if _COMMAND_START.match(span.strip()) and "…" not in span and "..." not in span:
                    found.append((rel, n, span.strip()))
    return found


_HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")


def commands(text: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, a here-document kept whole with its
    command, comments and blank lines dropped."""
    out, current = [], ""
    lines = iter(text.splitlines())
    for raw in lines:
        line = raw.rstrip()
        heredoc = _HEREDOC.search(line)
        if heredoc and not line.endswith("\\"):
            body = [current + line]
            for more in lines:
                body.append(more)
                if more.strip() == heredoc.group(1):
                    break
            out.append("\n".join(body))
            current = ""
            continue
        if line.endswith("\\"):
            current += line[:-1].rstrip() + " "
            continue
        if current:
            line = line.lstrip()
        current += line
        stripped = current.strip()
        current = ""
        if stripped and not stripped.startswith("#"):
            out.append(stripped)
    return out


def _simple_commands(command: str) -> list[list[str]]:
    """The argument vectors of one shell line, split at ``&&``, ``||``, ``;``, ``|`` and ``&``, without
    redirections; shell variables keep their names (a parse check needs words, not values)."""
    command = re.sub(r"\s\d*(?:>>?|<|&>)(?:&\d+|\s*[^\s&;|]+)", " ", command.split(" #")[0])
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words, argvs = [], []
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&", ";;"):
            argvs.append(words)
            words = []
        else:
            words.append(token)
    argvs.append(words)
    return [a for a in argvs if a]


def parse_targets(command: str) -> list[list[str]]:
    """The argument vectors in ``command`` that :func:`dry_parse` can check: ``fedsdk …`` (as
    ``python -m fedsdk``) and ``python <script>.py …`` for a script in this repository."""
    targets = []
    if _HEREDOC.search(command.splitlines()[0]):
        command = command.splitlines()[0]
    for argv in _simple_commands(command):
        argv = [re.sub(r"\$\{?(\w+)\}?", r"\1", w).strip("[]") for w in argv]
        argv = [w.split("|")[0] if "|" in w and not w.startswith("-") else w for w in argv if w]
        head = argv[0].removeprefix(".venv/bin/")
        if head == "fedsdk":
            targets.append(["-m", "fedsdk", *argv[1:]])
        elif head in ("python", "python3") and len(argv) > 1:
            if argv[1:3] == ["-m", "fedsdk"]:
                targets.append(argv[1:])
            elif argv[1].endswith(".py"):
                targets.append(argv[1:])
    return targets


_DRY = r"""
import argparse, json, os, runpy, sys
results = []
LENIENT = False
OPTIONAL = {"torch"}
class Parsed(BaseException):
    pass
real_parse = argparse.ArgumentParser.parse_args
real_add = argparse._ActionsContainer.add_argument
real_error = argparse.ArgumentParser.error
def parse_only(self, args=None, namespace=None):
    real_parse(self, args, namespace)
    raise Parsed
def add_argument(self, *names, **kw):
    if LENIENT:
        kw.pop("required", None)
        if names and not names[0].startswith("-") and kw.get("nargs") in (None, 1):
            kw["nargs"] = "?"
    return real_add(self, *names, **kw)
def error(self, message):
    if LENIENT and not ("unrecognized arguments" in message or "invalid choice" in message):
        raise Parsed
    real_error(self, message)
argparse.ArgumentParser.parse_args = parse_only
argparse._ActionsContainer.add_argument = add_argument
argparse.ArgumentParser.error = error
for item in json.loads(sys.stdin.read()):
    argv, LENIENT, base = item["argv"], item["lenient"], item["base"]
    err = ""
    module = argv[0] == "-m"
    sys.argv = ["fedsdk", *argv[2:]] if module else list(argv)
    try:
        if module:
            from fedsdk.cli import main
            main(sys.argv[1:])
        else:
            found = [p for p in (os.path.join(d, argv[0]) for d in (base, ROOT)) if os.path.exists(p)]
            path = found[0] if found else None
            if path is None:
                raise FileNotFoundError(argv[0])
            sys.argv[0] = path
            runpy.run_path(path, run_name="__main__")
        err = "ran without parsing arguments"
    except Parsed:
        pass
    except ModuleNotFoundError as exc:
        if exc.name not in OPTIONAL:  # an extra the suite does not install (the script says it needs it)
            err = f"{type(exc).__name__}: {exc}"
    except SystemExit as exc:
        if not (exc.code == 0 and ("--help" in argv or "-h" in argv)):
            err = f"argument parser exited {exc.code}"
    except BaseException as exc:
        err = f"{type(exc).__name__}: {exc}"
    results.append(err)
sys.__stdout__.write("\n@@" + json.dumps(results))
"""


def dry_parse(items: list[tuple[list[str], bool, str]]) -> list[str]:
    """Parse each ``(argv, lenient, base)`` with its program's own parser, running nothing after the parse;
    one message per item ("" when it parsed). ``base`` is the folder a script path is relative to (the
    document's, else the repository's). A lenient parse (a command named in prose, where values and required
    arguments may be left out) fails only on an unknown option or a value outside the choices."""
    if not items:
        return []
    payload = [{"argv": a, "lenient": lenient, "base": base} for a, lenient, base in items]
    proc = subprocess.run(
        [sys.executable, "-c", f"ROOT = {str(ROOT)!r}\n" + _DRY],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    tail = proc.stdout.rpartition("\n@@")[2]
    try:
        return list(json.loads(tail))
    except ValueError:
        raise AssertionError(f"the parse check failed: {proc.stderr[-2000:]}") from None


def _serves(command: str) -> bool:
    """A foreground command that runs until it is stopped: a broker, or a coordinator or key server
    without ``--exit-when-done``."""
    words = command.split()
    if not words or command.endswith("&"):
        return False
    if words[0] in ("mosquitto", "sudo") and "mosquitto" in words[:2]:
        return True
    return command.startswith(("fedsdk coordinator", "fedsdk keyserver")) and "--exit-when-done" not in words


def script(parts: list[Block], substitutions: dict[str, str]) -> str:
    """One bash script that runs ``parts`` in order as pasted: a line ending in ``&`` runs in the
    background and must exit 0 by the end (``mosquitto`` is stopped instead); a bare ``wait`` waits for each
    job and fails with the first that failed; a broker, coordinator or key server in the foreground, which
    runs until stopped, must still run 3 s after its start; any other failure stops the script with its
    code.
    ``substitutions`` replace text (ports); its ``http`` entry is the dashboard address a coordinator
    started without ``--http`` gets, so that the test does not depend on port 8080 being free."""
    lines = [
        "set -euo pipefail",
        "servers=(); jobs=()",
        'trap \'for p in "${servers[@]}"; do kill "$p" 2>/dev/null || true; done\' EXIT',
    ]
    for block in parts:
        text = block.text
        for old, new in substitutions.items():
            if old != "http":
                text = text.replace(old, new)
        lines.append(f"# {block.key}")
        for command in commands(text):
            if re.fullmatch(r"wait(\s+#.*)?", command):  # every job's own exit status, not bash's 0
                lines.append('for p in "${jobs[@]}"; do wait "$p"; done; jobs=()')
                continue
            if (
                command.startswith("fedsdk coordinator")
                and "--http" not in command
                and "http" in substitutions
            ):
                command = command.replace(
                    "fedsdk coordinator", f"fedsdk coordinator --http {substitutions['http']}", 1
                )
            if _serves(command):  # runs until stopped: started, checked alive, stopped at the end
                lines.append(f'{command} & servers+=($!); sleep 3; kill -0 "${{servers[-1]}}"')
                continue
            if command.endswith("&") and not command.endswith("&&"):
                target = "servers" if command.split()[0].endswith("mosquitto") else "jobs"
                lines.append(f"{command} {target}+=($!)")
            else:
                lines.append(command)
    lines.append('for p in "${jobs[@]}"; do wait "$p"; done')
    return "\n".join(lines) + "\n"
