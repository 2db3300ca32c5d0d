"""lm-eval's ``local-completions`` model, unmodified, against a live kvserve with ``--batch_size 4``.

Batched, lm-eval sends several prompts per completions request (lists of token ids with echo and logprobs
for loglikelihoods, lists of strings for generation) and detects the tokenizer from ``/tokenizer_info``.
A four-document task on local data (tests/data/lm_eval/) keeps this to seconds; no network is used.
Skips when lm-eval is not installed (``pip install -e .[test]`` installs it).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import httpx
import pytest

DATA = Path(__file__).resolve().parent / "data" / "lm_eval"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, monkeypatch_module):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e .[test])")
    from lm_eval.tasks import TaskManager

    for offline in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # local data only: never the hub
        monkeypatch_module.setenv(offline, "1")
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for task in ("kvserve_tiny_mc.yaml", "kvserve_tiny_gen.yaml"):
        text = (DATA / task).read_text().replace("DATA_FILE", str(DATA / "kvserve_tiny.jsonl"))
        (folder / task).write_text(text)
    return TaskManager(include_path=str(folder), include_defaults=False)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def evaluate(server_url: str, tasks, names: list[str], batch_size: int) -> dict:
    from lm_eval import simple_evaluate

    model_args = (f"model={MODEL},base_url={server_url}/v1/completions,num_concurrent=1,max_retries=1,"
                  "tokenized_requests=True")
    return simple_evaluate(model="local-completions", model_args=model_args, tasks=names, task_manager=tasks,
                           batch_size=batch_size, log_samples=True, random_seed=0, numpy_random_seed=0,
                           torch_random_seed=0, fewshot_random_seed=0)


def loglikelihoods(results: dict) -> list[list[float]]:
    """Per document, the loglikelihood of each choice (lm-eval's ``resps``: [[(ll, is_greedy)], ...])."""
    return [[resp[0][0] for resp in sample["resps"]] for sample in results["samples"]["kvserve_tiny_mc"]]


def test_lm_eval_batched_matches_unbatched(server_url, tasks, caplog):
    caplog.set_level(logging.INFO, logger="kvserve.requests")
    batched = evaluate(server_url, tasks, ["kvserve_tiny_mc", "kvserve_tiny_gen"], batch_size=4)
    posts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("POST /v1/completions 200")]
    # 16 loglikelihoods in 4 requests and 4 generations in 1: several prompts per request, all served
    assert len(posts) == 5, posts
    print("lm-eval --batch_size 4:", {task: {k: v for k, v in metrics.items() if isinstance(v, float)}
                                      for task, metrics in batched["results"].items()})
    accuracy = batched["results"]["kvserve_tiny_mc"]["acc,none"]
    exact = batched["results"]["kvserve_tiny_gen"]["exact_match,none"]
    assert 0.0 <= accuracy <= 1.0 and 0.0 <= exact <= 1.0
    # each batched generation is what the prompt gives alone (the model ends some answers at once: EOS)
    generated = []
    for sample in batched["samples"]["kvserve_tiny_gen"]:
        prompt = f"Question: {sample['doc']['question']}\nAnswer:"
        alone = httpx.post(server_url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": ["Question:"]}).json()["choices"][0]["text"]
        assert sample["resps"][0][0] == alone
        generated.append(alone)
    assert sum(bool(text.strip()) for text in generated) >= 2, generated
    single = evaluate(server_url, tasks, ["kvserve_tiny_mc"], batch_size=1)
    for many, one in zip(loglikelihoods(batched), loglikelihoods(single), strict=True):
        assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) and a < 0 for a, b in zip(many, one))
    assert single["results"]["kvserve_tiny_mc"]["acc,none"] == accuracy
