"""The live page: its snapshot's parts, its routes and their security, and what a person sees in a real browser.

The browser tests drive Debian's chromium headless through Playwright (scripts/ci_system_deps.sh installs it);
they skip, with the reason, where either cannot be had. ``KVSERVE_UI_SCREENSHOTS=DIR`` keeps their screenshots
(docs/img holds those of docs/ui.md).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import types
from pathlib import Path

import httpx
import pytest

from kvserve.engine.plan import SamplingParams, TokenLogprob
from kvserve.kvcache.block_manager import BlockManager, BlockState, block_state
from kvserve.scheduler.contract import EngineRequest, FinishReason, RequestOutput, StepOutput, StepRecord
from kvserve.server.config import ServeConfig
from kvserve.server.livepage import CSP, load_assets
from kvserve.server.snapshot import RATE_MIN_STEPS, RATE_READINGS, SLOW_PARTS_S, LiveView, SlotBoard, SnapshotHub, \
    StepBar, StepTrace, counter_value, histogram
from tests.serverutil import running_server

CHAT = "/v1/chat/completions"
SECRET_WORD = "Quetzalcoatlus"  # a prompt word that must never appear in the event stream


# -- the snapshot's parts, without a model ----------------------------------------------------------------------

def test_block_states_tell_free_used_shared_and_cached():
    live = LiveView(num_blocks=6)
    blocks = BlockManager(num_blocks=6, block_size=2, observer=live.blocks)
    tokens = [1, 2, 3, 4, 5]
    first: list[int] = []
    assert blocks.allocate(first, 5)                     # blocks 0, 1, 2
    blocks.cache_full_blocks(first, tokens, 5, [])      # 0 and 1 are full: hashed
    second: list[int] = []
    assert blocks.allocate(second, 5, blocks.find_cached_prefix(tokens))  # shares 0 and 1, takes 3
    assert second == [0, 1, 3]
    assert live.blocks.digits() == "221100"
    blocks.free(first)
    assert live.blocks.digits() == "110100"  # block 2 held only the first's partial tail
    blocks.free(second)
    assert live.blocks.digits() == "330000"  # 0 and 1 keep their hashes: cached but free
    assert [block_state(r, c) for r, c in ((0, False), (1, True), (3, False), (0, True))] == [
        BlockState.FREE, BlockState.USED, BlockState.SHARED, BlockState.CACHED]


def test_slots_follow_each_phase_from_the_outputs_alone():
    board = SlotBoard()
    board.submitted([EngineRequest(request_id=7, prompt_ids=list(range(10)), params=SamplingParams(), max_tokens=16)])
    states = [board.rows(32)[0]["state"]]                                  # waiting
    token = TokenLogprob(5, -0.1)
    for output in (RequestOutput(7, num_computed_tokens=4, new_block_ids=[3]),           # chunked prefill: 6 to go
                   RequestOutput(7, tokens=[token], num_computed_tokens=10, new_block_ids=[4, 9]),  # prompt in
                   RequestOutput(7, preempted=True),                                      # blocks taken back
                   RequestOutput(7, tokens=[token], num_computed_tokens=11, new_block_ids=[2, 6]),  # recomputed
                   RequestOutput(7, tokens=[token], num_computed_tokens=12, num_draft_tokens=2,
                                 num_accepted_tokens=1)):
        board.stepped(StepOutput([output]))
        states.append(board.rows(32)[0]["state"])
    assert states == ["waiting", "prefill", "decode", "preempted", "decode", "decode"]
    assert board.rows(32) == [{"id": 7, "state": "decode", "prompt": 10, "generated": 3, "cached": 0, "drafted": 2,
                               "accepted": 1, "preemptions": 1, "blocks": [2, 6]}]
    board.stepped(StepOutput([RequestOutput(7, finish_reason=FinishReason.LENGTH)]))
    assert board.rows(32) == []


def _record(index: int, prefill: int = 20, decode: int = 2, draft: int = 3, seconds: float = 0.0125) -> StepRecord:
    return StepRecord(index=index, rows=3, prefills=1, prefill_tokens=prefill, prompt_tokens=prefill,
                      decode_tokens=decode, draft_tokens=draft, accepted_tokens=0, generated_tokens=2, max_context=9,
                      seconds=seconds, started=0.0, ended=0.0, preemptions=0, prefix_queries=0, prefix_hits=0,
                      running=3, waiting=0, blocks_used=0, blocks_free=0, blocks_cached=0)


def test_a_step_bar_splits_prefill_decode_and_draft_tokens():
    assert StepBar.of(_record(3)) == StepBar(n=3, prefill=20, decode=2, draft=3, ms=12.5, rows=3)
    trace = StepTrace(size=2)
    for index in range(1, 4):
        trace.record(_record(index))
    assert [r.n for r in trace.steps] == [2, 3] and trace.count == 3


def test_histograms_count_per_bucket_and_counters_read_their_total():
    from prometheus_client import CollectorRegistry, Counter, Histogram

    hist = Histogram("h", "h", buckets=(0.1, 0.5), registry=CollectorRegistry())
    for value in (0.05, 0.07, 0.3, 2.0):
        hist.observe(value)
    assert histogram(hist) == {"le": ["0.1", "0.5", "+Inf"], "counts": [2, 1, 1]}
    refused = Counter("r", "r", ["reason"], registry=CollectorRegistry())
    refused.labels(reason="queue_full").inc(3)
    assert counter_value(refused, reason="queue_full") == 3


def test_the_hub_builds_at_most_once_per_interval():
    class Counting(SnapshotHub):
        builds = 0

        def build(self, now: float) -> dict:
            Counting.builds += 1
            return {"n": Counting.builds}

    hub = Counting(service=None, metrics=None, live=LiveView(1), info={}, min_interval_s=60)
    assert [hub.latest() for _ in range(5)] == ['{"n":1}'] * 5
    hub.min_interval_s = 0
    assert hub.latest() == '{"n":2}'


def test_the_histograms_and_totals_are_read_once_a_second_and_the_rest_every_build():
    """Reading Prometheus histograms costs as much as the rest of a snapshot: they and the totals are rebuilt
    every SLOW_PARTS_S, while slots, blocks and steps are read at each build."""
    class Counting(SnapshotHub):
        slow = 0

        def slow_parts(self, now: float) -> dict:
            Counting.slow += 1
            return {"totals": {"n": Counting.slow}}

    live = LiveView(5)
    blocks = BlockManager(num_blocks=5, block_size=1, observer=live.blocks)
    hub = Counting(service=types.SimpleNamespace(queued=0), metrics=None, live=live, info={})
    seen, table = [], []
    for tokens, now in enumerate((100.0, 100.4, 100.9, 100.0 + SLOW_PARTS_S, 100.5 + SLOW_PARTS_S), start=1):
        assert blocks.allocate(table, tokens)
        snap = hub.build(now)
        seen.append((snap["totals"]["n"], snap["blocks"]))
    assert seen == [(1, "10000"), (1, "11000"), (1, "11100"), (2, "11110"), (2, "11111")]


def test_tokens_per_s_spans_several_steps_so_a_long_step_never_reads_zero():
    """Under load on 2 cores a step of 32 sequences can take 3 s: over a 2 s window alone the tile read 0.0 between
    two steps. The window spans RATE_MIN_STEPS steps too, so it reads the rate the steps make; idle, it reads 0 and
    stays 0 (an idle server's snapshot stops changing); the readings kept are bounded."""
    stats = types.SimpleNamespace(generation_tokens=0, steps=0)
    hub = SnapshotHub(service=types.SimpleNamespace(totals=stats), metrics=None, live=LiveView(1), info={})
    rates = []
    for second in range(60):  # one reading a second, as slow_parts is called; a 32-token step every 3 s
        if second % 3 == 0:
            stats.steps += 1
            stats.generation_tokens += 32
        rates.append(hub.tokens_per_s(float(second)))
    loaded = rates[3 * RATE_MIN_STEPS:]
    assert min(loaded) >= 32 / 3 * 0.8 and max(loaded) <= 32 / 3 * 1.3, loaded  # about 10.7 tokens/s, never 0
    assert [hub.tokens_per_s(float(second), idle=True) for second in range(60, 65)] == [0.0] * 5
    for second in range(65, 65 + 2 * RATE_READINGS):  # steps so long that none ends within the run
        hub.tokens_per_s(float(second))
    assert len(hub._tokens) == RATE_READINGS


def test_a_snapshot_carries_the_steps_of_the_last_three_builds_not_the_whole_ring():
    live = LiveView(1)
    hub = SnapshotHub(service=types.SimpleNamespace(queued=0), metrics=None, live=live, info={})
    hub.slow_parts = lambda now: {}
    shown = []
    for build, new_steps in enumerate([5, 2, 3, 4, 1, 0]):
        for _ in range(new_steps):
            live.steps.record(_record(live.steps.count + 1))
        shown.append([row[0] for row in hub.build(float(build))["steps"]])
    # the first three builds carry the whole ring (5, 7, 10 steps), then the steps after the count three builds ago
    assert shown == [[1, 2, 3, 4, 5], list(range(1, 8)), list(range(1, 11)), list(range(6, 15)),
                     list(range(8, 16)), list(range(11, 16))]


def test_every_asset_is_in_the_package_and_the_page_loads_only_them():
    assets = load_assets()
    assert {"index.html", "app.js", "client.js", "charts.js", "playground.js", "style.css", "vendor/uPlot.iife.min.js",
            "vendor/uPlot.min.css"} == set(assets)
    html = assets["index.html"][0].decode()
    referenced = {part.split('"')[0].removeprefix("/ui/static/") for part in html.split('="/ui/static/')[1:]}
    assert referenced == set(assets) - {"index.html"}
    assert "http" not in html.replace("http-equiv", "")  # no CDN, no other origin
    assert "<script>" not in html and "style=" not in html  # nothing inline: the CSP allows none


# -- the routes, on a live server ---------------------------------------------------------------------------------

def _first_event(url: str, headers: dict | None = None, timeout_s: float = 10) -> dict:
    with httpx.stream("GET", url + "/ui/events", headers=headers or {}, timeout=timeout_s) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                return json.loads(line[len("data: "):])
    raise AssertionError("no event")


@pytest.fixture(scope="module")
def keyed_url(smollm2):
    with running_server(smollm2, ServeConfig(num_kv_blocks=64, max_num_seqs=8, api_key="sekrit")) as url:
        yield url


def test_the_page_and_its_assets_carry_a_strict_csp(server_url):
    for path in ("/", "/ui"):
        response = httpx.get(server_url + path)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
        assert response.headers["content-security-policy"] == CSP
        assert "script-src 'self';" in CSP and "unsafe" not in CSP and "frame-ancestors 'none'" in CSP
        assert response.headers["x-content-type-options"] == "nosniff"
        assert 'id="keyprompt"' in response.text
    script = httpx.get(server_url + "/ui/static/vendor/uPlot.iife.min.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert script.text.startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")


@pytest.mark.parametrize("path", ["/ui/static/nope.js", "/ui/static/../livepage.py", "/ui/static/%2e%2e/app.py",
                                  "/ui/static/vendor/README.txt"])
def test_only_the_listed_assets_are_served(server_url, path):
    response = httpx.get(server_url + path)
    assert response.status_code == 404
    assert response.json()["error"]["code"] in ("not_found", None)


def test_the_snapshot_describes_the_server(server_url):
    snap = _first_event(server_url)
    assert snap["info"]["block_size"] == 16 and snap["info"]["max_num_seqs"] == 32
    assert len(snap["blocks"]) == snap["info"]["num_blocks"] and set(snap["blocks"]) <= set("0123")
    assert set(snap) == {"info", "slots", "queue", "blocks", "steps", "totals", "tokens_per_s", "ttft", "itl"}


def test_the_event_stream_needs_the_key_and_the_page_does_not(keyed_url):
    assert httpx.get(keyed_url + "/").status_code == 200  # the page only asks for the key
    assert httpx.get(keyed_url + "/ui/events").status_code == 401
    assert httpx.get(keyed_url + "/ui/events", headers={"Authorization": "Bearer wrong"}).status_code == 401
    snap = _first_event(keyed_url, {"Authorization": "Bearer sekrit"})
    assert snap["info"]["auth"] is True


def test_the_host_guard_covers_the_page(server_url):
    for path in ("/", "/ui/events", "/ui/static/app.js"):
        response = httpx.get(server_url + path, headers={"Host": "evil.example"})
        assert response.status_code == 421, path


def test_no_ui_turns_it_off(smollm2):
    with running_server(smollm2, ServeConfig(num_kv_blocks=16, ui=False)) as url:
        for path in ("/", "/ui", "/ui/events", "/ui/static/app.js"):
            assert httpx.get(url + path).status_code == 404, path


def test_the_stream_shows_counts_never_text(server_url):
    """While a request runs, the stream shows its slot and counts, and none of its prompt or output."""
    body = {"messages": [{"role": "user", "content": f"Describe {SECRET_WORD}."}], "max_tokens": 24,
            "temperature": 0, "ignore_eos": True}
    result: dict = {}
    chat = threading.Thread(target=lambda: result.update(reply=httpx.post(server_url + CHAT, json=body, timeout=120)))
    events: list[str] = []
    with httpx.stream("GET", server_url + "/ui/events", timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line)
            snap = json.loads(line[len("data: "):])
            if len(events) == 1:
                start = snap["totals"]["generation_tokens"]
                chat.start()
            elif not snap["slots"] and snap["totals"]["generation_tokens"] >= start + 24:
                break  # the request has finished, as the scheduler sees it
    chat.join(timeout=60)
    snaps = [json.loads(line[len("data: "):]) for line in events]
    rows = [row for s in snaps for row in s["slots"]]
    assert rows and max(row["generated"] for row in rows) > 0
    assert {row["prompt"] for row in rows} == {result["reply"].json()["usage"]["prompt_tokens"]}
    text = result["reply"].json()["choices"][0]["message"]["content"]
    stream = "".join(events)
    assert SECRET_WORD not in stream and text.strip() and text.strip()[:12] not in stream


# -- in a real browser --------------------------------------------------------------------------------------------

def _chromium() -> str:
    path = os.environ.get("KVSERVE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no chromium on this machine (scripts/ci_system_deps.sh installs Debian's)")
    return path


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install .[test])")
    executable = _chromium()
    with sync_api.sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(executable_path=executable, headless=True,
                                                 args=["--no-sandbox", "--disable-gpu"])
        except Exception as exc:  # a chromium that cannot start here (no sandbox support, missing libraries)
            pytest.skip(f"chromium at {executable} does not start: {exc}")
        yield browser
        browser.close()


@pytest.fixture()
def page(browser):
    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    page = context.new_page()
    page.csp_errors = []
    page.on("console", lambda m: page.csp_errors.append(m.text) if "Content Security Policy" in m.text else None)
    yield page
    context.close()


def _screenshot(page, name: str) -> None:
    folder = os.environ.get("KVSERVE_UI_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / name), full_page=True)


def _number(page, element_id: str) -> int:
    return int(page.text_content(f"#{element_id}"))


def _load(url: str, prompts: list[tuple[str, int, int]]) -> threading.Thread:
    """Send streamed chats (prompt, max_tokens, n) at once through the public API, each on its own thread."""
    def one(prompt: str, max_tokens: int, n: int) -> None:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "n": n,
                "temperature": 0.8, "seed": 1, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + CHAT, json=body, timeout=300) as response:
            assert response.status_code == 200
            for _ in response.iter_lines():
                pass

    threads = [threading.Thread(target=one, args=p, daemon=True) for p in prompts]

    def run_all() -> None:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    runner = threading.Thread(target=run_all, daemon=True)
    runner.start()
    return runner


SHARED_PROMPT = ("You are a careful assistant. Answer in plain words, give one example, and keep it short. " * 3
                 + "Question: what is a paged KV cache?")


@pytest.fixture(scope="module")
def live_url(smollm2):
    with running_server(smollm2, ServeConfig(num_kv_blocks=160, max_num_seqs=8)) as url:
        yield url


def test_the_page_shows_slots_blocks_sharing_and_steps_under_load(live_url, page):
    page.goto(live_url + "/")
    page.wait_for_selector("#main", state="visible")
    assert page.is_hidden("#keyprompt")
    page.wait_for_function("() => document.getElementById('conn').textContent === 'live'")
    assert _number(page, "count-used") == 0
    _assert_idle(page)
    load = _load(live_url, [(f"Tell me a story about the number {i}.", 40, 1) for i in range(5)]
                 + [(SHARED_PROMPT, 48, 2)])  # n=2: the second choice shares the first's prompt blocks
    page.wait_for_function("() => document.querySelectorAll('#slots tbody tr[data-state=decode]').length >= 3",
                           timeout=120_000)
    page.wait_for_function("() => Number(document.getElementById('count-shared').textContent) > 0", timeout=120_000)
    # one read of the page (a snapshot may arrive between two reads): the counts and the grid agree
    used, shared, orange = page.evaluate("""[Number(document.getElementById('count-used').textContent),
        Number(document.getElementById('count-shared').textContent), document.querySelectorAll('#grid .b2').length]""")
    assert used >= shared == orange > 0
    page.hover("#slots tbody tr[data-state=decode]")  # its block table lights up in the grid
    page.wait_for_function("() => document.querySelectorAll('#grid .blk.hl').length > 0")
    page.wait_for_function("() => Number(document.body.dataset.steps) >= 5")
    assert page.text_content("#t-tps") != "idle" and page.is_hidden("#steps-idle")
    if os.environ.get("KVSERVE_UI_SCREENSHOTS"):  # for the docs: a chart with some history, the load still running
        page.wait_for_function("() => Number(document.body.dataset.steps) >= 24", timeout=120_000)
    _screenshot(page, "ui-under-load.png")
    load.join(timeout=300)
    assert not load.is_alive()
    page.wait_for_function("() => Number(document.getElementById('count-used').textContent) === 0", timeout=30_000)
    page.wait_for_function("() => document.querySelectorAll('#slots tbody tr:not(.finished)').length === 0")
    assert _number(page, "count-cached") > 0  # freed full blocks keep their hashes for the prefix cache
    assert float(page.text_content("#t-prefix").rstrip("%")) > 0
    _assert_idle(page)
    assert page.csp_errors == []


def _assert_idle(page) -> None:
    """Idle reads as idle: the tokens/s tile says so, the step chart is dimmed under a note, and its axes count
    steps and tokens in whole numbers (a few steps once drew ticks at 1.5, 2.5)."""
    page.wait_for_function("() => document.body.classList.contains('idle')", timeout=30_000)
    assert page.text_content("#t-tps") == "idle"
    assert page.is_visible("#steps-idle") and page.text_content("#steps-idle").startswith("idle: no request")
    x_ticks, token_ticks, _ = page.evaluate("window.kvserveStepChart.ticks()")
    assert x_ticks and all(float(t).is_integer() for t in x_ticks + token_ticks), (x_ticks, token_ticks)


def test_the_playground_streams_an_answer_with_ttft(live_url, page):
    page.goto(live_url + "/ui")
    page.wait_for_selector("#pg-input", state="visible")
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max-tokens", "24")
    load = _load(live_url, [(f"Count slowly to {i + 10}.", 48, 1) for i in range(4)])
    page.fill("#pg-input", "Name three colours of the rainbow.")
    page.click("#pg-send")
    page.wait_for_function("() => ['stop', 'length'].includes(document.getElementById('pg-finish').textContent)",
                           timeout=120_000)
    assert page.text_content("#pg-ttft").endswith(" ms") and float(page.text_content("#pg-ttft")[:-3]) > 0
    assert int(page.text_content("#pg-tokens")) > 0
    assert page.locator(".msg.assistant span.lp").count() > 0
    assert page.text_content(".msg.assistant").strip()
    _screenshot(page, "ui-playground.png")
    load.join(timeout=300)
    assert page.csp_errors == []


def test_with_an_api_key_the_page_shows_only_the_key_prompt(keyed_url, page):
    page.goto(keyed_url + "/")
    page.wait_for_selector("#keyprompt", state="visible")
    assert page.is_hidden("#main") and page.is_hidden("#slots")
    assert page.evaluate("sessionStorage.length") == 0
    page.fill("#key", "wrong")
    page.click("#keyprompt button")
    page.wait_for_function("() => document.getElementById('keyerror').textContent.includes('refused')")
    assert page.is_hidden("#main")
    page.fill("#key", "sekrit")
    page.click("#keyprompt button")
    page.wait_for_selector("#main", state="visible")
    assert page.is_hidden("#keyprompt")


def test_the_overhead_compares_each_open_window_with_the_closed_ones_on_either_side():
    from kvserve.loadtest.served.uibench import paired_ratios, read_switches, render, windows

    # the viewer's log: closed at 0, open at 1, closed at 2 (30 snapshots), ...; a cut last line is ignored
    log = "".join(f"{t}.0 {t % 2} {t * 0.01:.4f} {30 if t % 2 == 0 and t else 0}\n" for t in range(9)) + "9.0 1"
    switches = read_switches(log)
    assert [(s.at, s.page_open) for s in switches] == [(float(t), t % 2 == 1) for t in range(9)]
    assert [s.count for s in switches if s.page_open] == [30] * 4
    # the machine slows down 10% a window while the open windows lose 2% more: steps of 10 tokens, 100 closed tokens
    # a second in window 0, 90 * 0.98 open in 1, 81 closed in 2, ...; steps outside the steady span never count
    rate = [100 * 0.9 ** w * (0.98 if w % 2 else 1.0) for w in range(8)]
    steps = [(w + (i + 0.5) * 10 / rate[w], 10) for w in range(8) for i in range(int(rate[w] / 10))] + [(0.5, 1000)]
    ws = windows(switches, steps, steady=(1.0, 8.0))
    assert [w.page_open for w in ws] == [True, False, True, False, True, False, True]
    assert ws[1].tokens_per_s == pytest.approx(rate[2])
    # a window ends part-way through a step: its rate still counts whole steps over their own time, not the
    # window's (window 2 has 8 steps of 10 tokens, 80 tokens in 1 s at 81 a second)
    assert sum(1 for t, _ in steps if 2 < t <= 3) == 8
    assert ws[0].loop_cpu_ms == pytest.approx(1000 * 0.01 / (10 * int(rate[1] / 10)))  # 10 ms over the window's tokens
    # linear drift cancels only roughly for a geometric one: each pair sees the 2% and (0.9 + 1/0.9) / 2's bend
    bend = 2 / (0.9 + 1 / 0.9)
    assert paired_ratios(ws) == [pytest.approx(0.98 * bend)] * 2  # the first open window has no closed one before
    text = render(ws, "stream", 32, 64, "auto", 1.0, viewer_cpu_s=0.5, span_s=7.0)
    assert f"mean **{0.98 * bend:.3f}**" in text and "2 open windows" in text
    assert "| open | 4 |" in text and "| closed | 3 |" in text
    assert "Only 0 open window(s)" in render(ws[:2], "stream", 32, 64, "auto", 1.0, 0.5, 2.0)


def test_the_overhead_reads_output_tokens_from_the_step_log():
    from kvserve.loadtest.served.uibench import step_tokens

    log = ('{"prefills": 2, "decodes": 30, "prefill_tokens": 40, "draft_tokens": 0, "max_context": 9, '
           '"seconds": 0.1, "end_s": 5.25}\n{"prefills": 0, "decodes": 32, "draft_tokens": 3, "end_s": 5.3}\n{"pre')
    assert step_tokens(log) == [(5.25, 32), (5.3, 32)]  # a token per sequence (drafts proposed are not output)


def test_the_overhead_load_is_staggered_so_streams_end_at_different_steps():
    from kvserve.loadtest.served.uibench import staggered

    lengths = [spec.max_tokens for spec in staggered(256, 128)]
    assert min(lengths) >= 64 and max(lengths) <= 192 and len(set(lengths)) > 50
    assert lengths == [spec.max_tokens for spec in staggered(256, 128)]  # seeded
