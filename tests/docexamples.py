"""The docs' examples, run against a live server: their outputs are written by this module, and checked by it in CI.

In README.md and docs/api.md every fenced ``bash`` or ``python`` block is an example (blocks that start a server
or install something aside: ``SKIPPED``). An example whose next fenced block is marked ``text output`` or
``json output`` (the info string after the fence: ```` ```json output ````) shows its output there, and that output
is the server's: ::

    .venv/bin/python -m tests.docexamples --write      # start `kvserve serve` (the defaults), rerun every example
                                                       # in order, rewrite every output block
    .venv/bin/python -m tests.docexamples --url http://127.0.0.1:8000   # check against a running server instead

tests/test_docs_examples.py reruns the examples against a live server with the default configuration and compares
each output block with what the server answers now: the structure (every JSON body's keys, list lengths, the SSE
events one by one) and every deterministic field (text, token ids and counts, finish reasons, logprobs within
1e-3), leaving out what differs run to run (ids, times, prefix-cache counts: ``VOLATILE``). Examples that sample
pin a ``seed``. To add an output to an example, put an empty ```` ```text output ```` block right after it and
run the ``--write`` command. Python examples run in order in one namespace, as a reader pastes them; shell
examples run through bash; in both, the docs' address is swapped for the server's, and ``.venv/bin/`` for the
environment this runs in.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", ROOT / "docs" / "api.md")
DOC_URL = "http://127.0.0.1:8000"
# blocks that are not requests to a running server: starting one, installing, building, testing
SKIPPED = ("kvserve serve", ".venv/bin/kvserve serve", "bash scripts/", "docker ", "git ", "pip ", ".venv/bin/python -m pytest")
OUTPUTS = ("text output", "json output")
# fields whose values differ run to run (only their presence and type are compared): ids, clocks, measured times,
# and prompt tokens found in the prefix cache (which depends on what ran before)
# (and /tokenizer_info's local_files_only: whether huggingface_hub was imported offline, which differs between
# `kvserve serve` and a server inside pytest)
VOLATILE = {"id", "created", "created_at", "system_fingerprint", "item_id", "queue_ms", "ttft_ms",
            "decode_tokens_per_s", "cached_tokens", "local_files_only"}
# the same in printed text (``repr``s, header lines, a metric's value, the client CLI's figures)
MASKS = (
    (re.compile(r"\b(chatcmpl|cmpl|resp|msg|call)([-_])[0-9A-Za-z]{6,}"), r"\1\2#"),
    (re.compile(r"\b[0-9a-f]{16,}\b"), "#"),
    (re.compile(r"""(['"]?\b(?:%s)['"]?\s*[:=]\s*)-?[\d.]+(?:e-?\d+)?""" % "|".join(VOLATILE)), r"\1#"),
    (re.compile(r"\b\d+(?:\.\d+)?(?= ?(?:ms|tokens/s|s)\b)"), "#"),
    (re.compile(r"\(\d+ cached\)"), "(# cached)"),
    (re.compile(r"^(date|x-request-id): .*$", re.M), r"\1: #"),
    (re.compile(r"^(kvserve:\S+) -?[\d.]+(?:e[-+]?\d+)?$", re.M), r"\1 #"),
)
FLOAT_TOLERANCE = 1e-3  # logprobs: identical on one machine; this allows the last bits another CPU may round apart
WIDTH = 116  # a JSON body is wrapped to this many characters
DECIMALS = 4  # a JSON body's floats are shown to this many decimals (FLOAT_TOLERANCE is coarser)


@dataclass(frozen=True)
class Block:
    """One fenced block: its first line's number, info string, code, and the code's span in the file's text."""

    line: int
    info: str
    code: str
    start: int
    end: int


@dataclass(frozen=True)
class Example:
    """A runnable block and the output block that follows it (None: its output is not shown)."""

    block: Block
    output: Block | None

    @property
    def language(self) -> str:
        return self.block.info


def blocks(text: str) -> list[Block]:
    """Every fenced block of a markdown text, in order."""
    return [Block(text[:m.start()].count("\n") + 1, m.group(1).strip(), m.group(2), m.start(2), m.end(2))
            for m in re.finditer(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", text, re.M | re.S)]


def examples(text: str) -> list[Example]:
    """The runnable blocks (``bash``, ``python``; not ``SKIPPED``), each with its output block if the next fenced
    block is one, with only blank lines between.

    Raises:
        ValueError: an output block that follows no example.
    """
    found: list[Example] = []
    fences = blocks(text)
    taken = set()
    for i, block in enumerate(fences):
        if block.info not in ("bash", "python") or block.code.lstrip().startswith(SKIPPED):
            continue
        after = fences[i + 1] if i + 1 < len(fences) else None
        between = text[block.end:after.start] if after else ""
        # between the two codes: this block's closing fence, blank lines, the next block's opening fence
        output = after if after and after.info in OUTPUTS and not re.sub(r"```[^\n]*", "", between).strip() else None
        if output:
            taken.add(output.start)
        found.append(Example(block, output))
    stray = [b.line for b in fences if b.info in OUTPUTS and b.start not in taken]
    if stray:
        raise ValueError(f"output blocks that follow no example, at lines {stray}")
    return found


class Runner:
    """Runs examples against ``url`` in order: Python in one namespace, shell through bash."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.namespace: dict = {"__name__": "docs_example"}

    def run(self, example: Example, source: str) -> tuple[str, str | None]:
        """``(output, error)``: what the example printed (stdout, and stderr for shell), and why it failed (None
        when it ran). ``source`` names the file for error messages."""
        # the docs' address is the server's, and their .venv the environment running this
        code = example.block.code.replace(DOC_URL, self.url).replace(".venv/bin/", f"{Path(sys.executable).parent}/")
        where = f"{source}:{example.block.line}"
        if example.language == "python":
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    exec(compile(code, where, "exec"), self.namespace)
            except Exception as exc:  # noqa: BLE001 - the failing example is named, with its error
                return out.getvalue(), f"{where}: {type(exc).__name__}: {exc}"
            return out.getvalue(), None
        env = os.environ | {"KVSERVE_URL": self.url, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        done = subprocess.run(["bash", "-o", "pipefail", "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=300, cwd=ROOT)
        error = None if done.returncode == 0 else f"{where}: exit status {done.returncode}: {done.stdout[-2000:]}"
        return done.stdout, error


def render(output: str, url: str) -> str:
    """An example's output as the docs show it: the server's address as the docs', each JSON body that a line
    starts with wrapped to ``WIDTH`` (curl prints bodies on one line, with no newline after the last), trailing
    spaces dropped."""
    lines = []
    for line in output.replace(url.rstrip("/"), DOC_URL).splitlines():
        try:
            bodies = [body for _, body in json_bodies(line)]
        except json.JSONDecodeError:  # a line that starts like JSON and is not (a printed Python dict)
            bodies = []
        lines.extend([dump(body) for body in bodies] if bodies else [line.rstrip()])
    return "\n".join(lines).strip("\n") + "\n"


def json_bodies(line: str) -> Iterator[tuple[str, object]]:
    """``(text, value)`` of each JSON value in a line that holds one or more back to back (a body's strings may
    hold ``}{`` themselves, so the line is decoded, not split)."""
    decoder = json.JSONDecoder()
    at = 0
    while line.startswith("{", at):
        body, end = decoder.raw_decode(line, at)
        yield line[at:end], body
        at = end


def dump(value: object, indent: int = 0) -> str:
    """JSON as ``json.dumps`` writes it (long floats rounded to ``DECIMALS``), wrapped: a value that does not fit in
    ``WIDTH`` from column ``indent`` fills its members line by line, each line starting under the first member."""
    value = _rounded(value)
    flat = json.dumps(value, ensure_ascii=False)
    if indent + len(flat) <= WIDTH or not isinstance(value, (dict, list)) or not value:
        return flat
    if isinstance(value, dict):
        parts = [(json.dumps(key, ensure_ascii=False) + ": ", item) for key, item in value.items()]
        opening, closing = "{", "}"
    else:
        parts = [("", item) for item in value]
        opening, closing = "[", "]"
    column = indent + 1  # where every line of members starts
    lines, line = [], ""
    for name, item in parts:
        member = name + json.dumps(item, ensure_ascii=False)
        if line and column + len(line) + 2 + len(member) + 1 <= WIDTH:
            line = f"{line}, {member}"
            continue
        if line:
            lines.append(line + ",")
        line = member if column + len(member) + 1 <= WIDTH else name + dump(item, column + len(name))
    lines.append(line)
    return opening + ("\n" + " " * column).join(lines) + closing


def _rounded(value: object) -> object:
    """``value`` with floats of more than ``DECIMALS`` decimals rounded to them (a float32 logprob's 17 digits say
    no more than its first few)."""
    if isinstance(value, float):
        return round(value, DECIMALS)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def records(output: str) -> list[tuple[str, object]]:
    """An output as comparable records: each JSON body (possibly wrapped over lines), each SSE event's JSON, each
    line a Python literal evaluates (a printed dict or list), and every other non-blank line with ``MASKS``
    applied."""
    found: list[tuple[str, object]] = []
    decoder = json.JSONDecoder()
    at = 0
    while at < len(output):
        end = output.find("\n", at)
        end = len(output) if end < 0 else end
        line = output[at:end]
        if line.startswith(("{", "[")):
            try:
                body, stop = decoder.raw_decode(output, at)
                found.append(("json", body))
                at = stop
                continue
            except json.JSONDecodeError:
                pass
        if line.startswith("data: {"):
            found.append(("sse", json.loads(line[len("data: "):])))
        elif line.strip():
            try:
                found.append(("literal", ast.literal_eval(line.strip())))
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                masked = line.rstrip()
                for pattern, replacement in MASKS:
                    masked = pattern.sub(replacement, masked)
                found.append(("text", masked))
        at = end + 1
    return found


def differences(shown: str, now: str) -> list[str]:
    """How ``now`` (an example's output) differs from ``shown`` (its output block) in structure or in a
    deterministic field; empty when it does not."""
    expected, got = records(shown), records(now)
    if [kind for kind, _ in expected] != [kind for kind, _ in got]:
        return [f"the output's shape changed: {len(expected)} records shown, {len(got)} now "
                f"({[k for k, _ in expected]} -> {[k for k, _ in got]}); now:\n{now[:1500]}"]
    problems: list[str] = []
    for index, ((kind, a), (_, b)) in enumerate(zip(expected, got, strict=True)):
        if kind == "text":
            if a != b:
                problems.append(f"record {index}: {a!r} shown, {b!r} now")
        else:
            problems.extend(f"record {index}{where}" for where in _diff(a, b, ""))
    return problems


def _diff(a: object, b: object, path: str) -> list[str]:
    key = path.rsplit(".", 1)[-1]
    if key in VOLATILE:
        same_kind = type(a) is type(b) or (isinstance(a, (int, float)) and isinstance(b, (int, float)))
        return [] if same_kind else [f"{path}: {type(a).__name__} shown, {type(b).__name__} now"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} shown, {sorted(b)} now"]
        return [d for k in a for d in _diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items shown, {len(b)} now: {json.dumps(b, default=str)[:300]}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{path}[{i}]")]
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
                and math.isclose(a, b, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE):
            return []
    elif a == b and type(a) is type(b):
        return []
    return [f"{path}: {a!r} shown, {b!r} now"]


def run_doc(path: Path, runner: Runner) -> tuple[list[str], list[tuple[Example, str]]]:
    """Run every example of one file in order: ``(errors, [(example, its output now, as ``render`` writes it)])``
    (an example that failed is in ``errors`` only)."""
    errors, outputs = [], []
    for example in examples(path.read_text()):
        output, error = runner.run(example, path.name)
        if error:
            errors.append(error)
        else:
            outputs.append((example, render(output, runner.url)))
    return errors, outputs


def compare(path: Path, outputs: list[tuple[Example, str]]) -> list[str]:
    """What differs between each output block of ``path`` and its example's output now, one line each."""
    text = path.read_text()
    return [f"{path.name}:{example.output.line}: {problem}" for example, output in outputs if example.output
            for problem in differences(text[example.output.start:example.output.end], output)]


def write(path: Path, outputs: list[tuple[Example, str]]) -> int:
    """Put each output into its block; returns how many changed."""
    text = path.read_text()
    changed = 0
    shown = [(example, output) for example, output in outputs if example.output is not None]
    for example, output in sorted(shown, key=lambda pair: pair[0].output.start, reverse=True):
        if text[example.output.start:example.output.end] != output:
            text = text[:example.output.start] + output + text[example.output.end:]
            changed += 1
    path.write_text(text)
    return changed


@contextlib.contextmanager
def default_server() -> Iterator[str]:
    """``kvserve serve`` with every default but the port (a free one), until the block ends; yields its URL."""
    from tests.serverutil import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.server.cli", "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        import httpx

        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvserve serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("kvserve serve was not ready within 600 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    """Rerun the docs' examples; with ``--write`` rewrite their output blocks, else report what differs.
    Returns 0, or 1 when an example failed or (without ``--write``) an output differs."""
    parser = argparse.ArgumentParser(prog="python -m tests.docexamples", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the output blocks with what the server says")
    parser.add_argument("--url", default=None, help="a running server (default: start kvserve serve with its "
                                                    "defaults on a free port)")
    parser.add_argument("docs", nargs="*", type=Path, default=list(DOCS), help="the files (default: README.md, "
                                                                                "docs/api.md)")
    args = parser.parse_args(argv)
    status = 0
    with contextlib.nullcontext(args.url) if args.url else default_server() as url:
        for path in args.docs:
            errors, outputs = run_doc(path, Runner(url))
            for error in errors:
                print(f"FAILED {error}")
            status |= bool(errors)
            if args.write:
                print(f"{path}: {write(path, outputs)} output blocks rewritten")
                continue
            for problem in compare(path, outputs):
                print(problem)
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
