// The coordinator's live dashboard: polls the REST API (same origin) and redraws; no library, no network
// beyond this coordinator. Every value from the API is written with textContent or as an SVG attribute, never
// parsed as HTML (device ids and reasons are chosen by devices). It shows no model values.
"use strict";

const POLL_MS = 1500;
const SVG = "http://www.w3.org/2000/svg";
const METRICS = ["accuracy", "mae", "label_accuracy"];
// A round's time, by step: device means of these result metrics, and the coordinator's aggregation.
const STEPS = [
  ["train", ["train_s"]],
  ["protect", ["sensitivity_s", "mask_s", "encode_s", "encrypt_s", "self_audit_s"]],
  ["upload", ["upload_s"]],
  ["aggregate", null],
  ["decrypt", ["decrypt_s"]],
];
const COLORS = {
  train: "#2563eb", protect: "#9333ea", upload: "#0891b2", aggregate: "#d97706", decrypt: "#16a34a",
  other: "#cbd5e1",
};

const rounds = new Map(); // "round:cluster" -> round record with results

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

async function poll() {
  const link = document.getElementById("link");
  try {
    const [health, clients, clusters, fresh] = await Promise.all([
      getJSON("/api/health"),
      getJSON("/api/clients"),
      getJSON("/api/clusters"),
      getJSON(`/api/rounds?since=${since()}`),
    ]);
    for (const r of fresh) rounds.set(`${r.round_id}:${r.cluster_id}`, r);
    render(health, clients, clusters);
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
  const updates = r.results.filter((x) => x.status === "update");
  const split = {};
  let known = 0;
  for (const [step, keys] of STEPS) {
    const v = keys === null ? r.metrics.aggregate_s : mean(updates.map((x) => sum(x.metrics, keys)));
    split[step] = typeof v === "number" ? v : 0;
    known += split[step];
  }
  split.other = Math.max(0, (r.metrics.round_s || 0) - known);
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
    root.append(svg("polyline", { points: line, fill: "none", stroke: "#2563eb", "stroke-width": 2 }));
  }
  if (personal.length > 1) {
    const line = personal.map((p) => `${x(p.round).toFixed(1)},${y(p.eval.personal).toFixed(1)}`).join(" ");
    root.append(svg("polyline", { points: line, fill: "none", stroke: "#16a34a", "stroke-width": 2, "stroke-dasharray": "5 3" }));
  }
  for (const p of personal) {
    const dot = svg("circle", { cx: x(p.round), cy: y(p.eval.personal), r: 3, fill: "#16a34a", class: "personal-point" });
    dot.append(svg("title", {}, `round ${p.round}: personal ${name} ${fixed(p.eval.personal, 4)}`));
    root.append(dot);
  }
  for (const p of points) {
    const dot = svg("circle", { cx: x(p.round), cy: y(p.eval.value), r: 3.5, fill: "#2563eb", class: "point" });
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
    root.append(svg("text", { x: L - 6, y: top + 10, "text-anchor": "end" }, `r${r.round_id}`));
    let left = L;
    for (const step of [...STEPS.map(([s]) => s), "other"]) {
      const w = ((W - L - R) * split[step]) / whole;
      if (w <= 0) continue;
      const rect = svg("rect", { x: left, y: top, width: Math.max(w, 0.5), height: row - 3, fill: COLORS[step] });
      rect.append(svg("title", {}, `round ${r.round_id} ${step}: ${fixed(split[step], 3)} s`));
      root.append(rect);
      left += w;
    }
    root.append(svg("text", { x: W - R + 4, y: top + 10 }, `${fixed(r.metrics.round_s, 2)} s`));
  });
  return root;
}

function legend() {
  const box = el("div", { class: "legend" });
  for (const step of [...STEPS.map(([s]) => s), "other"]) {
    box.append(el("span", {}, el("span", { class: `swatch sw-${step}` }), step === "other" ? "waiting / other" : step));
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
    card.append(bars(grouped.get(k) || []));
    card.append(legend());
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
      cell(fixed(sum(m, STEPS[1][1]), 3), "num"),
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

function render(health, clients, clusters) {
  renderHeader(health);
  renderClusters(health, clusters);
  renderDecision(clusters);
  renderDevices(clients);
  renderProtection(health, clients);
  renderRejected(health);
}

poll();
