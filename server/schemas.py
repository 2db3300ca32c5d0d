"""Request bodies of the OpenAI-compatible API (pydantic). A chat or completions field kvserve does not know is
a 400 naming it (OpenAI's "unrecognized request argument"); OpenAI fields that kvserve does not implement
(best_of and suffix on chat, image parts, store) are refused with a 400 naming them whenever they would change the
output, so a client never gets silently different text. Keys inside a message are not checked (clients send back
the assistant messages they were given, with OpenAI's extra keys).

Ranges follow OpenAI's API reference; vLLM's extra sampling fields (top_k, min_p, repetition_penalty,
ignore_eos, min_tokens, stop_token_ids) are accepted too.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, StrictBool, ValidationInfo, field_validator, model_validator

from kvserve.server.validation import BodyError, RequestModel, checked_required


# a logit_bias key: a token id written as ASCII digits and nothing else, as OpenAI requires (no spaces, no sign:
# int() would read " 12 " and "+12"), and not 4,300 of them (int() refuses those)
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,12}")


# What server.tools accepts as a tool and a tool_choice, for /openapi.json (schema-driven clients and fuzzers)
TOOL_SCHEMA = {"type": "object", "required": ["function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object"}}}}}
TOOL_CHOICE_SCHEMAS = [{"enum": ["none", "auto", "required"]},
                       {"type": "object", "required": ["type", "function"], "properties": {
                           "type": {"const": "function"},
                           "function": {"type": "object", "required": ["name"],
                                        "properties": {"name": {"type": "string"}}}}},
                       {"type": "null"}]


class StreamOptions(RequestModel):
    """``stream_options``: OpenAI's ``include_usage`` (a last chunk with the usage) and vLLM's
    ``continuous_usage_stats`` (the usage so far on every chunk); ``include_obfuscation`` only at false (kvserve
    pads no chunk). Another key is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    include_obfuscation: StrictBool = False

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, value: bool) -> bool:
        if value:
            raise ValueError("not supported by kvserve: kvserve adds no obfuscation padding to chunks (send false)")
        return value


# Fields of vLLM and SGLang that change nothing at these values, which vllm-router (SGLang's router) writes into
# every request it forwards: accepted at exactly these values (or null), else a 400 naming them as any field
# kvserve does not serve.
NEUTRAL_AT = {"no_stop_trim": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
              "separate_reasoning": True, "stream_reasoning": True, "include_reasoning": True,
              "return_hidden_states": False, "include_stop_str_in_output": False,
              # OpenAI's chat fields for what kvserve does not serve (audio, predicted outputs, web search,
              # reasoning effort, verbosity): null, as SDK wrappers send them unset, or text-only modalities
              "audio": None, "prediction": None, "web_search_options": None, "reasoning_effort": None,
              "verbosity": None, "modalities": ["text"]}


MAX_STOP_STRINGS = 64  # a request's stop strings (see _bounded_stops)

ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]  # OpenAI's tiers: kvserve serves all as one


class _SamplingRequest(RequestModel):
    """Fields shared by chat and completions."""

    # a field kvserve does not know is a 400 naming it (OpenAI's "unrecognized request argument"), never
    # silently ignored: vLLM's and other servers' fields change the output where they are served
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    _is_body: ClassVar[bool] = True
    _completions: ClassVar[bool] = False  # CompletionRequest serves best_of and suffix
    _accepted_at: ClassVar[dict] = NEUTRAL_AT  # in /openapi.json with the one value each is taken at

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-2**63, lt=2**63)  # a signed 64-bit integer, as OpenAI's and vLLM's
    n: int = Field(default=1, ge=1, le=16)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stream: StrictBool = False  # "yes" is an error, not True
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's cache_salt: enters the first block's prefix-cache digest, so only requests with the same salt (and,
    # with API keys, the same key) share cached prefixes; a random 256-bit string keeps a prompt's cache private
    cache_salt: str | None = Field(default=None, min_length=1)
    # vLLM's priority: lower is scheduled first under --scheduling-policy priority; refused (400) by other policies
    priority: int = Field(default=0, ge=-2**31, lt=2**31)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]; see _check_logit_bias
    # vLLM's logprobs_mode, per request: processed_logprobs are those of the distribution sampled from (after
    # temperature and top-k/top-p), the soft labels of distillation; logits modes are not served (a 400)
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    # structured outputs and tools (checked and compiled by server.structured and server.tools)
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1,  # an empty option admits no output
                                            json_schema_extra={"items": {"type": "string", "minLength": 1}})
    guided_grammar: str | None = None
    structured_outputs: dict | None = None
    # checked by server.tools (its messages name the place); the schemas say what it accepts
    tools: list | None = Field(default=None, json_schema_extra={"items": TOOL_SCHEMA})
    tool_choice: str | dict | None = Field(default=None, json_schema_extra={"anyOf": TOOL_CHOICE_SCHEMAS})
    parallel_tool_calls: bool | None = None
    # served on completions only (CompletionRequest); see _refuse_unsupported
    best_of: int | None = None
    suffix: str | None = None
    # OpenAI's fields that do not change a reply: accepted, with no effect here (kvserve keeps no completions,
    # so store: true is refused; its prefix cache needs no key; it has one service tier)
    store: bool = False
    metadata: dict[str, str] | None = None
    service_tier: ServiceTier | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral(cls, data):
        """Leave out the ``NEUTRAL_AT`` fields sent at their neutral value (or null): they change nothing."""
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items()
                if key not in NEUTRAL_AT or key in cls.model_fields
                or not (value is None or (type(value) is type(NEUTRAL_AT[key]) and value == NEUTRAL_AT[key]))}

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        unsupported = [name for name, used in (
            # completions serve these (CompletionRequest, server.fim); chat has no such fields at OpenAI
            ("best_of", self.best_of is not None and self.best_of != self.n and not self._completions),
            ("suffix", self.suffix is not None and not self._completions),
            ("store", self.store),  # kvserve stores nothing
        ) if used]
        if unsupported:
            raise BodyError(f"not supported by kvserve: {', '.join(unsupported)}", unsupported[0])
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM answer it
            raise BodyError("stream_options is only allowed when stream is true", "stream_options")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """OpenAI's checks: keys are token ids written as integers, values in [-100, 100]. The ids' range is
        the tokenizer's and is checked when the request is prepared."""
        for key, bias in (value or {}).items():
            if len(key) > 12 and key.isascii() and key.isdigit():  # an id, but more digits than any vocabulary
                raise ValueError(f"token id {key[:24]} is past any vocabulary (this model's ids are checked "
                                 "against its tokenizer)")
            if not _TOKEN_ID_KEY.fullmatch(key):  # isdigit() would pass "²", which int() refuses
                raise ValueError(f"invalid key {key!r}: keys are token ids, written as non-negative integers "
                                 "(digits only, no spaces or sign)")
            if not -100 <= bias <= 100:
                raise ValueError(f"the value for token {key} is {bias}; values must be between -100 and 100")
        return value

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` with integer token ids (empty when not given)."""
        return {int(key): bias for key, bias in (self.logit_bias or {}).items()}

    @field_validator("response_format")
    @classmethod
    def _format_has_type(cls, value: dict | None) -> dict | None:
        if value is not None and "type" not in value:
            raise ValueError("type is required ('text', 'json_object' or 'json_schema')")
        return value

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, value: str | list[str] | None) -> list[str]:
        # OpenAI takes 4 and vLLM any number; harnesses send more than 4 (lm-eval adds the EOS string to a task's
        # own, up to 7), and the matcher's cost per character grows with their number: 64 bounds it
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed ({len(stops)} given)")
        return [s for s in stops if s]

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far (vLLM's ``continuous_usage_stats``)."""
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)


class ContentPart(RequestModel):
    """One part of a message's content list. OpenAI requires ``type``; a text part requires ``text``."""

    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = checked_required()  # checked by ChatMessage, which knows the part's index


_NULL_CONTENT_ROLES = ("assistant", "tool")  # roles whose content OpenAI's API takes as null


def check_text_parts(parts: list, text_types: tuple[str, ...]) -> None:
    """A message's content parts (each with ``type`` and ``text``, None where not given): at least one, each of
    ``text_types``, each with its text (chat's and the responses route's messages alike).

    Raises:
        ValueError: what is wrong, naming the first part at fault (the 400's message).
    """
    if not parts:
        raise ValueError("content must not be an empty list")
    other = sorted({part.type for part in parts if part.type not in text_types})
    if other:
        raise ValueError(f"only text content parts are supported, not {', '.join(other)}")
    missing = [i for i, part in enumerate(parts) if part.text is None]
    if missing:
        raise ValueError(f"text part {missing[0]} has no text")


class ChatMessage(RequestModel):
    """One chat turn. ``content`` is a string or a non-empty list of text parts; OpenAI allows null on an assistant
    turn (one that only calls tools, or a refusal) and on a tool turn, which then render as empty text; server.tools
    renders the calls."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # declared before content: content's validator reads them (null content is an assistant's with tool_calls)
    tool_calls: list[dict] | None = None  # an assistant's earlier calls (server.tools renders them)
    tool_call_id: str | None = None       # a tool message: the call it answers
    name: str | None = None
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)

    @field_validator("content", mode="before")
    @classmethod
    def _parts_have_a_type(cls, value):
        # said here: a part without type otherwise fails as "not a valid string" (the union's first member)
        if isinstance(value, list):
            untyped = [i for i, part in enumerate(value) if isinstance(part, dict) and "type" not in part]
            if untyped:
                raise ValueError(f"content part {untyped[0]} has no type (OpenAI requires it: 'text')")
        return value

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value, info: ValidationInfo):
        if value is None:
            if info.data.get("role") in _NULL_CONTENT_ROLES:
                return value
            raise ValueError("content is required: a string or a list of text parts (null only on an assistant "
                             "or a tool turn)")
        if isinstance(value, list):
            check_text_parts(value, ("text",))
        return value

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content if part.type == "text")
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM's: extra variables for the chat template (Qwen3's enable_thinking, ...); see server.prepare
    chat_template_kwargs: dict[str, object] | None = None
    # vLLM's: end the prompt with the assistant's turn opened (add_generation_prompt), or leave the final message
    # open for the model to continue (continue_final_message: an assistant prefill); server.prepare.chat_prompt
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI's deprecated function calling (superseded by tools): refused by name, never silently ignored
    functions: list | None = None
    function_call: str | dict | None = None

    @field_validator("functions", "function_call")
    @classmethod
    def _no_legacy_functions(cls, value, info):
        if value:
            raise ValueError(f"the legacy {info.field_name} field is not supported by kvserve; use tools (and "
                             "tool_choice) instead")
        return value

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise BodyError("top_logprobs requires logprobs: true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise BodyError("continue_final_message needs add_generation_prompt: false (the final message is "
                            "continued, so no new turn is opened; vLLM refuses both too)", "continue_final_message")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]

    # OpenAI's completions default, also when null; 0 with echo: the prompt alone, its logprobs too (vLLM's and the
    # legacy API's "echo without generation", as scoring harnesses send it)
    max_tokens: int = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    _completions: ClassVar[bool] = True
    # refused when used (see _no_tools): the schema says so
    tools: list | None = Field(default=None, json_schema_extra={"anyOf": [{"type": "array", "maxItems": 0},
                                                                         {"type": "null"}]})
    tool_choice: str | dict | None = Field(default=None, json_schema_extra={"anyOf": [{"type": "null"}]})
    # served: vLLM v0's best_of (best_of candidates, the n best by cumulative logprob returned); non-streamed only
    best_of: int | None = Field(default=None, ge=1, le=16)

    @model_validator(mode="after")
    def _no_tools(self):
        if self.tools or self.tool_choice is not None:
            name = "tools" if self.tools else "tool_choice"
            raise BodyError(f"{name}: tools and tool_choice are for /v1/chat/completions", name)
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_types(cls, value):
        # one message for every wrong shape, rather than pydantic's error for the union's first member
        def token_ids(item) -> bool:
            return isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)

        if isinstance(value, str) or token_ids(value) or (
                isinstance(value, list) and (all(isinstance(v, str) for v in value) or all(map(token_ids, value)))):
            return value
        raise ValueError("must be a string, a list of token ids (integers, not booleans), or a list holding one "
                         "of those")

    @field_validator("prompt")
    @classmethod
    def _prompt_or_prompts(cls, value):
        """One prompt stays as given; a list of one prompt is that prompt; several stay a list (``prompts``)."""
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and isinstance(value[0], (str, list)):
            if any(isinstance(p, list) and not p for p in value):
                raise ValueError("a prompt of token ids must not be empty")
            if len(value) == 1:
                return value[0]
        return value

    @model_validator(mode="after")
    def _generation_or_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise BodyError("max_tokens must be at least 1 (0 only with echo: the prompt alone)", "max_tokens")
        return self

    @model_validator(mode="after")
    def _check_best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            if self.best_of < self.n:
                raise BodyError(f"best_of ({self.best_of}) must be at least n ({self.n})", "best_of")
            if self.stream:
                raise BodyError("best_of above n cannot be streamed: the best candidates are known only at the end",
                                "best_of")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the request: one, or several (OpenAI's list of strings or of token-id lists)."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)
        return [self.prompt]

    @property
    def candidates(self) -> int:
        """Sequences generated per prompt: ``best_of`` when it is above ``n``, else ``n``."""
        return max(self.best_of or self.n, self.n)

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(RequestModel):
    # an unknown field is a 400 naming it, as on the generation and render routes
    model_config = ConfigDict(extra="forbid")
    _is_body: ClassVar[bool] = True
    model: str | None = None
    prompt: str | None = None
    return_token_strs: bool = False  # vLLM's: each token's piece (token_strs) beside its id
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True  # a text prompt's; chat messages render as generation renders them
    # chat: what generation renders too (vLLM's tokenize fields), so the count is the request's prompt tokens
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list | None = Field(default=None, json_schema_extra={"items": TOOL_SCHEMA})
    tool_choice: str | dict | None = Field(default=None, json_schema_extra={"anyOf": TOOL_CHOICE_SCHEMAS})
    chat_template_kwargs: dict[str, object] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise BodyError("give exactly one of prompt or messages", "prompt" if self.messages is None else "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise BodyError("continue_final_message needs add_generation_prompt: false", "continue_final_message")
        return self


class DetokenizeRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")
    _is_body: ClassVar[bool] = True
    model: str | None = None
    tokens: list[int]
