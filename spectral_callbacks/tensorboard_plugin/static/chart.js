// Drawing for the SPECTRAL tab: line charts and bars in SVG, the heatmap on a canvas.
// Hand-written so the tab needs no build step and no third-party code. Every chart records how
// many data points it drew in `data-points` on its container (the browser test reads it).

const SVG = 'http://www.w3.org/2000/svg';
const MARGIN = {left: 62, right: 14, top: 12, bottom: 40};

// matplotlib's tab10, so roles have the colours of `spectral-callbacks plot` (C0, C1, ...).
export const PALETTE = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd',
                        '#8c564b', '#e377c2', '#7f7f7f', '#bcbd22', '#17becf'];
const VIRIDIS = ['#440154', '#482878', '#3e4989', '#31688e', '#26828e',
                 '#1f9e89', '#35b779', '#6ece58', '#b5de2b', '#fde725'];

/** A colour of viridis for t in [0, 1] (depth 0 = dark purple, 1 = yellow). */
export function viridis(t) {
  if (!Number.isFinite(t)) return '#999999';
  const x = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  return mix(VIRIDIS[i], VIRIDIS[i + 1], x - i);
}

function mix(a, b, t) {
  const pa = [1, 3, 5].map((k) => parseInt(a.slice(k, k + 2), 16));
  const pb = [1, 3, 5].map((k) => parseInt(b.slice(k, k + 2), 16));
  return 'rgb(' + pa.map((v, k) => Math.round(v + (pb[k] - v) * t)).join(',') + ')';
}

function el(name, attrs = {}, parent = null) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

/** Round tick values covering [lo, hi]. */
function ticks(lo, hi, count = 6) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count;
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * power).find((s) => s >= raw);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) {
    out.push(Math.abs(v) < step * 1e-6 ? 0 : +v.toPrecision(12)); // no -2.8e-17 for zero
  }
  return out;
}

export function format(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return '–';
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(2);
  return +v.toPrecision(4) + '';
}

function extent(values, pad = 0.05) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) if (v !== null && Number.isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  if (lo === Infinity) return [0, 1];
  if (lo === hi) { lo -= 0.5 || 1; hi += 0.5; }
  const span = hi - lo;
  return [lo - span * pad, hi + span * pad];
}

function frame(container, width, height, xs, ys, xLabel, yLabel, xDomain = null) {
  const svg = el('svg', {width, height, class: 'chart'});
  const [x0, x1] = xDomain || extent(xs, 0.01);
  const [y0, y1] = extent(ys);
  const w = width - MARGIN.left - MARGIN.right, h = height - MARGIN.top - MARGIN.bottom;
  const sx = (x) => MARGIN.left + ((x - x0) / (x1 - x0 || 1)) * w;
  const sy = (y) => MARGIN.top + h - ((y - y0) / (y1 - y0 || 1)) * h;
  const axes = el('g', {class: 'axes'}, svg);
  for (const t of ticks(y0, y1)) {
    el('line', {x1: MARGIN.left, x2: MARGIN.left + w, y1: sy(t), y2: sy(t), class: 'grid'}, axes);
    el('text', {x: MARGIN.left - 6, y: sy(t) + 4, 'text-anchor': 'end'}, axes).textContent = format(t);
  }
  for (const t of ticks(x0, x1)) {
    el('line', {x1: sx(t), x2: sx(t), y1: MARGIN.top, y2: MARGIN.top + h, class: 'grid'}, axes);
    el('text', {x: sx(t), y: MARGIN.top + h + 16, 'text-anchor': 'middle'}, axes).textContent = format(t);
  }
  el('rect', {x: MARGIN.left, y: MARGIN.top, width: w, height: h, class: 'plot-area'}, axes);
  el('text', {x: MARGIN.left + w / 2, y: height - 6, 'text-anchor': 'middle', class: 'label'}, axes)
      .textContent = xLabel;
  el('text', {x: 14, y: MARGIN.top + h / 2, 'text-anchor': 'middle', class: 'label',
              transform: `rotate(-90 14 ${MARGIN.top + h / 2})`}, axes).textContent = yLabel;
  container.appendChild(svg);
  return {svg, sx, sy, w, h, y0, y1};
}

function tooltip(container) {
  let tip = container.querySelector('.tooltip');
  if (!tip) {
    tip = document.createElement('div');
    tip.className = 'tooltip';
    container.appendChild(tip);
  }
  return tip;
}

function showTip(container, tip, event, html) {
  const box = container.getBoundingClientRect();
  tip.innerHTML = html;
  tip.style.display = 'block';
  tip.style.left = Math.min(event.clientX - box.left + 12, box.width - 180) + 'px';
  tip.style.top = (event.clientY - box.top + 12) + 'px';
}

/**
 * Lines: series = [{label, color, dash, xs, ys, markers, low, high}]. Hover shows the nearest point
 * of each line. A series of one point (a model at rest, written by `analyze`) is drawn as a
 * marker, as `spectral-callbacks plot` does: a path of one point draws nothing. `low`/`high`
 * (the min and max over a layer's experts, or over its heads) draw a band around the line, a
 * whisker at a lone point.
 */
export function lineChart(container, {series, xLabel, yLabel, width = 620, height = 300, zeroLine = false}) {
  container.textContent = '';
  const xs = series.flatMap((s) => s.xs);
  const ys = series.flatMap((s) => [...s.ys, ...(s.low || []), ...(s.high || [])]);
  if (zeroLine) ys.push(0);
  const f = frame(container, width, height, xs, ys, xLabel, yLabel);
  if (zeroLine) {
    el('line', {x1: MARGIN.left, x2: MARGIN.left + f.w, y1: f.sy(0), y2: f.sy(0), class: 'zero'}, f.svg);
  }
  let points = 0;
  for (const s of series) if (s.low && s.high) band(f, s);
  for (const s of series) {
    let d = '', pen = false, finite = 0;
    s.xs.forEach((x, i) => {
      const y = s.ys[i];
      if (y === null || !Number.isFinite(y)) { pen = false; return; }
      d += (pen ? 'L' : 'M') + f.sx(x).toFixed(1) + ',' + f.sy(y).toFixed(1);
      pen = true;
      points += 1;
      finite += 1;
    });
    const path = el('path', {d, stroke: s.color, fill: 'none', 'stroke-width': s.width || 1.6, class: 'line'}, f.svg);
    if (s.dash) path.setAttribute('stroke-dasharray', s.dash);
    if (s.markers || finite === 1) {
      s.xs.forEach((x, i) => {
        if (s.ys[i] !== null && Number.isFinite(s.ys[i])) {
          el('circle', {cx: f.sx(x), cy: f.sy(s.ys[i]), r: 3, fill: s.color, class: 'marker'}, f.svg);
        }
      });
    }
  }
  container.dataset.points = points;
  const tip = tooltip(container);
  const cursor = el('line', {y1: MARGIN.top, y2: MARGIN.top + f.h, class: 'cursor', visibility: 'hidden'}, f.svg);
  f.svg.addEventListener('mousemove', (event) => {
    const box = f.svg.getBoundingClientRect();
    const px = event.clientX - box.left;
    const rows = [];
    let at = null;
    for (const s of series) {
      let best = -1, dist = Infinity;
      s.xs.forEach((x, i) => {
        const d = Math.abs(f.sx(x) - px);
        if (d < dist && s.ys[i] !== null) { dist = d; best = i; }
      });
      if (best >= 0 && dist < 40) {
        at = s.xs[best];
        const range = s.low && finiteNumber(s.low[best]) ? ` [${format(s.low[best])} … ${format(s.high[best])}]` : '';
        rows.push(`<span style="color:${s.color}">■</span> ${s.label}: ${format(s.ys[best])}${range}` +
                  ` <small>@ ${format(s.xs[best])}</small>`);
      }
    }
    if (!rows.length) { tip.style.display = 'none'; cursor.setAttribute('visibility', 'hidden'); return; }
    cursor.setAttribute('x1', f.sx(at)); cursor.setAttribute('x2', f.sx(at));
    cursor.setAttribute('visibility', 'visible');
    showTip(container, tip, event, rows.slice(0, 14).join('<br>') + (rows.length > 14 ? '<br>…' : ''));
  });
  f.svg.addEventListener('mouseleave', () => { tip.style.display = 'none'; cursor.setAttribute('visibility', 'hidden'); });
  return points;
}

const finiteNumber = (v) => v !== null && v !== undefined && Number.isFinite(v);

/** The spread of a line: a band from `low` to `high` where both are known, a whisker at a point
 * with no known neighbour. */
function band(f, s) {
  const runs = [[]];
  s.xs.forEach((x, i) => {
    if (finiteNumber(s.low[i]) && finiteNumber(s.high[i])) runs[runs.length - 1].push([f.sx(x), f.sy(s.low[i]), f.sy(s.high[i])]);
    else if (runs[runs.length - 1].length) runs.push([]);
  });
  for (const part of runs) {
    if (part.length === 1) {
      const [x, lo, hi] = part[0];
      el('line', {x1: x, x2: x, y1: lo, y2: hi, stroke: s.color, 'stroke-width': 2, class: 'band whisker'}, f.svg);
      for (const y of [lo, hi]) el('line', {x1: x - 4, x2: x + 4, y1: y, y2: y, stroke: s.color, class: 'band'}, f.svg);
    } else if (part.length > 1) {
      const top = part.map(([x, , hi], i) => (i ? 'L' : 'M') + x.toFixed(1) + ',' + hi.toFixed(1)).join('');
      const bottom = part.slice().reverse().map(([x, lo]) => 'L' + x.toFixed(1) + ',' + lo.toFixed(1)).join('');
      el('path', {d: top + bottom + 'Z', fill: s.color, 'fill-opacity': 0.18, stroke: 'none', class: 'band'}, f.svg);
    }
  }
}

/** A legend: items = [{label, color, dash}]. */
export function legend(container, items, title = '') {
  const box = document.createElement('div');
  box.className = 'legend';
  if (title) box.innerHTML = `<b>${title}</b> `;
  for (const item of items) {
    const entry = document.createElement('span');
    entry.className = 'legend-item';
    // A dashed line's swatch is that dash pattern (the runs, the stacks), not any dashes.
    entry.innerHTML = (item.dash
      ? `<svg class="swatch" width="22" height="6"><line x1="0" x2="22" y1="3" y2="3" stroke="${item.color}" ` +
        `stroke-width="2" stroke-dasharray="${item.dash}"></line></svg>`
      : `<i style="background:${item.color}"></i>`) + item.label;
    box.appendChild(entry);
  }
  container.appendChild(box);
}

/** A horizontal colour bar from viridis(0) to viridis(1). */
export function depthBar(container, label) {
  const box = document.createElement('div');
  box.className = 'legend';
  const stops = VIRIDIS.map((c, i) => `${c} ${(100 * i) / (VIRIDIS.length - 1)}%`).join(',');
  box.innerHTML = `<b>${label}</b> 0 <span class="depthbar" style="background:linear-gradient(90deg,${stops})"></span> 1`;
  container.appendChild(box);
}

/**
 * Heatmap on a canvas: rows = layers (0 at the top), columns = steps, values[row][col];
 * hover shows layer, step, value and the low/high range the column stands for.
 */
export function heatmap(container, {layers, steps, values, low, high, label, width = 1240, height = 260,
                                    xLabel = 'optimizer step', xName = 'step', categories = false}) {
  container.textContent = '';
  const canvas = document.createElement('canvas');
  const flat = values.flat().filter((v) => v !== null);
  let [lo, hi] = extent(flat, 0);
  // The colour bar's column holds the bar, its two tick values and the rotated label, each as wide
  // as it is: a long value (-1.23e-05) no longer runs into the label, and the canvas is tall
  // enough for the label along the bar (a 3-layer run's 60 px bar cut "energy_rank_90" off).
  const FONT = '11px sans-serif', BAR = 14, GAP = 4, LABEL = 16; // LABEL: the rotated line, a margin
  const g = canvas.getContext('2d');
  g.font = FONT;
  const tickWidth = Math.max(g.measureText(format(hi)).width, g.measureText(format(lo)).width);
  const labelLength = g.measureText(label).width;
  const left = 50, top = 8, bottom = 34;
  // At least 100 px, so the heatmaps of runs whose values print alike keep their columns aligned.
  const right = Math.max(100, 16 + BAR + GAP + Math.ceil(tickWidth) + GAP + LABEL);
  height = Math.max(height, Math.ceil(labelLength) + 2 * GAP + top + bottom);
  canvas.width = width; canvas.height = height;
  canvas.className = 'heatmap';
  container.appendChild(canvas);
  const w = width - left - right, h = height - top - bottom;
  const cell = (v) => (v === null ? '#dddddd' : viridis((v - lo) / (hi - lo || 1)));
  // Column edges halfway between steps, as the CLI's heatmap: the schedule is dense early.
  // Categories (heads): a cell of one unit around each.
  const last = steps[steps.length - 1];
  const x0 = categories ? steps[0] - 0.5 : steps[0], x1 = categories ? last + 0.5 : last;
  const sx = (s) => left + ((s - x0) / (x1 - x0 || 1)) * w;
  const edges = categories ? steps.map((s) => sx(s - 0.5))
    : steps.map((s, j) => (j === 0 ? sx(s) : (sx(steps[j - 1]) + sx(s)) / 2));
  edges.push(sx(x1));
  if (steps.length === 1 && !categories) { edges[0] = left; edges[1] = left + w; }
  const rh = h / layers.length;
  let points = 0;
  layers.forEach((layer, r) => {
    steps.forEach((_, j) => {
      g.fillStyle = cell(values[r][j]);
      const xa = edges[j], xb = Math.max(edges[j + 1], xa + 1);
      g.fillRect(xa, top + r * rh, xb - xa + 0.5, rh + 0.5);
      if (values[r][j] !== null) points += 1;
    });
  });
  g.fillStyle = '#333'; g.font = FONT; g.textAlign = 'right';
  const every = Math.ceil(layers.length / 12);
  layers.forEach((layer, r) => {
    if (r % every === 0) g.fillText('L' + layer, left - 6, top + r * rh + rh / 2 + 4);
  });
  g.textAlign = 'center';
  const at = categories ? ticks(steps[0], last).filter(Number.isInteger) : ticks(x0, x1);
  for (const t of at) g.fillText(format(t), sx(t), top + h + 14);
  g.fillText(xLabel, left + w / 2, top + h + 30);
  // Colour bar, its values beside it, the label along it (rotated, centred on the bar).
  const barX = width - right + 16, tickX = barX + BAR + GAP;
  for (let i = 0; i < h; i++) { g.fillStyle = viridis(1 - i / h); g.fillRect(barX, top + i, BAR, 1); }
  g.fillStyle = '#333'; g.textAlign = 'left';
  g.fillText(format(hi), tickX, top + 10);
  g.fillText(format(lo), tickX, top + h);
  // Turned a quarter back, the label reads upwards along its baseline at x: its letters stand up
  // to ~9 px left of x, descenders ~3 px right of it; at the canvas' edge, aligned across runs.
  g.save(); g.translate(width - LABEL + 10, top + h / 2);
  g.rotate(-Math.PI / 2); g.textAlign = 'center';
  g.fillText(label, 0, 0); g.restore();
  container.dataset.points = points;
  const tip = tooltip(container);
  canvas.addEventListener('mousemove', (event) => {
    const box = canvas.getBoundingClientRect();
    const px = ((event.clientX - box.left) * width) / box.width;
    const py = ((event.clientY - box.top) * height) / box.height;
    const r = Math.floor((py - top) / rh);
    const j = edges.findIndex((e, k) => k < steps.length && px >= e && px < edges[k + 1]);
    if (r < 0 || r >= layers.length || j < 0) { tip.style.display = 'none'; return; }
    let html = `layer ${layers[r]} · ${xName} ${steps[j]}<br>${label}: <b>${format(values[r][j])}</b>`;
    if (low && high && (low[r][j] !== values[r][j] || high[r][j] !== values[r][j])) {
      html += `<br><small>range since previous column: ${format(low[r][j])} … ${format(high[r][j])}</small>`;
    }
    showTip(container, tip, event, html);
  });
  canvas.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
  return points;
}

/**
 * Grouped bars: groups (layers) along x, one bar per key (role) in each, values[key][group];
 * spread[key] = {low, high} (a layer's experts or heads) adds a whisker from the min to the max.
 */
export function barChart(container, {groups, keys, values, spread = {}, colors, xLabel, yLabel, width = 620, height = 260}) {
  container.textContent = '';
  const all = keys.flatMap((k) => [...values[k], ...(spread[k] ? [...spread[k].low, ...spread[k].high] : [])]).concat([0]);
  const xs = [-0.5, groups.length - 0.5];
  const f = frame(container, width, height, [], all, xLabel, yLabel, xs);
  // Replace the numeric x ticks by the group labels.
  f.svg.querySelectorAll('.axes text[text-anchor="middle"]:not(.label)').forEach((t) => t.remove());
  f.svg.querySelectorAll('.axes line.grid').forEach((line) => {
    if (line.getAttribute('y1') == MARGIN.top && line.getAttribute('x1') === line.getAttribute('x2')) line.remove();
  });
  const slot = f.w / groups.length, bw = (slot * 0.8) / keys.length;
  let points = 0;
  const tip = tooltip(container);
  groups.forEach((group, gi) => {
    const gx = MARGIN.left + gi * slot + slot * 0.1;
    const every = Math.ceil(groups.length / 24);
    if (gi % every === 0) {
      el('text', {x: MARGIN.left + (gi + 0.5) * slot, y: MARGIN.top + f.h + 16, 'text-anchor': 'middle'}, f.svg)
          .textContent = group;
    }
    keys.forEach((key, ki) => {
      const v = values[key][gi];
      if (v === null || v === undefined) return;
      const y = f.sy(Math.max(v, 0)), y0 = f.sy(Math.min(v, 0));
      const bar = el('rect', {x: gx + ki * bw, y, width: Math.max(bw - 0.5, 0.5), height: Math.max(y0 - y, 0.5),
                              fill: colors[key], class: 'bar'}, f.svg);
      const range = spread[key] && finiteNumber(spread[key].low[gi]) && finiteNumber(spread[key].high[gi])
        ? [spread[key].low[gi], spread[key].high[gi]] : null;
      if (range) {
        const x = gx + ki * bw + bw / 2;
        el('line', {x1: x, x2: x, y1: f.sy(range[0]), y2: f.sy(range[1]), stroke: '#222', class: 'whisker'}, f.svg);
      }
      const spreadText = range ? `<br><small>experts: ${format(range[0])} … ${format(range[1])}</small>` : '';
      bar.addEventListener('mousemove', (event) => showTip(container, tip, event, `layer ${group} · ${key}: <b>${format(v)}</b>${spreadText}`));
      bar.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
      points += 1;
    });
  });
  el('line', {x1: MARGIN.left, x2: MARGIN.left + f.w, y1: f.sy(0), y2: f.sy(0), class: 'zero'}, f.svg);
  container.dataset.points = points;
  return points;
}
