// The SPECTRAL tab. TensorBoard loads this module in the plugin's iframe (whose base URL is
// data/plugin/spectral/) and calls render(). Every view asks its route for JSON over the runs
// ticked in the run selector and redraws; a poll every POLL_MS ms redraws what changed, so a run
// being written gains points while the page is open.

import {PALETTE, barChart, depthBar, heatmap, legend, lineChart, viridis} from './chart.js';

const POLL_MS = 3000;
const MAX_PANELS = 4; // heatmaps and bar panels drawn per view (one per run)
const DASHES = ['', '7 3', '2 3', '9 3 2 3', '4 2', '1 2'];
const GLYPHS = {MLP_up: 'MLP↑', MLP_down: 'MLP↓'};
const ROLE_ORDER = ['Q', 'K', 'V', 'O', 'MLP_up', 'MLP_down'];
const roleRank = (role) => (ROLE_ORDER.includes(role) ? ROLE_ORDER.indexOf(role) : ROLE_ORDER.length);
const glyph = (role) => GLYPHS[role] || role;

const state = {
  catalog: [],
  runs: [],
  wave: {metric: 'compression', role: 'Q'},
  byRole: {metric: 'stable_rank', layer: 0},
  byLayer: {metric: 'stable_rank', role: 'Q'},
  depth: {metric: 'alpha', role: 'Q', step: null},
  bars: {metric: 'compression', step: null},
  diff: {metric: null, baseline: null, x: 'step', layer: 0, role: 'Q'},
};
const drawn = {}; // view -> the JSON last drawn, to skip redraws of unchanged data
const panels = {};
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
    ['bars', 'Metric by layer × role', 'at the step of the slider (default: the last), a panel per run'],
    ['diff', 'Difference against a baseline run', 'aligned as spectral-callbacks plot --kind metric-diff aligns it'],
  ]) {
    const panel = document.createElement('section');
    panel.className = 'panel' + (view === 'wave' ? ' wide' : '');
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
    const {runs} = await getJson('runs', {});
    state.catalog = runs;
    const names = runs.map((r) => r.run);
    if (!state.runs.length) state.runs = names.slice(0, MAX_PANELS);
    state.runs = state.runs.filter((r) => names.includes(r));
    drawRunSelector(names);
    if (!names.length) {
      setStatus('no run with spectral scalars (spectral_<metric>/L<layer>/<role>) in this logdir yet');
      for (const view of Object.keys(panels)) clear(view);
      return;
    } else {
      setStatus(`${state.runs.length} of ${names.length} runs · updated ${new Date().toLocaleTimeString()}`);
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

function union(key) {
  const chosen = state.catalog.filter((r) => state.runs.includes(r.run));
  const values = new Set(chosen.flatMap((r) => r[key]));
  const order = chosen.length ? chosen[0][key] : [];
  return [...order.filter((v) => values.has(v)), ...[...values].filter((v) => !order.includes(v)).sort()];
}

function drawRunSelector(names) {
  const box = document.getElementById('run-selector');
  const key = names.join('\n') + '|' + state.runs.join('\n');
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  box.innerHTML = '<b>Runs</b>';
  names.forEach((name, i) => {
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
    label.style.borderColor = PALETTE[i % PALETTE.length];
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
    controls('wave', [s, union('metrics'), union('roles')], () => [
      select('metric', union('metrics'), s.metric, setter('wave', 'metric')),
      select('role', union('roles').map((r) => [r, glyph(r)]), s.role, setter('wave', 'role')),
    ]);
    const runs = state.runs.slice(0, MAX_PANELS);
    const all = await Promise.all(runs.map((run) => getJson('wave', {run, metric: s.metric, role: s.role})));
    const key = JSON.stringify([s, all]);
    if (drawn.wave === key) return;
    drawn.wave = key;
    plots('wave').textContent = '';
    let points = 0;
    for (const json of all) {
      const box = plotBox(plots('wave'), json.run);
      if (!json.steps.length) { box.textContent = `no ${s.metric} of ${glyph(s.role)} in ${json.run}`; continue; }
      points += heatmap(box, {...json, label: s.metric, height: Math.min(420, 60 + 14 * json.layers.length)});
    }
    panels.wave.dataset.points = points;
    message('wave', runs.length ? '' : 'tick a run above');
  },

  async byRole() {
    const s = state.byRole;
    controls('byRole', [s, union('metrics'), union('layers')], () => [
      select('metric', union('metrics'), s.metric, setter('byRole', 'metric')),
      select('layer', union('layers'), s.layer, setter('byRole', 'layer', Number)),
    ]);
    await fetchAndDraw('byRole', 'by_role', {run: state.runs, metric: s.metric, layer: s.layer}, ({series}) => {
      // Chart order (Q, K, V, O, MLP↑, MLP↓, then the others), whichever run comes first.
      const roles = [...new Set(series.map((x) => x.role))].sort((p, q) => roleRank(p) - roleRank(q) || p.localeCompare(q));
      const lines = series.map((x) => ({
        label: `${state.runs.length > 1 ? x.run + ' · ' : ''}${glyph(x.role)}`,
        color: roleColor(x.role),
        dash: DASHES[state.runs.indexOf(x.run) % DASHES.length], xs: x.steps, ys: x.values}));
      panels.byRole.dataset.points = lineChart(plotBox(plots('byRole')), {
        series: lines, xLabel: 'optimizer step', yLabel: `${s.metric} of layer ${s.layer}`});
      legend(plots('byRole'), roles.map((r) => ({label: glyph(r), color: roleColor(r)})), 'role');
      runLegend('byRole');
      if (!series.length) message('byRole', `no ${s.metric} at layer ${s.layer}`);
    });
  },

  async byLayer() {
    const s = state.byLayer;
    controls('byLayer', [s, union('metrics'), union('roles')], () => [
      select('metric', union('metrics'), s.metric, setter('byLayer', 'metric')),
      select('role', union('roles').map((r) => [r, glyph(r)]), s.role, setter('byLayer', 'role')),
    ]);
    await fetchAndDraw('byLayer', 'by_layer', {run: state.runs, metric: s.metric, role: s.role}, ({series}) => {
      const lines = series.map((x) => ({
        label: `${state.runs.length > 1 ? x.run + ' · ' : ''}L${x.layer}`, color: viridis(x.depth),
        dash: DASHES[state.runs.indexOf(x.run) % DASHES.length], xs: x.steps, ys: x.values}));
      panels.byLayer.dataset.points = lineChart(plotBox(plots('byLayer')), {
        series: lines, xLabel: 'optimizer step', yLabel: `${s.metric} of ${glyph(s.role)}`});
      depthBar(plots('byLayer'), 'relative depth i/(L−1)');
      runLegend('byLayer');
      if (!series.length) message('byLayer', `no ${s.metric} of ${glyph(s.role)}`);
    });
  },

  async depth() {
    const s = state.depth;
    const params = {run: state.runs, metric: s.metric, role: s.role, step: s.step};
    const json = await getJson('depth', params);
    controls('depth', [s, union('metrics'), union('roles'), json.steps], () => [
      select('metric', union('metrics'), s.metric, setter('depth', 'metric')),
      select('role', union('roles').map((r) => [r, glyph(r)]), s.role, setter('depth', 'role')),
      slider('step', json.steps, s.step, setter('depth', 'step')),
    ]);
    const key = JSON.stringify([params, json]);
    if (drawn.depth === key) return;
    drawn.depth = key;
    plots('depth').textContent = '';
    const lines = json.runs.map((r) => ({
      label: r.run + (r.steps.length ? ` (step ${Math.max(...r.steps)})` : ''),
      color: PALETTE[state.runs.indexOf(r.run) % PALETTE.length], xs: r.depths, ys: r.values, markers: true}));
    panels.depth.dataset.points = lineChart(plotBox(plots('depth')), {
      series: lines, xLabel: 'relative depth i / (L − 1)', yLabel: `${s.metric} of ${glyph(s.role)}`});
    const drawnRuns = lines.filter((l) => l.ys.length);
    legend(plots('depth'), drawnRuns.map((l) => ({label: l.label, color: l.color})), 'run');
    const missing = json.runs.filter((r) => !r.values.length).map((r) => r.run);
    message('depth', missing.length ? `no ${s.metric} of ${glyph(s.role)} in ${missing.join(', ')}` : '');
  },

  async bars() {
    const s = state.bars;
    const params = {run: state.runs.slice(0, MAX_PANELS), metric: s.metric, step: s.step};
    const json = await getJson('bars', params);
    controls('bars', [s, union('metrics'), json.steps], () => [
      select('metric', union('metrics'), s.metric, setter('bars', 'metric')),
      slider('step', json.steps, s.step, setter('bars', 'step')),
    ]);
    const key = JSON.stringify([params, json]);
    if (drawn.bars === key) return;
    drawn.bars = key;
    plots('bars').textContent = '';
    let points = 0;
    // Only the roles the panels hold: a role no ticked run has gets no legend entry.
    const roles = union('roles').filter((r) => json.runs.some((panel) => panel.roles.includes(r)));
    const colors = Object.fromEntries(roles.map((r) => [r, roleColor(r)]));
    for (const panel of json.runs) {
      const box = plotBox(plots('bars'), panel.layers.length ? `${panel.run} · step ${panel.step}` : panel.run);
      if (!panel.layers.length) { box.textContent = `no ${s.metric} in ${panel.run}`; continue; }
      points += barChart(box, {groups: panel.layers, keys: panel.roles, values: panel.values, colors,
                               xLabel: 'layer', yLabel: s.metric, height: 220});
    }
    panels.bars.dataset.points = points;
    legend(plots('bars'), roles.map((r) => ({label: glyph(r), color: colors[r]})), 'role');
  },

  async diff() {
    const s = state.diff;
    const scalars = union('scalars').filter((t) => !t.startsWith('spectral_monitor/') && t !== 'epoch');
    const metrics = union('metrics');
    if (s.metric === null) s.metric = scalars.find((t) => /loss/.test(t)) || scalars[0] || metrics[0] || null;
    const spectral = metrics.includes(s.metric) && !scalars.includes(s.metric);
    // Only runs that logged the chosen series can be the baseline or be compared: asking for a
    // difference against a run without it could only fail.
    const has = (run) => {
      const entry = state.catalog.find((r) => r.run === run);
      if (!entry) return false;
      if (!spectral) return entry.scalars.includes(s.metric);
      return entry.metrics.includes(s.metric) && entry.layers.includes(s.layer) && entry.roles.includes(s.role);
    };
    const able = state.runs.filter(has);
    if (!able.includes(s.baseline)) s.baseline = able[0] || null;
    const xs = ['step', ...scalars.filter((t) => t !== s.metric)];
    if (!xs.includes(s.x)) s.x = 'step';
    controls('diff', [s, scalars, metrics, state.runs, union('layers'), union('roles')], () => [
      select('metric', [...scalars, ...metrics], s.metric, setter('diff', 'metric')),
      ...(spectral ? [select('layer', union('layers'), s.layer, setter('diff', 'layer', Number)),
                      select('role', union('roles').map((r) => [r, glyph(r)]), s.role, setter('diff', 'role'))] : []),
      select('baseline', able, s.baseline, setter('diff', 'baseline')),
      select('x', xs, s.x, setter('diff', 'x')),
    ]);
    const what = spectral ? `${s.metric} of L${s.layer} ${glyph(s.role)}` : s.metric;
    if (able.length < 2 || s.metric === null) {
      clear('diff', state.runs.length < 2 ? 'tick at least two runs: the baseline and one to compare'
        : `fewer than two ticked runs have ${what}: tick another, or pick another metric`);
      return;
    }
    const params = {run: able, baseline: s.baseline, metric: s.metric, x: s.x,
                    layer: spectral ? s.layer : null, role: spectral ? s.role : null};
    await fetchAndDraw('diff', 'diff', params, ({series}) => {
      const lines = series.map((x) => ({label: x.run, color: PALETTE[state.runs.indexOf(x.run) % PALETTE.length],
                                        xs: x.x, ys: x.values}));
      panels.diff.dataset.points = lineChart(plotBox(plots('diff')), {
        series: lines, xLabel: s.x === 'step' ? 'optimizer step' : s.x,
        yLabel: `Δ ${what} (run − ${s.baseline})`, zeroLine: true});
      legend(plots('diff'), [{label: `${s.baseline} (baseline)`, color: '#000'},
                             ...lines.map((l) => ({label: l.label, color: l.color}))], 'run');
    });
  },
};

function runLegend(view) {
  if (state.runs.length < 2) return;
  legend(plots(view), state.runs.map((run, i) => ({label: run, color: '#444', dash: DASHES[i % DASHES.length] || null})), 'run');
}

