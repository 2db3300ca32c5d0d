"""Scheduling policies (``--scheduling-policy``) with a fake model through the engine core: FCFS, priority and fair
share per tenant; and the ``priority`` field at the HTTP boundary."""

from __future__ import annotations

import httpx
import pytest

from kvserve.engine.plan import SamplingParams, SeqResult, StepPlan, TokenLogprob
from kvserve.kvcache.block_manager import BlockManager
from kvserve.scheduler.contract import EngineRequest
from kvserve.scheduler.core import EngineCore
from kvserve.scheduler.offline import run_offline
from kvserve.scheduler.scheduler import Scheduler, SchedulerConfig
from kvserve.server.config import ServeConfig
from tests.serverutil import running_server

GREEDY = SamplingParams(temperature=0.0)


def fake_execute(plan: StepPlan) -> list[SeqResult]:
    return [SeqResult(w.seq_id, [TokenLogprob(7, 0.0)] if w.sample else []) for w in plan.work]


def core(policy: str, max_num_seqs: int = 2, budget: int = 16, num_blocks: int = 256) -> EngineCore:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=4096,
                             scheduling=policy)
    return EngineCore(Scheduler(config, BlockManager(num_blocks, 4)), fake_execute, timed=False)


def request(request_id: int, prompt_len: int = 4, max_tokens: int = 6, **fields) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt_ids=list(range(1, prompt_len + 1)), params=GREEDY,
                         max_tokens=max_tokens, **fields)


# -- priority ---------------------------------------------------------------------------------------------------
def test_priority_admits_lower_values_first_and_fcfs_within_a_level():
    c = core("priority", max_num_seqs=1)
    arrivals = {0: [request(0, max_tokens=3)],  # runs first: nobody else is there yet
                1: [request(1, max_tokens=3, priority=5), request(2, max_tokens=3, priority=5),
                    request(3, max_tokens=3, priority=1)]}
    run = run_offline(c, arrivals)
    order = sorted(run.first_token_step, key=run.first_token_step.get)
    assert order == [0, 3, 1, 2]


def test_priority_preempts_a_lower_priority_to_admit_a_higher_one_and_fcfs_never_does():
    steps = {}
    for policy in ("priority", "fcfs"):
        c = core(policy, max_num_seqs=2)
        arrivals = {0: [request(i, max_tokens=40, priority=3) for i in range(2)], 5: [request(9, priority=0)]}
        run = run_offline(c, arrivals)
        steps[policy] = run.first_token_step[9] - 5
        preemptions = sum(r.preemptions for r in run.records)
        assert preemptions == (1 if policy == "priority" else 0)
        assert run.tokens[0] == run.tokens[1] == [7] * 40  # the preempted one is recomputed, its output unchanged
    assert steps["priority"] == 0   # admitted and prefilled in the step it arrived before
    assert steps["fcfs"] > 30       # behind both 40-token replies


def test_priority_never_preempts_for_an_equal_or_lower_priority():
    c = core("priority", max_num_seqs=2)
    run = run_offline(c, {0: [request(0, max_tokens=10, priority=1), request(1, max_tokens=20, priority=1)],
                          3: [request(9, priority=2), request(8, priority=1)]})
    assert sum(r.preemptions for r in run.records) == 0
    assert 10 <= run.first_token_step[8] < run.first_token_step[9]  # 8 takes the first slot freed, 9 a later one


# -- fair share per tenant --------------------------------------------------------------------------------------
def _flood_and_one(policy: str) -> int:
    """Tenant "a" sends 200 requests at once; tenant "b" sends one at step 10. Returns the steps from b's arrival
    to its first token."""
    c = core(policy, max_num_seqs=8, budget=64, num_blocks=2048)
    flood = [request(i, prompt_len=60, max_tokens=20, tenant="a") for i in range(200)]
    lone = EngineRequest(request_id=1000, prompt_ids=list(range(500, 540)), params=GREEDY, max_tokens=4, tenant="b")
    run = run_offline(c, {0: flood, 10: [lone]})
    assert all(len(run.tokens[i]) == 20 for i in range(200)) and len(run.tokens[1000]) == 4
    return run.first_token_step[1000] - 10


def test_a_tenants_flood_delays_another_tenants_single_request_by_a_step_or_two():
    assert _flood_and_one("fair") == 1  # its 40-token prompt: half the step's 64 tokens at once, the rest next step
    assert _flood_and_one("fcfs") > 100  # behind the whole flood


def test_fair_share_splits_slots_and_tokens_equally_between_waiting_tenants():
    c = core("fair", max_num_seqs=8, budget=64, num_blocks=2048)
    flood_a = [request(i, prompt_len=60, max_tokens=30, tenant="a") for i in range(40)]
    flood_b = [request(100 + i, prompt_len=60, max_tokens=30, tenant="b") for i in range(40)]
    counts = []

    def watch(step, out):
        running = c.scheduler.running
        counts.append(sorted(sum(1 for s in running if s.request.tenant == t) for t in ("a", "b")))
    plans: list[StepPlan] = []
    execute = c.execute

    def recording(plan):
        plans.append(plan)
        return execute(plan)
    c.execute = recording
    run_offline(c, {0: flood_a, 3: flood_b}, on_step=watch)
    assert counts[20] == [4, 4]  # once both wait: half the slots each
    for plan in plans[3:40]:  # while both have prompts to compute, neither takes more than half the budget
        for tenant in (range(0, 40), range(100, 140)):
            assert sum(len(w.token_ids) for w in plan.work if w.seq_id in tenant) <= 32


# -- the HTTP boundary ------------------------------------------------------------------------------------------
PATHS = {"/v1/completions": {"prompt": "Hi", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
         "/v1/responses": {"input": "Hi", "max_output_tokens": 2}}


@pytest.mark.parametrize("path", list(PATHS))
def test_a_priority_is_refused_where_the_policy_does_not_use_it(server_url, path):
    response = httpx.post(server_url + path, json=PATHS[path] | {"priority": 3}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
    assert httpx.post(server_url + path, json=PATHS[path] | {"priority": 0}, timeout=60).status_code == 200


def test_a_priority_server_takes_priorities_on_every_route(smollm2):
    with running_server(smollm2, ServeConfig(num_kv_blocks=64, scheduling_policy="priority")) as url:
        for path, body in PATHS.items():
            response = httpx.post(url + path, json=body | {"priority": -2}, timeout=60)
            assert response.status_code == 200, (path, response.text)
        refused = httpx.post(url + "/v1/completions", json=PATHS["/v1/completions"] | {"priority": 2**31}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"


def test_the_scheduling_policy_flag_reaches_the_config():
    import argparse

    from kvserve.server.serve import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).scheduling_policy.value == "fcfs"
    config = config_from_args(parser.parse_args(["--scheduling-policy", "fair"]))
    assert config.scheduling_policy.value == "fair"
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lottery"])
    with pytest.raises(ValueError, match="static"):  # the baseline's groups are formed in arrival order
        config_from_args(parser.parse_args(["--scheduler", "static", "--scheduling-policy", "fair"]))
