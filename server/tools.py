"""Tool calling in OpenAI's shape: tools into the prompt, the reply parsed into ``tool_calls``.

The model sees the tools through its chat template when the template reads a ``tools`` variable
(transformers' ``apply_chat_template(tools=...)``); otherwise through ``DEFAULT_TOOL_PROMPT`` added to the system
message. Either way it is asked to answer with Hermes-style blocks, which is also what the parser reads::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

``tool_choice``: ``none`` leaves the tools out of the prompt and parses nothing; ``auto`` parses the reply from its
first ``<tool_call>`` on (the text before it is content); ``required`` and a named function constrain the reply to
that wrapper around the functions' parameter schemas (one call, or one or more with ``parallel_tool_calls``), so it
always parses.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from functools import cache

import jinja2
import jinja2.meta

from kvserve.engine.constraints import JSON_OPTIONS, GrammarSpec
from kvserve.server.errors import ApiError
from kvserve.server.reasoning import held

OPEN, CLOSE = "<tool_call>", "</tool_call>"

DEFAULT_TOOL_PROMPT = (
    "You can call functions. The functions, as JSON Schema, are:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one block per call and nothing else:\n"
    '<tool_call>{{"name": "<function name>", "arguments": <arguments as a JSON object>}}</tool_call>'
)
# OpenAI's rule for a function name, matched whole (fullmatch): a pattern's `$` also matches before a final "\n"
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# up to the arguments' opening brace, which must have arrived: a stream cut after `"arguments":` must not start
# the arguments with the space that follows (streamed and whole replies give the same arguments, byte for byte)
_HEADER = re.compile(r'\s*<tool_call>\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*(?=\{)', re.S)
_OPENED, _CLOSED = re.compile(r"\s*" + re.escape(OPEN) + r"\s*"), re.compile(r"\s*" + re.escape(CLOSE))
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def functions(body) -> list[dict]:
    """The request's functions (``{"name", "description", "parameters"}``), checked.

    Raises:
        ApiError: 400 for a tool that is not a function, a bad or repeated name, or a named ``tool_choice`` not
            among them.
    """
    result = []
    for index, tool in enumerate(body.tools or []):
        param = f"tools.{index}"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise ApiError(400, f"{param} must be {{\"type\": \"function\", \"function\": {{...}}}}", param=param)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ApiError(400, f"{param}.function.name must be 1-64 letters, digits, _ or - and nothing else",
                           param=f"{param}.function.name")
        if any(f["name"] == name for f in result):  # a call of it could follow either schema
            raise ApiError(400, f"{param}.function.name {name!r} names a function an earlier tool names too; "
                           "function names must be unique", param=f"{param}.function.name")
        parameters = function.get("parameters") or _EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise ApiError(400, f"{param}.function.parameters must be a JSON Schema object", param=param)
        if parameters.get("type", "object") != "object":  # the arguments are a JSON object (OpenAI's rule too)
            raise ApiError(400, f"{param}.function.parameters must be a schema of type \"object\" (the arguments "
                           f"are a JSON object), not type {json.dumps(parameters['type'])}",
                           param=f"{param}.function.parameters")
        result.append({"name": name, "description": function.get("description", ""), "parameters": parameters})
    choice = body.tool_choice
    if choice is not None and not result and choice != "none":
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise ApiError(400, f"tool_choice must be none, auto, required or a function, not {choice!r}",
                       param="tool_choice")
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ApiError(400, 'tool_choice must be none, auto, required or {"type": "function", "function": '
                           '{"name": "<one of the tools>"}}', param="tool_choice")
        if name not in {f["name"] for f in result}:
            raise ApiError(400, f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
    return result


def active(body) -> bool:
    """Whether the reply is to be parsed for tool calls (tools given, ``tool_choice`` not ``none``)."""
    return bool(getattr(body, "tools", None)) and body.tool_choice != "none"


def forced_grammar(body, tool_parameters: Callable[[dict, str], dict]) -> GrammarSpec | None:
    """The grammar of ``tool_choice`` ``required`` or a named function: ``<tool_call>`` blocks whose JSON is
    ``{"name": <a function>, "arguments": <its parameters>}``; None for ``auto``/``none``/no tools.

    Args:
        tool_parameters: ``(schema, param) -> schema as served``: a function's parameter schema read strictly (no
            properties it does not name) and checked like a ``response_format`` schema, raising ApiError (400)
            where it cannot be served (``server.structured.tool_parameters``; passed in so that this module does
            not import the one that imports it).
    """
    fns = functions(body)
    choice = body.tool_choice
    if not fns or choice in (None, "none", "auto"):
        return None
    if isinstance(choice, dict):
        fns = [f for f in fns if f["name"] == choice["function"]["name"]]
    alternatives = []
    for index, f in enumerate(fns):
        parameters = tool_parameters(f["parameters"], f"tools.{index}.function.parameters")
        # the arguments are a JSON document of their own, the parameters its root schema, so that the schema's
        # references ("#/$defs/...", "#") resolve against it; the call's JSON around them is literal text,
        # spaced as JSON_OPTIONS spaces the arguments
        header = '{"name": ' + json.dumps(f["name"]) + ', "arguments": '
        arguments = parameters | {"x-guidance": JSON_OPTIONS}
        alternatives.append(f"{json.dumps(header)} %json {json.dumps(arguments)} \"}}\"")
    repeat = "+" if body.parallel_tool_calls is not False else ""
    lark = (f"start: call{repeat}\ncall: {json.dumps(OPEN)} body {json.dumps(CLOSE)}\n"
            f"body: {' | '.join(f'({a})' for a in alternatives)}\n")
    return GrammarSpec("lark", lark, json_literals=True)


@cache
def template_takes_tools(template: str) -> bool:
    """Whether a chat template reads the ``tools`` variable."""
    return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))


def template_inputs(messages: list, body, template: str) -> tuple[list[dict], list[dict] | None]:
    """Chat-template turns and the ``tools`` argument for ``apply_chat_template``.

    Assistant ``tool_calls`` in the history become ``<tool_call>`` blocks (or the template's own ``tool_calls``
    when it takes tools); ``tool`` messages keep their role.
    """
    takes_tools = template_takes_tools(template)
    fns = functions(body) if body is not None and active(body) else []
    turns = []
    for number, m in enumerate(messages):
        turn: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        if m.role == "assistant" and m.tool_calls:
            calls = [_history_call(c, f"messages.{number}.tool_calls.{i}") for i, c in enumerate(m.tool_calls)]
            if takes_tools:
                turn["tool_calls"] = [{"type": "function", "function": c} for c in calls]
            else:
                turn["content"] = (m.text + "".join(f"{OPEN}{json.dumps(c)}{CLOSE}" for c in calls)).strip()
        if m.role == "tool" and m.tool_call_id:
            turn["tool_call_id"] = m.tool_call_id
        turns.append(turn)
    if not fns:
        return turns, None
    openai_tools = [{"type": "function", "function": f} for f in fns]
    if takes_tools:
        return turns, openai_tools
    prompt = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in openai_tools))
    if turns and turns[0]["role"] == "system":
        turns[0] = turns[0] | {"content": turns[0]["content"] + "\n\n" + prompt}
    else:
        turns.insert(0, {"role": "system", "content": prompt})
    return turns, None


def _history_call(call, param: str) -> dict:
    """An earlier assistant turn's tool call (``param``: where it is in the request, for the errors) as the chat
    template takes it: its name and its arguments parsed."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, "an assistant message's tool_calls must be [{\"id\", \"type\": \"function\", "
                            "\"function\": {\"name\", \"arguments\"}}]", param=param)
    arguments = function.get("arguments") or "{}"
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested thousands deep
        raise ApiError(400, f"{param}.function.arguments is not JSON: {exc}", param=param) from exc
    return {"name": function["name"], "arguments": arguments}


def _object_end(text: str, start: int) -> int | None:
    """Index just past the JSON value starting at ``text[start]`` (an object), or None if it is incomplete."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _one_per_call(deltas: list[dict]) -> list[dict]:
    """``deltas`` with one entry per call index: a call's header and its argument fragments from the same text
    joined into one, as OpenAI's chunks carry them (a client that reads ``delta.tool_calls`` by position, or
    keeps the last entry per index, would otherwise lose a fragment)."""
    merged: dict[int, dict] = {}
    for delta in deltas:
        entry = merged.get(delta["index"])
        if entry is None:
            merged[delta["index"]] = {**delta, "function": dict(delta["function"])}
        else:
            entry["function"]["arguments"] = entry["function"].get("arguments", "") + delta["function"]["arguments"]
    return list(merged.values())


def _whole_calls(calls: list[dict]) -> list[dict]:
    """Held calls as deltas, one each (index, id, type, name and all its arguments)."""
    return [{"index": i, **call, "function": dict(call["function"])} for i, call in enumerate(calls)]


class ToolCallStream:
    """Splits one choice's generated text into content and tool calls, incrementally.

    ``feed`` takes new text and returns ``(content, tool_call_deltas)`` in the shape of a chat chunk's
    ``delta.tool_calls`` (the first delta of a call carries its id and name, later ones argument fragments);
    ``finish`` flushes. ``calls`` holds the whole calls so far (for a non-streamed message).

    A streamed reply hands over the same calls as the whole one (``verdict``), so what it sends before the end
    must not be taken back. A constrained reply (``tool_choice`` required or a named function: its grammar
    admits only calls of the request's functions) streams its calls as they form. An unconstrained one (``auto``)
    may name a function the request does not have, or cut its arguments short with a stop: its calls are held
    until the reply ends, then sent whole, or the rest of the reply sent as content. Its text before the first
    ``<tool_call>`` is content, streamed as it comes (but a tail that may be the tag's start), as vLLM's Hermes
    parser returns it ("Let me check.\n<tool_call>..."); a constrained reply starts with the tag.

    Args:
        names: the request's functions (a call must name one of them).
        constrained: the reply is constrained to calls of ``names`` (stream them as they form).
    """

    def __init__(self, names: frozenset[str] = frozenset(), constrained: bool = False) -> None:
        self.names, self.constrained = names, constrained
        self.buffer = ""
        self.mode = "undecided"   # then "content" (text, until a call begins) or "tools"
        self.pos = 0               # tools mode: parsed up to here
        self.args_start: int | None = None  # tools mode: where the current call's arguments begin
        self.args_sent = 0
        self.calls: list[dict] = []
        self.tails: list[tuple[int, bool]] = []  # per call whose arguments closed: where they end, block closed

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content = ""
        if self.mode == "undecided":
            head = self.buffer.lstrip()
            if head.startswith(OPEN):
                self.mode = "tools"
            elif OPEN.startswith(head):
                return "", []  # maybe the start of a call: wait
            else:
                self.mode = "content"
        if self.mode == "content":
            at = self.buffer.find(OPEN)
            if at < 0:  # all of it but a tail that may be the tag's start
                cut = len(self.buffer) - held(self.buffer, OPEN)
                content, self.buffer = self.buffer[:cut], self.buffer[cut:]
                return content, []
            content, self.buffer, self.mode = self.buffer[:at], self.buffer[at:], "tools"
        deltas = _one_per_call(self._parse())
        return content, deltas if self.constrained else []

    def _parse(self) -> list[dict]:
        deltas: list[dict] = []
        while True:
            if self.args_start is None:
                match = _HEADER.match(self.buffer, self.pos)
                if match is None:
                    return deltas
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": match.group(1), "arguments": ""}}
                self.calls.append(call)
                deltas.append({"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                               "function": {"name": call["function"]["name"], "arguments": ""}})
                self.args_start, self.args_sent = match.end(), match.end()
            end = _object_end(self.buffer, self.args_start)
            limit = end if end is not None else len(self.buffer)
            if limit > self.args_sent:
                fragment = self.buffer[self.args_sent:limit]
                self.calls[-1]["function"]["arguments"] += fragment
                deltas.append({"index": len(self.calls) - 1, "function": {"arguments": fragment}})
                self.args_sent = limit
            if end is None:
                return deltas
            close = re.compile(r"\s*\}\s*" + re.escape(CLOSE)).match(self.buffer, end)
            if len(self.tails) < len(self.calls):
                self.tails.append((end, False))
            if close is None:
                return deltas
            self.tails[-1] = (end, True)
            self.pos, self.args_start = close.end(), None

    def open_call(self) -> bool:
        """Whether the last call's arguments are still open (its JSON object not closed: the reply ended in it)."""
        return self.args_start is not None and _object_end(self.buffer, self.args_start) is None

    def verdict(self, reason: str | None) -> bool:
        """Whether the calls parsed are handed over as ``tool_calls`` (else the reply is content): each names one
        of the request's functions and its arguments are a JSON object, except that the last call's arguments
        may be cut short where the reply ended inside them (finish_reason ``length``, as OpenAI returns such a
        call; or any end of a constrained reply, whose grammar admits only a call's beginning). A reply in ``auto`` mode is not
        constrained, so a model may write a call that is neither; it is then returned as content, as vLLM's
        Hermes parser does."""
        if not self.calls:
            return False
        cut = (reason == "length" or self.constrained) and self.open_call()
        for position, call in enumerate(self.calls):
            if call["function"]["name"] not in self.names:
                return False
            if cut and position == len(self.calls) - 1:
                continue
            try:
                if not isinstance(json.loads(call["function"]["arguments"]), dict):
                    return False
            except (ValueError, RecursionError):  # RecursionError: nesting past Python's stack
                return False
            end, closed = self.tails[position]
            # after the arguments, the block's "}</tool_call>", or the reply's end partway through it; anything
            # else (`{"a": 1} xyz}`) makes the block not a call's JSON (vLLM's Hermes parser returns it as content)
            if not closed and not ("}" + CLOSE).startswith(re.sub(r"\s+", "", self.buffer[end:])):
                return False
        return True

    def _blocks_in_any_order(self) -> list[dict] | None:
        """The reply's calls where it is whole ``<tool_call>`` blocks (text after the last one dropped, as the parse
        as it streams drops it), each a JSON object of exactly ``name`` (one of the request's functions) and
        ``arguments`` (an object) in whichever order, as vLLM's Hermes parser reads them (``json.loads``; the
        parse as it streams reads ``name`` first, as the prompt asks); else None. A block that writes ``name``
        first keeps its arguments' text byte for byte; one that writes them first has them re-serialized as
        that parser does (``json.dumps``, ``ensure_ascii`` off)."""
        calls, pos = [], 0
        decoder = json.JSONDecoder()
        while True:
            opened = _OPENED.match(self.buffer, pos)
            if opened is None:
                break
            try:
                value, end = decoder.raw_decode(self.buffer, opened.end())
            except (ValueError, RecursionError):  # RecursionError: nesting past Python's stack
                return None
            closed = _CLOSED.match(self.buffer, end)
            if (closed is None or not isinstance(value, dict) or set(value) != {"name", "arguments"}
                    or value["name"] not in self.names or not isinstance(value["arguments"], dict)):
                return None
            header = _HEADER.match(self.buffer, pos)
            arguments = (self.buffer[header.end():_object_end(self.buffer, header.end())] if header is not None
                         else json.dumps(value["arguments"], ensure_ascii=False))
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": value["name"], "arguments": arguments}})
            pos = closed.end()
        return calls if calls and OPEN not in self.buffer[pos:] else None

    def finish(self, reason: str | None = None) -> tuple[str, list[dict]]:
        """Flush at the end (``reason``: the finish_reason): undecided or held text is content; a tools-mode reply
        whose calls ``verdict`` does not hand over, or that has a block left after them, is read again as blocks
        with their keys in any order (``auto``: ``_blocks_in_any_order``), else is content, all of it from the
        first ``<tool_call>`` if ``verdict`` failed; held calls are sent, one delta each."""
        if self.mode == "tools" and not self.constrained and (not self.verdict(reason)
                                                              or OPEN in self.buffer[self.pos:]):
            reordered = self._blocks_in_any_order()
            if reordered is not None:
                self.calls = reordered
                return "", _whole_calls(reordered)
        if self.mode in ("undecided", "content") or (self.mode == "tools" and not self.verdict(reason)):
            content, self.buffer, self.mode, self.calls = self.buffer, "", "content", []
            return content, []
        if self.mode == "tools" and not self.constrained:
            return "", _whole_calls(self.calls)
        return "", []
