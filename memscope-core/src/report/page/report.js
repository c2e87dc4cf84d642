// memscope-bpf's report page: draws the data `memscope-bpf report` embedded in this file.
// No library and no network: canvases for the curves, plain DOM for the tree and the tables.
// Times are ns after the run's origin (DATA.runs[i].origin_ns, ns since the epoch).
"use strict";

const DATA = JSON.parse(document.getElementById("memscope-data").textContent);
const FAMILIES = ["HAL", "PTA", "HOST"];
const PALETTE = ["#3b78b7", "#e0823d", "#4a9d5b", "#c2474b", "#8a6bb8", "#8c5a4a", "#d46fb1", "#6f7d8c",
  "#b3a632", "#3aaebd", "#1f4e79", "#9c6b00"];
const OTHER = "#b9c0c8";
const state = { run: 0, device: 0, family: null, view: null, picked: null, sortKey: "size", sortDir: -1 };
const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const k of kids) if (k !== null && k !== undefined) e.append(k);
  return e;
}

function bytes(n) {
  if (n === null || n === undefined) return "";
  const a = Math.abs(n), units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0, v = a;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (n < 0 ? "-" : "") + (i === 0 ? String(a) : v.toFixed(2)) + " " + units[i];
}
function signed(n) { return (n > 0 ? "+" : "") + bytes(n); }
function secs(ns) { return ns === null || ns === undefined ? "" : (ns / 1e9).toFixed(6) + " s"; }
function span(ns) {
  if (ns === null || ns === undefined) return "";
  if (ns < 1e3) return ns + " ns"; if (ns < 1e6) return (ns / 1e3).toFixed(1) + " µs";
  if (ns < 1e9) return (ns / 1e6).toFixed(2) + " ms"; return (ns / 1e9).toFixed(3) + " s";
}

const run = () => DATA.runs[state.run];
const dev = () => run().devices[state.device];
const curve = () => dev().curves.find((c) => c.family === state.family);

// ------------------------------------------------------------------ pickers and overview

function pickers() {
  const mk = (box, items, on, pick) => {
    const b = $(box); b.textContent = "";
    if (items.length < 2 && box !== "family-picker") return;
    items.forEach((label, i) => b.append(el("button", { class: "pick" + (on(i) ? " on" : ""), type: "button",
      "data-pick": label, onclick: () => pick(i) }, label)));
  };
  mk("run-picker", DATA.runs.map((r, i) => runName(i)),
    (i) => i === state.run, (i) => { state.run = i; state.device = Math.min(state.device, run().devices.length - 1); reset(); });
  mk("device-picker", run().devices.map((d) => "device " + d.device), (i) => i === state.device,
    (i) => { state.device = i; reset(); });
  const fams = dev().curves.map((c) => c.family);
  mk("family-picker", fams, (i) => fams[i] === state.family, (i) => { state.family = fams[i]; state.picked = null; state.view = null; render(); });
}

function overview() {
  const d = dev(), c = curve(), box = $("overview"); box.textContent = "";
  const card = (label, value, attrs) => box.append(el("div", Object.assign({ class: "card" }, attrs || {}), el("b", {}, value), el("span", {}, label)));
  if (d.capture) box.append(el("p", { class: "note", id: "capture-note" }, "This trace is " + d.capture + "."));
  if (!c) { box.append(el("p", {}, "No memory blocks in this trace.")); return; }
  card(c.family + " peak at " + secs(c.peak_t), bytes(c.peak), { id: "peak-bytes", "data-bytes": String(c.peak), "data-t": String(c.peak_t), "data-family": c.family });
  card(c.family + " live at the end", bytes(c.total.length ? c.total[c.total.length - 1] : 0));
  card("trace length", span(d.end - d.start));
  card("blocks", String(d.blocks.blocks));
  const ooms = d.instants.filter((i) => i.kind === "oom").length;
  card("OOMs", String(ooms), ooms ? { class: "card verdict" } : {});
  card("steps", String(d.steps.length));
}

// ------------------------------------------------------------------ timeline

// Owners of the family coloured by their highest live bytes; the rest grouped as "other".
function groups(c) {
  const best = new Map();
  c.owners.forEach((list) => list.forEach(([o, b]) => best.set(o, Math.max(best.get(o) || 0, b))));
  const order = [...best.entries()].sort((a, b) => b[1] - a[1]).map((e) => e[0]);
  const top = order.slice(0, PALETTE.length - (order.length > PALETTE.length ? 1 : 0));
  const index = new Map(top.map((o, i) => [o, i]));
  return { top, index, other: order.length > top.length };
}

function lines(d) {
  const out = [];
  for (const c of d.curves) if (c.family !== state.family) out.push({ name: c.family + " allocated", pts: c.t.map((t, i) => [t, c.total[i]]), dash: [] });
  for (const r of d.reserved) out.push({ name: r.name, pts: r.points, dash: r.name.endsWith("reserved") ? [6, 3] : [2, 2] });
  return out;
}

function valueAt(pts, t) {
  let v = 0;
  for (const [pt, pv] of pts) { if (pt > t) break; v = pv; }
  return v;
}

const LINE_COLORS = ["#222", "#7b1fa2", "#00897b", "#5d4037", "#c2185b", "#1565c0", "#ef6c00", "#558b2f"];

function drawTimeline() {
  const cv = $("timeline"), d = dev(), c = curve();
  const w = cv.clientWidth || 800, h = 340, dpr = window.devicePixelRatio || 1;
  cv.width = w * dpr; cv.height = h * dpr;
  const g = cv.getContext("2d"); g.setTransform(dpr, 0, 0, dpr, 0, 0); g.clearRect(0, 0, w, h);
  if (!c) return;
  const [t0, t1] = state.view || [d.start, Math.max(d.end, d.start + 1)];
  const pad = { l: 70, r: 10, t: 10, b: 24 };
  const X = (t) => pad.l + (t - t0) / (t1 - t0) * (w - pad.l - pad.r);
  let ymax = 1;
  c.t.forEach((t, i) => { if (t >= t0 && t <= t1) ymax = Math.max(ymax, c.total[i]); });
  const other = lines(d);
  other.forEach((l) => l.pts.forEach(([t, v]) => { if (t >= t0 && t <= t1) ymax = Math.max(ymax, v); }));
  ymax *= 1.08;
  const Y = (v) => h - pad.b - v / ymax * (h - pad.t - pad.b);
  // Axes.
  g.fillStyle = "#5c6773"; g.font = "11px system-ui, sans-serif"; g.strokeStyle = "#e6e9ed";
  for (let k = 0; k <= 4; k++) {
    const v = ymax * k / 4, y = Y(v);
    g.beginPath(); g.moveTo(pad.l, y); g.lineTo(w - pad.r, y); g.stroke();
    g.fillText(bytes(Math.round(v)), 2, y + 4);
  }
  for (let k = 0; k <= 6; k++) {
    const t = t0 + (t1 - t0) * k / 6;
    g.fillText(secs(t).replace(/(\.\d{3})\d+/, "$1"), Math.min(X(t), w - 60), h - 8);
  }
  // Stacked owners: a step function, each instant's stack holding until the next.
  const gr = groups(c);
  const first = Math.max(0, c.t.findIndex((t) => t >= t0) - 1);
  for (let i = first; i < c.t.length && c.t[i] <= t1; i++) {
    const xa = Math.max(X(c.t[i]), pad.l), xb = Math.min(i + 1 < c.t.length ? X(c.t[i + 1]) : X(d.end), w - pad.r);
    if (xb < pad.l) continue;
    const stack = new Array(PALETTE.length + 1).fill(0);
    for (const [o, b] of c.owners[i]) { const k = gr.index.get(o); stack[k === undefined ? PALETTE.length : k] += b; }
    let base = 0;
    stack.forEach((b, k) => {
      if (b <= 0) return;
      g.fillStyle = k < PALETTE.length ? PALETTE[k] : OTHER;
      const ya = Y(base), yb = Y(base + b);
      g.fillRect(xa, yb, Math.max(xb - xa, 0.7), ya - yb);
      base += b;
    });
  }
  // Other layers and the pools' reserved bytes.
  other.forEach((l, k) => {
    g.strokeStyle = LINE_COLORS[k % LINE_COLORS.length]; g.setLineDash(l.dash); g.lineWidth = 1.4; g.beginPath();
    let prev = null;
    for (const [t, v] of l.pts) {
      const x = Math.min(Math.max(X(t), pad.l), w - pad.r), y = Y(v);
      if (prev === null) g.moveTo(x, y); else { g.lineTo(x, prev); g.lineTo(x, y); }
      prev = y;
    }
    if (prev !== null) g.lineTo(w - pad.r, prev);
    g.stroke(); g.setLineDash([]);
  });
  // Steps, marks, OOMs.
  for (const m of d.instants) {
    if (m.ts < t0 || m.ts > t1) continue;
    const x = X(m.ts);
    g.strokeStyle = m.kind === "oom" ? "#c62828" : m.kind === "mark" ? "#2f6fb0" : "#9aa3ad";
    g.lineWidth = m.kind === "oom" ? 2 : 1; g.setLineDash(m.kind === "mark" ? [3, 3] : []);
    g.beginPath(); g.moveTo(x, pad.t); g.lineTo(x, h - pad.b); g.stroke(); g.setLineDash([]);
    if (m.kind === "oom") { g.fillStyle = "#c62828"; g.fillText("OOM", x + 3, pad.t + 10); }
  }
  // The peak, and the instant picked.
  if (c.peak_t >= t0 && c.peak_t <= t1) {
    g.fillStyle = "#c62828"; g.beginPath(); g.arc(X(c.peak_t), Y(c.peak), 4, 0, 7); g.fill();
  }
  if (state.picked !== null) {
    const x = X(c.t[state.picked]);
    g.strokeStyle = "#000"; g.lineWidth = 1; g.setLineDash([2, 2]);
    g.beginPath(); g.moveTo(x, pad.t); g.lineTo(x, h - pad.b); g.stroke(); g.setLineDash([]);
  }
  state.geom = { t0, t1, pad, w, X };
  $("view-range").textContent = state.view ? "showing " + secs(t0) + " to " + secs(t1) : "whole trace";
  legend(c, gr, other);
}

function legend(c, gr, other) {
  const ul = $("legend"); ul.textContent = "";
  const owner = (o) => dev().owners[o][1];
  gr.top.forEach((o, k) => ul.append(el("li", { "data-owner": owner(o) }, el("span", { class: "swatch", style: "background:" + PALETTE[k] }), owner(o))));
  if (gr.other) ul.append(el("li", {}, el("span", { class: "swatch", style: "background:" + OTHER }), "other owners"));
  other.forEach((l, k) => ul.append(el("li", {}, el("span", { class: "swatch", style: "background:" + LINE_COLORS[k % LINE_COLORS.length] }), l.name + (l.dash.length ? (l.dash[0] > 2 ? " (dashed)" : " (dotted)") : ""))));
}

// The kept instant at or before t (the state then), else the first.
function instantAt(c, t) {
  let lo = 0, hi = c.t.length - 1, best = 0;
  while (lo <= hi) { const m = (lo + hi) >> 1; if (c.t[m] <= t) { best = m; lo = m + 1; } else hi = m - 1; }
  return best;
}

function timelineEvents() {
  const cv = $("timeline"), tip = $("timeline-tip");
  let down = null;
  const tAt = (ev) => {
    const r = cv.getBoundingClientRect(), gm = state.geom;
    const x = ev.clientX - r.left;
    return gm.t0 + (x - gm.pad.l) / (gm.w - gm.pad.l - gm.pad.r) * (gm.t1 - gm.t0);
  };
  cv.addEventListener("mousedown", (ev) => { down = ev.clientX; });
  cv.addEventListener("mouseup", (ev) => {
    if (down === null || !state.geom || !curve()) return;
    const a = down; down = null;
    if (Math.abs(ev.clientX - a) > 5) {
      const ta = tAt({ clientX: Math.min(a, ev.clientX) }), tb = tAt({ clientX: Math.max(a, ev.clientX) });
      if (tb - ta >= 1) { state.view = [ta, tb]; drawTimeline(); }
      return;
    }
    state.picked = instantAt(curve(), tAt(ev));
    drawTimeline(); tree();
  });
  cv.addEventListener("dblclick", () => { state.view = null; drawTimeline(); });
  cv.addEventListener("mousemove", (ev) => {
    const c = curve(); if (!c || !state.geom) return;
    const i = instantAt(c, tAt(ev)), r = cv.getBoundingClientRect();
    tip.hidden = false; tip.style.left = (ev.clientX - r.left + 12) + "px"; tip.style.top = "8px";
    tip.textContent = secs(c.t[i]) + "\n" + c.family + " " + bytes(c.total[i]);
  });
  cv.addEventListener("mouseleave", () => { tip.hidden = true; });
  // From the family's first change to its last, with a margin: a trace often starts and ends
  // with seconds of nothing (the tracer waiting, the job loading).
  $("zoom-fit").addEventListener("click", () => {
    const c = curve(), d = dev();
    if (!c || c.t.length < 2) return;
    const a = c.t[0], b = c.t[c.t.length - 1], pad = Math.max((b - a) * 0.02, 1);
    state.view = [Math.max(d.start, a - pad), Math.min(d.end, b + pad)];
    drawTimeline();
  });
  $("zoom-out").addEventListener("click", () => {
    if (!state.view) return;
    const d = dev(), [a, b] = state.view, m = (a + b) / 2, half = (b - a);
    const na = Math.max(d.start, m - half), nb = Math.min(d.end, m + half);
    state.view = na <= d.start && nb >= d.end ? null : [na, nb];
    drawTimeline();
  });
}

// ------------------------------------------------------------------ owner tree

function buildTree(c, i) {
  const root = { name: c.family + " (all)", path: "", bytes: 0, kids: new Map() };
  for (const [o, b] of c.owners[i]) {
    root.bytes += b;
    let node = root, path = [];
    for (const level of dev().owners[o][1].split("@")) {
      path.push(level);
      if (!node.kids.has(level)) node.kids.set(level, { name: level, path: path.join("@"), bytes: 0, kids: new Map() });
      node = node.kids.get(level); node.bytes += b;
    }
  }
  return root;
}

function tree() {
  const c = curve(), box = $("tree"), body = $("tree-table").tBodies[0];
  box.textContent = ""; body.textContent = "";
  if (!c || !c.t.length) { $("tree-title").textContent = "Owner tree"; return; }
  const peakIndex = c.t.indexOf(c.peak_t);
  const i = state.picked === null ? Math.max(peakIndex, 0) : state.picked;
  const title = $("tree-title");
  title.textContent = "Owner tree (" + c.family + ") " + (state.picked === null ? "at the peak, " : "at ") + secs(c.t[i]) + ": " + bytes(c.total[i]);
  title.setAttribute("data-t", String(c.t[i])); title.setAttribute("data-bytes", String(c.total[i]));
  title.setAttribute("data-at", state.picked === null ? "peak" : "picked");
  const root = buildTree(c, i), colours = new Map();
  groups(c).top.forEach((o, k) => colours.set(dev().owners[o][1], PALETTE[k]));
  const total = Math.max(root.bytes, 1);
  const draw = (node, depth) => {
    const kids = [...node.kids.values()].sort((a, b) => b.bytes - a.bytes);
    const colour = colours.get(node.path) || (depth === 0 ? "#1d232b" : kids.length ? "#6f7d8c" : OTHER);
    const label = el("div", { class: "label", style: "background:" + colour, title: (node.path || node.name) + "\n" + bytes(node.bytes) + " (" + node.bytes + " bytes)" },
      node.name + " " + bytes(node.bytes));
    const e = el("div", { class: "node", "data-path": node.path, "data-bytes": String(node.bytes), style: "flex:" + node.bytes + " 1 0" }, label);
    body.append(el("tr", { "data-path": node.path, "data-bytes": String(node.bytes) },
      el("td", { style: "padding-left:" + (6 + depth * 16) + "px" }, node.name),
      el("td", { class: "num", title: node.bytes + " bytes" }, bytes(node.bytes)),
      el("td", { class: "num" }, (100 * node.bytes / total).toFixed(1) + "%")));
    if (kids.length) { const k = el("div", { class: "kids" }); kids.forEach((n) => k.append(draw(n, depth + 1))); e.append(k); }
    return e;
  };
  const top = draw(root, 0); top.style.flex = "1 1 0"; box.append(top);
}

// ------------------------------------------------------------------ Python stacks (flame view)

// The flame's nodes come depth-first, children largest first; a node's parent is the last node
// before it one level up.
function flameTree(f) {
  const root = { name: f.nodes[0].name, bytes: f.nodes[0].bytes, blocks: f.nodes[0].blocks, kids: [] }, open = [root];
  for (const n of f.nodes.slice(1)) {
    const node = { name: n.name, bytes: n.bytes, blocks: n.blocks, kids: [] };
    open.length = n.depth; open[n.depth - 1].kids.push(node); open.push(node);
  }
  return root;
}

// `function (file:line)` drawn as `function file-name:line`, the whole in the tooltip.
function frameLabel(name) {
  const m = /^(.*) \((.*):(\d+)\)$/.exec(name);
  return m ? m[1] + " " + m[2].split("/").pop() + ":" + m[3] : name;
}

function flame() {
  const box = $("flame"), note = $("flame-note"), f = (dev().flames || []).find((x) => x.family === state.family);
  box.textContent = ""; note.textContent = "";
  if (!f || !f.nodes.length) {
    $("flame-title").textContent = "Python stacks at the peak";
    note.textContent = "No Python stacks for these blocks: the job runs no Python here, or it was traced with --no-infer (trace reads them by default).";
    return;
  }
  $("flame-title").textContent = "Python stacks at the peak (" + f.family + ") " + secs(f.t) + ": " + bytes(f.total);
  const hue = (name) => { let h = 0; for (const ch of name) h = (h * 31 + ch.charCodeAt(0)) % 360; return h; };
  const draw = (node, depth) => {
    const colour = depth === 0 ? "#d5dbe1" : "hsl(" + (20 + hue(node.name) % 40) + ", 75%, " + (62 + hue(node.name) % 15) + "%)";
    const label = el("div", { class: "label", style: "background:" + colour,
      title: node.name + "\n" + bytes(node.bytes) + " (" + node.bytes + " bytes) in " + node.blocks + " block(s), " + (100 * node.bytes / f.total).toFixed(1) + "%" },
      (depth === 0 ? node.name + " (all)" : frameLabel(node.name)) + " " + bytes(node.bytes));
    const e = el("div", { class: "node", "data-name": node.name, "data-depth": String(depth), "data-bytes": String(node.bytes),
      style: "flex:" + node.bytes + " 1 0" }, label);
    const rest = node.bytes - node.kids.reduce((a, k) => a + k.bytes, 0);
    if (node.kids.length) {
      const k = el("div", { class: "kids" }); node.kids.forEach((n) => k.append(draw(n, depth + 1)));
      if (rest > 0) k.append(el("div", { class: "node", style: "flex:" + rest + " 1 0" }));
      e.append(k);
    }
    return e;
  };
  const top = draw(flameTree(f), 0); top.style.flex = "1 1 0"; box.append(top);
}

// ------------------------------------------------------------------ per-step curves

// Lines over steps (or over seconds, `unit` "s"), each series [[x, bytes], ...].
function stepChart(canvasId, legendId, series, unit) {
  const cv = $(canvasId), w = cv.clientWidth || 800, h = 220, dpr = window.devicePixelRatio || 1;
  cv.width = w * dpr; cv.height = h * dpr;
  const g = cv.getContext("2d"); g.setTransform(dpr, 0, 0, dpr, 0, 0); g.clearRect(0, 0, w, h);
  const pad = { l: 70, r: 10, t: 10, b: 22 };
  let smin = Infinity, smax = -Infinity, ymax = 1;
  series.forEach((s) => s.pts.forEach(([x, y]) => { smin = Math.min(smin, x); smax = Math.max(smax, x); ymax = Math.max(ymax, y); }));
  if (smin === Infinity) return;
  if (smax === smin) smax = smin + 1;
  ymax *= 1.08;
  const X = (s) => pad.l + (s - smin) / (smax - smin) * (w - pad.l - pad.r), Y = (v) => h - pad.b - v / ymax * (h - pad.t - pad.b);
  g.fillStyle = "#5c6773"; g.font = "11px system-ui, sans-serif"; g.strokeStyle = "#e6e9ed";
  for (let k = 0; k <= 4; k++) { const y = Y(ymax * k / 4); g.beginPath(); g.moveTo(pad.l, y); g.lineTo(w - pad.r, y); g.stroke(); g.fillText(bytes(Math.round(ymax * k / 4)), 2, y + 4); }
  const xl = (v) => (unit === "s" ? v.toFixed(3) + " s" : "step " + v);
  g.fillText(xl(smin), pad.l, h - 6); g.fillText(xl(smax), w - pad.r - 60, h - 6);
  const ul = $(legendId); ul.textContent = "";
  series.forEach((s, k) => {
    const colour = s.colour || PALETTE[k % PALETTE.length];
    g.strokeStyle = colour; g.setLineDash(s.dash || []); g.lineWidth = 1.6; g.beginPath();
    s.pts.forEach(([x, y], i) => (i ? g.lineTo(X(x), Y(y)) : g.moveTo(X(x), Y(y))));
    g.stroke(); g.setLineDash([]);
    ul.append(el("li", {}, el("span", { class: "swatch", style: "background:" + colour }), s.name));
  });
}

function steps() {
  const d = dev(), sec = $("steps-section");
  sec.hidden = d.steps.length === 0;
  if (sec.hidden) return;
  const series = d.curves.map((c) => {
    const f = FAMILIES.indexOf(c.family);
    return { name: c.family + " live", pts: d.steps.map((s) => [s.step, s.totals[f]]) };
  });
  stepChart("steps", "steps-legend", series);
}

function compare() {
  const sec = $("compare-section"), pair = (DATA.compare || []).find((p) => (state.run === 0 ? p.a : p.b) === state.device);
  sec.hidden = !pair;
  if (!pair) return;
  const da = DATA.runs[0].devices[pair.a], db = DATA.runs[1].devices[pair.b];
  const at = pair.step === null ? "at the traces' ends" : "at the end of step " + pair.step;
  const grown = pair.owners.filter((o) => o.diff > 0);
  $("compare-summary").textContent = "Device " + pair.device + ", " + at + ": " + FAMILIES.map((f, i) =>
    f + " " + bytes(pair.totals_a[i]) + " → " + bytes(pair.totals_b[i])).filter((_, i) => pair.totals_a[i] || pair.totals_b[i]).join("; ")
    + ". " + (grown.length ? grown.length + " owner(s) grew, most: " + grown[0].owner + " " + signed(grown[0].diff) + "." : "No owner grew.");
  const series = [];
  FAMILIES.forEach((f, i) => {
    if (!da.steps.some((s) => s.totals[i]) && !db.steps.some((s) => s.totals[i])) return;
    const colour = PALETTE[i];
    series.push({ name: "A " + f, colour, pts: da.steps.map((s) => [s.step, s.totals[i]]) });
    series.push({ name: "B " + f, colour, dash: [6, 3], pts: db.steps.map((s) => [s.step, s.totals[i]]) });
  });
  // The most grown owners, per step, in both runs.
  const ownerSeries = (d, name) => d.steps.map((s) => [s.step, s.owners.filter(([o]) => d.owners[o][1] === name).reduce((a, [, b]) => a + b, 0)]);
  grown.slice(0, 3).forEach((o, k) => {
    const colour = PALETTE[3 + k];
    series.push({ name: "A " + o.owner, colour, pts: ownerSeries(da, o.owner) });
    series.push({ name: "B " + o.owner, colour, dash: [6, 3], pts: ownerSeries(db, o.owner) });
  });
  stepChart("compare-steps", "compare-legend", series);
  const body = $("grew").tBodies[0]; body.textContent = "";
  for (const o of pair.owners) {
    body.append(el("tr", { "data-owner": o.owner, "data-diff": String(o.diff) }, el("td", {}, o.family + ": " + o.owner),
      el("td", { class: "num" }, bytes(o.a)), el("td", { class: "num" }, bytes(o.b)),
      el("td", { class: "num " + (o.diff > 0 ? "grew" : "shrank") }, signed(o.diff))));
  }
}

// ------------------------------------------------------------------ blocks

function blockRows() {
  const d = dev(), q = $("block-filter").value.trim().toLowerCase();
  let rows = d.blocks.rows.map((b) => Object.assign({}, b, { life: (b.free === null ? d.end : b.free) - b.alloc, stack: b.python_stack || b.c_stack }));
  if (q) rows = rows.filter((b) => [b.owner, b.flags, b.site, b.stack, b.ptr, b.family, b.kind].join(" ").toLowerCase().includes(q));
  const k = state.sortKey, dir = state.sortDir;
  rows.sort((a, b) => {
    const x = a[k], y = b[k];
    if (x === y) return 0; if (x === null) return 1; if (y === null) return -1;
    return (typeof x === "number" ? x - y : String(x).localeCompare(String(y))) * dir;
  });
  return rows;
}

function blocks() {
  const d = dev(), rows = blockRows(), body = $("blocks").tBodies[0], shown = rows.slice(0, 500);
  body.textContent = "";
  for (const b of shown) {
    const stack = b.stack ? el("details", {}, el("summary", {}, b.stack.split("\n")[0].slice(0, 80)), el("pre", {}, b.stack)) : "";
    body.append(el("tr", { "data-size": String(b.size) },
      el("td", { class: "num", title: b.size + " bytes" }, bytes(b.size)), el("td", {}, b.owner),
      el("td", {}, b.family + (b.kind === "block" ? "" : " " + b.kind)), el("td", { class: "num" }, secs(b.alloc)),
      el("td", { class: "num" }, b.free === null ? "live at the end" : secs(b.free)), el("td", { class: "num" }, span(b.life)),
      el("td", { class: "num" }, b.birth_step === null ? "" : String(b.birth_step)), el("td", {}, b.flags), el("td", {}, b.site), el("td", {}, stack)));
  }
  $("blocks-count").textContent = rows.length + " listed" + (rows.length > shown.length ? ", first " + shown.length + " shown" : "");
  const rest = d.blocks.blocks - d.blocks.rows.length;
  $("blocks-note").textContent = rest > 0 ? "The table lists the " + d.blocks.rows.length + " largest of the trace's " + d.blocks.blocks +
    " blocks (" + bytes(d.blocks.bytes) + " allocated in all); the other " + rest + " are only counted." : "Every block of the trace is listed.";
  document.querySelectorAll("#blocks th").forEach((th) => {
    th.className = th.dataset.key === state.sortKey ? (state.sortDir > 0 ? "asc" : "desc") : "";
  });
}

function blockEvents() {
  $("block-filter").addEventListener("input", blocks);
  document.querySelectorAll("#blocks th").forEach((th) => th.addEventListener("click", () => {
    const k = th.dataset.key;
    state.sortDir = state.sortKey === k ? -state.sortDir : (k === "size" || k === "life" ? -1 : 1);
    state.sortKey = k; blocks();
  }));
}

// ------------------------------------------------------------------ findings

function findingTable(f) {
  const cells = (row) => row.map((v, i) => {
    const col = f.columns[i];
    const text = v === null ? "" : /(^|_)(ts|ts_ns|alloc_ts|free_ts)$/.test(col) && typeof v === "number" ? secs(v) : String(v);
    return el("td", { class: (typeof v === "number" ? "num" : "") + (col === "verdict" ? " verdict" : "") }, text);
  });
  const body = el("tbody");
  f.rows.slice(0, 200).forEach((r) => body.append(el("tr", {}, ...cells(r))));
  const wrap = el("div", { class: "table-wrap" }, el("table", { "data-table": f.table }, el("thead", {}, el("tr", {}, ...f.columns.map((c) => el("th", {}, c)))), body));
  if (f.rows.length > 200) {
    wrap.append(el("button", { class: "pick", type: "button", onclick: (ev) => { f.rows.slice(200).forEach((r) => body.append(el("tr", {}, ...cells(r)))); ev.target.remove(); } }, "show all " + f.rows.length + " rows"));
  }
  return wrap;
}

function fragmentationChart(f, box) {
  const col = (n) => f.columns.indexOf(n), ts = col("ts_ns");
  if (ts < 0) return;
  const cv = el("canvas", { id: "fragmentation", height: "200" }), ul = el("ul", { class: "legend", id: "fragmentation-legend" });
  box.append(cv, ul);
  const series = ["reserved", "allocated", "largest_free"].filter((n) => col(n) >= 0).map((n) => ({
    name: n, pts: f.rows.filter((r) => typeof r[col(n)] === "number").map((r) => [r[ts] / 1e9, r[col(n)]]) }));
  stepChart("fragmentation", "fragmentation-legend", series, "s");
}

function simulationChart(f, box) {
  const ts = f.columns.indexOf("ts_ns"), name = f.columns.indexOf("series"), res = f.columns.indexOf("reserved");
  if (ts < 0 || name < 0 || res < 0) return;
  const cv = el("canvas", { id: "simulation", height: "200" }), ul = el("ul", { class: "legend", id: "simulation-legend" });
  box.append(cv, ul);
  const names = [...new Set(f.rows.map((r) => r[name]))];
  const series = names.map((n) => ({ name: n, pts: f.rows.filter((r) => r[name] === n && typeof r[res] === "number").map((r) => [r[ts] / 1e9, r[res]]) }));
  stepChart("simulation", "simulation-legend", series, "s");
}

function unexplainedChart(f, box) {
  const col = (n) => f.columns.indexOf(n), ts = col("ts_ns"), pid = col("pid");
  if (ts < 0 || pid < 0) return;
  const cv = el("canvas", { id: "unexplained", height: "200" }), ul = el("ul", { class: "legend", id: "unexplained-legend" });
  box.append(cv, ul);
  const pids = [...new Set(f.rows.map((r) => r[pid]))];
  const series = pids.flatMap((p) => ["process_used", "traced", "unexplained"].filter((n) => col(n) >= 0).map((n) => ({
    name: (pids.length > 1 ? "pid " + p + " " : "") + n,
    pts: f.rows.filter((r) => r[pid] === p && typeof r[col(n)] === "number").map((r) => [r[ts] / 1e9, r[col(n)]]) })));
  stepChart("unexplained", "unexplained-legend", series, "s");
}

function findings() {
  const box = $("findings"); box.textContent = "";
  for (const f of dev().findings) {
    const sec = el("div", { class: "finding", "data-table": f.table });
    box.append(sec);
    sec.append(el("h3", {}, f.title));
    if (!f.present) {
      sec.append(el("p", { class: "note" }, "Not in this DB: " + f.command + " writes it (" + f.table + ")."));
    } else {
      sec.append(el("p", { class: "note" }, f.total + " row(s) in " + f.table + (f.total > f.rows.length ? ", the first " + f.rows.length + " kept" : "")));
      if (f.table === "ms_oom") {
        const v = f.columns.indexOf("verdict");
        if (v >= 0) sec.append(el("p", {}, "Verdicts: ", el("span", { class: "verdict" }, f.rows.map((r) => r[v]).join(", ") || "none")));
      }
      if (f.table === "ms_fragmentation" && f.rows.length) fragmentationChart(f, sec);
      if (f.table === "ms_simulation" && f.rows.length) simulationChart(f, sec);
      if (f.table === "ms_unexplained" && f.rows.length) unexplainedChart(f, sec);
      if (f.rows.length) sec.append(findingTable(f));
    }
  }
}

// ------------------------------------------------------------------ ranks

// What a run is called: its rank and job when the page compares ranks, A or B of two runs.
function runName(i) {
  const r = DATA.runs[i];
  if (DATA.ranks) {
    for (const job of DATA.ranks.jobs) {
      const k = job.ranks.find((x) => x.label === r.label);
      if (k) return rankName(k) + (DATA.ranks.jobs.length > 1 ? " of " + (job.job || "no job id") : "");
    }
  }
  return (DATA.runs.length > 1 ? "AB"[i] + ": " : "") + r.label;
}
function rankName(r) { return r.rank === null ? "device " + r.device + " (" + r.label + ")" : "rank " + r.rank; }

function whyText(w) {
  if (w.kind === "peak") {
    return w.family + " peak " + bytes(w.peak) + " against the other ranks' median " + bytes(w.median) + " (" + signed(w.peak - w.median) + "), by " +
      w.by.map((e) => e.owner + " " + bytes(e.bytes) + " (others " + bytes(e.others_median) + ")").join(", ");
  }
  return w.owner + " grew " + signed(w.per_step) + " per step over steps " + w.from + ".." + w.to + " (" + signed(w.total) +
    ") and never gave it back; the other ranks' " + signed(w.others_per_step) + " per step";
}

// At most `max` of the steps, evenly spread, first and last kept: a table cannot show thousands.
function someSteps(steps, max) {
  if (steps.length <= max) return steps.map((_, i) => i);
  const out = [];
  for (let k = 0; k < max; k++) out.push(Math.round(k * (steps.length - 1) / (max - 1)));
  return [...new Set(out)];
}

function rankGrid(job) {
  const cols = someSteps(job.steps, 40);
  const values = job.ranks.flatMap((r) => cols.map((c) => r.at_steps[c])).filter((v) => v !== null);
  const lo = Math.min(...values), hi = Math.max(...values);
  const head = el("tr", {}, el("th", {}, "Rank, step"), ...cols.map((c) => el("th", { class: "num" }, String(job.steps[c]))));
  const body = el("tbody");
  job.ranks.forEach((r) => {
    const row = el("tr", { "data-rank": String(r.rank) }, el("th", {}, rankName(r)));
    cols.forEach((c) => {
      const v = r.at_steps[c];
      const share = v === null || hi === lo ? 0 : (v - lo) / (hi - lo);
      row.append(el("td", { class: "num heat", style: "background: rgba(198, 40, 40, " + (0.08 + 0.6 * share).toFixed(2) + ")",
        "data-bytes": v === null ? "" : String(v), title: rankName(r) + ", step " + job.steps[c] + ": " + bytes(v) }, v === null ? "–" : bytes(v)));
    });
    body.append(row);
  });
  const note = cols.length < job.steps.length ? " (" + cols.length + " of " + job.steps.length + " steps, evenly spread)" : "";
  return [el("h4", {}, (job.family || "") + " live bytes at each step's end" + note), el("div", { class: "table-wrap" }, el("table", { class: "rank-grid" }, el("thead", {}, head), body))];
}

function ranks() {
  const sec = $("ranks-section"), box = $("ranks");
  sec.hidden = !DATA.ranks;
  if (!DATA.ranks) return;
  box.textContent = "";
  for (const job of DATA.ranks.jobs) {
    const part = el("div", { class: "rank-job", "data-job": job.job || "" });
    box.append(part);
    const compared = job.compared && job.compared[0] < job.compared[1] ? ", steps " + job.compared[0] + ".." + job.compared[1] + " compared" : "";
    part.append(el("h3", {}, (job.job ? "Job " + job.job : "Traces without a job id") + ": " + job.ranks.length + " rank(s)" +
      (job.world_size ? " of " + job.world_size : "") + ", " + (job.family || "no") + " live bytes" + compared));
    if (job.missing.length) part.append(el("p", { class: "note" }, "Ranks not given: " + job.missing.join(", ")));
    const outliers = el("ul", { class: "outliers" });
    if (!job.outliers.length) outliers.append(el("li", {}, "No rank stands out."));
    for (const o of job.outliers) {
      outliers.append(el("li", { class: "outlier", "data-rank": String(o.rank) },
        el("strong", {}, rankName(job.ranks[o.index]) + " stands out: "), o.why.map(whyText).join("; ") + "."));
    }
    part.append(outliers);
    const body = el("tbody");
    job.ranks.forEach((r, i) => {
      const run = DATA.runs.findIndex((x) => x.label === r.label);
      const pick = () => { if (run >= 0) { state.run = run; state.device = 0; reset(); $("overview").scrollIntoView(); } };
      body.append(el("tr", { class: job.outliers.some((o) => o.index === i) ? "outlier" : "", "data-rank": String(r.rank), title: r.label, onclick: pick },
        el("td", {}, rankName(r)), el("td", {}, r.device), el("td", { class: "num" }, bytes(r.peak)),
        el("td", { class: "num" }, r.growth_per_step === null ? "–" : signed(r.growth_per_step)),
        el("td", {}, r.owners.slice(0, 4).map((h) => h.owner + " " + bytes(h.bytes)).join(", "))));
    });
    const head = el("tr", {}, ...["Rank", "Device", "Peak", "Growth per step", "Owners at the peak"].map((h) => el("th", {}, h)));
    part.append(el("table", { class: "rank-table" }, el("thead", {}, head), body));
    if (job.steps.length) part.append(...rankGrid(job));
  }
}

// ------------------------------------------------------------------ page

function summarised() {
  const ul = $("summarised"); ul.textContent = "";
  const notes = dev().summarised;
  if (!notes.length) ul.append(el("li", {}, "Nothing: every instant, block and result row of this device is in the page."));
  notes.forEach((n) => ul.append(el("li", {}, n)));
}

function reset() {
  const d = dev();
  state.family = d.peak_family || (d.curves[0] && d.curves[0].family) || null;
  state.view = null; state.picked = null;
  render();
}

function render() {
  pickers(); overview(); drawTimeline(); tree(); flame(); steps(); compare(); blocks(); findings(); summarised();
}

function main() {
  $("runs").textContent = DATA.ranks ? DATA.runs.length + " traces compared as ranks; pick one to see its memory below." : DATA.runs.map((r, i) => runName(i) +
    " (origin " + new Date(Number(BigInt(r.origin_ns) / 1000000n)).toISOString() + ")").join(" · ");
  $("footer").textContent = "Written by " + DATA.tool + " " + DATA.version + ". Times are seconds after each run's first event.";
  timelineEvents(); blockEvents(); ranks();
  let resized = null;
  window.addEventListener("resize", () => { clearTimeout(resized); resized = setTimeout(() => { drawTimeline(); steps(); compare(); }, 100); });
  reset();
  document.body.setAttribute("data-ready", "1");
}

main();
