"""Grammars compiled first in a worker process, so that a crash of the grammar compiler cannot end the server.

llguidance is native code. An input that crashes it (a segmentation fault was found with a JSON schema's integer
bounds near -2^63) would take every stream in flight with it. ``CompileSandbox`` runs ``python -m
kvserve.engine.compile_worker`` once (a plain subprocess, not multiprocessing: nothing of the server's main
module is imported again) and has it compile each grammar the server has not seen, up to its first mask, before
the server compiles it itself. A worker that dies refuses that grammar, and the next one starts afresh; a compile
past the time limit is refused and its worker killed (a thread compiling in the server could not be stopped).

Protocol over the worker's stdin and stdout, one JSON document a line: first the tokenizer (``{"tokenizer":
serialized, "vocab_size": n, "eos": ids}``), answered by ``{"ready": true}`` once it is built, then a spec per
line (``{"kind": ..., "text": ..., "json_literals": ...}``), each answered by ``{"problem": why or null}``. The
worker's start (seconds, more on a loaded machine) is ``start``'s, so a compile's time limit times the compile.
"""

from __future__ import annotations

import json
import logging
import select
import subprocess
import sys
import threading
import time

from kvserve.engine.constraints import GrammarError, GrammarSpec, compiled, tokenizer_json
from kvserve.engine.heap import give_back

log = logging.getLogger("kvserve.grammar")


class CompileSandbox:
    """One worker process that compiles a grammar before the server does (the module docstring); pass it to
    engine.constraints.GrammarCompiler as its ``sandbox``.

    Args:
        hf_tokenizer: the served model's (fast) transformers tokenizer.
        eos_ids: the EOS token ids, as the GrammarCompiler is given them.
        timeout_s: longest compile, the worker's start (building its tokenizer, ~1-4 s) included (s).
    """

    def __init__(self, hf_tokenizer, eos_ids: list[int], timeout_s: float = 30.0) -> None:
        self._tokenizer = hf_tokenizer
        self._stop_ids = sorted(eos_ids)
        self._eos = self._stop_ids or hf_tokenizer.eos_token_id
        self._timeout_s = timeout_s
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one compile at a time: the worker answers in order

    def check(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` in the worker.

        Raises:
            GrammarError: it cannot be served (the compiler's reason), it ended the worker, or it took longer
                than ``timeout_s``.
        """
        request = json.dumps({"kind": spec.kind, "text": spec.text, "json_literals": spec.json_literals}) + "\n"
        with self._lock:
            process = self._start()
            try:
                process.stdin.write(request)
                process.stdin.flush()
                line = self._read_line(process)
            except (BrokenPipeError, OSError):
                line = ""
            if line is None:
                self._stop(process)
                raise GrammarError(f"compiling took longer than the limit of {self._timeout_s:g} s")
            if not line:
                code = self._stop(process)
                log.warning("the grammar compiler's worker ended (exit %s) on a %s grammar; refused", code, spec.kind)
                raise GrammarError(f"the grammar compiler crashed on this grammar (exit {code}, in a worker "
                                   "process: nothing else was affected)")
        problem = json.loads(line)["problem"]
        if problem is not None:
            raise GrammarError(problem)

    def start(self) -> None:
        """Start the worker now, if none runs, and wait until it has built its tokenizer.

        Raises:
            GrammarError: the worker ended or did not get ready within ``timeout_s``.
        """
        with self._lock:
            self._start()

    def _start(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            process = subprocess.Popen([sys.executable, "-m", "kvserve.engine.compile_worker"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8")
            self._process = process
            hello = {"tokenizer": tokenizer_json(self._tokenizer, self._stop_ids), "vocab_size": len(self._tokenizer),
                     "eos": self._eos}
            try:
                process.stdin.write(json.dumps(hello) + "\n")
                process.stdin.flush()
                line = self._read_line(process)
            except (BrokenPipeError, OSError):
                line = ""
            if not line:
                code = self._stop(process)
                raise GrammarError(f"the grammar compiler's worker did not start (exit {code}, or not ready within "
                                   f"{self._timeout_s:g} s)")
        return self._process

    def _read_line(self, process: subprocess.Popen) -> str | None:
        """The worker's next line ('' when it ended), or None past the time limit."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([process.stdout], [], [], left)
            if ready:
                return process.stdout.readline()

    def _stop(self, process: subprocess.Popen) -> int | None:
        process.kill()
        try:
            code = process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        if self._process is process:
            self._process = None
        return code

    def close(self) -> None:
        """Stop the worker (a later ``check`` starts another)."""
        with self._lock:
            if self._process is not None:
                self._stop(self._process)


def main() -> int:
    """The worker: read the tokenizer, then answer one spec a line until stdin closes."""
    import llguidance

    hello = json.loads(sys.stdin.readline())
    tokenizer = llguidance.LLTokenizer(hello["tokenizer"], n_vocab=hello["vocab_size"], eos_token=hello["eos"])
    del hello
    give_back()  # the tokenizer's JSON text and its parse, not kept
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        spec = GrammarSpec(**json.loads(line))
        try:
            compiled(tokenizer, spec)
            problem = None
        except GrammarError as exc:
            problem = str(exc)
        sys.stdout.write(json.dumps({"problem": problem}) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
