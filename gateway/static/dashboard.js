// Ember's dashboard: polls /dashboard/api/state every second and draws each function's charts as SVG.
// Written for this page, no libraries and no build step. Every chart names what it shows in its DOM:
// <figure data-chart=NAME data-function=APP/FUNCTION>, each series a <path data-series=KEY data-last=VALUE>.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const WIDTH = 300, HEIGHT = 120, LEFT = 36, RIGHT = 6, TOP = 6, BOTTOM = 16;
const POLL_MS = 1000;
const COLORS = {starting: "var(--starting)", hot: "var(--hot)", parked: "var(--parked)",
                a: "var(--a)", b: "var(--b)", c: "var(--c)", d: "var(--d)"};
const SEGMENTS = ["#f97316", "#a78bfa", "#34d399", "#60a5fa", "#f472b6", "#facc15", "#94a3b8"];

function html(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "style") node.style.cssText = v; else node.setAttribute(k, v);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

const format = {
  count: (v) => (v === null ? "–" : String(Math.round(v))),
  rate: (v) => (v === null ? "–" : `${v < 10 ? v.toFixed(2) : v.toFixed(0)}/s`),
  seconds: (v) => (v === null ? "–" : v < 1 ? `${(v * 1000).toFixed(v < 0.01 ? 1 : 0)} ms` : `${v.toFixed(2)} s`),
  percent: (v) => (v === null ? "–" : `${(v * 100).toFixed(0)}%`),
};

// Axis labels: short, so they fit the chart's left margin.
const tick = {
  count: (v) => String(Math.round(v)),
  rate: (v) => (v === 0 ? "0" : `${+v.toPrecision(2)}/s`),
  seconds: (v) => (v === 0 ? "0" : v < 1 ? `${+(v * 1000).toPrecision(2)}ms` : `${+v.toPrecision(2)}s`),
  percent: (v) => `${Math.round(v * 100)}%`,
};

function niceMax(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * power >= value) return step * power;
  return 10 * power;
}

// One chart: `series` are {key, label, color, values: [[t, v or null]...]}; `stacked` piles them as areas.
function chart(name, fn, title, series, {kind = "count", stacked = false, max = null} = {}) {
  const times = series.flatMap((s) => s.values.map(([t]) => t));
  const end = times.length ? Math.max(...times) : 0;
  const span = Math.min(600, Math.max(30, end - (times.length ? Math.min(...times) : end)));
  const x = (t) => LEFT + ((t - (end - span)) / span) * (WIDTH - LEFT - RIGHT);
  const tops = stacked ? stackedTops(series) : series.map((s) => s.values);
  const highest = Math.max(0, ...tops.flatMap((values) => values.map(([, v]) => v ?? 0)));
  const top = max ?? niceMax(highest);
  const y = (v) => TOP + (1 - v / top) * (HEIGHT - TOP - BOTTOM);

  const plot = svg("svg", {viewBox: `0 0 ${WIDTH} ${HEIGHT}`, preserveAspectRatio: "none", role: "img",
                           "aria-label": title});
  for (const fraction of [0, 0.5, 1]) {
    const level = y(top * fraction);
    plot.append(svg("line", {class: "grid", x1: LEFT, x2: WIDTH - RIGHT, y1: level, y2: level}));
  }
  const axis = (text, attrs) => { const t = svg("text", {class: "axis", ...attrs}); t.textContent = text; return t; };
  plot.append(axis(tick[kind](top), {x: LEFT - 4, y: y(top) + 8, "text-anchor": "end"}),
              axis(tick[kind](0), {x: LEFT - 4, y: y(0), "text-anchor": "end"}),
              axis(`-${Math.round(span)} s`, {x: LEFT, y: HEIGHT - 2}),
              axis("now", {x: WIDTH - RIGHT, y: HEIGHT - 2, "text-anchor": "end"}));
  if (!times.length) {
    const empty = svg("text", {class: "empty", x: WIDTH / 2, y: HEIGHT / 2, "text-anchor": "middle"});
    empty.textContent = "waiting for data";
    plot.append(empty);
  }
  series.forEach((s, i) => {
    const last = [...s.values].reverse().find(([, v]) => v !== null);
    const attrs = {"data-series": s.key, "data-last": last ? String(last[1]) : "", stroke: s.color,
                   "stroke-width": 1.6, "vector-effect": "non-scaling-stroke"};
    if (stacked) {
      const below = i ? tops[i - 1] : s.values.map(([t]) => [t, 0]);
      const upper = tops[i].map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`);
      const lower = below.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).reverse();
      const d = upper.length ? `M${upper.join("L")}L${lower.join("L")}Z` : "";
      plot.append(svg("path", {...attrs, d, fill: s.color, "fill-opacity": 0.55}));
    } else {
      plot.append(svg("path", {...attrs, d: linePath(s.values, x, y), fill: "none"}));
    }
  });
  const legend = html("div", {class: "legend"}, ...series.map((s) => {
    const last = [...s.values].reverse().find(([, v]) => v !== null);
    return html("span", {"data-series": s.key, style: `--swatch: ${s.color}`}, `${s.label} `,
                html("b", {}, format[kind](last ? last[1] : null)));
  }));
  return html("figure", {class: "chart", "data-chart": name, "data-function": fn},
              html("figcaption", {}, html("span", {}, title)), plot, legend);
}

function stackedTops(series) {
  let running = series[0] ? series[0].values.map(([t]) => [t, 0]) : [];
  return series.map((s) => {
    running = s.values.map(([t, v], i) => [t, running[i][1] + (v ?? 0)]);
    return running;
  });
}

function linePath(values, x, y) {
  let d = "", pen = "M";
  for (const [t, v] of values) {
    if (v === null || v === undefined) { pen = "M"; continue; }
    d += `${pen}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
    pen = "L";
  }
  return d;
}

function column(samples, key) {
  return samples.map((s) => [s.t, s[key] ?? null]);
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString([], {hour12: false});
}

function functionCard(f) {
  const id = `${f.app}/${f.function}`;
  const s = f.series;
  const charts = [
    chart("replicas", id, "Replicas by state", [
      {key: "hot", label: "hot", color: COLORS.hot, values: column(s, "hot")},
      {key: "starting", label: "starting", color: COLORS.starting, values: column(s, "starting")},
      {key: "parked", label: "parked", color: COLORS.parked, values: column(s, "parked")},
    ], {stacked: true}),
    chart("queue", id, "Queue and in flight", [
      {key: "queue", label: "queued", color: COLORS.d, values: column(s, "queue")},
      {key: "in_flight", label: "in flight", color: COLORS.c, values: column(s, "in_flight")},
    ]),
    chart("requests", id, `Requests and errors (${10} s rate)`, [
      {key: "rps", label: "requests", color: COLORS.a, values: column(s, "rps")},
      {key: "eps", label: "errors", color: "var(--failed)", values: column(s, "eps")},
    ], {kind: "rate"}),
    chart("latency", id, "Latency", [
      {key: "p50", label: "p50", color: COLORS.c, values: column(s, "p50")},
      {key: "p99", label: "p99", color: COLORS.b, values: column(s, "p99")},
    ], {kind: "seconds"}),
  ];
  if (f.llm) {
    charts.push(
      chart("ttft", id, "Time to first token", [
        {key: "ttft_p50", label: "p50", color: COLORS.c, values: column(s, "ttft_p50")},
        {key: "ttft_p99", label: "p99", color: COLORS.b, values: column(s, "ttft_p99")},
      ], {kind: "seconds"}),
      chart("itl", id, "Inter-token latency", [
        {key: "itl_p50", label: "p50", color: COLORS.c, values: column(s, "itl_p50")},
        {key: "itl_p99", label: "p99", color: COLORS.b, values: column(s, "itl_p99")},
      ], {kind: "seconds"}),
      chart("kv", id, "KV-cache usage", [
        {key: "kv", label: "used", color: COLORS.b, values: column(s, "kv")},
      ], {kind: "percent", stacked: true, max: 1}),
      chart("slots", id, "Replica slots (one a sequence)", [
        {key: "queue_slots", label: "queued", color: COLORS.d, values: column(s, "queue_slots")},
        {key: "slots", label: "held", color: COLORS.c, values: column(s, "slots")},
      ]),
    );
  }
  const stat = (value, label, key) => html("div", {class: "stat", "data-stat": key}, html("b", {}, String(value)),
                                           html("span", {}, label));
  return html("section", {class: "card function", "data-function": id},
    html("h2", {}, `${f.app} / ${f.function}`, html("span", {class: "badge"}, f.kind),
         f.llm ? html("span", {class: "badge llm"}, "LLM") : null,
         html("span", {class: "muted"}, `replicas ${f.settings.min_replicas}–${f.settings.max_replicas}, ` +
                                         `${f.settings.max_concurrency} ${f.llm ? "slots" : "calls"} each`)),
    html("div", {class: "stats"}, stat(f.by_state.hot, "hot", "hot"), stat(f.by_state.starting, "starting", "starting"),
         stat(f.by_state.parked, "parked", "parked"), stat(f.by_state.failed, "failed", "failed"),
         stat(f.queue_depth, "queued", "queue"), stat(f.in_flight, "in flight", "in_flight")),
    html("div", {class: "charts"}, ...charts),
    html("div", {class: "panels"}, coldStarts(f), decisions(f)));
}

function coldStarts(f) {
  const tiers = Object.entries(f.cold_starts.by_tier).map(([tier, n]) => `${tier} ${n}`).join(", ");
  const starts = f.cold_starts.recent;
  const parts = (start) => Object.entries(start.timings).filter(([k, v]) => k.endsWith("_ms") && k !== "total_ms"
                                                                && typeof v === "number");
  const longest = Math.max(1, ...starts.map((st) => st.timings.total_ms ?? parts(st).reduce((a, [, v]) => a + v, 0)));
  const names = [...new Set(starts.flatMap((st) => parts(st).map(([k]) => k)))];
  const color = (phase) => SEGMENTS[names.indexOf(phase) % SEGMENTS.length];
  const rows = starts.map((st) => {
    const total = st.timings.total_ms ?? parts(st).reduce((a, [, v]) => a + v, 0);
    return html("div", {class: "start", "data-replica": st.replica, "data-tier": st.tier},
      html("span", {title: st.replica}, `${clock(st.t)} ${st.tier} · ${total} ms`),
      html("div", {class: "bar", style: `width: ${Math.max(4, (100 * total) / longest)}%`},
           ...parts(st).map(([k, v]) => html("i", {title: `${k.replace(/_ms$/, "")} ${v} ms`,
             style: `width: ${(100 * v) / Math.max(total, 1)}%; background: ${color(k)}`}))));
  });
  const key = html("div", {class: "legend"}, ...names.map((k) => html("span",
    {style: `--swatch: ${color(k)}`}, k.replace(/_ms$/, ""))));
  return html("div", {class: "panel", "data-panel": "cold-starts"},
    html("h3", {}, `Starts and wakes ${tiers ? `(calls that waited: ${tiers})` : ""}`),
    ...(rows.length ? [...rows, key] : [html("div", {class: "muted"}, "no replica has started yet")]));
}

function decisions(f) {
  const rows = f.decisions.map((d) => html("div", {class: `decision ${d.action}`},
    html("b", {}, d.action + (d.count ? ` ×${d.count}` : "")), `${clock(d.t)} `,
    d.replica ? html("span", {class: "muted"}, `${d.replica} `) : null, d.reason));
  return html("div", {class: "panel", "data-panel": "decisions"}, html("h3", {}, "Last scaling decisions"),
    ...(rows.length ? rows : [html("div", {class: "muted"}, "none yet")]));
}

function meter(used, limit) {
  if (!limit) return html("span", {}, `${used} `, html("span", {class: "muted"}, "no limit"));
  const fraction = Math.min(1, used / limit);
  return html("div", {class: "meter"},
    html("div", {class: "track"}, html("i", {class: fraction > 0.9 ? "high" : "", style: `width: ${fraction * 100}%`})),
    html("span", {}, `${used} / ${limit}`));
}

function keyRow(k) {
  return html("tr", {"data-key": k.id},
    html("td", {}, `${k.name} `, html("span", {class: "muted"}, k.id + (k.admin ? " · admin" : ""))),
    html("td", {}, meter(k.used.rpm, k.limits.rpm)), html("td", {}, meter(k.used.tpm, k.limits.tpm)),
    html("td", {}, meter(k.used.concurrency, k.limits.concurrency)),
    html("td", {}, String(k.total.requests)), html("td", {}, String(k.total.tokens)));
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const reply = await fetch("/dashboard/api/state", {credentials: "same-origin", cache: "no-store"});
    if (reply.status === 401) { window.location.reload(); return; }
    if (!reply.ok) throw new Error(`HTTP ${reply.status}`);
    const state = await reply.json();
    document.getElementById("functions").replaceChildren(...state.functions.map(functionCard));
    document.querySelector("#keys tbody").replaceChildren(...state.keys.map(keyRow));
    status.textContent = `updated ${clock(state.time)} · gateway up ${Math.round(state.uptime_s)} s`;
    document.body.dataset.updated = String(state.time);
  } catch (error) {
    status.textContent = `cannot reach the gateway (${error.message}); retrying`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
