"""vLLM's render routes: a chat or completions body in, the engine request it becomes out, nothing generated.

``POST /v1/chat/completions/render`` answers one ``GenerateRequest`` and ``POST /v1/completions/render`` a list of
them, one per prompt, in vLLM's shape (its ``entrypoints/scale_out``): ``request_id``, ``token_ids`` (the prompt
exactly as the server would prefill it: same chat template, tools, ``chat_template_kwargs``, fill-in-the-middle
and tokenization, since both go through ``server.admission.prepare_request``), ``sampling_params`` under vLLM's
names, ``model``, ``stream``, ``cache_salt``, ``priority``. KV-aware routers (vllm-router's ``kv_aware``) call them
to learn a request's tokens before they choose the replica whose prefix cache holds the most of them.

A render checks the body as its generation route does (the same 400s and 404s), but queues nothing: it is never
refused for a full queue, nor by a draining server.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import BaseModel

from kvserve.server.admission import prepare_request
from kvserve.server.prepare import Prepared
from kvserve.server.schemas import ChatCompletionRequest, CompletionRequest
from kvserve.server.state import ServerState


class RenderedSamplingParams(BaseModel):
    """The sampling settings of a rendered request, under vLLM's ``SamplingParams`` names (the ones kvserve serves).

    ``max_tokens`` is the limit the server applies (a chat request without one gets ``--default-max-tokens``,
    within the context); ``stop_token_ids`` are the request's own, the model's end-of-sequence ids apart, as vLLM
    keeps them apart (``ignore_eos`` says whether those stop it).
    """

    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    max_tokens: int
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    logit_bias: dict[int, float] | None


class GenerateRequest(BaseModel):
    """One prompt of a request, rendered: what vLLM's token-in endpoint takes (``features``: no multimodal input)."""

    request_id: str
    token_ids: list[int]
    features: None = None
    sampling_params: RenderedSamplingParams
    model: str | None
    stream: bool
    stream_options: dict | None
    cache_salt: str | None
    priority: int


def _rendered(body: ChatCompletionRequest | CompletionRequest, prepared: Prepared, request_id: str) -> GenerateRequest:
    params = prepared.params
    sampling = RenderedSamplingParams(
        n=body.n, presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, min_p=params.min_p, seed=params.seed, stop=prepared.stop_strings,
        stop_token_ids=list(body.stop_token_ids), ignore_eos=body.ignore_eos, max_tokens=prepared.max_tokens,
        min_tokens=prepared.min_tokens, logprobs=params.logprobs,
        prompt_logprobs=params.logprobs if params.prompt_logprobs else None, logit_bias=params.logit_bias)
    options = body.stream_options.model_dump() if body.stream and body.stream_options is not None else None
    return GenerateRequest(request_id=request_id, token_ids=prepared.prompt_ids, sampling_params=sampling,
                           model=body.model, stream=body.stream, stream_options=options,
                           cache_salt=body.cache_salt, priority=body.priority)


def register(app: FastAPI, state: ServerState, dependencies: list) -> None:
    """Add the two render routes to ``app``, behind ``dependencies`` (the API-key check of the other /v1 routes)."""

    @app.post("/v1/chat/completions/render", dependencies=dependencies, response_model=GenerateRequest)
    async def render_chat(body: ChatCompletionRequest, request: Request) -> GenerateRequest:
        """vLLM's route: the chat request as the engine would run it (its prompt's token ids), generating nothing."""
        prepared = await prepare_request(state, body, request)
        return _rendered(body, prepared[0], "chatcmpl-" + request.state.request_id)

    @app.post("/v1/completions/render", dependencies=dependencies, response_model=list[GenerateRequest])
    async def render_completions(body: CompletionRequest, request: Request) -> list[GenerateRequest]:
        """vLLM's route: one rendered request per prompt (ids ``cmpl-<id>``, or ``cmpl-<id>-<i>`` for several)."""
        prepared = await prepare_request(state, body, request)
        base = "cmpl-" + request.state.request_id
        return [_rendered(body, one, base if len(prepared) == 1 else f"{base}-{index}")
                for index, one in enumerate(prepared)]
