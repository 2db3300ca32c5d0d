"""Every example in docs/api.md runs against a live server: its Python blocks in order in one namespace (as a
reader pastes them), its shell blocks through bash, each with the docs' address swapped for the test server's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).parent.parent / "docs" / "api.md"
DOC_URL = "http://127.0.0.1:8000"
# blocks that are not requests to a running server: starting one
SKIPPED = ("kvserve serve",)
# blocks that show a refusal on purpose (their output is an error body)
REFUSALS = ('"temperature": 5',)


def blocks(language: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each fenced block of ``language`` in docs/api.md, in order."""
    text = DOC.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(rf"```{language}\n(.*?)```", text, re.S)
            if not m.group(1).lstrip().startswith(SKIPPED)]


def test_the_doc_has_examples_of_both_kinds():
    assert len(blocks("python")) >= 15 and len(blocks("bash")) >= 15


def test_every_python_example_runs_in_order(server_url, capsys):
    namespace: dict = {"__name__": "docs_api"}
    for line, code in blocks("python"):
        try:
            exec(compile(code.replace(DOC_URL, server_url), f"docs/api.md:{line}", "exec"), namespace)
        except Exception as exc:  # noqa: BLE001 - the failing block is named, with its error
            pytest.fail(f"docs/api.md line {line}: {type(exc).__name__}: {exc}")
    assert "Paris" in capsys.readouterr().out


def json_bodies(out: str):
    """(text, object) for each JSON body curl printed: a line that begins with ``{`` holds one or more bodies back
    to back (curl prints no newline after a body, and a body's strings may hold ``}{`` themselves)."""
    decoder = json.JSONDecoder()
    for line in out.splitlines():
        at = 0
        while line.startswith("{", at):
            body, end = decoder.raw_decode(line, at)
            yield line[at:end], body
            at = end


@pytest.mark.parametrize("line, code", blocks("bash"), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_every_shell_example_runs(server_url, line, code):
    env = os.environ | {"KVSERVE_URL": server_url, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-o", "pipefail", "-c", code.replace(DOC_URL, server_url)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"docs/api.md line {line}: {done.stderr[-2000:]}"
    assert done.stdout.strip(), f"docs/api.md line {line}: no output"
    for part, body in json_bodies(done.stdout):  # a JSON body: an error only where the doc shows one
        assert "error" not in body or any(r in code for r in REFUSALS), f"docs/api.md line {line}: {part[:500]}"
