"""A bounded schemathesis pass over every operation of /openapi.json on the live server: no 5xx, and every status
and content type answered is one the document names. Generation is capped at a few tokens (a hook on the bodies),
and each operation gets a few examples, so the pass stays well under two minutes on two cores."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extra (pyproject.toml)")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402 (schemathesis installs hypothesis)
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance  # noqa: E402

from tests.schemathesis_hooks import map_body  # noqa: E402

EXAMPLES = 6    # per operation


def test_no_5xx_and_nothing_undocumented(server_url):
    """Every operation, a few examples each (positive and negative): the answers are checked for a 5xx, a
    status the document does not name, and a content type it does not name for that status. (schemathesis's
    pytest plugin is not used: its lazy fixtures do not run on this pytest.)"""
    schema = schemathesis.openapi.from_url(server_url + "/openapi.json")
    schema.hook("map_body")(map_body)
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
