"""docs/first_run.md as a new user runs it: the doctor's ``--help`` lists
the flags of the doc's table with its defaults, and the doc's sample model
directories, written by the command the doc gives, print through the doctor
the lines the doc shows."""

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.unit.conftest import NO_COPY_CHECKS, run_doctor
from vllm_ascend.kv_offload import doctor


def test_help_lists_every_flag_of_the_docs_with_its_default(capsys):
    """docs/first_run.md's flag table, as ``--help`` prints it."""
    with pytest.raises(SystemExit) as exited:
        doctor.main(["--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    table = (REPO / "docs" / "first_run.md").read_text().split("## Reading")[0]
    rows = [
        re.split(r"(?<!\\)\|", line)[1:3]  # flag(s), meaning; "\|" is text
        for line in table.splitlines()
        if line.startswith("| `--")
    ]
    flags = [f for cell, _ in rows for f in re.findall(r"`(--[a-z-]+)", cell)]
    assert len(flags) == 12
    for flag in flags:
        assert f"{flag} " in shown
    for cell, meaning in rows:
        for default in re.findall(r"\(default (\w+)", meaning):
            assert f"default {default}" in shown, (cell, default)


def test_the_docs_samples_print_the_docs_lines(tmp_path):
    """docs/first_run.md's sample directories, written by the command the
    doc gives, and its doctor commands: every line that holds no figure of
    the moment (host memory, times, GB/s) is in the doc as printed."""
    subprocess.run(
        [sys.executable, "-m", "tests.unit.model_configs", str(tmp_path)],
        cwd=REPO, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    doc = (REPO / "docs" / "first_run.md").read_text()
    runs = {
        "Qwen3-0.6B-bad": ("[FAIL] sizing",),
        "DeepSeek-V3.2-like": ("[warn] sizing",),
        "Qwen3-0.6B": ("model:", "CPU block:"),
        "DeepSeek-V2-Lite": ("model:", "CPU block:", "note:"),
    }
    for name, starts in runs.items():
        tp = ["--tensor-parallel-size", "2"] * (name == "DeepSeek-V2-Lite")
        _, out = run_doctor("--model", str(tmp_path / name), *tp, *NO_COPY_CHECKS)
        lines = [line.strip() for line in out.splitlines()]
        shown = [line for line in lines if line.startswith(starts)]
        assert len(shown) == len(starts), (name, lines)
        for line in shown:
            assert line.replace(str(tmp_path), "/tmp/models") in doc, (name, line)
