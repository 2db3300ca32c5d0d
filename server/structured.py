"""Structured outputs: a request's ``response_format`` / vLLM guided fields / forced tool call -> a compiled grammar.

Which fields are read (one of them per request; two is a 400):
- OpenAI: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}``;
- vLLM: ``guided_json`` (a schema, as an object or a string), ``guided_regex``, ``guided_choice`` (strings),
  ``guided_grammar`` (Lark or GBNF), and the newer ``structured_outputs: {json | regex | choice | grammar}``;
- ``tool_choice`` ``required`` or a named function (server.tools builds that grammar).

Compilation runs on a worker thread (never the event loop, never the engine thread), is cached by spec in the
engine's ``GrammarCompiler`` and is bounded: the schema's size and nesting are checked first, then what its text
says it needs (server.grammar_limits: counted repetitions, a grammar with no finite output), llguidance's parser
limits bound its work, and a compile past ``COMPILE_TIMEOUT_S`` is a 400; each names the limit. A grammar that
admits no output at all is refused when compiled (engine.constraints).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from collections.abc import Callable
from typing import TypeVar

import jsonschema
import llguidance

from kvserve.engine.closing import MAX_EXPONENT_DIGITS, MAX_MANTISSA_DIGITS
from kvserve.engine.constraints import Grammar, GrammarError, GrammarSpec
from kvserve.server import tools
from kvserve.server.grammar_limits import has_finite_value, lark_problem, patterns, repetition_problem
from kvserve.server.schema_numbers import SUBSCHEMA, SUBSCHEMA_LISTS, SUBSCHEMA_MAPS, SchemaNumberError, bounded
from kvserve.server.errors import ApiError

log = logging.getLogger("kvserve.grammar")
T = TypeVar("T")

MAX_SCHEMA_BYTES = 65_536   # a schema's JSON text; the largest real-world ones are a few kB
MAX_SCHEMA_DEPTH = 32       # nesting of objects/arrays in the schema document
COMPILE_TIMEOUT_S = 10.0    # wall time for one compilation (s)
MAX_CHOICES = 1_024         # options of a guided_choice (the choice list's JSON text is under MAX_SCHEMA_BYTES too)

_VLLM_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "lark"}
# a line that starts a GBNF rule: Lark writes rules as `name: ...`, GBNF as `name ::= ...`
_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][A-Za-z0-9_-]*\s*::=", re.M)
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}
# vLLM's StructuredOutputsParams' other fields: accepted at their defaults (None or False) only
_VLLM_STRUCTURED_OPTIONS = ("json_object", "disable_fallback", "disable_any_whitespace",
                            "disable_additional_properties", "whitespace_pattern", "structural_tag")
# keywords whose numbers the output may have to write (a step shapes the number's regex); bounds are narrowed to
# what can be written instead (server.schema_numbers)
_NUMBER_KEYWORDS = ("const", "enum", "multipleOf")
_JSON_NUMBER = re.compile(r"-?([0-9.]+)(?:[eE][+-]?([0-9]+))?")


def _depth(value, level: int = 0) -> int:
    if level > MAX_SCHEMA_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level)
    return level


def json_schema_spec(schema, param: str, strict: bool = False) -> GrammarSpec:
    """A checked JSON-schema spec; ``strict``: read as ``strict_schema`` reads it (also a schema given as text).

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
    if strict:
        schema = strict_schema(schema)
    text = json.dumps(schema)  # key order kept: properties are generated in the schema's order
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise ApiError(400, f"{param} is larger than the limit of {MAX_SCHEMA_BYTES} bytes", param=param)
    problem = _schema_problem(text)
    if problem is None:
        text, problem = _bounded_text(text)
    if problem is not None:
        raise ApiError(400, f"{param} {problem}", param=param)
    return GrammarSpec("json_schema", text)


@functools.lru_cache(maxsize=256)
def _bounded_text(text: str) -> tuple[str, str | None]:
    """The schema ``text`` with its numbers kept to what can be generated (server.schema_numbers), or why it
    cannot be served. Cached by text, as ``_schema_problem`` is."""
    try:
        return json.dumps(bounded(json.loads(text))), None
    except SchemaNumberError as exc:
        return text, str(exc)


@functools.lru_cache(maxsize=256)
def _pattern_compiles(pattern: object) -> bool:
    """A ``pattern`` the metaschema's ``format: regex`` allows: one Python's ``re`` compiles, or one the grammar
    compiler's regex engine takes (ECMA-262's ``\\p{L}`` classes, which ``re`` lacks)."""
    if not isinstance(pattern, str):
        return True  # not a string: the metaschema's type check reports it
    try:
        re.compile(pattern)
        return True
    except re.error:
        return not llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("regex", pattern))


# jsonschema's checks of a schema's own formats, but a pattern is judged by what the grammar compiler can build
_METASCHEMA_FORMATS = jsonschema.FormatChecker()
_METASCHEMA_FORMATS.checks("regex")(_pattern_compiles)


def _schema_problem(text: str) -> str | None:
    """Why the schema ``text`` cannot be served (too deep, not a valid JSON Schema), or None. Cached by text:
    jsonschema's check against the metaschema takes milliseconds (~5 ms for loadtest's mid-sized schema) on the
    event loop, and clients send the same schema with every request."""
    schema = json.loads(text)
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        return f"is nested deeper than the limit of {MAX_SCHEMA_DEPTH} levels"
    long_number = _long_number(schema)
    if long_number is not None:
        where, value = long_number
        return (f"asks for the number {value} (at {where}), longer than a generated JSON number may be: at most "
                f"{MAX_MANTISSA_DIGITS} digits before the exponent and {MAX_EXPONENT_DIGITS} in it")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(
            schema, format_checker=_METASCHEMA_FORMATS)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        return f"is not a valid JSON Schema: {exc.message}" + (f" (at {where})" if where else "")
    if not has_finite_value(schema):
        return ("admits no output at all: every value it allows contains itself (a required $ref cycle with no "
                "way out, such as a required property that refers back to its object)")
    return next(filter(None, map(repetition_problem, patterns(schema))), None)


def _long_number(value, where: str = "") -> tuple[str, str] | None:
    """``(path, number)`` of the first number in a schema's numeric keywords that a bounded JSON number
    (engine.closing) cannot write, or None."""
    if isinstance(value, list):
        return next(filter(None, (_long_number(v, f"{where}/{i}") for i, v in enumerate(value))), None)
    if not isinstance(value, dict):
        return None
    for key, item in value.items():
        numbers = item if key == "enum" and isinstance(item, list) else [item] if key in _NUMBER_KEYWORDS else []
        for number in numbers:
            if isinstance(number, (int, float)) and not isinstance(number, bool):
                text = json.dumps(number)
                match = _JSON_NUMBER.fullmatch(text)
                if match and (len(match[1].replace(".", "")) > MAX_MANTISSA_DIGITS
                              or len(match[2] or "") > MAX_EXPONENT_DIGITS):
                    return f"{where}/{key}".lstrip("/"), text
        if isinstance(item, (dict, list)) and key not in ("const", "enum", "default", "examples"):
            found = _long_number(item, f"{where}/{key}")
            if found is not None:
                return found
    return None


def tool_parameters(schema, param: str) -> dict:
    """A tool's parameter schema as a forced call serves it: read strictly (``strict_schema``), then checked like a
    ``response_format`` schema (``json_schema_spec``; ApiError 400 naming ``param`` where it cannot be served)."""
    strict = strict_schema(schema)
    json_schema_spec(strict, param)
    return strict


def strict_schema(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema that leaves it unspecified, as
    xgrammar's strict mode (vLLM's default backend) reads it: a property the schema does not name is not
    generated. Applied to tool parameters and to ``response_format`` with ``strict: true``; a schema that says
    ``additionalProperties`` (true, or a schema) keeps its word. Returns a copy; ``schema`` is unchanged."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SUBSCHEMA:
        if key in out:
            out[key] = strict_schema(out[key]) if isinstance(out[key], dict) else out[key]
    if isinstance(out.get("items"), list):  # draft-07 tuple form
        out["items"] = [strict_schema(s) for s in out["items"]]
    for key in SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s) for s in out[key]]
    for key in SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(s) for name, s in out[key].items()}
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    if is_object and "additionalProperties" not in out and "unevaluatedProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


# the fields OpenAI's response_format takes (any other is its "Unknown parameter" 400)
_JSON_SCHEMA_FIELDS = ("name", "description", "schema", "strict")


def _response_format_spec(response_format: dict) -> GrammarSpec | None:
    kind = response_format.get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise ApiError(400, f"response_format.type must be text, json_object or json_schema, not {kind!r}",
                       param="response_format.type")
    for key, value in response_format.items():  # null is absent, as everywhere in a request
        if value is not None and key != "type" and not (key == "json_schema" and kind == "json_schema"):
            raise ApiError(400, f"response_format.{key} is not a field of a response_format of type {kind}",
                           param=f"response_format.{key}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_schema", json.dumps({"type": "object"}))
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        raise ApiError(400, "response_format.json_schema must be an object with name and schema",
                       param="response_format.json_schema")
    for key, value in spec.items():
        param = f"response_format.json_schema.{key}"
        if key not in _JSON_SCHEMA_FIELDS:
            raise ApiError(400, f"{param} is not a field of json_schema (it takes {', '.join(_JSON_SCHEMA_FIELDS)})",
                           param=param)
        if value is not None and ((key == "strict" and not isinstance(value, bool)) or (
                key == "description" and not isinstance(value, str))):
            kind_of = "a boolean" if key == "strict" else "a string"
            raise ApiError(400, f"{param} must be {kind_of}, not {type(value).__name__}", param=param)
    return json_schema_spec(spec.get("schema", {}), "response_format.json_schema.schema",
                            strict=spec.get("strict") is True)


# a regex's shorthand classes as ASCII (the grammar compiler reads them as Unicode classes: \d took "🯸", a
# segmented digit): outside a class a class of their members; inside one the compiler's ASCII classes of the same
# members, which stay one item (written out, "[\w-z]"'s last member "_" would begin a range "_-z")
_ASCII_CLASSES = {"d": ("0-9", "digit"), "w": ("0-9A-Za-z_", "word"), "s": ("\\t\\n\\x0B\\f\\r ", "space")}


def ascii_shorthands(pattern: str) -> str:
    """``pattern`` with ``\\d``, ``\\w``, ``\\s`` and their negations as ASCII classes (``[0-9]``, ``[^0-9]``;
    inside a class ``[:digit:]``, ``[:^digit:]``, ...), as vLLM's regex backends read them and as a JSON Schema
    ``pattern`` reads ``\\d`` and ``\\w``, where the grammar compiler (Rust's regex-syntax) reads them as Unicode
    classes. Other escapes are left as written.

    Raises:
        ValueError: the pattern ends in a lone backslash (an escape of nothing).
    """
    out, depth, at = [], 0, 0
    while at < len(pattern):
        char = pattern[at]
        if char == "\\":
            if at + 1 == len(pattern):
                raise ValueError("ends in a lone backslash (write \\\\ for a backslash)")
            letter = pattern[at + 1]
            members, name = _ASCII_CLASSES.get(letter.lower(), (None, None))
            if members is None:
                out.append(pattern[at:at + 2])
            elif depth:
                if out and out[-1] == "-" and not (len(out) > 1 and out[-2] == "-"):  # not the "--" operator
                    out[-1] = "\\-"  # "[+-\\d]" is "+", "-" or a digit (ECMA's reading), not a range to a class
                out.append(f"[:{name}:]" if letter.islower() else f"[:^{name}:]")
            else:
                out.append(f"[{members}]" if letter.islower() else f"[^{members}]")
            at += 2
            continue
        if char == "[":
            depth += 1
            out.append(char)
            at += 1
            if pattern.startswith("^", at):
                out.append("^")
                at += 1
            if pattern.startswith("]", at) and pattern[at - 1] != ":":  # a leading "]" is a member
                out.append("]")
                at += 1
            continue
        if char == "]" and depth:
            depth -= 1
        out.append(char)
        at += 1
    return "".join(out)


def _text_spec(kind: str, value, param: str) -> GrammarSpec:
    if kind == "json_schema":
        return json_schema_spec(value, param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise ApiError(400, f"{param} must be a non-empty list of strings", param=param)
        if len(value) > MAX_CHOICES:
            raise ApiError(400, f"{param} has {len(value):,} options, more than the limit of {MAX_CHOICES:,}",
                           param=param)
        text = json.dumps(value)
        if len(text.encode()) > MAX_SCHEMA_BYTES:
            raise ApiError(400, f"{param} is larger than the limit of {MAX_SCHEMA_BYTES} bytes", param=param)
        return GrammarSpec("choice", text)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{param} must be a non-empty string", param=param)
    if len(value.encode()) > MAX_SCHEMA_BYTES:
        raise ApiError(400, f"{param} is larger than the limit of {MAX_SCHEMA_BYTES} bytes", param=param)
    if kind == "lark" and _GBNF_RULE.search(value):
        kind = "gbnf"  # llama.cpp's syntax (rules as `name ::= ...`), which llguidance reads too
    problem = repetition_problem(value) or (lark_problem(value) if kind == "lark" else None)
    if problem is not None:
        raise ApiError(400, f"{param} {problem}", param=param)
    if kind == "regex":
        try:
            value = ascii_shorthands(value)
        except ValueError as exc:
            raise ApiError(400, f"{param} {exc}", param=param) from None
    return GrammarSpec(kind, value)


def _readable(param: str, build: Callable[[], T]) -> T:
    """``build()``, whose RecursionError is a 400 naming ``param``: the body's depth limit (server.validation) does
    not see into a string, so a schema given as JSON text, a Lark grammar's parentheses or a schema's regex
    ``pattern`` can nest past what Python's parsers (json, re, the Lark checks here) read recursively."""
    try:
        return build()
    except RecursionError as exc:  # logged: a recursion of the server's own would otherwise pass for the input's
        log.warning("%s: RecursionError while reading it (refused as nested too deeply): %s", param, exc)
        raise ApiError(400, f"{param} is nested too deeply to be read", param=param) from None


def grammar_spec(body) -> GrammarSpec | None:
    """The grammar a request asks for, or None.

    Raises:
        ApiError: 400 for a malformed field, or for more than one of them.
    """
    found: list[tuple[str, GrammarSpec]] = []
    if body.response_format:
        spec = _readable("response_format", lambda: _response_format_spec(body.response_format))
        if spec is not None:
            found.append(("response_format", spec))
    for name, kind in _VLLM_FIELDS.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, _readable(name, lambda: _text_spec(kind, value, name))))
    if body.structured_outputs is not None:  # {} too: vLLM refuses a constraint that names none
        outputs = dict(body.structured_outputs)
        if outputs.get("json_object") is True:  # vLLM's: any JSON object
            outputs["json"] = {"type": "object"} if outputs.get("json") is None else outputs["json"]
        # vLLM's other options at their defaults (a dump of its settings object) change nothing; set, not served
        unknown = [k for k, v in outputs.items() if k not in _STRUCTURED_KEYS
                   and not (k in _VLLM_STRUCTURED_OPTIONS and v in (None, False))
                   and not (k == "json_object" and v is True)]
        if unknown:
            raise ApiError(400, f"structured_outputs.{unknown[0]} is not supported by kvserve (it serves "
                           f"{', '.join(_STRUCTURED_KEYS)} and json_object)", param=f"structured_outputs.{unknown[0]}")
        keys = [k for k in _STRUCTURED_KEYS if outputs.get(k) is not None]
        if len(keys) != 1:
            raise ApiError(400, "structured_outputs must give exactly one of json, regex, choice, grammar",
                           param="structured_outputs")
        param = f"structured_outputs.{keys[0]}"
        found.append(("structured_outputs", _readable(param, lambda: _text_spec(
            _STRUCTURED_KEYS[keys[0]], outputs[keys[0]], param))))
    # each function's parameters named where they nest too deeply; the tools' grammar around them as "tools"
    tool_spec = _readable("tools", lambda: tools.forced_grammar(
        body, lambda schema, param: _readable(param, lambda: tool_parameters(schema, param))))
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
        # once per server (the tokenizer's tables, the compile worker's start): not the compile the limit times,
        # and seconds on a loaded machine; bounded by the worker's own start limit
        await asyncio.to_thread(compiler.warm)
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
