"""OpenAI response shapes: chat and completion objects and chunks, logprobs in each API's format."""

from __future__ import annotations

from kvserve.engine.plan import TokenLogprob
from kvserve.server.choice import ChoiceUpdate
from kvserve.server.detok import text_offsets, token_bytes
from kvserve.server.generation import Generation
from kvserve.server.reasoning import ReasoningSplit
from kvserve.server.tools import ToolCallStream


def token_text(raw: bytes) -> str:
    """OpenAI's token string: the text, or ``bytes:\\xf0\\x9f`` for a partial character."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class Formatter:
    """Builds response dicts for one request.

    Args:
        generation: the request in flight.
        chat: chat.completion(s) shapes when True, text_completion otherwise.
        request_id: the id shared by every chunk of the response.
        model: the served model name.
        tokenizer: for token strings in logprobs.
        tool_calls: parse replies for tool calls (chat with tools; server.tools): they come out as
            ``tool_calls`` with finish_reason ``tool_calls`` instead of content.
        tool_names: the request's functions (a call naming another is content).
        tools_constrained: ``tool_choice`` required or a named function (a grammar holds the calls): streamed as
            they form; otherwise held to the reply's end (server.tools.ToolCallStream).
        thinking: chat with a reasoning parser (server.reasoning): whether the prompt opened ``<think>``; None
            when replies are not split.
    """

    def __init__(self, generation: Generation, chat: bool, request_id: str, model: str, tokenizer,
                 tool_calls: bool = False, thinking: bool | None = None,
                 tool_names: frozenset[str] = frozenset(), tools_constrained: bool = False) -> None:
        self.generation = generation
        self.chat = chat
        self.id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.text_base: dict[int, int] = {}  # per choice: characters before the completion (an echoed prompt)
        self.sent_role: set[int] = set()
        self._special_ids = frozenset(tokenizer.all_special_ids)
        self.tool_streams: dict[int, ToolCallStream] | None = {} if tool_calls else None
        self.tool_names = tool_names  # the request's functions: a reply's calls must name one of them
        self.tools_constrained = tools_constrained  # tool_choice required or a function: the grammar holds them
        self.thinking = thinking
        self.reasoning_splits: dict[int, ReasoningSplit] = {}

    def _split_reasoning(self, index: int, text: str, last: bool) -> tuple[str, str]:
        """``(reasoning, answer)`` of a choice's new text (no reasoning parser: all answer)."""
        if self.thinking is None:
            return "", text
        split = self.reasoning_splits.setdefault(index, ReasoningSplit(self.thinking))
        reasoning, answer = split.feed(text)
        if last:
            more, tail = split.finish()
            reasoning, answer = reasoning + more, answer + tail
        return reasoning, answer

    def _split_tools(self, index: int, text: str, reason: str | None) -> tuple[str, list[dict], str | None]:
        """Content, ``tool_calls`` deltas and finish_reason of a choice's new text (tools off: as given)."""
        if self.tool_streams is None:
            return text, [], reason
        stream = self.tool_streams.get(index)
        if stream is None:
            stream = self.tool_streams[index] = ToolCallStream(self.tool_names, self.tools_constrained)
        content, deltas = stream.feed(text)
        if reason is not None:
            tail, more = stream.finish(reason)
            content, deltas = content + tail, deltas + more
            if stream.calls and reason == "stop" and not stream.open_call():  # a stop string inside a call: "stop"
                reason = "tool_calls"
        return content, deltas, reason

    def _token_str(self, token_id: int) -> str:
        return token_text(token_bytes(self.tokenizer, token_id))

    def _chat_logprobs(self, tokens: list[TokenLogprob]) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            raw = token_bytes(self.tokenizer, token_id)
            return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}
        return {"content": [entry(t.token_id, t.logprob) | {"top_logprobs": [entry(i, lp) for i, lp in t.top]}
                            for t in tokens]}

    def _top_with_own(self, t: TokenLogprob) -> dict[str, float]:
        """A completions token's ``top_logprobs``: the ``logprobs`` most likely tokens and the token itself, so up
        to ``logprobs`` + 1 entries (OpenAI's legacy API and vLLM; ``logprobs: 0`` gives the token alone)."""
        top = {self._token_str(i): lp for i, lp in t.top}
        top.setdefault(self._token_str(t.token_id), t.logprob)
        return top

    def _completion_logprobs(self, index: int, tokens: list[TokenLogprob], offsets: list[int] | None = None) -> dict:
        """Completions logprobs of ``tokens``.

        Generated tokens (``offsets`` given) carry their own offsets into the completion text (from the
        Generation, which cut the text), shifted by an echoed prompt's length. An echoed prompt (``offsets``
        None) is the prompt as given: its first token has no logprob, and its offsets count the characters its
        tokens' bytes complete.
        """
        echoed_prompt = offsets is None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        base = self.text_base.get(index, 0)
        if echoed_prompt:
            # a token holding part of a character starts where that character starts, as a reply's tokens do;
            # echoed special tokens are in the prompt text, so they count
            offsets, base = text_offsets(self.tokenizer, [t.token_id for t in tokens]), 0
        for position, t in enumerate(tokens):
            out["tokens"].append(self._token_str(t.token_id))
            out["token_logprobs"].append(None if echoed_prompt and position == 0 else t.logprob)
            out["top_logprobs"].append(None if echoed_prompt and position == 0 else self._top_with_own(t))
            out["text_offset"].append(base + offsets[position])
        return out

    def echo_prefix(self, index: int, prompt_text: str, want_logprobs: bool) -> tuple[str, dict | None]:
        """Completions ``echo``: the prompt text and, with logprobs, its tokens (the first has logprob None)."""
        self.text_base[index] = len(prompt_text)  # the completion's offsets start after the echoed prompt
        if not want_logprobs:
            return prompt_text, None
        prompt_ids = self.generation.prompt_ids(index)
        first = TokenLogprob(token_id=prompt_ids[0], logprob=0.0)
        return prompt_text, self._completion_logprobs(index, [first] + self.generation.prompt_logprobs(index))

    def chunk(self, update: ChoiceUpdate, want_logprobs: bool,
              echo: tuple[str, dict | None] | None = None) -> dict | None:
        """One streamed chunk for one choice update; None for a chat update that leaves nothing to send (its
        tokens' text held back, e.g. while a tool call's opening tag may be forming, no logprobs asked, the role
        already sent, not the last), which vLLM's streams skip too."""
        if self.chat:
            reasoning, text = self._split_reasoning(update.index, update.text, update.finish_reason is not None)
            content, tool_deltas, reason = self._split_tools(update.index, text, update.finish_reason)
            if not (content or tool_deltas or reasoning or reason or update.index not in self.sent_role
                    or (want_logprobs and update.tokens)):
                return None
            # a forced tool call (tool_choice required or named) has no content to begin: null, as OpenAI's first
            # delta of a call and the whole reply's message.content say, not "" (which a client accumulates)
            delta: dict = {"content": content or (None if self.tools_constrained else content)}
            if update.index not in self.sent_role:
                self.sent_role.add(update.index)
                delta = {"role": "assistant", "content": delta["content"]}
            if reasoning:  # both names clients read (server.reasoning)
                delta |= {"content": content or None, "reasoning_content": reasoning, "reasoning": reasoning}
            if tool_deltas:
                delta |= {"content": content or None, "tool_calls": tool_deltas}
            choice = {"index": update.index, "delta": delta, "logprobs": None, "finish_reason": reason}
            if want_logprobs and update.tokens:
                choice["logprobs"] = self._chat_logprobs(update.tokens)
            obj = "chat.completion.chunk"
        else:
            text, logprobs = update.text, None
            if want_logprobs:
                logprobs = self._completion_logprobs(update.index, update.tokens, update.offsets)
            if echo is not None:
                text = echo[0] + text
                if echo[1] is not None and logprobs is not None:
                    logprobs = {k: echo[1][k] + logprobs[k] for k in logprobs}
            choice = {"index": update.index, "text": text, "logprobs": logprobs, "finish_reason": update.finish_reason}
            obj = "text_completion"
        body = {"id": self.id, "object": obj, "created": self.generation.created, "model": self.model,
                "choices": [choice]}
        if update.finish_reason is not None:
            body["timings"] = self.generation.timings(update.index)
        return body

    def usage_chunk(self) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.generation.created, "model": self.model,
                "choices": [], "usage": self.generation.usage()}

    def full(self, texts: dict[int, str], tokens: dict[int, list[TokenLogprob]], reasons: dict[int, str],
             want_logprobs: bool, echoes: dict[int, tuple[str, dict | None]],
             offsets: dict[int, list[int]] | None = None) -> dict:
        """The non-streamed response (``offsets``: per choice, ChoiceUpdate.offsets of all its updates)."""
        choices = []
        for index in sorted(texts):
            if self.chat:
                reasoning, text = self._split_reasoning(index, texts[index], last=True)
                content, _, reason = self._split_tools(index, text, reasons[index])
                message = {"role": "assistant", "content": content}
                calls = self.tool_streams[index].calls if self.tool_streams is not None else []
                if calls:
                    message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                if self.thinking is not None:  # a reasoning parser: the fields are there, null without reasoning
                    message |= {"reasoning_content": reasoning or None, "reasoning": reasoning or None}
                    if reasoning and not content:
                        message["content"] = None
                choice = {"index": index, "message": message,
                          "logprobs": self._chat_logprobs(tokens[index]) if want_logprobs else None,
                          "finish_reason": reason}
            else:
                update = ChoiceUpdate(index=index, text=texts[index], tokens=tokens[index],
                                      offsets=(offsets or {}).get(index, []))
                chunk = self.chunk(update, want_logprobs, echoes.get(index))
                choice = chunk["choices"][0] | {"finish_reason": reasons[index]}
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.generation.created, "model": self.model, "choices": choices,
                "usage": self.generation.usage(), "timings": self.generation.timings(0)}  # first choice's
