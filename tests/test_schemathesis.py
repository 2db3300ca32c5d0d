"""A bounded schemathesis pass over every operation of /openapi.json on the live server: no 5xx, and every status
and content type answered is one the document names. Generation is capped at a few tokens (a hook on the bodies),
and each operation gets a few examples, so the pass stays well under two minutes on two cores."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extra (pyproject.toml)")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402 (schemathesis installs hypothesis)
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance  # noqa: E402

EXAMPLES = 6    # per operation
MAX_TOKENS = 4  # tokens a fuzzed request may generate: the pass checks answers, not generation
_TOKEN_FIELDS = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens",
                 "/v1/responses": "max_output_tokens"}


def cap_tokens(context, body):
    """The ``map_body`` hook: a generation body asks for at most ``MAX_TOKENS`` tokens. A value that is not a
    positive integer is left as generated (a negative case the server must refuse)."""
    field = _TOKEN_FIELDS.get(context.operation.path)
    if field is None or not isinstance(body, dict):
        return body
    value = body.get(field, MAX_TOKENS)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        body[field] = min(value, MAX_TOKENS)
    body.pop("max_completion_tokens", None)
    return body


def test_no_5xx_and_nothing_undocumented(server_url):
    """Every operation, a few examples each (positive and negative): the answers are checked for a 5xx, a
    status the document does not name, and a content type it does not name for that status. (schemathesis's
    pytest plugin is not used: its lazy fixtures do not run on this pytest.)"""
    schema = schemathesis.openapi.from_url(server_url + "/openapi.json")
    schema.hook("map_body")(cap_tokens)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    failures = []
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def one(case):
            case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance],
                                   timeout=60)

        try:
            one()
        except Exception as exc:  # a failed check: collect them all, then report
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
