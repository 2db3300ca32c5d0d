"""Structured outputs: a request's ``response_format`` / vLLM guided fields / forced tool call -> a compiled grammar.

Which fields are read (one of them per request; two is a 400):
- OpenAI: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}``;
- vLLM: ``guided_json`` (a schema, as an object or a string), ``guided_regex``, ``guided_choice`` (strings),
  ``guided_grammar`` (Lark or GBNF), and the newer ``structured_outputs: {json | regex | choice | grammar}``;
- ``tool_choice`` ``required`` or a named function (server.tools builds that grammar).

Compilation runs on a worker thread (never the event loop, never the engine thread), is cached by spec in the
engine's ``GrammarCompiler`` and is bounded: the schema's size and nesting are checked first, llguidance's parser
limits bound its work, and a compile past ``COMPILE_TIMEOUT_S`` is a 400; each names the limit.
"""

from __future__ import annotations

import asyncio
import functools
import json

import jsonschema

from kvserve.engine.constraints import Grammar, GrammarError, GrammarSpec
from kvserve.server import tools
from kvserve.server.errors import ApiError

MAX_SCHEMA_BYTES = 65_536   # a schema's JSON text; the largest real-world ones are a few kB
MAX_SCHEMA_DEPTH = 32       # nesting of objects/arrays in the schema document
COMPILE_TIMEOUT_S = 10.0    # wall time for one compilation (s)

_VLLM_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "lark"}
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}


def _depth(value, level: int = 0) -> int:
    if level > MAX_SCHEMA_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level)
    return level


def json_schema_spec(schema, param: str) -> GrammarSpec:
    """A checked JSON-schema spec.

    Raises:
        ApiError: 400 for a schema that is not an object, not a valid JSON Schema, larger than
            ``MAX_SCHEMA_BYTES`` or nested deeper than ``MAX_SCHEMA_DEPTH``.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"{param} is not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param} must be a JSON Schema object", param=param)
    text = json.dumps(schema)  # key order kept: properties are generated in the schema's order
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise ApiError(400, f"{param} is larger than the limit of {MAX_SCHEMA_BYTES} bytes", param=param)
    problem = _schema_problem(text)
    if problem is not None:
        raise ApiError(400, f"{param} {problem}", param=param)
    return GrammarSpec("json_schema", text)


@functools.lru_cache(maxsize=256)
def _schema_problem(text: str) -> str | None:
    """Why the schema ``text`` cannot be served (too deep, not a valid JSON Schema), or None. Cached by text:
    jsonschema's check against the metaschema takes milliseconds (~5 ms for loadtest's mid-sized schema) on the
    event loop, and clients send the same schema with every request."""
    schema = json.loads(text)
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        return f"is nested deeper than the limit of {MAX_SCHEMA_DEPTH} levels"
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        return f"is not a valid JSON Schema: {exc.message}" + (f" (at {where})" if where else "")
    return None


def _response_format_spec(response_format: dict) -> GrammarSpec | None:
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_schema", json.dumps({"type": "object"}))
    if kind != "json_schema":
        raise ApiError(400, f"response_format.type must be text, json_object or json_schema, not {kind!r}",
                       param="response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        raise ApiError(400, "response_format.json_schema must be an object with name and schema",
                       param="response_format.json_schema")
    return json_schema_spec(spec.get("schema", {}), "response_format.json_schema.schema")


def _text_spec(kind: str, value, param: str) -> GrammarSpec:
    if kind == "json_schema":
        return json_schema_spec(value, param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise ApiError(400, f"{param} must be a non-empty list of strings", param=param)
        return GrammarSpec("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{param} must be a non-empty string", param=param)
    if len(value.encode()) > MAX_SCHEMA_BYTES:
        raise ApiError(400, f"{param} is larger than the limit of {MAX_SCHEMA_BYTES} bytes", param=param)
    return GrammarSpec(kind, value)


def grammar_spec(body) -> GrammarSpec | None:
    """The grammar a request asks for, or None.

    Raises:
        ApiError: 400 for a malformed field, or for more than one of them.
    """
    found: list[tuple[str, GrammarSpec]] = []
    if body.response_format:
        spec = _response_format_spec(body.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    for name, kind in _VLLM_FIELDS.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, _text_spec(kind, value, name)))
    if body.structured_outputs:
        keys = [k for k in _STRUCTURED_KEYS if body.structured_outputs.get(k) is not None]
        if len(keys) != 1:
            raise ApiError(400, "structured_outputs must give exactly one of json, regex, choice, grammar",
                           param="structured_outputs")
        found.append(("structured_outputs", _text_spec(_STRUCTURED_KEYS[keys[0]], body.structured_outputs[keys[0]],
                                                       f"structured_outputs.{keys[0]}")))
    tool_spec = tools.forced_grammar(body, json_schema_spec)
    if tool_spec is not None:
        found.append(("tool_choice", tool_spec))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ApiError(400, f"give one way of constraining the output, not several: {names}", param=found[1][0])
    return found[0][1] if found else None


async def compile_request(state, body) -> Grammar | None:
    """The compiled grammar for ``body``, or None when it is unconstrained. Runs the compiler on a worker thread.

    Raises:
        ApiError: 400 for a bad field, a grammar llguidance refuses (its message names the feature or the
            limit) or a compilation longer than ``COMPILE_TIMEOUT_S``.
    """
    spec = grammar_spec(body)
    if spec is None:
        return None
    if body.min_tokens:  # EOS held back where the grammar allows only EOS would leave no token to sample
        raise ApiError(400, "min_tokens cannot be combined with a grammar (response_format, guided_*, "
                            "structured_outputs or a forced tool call)", param="min_tokens")
    compiler = state.grammars
    param = _param_of(body)
    cached = compiler.cached(spec)
    if cached is not None:
        return cached
    try:
        return await asyncio.wait_for(asyncio.to_thread(compiler.compile, spec), COMPILE_TIMEOUT_S)
    except GrammarError as exc:
        raise ApiError(400, f"{param}: cannot constrain to this grammar: {exc}", param=param) from exc
    except TimeoutError as exc:
        raise ApiError(400, f"{param}: compiling the grammar took longer than the limit of {COMPILE_TIMEOUT_S:g} s",
                       param=param) from exc


def _param_of(body) -> str:
    if body.response_format and body.response_format.get("type", "text") != "text":
        return "response_format"
    for name in (*_VLLM_FIELDS, "structured_outputs"):
        if getattr(body, name, None) is not None:
            return name
    return "tool_choice"
