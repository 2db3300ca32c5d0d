"""How every request body is checked before any field is read: strict types, null meaning "the default", and a
whole-body pass (nesting depth, lone surrogates) whose 400 names the place. The bodies themselves are in
server/schemas.py (chat, completions, tokenize) and server/responses.py (the Responses API).
"""

from __future__ import annotations

import functools
import math
import types
import typing
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RequestModel(BaseModel):
    """An explicit ``null`` for a field with a default gives the default, as OpenAI's nullable fields and vLLM
    do (SDKs and proxies send ``"temperature": null``); a required field stays required.

    Types are strict, as OpenAI's API is: a boolean is not an integer (``"max_tokens": true`` is a 400, not 1)
    and a string is not a number (``"n": "2"`` is a 400); an integer is still a valid float.

    An integral float is an integer (``"n": 1.0``, ``"tokens": [1.0]``), as JSON Schema's ``integer`` says. A request body (the
    classes with ``_is_body``) is checked once as a whole by ``check_json``: nesting depth and lone surrogates.
    """

    model_config = ConfigDict(strict=True, json_schema_extra=lambda schema, cls: _document_nulls(schema, cls))
    _is_body: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data):
        if not isinstance(data, dict):
            return data
        if cls._is_body:
            check_json(data)
        fields, integers, lists = cls.model_fields, _integer_fields(cls), _integer_list_fields(cls)
        return {key: _integral(value) if key in integers or (key in lists and isinstance(value, list)) else value
                for key, value in data.items()
                if value is not None or key not in fields or fields[key].is_required()}


def _integral(value):
    """An integral float as the integer it is (``1.0`` -> ``1``), in lists too (``[1.0, [2.0]]``); else as given."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(item) for item in value]
    return value


_CHECKED = "x-kvserve-required"  # the mark of checked_required's fields, taken out of the schema


def checked_required(**kwargs):
    """A required field whose own validator refuses it missing or null, with a message naming what it takes (a
    clearer 400 than pydantic's "Field required"): declared with a default of None so the validator runs, and
    documented in /openapi.json as required and not null, which is what it is."""
    return Field(default=None, validate_default=True, json_schema_extra={_CHECKED: True}, **kwargs)


def _document_nulls(schema: dict, cls: type[BaseModel]) -> None:
    """Say in the JSON schema (/openapi.json) what ``_drop_nulls`` does: a field with a default also takes
    ``null``. Schema-driven clients and fuzzers then neither avoid it nor expect it refused. A
    ``checked_required`` field is documented as required instead, and a class's ``_accepted_at`` fields (taken
    only at one value or null, not model fields) with those values."""
    for name, info in cls.model_fields.items():
        prop = schema.get("properties", {}).get(name)
        if prop is not None and prop.pop(_CHECKED, False):
            prop.pop("default", None)
            options = [option for option in prop.pop("anyOf", ()) if option != {"type": "null"}]
            prop.update(options[0] if len(options) == 1 else {"anyOf": options} if options else {})
            schema["required"] = [*schema.get("required", ()), name]
            continue
        if prop is None or info.is_required() or _takes_null(prop):
            continue
        kept = {key: prop.pop(key) for key in ("title", "default", "description") if key in prop}
        schema["properties"][name] = kept | {"anyOf": [prop, {"type": "null"}]}
    for name, value in getattr(cls, "_accepted_at", {}).items():  # fields taken only at a value that asks nothing
        if name in cls.model_fields:
            continue
        schema.setdefault("properties", {})[name] = ({"type": "null"} if value is None else
                                                     {"anyOf": [{"const": value}, {"type": "null"}]})


def _takes_null(prop: dict) -> bool:
    return prop.get("type") == "null" or any(_takes_null(p) for p in prop.get("anyOf", ()))


class BodyError(ValueError):
    """A ValueError about one place in a request body, which the 400 names as its ``param``: pydantic reports a
    whole-body check (``check_json``) at no field, so the place travels with the exception."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


MAX_JSON_DEPTH = 64  # objects and arrays within one another in a request body; deeper is a 400, never a RecursionError


def check_json(value) -> None:
    """Refuse what no field could use and what would break later: nesting deeper than ``MAX_JSON_DEPTH``, text
    with lone surrogates (``"\\ud800"``: not Unicode, so it cannot be tokenized, compiled or echoed as UTF-8), and
    numbers that are not finite (NaN, 1e400: a schema holding one cannot be written back as JSON for the grammar).

    Raises:
        BodyError: naming the place (``messages.0.content``) and the limit.
    """
    stack = [(value, 0, "")]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            _check_unicode(item, path)
            continue
        if isinstance(item, float) and not math.isfinite(item):  # NaN, or a number past a float (1e400)
            raise BodyError(f"{path or 'the body'}: {item} is not a finite number (a JSON number past a float's "
                            "range, such as 1e400, reads as infinity)", path or None)
        if not isinstance(item, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            top = path.split('.')[0]
            raise BodyError(f"{top or 'the body'}: nested more than {MAX_JSON_DEPTH} levels deep", top or None)
        pairs = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in pairs:
            if isinstance(key, str):
                _check_unicode(key, path)
            stack.append((child, depth + 1, f"{path}.{key}" if path else str(key)))


def _check_unicode(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BodyError(f"{path or 'a key'}: not valid Unicode text (a lone surrogate at position {exc.start})",
                        path or None) from None


@functools.cache
def _integer_fields(cls: type) -> frozenset[str]:
    """Fields of ``cls`` that take an integer and no float (``int``, ``int | None``)."""
    names = set()
    for name, info in cls.model_fields.items():
        members = typing.get_args(info.annotation) if isinstance(info.annotation, types.UnionType) else (
            info.annotation,)
        if int in members and float not in members:
            names.add(name)
    return frozenset(names)


@functools.cache
def _integer_list_fields(cls: type) -> frozenset[str]:
    """Fields of ``cls`` that take a list of integers, or of lists of them (token ids: ``list[int]``,
    ``list[list[int]]``, alone or in a union)."""
    def ints(annotation) -> bool:
        args = typing.get_args(annotation)
        return typing.get_origin(annotation) is list and bool(args) and (args[0] is int or ints(args[0]))

    names = set()
    for name, info in cls.model_fields.items():
        members = typing.get_args(info.annotation) if isinstance(info.annotation, types.UnionType) else (
            info.annotation,)
        if any(ints(member) for member in members):
            names.add(name)
    return frozenset(names)
