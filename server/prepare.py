"""A request reduced to what the engine core needs: prompt tokens, limits and sampling settings, checked.

``prepare`` tokenizes (the chat template for chat, fill-in-the-middle for a suffix) and checks the prompt and
the limits against the model's context and the KV pool, raising ApiError (a 400) before anything is queued.
``server.generation`` builds the engine core's requests (``scheduler.contract.EngineRequest``) from a ``Prepared``.
"""

from __future__ import annotations

from dataclasses import dataclass

from jinja2.exceptions import TemplateError

from kvserve.engine.plan import SamplingParams
from kvserve.scheduler.ordering import SchedulingPolicy
from kvserve.server import tools
from kvserve.server.chat_template import pick
from kvserve.server.errors import ApiError
from kvserve.server.fim import fim_prompt
from kvserve.server.reasoning import opens_thinking
from kvserve.server.schemas import ChatCompletionRequest, CompletionRequest
from kvserve.server.state import ServerState


@dataclass(slots=True)
class Prepared:
    """A request reduced to what the engine core needs."""

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    n: int
    stop_strings: list[str]
    stop_token_ids: frozenset[int]
    min_tokens: int
    grammar: object | None = None  # engine.constraints.Grammar of a structured-output request (server.structured)
    cache_salt: str | None = None  # the prefix-cache salt of its sequences (server.auth.ApiKeys.cache_salt)
    priority: int = 0              # lower runs first under --scheduling-policy priority (vLLM's field)
    tenant: str | None = None      # whose request, for --scheduling-policy fair (server.auth.ApiKeys.tenant)
    owner: str | None = None       # its API key's fingerprint (server.auth): whose live page lists its requests
    thinking: bool | None = None   # chat with a reasoning parser: the prompt opened <think> (None: no split)
    prompt_only: bool = False      # completions' echo with max_tokens 0: one token computed, none returned

    @property
    def max_tokens_asked(self) -> int:
        """The client's max_tokens: ``max_tokens``, or 0 for a prompt-only echo (whose request computes one)."""
        return 0 if self.prompt_only else self.max_tokens


def _check_text(text: str, param: str) -> None:
    """Raise a 400 for text that is not valid Unicode (lone surrogates cannot be tokenized)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{param} is not valid UTF-8 text: {exc.reason} at position {exc.start}",
                       param=param) from exc


def check_token_ids(state: ServerState, ids, param: str) -> None:
    """Refuse token ids outside ``[0, state.token_ids_below)`` with a 400 naming ``param``, the range and the
    first few bad ids: an id beyond the embedding's rows would index past it in native code."""
    below = state.token_ids_below
    bad = [t for t in ids if not 0 <= t < below]
    if bad:
        shown = ", ".join(str(t) for t in bad[:5])
        raise ApiError(400, f"{param}: token ids must be in [0, {below - 1}] (this model's vocabulary); got "
                            f"{shown}", param=param)


# variables a template reads that the server fills itself: chat_template_kwargs may not replace them
_RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_MAX_TEMPLATE_ERROR = 500  # characters of a template's own error message quoted in the 400


def template_variables(request) -> dict:
    """The request's ``chat_template_kwargs`` (vLLM's field: extra variables for the chat template, e.g. Qwen3's
    ``enable_thinking``); a template ignores those it does not read.

    Raises:
        ApiError: 400 naming a variable the server fills itself (``messages``, ``tools``, ...).
    """
    given = getattr(request, "chat_template_kwargs", None) or {}
    for name in given:
        if name in _RESERVED_VARIABLES or name.startswith("kvserve_"):
            raise ApiError(400, f"chat_template_kwargs.{name}: the server sets this template variable itself",
                           param=f"chat_template_kwargs.{name}")
    return given


def chat_prompt(state: ServerState, messages: list, request=None,
                add_generation_prompt: bool | None = None) -> tuple[str, list[int]]:
    """The prompt text and token ids of chat messages through the model's chat template (server.chat_template),
    ready for the assistant's turn unless ``add_generation_prompt`` is False (None: the request's own, vLLM's
    field, default True), with the tools and ``chat_template_kwargs`` of ``request`` (a chat or a tokenize
    request, see server.tools). /tokenize and generation both render through here, so they count the same tokens.

    With the request's ``continue_final_message`` (vLLM's; transformers' apply_chat_template has the same), the
    final message is left open: the text is cut right after that message's own text, so the model continues it
    (an assistant prefill) instead of starting a new turn.

    Raises:
        ApiError: 400 for text that is not valid Unicode, a model without a chat template, a template that
            refuses or fails on the messages (its reason quoted), or one that does not show the final message's
            text as given (continue_final_message).
    """
    continue_final = bool(getattr(request, "continue_final_message", False))
    if add_generation_prompt is None:
        add_generation_prompt = bool(getattr(request, "add_generation_prompt", True))
    for index, message in enumerate(messages):
        _check_text(message.text, f"messages.{index}.content")
    template = pick(state.chat_templates, tools=request is not None and tools.active(request))
    if template is None:  # a base model: only plain-text completions make sense
        raise ApiError(400, f"model {state.model_name!r} has no chat template; send the text to /v1/completions",
                       param="messages")
    turns, tool_defs = tools.template_inputs(messages, request, template.source)
    variables = template_variables(request)
    try:
        text = template.render(turns, tools=tool_defs, add_generation_prompt=add_generation_prompt, **variables)
    except TemplateError as exc:  # the template's own refusal (roles that do not alternate), or a failure or bound
        reason = str(exc)[:_MAX_TEMPLATE_ERROR]
        raise ApiError(400, f"the model's chat template refused these messages: {reason}", param="messages") from None
    if continue_final:
        text = _open_final_message(text, messages[-1].text)
    return text, state.tokenizer(text, add_special_tokens=False)["input_ids"]


def _open_final_message(text: str, final: str) -> str:
    """``text`` cut right after the last place it shows ``final`` (stripped, as the templates strip turns), so
    the final message stays open (transformers' apply_chat_template does the same for continue_final_message).

    Raises:
        ApiError: 400 when the rendered text does not contain the final message's text.
    """
    final = final.strip()
    at = text.rfind(final) if final else -1
    if at < 0:
        raise ApiError(400, "continue_final_message: the model's chat template does not show the final message's "
                            "text as given (an empty final message cannot be continued)", param="messages")
    return text[:at + len(final)]


def chat_prompt_ids(state: ServerState, messages: list, request=None,
                    add_generation_prompt: bool | None = None) -> list[int]:
    """The token ids of ``chat_prompt``."""
    return chat_prompt(state, messages, request, add_generation_prompt)[1]


def text_prompt_ids(state: ServerState, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a plain-text prompt. Raises ApiError (400) on text that is not valid Unicode."""
    _check_text(text, "prompt")
    return state.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def completion_text_ids(state: ServerState, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a completions text prompt as generation prefills it (``/tokenize`` counts the same): an empty
    prompt is the start of a document (``_document_start``) where special tokens are added. Raises ApiError (400)
    on text that is not valid Unicode."""
    if not text and add_special_tokens:
        return _document_start(state.tokenizer)
    return text_prompt_ids(state, text, add_special_tokens)


def _document_start(tokenizer) -> list[int]:
    """The prompt of an empty prompt string, which OpenAI's completions take: the start of a document, i.e. the BOS
    token, or EOS where the tokenizer has no BOS (GPT-2's and Qwen2's ``<|endoftext|>`` separates documents), as
    llama.cpp's server starts one; a model needs at least one token to compute the next."""
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    return [start] if start is not None else []


def prompt_ids_of(state: ServerState, request: ChatCompletionRequest | CompletionRequest) -> list[int]:
    """Tokenize the prompt (chat template for chat). Raises ApiError on bad text or token ids."""
    tokenizer = state.tokenizer
    if isinstance(request, ChatCompletionRequest):
        return chat_prompt_ids(state, request.messages, request)
    if isinstance(request.prompt, str):
        if request.suffix:
            _check_text(request.suffix, "suffix")
            return text_prompt_ids(state, fim_prompt(tokenizer, request.prompt, request.suffix))
        return completion_text_ids(state, request.prompt)
    if request.suffix:
        raise ApiError(400, "suffix needs a text prompt (the fill-in-the-middle layout is text)", param="suffix")
    check_token_ids(state, request.prompt, "prompt")
    return list(request.prompt)


def prepare(state: ServerState, request: ChatCompletionRequest | CompletionRequest) -> Prepared:
    """Tokenize and check a request against the context and the pool.

    Raises:
        ApiError: 400 when the prompt is empty, or prompt + max_tokens exceeds the model's context or
            can never fit the KV pool (the message gives the token counts and the limit), or a priority is given
            where the scheduling policy does not use one.
    """
    if request.priority and state.config.scheduling_policy is not SchedulingPolicy.PRIORITY:
        raise ApiError(400, f"got priority {request.priority}, but this server does not schedule by priority "
                            "(start it with --scheduling-policy priority)", param="priority")
    thinking = None
    if isinstance(request, ChatCompletionRequest):
        text, prompt_ids = chat_prompt(state, request.messages, request)
        continued = request.messages[-1].text if request.continue_final_message else None
        thinking = opens_thinking(text, continued) if state.reasoning else None
    else:
        prompt_ids = prompt_ids_of(state, request)
    prompt_param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", param=prompt_param)
    for limit, what in ((state.max_model_len, "This model's maximum context length"),
                        (state.pool_tokens, "This server's KV cache")):
        if len(prompt_ids) >= limit:
            raise ApiError(400, f"{what} is {limit} tokens, but the prompt has {len(prompt_ids)} tokens (at least "
                                f"1 more is needed for the completion). Please shorten the prompt.", param=prompt_param)
    limit = min(state.max_model_len, state.pool_tokens)
    field_name = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
    max_tokens = request.token_limit
    if max_tokens is None:  # a chat or Responses request without a limit: --default-max-tokens, within the context
        max_tokens = min(state.config.default_max_tokens, limit - len(prompt_ids))
    if request.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({request.min_tokens}) must not exceed {field_name} ({max_tokens})",
                       param="min_tokens")
    check_token_ids(state, request.stop_token_ids, "stop_token_ids")
    check_token_ids(state, request.logit_bias_ids, "logit_bias")
    prompt_only = max_tokens == 0  # the step that computes the prompt's logprobs samples a token: not returned
    max_tokens = max(max_tokens, 1)
    total = len(prompt_ids) + max_tokens
    if total > state.max_model_len:
        raise ApiError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, you "
                            f"requested {total} tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the "
                            f"completion). Please reduce the prompt or {field_name}.", param=field_name)
    if total > state.pool_tokens:
        raise ApiError(400, f"The KV cache holds at most {state.pool_tokens} tokens. However, you requested {total} "
                            f"tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the completion).",
                       param=field_name)
    echo_logprobs = isinstance(request, CompletionRequest) and request.echo and request.logprobs is not None
    params = SamplingParams(temperature=request.temperature, top_p=request.top_p, top_k=max(request.top_k, 0),
                            min_p=request.min_p, seed=request.seed, presence_penalty=request.presence_penalty,
                            frequency_penalty=request.frequency_penalty,
                            repetition_penalty=request.repetition_penalty, logprobs=request.num_logprobs,
                            prompt_logprobs=echo_logprobs, logit_bias=request.logit_bias_ids or None,
                            processed_logprobs=request.logprobs_mode == "processed_logprobs")
    stop_ids = set(request.stop_token_ids) | (set() if request.ignore_eos else set(state.eos_ids))
    return Prepared(prompt_ids=prompt_ids, max_tokens=max_tokens, params=params, n=request.n,
                    stop_strings=request.stop_strings, stop_token_ids=frozenset(stop_ids),
                    min_tokens=min(request.min_tokens, max_tokens), priority=request.priority, thinking=thinking,
                    prompt_only=prompt_only)
