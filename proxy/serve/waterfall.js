// The waterfall page's script (/ui; the page's comment says what it draws).
//
// Every value it shows came from outside: a client chose the model, the end user and the prompt, an upstream the
// response model and its errors, an operator's files the tenants, routes and objectives. Each reaches the page only
// as text: nodes are built here (`el`) and filled with Text nodes, never by parsing markup (no innerHTML anywhere),
// and the page's Content-Security-Policy refuses inline script, inline style and every other origin, so that a
// miss elsewhere still cannot run. The admin key is never held here: the login form posts it, and the proxy answers
// with a cookie scripts cannot read.
"use strict";
const FILTERS = ["api", "model", "upstream", "instance", "tenant", "outcome", "slo", "verdict"];  // /llmproxy/requests filters, one select each
// A record's SLO verdict (--slo): good, miss, or none (not judged); a miss names each objective and its blamed phase.
const verdict = (r) => r.slo_good === true ? "good" : (r.slo_good === false ? "miss" : null);
const misses = (r) => (r.slo_missed || []).map((o) => `${o}: ${(r.slo_blame || {})[o]}`).join(", ");
const filterValue = (r, f) => f === "verdict" ? verdict(r) : r[f];
const PHASES = ["client", "failover", "wait", "network", "tokenize", "queue", "load", "reasoning", "prefill", "decode", "server", "proxy", "lag"];
const LANE_PX = 800;            // the width of the time axis, for the longest request shown
const state = {records: [], pxPerS: 0};
const $ = (id) => document.getElementById(id);
const ms = (s) => typeof s !== "number" ? "n/a" : (s < 1 ? (s * 1000).toFixed(2) + " ms" : s.toFixed(3) + " s");
const text = (v) => v == null ? "" : String(v);

// An element: `props` are the few this page sets (a class, a tooltip, data attributes, a width or offset in px), each
// by its property; `children` are nodes or values, a value always becoming a Text node.
function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props || {})) {
    if (name === "class") node.className = value;
    else if (name === "title") node.title = text(value);
    else if (name === "data") for (const [k, v] of Object.entries(value)) node.dataset[k] = text(v);
    else if (name === "width" || name === "left") node.style[name] = value;  // (the CSSOM: no style attribute parsed)
    else throw new Error(`el: no property ${name}`);
  }
  for (const child of children) if (child != null) node.append(child instanceof Node ? child : text(child));
  return node;
}

$("legend").replaceChildren(...PHASES.map((p) => el("span", {class: p}, p)));
// Filters preset from the page's query (/ui?model=m&upstream=u: the links in the alerts' first_look).
for (const [f, v] of new URLSearchParams(location.search)) if (FILTERS.includes(f) && v) {
  if (![...$(f).options].some((o) => o.value === v)) $(f).add(new Option(v, v));
  $(f).value = v;
}
$("min_ttft").value = new URLSearchParams(location.search).get("min_ttft") || "";
$("user").value = new URLSearchParams(location.search).get("user") || "";  // (an end user: typed, never listed: there are many)

// With --admin-key, a 401 shows the login form; it comes back to this view (its query) once the key is taken.
function askForKey() {
  $("back").value = location.search;
  $("refused").hidden = location.hash !== "#refused";
  $("login").hidden = false;
  $("live").checked = false;
}

async function fetchJSON(path, params) {
  for (const f of FILTERS) if ($(f).value) params.set(f, $(f).value);
  const response = await fetch(path + "?" + params, {credentials: "same-origin"});
  if (response.status === 401) {
    askForKey();
    return null;
  }
  return response.json();
}

const fetchRecords = () => fetchJSON("/llmproxy/requests", new URLSearchParams({limit: "200", ...($("min_ttft").value ? {min_ttft: $("min_ttft").value} : {}),
                                                                              ...($("user").value ? {user: $("user").value} : {})}));

// The store's summary of the last hour for the filters above (not the TTFT threshold: the aggregates are by dimension).
function drawSummary(s) {
  if (!s || s.requests == null) { $("summary").textContent = ""; return; }
  const since = new Date(s.since_unix_ns / 1e6).toLocaleTimeString();
  const q = (p) => `p50 ${ms(p.p50)}, p90 ${ms(p.p90)}, p99 ${ms(p.p99)}`;
  const outcomes = Object.entries(s.outcomes).map(([o, n]) => `${o} ${n}`).join(", ");
  const slos = Object.entries(s.slo).map(([name, v]) => `SLO ${name} ${v.attainment == null ? "n/a" : (100 * v.attainment).toFixed(2) + "%"} of ${v.judged}`).join("; ");
  $("summary").dataset.requests = String(s.requests);
  $("summary").textContent = `since ${since}: ${s.requests} requests (${outcomes || "none"}); TTFT ${q(s.ttft_s)}; end to end ${q(s.e2e_s)}` +
    (slos ? `; ${slos}` : "") + " (from the store's hourly counts; percentiles within a bucket of the dashboard's histograms)";
}

// Each replica's health now (this worker's view): set aside ones first, with why and when they are back.
function drawReplicas(list) {
  if (!Array.isArray(list)) return;
  const sorted = list.slice().sort((a, b) => (a.state === "serving") - (b.state === "serving"));
  const parts = ["replicas: "];
  sorted.forEach((u, i) => {
    if (i) parts.push(", ");
    if (u.state === "serving") { parts.push(`${u.upstream} serving`); return; }
    parts.push(el("span", {class: "aside", data: {upstream: u.upstream}}, `${u.upstream} ${u.state}`),
               ` (${text(u.reason).replaceAll("_", " ")}` + (u.state === "ejected" ? `, back in ${u.back_in_s} s)` : ")"));
  });
  $("replicas").replaceChildren(...parts);
}

function fillFilter(id, values) {
  const select = $(id), current = select.value;
  const known = new Set([...select.options].map((o) => o.value));
  for (const v of [...new Set(values.map(text))].sort()) if (!known.has(v)) select.add(new Option(v, v));
  select.value = current;
}

// A phase narrower than the 0.001 px a width is written with has no box to draw (a few ns: an
// engine figure that left a sliver of queue): not emitted as an empty, invisible segment.
const MIN_PX = 0.0005;

function segments(record, pxPerS) {
  const phases = record.phases_s || {};
  return PHASES.filter((p) => phases[p] * pxPerS >= MIN_PX)
    .map((p) => el("div", {class: `seg ${p}`, data: {phase: p}, title: `${p} ${ms(phases[p])}`, width: `${(phases[p] * pxPerS).toFixed(3)}px`}));
}

function draw() {
  const records = state.records.slice().reverse();  // newest first
  const longest = Math.max(1e-6, ...records.map((r) => typeof r.duration_s === "number" ? r.duration_s : 0));
  state.pxPerS = LANE_PX / longest;
  $("rows").dataset.pxPerS = String(state.pxPerS);
  $("rows").replaceChildren(...records.map((r, i) => {
    const when = new Date(r.received_unix_ns / 1e6).toLocaleTimeString();
    const missed = verdict(r) === "miss";
    const mark = missed ? el("span", {class: "miss", title: `SLO ${text(r.slo)} missed`}, `✗ ${misses(r)}`) : null;
    const label = el("div", {class: "label"}, mark, `${when} ${text(r.model)} ${text(r.api)} ${text(r.endpoint)} `,
                     el("span", {class: r.outcome === "ok" ? "ok" : "bad"}, r.outcome), ` ${ms(r.duration_s)}`);
    const lane = el("div", {class: "lane", width: `${LANE_PX}px`}, el("div", {class: "bar"}, ...segments(r, state.pxPerS)));
    const row = el("div", {class: missed ? "row missed" : "row", data: {index: i}, title: r.instance || ""}, label, lane);
    row.onclick = () => showDetail(r);
    return row;
  }));
  $("status").textContent = `${records.length} requests`;
}

function showDetail(r) {
  if (!r) return;
  const pxPerS = LANE_PX / Math.max(1e-6, typeof r.duration_s === "number" ? r.duration_s : 0);
  const ticks = (Array.isArray(r.content_offsets_ms) ? r.content_offsets_ms : []).map((t) => el("div", {class: "tick", left: `${(t / 1000 * pxPerS).toFixed(3)}px`}));
  const phases = r.phases_s || {};
  const tps = r.decode_tokens_per_second;
  const judged = r.slo ? `${text(r.slo)}: ${verdict(r) === "miss" ? "missed " + misses(r) : (verdict(r) || "not judged")}` : "none";
  const facts = [
    ["duration", ms(r.duration_s)], ["TTFT", ms(r.ttft_s)],
    ["decode", typeof tps === "number" ? tps.toFixed(1) + " tok/s" : "n/a"],
    ["tokens", `prompt ${text(r.prompt_tokens ?? "n/a")} (cached ${text(r.cached_prompt_tokens ?? 0)}), completion ${text(r.completion_tokens ?? "n/a")} (hidden reasoning ${text(r.hidden_reasoning_tokens ?? 0)})`],
    ["phases", PHASES.filter((p) => p in phases).map((p) => p + " " + ms(phases[p])).join(", ")],
    ["SLO", judged],
    ["instance", r.instance || "n/a"],
    ["tenant", `${text(r.tenant || "unknown")}${r.user ? `, end user ${text(r.user)}` : ""}`],
    ["response model", r.response_model || "n/a"],
    ...(r.error ? [["error", r.error]] : []),
    ...(Array.isArray(r.attempts) && r.attempts.length ? [["attempts", r.attempts.map((a) =>
      `${text(a.upstream)}: ${a.abandoned ? "abandoned (" + text(a.abandoned) + ") after " + ms(a.duration_s) : "served"}`).join("; ")]] : []),
    ["trace id", r.trace_id || "none (tracing off)"],
  ];
  const chunks = `(${text(r.content_chunks)} content chunks${r.content_offsets_truncated ? ", ticks truncated" : ""})`;
  $("detail").className = "open";
  $("detail").replaceChildren(
    el("strong", null, `${text(r.model)} ${text(r.api)} ${text(r.endpoint)} ${text(r.outcome)}`), ` ${chunks}`,
    el("div", {class: "axis", width: `${LANE_PX}px`}, el("div", {class: "bar"}, ...segments(r, pxPerS)), ...ticks),
    el("dl", null, ...facts.flatMap(([name, value]) => [el("dt", null, name), el("dd", null, value)])));
}

async function refresh() {
  const [records, summary, replicas] = await Promise.all([fetchRecords(), fetchJSON("/llmproxy/summary", new URLSearchParams({since: "3600"})),
                                                         fetchJSON("/llmproxy/upstreams", new URLSearchParams())]);
  drawSummary(summary);
  drawReplicas(replicas);
  if (Array.isArray(records)) {
    state.records = records;
    for (const f of FILTERS) fillFilter(f, records.map((r) => filterValue(r, f)).filter((v) => v != null));
    draw();
    const wanted = /#detail=(\d+)/.exec(location.hash);
    if (wanted) showDetail(state.records.slice().reverse()[Number(wanted[1])]);
  }
  document.body.dataset.loaded = "true";
}

for (const f of FILTERS) $(f).onchange = refresh;
$("min_ttft").onchange = refresh;
$("user").onchange = refresh;
setInterval(() => { if ($("live").checked) refresh(); }, 2000);
refresh();
