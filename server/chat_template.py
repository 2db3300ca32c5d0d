"""The model's chat template, rendered in a bounded sandbox; checked once at start-up.

A chat template is Jinja code that comes with the model files (``tokenizer_config.json``, ``chat_template.jinja``,
a GGUF's ``tokenizer.chat_template``): code from the internet that runs on every chat request. transformers
compiles it in Jinja's ``ImmutableSandboxedEnvironment`` (no attribute escapes, no mutation of the inputs) with its
own globals and filters (``raise_exception``, ``tojson``, ``strftime_now``, ``namespace``, the ``generation``
tag); kvserve renders it in the same environment with bounds the sandbox lacks, so that no template, and no input
to one, can hold the event loop or the memory:

- work: at most ``MAX_STEPS`` loop iterations, calls and operators per render (``range`` alone stops at 100,000
  items, but nested loops multiply);
- size: the output, every string or list built by ``*``, ``+``, ``~`` or ``%``, and every width a filter or a
  format string is asked for, at most ``max_chars`` characters (the request body limit: a prompt longer than that
  cannot fit the context anyway); ``**`` at most ``MAX_EXPONENT``.

A render past a bound, or one that fails in any way (``raise_exception``, a type error, deep recursion), is a
``TemplateError`` the server answers with a 400. A template that does not compile, or cannot render a one-message
chat, stops the start with one line naming the problem, instead of failing every chat request.
"""

from __future__ import annotations

import functools
import re
from contextvars import ContextVar

import jinja2
from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer
from transformers.utils.chat_template_utils import _compile_jinja_template

MAX_STEPS = 200_000  # loop iterations + calls + operators in one render: real templates need ~10-100 per message
MAX_EXPONENT = 64    # the largest exponent ``**`` takes: 2**64 is the largest number a template has reason to build
_EACH, _JOIN = "kvserve_each_", "kvserve_join_"  # the globals the rewritten loops and concatenations call
_WIDE = re.compile(r"[0-9]{7,}")  # a width or precision of a million or more in a format string


class TemplateLimitError(TemplateError):
    """A render went past one of the bounds (``MAX_STEPS``, the size limit, ``MAX_EXPONENT``)."""


class _Budget:
    """What one render may still spend: steps, and the size of any one string or list."""

    __slots__ = ("steps", "max_chars")

    def __init__(self, steps: int, max_chars: int) -> None:
        self.steps = steps
        self.max_chars = max_chars

    def charge(self, steps: int = 1) -> None:
        self.steps -= steps
        if self.steps < 0:
            raise TemplateLimitError(f"the chat template took more than {MAX_STEPS:,} steps (loop iterations, "
                                     "calls and operators) on this request")

    def size(self, value) -> None:
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.max_chars:
            raise TemplateLimitError(f"the chat template built a value of more than {self.max_chars:,} characters "
                                     "or items on this request")

    def number(self, value) -> None:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.max_chars:
            raise TemplateLimitError(f"the chat template asked for a width or count of {value:,}, more than "
                                     f"{self.max_chars:,}")


_BUDGET: ContextVar[_Budget] = ContextVar("kvserve_template_budget")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, charging the render's budget for every call and operator."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        budget = _BUDGET.get()
        budget.charge()
        for value in (*args, *kwargs.values()):
            budget.number(value)
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format in a safe formatter
        if isinstance(getattr(method, "__self__", None), str) and getattr(method, "__name__", "") in (
                "format", "format_map") and _WIDE.search(method.__self__):
            raise TemplateLimitError("the chat template's format string asks for a width of a million or more")
        result = super().call(__context, __obj, *args, **kwargs)
        budget.size(result)
        return result

    def call_binop(self, context, operator, left, right):
        budget = _BUDGET.get()
        budget.charge()
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise TemplateLimitError(f"the chat template raises to the power {right}, more than {MAX_EXPONENT}")
        if operator == "*":
            for value, times in ((left, right), (right, left)):
                if isinstance(value, (str, list, tuple)) and isinstance(times, int) and \
                        times * len(value) > budget.max_chars:
                    raise TemplateLimitError(f"the chat template repeats a value to more than {budget.max_chars:,} "
                                             "characters or items")
        if operator == "%" and isinstance(left, str):
            if _WIDE.search(left):
                raise TemplateLimitError("the chat template's format string asks for a width of a million or more")
            for value in right if isinstance(right, tuple) else (right,):
                budget.number(value)
        result = super().call_binop(context, operator, left, right)
        budget.size(result)
        return result


class _CountedLoops(NodeTransformer):
    """Rewrites every ``for`` loop to iterate through ``kvserve_each_`` (one step per item) and every ``~``
    concatenation into ``kvserve_join_`` (its size checked), which the sandbox cannot see otherwise."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = nodes.Call(nodes.Name(_EACH, "load"), [node.iter], [], None, None)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        node = self.generic_visit(node)
        return nodes.Call(nodes.Name(_JOIN, "load"), list(node.nodes), [], None, None)


def _each(iterable):
    budget = _BUDGET.get()
    for item in iterable:
        budget.charge()
        yield item


def _join(*parts) -> str:
    budget = _BUDGET.get()
    text = "".join(str(part) for part in parts)  # Jinja's ``~``: every operand as a string
    budget.size(text)
    return text


def _bounded_filter(function):
    """A filter whose numeric arguments (widths, counts) and result are checked against the budget."""
    @functools.wraps(function)  # keeps Jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        budget = _BUDGET.get()
        budget.charge()
        for value in (*args[1:], *kwargs.values()):
            budget.number(value)
        result = function(*args, **kwargs)
        budget.size(result)
        return result
    return bounded


class ChatTemplate:
    """A chat template compiled once, rendered with bounds.

    Args:
        source: the template's Jinja text.
        special_tokens: the tokenizer's special tokens by name (``bos_token``, ``eos_token``, ...), which
            transformers passes to every template.
        max_chars: the most characters the output, or any value built on the way, may have.

    Raises:
        ValueError: the template does not compile (a syntax error, a tag that is not defined).
    """

    def __init__(self, source: str, special_tokens: dict[str, str], max_chars: int) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.max_chars = max_chars
        try:
            # transformers' globals, filters and tags, from an empty template: compiling the untrusted source in its
            # environment would fold constant expressions ("x" * 10**9) at compile time, outside every bound
            reference = _compile_jinja_template("").environment
            env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                                  extensions=[type(ext) for ext in reference.extensions.values()])
            env.globals.update(reference.globals)
            env.filters.update({name: _bounded_filter(f) for name, f in reference.filters.items()})
            env.globals.update({_EACH: _each, _JOIN: _join})
            self.template = env.from_string(_CountedLoops().visit(env.parse(source)))
        except TemplateError as exc:
            raise ValueError(f"the model's chat template does not compile: {type(exc).__name__}: {exc}") from None

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               **variables) -> str:
        """The prompt text of ``messages`` (OpenAI-shaped dicts; keys with value None are left out, as
        transformers does) with ``tools`` and the template's other ``variables`` (``chat_template_kwargs``).

        Raises:
            TemplateError: the template refused the messages (``raise_exception``), failed on them in any other
                way, or went past a bound (``TemplateLimitError``).
        """
        turns = [{key: value for key, value in m.items() if value is not None} for m in messages]
        budget = _Budget(MAX_STEPS, self.max_chars)
        token = _BUDGET.set(budget)
        try:
            pieces, size = [], 0
            for piece in self.template.generate(**self.special_tokens, **variables, messages=turns, tools=tools,
                                                documents=None, add_generation_prompt=add_generation_prompt):
                size += len(piece)
                if size > self.max_chars:
                    raise TemplateLimitError(f"the chat template's output is longer than {self.max_chars:,} "
                                             "characters on this request")
                pieces.append(piece)
            return "".join(pieces)
        except TemplateError:
            raise
        except (Exception, RecursionError) as exc:  # noqa: BLE001 - any failure of the template's code is its own
            raise TemplateError(f"{type(exc).__name__}: {exc}") from None
        finally:
            _BUDGET.reset(token)

    def check(self) -> None:
        """Render a one-user-message chat, as the start-up check.

        Raises:
            ValueError: the template cannot render it (one line naming why).
        """
        try:
            self.render([{"role": "user", "content": "Hello"}])
        except TemplateError as exc:
            raise ValueError(f"the model's chat template cannot render a one-message chat: {exc}") from None


def pick(templates: dict[str, ChatTemplate], tools: bool) -> ChatTemplate | None:
    """The template a request renders with: ``tool_use`` when it has tools and the tokenizer has one (as
    transformers' ``get_chat_template`` picks), else ``default``; None without templates."""
    if tools and "tool_use" in templates:
        return templates["tool_use"]
    return templates.get("default")


def special_tokens(tokenizer) -> dict[str, str]:
    """The special tokens transformers passes to a template (``bos_token``, ``eos_token``, ...), as text."""
    return {name: str(value) for name, value in tokenizer.special_tokens_map.items() if isinstance(value, str)}


def chat_templates(tokenizer, max_chars: int) -> dict[str, ChatTemplate]:
    """Every chat template of ``tokenizer`` by name (``default``, and ``tool_use`` where it has one), compiled and
    checked (``ChatTemplate.check``); empty for a tokenizer without one (a base model).

    Raises:
        ValueError: a template does not compile or cannot render a one-message chat.
    """
    sources = tokenizer.chat_template
    if sources is None:
        return {}
    if not isinstance(sources, dict):
        sources = {"default": sources}
    templates = {}
    for name, source in sources.items():
        template = ChatTemplate(source, special_tokens(tokenizer), max_chars)
        template.check()
        templates[name] = template
    return templates


def end_of_turn_ids(template: ChatTemplate, tokenizer) -> set[int]:
    """The special token the template writes right after an assistant's text (``<|im_end|>``, ``<|eot_id|>``,
    ``<end_of_turn>``, ``</s>``): the model was trained to end its turn with it, so it ends a reply. Empty when the
    template writes plain text there, or cannot render a user-assistant exchange."""
    marker = "kvserve-reply-end"
    try:
        text = template.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": marker}],
                               add_generation_prompt=False)
    except TemplateError:
        return set()
    after = text[text.rfind(marker) + len(marker):] if marker in text else ""
    ids = tokenizer(after.lstrip(" "), add_special_tokens=False)["input_ids"][:1]
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return {i for i in ids if i in special}
