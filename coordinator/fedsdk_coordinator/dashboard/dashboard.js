// The coordinator's live dashboard: draws the state the coordinator wrote into the page at once, then polls
// the REST API (same origin) and redraws; no library, no network beyond this coordinator. Every value from the
// API is written with textContent or as an SVG attribute, never parsed as HTML (device ids and reasons are
// chosen by devices). It shows no model values.
"use strict";

const POLL_MS = 1500;
const SVG = "http://www.w3.org/2000/svg";
const METRICS = ["accuracy", "mae", "label_accuracy"];
// What the page asks the API for, each time it polls.
const SOURCES = [
  ["health", () => "/api/health"],
  ["clients", () => "/api/clients"],
  ["clusters", () => "/api/clusters"],
  ["rounds", () => `/api/rounds?since=${since()}`],
];
// The device's protection steps (seconds in its update's metrics), as the engine counts them (engine/timing.py).
const PROTECT = ["sensitivity_s", "mask_s", "encode_s", "encrypt_s", "self_audit_s", "leak_drop_s", "mask_vector_s", "mask_encode_s"];
// Where a round's time went, in the order drawn: [part, legend label, what it is]. The coordinator records
// each part as the round's time_<part>_s (engine/timing.py); they add up to its round_s.
const PARTS = [
  ["train", "train", "local training (mean over the devices that sent an update)"],
  ["protect", "protect", "sensitivity, mask, encoding, encryption, self-audit (device mean)"],
  ["upload", "upload", "publishing the update (device mean)"],
  ["trips", "message trips", "task, update, aggregate and report through the broker, with the device's untimed work around them (reading the task, serialising, merging and evaluating the model); device mean"],
  ["slowest", "waiting for the slowest device", "the last update's arrival after the mean device's, and the same for the reports"],
  ["missing", "waiting for absent devices", "from the last update to the end of the collection (deadline, or a failure or decline arriving last), and from the last report to the end of the report wait"],
  ["unmask", "unmask", "secure aggregation: waiting for the devices' unmask shares"],
  ["aggregate", "aggregate", "the coordinator sums, stores and publishes the aggregate"],
  ["decrypt", "decrypt", "decrypting the aggregate (device mean)"],
  ["shares", "waiting for decryption shares", "cooperative decryption: waiting for the peers' shares (device mean)"],
  ["personalise", "personalise", "fine-tuning the device's personal model (device mean)"],
  ["unattributed", "unattributed", "the coordinator's closing bookkeeping; in a round recorded without a breakdown (resumed after a restart, or by an older coordinator): all but the devices' timed steps and the aggregation"],
];
const COLORS = {
  train: "#2563eb", protect: "#9333ea", upload: "#0891b2", trips: "#64748b", slowest: "#f472b6",
  missing: "#b91c1c", unmask: "#a16207", aggregate: "#d97706", decrypt: "#16a34a", shares: "#facc15",
  personalise: "#84cc16", unattributed: "#cbd5e1", federated: "#2563eb", personal: "#16a34a",
};

// The plot's lines: the federated figure (or the coordinator's own), and the devices' personal models.
const LINES = {
  federated: { stroke: COLORS.federated, "stroke-width": 2 },
  personal: { stroke: COLORS.personal, "stroke-width": 2, "stroke-dasharray": "5 3" },
};

const rounds = new Map(); // "round:cluster" -> round record with results
const known = { health: null, clients: null, clusters: null }; // the latest answers

// -- DOM helpers: text only ------------------------------------------------------------------------------
function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (k === "text") node.textContent = v;
    else if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function fixed(v, digits) {
  return typeof v === "number" && Number.isFinite(v) ? v.toFixed(digits) : "–";
}

function pct(v) {
  return typeof v === "number" && Number.isFinite(v) ? `${(100 * v).toFixed(0)}%` : "–";
}

function clock(t) {
  return typeof t === "number" ? new Date(t * 1000).toLocaleTimeString() : "–";
}

function sum(metrics, keys) {
  let total = 0;
  let seen = false;
  for (const k of keys) {
    if (typeof metrics[k] === "number") {
      total += metrics[k];
      seen = true;
    }
  }
  return seen ? total : null;
}

function mean(values) {
  const xs = values.filter((v) => typeof v === "number" && Number.isFinite(v));
  return xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null;
}

// -- fetching ---------------------------------------------------------------------------------------------
async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function since() {
  // what may still change: every running round, and the latest round (a round that failed runs again under
  // the same number)
  let open = Infinity;
  let last = 0;
  for (const r of rounds.values()) {
    last = Math.max(last, r.round_id);
    if (r.state === "running") open = Math.min(open, r.round_id);
  }
  return Math.min(open, last);
}

function absorb(part, body) {
  if (part === "rounds") for (const r of body) rounds.set(`${r.round_id}:${r.cluster_id}`, r);
  else known[part] = body;
}

function initialState() {
  // the state the coordinator wrote into the page when it served it (the API's answers at that moment)
  const node = document.getElementById("initial-state");
  if (node === null || !node.textContent.trim()) return null;
  try {
    return JSON.parse(node.textContent);
  } catch (err) {
    return null;
  }
}

async function poll() {
  const link = document.getElementById("link");
  // while nothing is known, each answer is drawn as soon as it arrives, and the line names what is awaited
  const first = known.health === null;
  const waiting = new Set();
  const asks = SOURCES.map(([part, path]) => {
    const url = path();
    waiting.add(url);
    return getJSON(url).then((body) => {
      absorb(part, body);
      waiting.delete(url);
      if (first) {
        draw();
        link.textContent = waiting.size ? `waiting for ${[...waiting].join(", ")}` : "";
      }
    });
  });
  if (first) link.textContent = `connecting: waiting for ${[...waiting].join(", ")}`;
  try {
    await Promise.all(asks);
    if (!first) draw();
    link.textContent = `updated ${new Date().toLocaleTimeString()}`;
    link.className = "link";
  } catch (err) {
    link.textContent = `coordinator unreachable (${err.message}); retrying`;
    link.className = "link down";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

// -- what the rounds say ------------------------------------------------------------------------------------
function evaluation(r) {
  // the federated metric (devices' held-out data); the coordinator's own evaluation when none is reported
  // with personalisation, also the devices' own models on the same held-out data
  for (const name of METRICS) {
    if (typeof r.metrics[`device_${name}`] === "number") {
      const personal = r.metrics[`device_personal_${name}`];
      return { name, value: r.metrics[`device_${name}`], own: false, personal: typeof personal === "number" ? personal : null };
    }
  }
  for (const name of METRICS) {
    if (typeof r.metrics[`test_${name}`] === "number") return { name, value: r.metrics[`test_${name}`], own: true };
  }
  return null;
}

function timeSplit(r) {
  // the parts the coordinator recorded; for a round recorded without them, the devices' timed steps (means
  // over the updates), the aggregation, and the rest unattributed
  const split = {};
  if (typeof r.metrics.time_unattributed_s === "number") {
    for (const [part] of PARTS) split[part] = Math.max(0, r.metrics[`time_${part}_s`] || 0);
    return split;
  }
  const updates = r.results.filter((x) => x.status === "update");
  const device = (keys) => mean(updates.map((x) => sum(x.metrics, keys))) || 0;
  Object.assign(split, {
    train: device(["train_s"]), protect: device(PROTECT), upload: device(["upload_s"]), decrypt: device(["decrypt_s"]),
    aggregate: r.metrics.aggregate_s || 0,
  });
  const timed = Object.values(split).reduce((a, b) => a + b, 0);
  split.unattributed = Math.max(0, (r.metrics.round_s || 0) - timed);
  return split;
}

function byCluster() {
  const out = new Map();
  const sorted = [...rounds.values()].sort((a, b) => a.round_id - b.round_id);
  for (const r of sorted) {
    if (!out.has(r.cluster_id)) out.set(r.cluster_id, []);
    out.get(r.cluster_id).push(r);
  }
  return out;
}

function latestByDevice() {
  // each device's latest update in a finished round (in a running one when it has none yet: a running
  // round's record holds no budgets, and its devices' reports come after the aggregate), and its
  // failures by code
  const latest = new Map();
  const failures = new Map();
  const sorted = [...rounds.values()].sort((a, b) => a.round_id - b.round_id || (a.state === "done") - (b.state === "done"));
  for (const r of sorted) {
    for (const x of r.results) {
      if (x.status === "update") {
        if (r.state === "done" || !latest.has(x.client_id)) latest.set(x.client_id, { round: r, result: x });
      } else {
        const code = x.status.replace(/^error:/, "");
        const f = failures.get(x.client_id) || {};
        f[code] = (f[code] || 0) + 1;
        failures.set(x.client_id, f);
      }
    }
  }
  return { latest, failures };
}

// -- drawing --------------------------------------------------------------------------------------------------
function plot(series, planned) {
  const W = 536, H = 180, L = 42, R = 10, T = 24, B = 28;
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "plot", role: "img" });
  const points = series.filter((p) => p.eval !== null);
  const name = points.length ? points[0].eval.name.replace("_", " ") : "metric";
  const bounded = name !== "mae";
  const personal = points.filter((p) => typeof p.eval.personal === "number");
  const ys = [...points.map((p) => p.eval.value), ...personal.map((p) => p.eval.personal)];
  // a share: from 0.5 (or lower, to the lowest point) to 1 with a line every 0.1 or 0.2; an error: from 0
  const yMax = bounded ? 1 : Math.max(1e-9, ...ys) * 1.1;
  const yMin = bounded ? Math.min(0.5, ...ys.map((v) => Math.floor(v * 5) / 5)) : 0;
  const ticks = bounded ? Math.round((yMax - yMin) / (yMax - yMin > 0.5 ? 0.2 : 0.1)) : 4;
  const xMax = Math.max(planned || 1, ...series.map((p) => p.round));
  const x = (round) => L + ((W - L - R) * (round - 0.5)) / xMax;
  const y = (v) => T + (H - T - B) * (1 - (v - yMin) / (yMax - yMin || 1));
  for (let i = 0; i <= ticks; i++) {
    const v = yMin + ((yMax - yMin) * i) / ticks;
    root.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: "#e5e7eb" }));
    root.append(svg("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end" }, bounded ? pct(v) : fixed(v, 2)));
  }
  const step = Math.max(1, Math.ceil(xMax / 12));
  for (let round = 1; round <= xMax; round += step) {
    root.append(svg("text", { x: x(round), y: H - 10, "text-anchor": "middle" }, String(round)));
  }
  root.append(svg("text", { x: W - R, y: H - 1, "text-anchor": "end" }, "round"));
  if (points.length > 1) {
    const line = points.map((p) => `${x(p.round).toFixed(1)},${y(p.eval.value).toFixed(1)}`).join(" ");
    root.append(svg("polyline", { points: line, fill: "none", "data-series": "federated", ...LINES.federated }));
  }
  if (personal.length > 1) {
    const line = personal.map((p) => `${x(p.round).toFixed(1)},${y(p.eval.personal).toFixed(1)}`).join(" ");
    root.append(svg("polyline", { points: line, fill: "none", "data-series": "personal", ...LINES.personal }));
  }
  for (const p of personal) {
    const dot = svg("circle", { cx: x(p.round), cy: y(p.eval.personal), r: 3, fill: COLORS.personal, class: "personal-point", "data-series": "personal" });
    dot.append(svg("title", {}, `round ${p.round}: personal ${name} ${fixed(p.eval.personal, 4)}`));
    root.append(dot);
  }
  for (const p of points) {
    const dot = svg("circle", { cx: x(p.round), cy: y(p.eval.value), r: 3.5, fill: COLORS.federated, class: "point", "data-series": "federated" });
    dot.append(svg("title", {}, `round ${p.round}: ${name} ${fixed(p.eval.value, 4)}`));
    root.append(dot);
  }
  if (points.length) {
    const lastP = points[points.length - 1];
    const show = (v) => (bounded ? `${(100 * v).toFixed(1)}%` : fixed(v, 4));
    const label = `${points.some((p) => p.eval.own) ? "coordinator's" : "federated"} ${name}: ${show(lastP.eval.value)}` +
      (typeof lastP.eval.personal === "number" ? `, personal models ${show(lastP.eval.personal)}` : "");
    root.append(svg("text", { x: L, y: 12, class: "title" }, label));
  } else {
    root.append(svg("text", { x: L, y: 12, class: "title" }, "no evaluation reported yet"));
  }
  return root;
}

function plotLegend(series) {
  // one entry per series the plot draws, with its line's stroke
  const points = series.filter((p) => p.eval !== null);
  const box = el("div", { class: "legend plot-legend" });
  if (!points.length) return box;
  const name = points[0].eval.name.replace("_", " ");
  const own = points.some((p) => p.eval.own);
  const entries = [["federated", own ? `coordinator's ${name} (its evaluation data)` : `federated ${name} (devices' held-out data, weighted by samples)`]];
  if (points.some((p) => typeof p.eval.personal === "number")) {
    entries.push(["personal", `personal models' ${name} (each device's own model, same held-out data)`]);
  }
  for (const [series, label] of entries) {
    const swatch = svg("svg", { width: 22, height: 10, class: "swatch-line" });
    swatch.append(svg("line", { x1: 1, x2: 21, y1: 5, y2: 5, ...LINES[series] }));
    box.append(el("span", { "data-series": series }, swatch, label));
  }
  return box;
}

function bars(series) {
  // each finished round: its time split into steps, as shares of the round's whole (the first round also
  // starts the coordinator's workers, which would flatten every other bar), and its seconds
  const done = series.filter((r) => r.state === "done");
  const W = 536, row = 14, L = 42, R = 60;
  const H = Math.max(1, done.length) * row + 6;
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "bars", role: "img" });
  done.forEach((r, i) => {
    const split = timeSplit(r);
    const whole = Math.max(1e-9, Object.values(split).reduce((a, b) => a + b, 0));
    const top = 3 + i * row;
    const name = svg("text", { x: L - 6, y: top + 10, "text-anchor": "end" }, `r${r.round_id}`);
    const every = PARTS.filter(([p]) => split[p] > 0).map(([p, label]) => `${label} ${fixed(split[p], 3)} s`);
    name.append(svg("title", {}, `round ${r.round_id}: ${every.join(", ")}`));
    root.append(name);
    let left = L;
    for (const [part, label] of PARTS) {
      if (!visible(split, part, whole)) continue;
      const w = ((W - L - R) * split[part]) / whole;
      const rect = svg("rect", { x: left, y: top, width: Math.max(w, 0.5), height: row - 3, fill: COLORS[part], "data-part": part });
      rect.append(svg("title", {}, `round ${r.round_id}, ${label}: ${fixed(split[part], 3)} s (${pct(split[part] / whole)})`));
      root.append(rect);
      left += w;
    }
    root.append(svg("text", { x: W - R + 4, y: top + 10 }, `${fixed(r.metrics.round_s, 2)} s`));
  });
  return root;
}

function visible(split, part, whole) {
  // a part is drawn when it is at least half a percent of its round (every part is in the round's tooltip)
  const v = split[part] || 0;
  return v > 0 && v >= 0.005 * whole;
}

function barLegend(series) {
  // the parts drawn in any of the bars, each with what it is as its tooltip
  const shown = new Set();
  for (const r of series.filter((x) => x.state === "done")) {
    const split = timeSplit(r);
    const whole = Object.values(split).reduce((a, b) => a + b, 0);
    for (const [part] of PARTS) if (visible(split, part, whole)) shown.add(part);
  }
  const box = el("div", { class: "legend bar-legend" });
  for (const [part, label, what] of PARTS.filter(([p]) => shown.has(p))) {
    const swatch = svg("svg", { width: 10, height: 10, class: "swatch" });
    swatch.append(svg("rect", { width: 10, height: 10, rx: 2, fill: COLORS[part] }));
    box.append(el("span", { "data-part": part, title: what }, swatch, label));
  }
  return box;
}

function renderClusters(health, clusters) {
  const grouped = byCluster();
  const box = document.getElementById("clusters");
  const cards = [];
  const ids = new Set([...clusters.clusters.map((c) => c.cluster_id), ...grouped.keys()]);
  for (const k of [...ids].sort((a, b) => a - b)) {
    const info = clusters.clusters.find((c) => c.cluster_id === k) || { members: [], online: 0 };
    const series = (grouped.get(k) || []).map((r) => ({ round: r.round_id, eval: r.state === "done" ? evaluation(r) : null }));
    const last = (grouped.get(k) || []).filter((r) => r.state === "done").pop();
    const card = el("div", { class: "card", "data-cluster": String(k) });
    card.append(el("h3", { text: `cluster ${k}` }));
    const exemplar = info.exemplar ? `, exemplar ${info.exemplar}` : "";
    const clear = last ? `, last round ${pct(1 - (last.metrics.encrypted_ratio ?? 0))} of each update in the clear` : "";
    card.append(el("div", { class: "sub", text: `${info.members.length} devices (${info.online} online)${exemplar}${clear}` }));
    card.append(plot(series, health.rounds_planned));
    card.append(plotLegend(series));
    card.append(bars(grouped.get(k) || []));
    card.append(barLegend(grouped.get(k) || []));
    cards.push(card);
  }
  if (!cards.length) cards.push(el("p", { class: "note", text: "no cluster yet: rounds start when enough devices have joined" }));
  box.replaceChildren(...cards);
}

function renderDecision(clusters) {
  const d = clusters.decision;
  const rows = [["status", d.status.replace("_", " ")], ["reason", d.reason]];
  if (d.status !== "not_clustered") {
    rows.push(
      ["clusters", d.n_clusters ?? "–"],
      ["silhouette", d.silhouette === null ? "n/a" : fixed(d.silhouette, 3)],
      ["threshold", `a split needs a silhouette of at least ${fixed(d.min_silhouette, 2)}`],
    );
  }
  if (d.best_split) rows.push(["best split refused", `${d.best_split.n_clusters} clusters, silhouette ${fixed(d.best_split.silhouette, 3)}`]);
  for (const step of d.steps || []) {
    const where = step.path === "" ? "all devices" : `inside cluster ${step.path}`;
    const offered = step.candidates
      .map((c) => `${c.clusters}: ${c.silhouette === null ? "n/a" : fixed(c.silhouette, 3)}`)
      .join(", ");
    const answer = step.accepted ? `split in ${step.best_clusters}` : `kept whole (${step.reason.replace("_", " ")})`;
    rows.push([`${where} (${step.devices})`, `${answer}; offered ${offered || "nothing"}`]);
  }
  if (d.devices) rows.push(["devices clustered", d.devices]);
  if (d.decided_at) rows.push(["decided", `by ${clock(d.decided_at)}`]);
  const dl = document.getElementById("decision");
  dl.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: String(v) })]));
}

function describeDeclines(declines) {
  if (declines === undefined || declines === null) return "";
  if (Array.isArray(declines)) {
    return declines.map((x) => (typeof x === "object" && x !== null ? x.code || x.reason || JSON.stringify(x) : String(x))).join(", ");
  }
  if (typeof declines === "object") return Object.entries(declines).map(([k, v]) => `${k}×${v}`).join(", ");
  return String(declines);
}

function kilobytes(metrics) {
  // the update's size as sent: its ciphertexts and its clear part
  const total = sum(metrics, ["cipher_bytes", "plain_bytes"]);
  return total === null ? null : total / 1024;
}

function deviceFacts(facts) {
  const parts = [];
  if (facts.platform) parts.push(`${facts.platform}${facts.machine ? `/${facts.machine}` : ""}`);
  if (facts.cores) parts.push(`${facts.cores} cores`);
  if (facts.memory_mb) parts.push(`${Math.round(facts.memory_mb / 1024 * 10) / 10} GB`);
  if (facts.he_values_per_s) parts.push(`${Math.round(facts.he_values_per_s / 1000)}k HE values/s`);
  if (facts.refused) parts.push(`refused: ${facts.refused}`);
  return parts.join(", ");
}

function renderDevices(clients) {
  const { latest, failures } = latestByDevice();
  const body = document.querySelector("#devices tbody");
  const rows = clients.map((c) => {
    const last = latest.get(c.client_id);
    const m = last ? last.result.metrics : {};
    const budget = last ? last.round.metrics[`budget_${c.client_id}`] : undefined;
    const f = failures.get(c.client_id) || {};
    const seen = c.online ? el("span", { class: "on", text: "online" }) : el("span", { class: "off", text: `left ${clock(c.last_seen)}` });
    const cell = (text, cls) => el("td", cls ? { class: cls, text } : { text });
    const row = el("tr", { "data-device": c.client_id });
    row.append(
      cell(c.client_id),
      el("td", { class: "num", "data-field": "cluster", text: String(c.cluster_id) }),
      el("td", {}, seen),
      cell(String(c.num_samples), "num"),
      el("td", { class: "num", "data-field": "budget", text: fixed(budget, 2) }),
      cell(fixed(kilobytes(m), 1), "num"),
      cell(pct(m.encrypted_ratio), "num"),
      cell(pct(m.covered_sensitivity), "num"),
      cell(fixed(m.train_s, 3), "num"),
      cell(fixed(sum(m, PROTECT), 3), "num"),
      cell(fixed(m.upload_s, 3), "num"),
      cell(fixed(m.decrypt_s, 3), "num"),
      cell(Object.entries(f).map(([k, v]) => `${k}×${v}`).join(", "), "bad"),
      el("td", { "data-field": "declines", text: describeDeclines(c.declines) }),
      cell(deviceFacts(c.facts || {}), "facts"),
    );
    return row;
  });
  if (!rows.length) {
    rows.push(el("tr", {}, el("td", { colspan: "15", class: "note", text: "no device has said hello yet" })));
  }
  body.replaceChildren(...rows);
}

function renderProtection(health, clients) {
  const { latest } = latestByDevice();
  const box = document.getElementById("protection");
  const items = [];
  const done = [...rounds.values()].filter((r) => r.state === "done");
  const ratios = done.map((r) => r.metrics.encrypted_ratio).filter((v) => typeof v === "number");
  if (ratios.length) {
    const clear = 1 - mean(ratios);
    const lo = pct(1 - Math.max(...ratios));
    const hi = pct(1 - Math.min(...ratios));
    const range = lo === hi ? "" : ` (${lo} to ${hi})`;
    items.push(el("li", { text: `${pct(clear)} of each update left its device in the clear, on average over ${ratios.length} cluster rounds${range}` }));
  } else {
    items.push(el("li", { text: "no round finished yet" }));
  }
  const covered = mean([...latest.values()].map((x) => x.result.metrics.covered_sensitivity));
  if (covered !== null) items.push(el("li", { text: `encrypted parts cover ${pct(covered)} of the devices' measured sensitivity (latest rounds, mean)` }));
  const audits = [...latest.entries()].filter(([, x]) => typeof x.result.metrics.self_audit_max_db === "number");
  const withheld = (health.device_failures || {}).self_audit || 0;
  if (audits.length || withheld) {
    const worst = Math.max(-Infinity, ...audits.map(([, x]) => x.result.metrics.self_audit_max_db));
    items.push(el("li", { text: `self-audit: ${audits.length} devices checked their last update (highest reconstruction ${fixed(worst, 1)} dB); ${withheld} updates withheld` }));
  } else {
    items.push(el("li", { text: "self-audit: no device reports one" }));
  }
  const refused = Object.keys(health.refused || {}).length;
  if (refused) items.push(el("li", { class: "bad", text: `${refused} devices refused (their data does not fit the model)` }));
  const link = health.transport || {};
  const mb = (n) => (typeof n === "number" ? (n / 1048576).toFixed(1) : "–");
  items.push(el("li", { text: `coordinator's broker link: ${mb(link.bytes_in)} MB in, ${mb(link.bytes_out)} MB out` }));
  items.push(el("li", { text: `${clients.length} devices known, ${health.online} online` }));
  box.replaceChildren(el("ul", {}, ...items));
}

function renderRejected(health) {
  const rows = [];
  for (const [where, counts] of [["round engine", health.rejected || {}], ["transport (frames)", health.rejected_frames || {}]]) {
    for (const [code, n] of Object.entries(counts)) {
      rows.push(el("tr", { "data-code": code }, el("td", { text: code }), el("td", { text: where }), el("td", { class: "num", text: String(n) })));
    }
  }
  document.querySelector("#rejected tbody").replaceChildren(...rows);
  document.getElementById("rejected-none").hidden = rows.length > 0;
}

function renderHeader(health) {
  const phase = health.phase || health.state;
  const words = { online: "waiting for devices", waiting: "starting", sketch: "sketch round (clustering)" };
  document.getElementById("state").textContent = words[phase] || phase;
  document.getElementById("strategy").textContent = health.strategy;
  const planned = health.rounds_planned ? ` of ${health.rounds_planned}` : "";
  const current = health.current_round ?? health.round;
  document.getElementById("round-now").textContent =
    current > health.round ? `${current}${planned} (${health.round} completed)` : `${current}${planned}`;
  document.getElementById("online").textContent = String(health.online);
  document.getElementById("detail").textContent = health.detail || "";
}

function draw() {
  // what the answers known so far allow
  const { health, clients, clusters } = known;
  if (health) {
    renderHeader(health);
    renderRejected(health);
  }
  if (health && clusters) {
    renderClusters(health, clusters);
    renderDecision(clusters);
  }
  if (clients) renderDevices(clients);
  if (health && clients) renderProtection(health, clients);
}

function start() {
  const state = initialState();
  if (state === null) {
    poll();
    return;
  }
  document.getElementById("federation-name").textContent = state.federation || "–";
  document.title = `${state.federation} · fedsdk coordinator`;
  for (const [part] of SOURCES) if (state[part] !== undefined) absorb(part, state[part]);
  draw();
  document.getElementById("link").textContent = `as of ${clock(state.at)}, when the page was served`;
  setTimeout(poll, POLL_MS);
}

start();
