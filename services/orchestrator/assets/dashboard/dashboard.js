// Keel dashboard: the runs list (#/), one run (#/runs/<id>) and several runs overlaid
// (#/compare/<id>,<id>...), drawn from the orchestrator's /v1 API on the same origin. Plain
// ES2017, no build step; plots use the vendored uPlot. The plot settings live in the address
// after the view (`?x=step|time|tokens&smooth=0.6&log=1`), so a view can be linked as shown.
// A run that is live follows its event stream (/v1/runs/<id>/events, server-sent events; the
// browser sends the dashboard's token cookie with it), with a slow poll as the fallback.
//
// Markers for automated checks:
//   body[data-ready="true"]      every fetch of the current view has been rendered once
//   body[data-error="<message>"] the last fetch failed (also shown in #error)
//   body[data-live="sse"]        the run's event stream is open (data-sse-opened: it was once;
//                                data-sse-events: step events drawn)
//   [data-plot=<key>][data-points=<n>]  finite points drawn in that plot (raw series only)
//   [data-plot][data-x][data-smoothing][data-log][data-runs]  the settings a plot is drawn with
//   [data-plot="kl"][data-kl="off"|"on"]  whether the run has a KL penalty (β = 0: off)
//   tr.sample-row, tr.checkpoint-row (a[data-download])  one per sample and checkpoint shown
//   [data-spec]                  the run's spec; [data-duration], [data-eta] in the header
(function () {
  'use strict';

  const LIST_EVERY_MS = 5000;
  const RUN_EVERY_MS = 3000;
  const PLOT_HEIGHT = 240;
  const COLORS = ['#2563eb', '#dc2626', '#16a34a', '#d97706', '#7c3aed', '#0891b2', '#db2777', '#65a30d', '#475569'];
  const KL_NAMES = ['train/kl_penalty', 'train/kl', 'train/approx_kl'];
  // Per-step counts the x axis can accumulate: wall time and tokens trained on.
  const X_SOURCES = {
    time: ['timing/train/total_step_time'],
    tokens: ['train/global_valid_tokens', 'train/num_valid_tokens'],
  };
  const X_LABELS = { step: 'step', time: 'wall time (s, training steps)', tokens: 'tokens trained on' };
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

  // Validation during training, or an eval run's scores (`eval/`).
  function pickValidation(names) {
    const passAt = names.filter((n) => /^(validation|eval)\/pass@\d+$/.test(n))
      .sort((a, b) => Number(a.split('@')[1]) - Number(b.split('@')[1]));
    // Accuracy where rewards are right-or-wrong, the mean reward where they are not.
    return names.filter((n) => /^(validation|eval)\/(accuracy|reward_mean)$/.test(n)).concat(passAt);
  }

  // The headline score of a run's latest metrics: validation's, else an eval run's.
  function score(m) {
    for (const name of ['validation/accuracy', 'eval/accuracy', 'validation/reward_mean', 'eval/reward_mean']) {
      if (m[name] !== undefined) return [name, m[name]];
    }
    return [null, undefined];
  }

  // ---- plot settings (x axis, smoothing, log scale), kept in the address ----

  // `x` is the axis asked for; `axis` the one drawn (step where the run lacks the other's count).
  const settings = { x: 'step', axis: 'step', smooth: 0, log: false };

  function readSettings() {
    const query = new URLSearchParams((location.hash.split('?')[1]) || '');
    settings.x = ['step', 'time', 'tokens'].indexOf(query.get('x')) >= 0 ? query.get('x') : 'step';
    const smooth = Number(query.get('smooth'));
    settings.smooth = Number.isFinite(smooth) ? Math.min(0.99, Math.max(0, smooth)) : 0;
    settings.log = query.get('log') === '1';
  }

  function writeSettings() {
    const query = new URLSearchParams();
    if (settings.x !== 'step') query.set('x', settings.x);
    if (settings.smooth > 0) query.set('smooth', String(settings.smooth));
    if (settings.log) query.set('log', '1');
    const path = location.hash.split('?')[0];
    const text = query.toString();
    history.replaceState(null, '', location.pathname + location.search + path + (text ? '?' + text : ''));
  }

  // The settings bar; `changed()` redraws. `available(x)` says whether an x axis can be drawn.
  function settingsBar(changed, available) {
    const xSelect = el('select', { 'aria-label': 'x axis', onchange: () => { settings.x = xSelect.value; writeSettings(); changed(); } },
      option('step', 'x: step'), option('time', 'x: wall time'), option('tokens', 'x: tokens'));
    const value = el('span', { class: 'num smooth-value' });
    const slider = el('input', { type: 'range', min: 0, max: 0.99, step: 0.01, 'aria-label': 'smoothing',
      oninput: () => { settings.smooth = Number(slider.value); value.textContent = settings.smooth.toFixed(2); writeSettings(); changed(); } });
    const log = el('input', { type: 'checkbox', 'aria-label': 'log scale',
      onchange: () => { settings.log = log.checked; writeSettings(); changed(); } });
    const bar = el('div', { class: 'card settings' },
      el('label', null, xSelect),
      el('label', null, 'smoothing ', slider, ' ', value),
      el('label', null, log, ' log scale'));
    function sync() {
      Array.from(xSelect.options).forEach((o) => { o.disabled = !available(o.value); });
      settings.axis = available(settings.x) ? settings.x : 'step';
      xSelect.value = settings.axis;
      slider.value = String(settings.smooth);
      value.textContent = settings.smooth.toFixed(2);
      log.checked = settings.log;
    }
    sync();
    return { root: bar, sync: sync };
  }

  // step -> x for one run's series: the step itself, or the running sum of a per-step count
  // (step time, tokens) up to and including that step. Null when the run lacks the count.
  function xMapping(series, axis) {
    if (axis === 'step') return (step) => step;
    const name = (X_SOURCES[axis] || []).find((n) => series.has(n));
    if (!name) return null;
    const sums = new Map();
    let total = 0;
    series.get(name).forEach((p) => { if (Number.isFinite(p[1])) total += p[1]; sums.set(p[0], total); });
    const steps = Array.from(sums.keys()).sort((a, b) => a - b);
    return (step) => {
      let at = 0; // the last sum at or before `step` (0 before the first step)
      for (const s of steps) { if (s <= step) at = sums.get(s); else break; }
      return at;
    };
  }

  // TensorBoard's smoothing: an exponential moving average, debiased at the start.
  function smoothed(points, weight) {
    if (!(weight > 0)) return points;
    let last = 0, n = 0;
    return points.map((p) => {
      if (!Number.isFinite(p[1])) return [p[0], null];
      last = last * weight + (1 - weight) * p[1];
      n++;
      return [p[0], last / (1 - Math.pow(weight, n))];
    });
  }

  // The series a plot draws for `picked` [{label, points}] under the settings: x mapped,
  // and with smoothing a faint raw line under each smoothed one.
  function shaped(picked, map, stacked) {
    const mapped = picked.map((s, i) => ({ label: s.label, color: s.color || COLORS[i % COLORS.length],
      points: s.points.map((p) => [map(p[0]), p[1]]) }));
    if (stacked || !(settings.smooth > 0)) return mapped;
    const out = [];
    mapped.forEach((s) => {
      out.push({ label: s.label + ' (raw)', color: s.color, faint: true, points: s.points });
      out.push({ label: s.label, color: s.color, derived: true, points: smoothed(s.points, settings.smooth) });
    });
    return out;
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
        if (Number.isFinite(p[0]) && Number.isFinite(p[1])) { if (!s.derived) count++; steps.add(p[0]); }
      }));
      const log = settings.log && !stacked;
      root.dataset.x = settings.axis;
      root.dataset.smoothing = stacked ? '0' : String(settings.smooth);
      root.dataset.log = String(log);
      const xs = Array.from(steps).sort((a, b) => a - b);
      const at = new Map(xs.map((x, i) => [x, i]));
      const raw = series.map((s) => {
        const ys = xs.map(() => null);
        // A log scale shows positive values only.
        s.points.forEach((p) => { if (at.has(p[0]) && Number.isFinite(p[1]) && (!log || p[1] > 0)) ys[at.get(p[0])] = p[1]; });
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
      const sig = [stacked, log, settings.axis].join(':') + series.map((s) => s.label + '|' + (s.color || '')).join('\u0000');
      const key = JSON.stringify(data);
      if (plot && sig === signature) {
        if (key !== drawn) plot.setData(data);
      } else {
        if (plot) plot.destroy();
        plot = new uPlot(options(series, stacked, holder, box, log), data, box);
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

  function options(series, stacked, holder, box, log) {
    const opts = {
      width: plotWidth(box),
      height: PLOT_HEIGHT,
      cursor: { drag: { x: true, y: false } },
      scales: { x: { time: false }, y: log ? { distr: 3 } : {} },
      axes: [
        settings.axis === 'step' ? { label: 'step', labelSize: 20, incrs: STEP_TICKS } : { label: X_LABELS[settings.axis], labelSize: 20, values: (u, ticks) => ticks.map(fmt) },
        { size: 60, values: (u, ticks) => ticks.map(fmt) },
      ],
      series: [{ label: X_LABELS[settings.axis] }].concat(series.map((s, i) => {
        const color = s.color || COLORS[i % COLORS.length];
        return {
          label: s.label,
          stroke: s.faint ? color + '55' : color,
          width: s.faint ? 1 : 1.5,
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
    const heads = ['', 'Run', 'Algorithm', 'Status', 'Progress', 'Created', 'Reward', 'Loss', 'Validation / eval'];
    const chosen = new Set();
    const compare = el('button', { type: 'button', class: 'compare', disabled: true,
      onclick: () => { location.hash = '#/compare/' + Array.from(chosen).map(encodeURIComponent).join(','); } },
    'Compare selected');
    fill(app, el('section', { class: 'card' },
      el('div', { class: 'card-head' }, el('h1', null, 'Runs'), compare),
      el('div', { class: 'table-wrap' }, el('table', { class: 'runs' },
        el('thead', null, el('tr', null, heads.map((h) => el('th', null, h)))), rows)),
      note));

    function row(run) {
      const href = '#/runs/' + encodeURIComponent(run.id);
      const m = run.latest_metrics || {};
      const [scoreName, scoreValue] = score(m);
      const pick = el('input', { type: 'checkbox', class: 'pick', 'aria-label': 'compare ' + (run.name || run.id),
        checked: chosen.has(run.id), onchange: () => {
          if (pick.checked) chosen.add(run.id); else chosen.delete(run.id);
          compare.disabled = chosen.size < 2;
          compare.textContent = 'Compare selected' + (chosen.size ? ' (' + chosen.size + ')' : '');
        } });
      return el('tr', { class: 'run-row', 'data-run-id': run.id, onclick: (e) => {
        if (!e.target.closest('a') && !e.target.closest('input')) location.hash = href.slice(1);
      } },
      el('td', null, pick),
      el('td', null, el('a', { href: href, title: run.id }, run.name || shortId(run.id))),
      el('td', null, el('span', { class: 'algo' }, run.algorithm)),
      el('td', null, badge(run.status, run.reason)),
      el('td', null, progress(run)),
      el('td', { class: 'nowrap' }, fmtTime(run.created_at)),
      el('td', { class: 'num' }, fmt(m['train/reward'])),
      el('td', { class: 'num' }, fmt(m['train/loss'])),
      el('td', { class: 'num score', title: scoreName || '', 'data-score': scoreName || '' }, fmt(scoreValue)));
    }

    const poll = poller(async () => {
      const body = await api('/v1/runs?limit=100');
      const runs = body.runs || [];
      fill(rows, runs.length ? runs.map(row)
        : el('tr', { class: 'no-runs' }, el('td', { colspan: heads.length, class: 'muted' },
          el('p', null, 'No runs yet. Submit one with the CLI, from a run spec in YAML or JSON (the book\'s run spec reference lists every field):'),
          el('pre', { class: 'text' }, 'KEEL_API_URL=' + location.origin + ' KEEL_API_TOKEN=<token> keel run submit my-run.yaml'),
          el('p', null, 'or POST the spec as JSON to ', el('code', null, '/v1/runs'),
            ' with the header ', el('code', null, 'Authorization: Bearer <token>'),
            '. It appears here as soon as it is queued.'))));
      note.textContent = body.next ? 'Showing the newest ' + runs.length + ' runs.' : '';
      return true;
    }, LIST_EVERY_MS);
    return { stop: poll.stop, resize() {} };
  }

  // ---- one run ----

  // Seconds as "1h 02m", "3m 05s" or "12s".
  function fmtDuration(seconds) {
    if (!Number.isFinite(seconds) || seconds < 0) return '—';
    const s = Math.round(seconds), h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
    if (h > 0) return h + 'h ' + String(m).padStart(2, '0') + 'm';
    if (m > 0) return m + 'm ' + String(r).padStart(2, '0') + 's';
    return r + 's';
  }

  // How long the run has taken (until now while live) and, while live, the time left at the
  // mean recorded step time (else at the mean pace since it was created).
  function timing(run, series) {
    const end = isLive(run) ? Date.now() : new Date(run.updated_at).getTime();
    const elapsed = (end - new Date(run.created_at).getTime()) / 1000;
    let eta = null;
    if (isLive(run) && run.step > 0 && run.total_steps > run.step) {
      const steps = (series.get('timing/train/total_step_time') || []).map((p) => p[1]).filter(Number.isFinite);
      const perStep = steps.length ? steps.reduce((a, b) => a + b, 0) / steps.length : elapsed / run.step;
      eta = perStep * (run.total_steps - run.step);
    }
    return { elapsed: elapsed, eta: eta };
  }

  // The KL penalty's coefficient β of a clipped_pg run (null for other losses).
  function klCoefficient(run) {
    const loss = run.spec && run.spec.training && run.spec.training.loss;
    if (!loss || loss.type !== 'clipped_pg') return null;
    return typeof loss.reference_policy_kl_penalty === 'number' ? loss.reference_policy_kl_penalty : 0.01;
  }

  // A run's metrics by name, fetched from the last step seen on (it may have been partly
  // written) and merged; events' metrics are merged the same way.
  function metricStore(base) {
    const series = new Map(); // name -> [[step, value], ...] in step order
    let fromStep = 0;
    function merge(name, points) {
      const by = new Map((series.get(name) || []).map((p) => [p[0], p]));
      points.forEach((p) => by.set(p[0], p));
      series.set(name, Array.from(by.values()).sort((a, b) => a[0] - b[0]));
      points.forEach((p) => { if (p[0] > fromStep) fromStep = p[0]; });
    }
    return {
      series: series,
      async load() {
        const from = fromStep;
        const body = await api(base + '/metrics' + (from > 0 ? '?from_step=' + from : ''));
        (body.metrics || []).forEach((m) => merge(m.name, m.points || []));
      },
      step(step, metrics) { Object.keys(metrics || {}).forEach((name) => merge(name, [[step, metrics[name]]])); },
    };
  }

  function runView(id) {
    document.title = 'Run ' + shortId(id) + ' · Keel';
    const base = '/v1/runs/' + encodeURIComponent(id);
    const metrics = metricStore(base);
    const series = metrics.series;
    let run = null, extra = '', samplesSeq = 0, samplesShown = null, checkpointsShown = null, events = null;
    const filter = { split: '', step: '' };
    const sampleSteps = new Set();

    const header = el('section', { class: 'card run-header' }, el('p', { class: 'muted' }, 'Loading run…'));
    const bar = settingsBar(() => drawPlots(), (axis) => axis === 'step' || xMapping(series, axis) !== null);
    const cards = {};
    PLOTS.forEach((p) => { cards[p[0]] = plotCard(p[0], p[1]); });
    const klNote = el('span', { class: 'muted kl-note' });
    cards.kl.root.querySelector('.card-head').appendChild(klNote);
    const extraSelect = el('select', { 'aria-label': 'Series', onchange: () => { extra = extraSelect.value; drawPlots(); } });
    cards.extra = plotCard('extra', 'Other series', extraSelect);

    const checkpointRows = el('tbody');
    const checkpointHeads = ['Step', 'Status', 'Created', 'Metrics', 'Download'];
    const specBox = el('pre', { class: 'spec-text' });

    const splitSelect = el('select', { 'aria-label': 'Split', onchange: () => { filter.split = splitSelect.value; loadSamples().catch(report); } },
      option('', 'all splits'), option('train', 'train'), option('validation', 'validation'));
    const stepSelect = el('select', { 'aria-label': 'Step', onchange: () => { filter.step = stepSelect.value; loadSamples().catch(report); } },
      option('', 'all steps'));
    const sampleRows = el('tbody');
    const sampleNote = el('span', { class: 'muted' });
    const sampleHeads = ['Step', 'Split', 'Reward', 'Prompt', 'Turns', 'Ground truth', 'Finish', 'Info'];

    fill(app,
      el('p', { class: 'crumbs' }, el('a', { href: '#/' }, '← All runs')),
      header,
      bar.root,
      el('section', { class: 'plots' }, Object.keys(cards).map((k) => cards[k].root)),
      el('section', { class: 'card checkpoints' },
        el('div', { class: 'card-head' }, el('h2', null, 'Checkpoints')),
        el('div', { class: 'table-wrap' }, el('table', { class: 'checkpoints-table' },
          el('thead', null, el('tr', null, checkpointHeads.map((h) => el('th', null, h)))), checkpointRows))),
      el('section', { class: 'card spec', 'data-spec': '' },
        el('details', null, el('summary', null, el('h2', { class: 'inline' }, 'Run spec')), specBox)),
      el('section', { class: 'card samples' },
        el('div', { class: 'card-head' }, el('h2', null, 'Samples'),
          el('div', { class: 'filters' }, splitSelect, stepSelect, sampleNote)),
        el('div', { class: 'table-wrap' }, el('table', { class: 'samples-table' },
          el('thead', null, el('tr', null, sampleHeads.map((h) => el('th', null, h)))), sampleRows))));

    let stopped = false;
    function report(e) { if (!stopped) showError(e.message || String(e)); }

    function renderHeader() {
      const t = timing(run, series);
      const live = events && events.open ? 'live · following its events' : 'live · refreshing every 3 s';
      fill(header,
        el('div', { class: 'title-row' },
          el('h1', null, run.name || 'Run ' + shortId(run.id)), badge(run.status),
          el('span', { class: 'algo' }, run.algorithm),
          isLive(run) ? el('span', { class: 'muted live' }, live) : null),
        run.reason ? el('p', { class: 'reason' }, ({ failed: 'Failed: ', waiting: 'Waiting for: ' }[run.status] || 'Reason: ') + run.reason) : null,
        el('dl', { class: 'facts' },
          el('div', null, el('dt', null, 'ID'), el('dd', null, el('code', null, run.id))),
          el('div', null, el('dt', null, 'Progress'), el('dd', null, progress(run))),
          el('div', null, el('dt', null, 'Created'), el('dd', null, fmtTime(run.created_at))),
          el('div', null, el('dt', null, 'Duration'), el('dd', { 'data-duration': Math.round(t.elapsed) }, fmtDuration(t.elapsed))),
          isLive(run) ? el('div', null, el('dt', null, 'ETA'),
            el('dd', { 'data-eta': t.eta == null ? '' : Math.round(t.eta) }, t.eta == null ? '—' : fmtDuration(t.eta))) : null,
          el('div', null, el('dt', null, 'Updated'), el('dd', null, fmtTime(run.updated_at)))));
      document.title = (run.name || 'Run ' + shortId(run.id)) + ' · Keel';
      const text = JSON.stringify(run.spec, null, 2);
      if (specBox.textContent !== text) specBox.textContent = text;
      const beta = klCoefficient(run);
      const card = cards.kl.root;
      card.dataset.kl = beta === 0 ? 'off' : (beta == null ? 'none' : 'on');
      klNote.textContent = beta === 0 ? 'KL penalty off (β = 0)' : (beta == null ? '' : 'β = ' + fmt(beta));
    }

    function drawPlots() {
      bar.sync();
      const map = xMapping(series, settings.axis) || ((step) => step);
      const names = Array.from(series.keys()).sort();
      const used = new Set();
      PLOTS.forEach((p) => {
        const picked = p[2](names);
        picked.forEach((n) => used.add(n));
        const label = (n) => (p[3] ? n.slice(STEP_TIME_PREFIX.length) : n);
        const list = picked.map((n) => ({ label: label(n), points: series.get(n) }));
        cards[p[0]].update(list.length ? shaped(list, map, p[3]) : [{ label: p[1], points: [] }], p[3]);
        cards[p[0]].root.dataset.runs = '1';
      });
      const others = names.filter((n) => !used.has(n));
      if (extra && others.indexOf(extra) < 0) others.unshift(extra);
      setOptions(extraSelect, [['', others.length ? 'choose a series…' : 'no other series']]
        .concat(others.map((n) => [n, n])), extra);
      const chosen = [{ label: extra || 'series', points: extra ? series.get(extra) || [] : [] }];
      cards.extra.update(extra ? shaped(chosen, map, false) : chosen, false);
    }

    async function loadCheckpoints() {
      const list = await api(base + '/checkpoints');
      if (stopped) return;
      const key = JSON.stringify(list);
      if (key === checkpointsShown) return;
      checkpointsShown = key;
      const rows = (Array.isArray(list) ? list : []).slice().sort((a, b) => a.step - b.step).map((c) => {
        const m = c.metrics || {};
        const shown = Object.keys(m).filter((n) => /^(validation|eval)\//.test(n) || n === 'train/loss' || n === 'train/reward')
          .sort().slice(0, 4).map((n) => n + ' ' + fmt(m[n])).join(' · ');
        const href = base + '/checkpoints/' + encodeURIComponent(c.id) + '/archive';
        return el('tr', { class: 'checkpoint-row', 'data-checkpoint-id': c.id },
          el('td', { class: 'num' }, String(c.step)),
          el('td', null, c.status),
          el('td', { class: 'nowrap' }, fmtTime(c.created_at * 1000)),
          el('td', null, shown || '—'),
          el('td', null, c.status === 'complete'
            ? el('a', { href: href, download: '', 'data-download': href, title: c.id }, 'tar')
            : el('span', { class: 'muted' }, 'uploading')));
      });
      fill(checkpointRows, rows.length ? rows
        : el('tr', null, el('td', { colspan: checkpointHeads.length, class: 'muted' }, 'No checkpoints kept.')));
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

    // A sample: its reward with the named components that make it up, every turn after the
    // prompt with its role (the model's and the environment's, as multi-turn rollouts record
    // them; the joined completion where no turns were recorded), and what the environment
    // reported besides the reward.
    function sampleRow(s) {
      const text = (v) => (v == null ? el('span', { class: 'muted' }, '—') : el('pre', { class: 'text' }, v));
      const named = Object.keys(s.rewards || {}).sort();
      const reward = el('td', { class: 'num' + (s.reward > 0 ? ' good' : '') }, fmt(s.reward),
        named.length ? el('ul', { class: 'reward-parts' },
          named.map((n) => el('li', { 'data-reward': n }, n + ' ' + fmt(s.rewards[n])))) : null);
      const turns = (s.turns || []).length
        ? el('ol', { class: 'turns' }, s.turns.map((t) => el('li', { class: 'turn turn-' + t.role, 'data-role': t.role },
          el('span', { class: 'role' }, t.role === 'assistant' ? 'model' : t.role), el('pre', { class: 'text' }, t.content))))
        : text(s.completion);
      const tokens = [s.num_prompt_tokens != null ? s.num_prompt_tokens + ' prompt' : null,
        s.num_generated_tokens != null ? s.num_generated_tokens + ' generated' : null,
        s.truncated ? 'truncated' : null].filter((x) => x).join(' · ');
      const info = s.info == null || (typeof s.info === 'object' && !Object.keys(s.info).length) ? el('span', { class: 'muted' }, '—')
        : el('details', { class: 'info' }, el('summary', null, 'info'), el('pre', { class: 'text' }, JSON.stringify(s.info, null, 2)));
      return el('tr', { class: 'sample-row' },
        el('td', { class: 'num' }, String(s.step)),
        el('td', null, s.split),
        reward,
        el('td', null, text(s.prompt)),
        el('td', null, turns, tokens ? el('p', { class: 'muted tokens' }, tokens) : null),
        el('td', null, text(s.ground_truth)),
        el('td', null, s.finish_reason || '—'),
        el('td', null, info));
    }

    // A live run's event stream: each step's metrics are drawn as they are recorded, a
    // status or checkpoint event refreshes the run or its checkpoints. EventSource reconnects
    // by itself (with Last-Event-ID); the poll below goes on slowly meanwhile.
    function follow() {
      if (events || typeof EventSource === 'undefined') return;
      const source = new EventSource(base + '/events');
      events = { source: source, open: false, heard: 0 };
      source.addEventListener('open', () => {
        events.open = true;
        document.body.dataset.live = 'sse';
        document.body.dataset.sseOpened = 'true';
      });
      source.addEventListener('error', () => {
        events.open = false;
        document.body.dataset.live = 'polling';
        if (source.readyState === EventSource.CLOSED) { events = null; }
      });
      source.addEventListener('step', (e) => {
        const record = JSON.parse(e.data);
        metrics.step(record.event.step, record.event.metrics);
        events.heard++;
        document.body.dataset.sseEvents = String(events.heard);
        if (run && record.event.step > run.step) run.step = record.event.step;
        if (run) renderHeader();
        drawPlots();
      });
      source.addEventListener('status', () => { api(base).then((r) => { run = r; renderHeader(); }).catch(report); });
      source.addEventListener('checkpoint', () => { loadCheckpoints().catch(report); });
    }

    function unfollow() {
      if (events) { events.source.close(); events = null; }
    }

    // The run first: when it is final, the metrics and samples fetched after it are complete.
    let polls = 0;
    const poll = poller(async () => {
      run = await api(base);
      const live = isLive(run);
      if (live) follow(); else unfollow();
      polls++;
      // Following the events, the full refresh runs every fifth poll only.
      if (polls === 1 || !events || !events.open || polls % 5 === 0 || !live) {
        await Promise.all([metrics.load(), loadSamples(), loadCheckpoints()]);
      }
      if (!stopped) { renderHeader(); drawPlots(); }
      return live;
    }, RUN_EVERY_MS);

    return {
      stop() { stopped = true; poll.stop(); unfollow(); },
      resize() { Object.keys(cards).forEach((k) => cards[k].resize()); },
    };
  }

  // ---- several runs overlaid ----

  function compareView(ids) {
    document.title = 'Compare ' + ids.length + ' runs · Keel';
    const runs = ids.map((id) => ({ id: id, base: '/v1/runs/' + encodeURIComponent(id), run: null }));
    runs.forEach((r) => { r.metrics = metricStore(r.base); });
    const bar = settingsBar(() => drawPlots(),
      (axis) => axis === 'step' || runs.every((r) => xMapping(r.metrics.series, axis) !== null));
    const cards = {};
    const overlaid = PLOTS.filter((p) => !p[3]);
    overlaid.forEach((p) => { cards[p[0]] = plotCard(p[0], p[1]); });
    const legend = el('ul', { class: 'compare-legend' });
    fill(app,
      el('p', { class: 'crumbs' }, el('a', { href: '#/' }, '← All runs')),
      el('section', { class: 'card' }, el('h1', null, 'Comparing ' + ids.length + ' runs'), legend),
      bar.root,
      el('section', { class: 'plots' }, Object.keys(cards).map((k) => cards[k].root)));

    function drawPlots() {
      bar.sync();
      fill(legend, runs.map((r, i) => el('li', { 'data-run-id': r.id },
        el('span', { class: 'swatch', style: 'background:' + COLORS[i % COLORS.length] }),
        el('a', { href: '#/runs/' + encodeURIComponent(r.id) }, r.run ? (r.run.name || shortId(r.id)) : shortId(r.id)),
        r.run ? ' ' : null, r.run ? badge(r.run.status) : null)));
      overlaid.forEach((p) => {
        const list = [];
        runs.forEach((r, i) => {
          const names = Array.from(r.metrics.series.keys()).sort();
          const first = p[2](names)[0];
          if (!first) return;
          const map = xMapping(r.metrics.series, settings.axis) || ((step) => step);
          const name = r.run ? (r.run.name || shortId(r.id)) : shortId(r.id);
          list.push.apply(list, shaped([{ label: name + ': ' + first, color: COLORS[i % COLORS.length],
            points: r.metrics.series.get(first) }], map, false));
        });
        cards[p[0]].update(list.length ? list : [{ label: p[1], points: [] }], false);
        cards[p[0]].root.dataset.runs = String(new Set(list.map((s) => s.color)).size);
      });
    }

    const poll = poller(async () => {
      await Promise.all(runs.map(async (r) => { r.run = await api(r.base); await r.metrics.load(); }));
      drawPlots();
      return runs.some((r) => isLive(r.run));
    }, LIST_EVERY_MS);
    return { stop: poll.stop, resize() { Object.keys(cards).forEach((k) => cards[k].resize()); } };
  }

  // ---- routing ----

  let view = null;

  function route() {
    if (view) view.stop();
    delete document.body.dataset.ready;
    clearError();
    readSettings();
    const match = /^#\/runs\/([^/?#]+)/.exec(location.hash);
    const several = /^#\/compare\/([^?#]+)/.exec(location.hash);
    if (match) view = runView(decodeURIComponent(match[1]));
    else if (several) view = compareView(several[1].split(',').filter(Boolean).map(decodeURIComponent));
    else view = listView();
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
