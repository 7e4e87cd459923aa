// kvtier dashboard: polls /v1/stats (see kvtier/dashboard/stats.py for the document) and draws
// the figures and charts. Each figure's element carries the raw value in data-value, so a test
// (tests/unit/dashboard/test_dashboard_browser.py) can compare the page with the endpoint.
"use strict";

const POLL_MS = 1000;
const STATS_URL = "v1/stats";
const TIER_COLORS = { all: "#111827", GPU: "#16a34a", CPU: "#2563eb", DISK: "#ea580c", REMOTE: "#9333ea" };
const EXTRA_COLORS = ["#0891b2", "#db2777", "#65a30d", "#7c3aed", "#b45309", "#0f766e", "#be123c", "#4338ca"];
// Series that overlap (all hits from one tier: "all" and "GPU" coincide) stay distinguishable:
// each has its own dash pattern and marker size, "all" is the thick solid line with hollow markers.
const TIER_DASHES = { all: [], GPU: [10, 4], CPU: [3, 3], DISK: [14, 4, 3, 4], REMOTE: [6, 6] };
const EXTRA_DASHES = [[], [10, 4], [3, 3], [14, 4, 3, 4], [6, 6], [2, 6], [18, 6]];

// A daemon started with a token: open /dashboard#token=SECRET (the fragment never leaves the
// browser); the page sends it as a bearer token.
const TOKEN = new URLSearchParams(location.hash.slice(1)).get("token");

const fmtInt = (n) => (n == null ? "–" : Math.round(n).toLocaleString("en-US"));
const fmtPct = (x) => (x == null ? "–" : (x * 100).toFixed(1) + "%");
function fmtBytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}
const sum = (obj) => Object.values(obj || {}).reduce((a, b) => a + b, 0);

function colorOf(name, index) {
  return TIER_COLORS[name] || EXTRA_COLORS[index % EXTRA_COLORS.length];
}

function dashOf(name, index) {
  return TIER_DASHES[name] || EXTRA_DASHES[index % EXTRA_DASHES.length];
}

function setValue(id, raw, text) {
  const el = document.getElementById(id);
  el.dataset.value = raw == null ? "" : String(raw);
  el.textContent = text;
}

// -- charts --------------------------------------------------------------------------------
const charts = {};

function chartWidth(el) {
  return Math.max(300, el.clientWidth || el.parentElement.clientWidth - 20);
}

// One uPlot per element; rebuilt when its set of series changes (a tier or path appears).
// Every sample is a marker and lines span idle intervals (a null hit rate: nothing looked up),
// so the first samples already show; with none the chart says "no data yet".
function drawChart(id, names, xs, ys, yFormat, yRange) {
  const el = document.getElementById(id);
  const hasData = xs.length > 0 && ys.some((y) => y.some((v) => v != null));
  el.parentElement.classList.toggle("no-data", !hasData);
  const key = names.join("|");
  const data = [xs, ...ys];
  const chart = charts[id];
  if (chart && chart.key === key) {
    chart.plot.setData(data);
    return;
  }
  if (chart) chart.plot.destroy();
  const colors = names.map((name, i) => colorOf(name, i));
  const opts = {
    width: chartWidth(el),
    height: 220,
    scales: { x: { time: true }, y: yRange ? { range: yRange } : { auto: true } },
    axes: [{}, { values: (u, vals) => vals.map(yFormat), size: 96 }],
    legend: { live: false },
    series: [{}, ...names.map((name, i) => ({
      label: name, stroke: colors[i], width: name === "all" ? 3 : 2, dash: dashOf(name, i), spanGaps: true,
      points: { show: true, size: name === "all" ? 8 : 5, width: 2, fill: name === "all" ? "#ffffff" : colors[i] },
      value: (u, v) => (v == null ? "–" : yFormat(v)),
    }))],
  };
  charts[id] = { key, colors, plot: new uPlot(opts, data, el) };
}

// For tests: per chart, the points each series has and how many canvas pixels carry its color.
function coloredPixels(plot, hex) {
  const [r, g, b] = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
  const { width, height } = plot.ctx.canvas;
  const px = plot.ctx.getImageData(0, 0, width, height).data;
  let n = 0;
  for (let i = 0; i < px.length; i += 4) {
    if (px[i + 3] > 200 && Math.abs(px[i] - r) + Math.abs(px[i + 1] - g) + Math.abs(px[i + 2] - b) < 40) n++;
  }
  return n;
}
window.kvtierChartStats = () => Object.entries(charts).map(([id, c]) => ({
  id,
  empty: document.getElementById(id).parentElement.classList.contains("no-data"),
  series: c.plot.series.slice(1).map((s, i) => ({
    label: s.label, color: c.colors[i], points: c.plot.data[i + 1].filter((v) => v != null).length,
    pixels: coloredPixels(c.plot, c.colors[i]),
  })),
}));

function drawCharts(series) {
  const xs = series.t;
  const tiers = Object.keys(series.hit_rate);
  drawChart("chart-hit-rate", tiers, xs, tiers.map((t) => series.hit_rate[t]),
    (v) => (v * 100).toFixed(0) + "%", [0, 1]);
  drawChart("chart-tokens", ["from cache", "computed"], xs,
    [series.cached_tokens_per_s, series.computed_tokens_per_s], (v) => fmtInt(v) + "/s");
  const reasons = Object.keys(series.miss_tokens_per_s || {});
  drawChart("chart-misses", reasons, xs, reasons.map((r) => series.miss_tokens_per_s[r]), (v) => fmtInt(v) + "/s");
  const paths = Object.keys(series.bytes_per_s);
  drawChart("chart-bytes", paths, xs, paths.map((p) => series.bytes_per_s[p]), (v) => fmtBytes(v) + "/s");
  const evictTiers = Object.keys(series.evicted_blocks_per_s);
  drawChart("chart-evictions", evictTiers, xs, evictTiers.map((t) => series.evicted_blocks_per_s[t]),
    (v) => v.toFixed(v < 10 ? 1 : 0) + "/s");
}

// -- figures and tables --------------------------------------------------------------------
function renderFigures(s) {
  setValue("kpi-hit-rate", s.hit_rate, fmtPct(s.hit_rate));
  setValue("kpi-lookup-tokens", s.lookup_tokens, fmtInt(s.lookup_tokens));
  document.getElementById("kpi-remote-lookup").textContent = "REMOTE asked: " + fmtInt(s.remote_lookup_tokens);
  setValue("kpi-hit-tokens", s.hit_tokens_total, fmtInt(s.hit_tokens_total));
  document.getElementById("kpi-hit-split").textContent =
    Object.entries(s.hit_tokens).map(([t, n]) => t + " " + fmtInt(n)).join(" · ") || "–";
  setValue("kpi-computed-tokens", s.computed_tokens, fmtInt(s.computed_tokens));
  document.getElementById("kpi-computed-note").textContent = s.engine_computed_tokens == null
    ? "looked up but not cached" : "looked up but not cached; engine prefilled " + fmtInt(s.engine_computed_tokens);
  setValue("kpi-ttft-saved", s.ttft_saved_s, s.ttft_saved_s == null ? "n/a" : s.ttft_saved_s.toFixed(1) + " s");
  const lost = s.ttft_lost_s || 0;
  document.getElementById("kpi-ttft-note").textContent = s.ttft_saved_s == null
    ? "not reported: needs the engine connector's counter"
    : "prefill time avoided, since start" + (lost >= 0.05 ? "; loads cost " + lost.toFixed(1) + " s more" : "");
  const missed = (s.miss_tokens || []).reduce((a, m) => a + m.tokens, 0);
  setValue("kpi-miss-tokens", missed, fmtInt(missed));
  document.getElementById("kpi-miss-split").textContent = (s.miss_tokens || []).slice(0, 3)
    .map((m) => m.reason.replace(/_/g, " ") + (m.tier ? " " + m.tier : "") + " " + fmtInt(m.tokens)).join(" · ") || "none";
  const evicted = sum(s.evicted_blocks);
  setValue("kpi-evicted-blocks", evicted, fmtInt(evicted));
  const failures = s.load_failures.reduce((a, f) => a + f.blocks, 0);
  setValue("kpi-load-failures", failures, fmtInt(failures));
  document.getElementById("kpi-failure-split").textContent = s.load_failures
    .filter((f) => f.blocks > 0).map((f) => (f.tier ? f.tier + " " : "") + f.reason + " " + fmtInt(f.blocks))
    .join(" · ") || "none";
  const moved = sum(s.moved_bytes);
  setValue("kpi-moved-bytes", moved, fmtBytes(moved));
}

function cell(id, raw, text) {
  const td = document.createElement("td");
  if (id) td.id = id;
  td.dataset.value = raw == null ? "" : String(raw);
  if (text instanceof Node) td.appendChild(text); else td.textContent = text;
  return td;
}

function occupancyBar(used, capacity) {
  const span = document.createElement("span");
  const bar = document.createElement("span");
  bar.className = "bar";
  const fill = document.createElement("span");
  const frac = capacity ? Math.min(1, used / capacity) : 0;
  fill.style.width = (frac * 100).toFixed(1) + "%";
  bar.appendChild(fill);
  const pct = document.createElement("span");
  pct.className = "pct";
  pct.textContent = fmtPct(frac);
  span.append(bar, pct);
  return span;
}

function renderTiers(s) {
  const body = document.querySelector("#tier-table tbody");
  body.replaceChildren();
  const tiers = Array.from(new Set([...Object.keys(s.tiers), ...s.tier_names]));
  for (const t of tiers) {
    const u = s.tiers[t] || { used_bytes: null, capacity_bytes: null, blocks: null };
    const tr = document.createElement("tr");
    tr.append(
      cell(null, t, t),
      cell(`tier-${t}-occupancy`, u.capacity_bytes ? u.used_bytes / u.capacity_bytes : null,
        u.capacity_bytes ? occupancyBar(u.used_bytes, u.capacity_bytes) : "–"),
      cell(`tier-${t}-used_bytes`, u.used_bytes, fmtBytes(u.used_bytes)),
      cell(`tier-${t}-capacity_bytes`, u.capacity_bytes, fmtBytes(u.capacity_bytes)),
      cell(`tier-${t}-blocks`, u.blocks, fmtInt(u.blocks)),
      cell(`tier-${t}-hit_tokens`, s.hit_tokens[t] ?? 0, fmtInt(s.hit_tokens[t] ?? 0)),
      cell(`tier-${t}-served_tokens`, s.served_tokens[t] ?? 0, fmtInt(s.served_tokens[t] ?? 0)),
      cell(`tier-${t}-stored_tokens`, s.stored_tokens[t] ?? 0, fmtInt(s.stored_tokens[t] ?? 0)),
      cell(`tier-${t}-evicted_blocks`, s.evicted_blocks[t] ?? 0, fmtInt(s.evicted_blocks[t] ?? 0)),
    );
    body.appendChild(tr);
  }
}

function renderMisses(s) {
  const body = document.querySelector("#miss-table tbody");
  body.replaceChildren();
  const rows = s.miss_tokens || [];
  const total = rows.reduce((a, m) => a + m.tokens, 0);
  for (const m of rows) {
    const tr = document.createElement("tr");
    const key = `miss-${m.reason}-${m.tier || "none"}`;
    tr.append(cell(null, m.reason, m.reason.replace(/_/g, " ")), cell(null, m.tier, m.tier || "–"),
      cell(key, m.tokens, fmtInt(m.tokens)), cell(null, total ? m.tokens / total : null, fmtPct(total ? m.tokens / total : null)));
    body.appendChild(tr);
  }
}

function renderPaths(s, series) {
  const body = document.querySelector("#path-table tbody");
  body.replaceChildren();
  for (const [p, n] of Object.entries(s.moved_bytes)) {
    const rates = series.bytes_per_s[p] || [];
    const last = rates.length ? rates[rates.length - 1] : null;
    const tr = document.createElement("tr");
    tr.append(cell(null, p, p), cell(`path-${p}-bytes`, n, fmtBytes(n)),
      cell(`path-${p}-rate`, last, last == null ? "–" : fmtBytes(last) + "/s"));
    body.appendChild(tr);
  }
}

// -- polling -------------------------------------------------------------------------------
function updateNamespaces(doc) {
  const select = document.getElementById("namespace");
  const have = Array.from(select.options).map((o) => o.value).slice(1);
  const names = Object.keys(doc.namespaces);
  if (have.join("|") === names.join("|")) return;
  const chosen = select.value;
  select.replaceChildren(new Option("all namespaces", ""));
  for (const name of names) {
    const label = doc.namespaces[name].name || (name.length > 20 ? name.slice(0, 16) + "…" : name);
    select.appendChild(new Option(label, name));
  }
  select.value = names.includes(chosen) ? chosen : "";
}

function render(doc) {
  updateNamespaces(doc);
  const ns = document.getElementById("namespace").value;
  const s = ns ? doc.namespaces[ns] : doc.total;
  renderFigures(s);
  renderTiers(s);
  renderMisses(s);
  renderPaths(s, doc.series);
  drawCharts(doc.series);
  const when = new Date(doc.time * 1000);
  setValue("sample-time", doc.time, when.toLocaleTimeString("en-GB"));
  document.body.dataset.renders = String(Number(document.body.dataset.renders || 0) + 1);
}

let lastDoc = null;

async function poll() {
  const status = document.getElementById("status");
  try {
    const headers = TOKEN ? { Authorization: "Bearer " + TOKEN } : {};
    const response = await fetch(STATS_URL, { cache: "no-store", headers });
    if (!response.ok) throw new Error("HTTP " + response.status);
    lastDoc = await response.json();
    render(lastDoc);
    status.textContent = "live";
    status.className = "status ok";
  } catch (err) {
    status.textContent = "no data: " + err.message;
    status.className = "status error";
  } finally {
    if (!window.kvtierPaused) setTimeout(poll, POLL_MS);
  }
}

document.getElementById("namespace").addEventListener("change", () => lastDoc && render(lastDoc));
window.addEventListener("resize", () => {
  for (const [id, c] of Object.entries(charts)) c.plot.setSize({ width: chartWidth(document.getElementById(id)), height: 220 });
});
// Tests: window.kvtierPaused = true stops polling after the poll in flight; kvtierPoll() polls once.
window.kvtierPoll = poll;
poll();
