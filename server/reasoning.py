"""A thinking model's reasoning, returned apart from its answer: ``<think>...</think>`` -> ``reasoning_content``.

Qwen3, QwQ and DeepSeek-R1's distills write their reasoning between ``<think>`` and ``</think>`` before the answer;
their chat templates drop it from earlier assistant turns, so the template itself names ``</think>``. vLLM splits it
off with a reasoning parser chosen by a flag (``--reasoning-parser qwen3``: one parser per family); kvserve has one
parser for the ``<think>`` families and turns it on from the template (``--reasoning-parser auto``, the default:
when the template writes ``</think>``, the model was trained to think in those tags), or always (``think``), or
never (``none``).

The split, as vLLM's Qwen3 and DeepSeek-R1 parsers do it:

- the reasoning starts at the reply's start when the prompt ends inside a thinking block (the template opened
  ``<think>`` in the generation prompt: DeepSeek-R1, Qwen3.5; or an assistant prefill continued with
  ``continue_final_message`` opened one and left it open), or when the reply opens one itself (the tag is
  dropped); otherwise the reply is all answer (Qwen3 with ``enable_thinking: false``, whose template writes an
  empty block into the prompt);
- it ends at ``</think>`` (dropped, with the whitespace after it); a reply cut before that is all reasoning.

The reasoning goes out under both names clients read: ``reasoning_content`` (DeepSeek's API, llama.cpp's and
SGLang's servers, vLLM before 0.11) and ``reasoning`` (vLLM's name since). Streamed and whole replies are split by
the same ``ReasoningSplit``, so they agree by construction.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def reasoning_enabled(parser: str, templates: dict) -> bool:
    """Whether replies are split: ``parser`` is ``--reasoning-parser`` (auto, think, none); ``templates`` the
    server's chat templates (server.chat_template)."""
    if parser == "auto":
        return any(END in template.source for template in templates.values())
    return parser == "think"


def opens_thinking(prompt_text: str, continued: str | None = None) -> bool:
    """Whether a rendered prompt ends inside a thinking block: its generation prompt opened ``<think>``, or the
    assistant message it continues (``continued``: the final message's text under ``continue_final_message``)
    opened one and has not closed it (a prefill of the reasoning, ``<think>Let me``). Only the continued message
    is searched, not the whole prompt: a user's own text may hold the tags."""
    if prompt_text.rstrip().endswith(START):
        return True
    return continued is not None and continued.rfind(START) > continued.rfind(END)


def held(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (may be completed later)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ReasoningSplit:
    """Splits one choice's text, fed as it arrives, into reasoning and answer.

    Args:
        thinking: the prompt ends inside a thinking block (``opens_thinking``).
    """

    def __init__(self, thinking: bool) -> None:
        self.state = "reasoning" if thinking else "start"
        self.buffer = ""
        self.reasoning_seen = False

    def feed(self, text: str) -> tuple[str, str]:
        """Add new text; return ``(reasoning, answer)`` released by it (either may be empty)."""
        self.buffer += text
        reasoning = answer = ""
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(START):
                self.state, self.buffer = "reasoning", head[len(START):]
            elif START.startswith(head):
                return "", ""  # maybe the start of the tag: wait
            else:
                self.state = "answer"
        if self.state == "reasoning":
            end = self.buffer.find(END)
            if end < 0:
                keep = held(self.buffer, END)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                self.reasoning_seen = self.reasoning_seen or bool(reasoning)
                return reasoning, ""
            reasoning, self.buffer = self.buffer[:end], self.buffer[end + len(END):]
            self.reasoning_seen = True
            self.state = "answer_start"
        if self.state == "answer_start":  # the whitespace between </think> and the answer is neither's
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return reasoning, ""
            self.state = "answer"
        answer, self.buffer = self.buffer, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """Flush at the end: held text is reasoning in a thinking block (the reply was cut), else answer."""
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            self.reasoning_seen = self.reasoning_seen or bool(rest)
            return rest, ""
        return "", rest if self.state in ("start", "answer") else ""
