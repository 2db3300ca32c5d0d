// The page's charts, drawn by uPlot (vendored in vendor/): the scrolling step chart, the elbow's scatter and
// the two latency histograms. Each function returns {update(...)}; data arrive from app.js.
'use strict';

const charts = (() => {
  const COLORS = {prefill: '#e08a1e', decode: '#2f7ed8', draft: '#8e5bd0', ms: '#333', point: '#2f7ed8'};
  const STEPS_SHOWN = 200;   // steps in the scrolling chart
  const STEPS_MIN = 50;      // the chart's x axis spans at least this many steps, so a few bars stay bars
  // ticks on whole counts only (steps, tokens): uPlot picks the first of these increments that leaves room
  const WHOLE = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6, 1e7, 1e8];
  const wholeTicks = (u, ticks) => ticks.map((t) => (Number.isInteger(t) ? t.toLocaleString('en') : ''));
  const POINTS_KEPT = 3000;  // (tokens, ms) points the elbow keeps
  const ELBOW_MS = 1000;     // the elbow's redraws are at least this far apart

  function sized(el, height, opts) {
    const plot = new uPlot({width: Math.max(el.clientWidth, 200), height, ...opts}, opts.data, el);
    new ResizeObserver(() => plot.setSize({width: Math.max(el.clientWidth, 200), height})).observe(el);
    return plot;
  }

  const bars = () => uPlot.paths.bars({size: [0.75, 40]});  // gaps between bars: one bar, one step
  const dots = () => null;  // no line between the elbow's points

  // Stacked bars of tokens per step (prefill under decode under draft) and the step's ms on the right axis.
  // uPlot does not stack: each series is drawn as the running total, biggest first, so each shows its share.
  // The x axis is a window of STEPS_SHOWN steps ending at the last one (at least STEPS_MIN wide), so a bar is a
  // step's width whether the page has seen 3 steps or 3,000.
  function steps(el) {
    const raw = [[], [], [], [], []];  // step n, prefill, decode, draft, ms
    let drawn = 0;  // steps drawn since the page opened (the chart keeps the last STEPS_SHOWN)
    const rawValue = (index) => (u, v, si, i) => (i == null || raw[index][i] == null ? '–' : raw[index][i]);
    const plot = sized(el, 220, {
      data: [[], [], [], [], []],
      cursor: {points: {show: false}},
      legend: {live: true},
      scales: {
        x: {time: false, range: (u, lo, hi) => {
          const last = Math.max(hi ?? 0, STEPS_MIN);
          return [Math.max(last - STEPS_SHOWN, 0) + 0.5, last + 0.5];
        }},
        y: {range: (u, lo, hi) => [0, Math.max(hi ?? 0, 1)]},
        ms: {range: (u, lo, hi) => [0, Math.max(hi ?? 0, 1) * 1.1]},
      },
      axes: [{label: 'step', incrs: WHOLE, values: wholeTicks}, {label: 'tokens', incrs: WHOLE, values: wholeTicks},
        {scale: 'ms', side: 1, label: 'ms', grid: {show: false}, incrs: WHOLE, values: wholeTicks}],
      series: [
        {label: 'step'},
        {label: 'draft', fill: COLORS.draft, stroke: COLORS.draft, paths: bars(), points: {show: false}, value: rawValue(3)},
        {label: 'decode', fill: COLORS.decode, stroke: COLORS.decode, paths: bars(), points: {show: false}, value: rawValue(2)},
        {label: 'prefill', fill: COLORS.prefill, stroke: COLORS.prefill, paths: bars(), points: {show: false}, value: rawValue(1)},
        {label: 'step ms', scale: 'ms', stroke: COLORS.ms, width: 1.5, points: {show: false}, value: rawValue(4)},
      ],
    });
    return {
      count: () => drawn,
      ticks: () => plot.axes.map((axis) => axis._splits || []),  // each axis's tick values, as drawn (tests read them)
      // rows: [n, prefill, decode, draft, ms, batch rows] in step order; those already shown are skipped
      update(rows) {
        const last = raw[0].length ? raw[0][raw[0].length - 1] : 0;
        const fresh = rows.filter((r) => r[0] > last);
        if (!fresh.length) return fresh;
        for (const r of fresh) for (let k = 0; k < 5; k++) raw[k].push(r[k]);
        drawn += fresh.length;
        for (const column of raw) column.splice(0, Math.max(0, column.length - STEPS_SHOWN));
        const prefill = raw[1];
        const decode = raw[2].map((d, i) => d + prefill[i]);
        const total = raw[3].map((d, i) => d + decode[i]);
        plot.setData([raw[0], total, decode, prefill, raw[4]]);
        return fresh;
      },
    };
  }

  // Step time against tokens computed in the step: flat while a step is bound by reading the weights, then
  // rising once it is bound by compute (the elbow).
  function elbow(el) {
    const points = [];
    const plot = sized(el, 220, {
      data: [[], []],
      cursor: {drag: {x: false, y: false}},
      scales: {x: {time: false, range: (u, lo, hi) => [0, Math.max(hi, 1) * 1.05]},
        y: {range: (u, lo, hi) => [0, Math.max(hi, 1) * 1.1]}},
      axes: [{label: 'tokens in the step', incrs: WHOLE, values: wholeTicks}, {label: 'step ms'}],
      series: [{label: 'tokens'}, {label: 'ms', stroke: COLORS.point, paths: dots,
        points: {show: true, size: 5, fill: COLORS.point, stroke: COLORS.point}}],
    });
    let timer = null;
    let drawnAt = -Infinity;
    function draw() {
      timer = null;
      drawnAt = performance.now();
      const sorted = points.slice().sort((a, b) => a[0] - b[0]);  // uPlot wants ascending x
      plot.setData([sorted.map((p) => p[0]), sorted.map((p) => p[1])]);
    }
    return {
      count: () => points.length,
      // thousands of points, whose shape changes slowly: redrawn at most once per ELBOW_MS, not per snapshot
      update(fresh) {
        for (const r of fresh) points.push([r[1] + r[2] + r[3], r[4]]);
        points.splice(0, Math.max(0, points.length - POINTS_KEPT));
        if (timer === null) timer = setTimeout(draw, Math.max(0, drawnAt + ELBOW_MS - performance.now()));
      },
    };
  }

  const msLabel = (le) => (le === '+Inf' ? '∞' : (Number(le) * 1000 >= 1000 ? Number(le) + 's' : Math.round(Number(le) * 1000) + 'ms'));

  // A Prometheus histogram as bars, one per bucket (labelled by its upper bound), trimmed after the last used one.
  function histogram(el, color) {
    let labels = [];
    const plot = sized(el, 110, {
      data: [[], []],
      legend: {show: false},
      cursor: {points: {show: false}},
      scales: {x: {time: false}, y: {range: (u, lo, hi) => [0, Math.max(hi, 1)]}},
      axes: [{values: (u, ticks) => ticks.map((t) => labels[t] ?? ''), space: 52, size: 30},
        {size: 50, values: (u, ticks) => ticks.map((t) => (Number.isInteger(t) ? t : ''))}],
      series: [{}, {fill: color, stroke: color, paths: bars(), points: {show: false}}],
    });
    let lastJson = '';
    return {
      update(hist) {
        const json = JSON.stringify(hist.counts);
        if (json === lastJson) return;
        lastJson = json;
        let end = hist.counts.length;
        while (end > 8 && hist.counts[end - 1] === 0) end--;
        labels = hist.le.slice(0, end).map(msLabel);
        plot.setData([labels.map((_, i) => i), hist.counts.slice(0, end)]);
      },
    };
  }

  return {steps, elbow, histogram, COLORS};
})();
