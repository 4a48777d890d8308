// The SPECTRAL tab. TensorBoard loads this module in the plugin's iframe (whose base URL is
// data/plugin/spectral/) and calls render(). Every view asks its route for JSON over the runs
// ticked in the run selector and redraws; a poll every POLL_MS ms redraws what changed, so a run
// being written gains points while the page is open.

import {PALETTE, barChart, depthBar, format, heatmap, legend, lineChart, viridis} from './chart.js';

const POLL_MS = 3000;
const MAX_PANELS = 4; // heatmaps and bar panels drawn per view (one per run)
const MAX_ALERT_ROWS = 200; // rows of the alerts table per run
const DASHES = ['', '7 3', '2 3', '9 3 2 3', '4 2', '1 2'];
const GLYPHS = {MLP_up: 'MLP↑', MLP_down: 'MLP↓'};
const glyph = (role) => GLYPHS[role] || role;

// Each view's choices; `stack` is the stack (enc, dec, text, vision...) a view of one layer or
// one role shows where a ticked run has several (a run with one stack is shown in any).
const state = {
  catalog: [],
  runs: [], // the ticked runs
  ticked: false, // whether a catalog with runs has ticked the first MAX_PANELS
  wave: {metric: 'compression', role: 'Q', stack: ''},
  byRole: {metric: 'stable_rank', layer: 0, stack: ''},
  byLayer: {metric: 'stable_rank', role: 'Q', stack: ''},
  depth: {metric: 'alpha', role: 'Q', step: null},
  bars: {metric: 'compression', step: null, stack: ''},
  heads: {metric: 'qk_spectral_norm', step: null, layer: 0, stack: ''},
  diff: {metric: null, baseline: null, x: 'step', layer: 0, role: 'Q', stack: ''},
  alerts: {},
};
const drawn = {}; // view -> the JSON last drawn, to skip redraws of unchanged data
const panels = {};
const oneStep = new Set(); // [run, metric, where] of series the server said have one point
let polling = false;

export async function render() {
  const style = document.createElement('link');
  style.rel = 'stylesheet';
  style.href = './static/style.css';
  document.head.appendChild(style);
  document.body.innerHTML = `
    <header><h1>Spectral</h1><div id="run-selector" class="runs"></div>
      <span id="status" class="status"></span></header>
    <main id="views"></main>`;
  const views = document.getElementById('views');
  for (const [view, title, blurb] of [
    ['wave', 'Compression wave', 'metric over layer × step for one role, a heatmap per run; hover for values'],
    ['byRole', 'Metric vs step, one layer', 'one colour per role; one line style per run'],
    ['byLayer', 'Metric vs step, one role', 'one line per layer, coloured by relative depth'],
    ['depth', 'Metric vs relative depth', 'at the step of the slider (default: the last), runs overlaid'],
    ['diff', 'Difference against a baseline run', 'aligned as spectral-callbacks plot --kind metric-diff aligns it'],
    ['bars', 'Metric by layer × role', 'at the step of the slider (default: the last), a panel per run'],
    ['heads', 'Attention heads', 'a QK/OV circuit metric (circuits=True) by layer × head at the step of the slider (default: the last), a heatmap per run; below, each head of one layer vs step'],
    ['alerts', 'Alerts', 'what the monitor’s alert rules raised in each ticked run, newest first'],
  ]) {
    const panel = document.createElement('section');
    // The views with a panel per run span the page (their panels side by side where they fit):
    // in a column of the grid the bars of four runs stood ~1,000 px tall beside a chart of 450.
    // The others pair up, depth beside diff.
    panel.className = 'panel' + (['wave', 'bars', 'alerts', 'heads'].includes(view) ? ' wide' : '');
    panel.dataset.view = view;
    panel.innerHTML = `<h2>${title}</h2><p class="blurb">${blurb}</p><div class="controls"></div>
      <div class="plots"></div><div class="message"></div>`;
    views.appendChild(panel);
    panels[view] = panel;
  }
  await refresh();
  setInterval(() => { if (!polling) refresh(); }, POLL_MS);
}

async function getJson(route, params) {
  const query = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    for (const item of [].concat(v)) if (item !== null && item !== undefined) query.append(k, item);
  }
  const response = await fetch(`${route}?${query}`);
  const text = await response.text();
  if (!response.ok) throw new Error(text);
  return JSON.parse(text);
}

async function refresh() {
  polling = true;
  try {
    const {runs, role_order: roleOrder} = await getJson('runs', {});
    state.catalog = runs;
    state.roleOrder = roleOrder || [];
    const names = runs.map((r) => r.run);
    // Only the first catalog with runs ticks runs (an empty logdir's come before it): a run the
    // user unticked, the last one too, stays so.
    if (!state.ticked && names.length) {
      state.runs = names.slice(0, MAX_PANELS);
      state.ticked = true;
    }
    state.runs = state.runs.filter((r) => names.includes(r));
    drawRunSelector(names);
    if (!names.length) {
      setStatus('no run with spectral scalars (spectral_<metric>/L<layer>/<role>) in this logdir yet');
      for (const view of Object.keys(panels)) clear(view);
      return;
    } else {
      setStatus(`${state.runs.length} of ${names.length} run${names.length === 1 ? '' : 's'} · updated ${new Date().toLocaleTimeString()}`);
    }
    await Promise.all(Object.keys(panels).map((view) => update(view)));
  } catch (error) {
    setStatus('could not reach TensorBoard: ' + error.message);
  } finally {
    polling = false;
  }
}

function setStatus(text) { document.getElementById('status').textContent = text; }

/** A role's colour: the server's (the CLI's palette), so it never depends on which runs are ticked. */
function roleColor(role) {
  for (const entry of state.catalog) if (entry.role_colors && entry.role_colors[role]) return entry.role_colors[role];
  return '#444';
}

/** A run's colour: fixed by its place among the logdir's runs (as its border in the run list),
 * so ticking another run recolours nothing. */
function runColor(run) {
  const index = state.catalog.findIndex((r) => r.run === run);
  return PALETTE[Math.max(index, 0) % PALETTE.length];
}

/** A stack's line style (the server's, fixed by name). */
function stackDash(stack) {
  for (const entry of state.catalog) if (entry.stack_dashes && stack in entry.stack_dashes) return entry.stack_dashes[stack];
  return '';
}

function ticked() { return state.catalog.filter((r) => state.runs.includes(r.run)); }

function union(key) {
  const chosen = ticked();
  const values = new Set(chosen.flatMap((r) => r[key]));
  if (key === 'roles') return state.roleOrder.filter((v) => values.has(v)); // the server's one order
  const order = chosen.length ? chosen[0][key] : [];
  return [...order.filter((v) => values.has(v)), ...[...values].filter((v) => !order.includes(v)).sort()];
}

/** The metrics a view can show: the logged ones, and compression where stable rank is logged
 * (the server computes it, as the command line does). */
function metricsOf(compression = false) {
  const metrics = union('metrics');
  return compression && metrics.includes('stable_rank') && !metrics.includes('compression') ? [...metrics, 'compression'] : metrics;
}

/** `value` when `options` offer it, else the first of `preferred` they offer, else their first:
 * a select never stands blank on a value the ticked runs do not have. */
function valid(value, options, ...preferred) {
  const values = options.map((o) => (Array.isArray(o) ? o[0] : o));
  if (values.some((v) => v === value)) return value;
  return preferred.find((p) => values.includes(p)) ?? (values.length ? values[0] : value);
}

/** The named stacks of the ticked runs, each run's in the server's order (enc before dec). */
function stacksTicked() { return [...new Set(ticked().flatMap((r) => r.stacks))]; }

/** The stack a view shows: its choice while a ticked run has it, else the first ('' where no
 * ticked run has several stacks). */
function stackOf(s) {
  const stacks = stacksTicked();
  s.stack = valid(s.stack, stacks, 'dec', 'text');
  if (!stacks.length) s.stack = '';
  return s.stack;
}

function stackSelect(view) {
  const stacks = stacksTicked();
  return stacks.length ? [select('stack', stacks, state[view].stack, setter(view, 'stack'))] : [];
}

/** The layers of the ticked runs in `stack` (a run with one stack: all its layers). */
function layersIn(stack) {
  const layers = new Set(ticked().flatMap((r) => r.stack_layers[r.stacks.length ? stack : ''] || []));
  return [...layers].sort((a, b) => a - b);
}

/** "dec L3" for a layer of a named stack, "L3" else. */
function place(stack, layer) { return (stack ? stack + ' ' : '') + 'L' + layer; }

function drawRunSelector(names) {
  const box = document.getElementById('run-selector');
  const key = names.join('\n') + '|' + state.runs.join('\n');
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  box.innerHTML = '<b>Runs</b>';
  names.forEach((name) => {
    const label = document.createElement('label');
    const input = document.createElement('input');
    input.type = 'checkbox';
    input.value = name;
    input.checked = state.runs.includes(name);
    input.onchange = () => {
      state.runs = names.filter((n) => n === name ? input.checked : state.runs.includes(n));
      box.dataset.key = '';
      refresh();
    };
    label.appendChild(input);
    label.append(' ' + name);
    label.style.borderColor = runColor(name);
    box.appendChild(label);
  });
}

// --- controls ---------------------------------------------------------------------------------

function select(label, options, value, onchange) {
  const wrap = document.createElement('label');
  wrap.textContent = label + ' ';
  const input = document.createElement('select');
  for (const option of options) {
    const [v, text] = Array.isArray(option) ? option : [option, option];
    const node = document.createElement('option');
    node.value = v;
    node.textContent = text;
    input.appendChild(node);
  }
  input.value = value;
  input.onchange = () => onchange(input.value);
  wrap.appendChild(input);
  return wrap;
}

function slider(label, steps, step, onchange) {
  const wrap = document.createElement('label');
  wrap.className = 'slider';
  const index = step === null ? steps.length - 1 : Math.max(0, steps.findLastIndex((s) => s <= step));
  wrap.innerHTML = `${label} <input type="range" min="0" max="${Math.max(steps.length - 1, 0)}" value="${index}">
    <output>${step === null ? `last (${steps[steps.length - 1] ?? '–'})` : steps[index]}</output>`;
  const input = wrap.querySelector('input');
  input.oninput = () => {
    const i = +input.value;
    wrap.querySelector('output').textContent = i === steps.length - 1 ? `last (${steps[i]})` : steps[i];
  };
  input.onchange = () => onchange(+input.value === steps.length - 1 ? null : steps[+input.value]);
  return wrap;
}

/** Rebuild a view's controls only when their options or values changed (a poll must not close
 * a drop-down the user has open). */
function controls(view, signature, makeItems) {
  const box = panels[view].querySelector('.controls');
  const key = JSON.stringify(signature);
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  box.textContent = '';
  makeItems().forEach((item) => box.appendChild(item));
}

function setter(view, key, parse = (v) => v) {
  return (value) => { state[view][key] = parse(value); drawn[view] = null; update(view); };
}

function message(view, text) { panels[view].querySelector('.message').textContent = text; }

function plots(view) { return panels[view].querySelector('.plots'); }

/** Cells for `count` charts side by side in `parent`, in as few rows as the width allows and as
 * many charts in each (four runs: two rows of two, not three and one); `cell()` makes the next one.
 * A cell's share is a percentage, so a scroll bar that comes later cannot push a chart to the next
 * row; the chart's `width` leaves room for it. */
function sideBySide(parent, count) {
  const MIN_WIDTH = 420, GAP = 12, SCROLLBAR = 20;
  const row = document.createElement('div');
  row.className = 'side-by-side';
  parent.appendChild(row);
  const room = parent.clientWidth || 620;  // 0 where the page is not laid out
  const most = Math.max(1, Math.floor((room + GAP) / (MIN_WIDTH + GAP)));
  const perRow = Math.ceil(Math.max(count, 1) / Math.ceil(Math.max(count, 1) / most));
  const share = `calc((100% - ${GAP * (perRow - 1)}px) / ${perRow})`;
  const cell = () => {
    const box = document.createElement('div');
    box.className = 'cell';
    box.style.flexBasis = share;
    row.appendChild(box);
    return box;
  };
  return {cell, width: Math.max(MIN_WIDTH, Math.floor((room - GAP * (perRow - 1)) / perRow) - SCROLLBAR)};
}

function plotBox(parent, title = '') {
  const box = document.createElement('div');
  box.className = 'plot';
  if (title) {
    const heading = document.createElement('h3');
    heading.textContent = title;
    parent.appendChild(heading);
  }
  parent.appendChild(box);
  return box;
}

// --- views ------------------------------------------------------------------------------------

/** A view with nothing on it: no chart, no count, so the next answer draws afresh. */
function clear(view, text = '') {
  plots(view).textContent = '';
  panels[view].dataset.points = 0;
  drawn[view] = null;
  message(view, text);
}

async function update(view) {
  if (!state.runs.length) {  // no request that must fail ("pass at least one run")
    clear(view, state.catalog.length ? 'tick a run above' : '');
    return;
  }
  try {
    await VIEWS[view]();
  } catch (error) {
    clear(view, error.message);  // no stale chart under the error; the next success clears it
  }
}

/** Fetch a view's JSON; draw(json) only when it differs from what is on screen. */
async function fetchAndDraw(view, route, params, draw) {
  const json = await getJson(route, params);
  const key = JSON.stringify([params, json]);
  if (drawn[view] === key) return;
  drawn[view] = key;
  plots(view).textContent = '';
  message(view, '');
  draw(json);
}

const VIEWS = {
  async wave() {
    const s = state.wave;
    const metrics = metricsOf(true), roles = union('roles');
    s.metric = valid(s.metric, metrics, 'compression', 'stable_rank');
    s.role = valid(s.role, roles, 'Q');
    const stack = stackOf(s);
    controls('wave', [s, metrics, roles, stacksTicked()], () => [
      select('metric', metrics, s.metric, setter('wave', 'metric')),
      select('role', roles.map((r) => [r, glyph(r)]), s.role, setter('wave', 'role')),
      ...stackSelect('wave'),
    ]);
    const runs = state.runs.slice(0, MAX_PANELS);
    // A heatmap per run: a run that did not log the metric or the role (another ticked run did)
    // is not asked (the server answers 400 for what a run never logged) and says so in its panel.
    const logs = (run) => {
      const entry = state.catalog.find((r) => r.run === run) || {metrics: [], roles: []};
      const metric = entry.metrics.includes(s.metric) || (s.metric === 'compression' && entry.metrics.includes('stable_rank'));
      return metric && entry.roles.includes(s.role);
    };
    const all = await Promise.all(runs.map((run) => logs(run)
      ? getJson('wave', {run, metric: s.metric, role: s.role, stack})
      : {run, steps: [], left_out: null}));
    const key = JSON.stringify([s, all, state.runs]);  // the runs left out are said too
    if (drawn.wave === key) return;
    drawn.wave = key;
    plots('wave').textContent = '';
    let points = 0;
    for (const json of all) {
      const named = (ticked().find((r) => r.run === json.run) || {stacks: []}).stacks.length;
      const box = plotBox(plots('wave'), named ? `${json.run} · ${stack}` : json.run);
      if (!json.steps.length) {
        // as `spectral-callbacks plot` says when it leaves a run out (one snapshot: no reference)
        box.textContent = `no ${s.metric} of ${glyph(s.role)} in ${json.run}` + (json.left_out ? `: ${json.left_out}` : '');
        continue;
      }
      points += heatmap(box, {...json, label: s.metric, height: Math.min(420, 60 + 14 * json.layers.length)});
    }
    panels.wave.dataset.points = points;
    message('wave', runs.length ? '' : 'tick a run above');
    notDrawn('wave', 'heatmap');
  },

  async byRole() {
    const s = state.byRole;
    const metrics = metricsOf();
    s.metric = valid(s.metric, metrics, 'stable_rank');
    const stack = stackOf(s);
    const layers = layersIn(stack);
    s.layer = valid(s.layer, layers, 0);
    controls('byRole', [s, metrics, layers, stacksTicked()], () => [
      select('metric', metrics, s.metric, setter('byRole', 'metric')),
      ...stackSelect('byRole'),
      select('layer', layers, s.layer, setter('byRole', 'layer', Number)),
    ]);
    const where = place(stack, s.layer);
    await fetchAndDraw('byRole', 'by_role', {run: state.runs, metric: s.metric, layer: s.layer, stack}, ({series}) => {
      // Chart order (Q, K, V, O, MLP↑, MLP↓, then the others), whichever run comes first.
      const order = union('roles'); // the server's order, the command line's
      const roles = [...new Set(series.map((x) => x.role))].sort((p, q) => order.indexOf(p) - order.indexOf(q));
      const lines = series.map((x) => ({
        label: `${state.runs.length > 1 ? x.run + ' · ' : ''}${glyph(x.role)}`,
        color: roleColor(x.role), low: x.low, high: x.high,
        dash: DASHES[state.runs.indexOf(x.run) % DASHES.length], xs: x.steps, ys: x.values}));
      panels.byRole.dataset.points = lineChart(plotBox(plots('byRole')), {
        series: lines, xLabel: 'optimizer step', yLabel: `${s.metric} of ${where}`});
      legend(plots('byRole'), roles.map((r) => ({label: glyph(r), color: roleColor(r)})), 'role');
      spreadNote('byRole', series);
      runLegend('byRole');
      if (!series.length) message('byRole', `no ${s.metric} at ${where}`);
    });
  },

  async byLayer() {
    const s = state.byLayer;
    const metrics = metricsOf(), roles = union('roles');
    s.metric = valid(s.metric, metrics, 'stable_rank');
    s.role = valid(s.role, roles, 'Q');
    const stack = stackOf(s);
    controls('byLayer', [s, metrics, roles, stacksTicked()], () => [
      select('metric', metrics, s.metric, setter('byLayer', 'metric')),
      select('role', roles.map((r) => [r, glyph(r)]), s.role, setter('byLayer', 'role')),
      ...stackSelect('byLayer'),
    ]);
    await fetchAndDraw('byLayer', 'by_layer', {run: state.runs, metric: s.metric, role: s.role, stack}, ({series}) => {
      const lines = series.map((x) => ({
        label: `${state.runs.length > 1 ? x.run + ' · ' : ''}L${x.layer}`, color: viridis(x.depth),
        low: x.low, high: x.high,
        dash: DASHES[state.runs.indexOf(x.run) % DASHES.length], xs: x.steps, ys: x.values}));
      panels.byLayer.dataset.points = lineChart(plotBox(plots('byLayer')), {
        series: lines, xLabel: 'optimizer step', yLabel: `${s.metric} of ${glyph(s.role)}${stack ? ' in ' + stack : ''}`});
      depthBar(plots('byLayer'), `relative depth i/(L−1)${stack ? ' within the stack' : ''}`);
      spreadNote('byLayer', series);
      runLegend('byLayer');
      if (!series.length) message('byLayer', `no ${s.metric} of ${glyph(s.role)}${stack ? ' in ' + stack : ''}`);
    });
  },

  async depth() {
    const s = state.depth;
    const metrics = metricsOf(), roles = union('roles');
    s.metric = valid(s.metric, metrics, 'alpha', 'stable_rank');
    s.role = valid(s.role, roles, 'Q');
    const params = {run: state.runs, metric: s.metric, role: s.role, step: s.step};
    const json = await getJson('depth', params);
    controls('depth', [s, metrics, roles, json.steps], () => [
      select('metric', metrics, s.metric, setter('depth', 'metric')),
      select('role', roles.map((r) => [r, glyph(r)]), s.role, setter('depth', 'role')),
      slider('step', json.steps, s.step, setter('depth', 'step')),
    ]);
    const key = JSON.stringify([params, json]);
    if (drawn.depth === key) return;
    drawn.depth = key;
    plots('depth').textContent = '';
    // One curve per run and stack: the run's colour, the stack's line style.
    const lines = json.runs.map((r) => ({
      label: r.run + (r.stack ? ` · ${r.stack}` : '') + (r.steps.length ? ` (step ${Math.max(...r.steps)})` : ''),
      color: runColor(r.run), dash: stackDash(r.stack), low: r.low, high: r.high,
      xs: r.depths, ys: r.values, markers: true}));
    panels.depth.dataset.points = lineChart(plotBox(plots('depth')), {
      series: lines, xLabel: 'relative depth i / (L − 1) within each stack', yLabel: `${s.metric} of ${glyph(s.role)}`});
    const drawnLines = lines.filter((l) => l.ys.length);
    legend(plots('depth'), drawnLines.map((l) => ({label: l.label, color: l.color, dash: l.dash})), 'run');
    spreadNote('depth', json.runs);
    const missing = [...new Set(json.runs.filter((r) => !r.values.length).map((r) => r.run))];
    message('depth', missing.length ? `no ${s.metric} of ${glyph(s.role)} in ${missing.join(', ')}` : '');
  },

  async bars() {
    const s = state.bars;
    const metrics = metricsOf(true);
    s.metric = valid(s.metric, metrics, 'compression', 'stable_rank');
    const stack = stackOf(s);
    const params = {run: state.runs.slice(0, MAX_PANELS), metric: s.metric, step: s.step, stack};
    const json = await getJson('bars', params);
    controls('bars', [s, metrics, json.steps, stacksTicked()], () => [
      select('metric', metrics, s.metric, setter('bars', 'metric')),
      ...stackSelect('bars'),
      slider('step', json.steps, s.step, setter('bars', 'step')),
    ]);
    const key = JSON.stringify([params, json, state.runs]);  // the runs left out are said too
    if (drawn.bars === key) return;
    drawn.bars = key;
    plots('bars').textContent = '';
    let points = 0;
    // Only the roles the panels hold: a role no ticked run has gets no legend entry.
    const roles = union('roles').filter((r) => json.runs.some((panel) => panel.roles.includes(r)));
    const colors = Object.fromEntries(roles.map((r) => [r, roleColor(r)]));
    const {cell, width} = sideBySide(plots('bars'), json.runs.length);
    for (const panel of json.runs) {
      const named = (ticked().find((r) => r.run === panel.run) || {stacks: []}).stacks.length;
      const title = named ? `${panel.run} · ${stack}` : panel.run;
      const box = plotBox(cell(), panel.layers.length ? `${title} · step ${panel.step}` : title);
      if (!panel.layers.length) {
        box.textContent = `no ${s.metric} in ${title}` + (panel.left_out ? `: ${panel.left_out}` : '');
        continue;
      }
      points += barChart(box, {groups: panel.layers, keys: panel.roles, values: panel.values, spread: panel.spread,
                               colors, xLabel: 'layer', yLabel: s.metric, width, height: 220});
    }
    panels.bars.dataset.points = points;
    legend(plots('bars'), roles.map((r) => ({label: glyph(r), color: colors[r]})), 'role');
    for (const over of spreadsOver(json.runs.flatMap((panel) => Object.values(panel.spread || {})))) {
      note('bars', `a bar of a layer’s ${over} is their mean, its whisker the min … max over the ${over}`);
    }
    notDrawn('bars', 'bar panel');
  },

  async heads() {
    const s = state.heads;
    const metrics = union('head_metrics');
    if (!metrics.length) {
      clear('heads');
      note('heads', 'no ticked run logged per-head circuits: train with circuits=True');
      return;
    }
    s.metric = valid(s.metric, metrics, 'qk_spectral_norm');
    const stack = stackOf(s);
    const params = {run: state.runs.slice(0, MAX_PANELS), metric: s.metric, step: s.step, stack};
    const json = await getJson('heads', params);
    // the layers with heads (a layer without attention has none: asking for it is an error)
    const layers = [...new Set(json.runs.flatMap((panel) => panel.layers))].sort((a, b) => a - b);
    s.layer = valid(s.layer, layers, 0);
    const lines = await getJson('by_head', {run: state.runs, metric: s.metric, layer: s.layer, stack});
    controls('heads', [s, metrics, layers, json.steps, stacksTicked()], () => [
      select('metric', metrics, s.metric, setter('heads', 'metric')),
      ...stackSelect('heads'),
      slider('step', json.steps, s.step, setter('heads', 'step')),
      select('layer of the lines', layers, s.layer, setter('heads', 'layer', Number)),
    ]);
    const key = JSON.stringify([params, json, lines]);
    if (drawn.heads === key) return;
    drawn.heads = key;
    plots('heads').textContent = '';
    message('heads', '');
    let points = 0;
    for (const panel of json.runs) {
      const named = (ticked().find((r) => r.run === panel.run) || {stacks: []}).stacks.length;
      const title = named ? `${panel.run} · ${stack}` : panel.run;
      const box = plotBox(plots('heads'), panel.layers.length ? `${title} · step ${panel.step}` : title);
      if (!panel.layers.length) { box.textContent = `no per-head ${s.metric} in ${title}`; continue; }
      points += heatmap(box, {layers: panel.layers, steps: panel.heads, values: panel.values, label: s.metric,
                              xLabel: 'head', xName: 'head', categories: true, width: 900,
                              height: Math.min(420, 60 + 18 * panel.layers.length)});
    }
    const series = lines.series.map((x) => ({
      label: `${state.runs.length > 1 ? x.run + ' · ' : ''}H${x.head}`, color: PALETTE[x.head % PALETTE.length],
      dash: DASHES[state.runs.indexOf(x.run) % DASHES.length], xs: x.steps, ys: x.values}));
    if (series.length) {
      points += lineChart(plotBox(plots('heads'), `each head of ${place(stack, s.layer)}`), {
        series, xLabel: 'optimizer step', yLabel: `${s.metric} of ${place(stack, s.layer)}`});
      const heads = [...new Set(lines.series.map((x) => x.head))];
      legend(plots('heads'), heads.map((h) => ({label: `H${h}`, color: PALETTE[h % PALETTE.length]})), 'head');
    }
    panels.heads.dataset.points = points;
  },

  async diff() {
    const s = state.diff;
    const scalars = union('scalars').filter((t) => !t.startsWith('spectral_monitor/') && !t.startsWith('spectral_alerts/') && t !== 'epoch');
    const metrics = union('metrics');
    s.metric = valid(s.metric, [...scalars, ...metrics], scalars.find((t) => /loss/.test(t)), scalars[0], metrics[0]);
    if (s.metric === undefined) s.metric = null;
    const spectral = metrics.includes(s.metric) && !scalars.includes(s.metric);
    const stack = stackOf(s);
    const layers = layersIn(stack);
    if (spectral) s.layer = valid(s.layer, layers, 0);
    // Only runs that logged the chosen series can be the baseline or be compared: asking for a
    // difference against a run without it could only fail.
    const has = (run) => {
      const entry = state.catalog.find((r) => r.run === run);
      if (!entry) return false;
      if (!spectral) return entry.scalars.includes(s.metric);
      const own = entry.stack_layers[entry.stacks.length ? stack : ''] || [];
      return entry.metrics.includes(s.metric) && own.includes(s.layer) && entry.roles.includes(s.role);
    };
    const able = state.runs.filter(has);
    // A run with one point of the series (an analyzed model) is no baseline curve: once the
    // server has said so, another run is the default baseline (unless this one was picked).
    const seriesKey = (run) => JSON.stringify([run, s.metric, spectral ? [stack, s.layer, s.role] : null]);
    const curves = able.filter((run) => !oneStep.has(seriesKey(run)));
    if (!able.includes(s.baseline) || (!s.picked && oneStep.has(seriesKey(s.baseline)) && curves.length)) {
      s.baseline = curves[0] || able[0] || null;
      s.picked = false;
    }
    const xs = ['step', ...scalars.filter((t) => t !== s.metric)];
    if (!xs.includes(s.x)) s.x = 'step';
    controls('diff', [s, scalars, metrics, state.runs, layers, union('roles'), stacksTicked()], () => [
      select('metric', [...scalars, ...metrics], s.metric, setter('diff', 'metric')),
      ...(spectral ? [...stackSelect('diff'), select('layer', layers, s.layer, setter('diff', 'layer', Number)),
                      select('role', union('roles').map((r) => [r, glyph(r)]), s.role, setter('diff', 'role'))] : []),
      select('baseline', able, s.baseline, (run) => { s.picked = true; setter('diff', 'baseline')(run); }),
      select('x', xs, s.x, setter('diff', 'x')),
    ]);
    const what = spectral ? `${s.metric} of ${place(stack, s.layer)} ${glyph(s.role)}` : s.metric;
    if (able.length < 2 || s.metric === null) {
      clear('diff', state.runs.length < 2 ? 'tick at least two runs: the baseline and one to compare'
        : `fewer than two ticked runs have ${what}: tick another, or pick another metric`);
      return;
    }
    const params = {run: able, baseline: s.baseline, metric: s.metric, x: s.x,
                    layer: spectral ? s.layer : null, role: spectral ? s.role : null, stack: spectral ? stack : null};
    await fetchAndDraw('diff', 'diff', params, ({series, left_out: leftOut}) => {
      if (leftOut) {  // the baseline has one point: say so, and default to another next time
        oneStep.add(seriesKey(s.baseline));
        message('diff', leftOut);
        panels.diff.dataset.points = 0;
        return;
      }
      const lines = series.map((x) => ({label: x.run, color: runColor(x.run), xs: x.x, ys: x.values}));
      panels.diff.dataset.points = lineChart(plotBox(plots('diff')), {
        series: lines, xLabel: s.x === 'step' ? 'optimizer step' : s.x,
        yLabel: `Δ ${what} (run − ${s.baseline})`, zeroLine: true});
      legend(plots('diff'), [{label: `${s.baseline} (baseline)`, color: '#000'},
                             ...lines.map((l) => ({label: l.label, color: l.color}))], 'run');
    });
  },

  async alerts() {
    await fetchAndDraw('alerts', 'alerts', {run: state.runs}, ({runs}) => {
      let shown = 0;
      for (const entry of runs) {
        const kinds = Object.entries(entry.counts).filter(([, n]) => n > 0).map(([k, n]) => `${k} ${n}`);
        const head = !entry.counted ? `${entry.run} · alerts off (no spectral_alerts counts)`
          : entry.total ? `${entry.run} · ${entry.total} alert${entry.total > 1 ? 's' : ''} (${kinds.join(', ')})`
          : `${entry.run} · no alerts up to step ${entry.step}`;
        const box = plotBox(plots('alerts'), head);
        if (!entry.alerts.length) continue;
        shown += alertTable(box, entry.alerts.slice(0, MAX_ALERT_ROWS));
        if (entry.alerts.length < entry.total) {
          const more = document.createElement('p');
          more.className = 'blurb';
          more.textContent = `${entry.alerts.length} of ${entry.total} shown: TensorBoard keeps 10 text entries per run ` +
            'unless started with --samples_per_plugin text=0';
          box.appendChild(more);
        }
      }
      panels.alerts.dataset.points = shown;
      // An empty state, not an error: said in the panel, not in its (red) message line.
      if (!runs.some((r) => r.counted)) note('alerts', 'no ticked run counts alerts: they were off (alerts=None), or the run was written without them');
      else if (!shown) note('alerts', 'no alerts in the ticked runs');
    });
  },
};

// `unit` says what value and threshold are: a fraction (rank_collapse), a factor (sigma_growth), an ESD α.
const ALERT_COLUMNS = [['step', 'step'], ['kind', 'kind'], ['matrix', 'matrix'], ['stack', 'stack'], ['layer', 'layer'],
                       ['role', 'role'], ['value', 'value'], ['threshold', 'threshold'], ['unit', 'unit'],
                       ['since_step', 'since step']];

/** The alerts of one run as a table (step, kind, matrix, stack, layer, role, value, threshold, unit, since). */
function alertTable(box, alerts) {
  const table = document.createElement('table');
  table.className = 'alerts';
  const extra = Object.keys(alerts[0]).filter((k) => !ALERT_COLUMNS.some(([c]) => c === k));
  // a model with one stack has no stack to name: no empty column
  const shown = ALERT_COLUMNS.filter(([c]) => c !== 'stack' || alerts.some((a) => a.stack));
  const columns = [...shown, ...extra.map((k) => [k, k.replace(/_/g, ' ')])];
  table.innerHTML = '<thead><tr>' + columns.map(([, t]) => `<th>${t}</th>`).join('') + '</tr></thead>';
  const body = document.createElement('tbody');
  for (const alert of alerts) {
    const row = document.createElement('tr');
    row.className = 'alert';
    for (const [key] of columns) {
      const cell = document.createElement('td');
      const v = alert[key];
      cell.textContent = v === null || v === undefined ? '' : typeof v === 'number' && !Number.isInteger(v) ? format(v) : v;
      row.appendChild(cell);
    }
    body.appendChild(row);
  }
  table.appendChild(body);
  box.appendChild(table);
  return alerts.length;
}

/** Say which ticked runs a view with one panel per run leaves out (it draws MAX_PANELS at most). */
function notDrawn(view, what) {
  const left = state.runs.slice(MAX_PANELS);
  if (left.length) {
    note(view, `${left.length} ticked run${left.length > 1 ? 's' : ''} not drawn here (a ${what} per run, ` +
      `${MAX_PANELS} at most): ${left.join(', ')}; untick others to see ${left.length > 1 ? 'them' : 'it'}`);
  }
}

/** What the spreads of `items` are over ('experts', 'heads'), as the server names them. */
function spreadsOver(items) { return [...new Set(items.filter((x) => x.low).map((x) => x.over))].sort(); }

/** Under a chart with a layer's experts or heads as one line: how its spread is drawn. */
function spreadNote(view, series) {
  for (const over of spreadsOver(series)) {
    note(view, `a layer’s ${over}: the line is their mean, the band their min … max over the ${over}`);
  }
}

function note(view, text) {
  const line = document.createElement('p');
  line.className = 'blurb note';
  line.textContent = text;
  plots(view).appendChild(line);
}

function runLegend(view) {
  if (state.runs.length < 2) return;
  legend(plots(view), state.runs.map((run, i) => ({label: run, color: '#444', dash: DASHES[i % DASHES.length] || null})), 'run');
}

