// Live dashboard of one job: polls GET /jobs/{job}/metrics every 2 s and draws plain <canvas>
// charts; pause/resume buttons POST with the bearer token kept in sessionStorage (which the
// polls send too, for a gateway whose reads need a token).
"use strict";

const JOB = document.querySelector('meta[name="diloco-job"]').content;
const POLL_MS = 2000;
const TOKEN_KEY = "diloco-token";
const $ = (selector, root = document) => root.querySelector(selector);

// ---- token --------------------------------------------------------------------------------

function token() {
  const typed = $("#token").value.trim();
  if (typed) sessionStorage.setItem(TOKEN_KEY, typed);
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

function showTokenState() {
  $("#token-state").textContent = sessionStorage.getItem(TOKEN_KEY) ? "token saved" : "";
}

function message(text, ok = false) {
  const el = $("#message");
  el.textContent = text;
  el.className = ok ? "ok" : "";
}

$("#save-token").addEventListener("click", () => {
  token();
  $("#token").value = "";
  showTokenState();
});
showTokenState();

async function setDesired(unit, action) {
  const bearer = token();
  if (!bearer) {
    message("enter the bearer token first");
    $("#token").focus();
    return;
  }
  showTokenState();
  const response = await fetch(`/jobs/${encodeURIComponent(JOB)}/units/${unit}/${action}`, {
    method: "POST",
    headers: { Authorization: `Bearer ${bearer}` },
  });
  if (response.ok) {
    message(`unit ${unit}: ${action} requested`, true);
  } else {
    if (response.status === 401 || response.status === 403) {
      sessionStorage.removeItem(TOKEN_KEY);
      showTokenState();
    }
    message(`unit ${unit}: ${action} failed (${response.status}) ${await response.text()}`);
  }
  poll();
}

// ---- units table --------------------------------------------------------------------------

const COLUMNS = ["state", "desired", "step", "tokens-per-s", "train-loss", "version-lag",
  "heartbeat", "bytes-sent", "link", "link-bytes", "bytes-per-token", "latency",
  "network-wait", "goodput", "guard"];

function unitRow(unit) {
  let row = $(`#units tbody tr[data-unit="${unit}"]`);
  if (row) return row;
  row = document.createElement("tr");
  row.dataset.unit = String(unit);
  row.innerHTML = `<td class="unit">${unit}</td>` +
    COLUMNS.map((c) => `<td class="${c}"></td>`).join("") +
    '<td><button type="button" class="pause">pause</button> ' +
    '<button type="button" class="resume">resume</button></td>';
  $("button.pause", row).addEventListener("click", () => setDesired(unit, "pause"));
  $("button.resume", row).addEventListener("click", () => setDesired(unit, "resume"));
  $("#units tbody").appendChild(row);
  return row;
}

const fmt = (v, digits = 0) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function renderUnits(units) {
  for (const u of units) {
    const row = unitRow(u.unit);
    const state = $(".state", row);
    state.textContent = u.state;
    state.className = `state ${u.state}`;
    row.dataset.state = u.state;
    $(".desired", row).textContent = u.desired;
    $(".step", row).textContent = fmt(u.step);
    $(".tokens-per-s", row).textContent = fmt(u.tokens_per_s, 1);
    $(".train-loss", row).textContent = fmt(u.train_loss, 3);
    $(".version-lag", row).textContent = fmt(u.version_lag);
    $(".heartbeat", row).textContent =
      u.heartbeat_age_s === null ? "–" : `${u.heartbeat_age_s.toFixed(1)} s ago`;
    $(".bytes-sent", row).textContent = bytes(u.bytes_sent);
    // Measured at the unit's shaped link (diloco link), when it has one.
    const link = u.link;
    const outage = link && link.outage ? ` (${link.outage})` : "";
    $(".link", row).textContent = link ? link.link + outage : "–";
    $(".link-bytes", row).textContent =
      link ? `${bytes(link.bytes_up)} / ${bytes(link.bytes_down)}` : "–";
    const saving = link && link.times_less_than_data_parallel;
    $(".bytes-per-token", row).textContent = !link ? "–"
      : fmt(link.bytes_per_token, 1) + (saving ? ` (${fmt(saving)}× less than DP)` : "");
    // Medians on the unit's clock: upload (loop → JetStream), sync (sync point → params that
    // include it), params (head → loop).
    const p50 = (l) => (l ? `${l.p50_s.toFixed(2)}` : "–");
    $(".latency", row).textContent =
      `${p50(u.upload_latency)} / ${p50(u.sync_latency)} / ${p50(u.params_latency)}`;
    $(".network-wait", row).textContent = fmt(u.network_wait_s, 3);
    $(".goodput", row).textContent = fmt(u.goodput, 2);
    // What the outer refused of this unit (by reason) and how many applied uploads it clipped:
    // the column that shows which unit misbehaves.
    const reasons = Object.entries(u.rejected || {});
    const refused = reasons.reduce((sum, [, n]) => sum + n, 0);
    const guard = $(".guard", row);
    guard.textContent = `${refused} / ${u.clipped ?? 0}`;
    guard.title = reasons.map(([reason, n]) => `${reason}: ${n}`).join(", ") || "none rejected";
    guard.classList.toggle("bad", refused + (u.clipped ?? 0) > 0);
    $("button.pause", row).disabled = u.desired === "paused";
    $("button.resume", row).disabled = u.desired === "running";
  }
  $("#units").dataset.units = String(units.length);
}

// ---- charts -------------------------------------------------------------------------------

const PAD = { left: 56, right: 12, top: 10, bottom: 34 };

function frame(canvas, xMax, yMin, yMax, xLabel, showMax = true) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = "#999";
  ctx.fillStyle = "#444";
  ctx.font = "11px system-ui, sans-serif";
  ctx.beginPath();
  ctx.moveTo(PAD.left, PAD.top);
  ctx.lineTo(PAD.left, h - PAD.bottom);
  ctx.lineTo(w - PAD.right, h - PAD.bottom);
  ctx.stroke();
  const x = (v) => PAD.left + (xMax > 0 ? v / xMax : 0) * (w - PAD.left - PAD.right);
  const y = (v) => h - PAD.bottom -
    (yMax > yMin ? (v - yMin) / (yMax - yMin) : 0.5) * (h - PAD.top - PAD.bottom);
  ctx.textAlign = "right";
  for (let i = 0; i <= 4; i += 1) {
    const v = yMin + ((yMax - yMin) * i) / 4;
    ctx.fillText(Math.abs(v) >= 1000 ? v.toExponential(1) : v.toFixed(2), PAD.left - 4, y(v) + 4);
  }
  ctx.textAlign = "center";
  const caption = showMax ? `${xLabel} (max ${xMax.toLocaleString()})` : xLabel;
  ctx.fillText(caption, (PAD.left + w - PAD.right) / 2, h - 4);
  return { ctx, x, y };
}

function drawLoss(metrics) {
  const canvas = $("#loss-chart");
  const series = [
    { color: "#2563eb", points: metrics.eval_history.map((p) => [p.tokens, p.nats_per_byte]) },
    { color: "#dc2626", points: metrics.train_history.map((p) => [p.tokens, p.train_loss]) },
  ];
  const all = series.flatMap((s) => s.points);
  if (!all.length) return;
  const xMax = Math.max(1, ...all.map((p) => p[0]));
  const ys = all.map((p) => p[1]);
  const { ctx, x, y } = frame(canvas, xMax, Math.min(...ys) * 0.95, Math.max(...ys) * 1.05,
    "tokens applied");
  for (const s of series) {
    ctx.strokeStyle = s.color;
    ctx.fillStyle = s.color;
    ctx.beginPath();
    s.points.forEach(([px, py], i) => (i ? ctx.lineTo(x(px), y(py)) : ctx.moveTo(x(px), y(py))));
    ctx.stroke();
    for (const [px, py] of s.points) ctx.fillRect(x(px) - 2, y(py) - 2, 4, 4);
  }
  canvas.dataset.points = String(all.length);
}

function drawBars(canvas, labels, groups, xLabel) {
  // groups: [{color, values}] drawn side by side for every label
  const values = groups.flatMap((g) => g.values);
  if (!labels.length) return;
  const { ctx, y } = frame(canvas, labels.length, 0, Math.max(1, ...values), xLabel, false);
  const slot = (canvas.width - PAD.left - PAD.right) / labels.length;
  const bar = (slot * 0.8) / groups.length;
  labels.forEach((label, i) => {
    groups.forEach((g, j) => {
      ctx.fillStyle = g.color;
      const left = PAD.left + i * slot + slot * 0.1 + j * bar;
      ctx.fillRect(left, y(g.values[i]), bar - 1, y(0) - y(g.values[i]));
    });
    ctx.fillStyle = "#444";
    ctx.textAlign = "center";
    ctx.fillText(String(label), PAD.left + (i + 0.5) * slot, canvas.height - PAD.bottom + 12);
  });
  canvas.dataset.points = String(labels.length);
}

function drawStaleness(metrics) {
  const entries = Object.entries(metrics.staleness).map(([k, v]) => [Number(k), v]);
  entries.sort((a, b) => a[0] - b[0]);
  drawBars($("#staleness-chart"), entries.map((e) => e[0]),
    [{ color: "#7c3aed", values: entries.map((e) => e[1]) }], "staleness (versions)");
}

function drawBytes(metrics) {
  const units = metrics.units;
  drawBars($("#bytes-chart"), units.map((u) => `unit ${u.unit}`), [
    { color: "#0891b2", values: units.map((u) => u.bytes_sent) },
    { color: "#16a34a", values: units.map((u) => u.payload_bytes_encoded) },
    { color: "#d4d4d4", values: units.map((u) => u.fp32_bytes_encoded) },
  ], "bytes");
}

// ---- polling ------------------------------------------------------------------------------

// A gateway with a read-only token answers reads only with a token (that one or the API's).
function readHeaders() {
  const bearer = sessionStorage.getItem(TOKEN_KEY);
  return bearer ? { Authorization: `Bearer ${bearer}` } : {};
}

// A gateway of no job (compose's) serves the page without one: show the newest job, if any.
async function pickJob() {
  const response = await fetch("/jobs", { headers: readHeaders() });
  if (!response.ok) {
    $("#outer-state").textContent = response.status === 401
      ? "enter a token to see the jobs (read-only or API)"
      : `no jobs (${response.status})`;
    return;
  }
  const jobs = await response.json();
  if (jobs.length === 0) {
    $("#outer-state").textContent = "no job yet: create one with POST /jobs";
    return;
  }
  jobs.sort((a, b) => (a.created || 0) - (b.created || 0));
  window.location.replace(`/?job=${encodeURIComponent(jobs[jobs.length - 1].job)}`);
}

async function poll() {
  if (!JOB) {
    await pickJob().catch(() => { $("#outer-state").textContent = "gateway unreachable"; });
    return;
  }
  let metrics;
  try {
    const response = await fetch(`/jobs/${encodeURIComponent(JOB)}/metrics`, {
      headers: readHeaders(),
    });
    if (!response.ok) {
      $("#outer-state").textContent = response.status === 401
        ? "enter a token to see this job (read-only or API)"
        : `no data (${response.status})`;
      return;
    }
    metrics = await response.json();
  } catch (err) {
    $("#outer-state").textContent = "gateway unreachable";
    return;
  }
  $("#outer-state").textContent = `outer ${metrics.outer_state}`;
  $("#outer-state").className = `state ${metrics.outer_state}`;
  $("#version").textContent = fmt(metrics.version);
  $("#merges").textContent = fmt(metrics.merges);
  $("#tokens-applied").textContent = fmt(metrics.tokens_applied);
  $("#goodput").textContent = fmt(metrics.goodput, 2);
  $("#eval-loss").textContent = fmt(metrics.eval_nats_per_byte ?? metrics.eval_init_nats_per_byte, 4);
  renderUnits(metrics.units);
  drawLoss(metrics);
  drawStaleness(metrics);
  drawBytes(metrics);
  const updated = $("#updated");
  updated.dataset.polls = String(Number(updated.dataset.polls) + 1);
  updated.textContent = `updated ${new Date().toLocaleTimeString()}`;
}

poll();
setInterval(poll, POLL_MS);
