"""Grammars that cannot be served, read from their text before they are compiled: counted repetitions past a bound,
and grammars that admit no finite output (a JSON schema whose every value contains itself, a Lark grammar whose
start rule never ends). Each check refuses only what it understands; anything else is left to llguidance.
"""

from __future__ import annotations

import re

# a counted repetition (regex ``a{n}``, Lark ``"a"~n``) is unrolled into n states when the grammar is built:
# 10,000 builds in milliseconds, a million takes seconds of CPU and a mask per token past llguidance's fuel
MAX_REPEAT = 10_000
MAX_DEFS_CHECKED = 200  # $defs (or Lark rules) past which cycles are not read: the fixed point is quadratic
# the counts of a repetition: regex {n}, {n,} and {n,m} (not after a backslash), and Lark's ~n and ~n..m
_REPEAT_COUNTS = re.compile(r"(?<!\\)\{\s*([0-9]+)\s*(?:,\s*([0-9]*)\s*)?\}|~\s*([0-9]+)(?:\s*\.\.\s*([0-9]+))?")


def least_fixed_point(names, ends) -> set[str]:
    """The names that end: starting from none, add each name whose ``ends(name, ending_so_far)`` holds, until no
    more does."""
    ending: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name in names:
            if name not in ending and ends(name, ending):
                ending.add(name)
                changed = True
    return ending


def has_finite_value(root: dict) -> bool:
    """Whether some finite JSON value can satisfy ``root`` as far as its local ``$ref`` cycles go (the least fixed
    point over its ``$defs``: a definition has a finite value once one of its ways out does). Keywords read:
    ``$ref``, ``required`` properties, ``allOf``/``anyOf``/``oneOf`` and ``minItems`` of ``items``; whatever else a
    schema says is taken to allow a finite value, so this refuses only true cycles. Past ``MAX_DEFS_CHECKED``
    definitions it is not checked (a pass per definition: quadratic, and it runs on the event loop)."""
    defs = {f"#/{key}/{name}": sub for key in ("$defs", "definitions") if isinstance(root.get(key), dict)
            for name, sub in root[key].items()}
    if len(defs) > MAX_DEFS_CHECKED:
        return True
    defs["#"] = root
    return "#" in least_fixed_point(defs, lambda ref, finite: _finite(defs[ref], finite, defs.keys()))



def _finite(schema, finite: set[str], known) -> bool:
    """Whether ``schema`` allows a finite value when, of the ``known`` references, only those in ``finite`` do
    (see above); a reference to anything else is not read here."""
    if not isinstance(schema, dict):
        return schema is not False

    def allows(sub) -> bool:
        return _finite(sub, finite, known)

    ref = schema.get("$ref")
    if isinstance(ref, str) and ref in known and ref not in finite:
        return False
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    if any(not allows(properties[name]) for name in required if isinstance(name, str) and name in properties):
        return False
    if isinstance(schema.get("allOf"), list) and not all(map(allows, schema["allOf"])):
        return False
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options and not any(map(allows, options)):
            return False
    min_items = schema.get("minItems", 0)
    if isinstance(min_items, int) and min_items > 0 and isinstance(schema.get("items"), dict):
        return allows(schema["items"])
    return True


def _count(match: re.Match) -> int:
    """The largest count of a repetition match; one of 10+ digits is past any limit without reading it (int()
    refuses 4,300+ digits)."""
    return max(int(number) if len(number) < 10 else 10**9 for number in match.groups() if number)


def nested_repetition(text: str) -> int:
    """The largest product of counted repetitions nested in one another (``(a{1000}){1000}`` unrolls into a
    million states, though neither count is past ``MAX_REPEAT``). Read over parentheses, with backslash escapes
    and regex character classes skipped; a repetition applies to the group it follows (the product of its
    contents) or else to one atom. A parenthesis inside a quoted literal is read as a group, which can only
    raise the figure."""
    levels = [1]  # per open group: the largest product within it so far
    closed = None  # the product of the group that just closed, while a repetition may still follow it
    i = 0
    while i < len(text):
        char = text[i]
        match = _REPEAT_COUNTS.match(text, i) if char in "{~" and (i == 0 or text[i - 1] != "\\") else None
        if match is not None:
            inner = closed if closed is not None else 1
            levels[-1] = max(levels[-1], min(inner * _count(match), 10**12))
            closed, i = None, match.end()
            continue
        if closed is not None:
            levels[-1] = max(levels[-1], closed)
            closed = None
        if char == "\\":
            i += 2
            continue
        if char == "[":  # a character class: its brackets and braces are characters
            end = text.find("]", i + 2 if text.startswith("[]", i) or text.startswith("[^]", i) else i + 1)
            i = len(text) if end < 0 else end + 1
            continue
        if char == "(":
            levels.append(1)
        elif char == ")" and len(levels) > 1:
            closed = levels.pop()
        i += 1
    return max([*levels, closed or 1])


def repetition_problem(text: str) -> str | None:
    """Why a regex or Lark grammar's counted repetitions cannot be built (a count past ``MAX_REPEAT``, or counts
    nested to a product past it), or None. Read from the text: a brace that is not a repetition (inside a class
    or a quoted literal) is counted too, which can only refuse, never let a large one through."""
    for match in _REPEAT_COUNTS.finditer(text):
        if _count(match) > MAX_REPEAT:
            return (f"repeats {match.group().strip()[:24]!r}, more than the limit of {MAX_REPEAT:,} "
                    "repetitions a grammar may count")
    nested = nested_repetition(text)
    if nested > MAX_REPEAT:
        return (f"nests counted repetitions into {nested:,} repetitions, more than the limit of {MAX_REPEAT:,} a "
                "grammar may count")
    return None


def patterns(value) -> list[str]:
    """The regexes of a schema's ``pattern`` and ``patternProperties`` keywords, nested ones included."""
    if isinstance(value, list):
        return [p for item in value for p in patterns(item)]
    if not isinstance(value, dict):
        return []
    found = [value["pattern"]] if isinstance(value.get("pattern"), str) else []
    if isinstance(value.get("patternProperties"), dict):
        found += list(value["patternProperties"])
    return found + [p for key, item in value.items() if key not in ("const", "enum", "default", "examples")
                    for p in patterns(item)]


_LARK_RULE = re.compile(r"^\s*[?!]?([a-z_][a-z_0-9]*)(?:\.-?[0-9]+)?\s*:(.*)$")
_LARK_TERMINAL = re.compile(r"^\s*[A-Z_][A-Z_0-9]*(?:\.-?[0-9]+)?\s*:")
_LARK_TOKEN = re.compile(r'\s*(?:("(?:[^"\\]|\\.)*"i?)|(/(?:[^/\\]|\\.)+/[imslux]*)|([A-Za-z_][A-Za-z_0-9]*)'
                         r"|([0-9]+)|(\.\.)|([()\[\]|?*+~]))")


def lark_problem(text: str) -> str | None:
    """Why a Lark grammar admits no output, or None: its ``start`` rule has no finite expansion (every
    alternative reaches a rule that never ends, such as ``a: "x" a``). Read over rules, alternatives, groups,
    ``[...]``, ``? * + ~``, strings and regexes; a grammar with anything else (directives, ``%json``, GBNF) is not
    read."""
    if "::=" in text or "%" in text:
        return None
    rules = _lark_rules(text)
    if rules is None or "start" not in rules or len(rules) > MAX_DEFS_CHECKED:
        return None
    ending = least_fixed_point(rules, lambda name, done: _ends(rules[name], done, rules.keys()))
    if "start" in ending:
        return None
    return ("admits no output at all: rule start never ends (each of its alternatives reaches a rule with no "
            f"alternative that ends: {', '.join(sorted(set(rules) - ending))})")


def _lark_rules(text: str) -> dict[str, list] | None:
    """Rule name -> its expansion's tokens, or None where a line is not a rule, a terminal or a continuation."""
    rules: dict[str, list] = {}
    current: list | None = None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("//"):  # a comment after a rule is not read (None)
            continue
        rule, terminal = _LARK_RULE.match(line), _LARK_TERMINAL.match(line)
        if rule:
            current = rules.setdefault(rule.group(1), [])
            body = rule.group(2)
            if current:
                current.append("|")
        elif terminal:
            current = []  # a terminal ends: its text is not read (terminals are strings and regexes)
            continue
        elif line.lstrip().startswith("|") and current is not None:
            body = line
        else:
            return None
        tokens = _lark_tokens(body)
        if tokens is None:
            return None
        current.extend(tokens)
    return rules


def _lark_tokens(body: str) -> list | None:
    tokens, pos = [], 0
    while body[pos:].strip():
        match = _LARK_TOKEN.match(body, pos)
        if match is None:
            return None
        string, regex, name, number, dots, op = match.groups()
        tokens.append(("t",) if string or regex else ("n", name) if name else ("#", int(number[:9])) if number
                      else dots or op)
        pos = match.end()
    return tokens


def _ends(tokens: list, done: set[str], rules) -> bool:
    """Whether an expansion (tokens) has a finite derivation when only the rules in ``done`` do."""
    ends, pos = _alternatives(tokens, 0, done, rules)
    return ends if pos == len(tokens) else True  # not understood to its end: not refused


def _alternatives(tokens, pos, done, rules) -> tuple[bool, int]:
    ends, pos = _sequence(tokens, pos, done, rules)
    while pos < len(tokens) and tokens[pos] == "|":
        more, pos = _sequence(tokens, pos + 1, done, rules)
        ends = ends or more
    return ends, pos


def _sequence(tokens, pos, done, rules) -> tuple[bool, int]:
    ends = True
    while pos < len(tokens) and tokens[pos] not in ("|", ")", "]"):
        token = tokens[pos]
        if token in ("(", "["):
            inner, pos = _alternatives(tokens, pos + 1, done, rules)
            item = inner or token == "["  # [...] may be left out
            pos += 1  # the closing bracket
        elif isinstance(token, tuple) and token[0] == "t":
            item, pos = True, pos + 1
        elif isinstance(token, tuple) and token[0] == "n":
            item, pos = token[1] not in rules or token[1] in done, pos + 1
        else:
            return True, len(tokens) + 1  # an operator out of place: not understood
        if pos < len(tokens) and tokens[pos] in ("?", "*"):
            item, pos = True, pos + 1
        elif pos < len(tokens) and tokens[pos] == "+":
            pos += 1
        elif pos < len(tokens) and tokens[pos] == "~":
            pos += 1
            if pos < len(tokens) and isinstance(tokens[pos], tuple) and tokens[pos][0] == "#":
                item = item or tokens[pos][1] == 0
                pos += 1
                if pos + 1 < len(tokens) and tokens[pos] == "..":
                    pos += 2
        ends = ends and item
    return ends, pos
