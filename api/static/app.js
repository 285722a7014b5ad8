// The LMSP dashboard: plain JavaScript against the public API, no build step.
// The token lives in sessionStorage (this tab only). Every value from the server is set with
// textContent, never parsed as HTML.
"use strict";

const API = "/lmsp/v1";
const FINAL = ["response.completed", "response.incomplete", "response.failed", "response.cancelled"];
const TERMINAL = ["succeeded", "failed", "cancelled"];
const $ = (sel) => document.querySelector(sel);

const POLL_MS = 2000;  // the home page's refresh while the tab is visible (the list's 304s cost no body)
const POLL_TIMEOUT_MS = 10000;  // a poll that hangs is given up, so the next one is not held back

let nextCursor = null;
let listTag = null;   // the task list's ETag: a poll of an unchanged list answers 304
let pollTimer = null;
let pollRun = 0;      // the latest refresh: only it schedules the next (no two timers)
let current = null;  // the task page's state: {id, task, source, last, chars, timer}

// -- the API ---------------------------------------------------------------------------------------
function token() { return sessionStorage.getItem("lmsp-token"); }

function randomKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));  // randomUUID needs a secure context
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

// `etag`: sent as If-None-Match; a 304 answers null. The answer's ETag goes to `onTag`. `timeout`: ms.
async function api(method, path, body, { etag, onTag, timeout } = {}) {
  const headers = { Authorization: `Bearer ${token()}`, "LMSP-Version": "1.0" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    headers["Idempotency-Key"] = randomKey();
  }
  if (etag) headers["If-None-Match"] = etag;
  let resp;
  try {
    resp = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body),
                               signal: timeout ? AbortSignal.timeout(timeout) : undefined });
  } catch (exc) {
    throw Object.assign(new Error("Cannot reach the service; is it running?"), { status: 0 });
  }
  if (onTag) onTag(resp.headers.get("ETag"));
  if (resp.status === 304) return null;
  const data = await resp.json().catch(() => null);
  if (!resp.ok) {
    if (resp.status === 401 && path !== `${API}/models`) signOut("The token was refused; sign in again.");
    const detail = data && data.detail ? data.detail : `${resp.status} ${resp.statusText}`;
    throw Object.assign(new Error(detail), { status: resp.status, problem: data });
  }
  return data;
}

// -- formatting ------------------------------------------------------------------------------------
function seconds(s) {
  s = Math.max(0, Math.round(s));
  const m = Math.floor(s / 60);
  return m ? `${m}m ${String(s % 60).padStart(2, "0")}s` : `${s}s`;
}
function duration(task) {
  const end = TERMINAL.includes(task.status) ? task.updated_at : Date.now() / 1000;
  return seconds(end - task.created_at);
}
// Where a finished task's time went (its x-lmsp-timeline extension): one bar, a segment per phase.
const PHASES = ["queue", "retries", "dispatch", "load", "prefill", "decode", "write_lag"];
function span(s) { return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`; }
function timelineBar(task) {
  const line = task.extensions && task.extensions["x-lmsp-timeline"];
  const bar = document.createElement("div");
  bar.className = "timeline";
  if (!line || !line.durations || !(line.wall > 0)) return bar;
  const d = line.durations;
  const parts = PHASES.filter((p) => d[p] > 0).map((p) => `${p.replace("_", " ")} ${span(d[p])}`);
  const label = `${parts.join(", ")}; framework ${span(d.framework_overhead)} of ${span(line.wall)}`;
  bar.setAttribute("role", "img");
  bar.setAttribute("aria-label", label);
  bar.title = label;
  for (const phase of PHASES) {
    if (!(d[phase] > 0)) continue;
    const seg = document.createElement("span");
    seg.className = `phase-${phase}`;
    seg.style.width = `${(100 * d[phase]) / line.wall}%`;
    bar.append(seg);
  }
  return bar;
}
function timelineLegend(task) {
  const line = task.extensions && task.extensions["x-lmsp-timeline"];
  const list = document.createElement("ul");
  list.className = "legend";
  if (!line || !line.durations) return list;
  for (const phase of [...PHASES, "framework_overhead"]) {
    if (!(line.durations[phase] > 0)) continue;
    const item = document.createElement("li");
    const swatch = document.createElement("span");
    swatch.className = `swatch phase-${phase}`;
    item.append(swatch, `${phase.replace("_", " ")} ${span(line.durations[phase])}`);
    list.append(item);
  }
  return list;
}
function workerOf(task) {  // the worker of its latest attempt, from the timeline
  const line = task.extensions && task.extensions["x-lmsp-timeline"];
  const attempts = (line && line.attempts) || [];
  return attempts.length ? `${attempts[attempts.length - 1].worker_id} (attempt ${attempts.length})` : "–";
}
function tokensOf(task) {
  const usage = task.response && task.response.usage;
  return usage ? String(usage.output_tokens) : "–";
}
function outputText(response) {
  let text = "";
  for (const item of (response && response.output) || []) {
    if (item.type !== "message") continue;
    for (const part of item.content || []) if (part.type === "output_text") text += part.text;
  }
  return text;
}
function cell(row, text, state) {
  const td = row.insertCell();
  td.textContent = text;
  if (state) td.dataset.state = state;
  return td;
}
function notice(text) {
  const el = $("#notice");
  el.textContent = text || "";
  el.hidden = !text;
}

// -- pages -----------------------------------------------------------------------------------------
function show(page) {
  for (const id of ["signin-page", "home-page", "task-page"]) $(`#${id}`).hidden = id !== page;
  $("#signout").hidden = page === "signin-page";
  if (page !== "home-page") clearTimeout(pollTimer);
}

function signOut(message) {
  sessionStorage.removeItem("lmsp-token");
  stopFollowing();
  show("signin-page");
  $("#signin-error").textContent = message || "";
  $("#token").focus();
}

async function route() {
  stopFollowing();
  notice("");
  if (!token()) return signOut();
  const match = location.hash.match(/^#\/tasks\/([A-Za-z0-9_]+)$/);
  if (match) return openTask(match[1]);
  show("home-page");
  listTag = null;  // the table may be stale: the first read is unconditional
  await refreshHome();
}

// -- the home page, live: tasks, models and workers, every POLL_MS while the tab is visible ----------
async function refreshHome() {
  clearTimeout(pollTimer);
  const run = ++pollRun;
  try {
    await Promise.all([loadModels(), loadTasks(false), loadWorkers()]);
    notice("");
  } catch (exc) {
    notice(exc.message);  // e.g. the service is down: keep trying at the same pace
  }
  if (run === pollRun && !$("#home-page").hidden && document.visibilityState === "visible" && token()) {
    pollTimer = setTimeout(refreshHome, POLL_MS);
  }
}

async function loadModels() {
  const { data } = await api("GET", `${API}/models`, undefined, { timeout: POLL_TIMEOUT_MS });
  const body = $("#models tbody");
  body.replaceChildren();
  for (const m of data) {
    const row = body.insertRow();
    cell(row, m.id);
    cell(row, m.status, m.status);
    cell(row, String(m.workers));
    cell(row, String(m.context_window));
  }
  const select = $("#model");
  const options = data.map((m) => new Option(`${m.id}${m.status === "ready" ? "" : " (unavailable)"}`, m.id));
  if (options.map((o) => o.text).join("\n") === Array.from(select.options, (o) => o.text).join("\n")) return;
  const chosen = select.value;  // rebuilt only when it changed: someone may be choosing
  select.replaceChildren(...options);
  const ready = data.find((m) => m.status === "ready");
  select.value = data.some((m) => m.id === chosen) ? chosen : (ready || data[0] || {}).id || "";
}

// `more`: the next page, below. Otherwise the rows shown are read again (up to 100), only if changed.
async function loadTasks(more) {
  const body = $("#tasks tbody");
  const shown = body.querySelectorAll("tr[data-id]").length;
  const params = new URLSearchParams({ limit: String(more ? 20 : Math.min(100, Math.max(20, shown))) });
  if (more && nextCursor) params.set("cursor", nextCursor);
  let tag = null;
  const page = await api("GET", `${API}/tasks?${params}`, undefined,
                         { etag: more ? null : listTag, onTag: (t) => { tag = t; }, timeout: POLL_TIMEOUT_MS });
  if (page === null) return tickDurations();  // 304: nothing came, went or changed state
  if (!more) listTag = tag;
  const rows = page.data.map(taskRow);
  const offset = more ? shown : 0;
  rows.forEach((row, i) => {  // in place: a row that stays keeps its node (and the focus in it)
    if (body.rows[offset + i] !== row) body.insertBefore(row, body.rows[offset + i] || null);
  });
  if (!more && shown <= 100) while (body.rows.length > rows.length) body.deleteRow(-1);
  if (!rows.length && !more) {
    const empty = body.insertRow().insertCell();
    empty.colSpan = 6;
    empty.className = "muted";
    empty.textContent = "No tasks yet: submit one above.";
  }
  if (more || shown <= 100) {  // the page read covers every row shown: its cursor is the next page's
    nextCursor = page.next_cursor;
    $("#more").hidden = !page.has_more;
  }
}

function taskRow(task) {
  let row = $(`#tasks tbody tr[data-id="${task.id}"]`);
  if (!row) {
    row = document.createElement("tr");
    row.dataset.id = task.id;
    const link = document.createElement("a");
    link.href = `#/tasks/${task.id}`;
    link.textContent = task.id;
    row.insertCell().append(link);
    for (let i = 0; i < 5; i += 1) row.insertCell();
  }
  row.task = task;
  const cells = row.cells;
  cells[1].textContent = task.status;
  cells[1].dataset.state = task.status;
  cells[2].textContent = tokensOf(task);
  cells[3].textContent = duration(task);
  cells[4].textContent = new Date(task.created_at * 1000).toLocaleString();
  cells[5].replaceChildren(timelineBar(task));
  return row;
}

function tickDurations() {  // an unchanged list still has running tasks whose duration grows
  for (const row of $("#tasks tbody").rows) if (row.task) row.cells[3].textContent = duration(row.task);
}

const WORKER_STATES = ["ready", "loading", "reloading", "reconnecting", "draining", "lost"];
function rate(x) { return `${x.toFixed(1)} tok/s`; }

// Each worker for a token with scope admin; per model for others (the api leaves `data` out).
async function loadWorkers() {
  const list = await api("GET", `${API}/workers`, undefined, { timeout: POLL_TIMEOUT_MS });
  $("#workers-total").textContent = `${list.running} running · ${rate(list.tokens_per_second)}`;
  const head = $("#workers thead tr");
  const body = $("#workers tbody");
  body.replaceChildren();
  if (list.data) {
    head.replaceChildren(...["Worker", "Models loaded", "State", "Running", "Tokens/s"].map(th));
    for (const w of list.data) {
      const row = body.insertRow();
      row.dataset.id = w.id;
      cell(row, w.id);
      cell(row, w.models_loaded.join(", ") || `– (serves ${w.model})`);
      cell(row, w.state, w.state);
      cell(row, String(w.running));
      cell(row, rate(w.tokens_per_second));
    }
  } else {
    head.replaceChildren(...["Model", "Workers", "Loaded on"].map(th));
    for (const m of list.models) {
      const row = body.insertRow();
      row.dataset.model = m.model;
      cell(row, m.model);
      const counts = WORKER_STATES.filter((s) => m.workers[s]).map((s) => `${m.workers[s]} ${s}`);
      cell(row, counts.join(", "), m.workers.ready ? "ready" : "unavailable");
      cell(row, String(m.loaded_on));
    }
  }
  if (!body.rows.length) {
    const empty = body.insertRow().insertCell();
    empty.colSpan = head.cells.length;
    empty.className = "muted";
    empty.textContent = "No worker is running.";
  }
}
function th(text) {
  const el = document.createElement("th");
  el.textContent = text;
  return el;
}

async function submitTask(event) {
  event.preventDefault();
  $("#submit-error").textContent = "";
  const input = { model: $("#model").value, input: [{ type: "message", role: "user",
    content: [{ type: "input_text", text: $("#prompt").value }] }] };
  const max = $("#max-tokens").value;
  if (max) input.max_output_tokens = Number(max);
  try {
    const task = await api("POST", `${API}/tasks`, { type: "response", input, on_restart: $("#on-restart").value });
    $("#prompt").value = "";
    location.hash = `#/tasks/${task.id}`;
  } catch (exc) {
    $("#submit-error").textContent = exc.problem && exc.problem.param ? `${exc.message} (${exc.problem.param})`
                                                                      : exc.message;
  }
}

// -- one task, live ----------------------------------------------------------------------------------
function renderTask() {
  const { task } = current;
  $("#task-title").textContent = task.id;
  $("#task-state").textContent = task.status;
  $("#task-state").dataset.state = task.status;
  const usage = task.response && task.response.usage;
  $("#task-tokens").textContent = usage ? `${usage.output_tokens} output, ${usage.input_tokens} input`
                                        : `${current.chars} characters so far`;
  $("#task-elapsed").textContent = duration(task);
  const bar = timelineBar(task);
  $("#task-timeline").replaceChildren(bar, bar.title ? timelineLegend(task) : "–");
  $("#task-worker").textContent = workerOf(task);
  $("#cancel").hidden = TERMINAL.includes(task.status) || task.status === "cancelling";
  if (task.error) $("#task-error").textContent = `${task.error.code}: ${task.error.detail}`;
}

function setText(text) {
  const pre = $("#task-text");
  pre.replaceChildren(document.createTextNode(text));
  current.chars = text.length;
}

function appendText(delta) {
  const pre = $("#task-text");
  const last = pre.lastChild;
  if (last && last.nodeType === Node.TEXT_NODE) last.appendData(delta);
  else pre.append(document.createTextNode(delta));
  current.chars += delta.length;
}

async function openTask(id) {
  show("task-page");
  const state = { id, task: null, source: null, last: 0, chars: 0, timer: null, retry: null };
  current = state;
  $("#task-text").replaceChildren();
  $("#task-error").textContent = "";
  $("#task-stream").textContent = "";
  let task;
  try {
    task = await api("GET", `${API}/tasks/${id}`);
  } catch (exc) {
    if (state !== current) return;
    $("#task-title").textContent = id;
    $("#task-error").textContent = exc.message;
    return;
  }
  // Another page was opened while this read was on its way: the answer is no longer wanted (following
  // from here would give the page shown a second stream nobody closes).
  if (state !== current) return;
  current.task = task;
  renderTask();
  current.timer = setInterval(() => current && current.task && renderTask(), 1000);
  if (current.task.status === "succeeded") {
    setText(outputText(current.task.response));  // the stored result: nothing to stream
    renderTask();
    $("#task-stream").textContent = "finished";
    return;
  }
  follow();
}

// EventSource cannot send the Authorization header: a short-lived ticket for this task rides in
// the URL instead. EventSource reconnects by itself with Last-Event-ID; if it gives up (the ticket
// expired, the api answered an error), open a new one with a new ticket from the last id seen.
async function follow() {
  const state = current;
  let ticket;
  try {
    ticket = await api("POST", `${API}/tasks/${state.id}/events/ticket`);
  } catch (exc) {
    if (state !== current) return;
    $("#task-stream").textContent = "reconnecting…";
    state.retry = setTimeout(follow, 2000);
    return;
  }
  if (state !== current) return;
  const url = ticket.events_url + (state.last ? `&after=${state.last}` : "");
  const source = new EventSource(url);
  state.source = source;
  const fresh = (e) => {  // a replay after a reconnect may repeat events: keep each id once
    const id = Number(e.lastEventId);
    if (!id || id <= state.last) return false;
    state.last = id;
    return true;
  };
  source.onopen = () => { $("#task-stream").textContent = "live"; };
  source.addEventListener("response.output_item.added", (e) => {
    if (fresh(e) && state.task.status !== "cancelling") { state.task.status = "running"; renderTask(); }
  });
  source.addEventListener("response.output_text.delta", (e) => {
    if (fresh(e)) appendText(JSON.parse(e.data).delta);
  });
  source.addEventListener("response.attempt.started", (e) => {
    if (!fresh(e)) return;
    const marker = document.createElement("span");
    marker.className = "retry";
    marker.textContent = `↻ attempt ${JSON.parse(e.data).attempt} started: the text so far was discarded`;
    $("#task-text").replaceChildren(marker);
    state.chars = 0;
  });
  for (const name of FINAL) {
    // A final event may come without an id (recovered from the database): never skip it.
    source.addEventListener(name, (e) => { fresh(e); finish(state); });
  }
  source.addEventListener("error", (e) => {
    if (e.data) {  // the server's `error` event: it cannot go on; EventSource reconnects
      $("#task-stream").textContent = "reconnecting…";
    } else if (source.readyState === EventSource.CLOSED) {
      $("#task-stream").textContent = "reconnecting…";
      source.close();
      if (state === current) state.retry = setTimeout(follow, 1000);
    } else {
      $("#task-stream").textContent = "reconnecting…";
    }
  });
}

async function finish(state) {
  if (state.source) state.source.close();  // the stream is over: no reconnect loop
  state.source = null;
  $("#task-stream").textContent = "closed";
  try {
    state.task = await api("GET", `${API}/tasks/${state.id}`);
  } catch (exc) {
    $("#task-error").textContent = exc.message;
  }
  if (state === current) renderTask();
}

function stopFollowing() {
  if (!current) return;
  if (current.source) current.source.close();
  clearTimeout(current.retry);
  clearInterval(current.timer);
  current = null;
}

async function cancelTask() {
  const state = current;
  try {
    const task = await api("POST", `${API}/tasks/${state.id}/cancel`);
    // The stream's final event (and the task read after it) can come before this answer on a busy
    // link: a late "cancelling" must not undo the final state already shown.
    if (!TERMINAL.includes(state.task.status)) state.task = task;
    if (state === current) renderTask();
  } catch (exc) {
    $("#task-error").textContent = exc.message;
  }
}

// -- wiring ----------------------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  $("#signin-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    sessionStorage.setItem("lmsp-token", $("#token").value.trim());
    try {
      await api("GET", `${API}/models`);
    } catch (exc) {
      sessionStorage.removeItem("lmsp-token");
      $("#signin-error").textContent = exc.status === 401 ? "That token is unknown or revoked." : exc.message;
      return;
    }
    $("#token").value = "";
    route();
  });
  $("#signout").addEventListener("click", () => signOut());
  $("#submit-form").addEventListener("submit", submitTask);
  $("#prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("#submit-form").requestSubmit();
  });
  $("#refresh").addEventListener("click", () => { listTag = null; refreshHome(); });
  $("#more").addEventListener("click", () => loadTasks(true).catch((exc) => notice(exc.message)));
  $("#cancel").addEventListener("click", cancelTask);
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && !$("#task-page").hidden) location.hash = "#/";
  });
  window.addEventListener("hashchange", route);
  document.addEventListener("visibilitychange", () => {  // a hidden tab asks nothing; shown, it catches up
    if (document.visibilityState === "visible" && !$("#home-page").hidden) refreshHome();
    else clearTimeout(pollTimer);
  });
  route();
});
