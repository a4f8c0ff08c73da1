// Keel dashboard: the runs list (#/) and one run (#/runs/<id>), drawn from the orchestrator's
// /v1 API on the same origin. Plain ES2017, no build step; plots use the vendored uPlot.
//
// Markers for automated checks:
//   body[data-ready="true"]      every fetch of the current view has been rendered once
//   body[data-error="<message>"] the last fetch failed (also shown in #error)
//   [data-plot=<key>][data-points=<n>]  finite (step, value) points drawn in that plot
//   tr.sample-row                one per sample shown
(function () {
  'use strict';

  const LIST_EVERY_MS = 5000;
  const RUN_EVERY_MS = 3000;
  const PLOT_HEIGHT = 240;
  const COLORS = ['#2563eb', '#dc2626', '#16a34a', '#d97706', '#7c3aed', '#0891b2', '#db2777', '#65a30d', '#475569'];
  const KL_NAMES = ['train/kl_penalty', 'train/kl', 'train/approx_kl'];
  const STEP_TIME_PREFIX = 'timing/train/';
  // Whole-step tick spacings for the x axis: 1, 2, 5, 10, 20, 50, ...
  const STEP_TICKS = [];
  for (let m = 1; m <= 1e7; m *= 10) STEP_TICKS.push(m, 2 * m, 5 * m);

  // Each fixed plot: [key, title, pick(names) -> the series names it draws, stacked].
  const PLOTS = [
    ['reward', 'Reward', (names) => names.filter((n) => n === 'train/reward'), false],
    ['loss', 'Loss', (names) => names.filter((n) => n === 'train/loss'), false],
    ['kl', 'KL', (names) => KL_NAMES.filter((n) => names.indexOf(n) >= 0).slice(0, 1), false],
    ['validation', 'Validation', pickValidation, false],
    ['step_time', 'Step time (s, stacked)', (names) => names
      .filter((n) => n.startsWith(STEP_TIME_PREFIX) && n !== 'timing/train/total_step_time').sort(), true],
  ];

  function pickValidation(names) {
    const passAt = names.filter((n) => /^validation\/pass@\d+$/.test(n))
      .sort((a, b) => Number(a.split('@')[1]) - Number(b.split('@')[1]));
    // Accuracy where rewards are right-or-wrong, the mean reward where they are not.
    return names.filter((n) => n === 'validation/accuracy' || n === 'validation/reward_mean').concat(passAt);
  }

  // ---- bearer token and API access ----

  const TOKEN_KEY = 'keel.dashboard.token';
  let token = null;

  function initToken() {
    const url = new URL(location.href);
    const fromUrl = url.searchParams.get('token');
    try {
      if (fromUrl) localStorage.setItem(TOKEN_KEY, fromUrl);
      token = fromUrl || localStorage.getItem(TOKEN_KEY);
    } catch (e) {
      token = fromUrl; // storage disabled: keep it for this page only
    }
    if (fromUrl) { // keep the token out of the address bar and history
      url.searchParams.delete('token');
      history.replaceState(null, '', url.pathname + url.search + url.hash);
    }
  }

  async function api(path) {
    const headers = { Accept: 'application/json' };
    if (token) headers.Authorization = 'Bearer ' + token;
    let response;
    try {
      response = await fetch(path, { headers: headers, cache: 'no-store' });
    } catch (e) {
      throw new Error('Cannot reach the orchestrator: ' + e.message);
    }
    const text = await response.text();
    let body = null;
    try { body = JSON.parse(text); } catch (e) { /* not JSON: reported below */ }
    if (!response.ok) {
      const error = body && body.error;
      let message = error && error.message ? error.message : (text.trim().slice(0, 200) || response.statusText);
      message += ' (HTTP ' + response.status + (error && error.type ? ', ' + error.type : '') + ')';
      if (response.status === 401) message += ' — open the dashboard with ?token=… to set a bearer token';
      throw new Error(message);
    }
    if (body === null || typeof body !== 'object') throw new Error('Unexpected response from ' + path);
    return body;
  }

  // ---- small DOM and formatting helpers ----

  // el('td', {class: 'num'}, child...): strings become text nodes, so data is never parsed as HTML.
  function el(tag, attrs) {
    const node = document.createElement(tag);
    Object.keys(attrs || {}).forEach((key) => {
      const value = attrs[key];
      if (value == null || value === false) return;
      if (key === 'class') node.className = value;
      else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? '' : String(value));
    });
    for (let i = 2; i < arguments.length; i++) add(node, arguments[i]);
    return node;
  }

  function add(node, child) {
    if (child == null || child === false) return;
    if (Array.isArray(child)) child.forEach((c) => add(node, c));
    else node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }

  function fill(node) {
    node.textContent = '';
    for (let i = 1; i < arguments.length; i++) add(node, arguments[i]);
  }

  function fmt(v) {
    if (typeof v !== 'number' || !Number.isFinite(v)) return '—';
    const a = Math.abs(v);
    if (a === 0) return '0';
    if (a >= 1e5 || a < 1e-3) return v.toExponential(2);
    return String(Number(v.toPrecision(4)));
  }

  function fmtTime(s) {
    const d = new Date(s);
    return isNaN(d.getTime()) ? String(s) : d.toLocaleString();
  }

  const shortId = (id) => String(id).slice(0, 8);
  const isLive = (run) => run.status === 'queued' || run.status === 'running' || run.status === 'waiting';
  const badge = (status, reason) => el('span', { class: 'badge status-' + status, title: reason || '' }, status);
  const option = (value, label) => el('option', { value: value }, label);

  // Replaces a <select>'s [value, label] options, only when they changed (an open list stays open).
  const shownOptions = new WeakMap();
  function setOptions(select, options, selected) {
    const key = JSON.stringify(options);
    if (shownOptions.get(select) !== key) {
      shownOptions.set(select, key);
      fill(select, options.map((o) => option(o[0], o[1])));
    }
    select.value = selected;
  }

  function progress(run) {
    const pct = run.total_steps > 0 ? Math.min(100, (100 * run.step) / run.total_steps) : 0;
    const bar = el('span', { class: 'bar' }, el('span', { class: 'bar-fill' }));
    bar.firstChild.style.width = pct.toFixed(1) + '%';
    return el('span', { class: 'progress' }, bar, el('span', { class: 'num' }, run.step + ' / ' + run.total_steps));
  }

  const errorBox = document.getElementById('error');
  const app = document.getElementById('app');

  function showError(message) {
    errorBox.textContent = message;
    errorBox.hidden = false;
    document.body.dataset.error = message;
  }

  function clearError() {
    errorBox.hidden = true;
    delete document.body.dataset.error;
  }

  // Runs `refresh` now and again every `everyMs` while it returns true (retrying after
  // errors). Marks the page ready after the first success.
  function poller(refresh, everyMs) {
    let stopped = false, ready = false, timer = null;
    async function tick() {
      let more = true;
      try {
        more = await refresh();
        if (stopped) return;
        clearError();
        if (!ready) { ready = true; document.body.dataset.ready = 'true'; }
      } catch (e) {
        if (stopped) return;
        showError(e.message || String(e));
      }
      if (more) timer = setTimeout(tick, everyMs);
    }
    tick();
    return { stop() { stopped = true; clearTimeout(timer); } };
  }

  // ---- plots ----

  // A plot card: `update(series, stacked)` draws [{label, points: [[step, value], ...]}].
  function plotCard(key, title, extraHead) {
    const box = el('div', { class: 'plot' });
    const root = el('div', { class: 'card plot-card', 'data-plot': key, 'data-points': 0 },
      el('div', { class: 'card-head' }, el('h3', null, title), extraHead),
      box, el('div', { class: 'nodata' }, 'no data'));
    let plot = null, signature = '', drawn = '';
    const holder = { raw: [] };

    function update(series, stacked) {
      let count = 0;
      const steps = new Set();
      series.forEach((s) => s.points.forEach((p) => {
        if (Number.isFinite(p[0]) && Number.isFinite(p[1])) { count++; steps.add(p[0]); }
      }));
      const xs = Array.from(steps).sort((a, b) => a - b);
      const at = new Map(xs.map((x, i) => [x, i]));
      const raw = series.map((s) => {
        const ys = xs.map(() => null);
        s.points.forEach((p) => { if (at.has(p[0]) && Number.isFinite(p[1])) ys[at.get(p[0])] = p[1]; });
        return ys;
      });
      let ys = raw;
      if (stacked) { // cumulative sums, bottom series first; the legend still shows raw values
        const sum = xs.map(() => 0);
        ys = raw.map((r) => r.map((v, i) => (sum[i] += v || 0)));
      }
      holder.raw = raw;
      root.dataset.points = String(count);
      root.classList.toggle('empty', count === 0);

      const data = [xs].concat(ys);
      const sig = (stacked ? 'stacked:' : '') + series.map((s) => s.label).join('\u0000');
      const key = JSON.stringify(data);
      if (plot && sig === signature) {
        if (key !== drawn) plot.setData(data);
      } else {
        if (plot) plot.destroy();
        plot = new uPlot(options(series, stacked, holder, box), data, box);
        signature = sig;
      }
      drawn = key;
    }

    function resize() {
      if (plot) plot.setSize({ width: plotWidth(box), height: PLOT_HEIGHT });
    }

    return { root: root, update: update, resize: resize };
  }

  function plotWidth(box) {
    return Math.max(200, Math.floor(box.clientWidth));
  }

  function options(series, stacked, holder, box) {
    const opts = {
      width: plotWidth(box),
      height: PLOT_HEIGHT,
      cursor: { drag: { x: true, y: false } },
      scales: { x: { time: false } },
      axes: [
        { label: 'step', labelSize: 20, incrs: STEP_TICKS },
        { size: 60, values: (u, ticks) => ticks.map(fmt) },
      ],
      series: [{ label: 'step' }].concat(series.map((s, i) => {
        const color = COLORS[i % COLORS.length];
        return {
          label: s.label,
          stroke: color,
          width: 1.5,
          spanGaps: true,
          fill: stacked ? color + '59' : undefined,
          value: stacked
            ? (u, v, si, idx) => (idx == null ? '—' : fmt(holder.raw[si - 1][idx]))
            : (u, v) => fmt(v),
        };
      })),
    };
    if (stacked) {
      opts.scales.y = { range: (u, min, max) => [0, max > 0 ? max * 1.05 : 1] };
      // Fill each layer down to the one below it rather than to zero.
      opts.bands = series.slice(1).map((s, i) => ({ series: [i + 2, i + 1] }));
    }
    return opts;
  }

  // ---- runs list ----

  function listView() {
    document.title = 'Runs · Keel';
    const rows = el('tbody');
    const note = el('p', { class: 'muted' });
    const heads = ['Run', 'Algorithm', 'Status', 'Progress', 'Created', 'Reward', 'Loss', 'Validation'];
    fill(app, el('section', { class: 'card' },
      el('h1', null, 'Runs'),
      el('div', { class: 'table-wrap' }, el('table', { class: 'runs' },
        el('thead', null, el('tr', null, heads.map((h) => el('th', null, h)))), rows)),
      note));

    function row(run) {
      const href = '#/runs/' + encodeURIComponent(run.id);
      const m = run.latest_metrics || {};
      return el('tr', { class: 'run-row', 'data-run-id': run.id, onclick: (e) => {
        if (!e.target.closest('a')) location.hash = href.slice(1);
      } },
      el('td', null, el('a', { href: href, title: run.id }, run.name || shortId(run.id))),
      el('td', null, el('span', { class: 'algo' }, run.algorithm)),
      el('td', null, badge(run.status, run.reason)),
      el('td', null, progress(run)),
      el('td', { class: 'nowrap' }, fmtTime(run.created_at)),
      el('td', { class: 'num' }, fmt(m['train/reward'])),
      el('td', { class: 'num' }, fmt(m['train/loss'])),
      el('td', { class: 'num', title: m['validation/accuracy'] !== undefined ? 'accuracy' : 'mean reward' },
        fmt(m['validation/accuracy'] ?? m['validation/reward_mean'])));
    }

    const poll = poller(async () => {
      const body = await api('/v1/runs?limit=100');
      const runs = body.runs || [];
      fill(rows, runs.length ? runs.map(row)
        : el('tr', null, el('td', { colspan: heads.length, class: 'muted' }, 'No runs yet.')));
      note.textContent = body.next ? 'Showing the newest ' + runs.length + ' runs.' : '';
      return true;
    }, LIST_EVERY_MS);
    return { stop: poll.stop, resize() {} };
  }

  // ---- one run ----

  function runView(id) {
    document.title = 'Run ' + shortId(id) + ' · Keel';
    const base = '/v1/runs/' + encodeURIComponent(id);
    const series = new Map(); // name -> [[step, value], ...] in step order
    let run = null, extra = '', samplesSeq = 0, samplesShown = null, fromStep = 0;
    const filter = { split: '', step: '' };
    const sampleSteps = new Set();

    const header = el('section', { class: 'card run-header' }, el('p', { class: 'muted' }, 'Loading run…'));
    const cards = {};
    PLOTS.forEach((p) => { cards[p[0]] = plotCard(p[0], p[1]); });
    const extraSelect = el('select', { 'aria-label': 'Series', onchange: () => { extra = extraSelect.value; drawPlots(); } });
    cards.extra = plotCard('extra', 'Other series', extraSelect);

    const splitSelect = el('select', { 'aria-label': 'Split', onchange: () => { filter.split = splitSelect.value; loadSamples().catch(report); } },
      option('', 'all splits'), option('train', 'train'), option('validation', 'validation'));
    const stepSelect = el('select', { 'aria-label': 'Step', onchange: () => { filter.step = stepSelect.value; loadSamples().catch(report); } },
      option('', 'all steps'));
    const sampleRows = el('tbody');
    const sampleNote = el('span', { class: 'muted' });
    const sampleHeads = ['Step', 'Split', 'Reward', 'Prompt', 'Completion', 'Ground truth', 'Finish reason'];

    fill(app,
      el('p', { class: 'crumbs' }, el('a', { href: '#/' }, '← All runs')),
      header,
      el('section', { class: 'plots' }, Object.keys(cards).map((k) => cards[k].root)),
      el('section', { class: 'card samples' },
        el('div', { class: 'card-head' }, el('h2', null, 'Samples'),
          el('div', { class: 'filters' }, splitSelect, stepSelect, sampleNote)),
        el('div', { class: 'table-wrap' }, el('table', { class: 'samples-table' },
          el('thead', null, el('tr', null, sampleHeads.map((h) => el('th', null, h)))), sampleRows))));

    let stopped = false;
    function report(e) { if (!stopped) showError(e.message || String(e)); }

    function renderHeader() {
      fill(header,
        el('div', { class: 'title-row' },
          el('h1', null, run.name || 'Run ' + shortId(run.id)), badge(run.status),
          el('span', { class: 'algo' }, run.algorithm),
          isLive(run) ? el('span', { class: 'muted live' }, 'live · refreshing every 3 s') : null),
        run.reason ? el('p', { class: 'reason' }, ({ failed: 'Failed: ', waiting: 'Waiting for: ' }[run.status] || 'Reason: ') + run.reason) : null,
        el('dl', { class: 'facts' },
          el('div', null, el('dt', null, 'ID'), el('dd', null, el('code', null, run.id))),
          el('div', null, el('dt', null, 'Progress'), el('dd', null, progress(run))),
          el('div', null, el('dt', null, 'Created'), el('dd', null, fmtTime(run.created_at))),
          el('div', null, el('dt', null, 'Updated'), el('dd', null, fmtTime(run.updated_at)))));
      document.title = (run.name || 'Run ' + shortId(run.id)) + ' · Keel';
    }

    // Fetches the points from the last step seen on (that step may have been partly written).
    async function loadMetrics() {
      const from = fromStep;
      const body = await api(base + '/metrics' + (from > 0 ? '?from_step=' + from : ''));
      (body.metrics || []).forEach((m) => {
        const old = (series.get(m.name) || []).filter((p) => p[0] < from);
        series.set(m.name, old.concat(m.points || []));
        (m.points || []).forEach((p) => { if (p[0] > fromStep) fromStep = p[0]; });
      });
    }

    function drawPlots() {
      const names = Array.from(series.keys()).sort();
      const used = new Set();
      PLOTS.forEach((p) => {
        const picked = p[2](names);
        picked.forEach((n) => used.add(n));
        const label = (n) => (p[3] ? n.slice(STEP_TIME_PREFIX.length) : n);
        const list = picked.map((n) => ({ label: label(n), points: series.get(n) }));
        cards[p[0]].update(list.length ? list : [{ label: p[1], points: [] }], p[3]);
      });
      const others = names.filter((n) => !used.has(n));
      if (extra && others.indexOf(extra) < 0) others.unshift(extra);
      setOptions(extraSelect, [['', others.length ? 'choose a series…' : 'no other series']]
        .concat(others.map((n) => [n, n])), extra);
      cards.extra.update([{ label: extra || 'series', points: extra ? series.get(extra) || [] : [] }], false);
    }

    async function loadSamples() {
      const seq = ++samplesSeq;
      let query = '?limit=200';
      if (filter.step !== '') query += '&step=' + encodeURIComponent(filter.step);
      if (filter.split) query += '&split=' + encodeURIComponent(filter.split);
      const body = await api(base + '/samples' + query);
      if (seq !== samplesSeq || stopped) return; // a newer request (other filters) wins
      const samples = body.samples || [];
      samples.forEach((s) => sampleSteps.add(s.step));
      const steps = Array.from(sampleSteps).sort((a, b) => b - a);
      setOptions(stepSelect, [['', 'all steps']].concat(steps.map((s) => [String(s), 'step ' + s])), filter.step);
      sampleNote.textContent = samples.length + ' sample' + (samples.length === 1 ? '' : 's') +
        (samples.length >= 200 ? ' (latest 200)' : '');
      const key = JSON.stringify(samples);
      if (key === samplesShown) return;
      samplesShown = key;
      fill(sampleRows, samples.length ? samples.map(sampleRow)
        : el('tr', null, el('td', { colspan: sampleHeads.length, class: 'muted' }, 'No samples recorded.')));
    }

    function sampleRow(s) {
      const text = (v) => (v == null ? el('span', { class: 'muted' }, '—') : el('pre', { class: 'text' }, v));
      return el('tr', { class: 'sample-row' },
        el('td', { class: 'num' }, String(s.step)),
        el('td', null, s.split),
        el('td', { class: 'num' + (s.reward > 0 ? ' good' : '') }, fmt(s.reward)),
        el('td', null, text(s.prompt)),
        el('td', null, text(s.completion)),
        el('td', null, text(s.ground_truth)),
        el('td', null, s.finish_reason || '—'));
    }

    // The run first: when it is final, the metrics and samples fetched after it are complete.
    const poll = poller(async () => {
      run = await api(base);
      renderHeader();
      await Promise.all([loadMetrics(), loadSamples()]);
      if (!stopped) drawPlots();
      return isLive(run);
    }, RUN_EVERY_MS);

    return {
      stop() { stopped = true; poll.stop(); },
      resize() { Object.keys(cards).forEach((k) => cards[k].resize()); },
    };
  }

  // ---- routing ----

  let view = null;

  function route() {
    if (view) view.stop();
    delete document.body.dataset.ready;
    clearError();
    const match = /^#\/runs\/([^/?#]+)/.exec(location.hash);
    view = match ? runView(decodeURIComponent(match[1])) : listView();
    window.scrollTo(0, 0);
  }

  let resizeTimer = null;
  window.addEventListener('resize', () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => { if (view) view.resize(); }, 100);
  });
  window.addEventListener('hashchange', route);

  if (typeof uPlot === 'undefined') {
    showError('The plotting library (/dashboard/vendor/uplot/uPlot.iife.min.js) did not load.');
    return;
  }
  initToken();
  route();
})();
