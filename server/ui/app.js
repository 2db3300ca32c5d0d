// The live page: connects to /ui/events (asking for the API key when the server wants one) and draws each
// snapshot: tiles, slots, the KV pool's blocks and the charts. Nothing here holds another request's text: a
// snapshot carries ids and counts only.
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);
  const RETRY_MS = 1000;
  const FADE_MS = 4000;  // a finished slot row fades out over this long, then goes (fade, style.css .finished)
  const STATES = ['b0', 'b1', 'b2', 'b3'];  // free, in use, shared, cached-but-free (server/snapshot.py)

  let infoShown = false;
  let stepChart, elbowChart, ttftChart, itlChart;
  const rows = new Map();  // seq id -> {tr, blocks, finished: when it finished (ms), or false}
  let hovered = null;      // seq id whose block table is highlighted
  let cells = [];
  let latest = null;       // the last snapshot received, drawn when a hidden tab is shown again

  function setConn(text, cls) {
    const el = $('conn');
    el.textContent = text;
    el.className = 'conn ' + (cls || '');
  }

  function showKeyPrompt(message) {
    $('main').hidden = true;
    $('keyprompt').hidden = false;
    $('keyerror').textContent = message;
    setConn('locked', 'off');
    $('key').focus();
  }

  function showMain() {
    $('keyprompt').hidden = true;
    $('main').hidden = false;
    if (!stepChart) {  // charts are sized from their panels, so they are made once the panels are shown
      stepChart = charts.steps($('stepchart'));
      window.kvserveStepChart = stepChart;  // for the browser tests: its ticks
      elbowChart = charts.elbow($('elbowchart'));
      ttftChart = charts.histogram($('ttftchart'), '#2f7ed8');
      itlChart = charts.histogram($('itlchart'), '#3aa675');
    }
  }

  async function connect() {
    let response;
    try {
      response = await fetch('/ui/events', {headers: kv.authHeaders(), cache: 'no-store'});
    } catch (e) {
      setConn('offline, retrying', 'off');
      setTimeout(connect, RETRY_MS);
      return;
    }
    if (response.status === 401) {
      showKeyPrompt(kv.hasKey() ? 'That key was refused.' : '');
      return;
    }
    if (!response.ok) {
      setConn('error ' + response.status + ', retrying', 'off');
      setTimeout(connect, RETRY_MS);
      return;
    }
    showMain();
    setConn('live', 'on');
    try {
      await kv.readEvents(response, (data) => {
        latest = JSON.parse(data);
        if (!document.hidden) render(latest);  // a tab in the background draws nothing
      });
    } catch (e) { /* the server went away: reconnect below */ }
    setConn('reconnecting', 'off');
    setTimeout(connect, RETRY_MS);
  }

  function render(snap) {
    if (!infoShown) showInfo(snap.info);
    renderTiles(snap);
    renderSlots(snap);
    renderBlocks(snap.blocks);
    const fresh = stepChart.update(snap.steps);
    if (fresh.length) elbowChart.update(fresh);
    ttftChart.update(snap.ttft);
    itlChart.update(snap.itl);
    document.body.dataset.steps = stepChart.count();  // steps drawn: what the tests and the benchmark read
  }

  function showInfo(info) {
    infoShown = true;
    $('model').textContent = info.model + ' · ' + info.max_num_seqs + ' slots · context ' + info.max_model_len;
    $('pool-size').textContent = info.num_blocks + ' blocks of ' + info.block_size + ' tokens' +
      (info.prefix_caching ? ', prefix caching on' : ', prefix caching off');
    const grid = $('grid');
    for (let i = 0; i < info.num_blocks; i++) {
      const cell = document.createElement('i');
      cell.className = 'blk b0';
      cell.title = 'block ' + i;
      grid.appendChild(cell);
    }
    cells = Array.from(grid.children);
    playground.configure(info);
  }

  function renderTiles(snap) {
    const t = snap.totals;
    const running = snap.slots.filter((s) => s.state === 'prefill' || s.state === 'decode').length;
    $('t-running').textContent = running + ' / ' + snap.info.max_num_seqs;
    $('t-queue').textContent = snap.queue;
    $('t-rejected').textContent = t.rejected;
    $('t-prefix').textContent = t.prefix_queries ? (100 * t.prefix_hits / t.prefix_queries).toFixed(1) + '%' : '–';
    const idle = snap.slots.length === 0 && snap.queue === 0;  // nothing running or waiting
    document.body.classList.toggle('idle', idle);
    $('steps-idle').hidden = !idle;
    $('steps-idle').textContent = 'idle: no request running or waiting' +
      (t.steps ? ' (the bars are the last steps, up to step ' + t.steps.toLocaleString('en') + ')' : '');
    $('t-tps').textContent = idle ? 'idle' : snap.tokens_per_s.toFixed(1);
    $('t-preempt').textContent = t.preemptions;
    $('t-steps').textContent = t.steps;
  }

  function cell(tr, index, text) {
    while (tr.children.length <= index) tr.appendChild(document.createElement('td'));
    if (tr.children[index].textContent !== String(text)) tr.children[index].textContent = text;
  }

  function renderSlots(snap) {
    const body = $('slots').tBodies[0];
    const seen = new Set();
    for (const s of snap.slots) {
      seen.add(s.id);
      let row = rows.get(s.id);
      if (!row || row.finished) {
        if (row) row.tr.remove();
        const tr = document.createElement('tr');
        tr.addEventListener('mouseenter', () => { hovered = s.id; highlight(); });
        tr.addEventListener('mouseleave', () => { hovered = null; highlight(); });
        body.insertBefore(tr, firstFinished(body));  // live rows above the fading ones
        row = {tr, blocks: [], finished: false};
        rows.set(s.id, row);
      }
      row.blocks = s.blocks;
      row.tr.dataset.state = s.state;
      cell(row.tr, 0, s.id);
      cell(row.tr, 1, s.state);
      row.tr.children[1].className = 'state ' + s.state;
      cell(row.tr, 2, s.prompt);
      cell(row.tr, 3, s.generated);
      cell(row.tr, 4, s.cached);
      cell(row.tr, 5, s.drafted ? s.accepted + ' / ' + s.drafted : '–');
      cell(row.tr, 6, s.blocks.length);
    }
    for (const [id, row] of rows) {
      if (seen.has(id) || row.finished) continue;
      row.finished = performance.now();  // gone from the scheduler: finished (or aborted)
      row.tr.dataset.state = 'finished';
      cell(row.tr, 1, 'finished');
      row.tr.children[1].className = 'state finished';
      row.tr.classList.add('finished');
      body.appendChild(row.tr);
    }
    fade(performance.now());
    const listed = snap.slots.filter((s) => s.state === 'waiting' || s.state === 'preempted').length;
    $('slots-more').textContent = snap.queue > listed ? '+ ' + (snap.queue - listed) + ' more waiting' : '';
    if (hovered !== null) highlight();
  }

  // Finished rows step towards transparent as snapshots are drawn (style.css, .f1-.f3) and go after FADE_MS.
  function fade(now) {
    for (const [id, row] of rows) {
      if (!row.finished) continue;
      const step = Math.floor(4 * (now - row.finished) / FADE_MS);
      if (step >= 4) {
        row.tr.remove();
        rows.delete(id);
      } else if (step > 0 && !row.tr.classList.contains('f' + step)) {
        row.tr.classList.remove('f' + (step - 1));
        row.tr.classList.add('f' + step);
      }
    }
  }

  function firstFinished(body) {
    for (const tr of body.rows) if (tr.classList.contains('finished')) return tr;
    return null;
  }

  function renderBlocks(states) {
    const counts = [0, 0, 0, 0];
    for (let i = 0; i < states.length && i < cells.length; i++) {
      const state = states.charCodeAt(i) - 48;
      counts[state]++;
      const cls = 'blk ' + STATES[state];
      if (cells[i].dataset.s !== String(state)) {
        cells[i].dataset.s = state;
        cells[i].className = cls + (cells[i].classList.contains('hl') ? ' hl' : '');
      }
    }
    $('count-used').textContent = counts[1] + counts[2];
    $('count-shared').textContent = counts[2];
    $('count-cached').textContent = counts[3];
    $('count-free').textContent = counts[0];
  }

  function highlight() {
    for (const c of cells) c.classList.remove('hl');
    const row = hovered !== null ? rows.get(hovered) : null;
    if (!row) return;
    for (const b of row.blocks) if (cells[b]) cells[b].classList.add('hl');
  }

  $('keyprompt').addEventListener('submit', (event) => {
    event.preventDefault();
    kv.setKey($('key').value.trim());
    $('key').value = '';
    setConn('connecting…');
    connect();
  });

  document.addEventListener('visibilitychange', () => { if (!document.hidden && latest) render(latest); });
  setInterval(() => fade(performance.now()), 1000);  // an idle server sends no snapshots: rows still go
  connect();
})();
