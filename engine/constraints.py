"""Constrained decoding: grammars compiled by llguidance, one matcher per sequence, token masks per step.

Why llguidance (a Rust wheel without Python dependencies) rather than xgrammar or outlines-core: measured on
SmolLM2's 49,152-token vocabulary, it compiles the test schemas an order of magnitude faster than xgrammar (a
server compiles a client's schema on every cache miss, per request), its mask per token is well below a decode
step (xgrammar's is smaller still, which does not matter at these step times), its parser limits
(``LLParserLimits``) bound a pathological grammar's work, and a matcher rolls back tokens. Figures: BENCHMARKS.md,
"Structured outputs".

Who owns what: the server compiles a ``Grammar`` (off the event loop) and hands each sequence a ``Constraint``
(its own matcher); the scheduler carries it opaquely in the plan; the runner asks ``engine.masks.fill_masks``
for the allowed tokens of the constrained rows of a step and ``apply_masks`` them to the logits before sampling
(that module: the per-step side, which changes with the step loop and the sampler). A matcher
follows the sequence's accepted tokens (``SeqWork.output_ids``, the scheduler's truth): before each mask it
consumes what was appended since and rolls back what was dropped, so preemption by recompute, aborts and
rejected draft tokens need no separate bookkeeping.

A thinking model whose prompt opened its thinking block (server.reasoning) thinks first, unconstrained, as vLLM
does with a reasoning parser: its constraint starts after the block's end (``after``, the bytes of ``</think>``),
at the first token boundary past it; until then every token but EOS is allowed (a reply may not end inside its
thinking with its constraint unmet), and the budget that forces a closing path counts the tokens left after it.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import llguidance
import numpy as np

from kvserve.engine.closing import (CLOSING_SLACK, RECHECK_EVERY, START, LexState, TokenTable, advance,
                                    closing_path, only, opener_slack)
from kvserve.engine.heap import give_back

# Work bounds for one grammar (llguidance's units); a schema past them is refused, never served slowly.
_LIMITS = dict(max_grammar_size=200_000,     # symbols in the grammar's productions
               max_lexer_states=100_000,     # lexer DFA states (~1-2 kB each)
               initial_lexer_fuel=1_000_000,  # regex work while building the lexer (~50k per ms)
               step_lexer_fuel=200_000,      # lexer work per mask (~14k per ms): ~15 ms at most per token
               step_max_items=50_000)        # Earley items per mask


# compact JSON (one space after , and :), no free whitespace: a small model given room for whitespace may spend its
# tokens on newlines; the data is the same
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that cannot be served: invalid, unsupported by the engine, or past a limit."""


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    """What to constrain to, as a client sent it.

    Attributes:
        kind: ``json_schema`` (text is a JSON schema), ``regex``, ``choice`` (a JSON list of strings),
            ``lark`` (a Lark grammar, llguidance's syntax), ``gbnf`` (llama.cpp's GBNF) or ``llguidance`` (a
            ready grammar).
        text: the grammar in that kind's syntax.
        json_literals: the text it generates is JSON, or JSON inside a wrapper (a forced tool call); implied by
            ``json_schema``. Its numbers are bounded (engine.closing).
    """

    kind: str
    text: str
    json_literals: bool = False

    @property
    def is_json(self) -> bool:
        return self.kind == "json_schema" or self.json_literals


class Grammar:
    """A compiled grammar; ``constraint()`` gives each sequence its own matcher (a cheap copy)."""

    def __init__(self, pristine: llguidance.LLMatcher, vocab_size: int, eos_ids: list[int], table: TokenTable,
                 is_json: bool) -> None:
        self._pristine = pristine
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.table = table
        self.is_json = is_json

    def constraint(self, budget: int | None = None, after: bytes | None = None) -> Constraint:
        """A matcher for one sequence that may generate at most ``budget`` tokens (None: no closing path), from the
        start of its output or, with ``after``, from the first token boundary past those bytes of it (the end of
        a thinking block the prompt opened)."""
        return Constraint(self._pristine.deep_copy(), self, budget, after)


class Constraint:
    """One sequence's matcher. Opaque to the scheduler; only the engine calls its methods."""

    __slots__ = ("matcher", "vocab_size", "eos_ids", "consumed", "table", "budget", "lex", "path_len", "walked_at",
                 "slack", "forced", "forced_at", "after", "start", "thought", "tail")

    def __init__(self, matcher: llguidance.LLMatcher, grammar: Grammar, budget: int | None = None,
                 after: bytes | None = None) -> None:
        self.matcher = matcher
        self.vocab_size = grammar.vocab_size
        self.eos_ids = grammar.eos_ids  # allowed when the matcher allows nothing (an error, or EOS ignored)
        self.table = grammar.table
        self.budget = budget            # max_tokens (the server caps it at the context); None: never forced
        self.consumed: list[int] = []   # tokens the matcher has taken, in order
        # a JSON grammar's lexical state before the first token and after each consumed one (engine.closing)
        self.lex: list[LexState] | None = [START] if grammar.is_json else None
        self.path_len: int | None = None  # the closing path's length at the last walk; None: not walked
        self.walked_at = 0                # tokens consumed at the last walk
        self.slack = CLOSING_SLACK        # room kept beyond the path at the last walk (engine.closing.opener_slack)
        self.forced: list[int] | None = None  # the closing path being forced, from token ``forced_at`` on
        self.forced_at = 0
        self.after = after                # the grammar starts past these output bytes (a thinking block's end)
        self.start: int | None = None if after else 0  # the output index it starts at; None: still thinking
        self.thought: list[int] = []      # output tokens scanned for ``after``, up to ``start``
        self.tail = b""                   # their last bytes, where ``after`` may begin

    @property
    def thinking(self) -> bool:
        """Whether the sequence is still inside its thinking block: unconstrained but for EOS."""
        return self.start is None

    def allow_thinking(self, bits: np.ndarray) -> None:
        """Set ``bits`` (``[words]`` uint32, in place) to every token of the vocabulary but EOS."""
        bits[:] = np.uint32(0xFFFFFFFF)
        if self.vocab_size % 32:
            bits[-1] = np.uint32((1 << (self.vocab_size % 32)) - 1)
        for eos in self.eos_ids:
            if eos < self.vocab_size:  # a generation config's id past the tokenizer's vocabulary has no bit
                bits[eos // 32] &= ~np.uint32(1 << (eos % 32))

    def allowed_now(self, bits: np.ndarray) -> None:
        """Narrow this sequence's allowed tokens ``bits`` (``[words]`` uint32, in place) by the bounds on JSON
        numbers, and to the closing path's next token once the tokens left come down to the path's length plus
        the slack (engine.closing); from then on to that path's tokens in turn, to its EOS."""
        state = self.lex[-1] if self.lex is not None else None
        if state is not None:
            ban = self.table.digit_ban(state)
            if ban is not None:
                bits &= ~ban
        if self.budget is None:
            return
        if self.forced is not None:  # the path's walk is deterministic: once forced, it is followed to its end
            bits[:] = only(self.forced[min(len(self.consumed) - self.forced_at, len(self.forced) - 1)], bits.size)
            return
        left = self.budget - self.start - len(self.consumed)
        if self.path_len is not None and not self._walk_due(left):
            return
        path = closing_path(self.matcher, state, self.table, left)
        self.path_len, self.walked_at = (len(path) if path is not None else left + 1), len(self.consumed)
        if path is None:
            return
        # the slack is walked only near the point of forcing, where it decides
        near = left <= len(path) + self.slack + RECHECK_EVERY
        self.slack = opener_slack(self.matcher, state, self.table, path, left) if near else CLOSING_SLACK
        if left <= len(path) + self.slack:
            self.forced, self.forced_at = path, len(self.consumed)
            bits[:] = only(path[0], bits.size)

    def _walk_due(self, left: int) -> bool:
        """Whether the closing path must be walked again now (engine.closing: when it is walked): a quarter of the
        way to where the path would be forced, at most RECHECK_EVERY tokens, every step near it; a walk that
        found no path within the tokens left, on the same schedule as a far one."""
        gap = left - self.path_len - self.slack
        if self.path_len > left + len(self.consumed) - self.walked_at:  # it did not fit when walked
            gap = left
        return len(self.consumed) - self.walked_at >= max(1, min(RECHECK_EVERY, gap // 4))

    def sync(self, output_ids: list[int]) -> None:
        """Bring the matcher to the state after ``output_ids``: roll back tokens no longer there (preemption,
        rejected drafts), then consume the new ones. A token the grammar refuses puts the matcher in its error
        state, whose mask allows only EOS. With ``after``, only the tokens past the thinking block's end count."""
        if self.after is not None:
            if self.start is not None and output_ids[:self.start] != self.thought:  # its end was rolled back
                self._roll_back_to(0)
                self.start = None
            if self.start is None:
                self._find_start(output_ids)
                if self.start is None:
                    return
            output_ids = output_ids[self.start:]
        common = len(self.consumed)
        if output_ids[:common] != self.consumed:  # tokens dropped (one C-level compare in the usual step)
            common = next((i for i, (mine, theirs) in enumerate(zip(self.consumed, output_ids)) if mine != theirs),
                          min(len(self.consumed), len(output_ids)))
        if common < len(self.consumed):
            common = self._roll_back_to(common)
        for token in output_ids[common:]:
            self.matcher.consume_token(token)
            self.consumed.append(token)
            if self.lex is not None:
                self.lex.append(advance(self.lex[-1], self.table.token_bytes[token]))

    def _roll_back_to(self, common: int) -> int:
        """The matcher back to its state after ``consumed[:common]`` (to its start where it cannot roll back that
        far); returns how many tokens it keeps."""
        if not self.matcher.rollback(len(self.consumed) - common):
            self.matcher.reset()
            common = 0
        del self.consumed[common:]
        # walk again from the state rolled back to
        self.path_len, self.slack, self.forced = None, CLOSING_SLACK, None
        if self.lex is not None:
            del self.lex[common + 1:]
        return common

    def _find_start(self, output_ids: list[int]) -> None:
        """Scan ``output_ids`` (from where the last scan stopped, or again where they were rolled back) for the
        bytes ``after``; ``start`` is set just past the token that completes them."""
        if output_ids[:len(self.thought)] != self.thought:
            self.thought.clear()
            self.tail = b""
        keep = len(self.after) - 1
        for token in output_ids[len(self.thought):]:
            self.thought.append(token)
            self.tail += self.table.token_bytes[token]
            if self.after in self.tail:
                self.start = len(self.thought)
                return
            self.tail = self.tail[-keep:] if keep else b""


class Constraints:
    """The grammar matchers of structured-output sequences, by sequence id: the constraint plug-in the runner
    consults each step (the scheduler never sees a matcher).

    Whoever admits a request with a grammar ``add``s its matcher before the request runs and ``pop``s it once the
    request has ended (the server: its verdict, ``unsatisfied``, is read after the end). Adding and removing happen
    on the event loop while a step may run on the engine thread; each is one dict operation, and a step only reads
    the matchers of sequences in its plan, which are neither new nor ended.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, Constraint] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, seq_id: int, constraint: Constraint) -> None:
        self._by_id[seq_id] = constraint

    def get(self, seq_id: int) -> Constraint | None:
        return self._by_id.get(seq_id)

    def pop(self, seq_id: int) -> Constraint | None:
        return self._by_id.pop(seq_id, None)

    def of(self, plan) -> dict[int, Constraint]:
        """``{seq_id: matcher}`` of the sampling sequences of ``plan`` (an ``engine.plan.StepPlan``) that have one,
        in plan order."""
        if not self._by_id:
            return {}
        return {w.seq_id: c for w in plan.work if w.sample and (c := self._by_id.get(w.seq_id)) is not None}


class GrammarCompiler:
    """Compiles grammars for one tokenizer, caching compiled ones by spec (LRU).

    Thread-safe; meant to run on a worker thread (compiling takes milliseconds to, for a huge schema, about a
    second). The llguidance tokenizer is built on first use (~1-4 s for a 49k vocabulary).

    With a ``sandbox`` (engine.compile_worker.CompileSandbox, as the server passes), a grammar not seen before is
    first compiled in a worker process, up to its first mask, and only then in this one: llguidance is native
    code, and an input that crashes it (a segmentation fault was found with integer bounds near -2^63) then ends
    the worker, not the server.

    Args:
        hf_tokenizer: the served model's (fast) transformers tokenizer.
        eos_ids: tokens that end a sequence; a finished grammar allows only these.
        cache_size: compiled grammars kept.
        sandbox: what compiles a new grammar first, elsewhere (its ``check(spec)`` raises GrammarError), or None.
    """

    def __init__(self, hf_tokenizer, eos_ids: list[int], cache_size: int = 256, sandbox=None) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._eos_ids = sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._table: TokenTable | None = None
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self.vocab_size = len(hf_tokenizer)
        self._sandbox = sandbox

    def tokenizer(self) -> llguidance.LLTokenizer:
        # built once, under a lock of its own: the cache's lock, which the event loop takes (cached), is held only
        # to publish the tokenizer and its table together
        with self._build_lock:
            if self._tokenizer is None:
                eos = self._eos_ids or self._hf_tokenizer.eos_token_id
                tokenizer = llguidance.LLTokenizer(tokenizer_json(self._hf_tokenizer, self._eos_ids),
                                                   n_vocab=self.vocab_size, eos_token=eos)
                table = TokenTable(tokenizer, self.vocab_size, self._closing_eos())
                with self._lock:
                    self._tokenizer, self._table = tokenizer, table
                give_back()  # the JSON text and its parse's transients, not kept
            return self._tokenizer


    def warm(self) -> None:
        """Do the one-time work before the first compile: build the tokenizer and its token table, and start the
        sandbox's worker (server.structured times each compile without them).

        Raises:
            GrammarError: the sandbox's worker did not start.
        """
        self.tokenizer()
        if self._sandbox is not None:
            self._sandbox.start()

    def _closing_eos(self) -> int:
        """The EOS a closed reply ends with: the tokenizer's own when it is among the stop tokens."""
        eos = self._hf_tokenizer.eos_token_id
        return eos if eos in self._eos_ids or not self._eos_ids else self._eos_ids[0]

    def cached(self, spec: GrammarSpec) -> Grammar | None:
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
            return grammar

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar of ``spec``, from the cache or compiled now.

        Raises:
            GrammarError: an invalid grammar, a feature llguidance does not implement (the message names it),
                or a grammar past the work limits.
        """
        grammar = self.cached(spec)
        if grammar is not None:
            return grammar
        tokenizer = self.tokenizer()
        if self._sandbox is not None:
            self._sandbox.check(spec)
        matcher = compiled(tokenizer, spec)
        grammar = Grammar(matcher, self.vocab_size, self._eos_ids or [self._hf_tokenizer.eos_token_id], self._table,
                          spec.is_json)
        with self._lock:
            self._cache[spec] = grammar
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar


def compiled(tokenizer: llguidance.LLTokenizer, spec: GrammarSpec) -> llguidance.LLMatcher:
    """A matcher for ``spec`` in its start state, checked to admit some output.

    Raises:
        GrammarError: invalid, unsupported, past the work limits, or admitting no output.
    """
    try:
        text = _grammar_text(spec)
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from exc
    limits = llguidance.LLParserLimits(**_LIMITS, verbose_errors=False)
    matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=limits)
    if matcher.is_error():
        raise GrammarError(_short(matcher.get_error()))
    _check_has_output(matcher)
    return matcher


def tokenizer_json(hf_tokenizer, stop_ids: Iterable[int] = ()) -> str:
    """The fast tokenizer serialized for llguidance: as ``llguidance.hf.from_tokenizer`` serializes it (padding
    and truncation off), with the tags that are text (``plain_tags``; not ``stop_ids``, the tokens that end a
    reply) read as text. from_tokenizer copies the Rust tokenizer first, a second one held while it serializes
    (~45 MiB of a 128k vocabulary): here only where padding or truncation is on, to turn them off in the copy."""
    backend = hf_tokenizer.backend_tokenizer
    if backend.padding is not None or backend.truncation is not None:
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
    return _tags_as_text(backend.to_str(), plain_tags(hf_tokenizer, stop_ids))


# an added token llguidance would take for a control token by its shape alone: <...>, printable ASCII, no space;
# not <|...|>, the shape llama.cpp's converter takes for a control token's (its does_token_look_special)
_TAG = re.compile(r"<[!-~]+>")


def plain_tags(hf_tokenizer, stop_ids: Iterable[int] = ()) -> dict[int, str]:
    """The added tokens that are text, not control tokens (``special`` false, none of the tokenizer's special
    tokens or ``stop_ids``), shaped like a tag but not like a control token (``<think>``, not ``<|im_end|>``):
    ``{id: text}``.

    Qwen2.5's and Qwen3's ``<tool_call>``, ``</tool_call>``, ``<think>`` and ``</think>`` are such tokens (in their
    GGUF files, llama.cpp's converter marks them USER_DEFINED; in their tokenizer.json, ``special: false``): the
    model writes them as text, one token each. llguidance (toktrie_hf_tokenizers, 1.x) takes every added token of
    the form ``<...>`` for a special token, whose bytes no grammar's text matches: its mask then allowed the token
    where a grammar's literal ``"<tool_call>"`` stood, while consuming it failed the grammar, so a forced tool call
    on these files ended in an error at its first token.
    """
    control = {*hf_tokenizer.all_special_ids, *stop_ids}
    return {i: t.content for i, t in hf_tokenizer.added_tokens_decoder.items()
            if not t.special and i not in control and _TAG.fullmatch(t.content)
            and not (t.content.startswith("<|") and t.content.endswith("|>"))}


def _tags_as_text(text: str, tags: dict[int, str]) -> str:
    """The tokenizer JSON ``text`` with ``tags`` (``plain_tags``) moved from its added tokens into its BPE
    vocabulary under the same ids (a GGUF file's converted vocabulary holds them there already), so llguidance
    reads each as the bytes of its text. Their characters are printable ASCII, which byte-level and SentencePiece
    vocabularies both spell as themselves. Every added token that stays gets a vocabulary entry under its own id
    too: the tokenizers library numbers an added token missing from the vocabulary from the vocabulary's size on,
    so a tag moved from below it (Qwen's own tokenizer.json: its special tokens 151643-151656, <tool_call> at
    151657, more after it) would leave it a gap to be renumbered into. Left as they are where the model is not a
    BPE one, or for a tag whose text the vocabulary holds under another id."""
    if not tags:
        return text
    data = json.loads(text)
    model = data.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict):
        return text
    moved = {i: t for i, t in tags.items() if vocab.get(t, i) == i}
    data["added_tokens"] = [t for t in data.get("added_tokens", []) if t.get("id") not in moved]
    vocab.update({t: i for i, t in moved.items()})
    for token in data["added_tokens"]:
        vocab.setdefault(token["content"], token["id"])
    return json.dumps(data, ensure_ascii=False)


def _check_has_output(matcher: llguidance.LLMatcher) -> None:
    """Refuse a grammar that admits no text at all (an empty class such as ``[^\\s\\S]``, a ``$ref`` to itself, a
    rule with only a left-recursive alternative): llguidance builds it, and its first mask is an error. Served,
    such a reply would be empty and would end at once.

    Raises:
        GrammarError: naming why (llguidance's reason).
    """
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if probe.is_error() and not matcher.is_accepting():
        raise GrammarError(f"the grammar admits no output at all ({_short(probe.get_error())})")


def unsatisfied(constraint: Constraint) -> str | None:
    """Why the reply a sequence ended with does not satisfy its grammar, or None when it does: its matcher, synced
    to every token but the last (the stop token, which no mask after it consumed), is not in an accepting state.
    It happens where the grammar left no token to sample (a mask that was an error, such as a work limit hit
    mid-reply): ``fill_masks`` then allows EOS so that the sequence ends.
    """
    if constraint.thinking:  # a client's own stop token while thinking (EOS is not allowed there): nothing began
        return None
    matcher = constraint.matcher
    if matcher.is_accepting():
        return None
    reason = _short(matcher.get_error()) if matcher.is_error() else "the grammar allowed no further token"
    return f"the reply stops short of its constraint after {len(constraint.consumed)} tokens: {reason}"


def _grammar_text(spec: GrammarSpec) -> str:
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_OPTIONS)
    if spec.kind == "choice":
        choices = json.loads(spec.text)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("a choice list must be a non-empty list of strings")
    return llguidance.grammar_from(spec.kind, spec.text)


def _short(error: str) -> str:
    """llguidance's error without the parser-state dump it may append. A regex error comes over several lines
    (``regex parse error:``, the pattern, a caret line, ``error: <why>``): its pattern and reason are kept."""
    lines = [line.strip() for line in error.split("\n")]
    why = next((line for line in lines[1:] if line.startswith("error:")), None)
    if lines[0].endswith(":") and why is not None:
        return f"{lines[0]} {lines[1]}: {why.removeprefix('error:').strip()}"
    return lines[0]
