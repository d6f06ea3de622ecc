"""The pytest commands the docs show run what they say: every file or
directory they name exists, and one that selects tests by keyword (``-k``)
selects at least one (pytest would otherwise report "deselected" and exit 5,
and the sample output printed beside the command would come from nothing)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
# In an inline code span (which Markdown may wrap), or alone on a line of a
# code block (with backslash continuations).
INLINE = re.compile(r"`(python -m pytest[^`]*)`")
BLOCK = re.compile(r"^[ \t]*(python -m pytest(?:[^\n]*\\\n)*[^\n]*)$", re.M)


def doc_commands() -> dict[str, list[str]]:
    """Each distinct command (its arguments after ``pytest``) -> the docs
    that show it."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        spans = [*INLINE.findall(text), *BLOCK.findall(text)]
        for span in spans:
            command = " ".join(span.replace("\\\n", " ").split())
            found.setdefault(command, []).append(doc.name)
    return found


COMMANDS = doc_commands()


def test_the_docs_show_pytest_commands():
    assert len(COMMANDS) >= 10, COMMANDS  # the scan itself finds them


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_path_a_doc_command_names_exists(command):
    paths = [a.split("::")[0] for a in shlex.split(command) if a.startswith("tests")]
    assert paths, command
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"{command} (in {COMMANDS[command]}) names {missing}"


KEYWORD_COMMANDS = sorted(c for c in COMMANDS if " -k " in c)


@pytest.mark.parametrize("command", KEYWORD_COMMANDS)
def test_a_doc_command_selecting_by_keyword_selects_tests(command):
    args = shlex.split(command)[3:]  # after "python -m pytest"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "--collect-only"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # pytest's summary: "N tests collected" or "N/M tests collected (...)".
    counts = re.findall(r"(\d+)(?:/\d+)? tests? collected", proc.stdout)
    assert proc.returncode == 0 and counts and int(counts[-1]) > 0, (
        f"{command} (in {COMMANDS[command]}) selects nothing:\n{proc.stdout[-2000:]}"
    )
