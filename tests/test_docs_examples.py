"""The docs' examples (README.md, docs/api.md) against a live server with `kvserve serve`'s defaults: each runs,
and each output block shows what the server answers now (tests/docexamples.py says what is compared). When one
fails after a deliberate change, rerun `.venv/bin/python -m tests.docexamples --write` and read the diff."""

from __future__ import annotations

import pytest

from kvserve.server.config import ServeConfig
from tests import docexamples
from tests.serverutil import running_server

# examples that show a refusal on purpose (their output is an error body)
REFUSALS = ('"temperature": 5',)


@pytest.fixture(scope="module")
def default_url(smollm2_gguf):
    """A live server as `kvserve serve` with no flags: the embedded SmolLM2's own GGUF blocks, the default pool."""
    with running_server(smollm2_gguf, ServeConfig()) as url:
        yield url


def test_the_docs_examples_run_and_show_the_servers_outputs(default_url):
    problems = []
    shown = 0
    for path in docexamples.DOCS:
        errors, outputs = docexamples.run_doc(path, docexamples.Runner(default_url))
        problems += errors + docexamples.compare(path, outputs)
        shown += sum(example.output is not None for example, _ in outputs)
        for example, output in outputs:  # an error body only where the doc shows one on purpose
            for line in output.splitlines():
                if line.startswith('{"error"') and not any(r in example.block.code for r in REFUSALS):
                    problems.append(f"{path.name}:{example.block.line}: {line[:300]}")
    assert not problems, "\n".join(problems) + "\n(`.venv/bin/python -m tests.docexamples --write` rewrites them)"
    assert shown >= 35


def test_every_output_block_follows_an_example_and_both_docs_have_them():
    for path in docexamples.DOCS:
        found = docexamples.examples(path.read_text())
        assert sum(e.output is not None for e in found) >= 3, path
    with pytest.raises(ValueError, match="output blocks that follow no example, at lines \\[3\\]"):
        docexamples.examples("Text.\n\n```text output\nhi\n```\n")


def test_the_comparison_sees_changed_answers_and_shapes_and_not_ids_times_or_cache_counts():
    shown = ('{"id": "cmpl-1a2b3c4d5e6f", "created": 1, "choices": [{"text": " Paris.", "logprobs": {"lp": [-1.2345]}}],\n'
             ' "usage": {"cached_tokens": 0}, "timings": {"ttft_ms": 12.5, "prompt_tokens": 5}}\n'
             'data: {"id": "x", "choices": [{"delta": {"content": "Tok"}}]}\n'
             "{'queue_ms': 0.2, 'prompt_tokens': 5}\n"
             "TTFT 34 ms | 13.4 tokens/s | server: 37 prompt tokens (32 cached)\n"
             "x-request-id: 0123456789abcdef0123\n")
    same = shown.replace("1a2b3c4d5e6f", "ffff00001111").replace('"created": 1', '"created": 99') \
        .replace("12.5", "99.1").replace('"cached_tokens": 0', '"cached_tokens": 16').replace("-1.2345", "-1.2349") \
        .replace("0.2,", "7.5,").replace("34 ms", "1208 ms").replace("13.4", "2.0").replace("(32", "(0") \
        .replace("0123456789abcdef0123", "fedcba9876543210fedc")
    assert docexamples.differences(shown, same) == []
    assert docexamples.differences(shown, shown.replace("Paris", "Lyon")) == [
        "record 0.choices[0].text: ' Paris.' shown, ' Lyon.' now"]
    assert docexamples.differences(shown, shown.replace("-1.2345", "-1.5")) != []   # a logprob beyond 1e-3
    assert docexamples.differences(shown, shown.replace('"prompt_tokens": 5}}', '"prompt_tokens": 6}}')) != []
    assert docexamples.differences(shown, shown.replace('"Tok"', '"Kyo"')) != []     # an SSE event's text
    assert docexamples.differences(shown, shown.replace("'prompt_tokens': 5", "'prompt_tokens': 9")) != []
    assert docexamples.differences(shown, shown.replace('"usage"', '"usage2"')) != []  # a key
    assert "shape changed" in docexamples.differences(shown, shown + "one more line\n")[0]
