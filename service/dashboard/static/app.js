// mpflow dashboard: the tenant's streams, and one stream live. Plain JavaScript and <canvas>, no libraries.
//
// Every piece of data comes from the authenticated API of this origin:
//   GET /v1/streams                  the stream list (refreshed every LIST_REFRESH_MS)
//   GET /v1/streams/{id}/particles   the particle cloud (re-read after each update)
//   GET /v1/streams/{id}/history     the steps the stream keeps, with their observations (read when the page
//                                    opens, so the traces start at the first kept step, then after each update)
//   GET /v1/streams/{id}/events      Server-Sent Events: the stream document, then one event per update
//                                    (read with fetch(), so the key travels in a header, never in the URL)
// When the API answers 401 the page asks for an API key and keeps it in sessionStorage (this tab only).
"use strict";

const KEY_STORAGE = "mpflow.apiKey";
const LIST_REFRESH_MS = 3000;
const MAX_POINTS = 5000; // particles drawn at most (an even subsample of larger clouds)
const MAX_HISTORY = 5000; // steps kept for the traces
const MAX_BAND_DIMS = 6; // all dimensions get a band up to this many; else only the selected x and y
const OBSERVATION_ROWS = 12; // observations listed, the latest first
const OBSERVATION_CHARS = 160; // an observation's JSON is cut to this many characters in the list
const OBSERVED_COLOR = "#111827"; // the observed values drawn on the traces
const CHI2_2D_95 = 5.991; // 95% quantile of chi-square with 2 degrees of freedom (the ellipse radius²)
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];

const $ = (id) => document.getElementById(id);
// Whether a stream's particles carry importance weights (ESS < N): what its method says of itself with the stream's
// options (the stream document's `capabilities`, declared by the method on the server; smc, mpf with
// flow_fraction "auto").
const weightedCloud = (doc) => Boolean(doc.capabilities && doc.capabilities.weighted);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// ----------------------------------------------------------------------------------------- API access

class Unauthorized extends Error {}

class ApiFailure extends Error {
  constructor(status, body) {
    const err = body && body.error;
    super(err ? `${err.message} (${err.code})` : `HTTP ${status}`);
    this.status = status;
  }
}

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// GET a JSON document of the API; throws Unauthorized on 401 and ApiFailure on any other error.
async function api(path) {
  const res = await fetch(path, { headers: { ...authHeaders(), Accept: "application/json" } });
  if (res.status === 401) throw new Unauthorized();
  const body = await res.json().catch(() => null);
  if (!res.ok) throw new ApiFailure(res.status, body);
  return body;
}

// Read a Server-Sent-Events response, calling onEvent(name, data) per event, until the server ends it.
async function readEvents(path, onEvent, signal) {
  const res = await fetch(path, { headers: { ...authHeaders(), Accept: "text/event-stream" }, signal });
  if (res.status === 401) throw new Unauthorized();
  if (!res.ok) throw new ApiFailure(res.status, await res.json().catch(() => null));
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) continue; // a keep-alive comment
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) onEvent(name, JSON.parse(data.join("\n")));
    }
  }
}

function setStatus(text) {
  $("status").textContent = text || "";
}

// Show one of the three views (key prompt, stream list, one stream).
function show(viewId) {
  for (const id of ["key-view", "list-view", "stream-view"]) $(id).hidden = id !== viewId;
  $("forget-key").hidden = !sessionStorage.getItem(KEY_STORAGE);
}

// Ask for a key; `then` runs once one is entered.
function askForKey(then, message) {
  show("key-view");
  setStatus("");
  $("key-error").textContent = message || "";
  $("key-input").value = "";
  $("key-input").focus();
  $("key-form").onsubmit = (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY_STORAGE, $("key-input").value.trim());
    then();
  };
}

// A key the API refused is dropped and asked for again.
function keyRefused(then) {
  const had = sessionStorage.getItem(KEY_STORAGE);
  sessionStorage.removeItem(KEY_STORAGE);
  askForKey(then, had ? "The API did not accept this key." : "");
}

// ----------------------------------------------------------------------------------------- stream list

async function listStreams() {
  const all = [];
  let cursor = null;
  do {
    const query = cursor ? `?limit=1000&cursor=${encodeURIComponent(cursor)}` : "?limit=1000";
    const page = await api(`/v1/streams${query}`);
    all.push(...page.streams);
    cursor = page.next_cursor;
  } while (cursor && all.length < 10000);
  return all;
}

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

async function runListView() {
  for (;;) {
    let streams;
    try {
      streams = await listStreams();
    } catch (err) {
      if (err instanceof Unauthorized) return keyRefused(runListView);
      setStatus(`Could not list the streams: ${err.message}`);
      await sleep(LIST_REFRESH_MS);
      continue;
    }
    show("list-view");
    setStatus("");
    const body = $("streams").tBodies[0];
    body.replaceChildren();
    for (const s of streams) {
      const row = body.insertRow();
      row.dataset.streamId = s.stream_id;
      const link = document.createElement("a");
      link.href = `/streams/${encodeURIComponent(s.stream_id)}`;
      link.textContent = s.stream_id;
      cell(row, "").appendChild(link);
      cell(row, s.model ? s.model.family : "");
      cell(row, methodLabel(s));
      cell(row, String(s.step), "num");
      cell(row, s.updated_at || "");
    }
    $("list-empty").hidden = streams.length > 0;
    await sleep(LIST_REFRESH_MS);
  }
}

// ----------------------------------------------------------------------------------------- one stream

const view = {
  id: null,
  doc: null, // the latest stream document (summary without cov after updates)
  dim: 0,
  history: [], // {step, mean, std, lei, lesd, ess, obs?: {value, dt, omitted}} sorted by step, one per step seen
  cloud: null, // {step, points: [[..]], logWeights: [..]}
  kept: null, // the most steps the stream keeps (MPFLOW_HISTORY_STEPS), once the history was read
  historyStep: 0, // the stream's step at the last history read: the steps up to it are read
};

// `read` (async) made into a refresh that never runs twice at once: a call while it runs causes one more run when
// it is done (however many calls came). A failure other than 401 is shown with `what`.
function coalesced(what, read) {
  let running = false;
  let again = false;
  return async () => {
    if (running) {
      again = true;
      return;
    }
    running = true;
    try {
      do {
        again = false;
        await read();
      } while (again);
    } catch (err) {
      if (!(err instanceof Unauthorized)) setStatus(`Could not read ${what}: ${err.message}`);
    } finally {
      running = false;
    }
  };
}

// Add a per-step entry (or replace the one of the same step) keeping history sorted by step.
function remember(entry) {
  const h = view.history;
  let i = h.length;
  while (i > 0 && h[i - 1].step > entry.step) i--;
  if (i > 0 && h[i - 1].step === entry.step) {
    // keep a known increment and observation when the new entry (a stream document, a live event) has none
    const old = h[i - 1];
    h[i - 1] = { ...entry, lei: entry.lei ?? old.lei, lesd: entry.lesd ?? old.lesd, obs: entry.obs ?? old.obs };
  } else {
    h.splice(i, 0, entry);
  }
  if (h.length > MAX_HISTORY) h.splice(0, h.length - MAX_HISTORY);
}

// How a stream's method reads: with its trained operator, or — mpf without one — as the untrained base flow.
function methodLabel(doc) {
  if (doc.operator) return `${doc.method} (${doc.operator})`;
  return doc.method === "mpf" ? "mpf (base flow, no operator)" : doc.method;
}

// The name of state dimension j: the stream's state_names where it has them, else x[j].
function dimName(j) {
  const names = view.doc && view.doc.state_names;
  return Array.isArray(names) && names.length === view.dim ? String(names[j]) : `x[${j}]`;
}

function fillSelect(select, dim, chosen) {
  if (select.options.length === dim) return;
  select.replaceChildren();
  for (let j = 0; j < dim; j++) select.add(new Option(dimName(j), String(j)));
  select.value = String(Math.min(chosen, dim - 1));
}

// The stream document arrived (first event of a feed): facts, selectors, the current point of the traces.
function onDocument(doc) {
  view.doc = doc;
  view.dim = doc.state_dim || doc.summary.mean.length;
  $("family").textContent = doc.model.family;
  $("method").textContent = methodLabel(doc);
  $("particles").textContent = String(doc.num_particles);
  fillSelect($("dim-x"), view.dim, 0);
  fillSelect($("dim-y"), view.dim, 1);
  const s = doc.summary;
  remember({ step: doc.step, mean: s.mean, std: s.std, lei: null, ess: s.ess });
  onStep(doc);
}

// A per-step entry (of an answer, an event or the history) as a history entry, without its observation.
function fromStep(p) {
  const lesd = p.log_evidence_sd ?? null;
  return { step: p.step, mean: p.mean, std: p.std, lei: p.log_evidence_increment, lesd, ess: p.ess };
}

// A step of GET .../history as a history entry, with the observation that was applied.
function fromHistory(e) {
  const obs = { value: e.observation, dt: e.dt ?? null, omitted: Boolean(e.observation_omitted) };
  return { ...fromStep(e), obs };
}

// Read the steps not read yet from the stream's history: all it keeps the first time (the page opened late starts
// at the first kept step), then those of the updates since (the live feed carries no observations).
const refreshHistory = coalesced("the history", async () => {
  const missing = view.doc.step - view.historyStep;
  if (missing <= 0) return;
  const query = view.kept ? `?limit=${Math.min(missing, view.kept)}` : "";
  const got = await api(`/v1/streams/${encodeURIComponent(view.id)}/history${query}`);
  view.kept = got.history_steps;
  for (const e of got.steps) remember(fromHistory(e));
  view.historyStep = Math.max(view.historyStep, got.step);
  showCounts();
  drawTraces();
  drawObservations();
  if (view.cloud) drawCloud();
});

function showCounts() {
  $("history-count").textContent = String(view.history.length);
  $("history-kept").textContent = view.kept ? String(view.kept) : "–";
}

// An update event: every per-step entry it carries goes into the history.
function onUpdate(ev) {
  if (view.doc && ev.step <= view.doc.step) return; // an older event, delivered late
  for (const p of ev.per_step) {
    remember(fromStep(p));
  }
  view.doc = { ...view.doc, step: ev.step, updated_at: ev.updated_at, summary: ev.summary };
  onStep(view.doc);
}

// The latest predictive p-values, those beyond the stream's pit_alert marked (the summary's pit_flags).
function showPit(summary) {
  const cell = $("pit");
  const pit = summary.pit || [];
  const flags = summary.pit_flags || [];
  cell.textContent = pit.length ? pit.map((u, j) => (u === null ? "–" : u.toFixed(3) + (flags[j] ? " ⚠" : ""))).join(", ") : "–";
  cell.classList.toggle("flagged", Boolean(summary.pit_flagged));
  cell.title = `P(reading ≤ observed | before), per observed entry; flagged beyond the two-sided level ${summary.pit_alert}`;
  const s = summary.surprise;
  $("surprise").textContent = s === undefined || s === null ? "–" : s.toFixed(2) + " nats";
  const a = summary.anomaly_score;
  $("anomaly").textContent = a === undefined || a === null ? (s === undefined || s === null ? "–" : "warming up") : a.toFixed(4);
}

function onStep(doc) {
  $("step").textContent = String(doc.step);
  $("updated").textContent = doc.updated_at;
  $("log-evidence").textContent = doc.summary.log_evidence.toFixed(3);
  showPit(doc.summary);
  showCounts();
  refreshCloud();
  refreshHistory();
  drawTraces();
  drawObservations();
}

// Re-read the particles (after each update).
const refreshCloud = coalesced("the particles", async () => {
  const step = view.doc.step;
  const got = await api(`/v1/streams/${encodeURIComponent(view.id)}/particles`);
  view.cloud = { step, points: got.particles, logWeights: got.log_weights };
  drawCloud();
});

// Follow the stream's feed for as long as the page is open, reconnecting after each feed ends.
async function runStreamView(id) {
  view.id = id;
  $("stream-id").textContent = id;
  setStatus("Connecting…");
  let backoff = 500;
  for (;;) {
    try {
      await readEvents(`/v1/streams/${encodeURIComponent(id)}/events`, (name, data) => {
        if (name === "stream") {
          show("stream-view");
          setStatus("");
          setLive(true);
          onDocument(data);
        } else if (name === "update") onUpdate(data);
        else if (name === "error") setStatus(`The service reports: ${data.error.message}`);
      });
      backoff = 500; // the server ended a feed normally: reconnect now
    } catch (err) {
      if (err instanceof Unauthorized) return keyRefused(() => runStreamView(id));
      if (err instanceof ApiFailure && err.status === 404) {
        show("stream-view");
        setStatus(`No stream ${JSON.stringify(id)} for this key (it may have expired or been deleted).`);
        setLive(false, "not found");
        return;
      }
      setLive(false, "reconnecting…");
      await sleep(backoff);
      backoff = Math.min(backoff * 2, 10000);
    }
  }
}

function setLive(on, text) {
  const el = $("live");
  el.className = `live ${on ? "on" : "off"}`;
  el.textContent = on ? "● live" : text;
}

// ----------------------------------------------------------------------------------------- drawing

// A canvas sized to its CSS box at the device's pixel ratio; returns its context and CSS size.
function surface(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth;
  const h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
    canvas.width = Math.round(w * ratio);
    canvas.height = Math.round(h * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  return { ctx, w, h };
}

// About n round tick values covering [lo, hi].
function ticks(lo, hi, n) {
  const raw = (hi - lo) / Math.max(n, 1);
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + 1e-9 * step; t += step) out.push(Math.abs(t) < step * 1e-9 ? 0 : t);
  return out;
}

function label(t) {
  return Math.abs(t) >= 1e4 || (Math.abs(t) < 1e-3 && t !== 0) ? t.toExponential(1) : String(+t.toPrecision(4));
}

// [lo, hi] of finite values, widened by a margin (and to a non-empty interval).
function extent(values, margin = 0.06) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) {
    if (v === null || !Number.isFinite(v)) continue;
    if (v < lo) lo = v;
    if (v > hi) hi = v;
  }
  if (lo === Infinity) return [0, 1];
  const pad = (hi - lo) * margin || Math.abs(lo) * 0.1 || 1;
  return [lo - pad, hi + pad];
}

// Axes with ticks in a plot area; returns the data → pixel maps.
function axes(ctx, w, h, xr, yr, xLabel, yLabel) {
  const box = { left: 52, right: w - 10, top: 8, bottom: h - 26 };
  const px = (x) => box.left + ((x - xr[0]) / (xr[1] - xr[0])) * (box.right - box.left);
  const py = (y) => box.bottom - ((y - yr[0]) / (yr[1] - yr[0])) * (box.bottom - box.top);
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#6b7385";
  ctx.strokeStyle = "#eef0f4";
  ctx.lineWidth = 1;
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (const t of ticks(xr[0], xr[1], Math.max(2, Math.floor(w / 90)))) {
    ctx.beginPath();
    ctx.moveTo(px(t), box.top);
    ctx.lineTo(px(t), box.bottom);
    ctx.stroke();
    ctx.fillText(label(t), px(t), box.bottom + 4);
  }
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const t of ticks(yr[0], yr[1], Math.max(2, Math.floor(h / 40)))) {
    ctx.beginPath();
    ctx.moveTo(box.left, py(t));
    ctx.lineTo(box.right, py(t));
    ctx.stroke();
    ctx.fillText(label(t), box.left - 5, py(t));
  }
  ctx.strokeStyle = "#b8bfcc";
  ctx.strokeRect(box.left, box.top, box.right - box.left, box.bottom - box.top);
  ctx.fillStyle = "#1d2330";
  ctx.textAlign = "right";
  ctx.textBaseline = "bottom";
  if (xLabel) ctx.fillText(xLabel, box.right - 2, box.bottom - 2);
  ctx.textAlign = "left";
  ctx.textBaseline = "top";
  if (yLabel) ctx.fillText(yLabel, box.left + 4, box.top + 3);
  return { px, py, box };
}

// A line through (xs[i], ys[i]), broken where a value is missing or steps are not consecutive (history has
// gaps when a feed was reconnected). For a trace over time xs is steps itself.
function polyline(ctx, steps, xs, ys, px, py) {
  ctx.beginPath();
  let pen = false;
  for (let i = 0; i < steps.length; i++) {
    if (ys[i] === null || !Number.isFinite(ys[i])) {
      pen = false;
      continue;
    }
    const gap = i > 0 && steps[i] - steps[i - 1] > 1;
    if (!pen || gap) ctx.moveTo(px(xs[i]), py(ys[i]));
    else ctx.lineTo(px(xs[i]), py(ys[i]));
    pen = true;
  }
  ctx.stroke();
}

function maxOf(values) {
  let m = -Infinity;
  for (const v of values) if (v > m) m = v;
  return m;
}

// The band lo..hi over steps, one polygon per run of consecutive steps.
function band(ctx, steps, lo, hi, px, py) {
  // one filled run per stretch of consecutive steps where both edges are known
  const usable = (j) => Number.isFinite(lo[j]) && Number.isFinite(hi[j]);
  let start = -1;
  for (let i = 0; i <= steps.length; i++) {
    const ok = i < steps.length && usable(i);
    if (ok && start >= 0 && steps[i] - steps[i - 1] === 1) continue;
    if (start >= 0) {
      ctx.beginPath();
      for (let j = start; j < i; j++) ctx.lineTo(px(steps[j]), py(hi[j]));
      for (let j = i - 1; j >= start; j--) ctx.lineTo(px(steps[j]), py(lo[j]));
      ctx.closePath();
      ctx.fill();
    }
    start = ok ? i : -1;
  }
}

// A small FNV-1a hash of the drawn coordinates: lets a test see that the plotted points changed.
function fingerprint(points, jx, jy) {
  let h = 0x811c9dc5;
  for (const p of points) {
    const s = `${p[jx].toFixed(6)},${p[jy].toFixed(6)};`;
    for (let i = 0; i < s.length; i++) h = Math.imul(h ^ s.charCodeAt(i), 0x01000193);
  }
  return (h >>> 0).toString(16);
}

// Weighted mean and covariance of two coordinates (for the 95% ellipse).
function moments2(points, weights, jx, jy) {
  let mx = 0;
  let my = 0;
  for (let i = 0; i < points.length; i++) {
    mx += weights[i] * points[i][jx];
    my += weights[i] * points[i][jy];
  }
  let sxx = 0;
  let syy = 0;
  let sxy = 0;
  for (let i = 0; i < points.length; i++) {
    const dx = points[i][jx] - mx;
    const dy = points[i][jy] - my;
    sxx += weights[i] * dx * dx;
    syy += weights[i] * dy * dy;
    sxy += weights[i] * dx * dy;
  }
  return { mx, my, sxx, syy, sxy };
}

// The particle cloud in the chosen dimensions: scatter (opacity ∝ weight) or a weighted 2-D histogram,
// the posterior-mean path from the history and the 95% ellipse of the cloud's Gaussian moments.
function drawCloud() {
  const canvas = $("cloud");
  const cloud = view.cloud;
  if (!cloud || !cloud.points.length) return;
  const jx = Number($("dim-x").value || 0);
  const jy = Number($("dim-y").value || Math.min(1, view.dim - 1));
  const all = cloud.points;
  const stride = Math.ceil(all.length / MAX_POINTS);
  const idx = [];
  for (let i = 0; i < all.length; i += stride) idx.push(i);
  const points = idx.map((i) => all[i]);
  // normalised weights of all particles (log-sum-exp), and of the drawn ones relative to their largest
  const lwMax = maxOf(cloud.logWeights);
  const wAll = cloud.logWeights.map((lw) => Math.exp(lw - lwMax));
  const wSum = wAll.reduce((a, b) => a + b, 0);
  const weights = wAll.map((w) => w / wSum);
  const drawnW = idx.map((i) => wAll[i]);
  const drawnMax = maxOf(drawnW);

  const path = view.history.map((e) => [e.mean[jx], e.mean[jy]]);
  const fitted = $("cloud-fit").value === "cloud" ? [] : path; // what the axes must show besides the cloud
  const xr = extent(points.map((p) => p[jx]).concat(fitted.map((p) => p[0])));
  const yr = extent(points.map((p) => p[jy]).concat(fitted.map((p) => p[1])));
  const { ctx, w, h } = surface(canvas);
  const { px, py, box } = axes(ctx, w, h, xr, yr, dimName(jx), dimName(jy));
  ctx.save();
  ctx.beginPath();
  ctx.rect(box.left, box.top, box.right - box.left, box.bottom - box.top);
  ctx.clip();

  if ($("cloud-mode").value === "density") {
    const bins = Math.max(12, Math.min(64, Math.round(2 * Math.sqrt(all.length)))); // ~N/4 particles per row
    const grid = new Float64Array(bins * bins);
    for (let i = 0; i < all.length; i++) {
      const bx = Math.floor(((all[i][jx] - xr[0]) / (xr[1] - xr[0])) * bins);
      const by = Math.floor(((all[i][jy] - yr[0]) / (yr[1] - yr[0])) * bins);
      if (bx >= 0 && bx < bins && by >= 0 && by < bins) grid[by * bins + bx] += weights[i];
    }
    const top = maxOf(grid);
    const cw = (box.right - box.left) / bins;
    const ch = (box.bottom - box.top) / bins;
    for (let by = 0; by < bins; by++) {
      for (let bx = 0; bx < bins; bx++) {
        const v = grid[by * bins + bx] / top;
        if (v <= 0) continue;
        ctx.fillStyle = `rgba(37, 99, 235, ${0.08 + 0.92 * Math.sqrt(v)})`;
        ctx.fillRect(box.left + bx * cw, box.bottom - (by + 1) * ch, cw + 0.5, ch + 0.5);
      }
    }
  } else {
    const weighted = weightedCloud(view.doc);
    let alphaMin = 1;
    let alphaMax = 0;
    for (let k = 0; k < points.length; k++) {
      const alpha = weighted ? 0.06 + 0.74 * (drawnW[k] / drawnMax) : 0.35;
      alphaMin = Math.min(alphaMin, alpha);
      alphaMax = Math.max(alphaMax, alpha);
      ctx.fillStyle = `rgba(37, 99, 235, ${alpha.toFixed(3)})`;
      ctx.beginPath();
      ctx.arc(px(points[k][jx]), py(points[k][jy]), 2.2, 0, 2 * Math.PI);
      ctx.fill();
    }
    canvas.dataset.weighted = String(weighted); // scatter: opacity ∝ weight, or one opacity for a uniform cloud
    canvas.dataset.opacity = `${alphaMin.toFixed(3)},${alphaMax.toFixed(3)}`;
  }

  // the 95% region of the Gaussian with the cloud's weighted moments: eigen-decomposition of the 2×2 covariance
  const m = moments2(all, weights, jx, jy);
  const tr = (m.sxx + m.syy) / 2;
  const disc = Math.sqrt(Math.max(0, ((m.sxx - m.syy) / 2) ** 2 + m.sxy ** 2));
  const angle = 0.5 * Math.atan2(2 * m.sxy, m.sxx - m.syy);
  const r1 = Math.sqrt(CHI2_2D_95 * Math.max(0, tr + disc));
  const r2 = Math.sqrt(CHI2_2D_95 * Math.max(0, tr - disc));
  if (jx !== jy) {
    ctx.strokeStyle = "#dc2626";
    ctx.lineWidth = 1.6;
    ctx.beginPath();
    for (let t = 0; t <= 64; t++) {
      const a = (t / 64) * 2 * Math.PI;
      const ex = r1 * Math.cos(a);
      const ey = r2 * Math.sin(a);
      const x = m.mx + ex * Math.cos(angle) - ey * Math.sin(angle);
      const y = m.my + ex * Math.sin(angle) + ey * Math.cos(angle);
      if (t === 0) ctx.moveTo(px(x), py(y));
      else ctx.lineTo(px(x), py(y));
    }
    ctx.stroke();
  }

  // the posterior mean over time (the tracked path), its latest point marked
  ctx.strokeStyle = "#111827";
  ctx.lineWidth = 1.5;
  const steps = view.history.map((e) => e.step);
  polyline(ctx, steps, path.map((p) => p[0]), path.map((p) => p[1]), px, py);
  const last = path[path.length - 1];
  if (last) {
    ctx.fillStyle = "#111827";
    ctx.beginPath();
    ctx.arc(px(last[0]), py(last[1]), 4, 0, 2 * Math.PI);
    ctx.fill();
  }
  ctx.restore();

  // what a test (or a curious user) can read off the element
  canvas.dataset.points = String(points.length);
  canvas.dataset.step = String(cloud.step);
  canvas.dataset.first = `${points[0][jx].toFixed(6)},${points[0][jy].toFixed(6)}`;
  canvas.dataset.hash = fingerprint(points, jx, jy);
  $("cloud-note").textContent =
    `step ${cloud.step}, ${points.length}${points.length < all.length ? ` of ${all.length}` : ""} particles`;
}

// One trace over steps: `series` are {ys, color}; `bandOf` optionally gives {lo, hi, color}.
function drawTrace(canvas, steps, series, yLabel, bandOf) {
  const { ctx, w, h } = surface(canvas);
  const values = series.flatMap((s) => s.ys).concat(bandOf ? bandOf.lo.concat(bandOf.hi) : []);
  const xr = steps.length > 1 ? [steps[0], steps[steps.length - 1]] : [steps[0] - 1, steps[0] + 1];
  const { px, py } = axes(ctx, w, h, xr, extent(values), "", yLabel);
  if (bandOf) {
    ctx.fillStyle = bandOf.color;
    band(ctx, steps, bandOf.lo, bandOf.hi, px, py);
  }
  for (const s of series) {
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 1.6;
    if (s.line !== false) polyline(ctx, steps, steps, s.ys, px, py);
    if (s.dots) {
      ctx.fillStyle = s.color;
      for (let i = 0; i < steps.length; i++) {
        if (s.ys[i] === null || !Number.isFinite(s.ys[i])) continue;
        ctx.beginPath();
        ctx.arc(px(steps[i]), py(s.ys[i]), 2, 0, 2 * Math.PI);
        ctx.fill();
      }
    }
  }
}

function bandDims() {
  if (view.dim <= MAX_BAND_DIMS) return [...Array(view.dim).keys()];
  return [...new Set([Number($("dim-x").value), Number($("dim-y").value)])];
}

// Mean ± 1.96 sd per dimension, the log-evidence increments and (weighted clouds) the ESS.
function drawTraces() {
  const h = view.history;
  if (!h.length) return;
  const steps = h.map((e) => e.step);
  const dims = bandDims();
  const holder = $("bands");
  if (holder.childElementCount !== dims.length || holder.dataset.dims !== dims.join(",")) {
    holder.replaceChildren(...dims.map(() => document.createElement("canvas")));
    holder.dataset.dims = dims.join(",");
  }
  const observed = h.map((e) => observedVector(e.obs));
  dims.forEach((j, k) => {
    const color = COLORS[k % COLORS.length];
    const mean = h.map((e) => e.mean[j]);
    const lo = h.map((e) => e.mean[j] - 1.96 * e.std[j]);
    const hi = h.map((e) => e.mean[j] + 1.96 * e.std[j]);
    const ys = observed.map((o) => (o === null ? null : o[j]));
    const series = [{ ys: mean, color }];
    const seen = ys.filter((y) => y !== null).length;
    if (seen) series.push({ ys, color: OBSERVED_COLOR, dots: true, line: false });
    const canvas = holder.children[k];
    drawTrace(canvas, steps, series, dimName(j), { lo, hi, color: `${color}33` });
    canvas.dataset.observed = String(seen); // what a test can read off the element
  });
  $("observed-legend").hidden = !observed.some((o) => o !== null);

  // the increments, with ± 1.96 of their standard error where the method reports one (mpf's marginal filter)
  const lei = h.map((e) => e.lei);
  const sd = h.map((e) => (e.lei !== null && e.lesd != null ? e.lesd : null));
  const banded = sd.filter((v) => v !== null).length;
  const around = (sign) => lei.map((v, i) => (sd[i] === null ? null : v + sign * 1.96 * sd[i]));
  const errorBand = banded ? { lo: around(-1), hi: around(1), color: "#7c3aed33" } : undefined;
  drawTrace($("evidence"), steps, [{ ys: lei, color: "#7c3aed", dots: true }], "log p(o_m | past)", errorBand);
  $("evidence").dataset.banded = String(banded); // what a test can read off the element
  const known = h.filter((e) => e.lei !== null);
  const last = known[known.length - 1];
  $("evidence-note").textContent = last
    ? `latest ${last.lei.toFixed(3)}` + (last.lesd != null ? ` ± ${(1.96 * last.lesd).toFixed(3)}` : "")
    : "";

  const weighted = weightedCloud(view.doc);
  $("ess-figure").hidden = !weighted;
  if (weighted) {
    const ess = h.map((e) => e.ess);
    drawTrace($("ess"), steps, [{ ys: ess, color: "#059669", dots: true }], `ESS (of ${view.doc.num_particles})`);
    $("ess-note").textContent = `latest ${ess[ess.length - 1].toFixed(1)} of ${view.doc.num_particles}`;
  }
}

// An observation that is a vector of the state's size (a number when d = 1), drawn on the traces; else null.
function observedVector(obs) {
  if (!obs || obs.omitted) return null;
  const v = typeof obs.value === "number" && view.dim === 1 ? [obs.value] : obs.value;
  if (!Array.isArray(v) || v.length !== view.dim) return null;
  return v.every((x) => x === null || typeof x === "number") ? v : null;
}

// The latest observations, newest first: step, dt and the value as posted.
function drawObservations() {
  const withObs = view.history.filter((e) => e.obs);
  $("observations-figure").hidden = withObs.length === 0;
  const body = $("observations").tBodies[0];
  body.replaceChildren();
  for (const e of withObs.slice(-OBSERVATION_ROWS).reverse()) {
    const row = body.insertRow();
    row.dataset.step = String(e.step);
    cell(row, String(e.step), "num");
    cell(row, e.obs.dt === null ? "" : String(e.obs.dt), "num");
    let text;
    if (e.obs.omitted) text = "(too large to keep)";
    else if (e.obs.value === null) text = "none (prediction only)";
    else text = JSON.stringify(e.obs.value);
    cell(row, text.length > OBSERVATION_CHARS ? `${text.slice(0, OBSERVATION_CHARS - 1)}…` : text, "obs");
  }
  $("observations-note").textContent = `latest ${Math.min(OBSERVATION_ROWS, withObs.length)} of ${withObs.length}`;
}

// ----------------------------------------------------------------------------------------- start

function start() {
  $("forget-key").onclick = () => {
    sessionStorage.removeItem(KEY_STORAGE);
    window.location.reload();
  };
  for (const id of ["dim-x", "dim-y", "cloud-mode", "cloud-fit"]) {
    $(id).onchange = () => {
      drawCloud();
      drawTraces();
    };
  }
  window.addEventListener("resize", () => {
    if (view.doc) {
      drawCloud();
      drawTraces();
    }
  });
  const match = window.location.pathname.match(/^\/streams\/([^/]+)\/?$/);
  if (match) runStreamView(decodeURIComponent(match[1]));
  else runListView();
}

start();
