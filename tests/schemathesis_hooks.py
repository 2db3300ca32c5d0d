"""schemathesis hooks shared by the bounded pass (tests/test_schemathesis.py) and the full generated attack
(docs/operations.md, *The generated attack*): load with ``SCHEMATHESIS_HOOKS=tests.schemathesis_hooks``."""

from __future__ import annotations

import schemathesis

MAX_TOKENS = 4  # tokens a fuzzed request may generate: the pass checks answers, not generation
_TOKEN_FIELDS = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens",
                 "/v1/responses": "max_output_tokens"}


@schemathesis.hook
def map_body(context, body):
    """A generation body asks for at most ``MAX_TOKENS`` tokens, also when it leaves the limit out or sends null
    (the server's default then: thousands of tokens, sampled, so minutes on a busy machine). A value that is not a
    positive integer is left as generated (a negative case the server must refuse)."""
    field = _TOKEN_FIELDS.get(context.operation.path)
    if field is None or not isinstance(body, dict):
        return body
    value = body.get(field) if body.get(field) is not None else MAX_TOKENS
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        body[field] = min(value, MAX_TOKENS)
    body.pop("max_completion_tokens", None)
    return body
