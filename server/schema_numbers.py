"""The numbers of a JSON schema that reach the grammar compiler, kept to what it computes safely and to what a
generated number can write.

llguidance (engine.constraints) computes integer ranges in signed 64 bits. Bounds near either end crash the
process (a ``minimum`` and ``maximum`` both near -2^63 end it with a segmentation fault), and bounds beyond it are
clamped silently (a ``maximum`` of 2^64 let it write 2^63 - 1, outside ``minimum: 2^63``). Its number ranges are
written as plain decimals, never with an exponent, and kvserve's JSON numbers have at most
``MAX_MANTISSA_DIGITS`` digits (engine.closing), so a range whose every value needs more (``minimum: 1e20``,
``maximum: 1e-30``) could only end short of the schema after tokens were spent.

So before a schema is compiled, each subschema's bounds (``minimum``, ``maximum``, ``exclusiveMinimum``,
``exclusiveMaximum``) are read exactly (as the decimal text JSON carries) and:

- a bound beyond what can be generated is narrowed to it (integers to ±``INTEGER_LIMIT``, where every boundary
  case was checked against the compiler; numbers to ±``NUMBER_LIMIT``, past which its number ranges fail). The
  schema then allows fewer values, never others: whatever is generated still validates against the client's;
- a type left with no value it can generate is dropped from the subschema's ``type`` list, and a subschema left
  with no type at all is refused (a 400 naming where and why), before any work.

Counts (``minLength``, ``maxItems``, ...) past ``MAX_COUNT`` are refused by name.
"""

from __future__ import annotations

import copy
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

from kvserve.engine.closing import MAX_MANTISSA_DIGITS

INTEGER_LIMIT = 2**62   # the integer bounds llguidance is given stay within ±this (its own range is ±2^63)
NUMBER_LIMIT = Decimal(10**18)  # the number bounds it is given stay within ±this (its float ranges fail past ~1e19)
MAX_COUNT = 2**31 - 1   # lengths, item and property counts
COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                  "minContains", "maxContains")
BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

# keywords whose value is one subschema, a list of them, or a mapping of names to them (JSON Schema 2020-12)
SUBSCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
             "unevaluatedItems", "unevaluatedProperties")
SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class SchemaNumberError(ValueError):
    """A schema whose numbers cannot be served; the message says where (a JSON pointer) and why."""


def bounded(schema: dict) -> dict:
    """``schema`` with every subschema's numbers kept to what can be generated (the module docstring says how).
    Returns a copy (or ``schema`` itself when nothing changed); the argument is never modified.

    Raises:
        SchemaNumberError: a count past ``MAX_COUNT``, or a subschema whose bounds leave no value it could
            generate.
    """
    out = copy.deepcopy(schema)
    changed = _walk(out, "")
    return out if changed else schema


def _walk(node, where: str) -> bool:
    """Check and narrow ``node`` and its subschemas in place; whether anything changed."""
    if not isinstance(node, dict):
        return False
    for key in COUNT_KEYWORDS:
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_COUNT:
            raise SchemaNumberError(f"{where}/{key} is {value}, more than the limit of {MAX_COUNT:,}")
    changed = _narrow(node, where) if any(key in node for key in BOUND_KEYWORDS) else False
    children = [(f"{where}/{key}", node[key]) for key in SUBSCHEMA if isinstance(node.get(key), dict)]
    if isinstance(node.get("items"), list):  # draft-07 tuple form
        children += [(f"{where}/items/{i}", s) for i, s in enumerate(node["items"])]
    children += [(f"{where}/{key}/{i}", s) for key in SUBSCHEMA_LISTS if isinstance(node.get(key), list)
                 for i, s in enumerate(node[key])]
    children += [(f"{where}/{key}/{name}", s) for key in SUBSCHEMA_MAPS if isinstance(node.get(key), dict)
                 for name, s in node[key].items()]
    for path, child in children:
        changed |= _walk(child, path)
    return changed


def _exact(value) -> Decimal | None:
    """A bound as the decimal its JSON text says (a float by its shortest repr, as json.dumps writes it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return Decimal(value) if isinstance(value, int) else Decimal(repr(value))


def _range(node: dict) -> tuple[Decimal | None, bool, Decimal | None, bool]:
    """``(low, low exclusive, high, high exclusive)`` of a subschema's bounds (the tighter where two are given;
    draft-04's boolean ``exclusiveMinimum`` / ``exclusiveMaximum`` included)."""
    low, low_ex = _exact(node.get("minimum")), node.get("exclusiveMinimum") is True
    high, high_ex = _exact(node.get("maximum")), node.get("exclusiveMaximum") is True
    ex_low, ex_high = _exact(node.get("exclusiveMinimum")), _exact(node.get("exclusiveMaximum"))
    if ex_low is not None and (low is None or ex_low >= low):
        low, low_ex = ex_low, True
    if ex_high is not None and (high is None or ex_high <= high):
        high, high_ex = ex_high, True
    return low, low_ex, high, high_ex


def _integer_range(low, low_ex, high, high_ex) -> tuple[Decimal, Decimal] | None:
    """The integers of the range within ±INTEGER_LIMIT, as (least, greatest), or None when there are none."""
    least = -INTEGER_LIMIT if low is None else low.to_integral_value(ROUND_FLOOR) + 1 if low_ex \
        else low.to_integral_value(ROUND_CEILING)
    greatest = INTEGER_LIMIT if high is None else high.to_integral_value(ROUND_CEILING) - 1 if high_ex \
        else high.to_integral_value(ROUND_FLOOR)
    least, greatest = max(least, Decimal(-INTEGER_LIMIT)), min(greatest, Decimal(INTEGER_LIMIT))
    return (least, greatest) if least <= greatest else None


def _plain_number_exists(low, low_ex, high, high_ex) -> bool:
    """Whether some number of the range is written plainly in at most MAX_MANTISSA_DIGITS digits (leading zeros
    count, as engine.closing counts them: ``0.001`` has four)."""
    above_low = low is None or low < 0 or (low == 0 and not low_ex)
    below_high = high is None or high > 0 or (high == 0 and not high_ex)
    if above_low and below_high:
        return True  # 0
    if not above_low and high is not None and high < low:
        return False
    if above_low:  # all of it below zero: the same question for its mirror image
        return _plain_number_exists(-high, high_ex, None if low is None else -low, low_ex)
    for decimals in range(MAX_MANTISSA_DIGITS):  # the fewest decimals that reach into the range
        step = Decimal(1).scaleb(-decimals)
        candidate = (low / step).to_integral_value(ROUND_CEILING) * step
        if low_ex and candidate == low:
            candidate += step
        if high is None or candidate < high or (candidate == high and not high_ex):
            return len(format(candidate, f".{decimals}f").replace(".", "")) <= MAX_MANTISSA_DIGITS
    return False


def _narrow(node: dict, where: str) -> bool:
    """Narrow one subschema's bounds and types in place (the module docstring); whether anything changed.

    Raises:
        SchemaNumberError: it allows only numbers kvserve cannot generate.
    """
    low, low_ex, high, high_ex = _range(node)
    kinds = node.get("type")
    types = [kinds] if isinstance(kinds, str) else list(kinds) if isinstance(kinds, list) else None
    integers = _integer_range(low, low_ex, high, high_ex)
    in_low, in_low_ex = (-NUMBER_LIMIT, False) if low is None or low < -NUMBER_LIMIT else (low, low_ex)
    in_high, in_high_ex = (NUMBER_LIMIT, False) if high is None or high > NUMBER_LIMIT else (high, high_ex)
    numbers = _plain_number_exists(in_low, in_low_ex, in_high, in_high_ex)
    kept = types
    if types is not None:
        kept = [t for t in types if not (t == "integer" and integers is None) and not (t == "number" and not numbers)]
        if not kept:
            shown = " and ".join(f"{key} {node[key]}" for key in BOUND_KEYWORDS if key in node)
            raise SchemaNumberError(
                f"{where or '/'} allows no value kvserve can generate: {shown} leave no "
                + ("integer within ±2^62 (where kvserve keeps integer bounds; an integer without bounds "
                   "is not limited)" if types == ["integer"] else
                   f"number within ±10^{NUMBER_LIMIT.adjusted()} written in at most {MAX_MANTISSA_DIGITS} digits "
                   "without an exponent (the numbers kvserve generates)"))
        if kept != types:
            node["type"] = kept[0] if len(kept) == 1 else kept
        if not {"integer", "number"} & set(kept):  # bounds of no type left: not handed to the compiler at all
            for key in BOUND_KEYWORDS:
                node.pop(key, None)
            return True
    # the compiler writes a number range through 64-bit integers: a "number" keeps to the narrower limit
    limit = Decimal(INTEGER_LIMIT) if kept is not None and "number" not in kept else NUMBER_LIMIT
    changed = kept != types
    if low is not None and low < -limit:
        node.pop("exclusiveMinimum", None)
        node["minimum"] = int(-limit)
        changed = True
    if high is not None and high > limit:
        node.pop("exclusiveMaximum", None)
        node["maximum"] = int(limit)
        changed = True
    return changed
