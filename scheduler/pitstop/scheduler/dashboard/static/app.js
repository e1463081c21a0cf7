// pitstop dashboard: one server-sent event stream keeps the page live (no reloads).
// Everything is drawn from what the stream sends: fleet, jobs, job, steps, events.
"use strict";

const $ = (id) => document.getElementById(id);
const el = (tag, props = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else if (key === "class") node.className = value;
    else node[key] = value;
  }
  for (const child of children) node.append(child);
  return node;
};

const state = {
  job: new URLSearchParams(location.search).get("job") || "",
  nodes: new Map(),       // id -> row
  jobs: [],
  detail: null,           // the selected job
  columns: new Map(),     // step -> per-rank seconds (heatmap)
  window: 40,
  span: 1,                // steps a heatmap column covers (a straggler window)
  loss: new Map(),        // step -> loss
  events: [],
  kinds: new Set(),
  rendered: { fleet: false, job: false },
};
const MAX_EVENTS = 2000;
const SHOWN_EVENTS = 400;

// ---- the stream ----------------------------------------------------------------

let source = null;
function connect() {
  if (source) source.close();
  const query = state.job ? `?job=${encodeURIComponent(state.job)}` : "";
  source = new EventSource(`/api/stream${query}`);
  setLive("connecting");
  source.addEventListener("hello", (e) => {
    const hello = JSON.parse(e.data);
    setLive("live");
    state.job = hello.job;
    state.columns.clear();
    state.loss.clear();
    state.events = [];
  });
  source.addEventListener("fleet", (e) => onFleet(JSON.parse(e.data)));
  source.addEventListener("jobs", (e) => onJobs(JSON.parse(e.data).jobs));
  source.addEventListener("job", (e) => onJob(JSON.parse(e.data)));
  source.addEventListener("missing", (e) => {
    const missing = JSON.parse(e.data);
    state.job = "";
    $("job-name").textContent = missing.error;
  });
  source.addEventListener("steps", (e) => onSteps(JSON.parse(e.data)));
  source.addEventListener("events", (e) => onEvents(JSON.parse(e.data).events));
  source.addEventListener("denied", (e) => {
    source.close();
    setLive("signed out");
    $("live").title = JSON.parse(e.data).error;
  });
  // EventSource retries by itself; a refused sign-in (401) closes it for good.
  source.onerror = () => setLive(source.readyState === EventSource.CLOSED ? "signed out" : "reconnecting");
}

function setLive(value) {
  const live = $("live");
  live.dataset.live = value;
  live.textContent = value === "live" ? "● live" : value;
  if (value === "signed out") live.replaceChildren(el("a", { href: "/login", textContent: "signed out: sign in again" }));
}

// Coalesce redraws: many messages, one paint.
const dirty = new Set();
function redraw(part) {
  if (dirty.size === 0) requestAnimationFrame(paint);
  dirty.add(part);
}
function paint() {
  const parts = new Set(dirty);
  dirty.clear();
  if (parts.has("fleet")) drawFleet();
  if (parts.has("job")) drawJob();
  if (parts.has("steps")) { drawHeatmap(); drawLoss(); }
  if (parts.has("events")) drawEvents();
  if (state.rendered.fleet && state.rendered.job && window.pitstopRendered === undefined) {
    window.pitstopRendered = performance.now();
    document.body.dataset.rendered = "1";
  }
}

// ---- fleet -----------------------------------------------------------------------

function onFleet(message) {
  if (message.full) state.nodes.clear();
  let structural = Boolean(message.full);
  for (const row of message.nodes) {
    const before = state.nodes.get(row.id);
    if (!before || before.zone !== row.zone || before.block !== row.block || before.rack !== row.rack) {
      structural = true;
    }
    state.nodes.set(row.id, row);
    if (!structural) updateNode(row);
  }
  if (structural) redraw("fleet");
}

function nodeClass(row) {
  const jobHere = state.job && row.jobs.includes(state.job);
  const gpuBad = row.gpus.some(([, verdict]) => verdict === "fatal");
  return `node s-${row.status}${jobHere ? " in-job" : ""}${gpuBad ? " gpu-bad" : ""}`;
}

function nodeTitle(row) {
  const gpus = row.gpus.map(([index, verdict]) => `GPU ${index}: ${verdict}`).join("\n");
  const where = [row.zone, row.block, row.rack].filter(Boolean).join(" / ");
  return `${row.id} — ${row.status}${row.reason ? `: ${row.reason}` : ""}\n${where}` +
    `${row.connected ? "" : "\n(agent not connected)"}${row.jobs.length ? `\njobs: ${row.jobs.join(", ")}` : ""}` +
    `${gpus ? `\n${gpus}` : ""}`;
}

function updateNode(row) {
  const cell = document.querySelector(`.node[data-node="${CSS.escape(row.id)}"]`);
  if (!cell) { redraw("fleet"); return; }
  cell.className = nodeClass(row);
  cell.dataset.state = row.status;
  cell.title = nodeTitle(row);
}

function drawFleet() {
  const zones = new Map();
  for (const row of state.nodes.values()) {
    const zone = zones.get(row.zone) || new Map();
    zones.set(row.zone, zone);
    const block = zone.get(row.block) || new Map();
    zone.set(row.block, block);
    const rack = block.get(row.rack) || [];
    block.set(row.rack, rack);
    rack.push(row);
  }
  const sorted = (map) => [...map.entries()].sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  const fragment = document.createDocumentFragment();
  for (const [zoneName, blocks] of sorted(zones)) {
    const zone = el("div", { class: "zone" }, el("div", { class: "label", textContent: `zone ${zoneName || "—"}` }));
    for (const [blockName, racks] of sorted(blocks)) {
      const block = el("div", { class: "block" }, el("div", { class: "label", textContent: `block ${blockName || "—"}` }));
      for (const [rackName, rows] of sorted(racks)) {
        const rack = el("div", { class: "rack", dataset: { rack: rackName } },
          el("span", { class: "label", textContent: rackName || "—", title: rackName }));
        rows.sort((a, b) => (a.id < b.id ? -1 : 1));
        for (const row of rows) {
          rack.append(el("span", {
            class: nodeClass(row), title: nodeTitle(row), dataset: { node: row.id, state: row.status },
          }));
        }
        block.append(rack);
      }
      zone.append(block);
    }
    fragment.append(zone);
  }
  $("fleet").replaceChildren(fragment);
  const counts = {};
  for (const row of state.nodes.values()) counts[row.status] = (counts[row.status] || 0) + 1;
  $("fleet-count").textContent = `${state.nodes.size} nodes · ` +
    Object.entries(counts).map(([k, v]) => `${v} ${k}`).join(", ");
  state.rendered.fleet = true;
}

$("fleet").addEventListener("click", async (e) => {
  const id = e.target.dataset && e.target.dataset.node;
  if (id) showNode(id);
});
$("node-close").addEventListener("click", () => { $("node-panel").hidden = true; });

async function showNode(id) {
  const reply = await fetch(`/api/nodes/${encodeURIComponent(id)}`);
  const node = await reply.json();
  const panel = $("node-detail");
  if (!reply.ok) { panel.replaceChildren(el("p", { class: "error", textContent: node.error })); $("node-panel").hidden = false; return; }
  const labels = node.labels || {};
  const health = node.health || {};
  const gpuRows = (health.gpus || []).map((g) => el("tr", { dataset: { gpu: g.index ?? 0 } },
    el("td", { textContent: g.index ?? 0 }),
    el("td", { textContent: (g.verdict || "").replace("HEALTH_VERDICT_", "").toLowerCase() }),
    el("td", { textContent: g.temperature_c ? `${g.temperature_c.toFixed(0)} °C` : "" }),
    el("td", { textContent: (g.reasons || []).join("; ") })));
  const xidRows = (node.xid_history || []).map((x) => el("tr", {},
    el("td", { textContent: x.time ? new Date(x.time).toLocaleTimeString() : "" }),
    el("td", { textContent: `GPU ${x.gpu_index ?? 0}` }),
    el("td", { textContent: `Xid ${x.xid}` }),
    el("td", { textContent: x.message || "" })));
  panel.replaceChildren(
    el("h3", { textContent: `${node.id} — ${node.status}` }),
    el("p", { textContent: node.reason || "" }),
    el("p", { textContent: [labels.zone, labels.block, labels.rack].filter(Boolean).join(" / ") }),
    el("p", { textContent: `jobs: ${(node.job_ids || []).join(", ") || "none"} · ${node.connected ? "connected" : "not connected"}` }),
    el("h4", { textContent: "GPUs" }),
    el("table", {}, el("tbody", {}, ...gpuRows)),
    el("h4", { textContent: `Xid history (${xidRows.length})` }),
    el("table", { id: "xid-history" }, el("tbody", {}, ...xidRows)),
  );
  $("node-panel").hidden = false;
}

// ---- jobs ------------------------------------------------------------------------

function onJobs(jobs) {
  state.jobs = jobs;
  const select = $("job-select");
  const options = jobs.map((job) => el("option", {
    value: job.id, textContent: `${job.name || job.id} (${job.state})`, selected: job.id === state.job,
  }));
  if (!jobs.length) options.push(el("option", { value: "", textContent: "no jobs yet" }));
  select.replaceChildren(...options);
  const waiting = jobs.filter((job) => job.queue_position).sort((a, b) => a.queue_position - b.queue_position);
  $("queue-panel").hidden = !waiting.length;
  $("queue").tBodies[0].replaceChildren(...waiting.map((job) => {
    const row = el("tr", {});
    row.append(
      el("td", { textContent: String(job.queue_position) }),
      el("td", { textContent: `${job.name} · ${job.id}` }),
      el("td", { textContent: job.project }),
      el("td", { textContent: String(job.priority) }),
      el("td", { textContent: job.reason || "—" }),
    );
    return row;
  }));
}

$("job-select").addEventListener("change", (e) => {
  state.job = e.target.value;
  history.replaceState(null, "", state.job ? `?job=${encodeURIComponent(state.job)}` : "/");
  state.detail = null;
  connect();
});

function onJob(job) {
  const before = state.detail;
  state.detail = job;
  if (before && before.ranks.length !== job.ranks.length) state.columns.clear();
  redraw("job");
  if (!before || before.ranks !== job.ranks) redraw("steps");
  if (!before) redraw("fleet");
}

const fmt = (seconds) => (seconds >= 10 ? seconds.toFixed(1) : seconds.toFixed(2));

function drawJob() {
  const job = state.detail;
  if (!job) return;
  $("job-name").textContent = `${job.name} · ${job.id}`;
  const record = $("job-record");
  record.href = `/api/jobs/${encodeURIComponent(job.id)}/record`;
  record.hidden = false;
  const badge = $("job-state");
  badge.textContent = job.state;
  badge.dataset.state = job.state;
  const g = job.goodput;
  $("goodput-figure").textContent = `goodput ${(100 * g.ratio).toFixed(1)}%`;
  const summary = [
    ["state", job.state + (job.reason ? ` — ${job.reason}` : "")],
    ["generation", job.generation],
    ["step", job.total_steps ? `${job.current_step} / ${job.total_steps}` : job.current_step],
    ["committed · durable", `${job.committed_step} · ${job.durable_step}`],
    ["ranks", job.ranks.length],
    ["restarts", job.restarts],
    ["project · priority", `${job.project} · ${job.priority}`],
    ["preemptible", job.preemptible ? `yes (preempted ${job.preemptions}×)` : "no"],
    ...(job.queue_position ? [["queue position", job.queue_position]] : []),
    ["tokens/s", state.rates ? Math.round(state.rates.tokens_per_second).toLocaleString() : "—"],
    ["steps/s", state.rates ? state.rates.steps_per_second.toFixed(2) : "—"],
    ["goodput", `${(100 * g.ratio).toFixed(1)}%`],
    ["recoveries", g.recoveries],
    ["lost to detect · recover · redo", `${fmt(g.detect_seconds)} · ${fmt(g.recovery_seconds)} · ${fmt(g.recompute_seconds)} s`],
    ["stragglers", job.ranks.filter((r) => r[8]).map((r) => r[0]).join(", ") || "none"],
  ];
  $("job-summary").replaceChildren(...summary.flatMap(([k, v]) =>
    [el("dt", { textContent: k }), el("dd", { textContent: String(v), dataset: { field: k } })]));
  drawRecoveries(job);
  for (const row of state.nodes.values()) updateNodeClassOnly(row);
  state.rendered.job = true;
}

function updateNodeClassOnly(row) {
  const cell = document.querySelector(`.node[data-node="${CSS.escape(row.id)}"]`);
  if (cell) cell.className = nodeClass(row);
}

// ---- recoveries ------------------------------------------------------------------

function drawRecoveries(job) {
  const incidents = job.incidents;
  $("recovery-count").textContent = `${job.goodput.incident_count} in all · goodput ${(100 * job.goodput.ratio).toFixed(1)}%`;
  const longest = Math.max(1, ...incidents.map((i) => i.detect + i.decide + i.resume));
  const rows = incidents.slice().reverse().map((i) => {
    const total = i.detect + i.decide + i.resume;
    const seg = (phase, seconds, name = phase) => el("span", {
      class: `seg ${phase}`, title: `${name}: ${fmt(seconds)} s`,
      style: `width:${(100 * seconds) / longest}%`,
    });
    // Restore and re-form apart once every rank of the new generation said when it
    // restored; until then (or for ranks that do not say) one resume segment.
    const split = i.restore + i.reform > 0;
    const phases = split
      ? [seg("detect", i.detect), seg("decide", i.decide), seg("restore", i.restore),
        seg("reform", i.reform, "re-form")]
      : [seg("detect", i.detect), seg("decide", i.decide), seg("resume", i.resume, "restore + re-form")];
    const parts = split
      ? `${fmt(i.detect)} + ${fmt(i.decide)} + ${fmt(i.restore)} + ${fmt(i.reform)}`
      : `${fmt(i.detect)} + ${fmt(i.decide)} + ${fmt(i.resume)}`;
    const when = i.failed_at ? new Date(i.failed_at * 1000).toLocaleTimeString() : "";
    return el("div", { class: "incident", dataset: { kind: i.kind, outcome: i.outcome, split: split ? "1" : "0" } },
      el("span", { class: "cause", textContent: `${when} ${i.cause}`, title: i.cause }),
      el("span", { class: "bar" }, ...phases),
      el("span", { class: "numbers", textContent:
        `${fmt(total)} s = ${parts} · ` +
        `${i.lost_steps} step${i.lost_steps === 1 ? "" : "s"} lost · ${i.outcome.replace("_", " ")}` }));
  });
  if (!rows.length) rows.push(el("p", { class: "muted", textContent: "no failure yet" }));
  $("recoveries").replaceChildren(...rows);
}

// ---- steps: heatmap and loss -----------------------------------------------------

function onSteps(message) {
  if (message.job !== state.job) return;
  if (message.reset) { state.columns.clear(); state.loss.clear(); }
  state.window = message.window;
  state.span = message.span || 1;
  for (const column of message.columns) state.columns.set(column.step, column.times);
  const steps = [...state.columns.keys()].sort((a, b) => a - b);
  for (const old of steps.slice(0, Math.max(0, steps.length - state.window))) state.columns.delete(old);
  for (const [step, loss] of message.loss) state.loss.set(step, loss);
  state.rates = { steps_per_second: message.steps_per_second, tokens_per_second: message.tokens_per_second };
  redraw("steps");
  redraw("job");
}

function median(values) {
  const xs = values.filter((v) => v !== null).sort((a, b) => a - b);
  return xs.length ? xs[Math.floor(xs.length / 2)] : 0;
}

function ratioColour(ratio) {
  // 1.0 (the step's median) green, 1.25 yellow, 1.5 and over red.
  const t = Math.max(0, Math.min(1, (ratio - 1) / 0.5));
  const r = Math.round(46 + t * (212 - 46));
  const g = Math.round(158 - t * (158 - 61));
  return `rgb(${r},${g},${Math.round(91 - t * 30)})`;
}

let heatmapGeometry = null;
function drawHeatmap() {
  const canvas = $("heatmap");
  const context = canvas.getContext("2d");
  context.clearRect(0, 0, canvas.width, canvas.height);
  const job = state.detail;
  if (!job || !job.ranks.length) return;
  const ranks = job.ranks.length;
  const steps = [...state.columns.keys()].sort((a, b) => a - b);
  const gutter = 6;
  const width = canvas.width - gutter;
  const cellW = width / Math.max(state.window, 1);
  const rows = Math.min(ranks, canvas.height);
  const rowH = canvas.height / rows;
  const perRow = ranks / rows;
  heatmapGeometry = { steps, cellW, rowH, perRow, gutter, ranks };
  steps.forEach((step, x) => {
    const times = state.columns.get(step);
    const mid = median(times) || 1;
    for (let row = 0; row < rows; row++) {
      const from = Math.floor(row * perRow);
      const to = Math.max(from + 1, Math.floor((row + 1) * perRow));
      let worst = null;
      for (let rank = from; rank < to && rank < ranks; rank++) {
        const t = times[rank];
        if (t !== null && t !== undefined && (worst === null || t > worst)) worst = t;
      }
      context.fillStyle = worst === null ? "#2a2f35" : ratioColour(worst / mid);
      context.fillRect(gutter + x * cellW, row * rowH, Math.ceil(cellW), Math.ceil(rowH));
    }
  });
  context.fillStyle = "#ff4040";
  for (const r of job.ranks) {
    if (r[8]) context.fillRect(0, Math.floor(r[0] / perRow) * rowH, gutter - 1, Math.max(2, rowH));
  }
}

$("heatmap").addEventListener("mousemove", (e) => {
  const tip = $("heatmap-tip");
  const g = heatmapGeometry;
  const job = state.detail;
  if (!g || !job) return;
  const box = e.target.getBoundingClientRect();
  const x = Math.floor((e.clientX - box.left - g.gutter) / g.cellW);
  const rank = Math.min(g.ranks - 1, Math.floor(Math.floor((e.clientY - box.top) / g.rowH) * g.perRow));
  const step = g.steps[x];
  const r = job.ranks[rank];
  if (step === undefined || !r) { tip.style.display = "none"; return; }
  const t = state.columns.get(step)[rank];
  tip.textContent = `rank ${r[0]} on ${r[1]} (${[r[2], r[3], r[4]].filter(Boolean).join("/")}; dp ${r[5]} pp ${r[6]} tp ${r[7]})` +
    ` · ${state.span > 1 ? `steps ${step}–${step + state.span - 1}, median` : `step ${step}`}: ${t === null || t === undefined ? "—" : `${t.toFixed(3)} s`}${r[8] ? " · straggler" : ""}`;
  tip.style.display = "block";
  tip.style.left = `${e.clientX - box.left + 12}px`;
  tip.style.top = `${e.clientY - box.top + 24}px`;
});
$("heatmap").addEventListener("mouseleave", () => { $("heatmap-tip").style.display = "none"; });

function drawLoss() {
  const svg = $("loss");
  const points = [...state.loss.entries()].sort((a, b) => a[0] - b[0]);
  if (points.length < 2) { svg.replaceChildren(); return; }
  const [x0, x1] = [points[0][0], points[points.length - 1][0]];
  const ys = points.map((p) => p[1]);
  const [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  const sx = (x) => (400 * (x - x0)) / Math.max(x1 - x0, 1);
  const sy = (y) => 150 - (140 * (y - y0)) / Math.max(y1 - y0, 1e-9);
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" "));
  const label = document.createElementNS("http://www.w3.org/2000/svg", "text");
  label.setAttribute("x", "4"); label.setAttribute("y", "12"); label.setAttribute("fill", "#8a949e");
  label.setAttribute("font-size", "10");
  label.textContent = `${ys[ys.length - 1].toFixed(4)} at step ${x1} (min ${y0.toFixed(4)}, max ${y1.toFixed(4)})`;
  svg.replaceChildren(line, label);
}

// ---- events ----------------------------------------------------------------------

function onEvents(events) {
  state.events.push(...events);
  if (state.events.length > MAX_EVENTS) state.events.splice(0, state.events.length - MAX_EVENTS);
  let newKind = false;
  for (const event of events) {
    if (!state.kinds.has(event.kind)) { state.kinds.add(event.kind); newKind = true; }
  }
  if (newKind) {
    const select = $("event-kind");
    const chosen = select.value;
    select.replaceChildren(el("option", { value: "", textContent: "every kind" }),
      ...[...state.kinds].sort().map((k) => el("option", { value: k, textContent: k, selected: k === chosen })));
  }
  redraw("events");
}

function drawEvents() {
  const words = $("event-filter").value.trim().toLowerCase().split(/\s+/).filter(Boolean);
  const kind = $("event-kind").value;
  const shown = [];
  for (let i = state.events.length - 1; i >= 0 && shown.length < SHOWN_EVENTS; i--) {
    const e = state.events[i];
    if (kind && e.kind !== kind) continue;
    const text = `${e.kind} ${e.node} ${e.job} ${e.reason} ${e.actor} ${e.from} ${e.to}`.toLowerCase();
    if (words.some((w) => !text.includes(w))) continue;
    shown.push(el("tr", { class: `k-${e.kind.replace(".", "-")}`, dataset: { kind: e.kind, node: e.node } },
      el("td", { textContent: new Date(e.time * 1000).toLocaleTimeString() }),
      el("td", { textContent: e.kind }),
      el("td", { textContent: e.node }),
      el("td", { textContent: e.job }),
      el("td", { textContent: (e.from || e.to ? `${e.from} → ${e.to}. ` : "") + e.reason }),
      el("td", { textContent: e.actor })));
  }
  $("events").tBodies[0].replaceChildren(...shown);
}
$("event-filter").addEventListener("input", () => redraw("events"));
$("event-kind").addEventListener("change", () => redraw("events"));

connect();
