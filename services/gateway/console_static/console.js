// The kvserve console: follows /console/api/events (server-sent events read with
// fetch, so the API key goes in an Authorization header, never in the URL) and
// draws each state it receives. Every value is put in the page as text.
"use strict";

const KEY = "kvserve.apiKey";
const $ = (id) => document.getElementById(id);
let charts = null;

// --- formatting --------------------------------------------------------------------
const ms = (s) => (s == null ? "–" : s < 1 ? `${(s * 1e3).toFixed(0)} ms` : `${s.toFixed(2)} s`);
const pct = (x) => (x == null ? "–" : `${(x * 100).toFixed(x === 1 || x === 0 ? 0 : 1)}%`);
const ago = (s) => (s == null ? "–" : `${s.toFixed(1)} s ago`);
const clock = (t) => new Date(t * 1000).toLocaleTimeString();
const tiers = (t) => Object.entries(t || {}).filter(([, n]) => n).map(([k, n]) => `${k} ${n}`).join(", ") || "–";

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("data-")) el.setAttribute(k, v);
    else el[k] = v;
  }
  for (const child of children.flat()) {
    if (child == null) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function fill(tableId, rows) {
  $(tableId).tBodies[0].replaceChildren(...rows);
}

function costText(cost) {
  if (!cost) return "not measured";
  if (cost.prefill_per_token === 0 && cost.decode_base === 0) {
    return Object.entries(cost.load_per_block || {}).map(([t, s]) => `${t} ${(s * 1e6).toFixed(0)} µs/block`).join(", ");
  }
  return `prefill ${(cost.prefill_per_token * 1e3).toFixed(2)} ms/tok · step ${(cost.decode_base * 1e3).toFixed(1)} ms`
    + ` + ${(cost.decode_per_seq * 1e3).toFixed(2)} ms/seq`;
}

// --- the sections ------------------------------------------------------------------
function renderTiles(state) {
  const slo = state.slo;
  $("gateway").textContent = `${state.gateway.instance_id} · ${state.gateway.model}`;
  $("attainment").textContent = pct(slo.attainment);
  $("attainment").className = slo.attainment == null ? "" : slo.attainment >= 0.9 ? "good" : "bad";
  $("slo-targets").textContent = slo.ttft_s == null ? "no conductor" :
    `TTFT ≤ ${ms(slo.ttft_s)}, TPOT ≤ ${ms(slo.tbt_s)}, last ${slo.window_s / 60} min`;
  $("ttft").textContent = `${ms(slo.ttft_p50_s)} / ${ms(slo.ttft_p90_s)}`;
  $("tpot").textContent = `${ms(slo.tpot_p50_s)} / ${ms(slo.tpot_p90_s)}`;
  $("cache-hit").textContent = pct(slo.cache_hit);
  $("cache-tokens").textContent = `${slo.cached_tokens} of ${slo.prompt_tokens} prompt tokens`;
  $("requests-count").textContent = slo.requests;
  $("in-flight").textContent = `${state.gateway.in_flight} in flight`;
  const conductors = state.conductors.filter((c) => !c.error);
  $("policy").textContent = conductors.length ? conductors[0].policy : "–";
  $("conductors").textContent = state.conductors.map((c) => c.instance_id + (c.error ? ` (${c.error})` : "")).join(", ");
}

function renderInstances(state) {
  fill("instances", state.instances.map((i) => {
    const usage = i.kv_usage == null ? "–" : [
      h("span", { class: "bar" }, h("span", { style: `width:${(i.kv_usage * 100).toFixed(1)}%` })),
      `${pct(i.kv_usage)} of ${i.kv_capacity_blocks}`,
    ];
    const work = i.role === "prefill" ? `${i.queued_tokens} tok queued` : i.role === "decode" ? `batch ${i.batch_size}` : "–";
    return h("tr", { "data-instance": i.instance_id },
      h("td", {}, h("code", {}, i.instance_id)), h("td", { class: `role role-${i.role}` }, i.role),
      h("td", {}, i.host_id), h("td", { class: "num" }, i.load), h("td", {}, usage), h("td", {}, work),
      h("td", {}, tiers(i.tiers)), h("td", {}, i.role === "prefill" || i.role === "decode" || i.role === "store" ? costText(i.cost) : "–"),
      h("td", { class: "num" }, ago(i.last_heard_s)));
  }));
}

function candidateList(d) {
  return d.candidates.map((c) => {
    const chosen = c.instance_id === (c.role === "prefill" ? d.prefill_id : d.decode_id);
    const text = c.role === "prefill"
      ? `${c.instance_id}: TTFT ${ms(c.predicted_ttft_s)} (queue ${ms(c.queue_s)}, reuse ${c.cached_tokens})`
      : `${c.instance_id}: TBT ${ms(c.predicted_tbt_s)} (batch ${c.batch_size})`;
    return h("div", { class: chosen ? "chosen" : "" }, (chosen ? "✓ " : "") + text);
  });
}

function renderDecisions(state) {
  fill("decisions", state.decisions.map((d) => {
    const a = d.actual;
    const reuse = Object.entries(d.cached_tokens).filter(([, n]) => n).map(([t, n]) => `${t} ${n}`).join(", ") || "none";
    return h("tr", { "data-request-id": d.request_id, class: d.rejected ? "rejected" : "" },
      h("td", {}, clock(d.at)), h("td", {}, h("code", {}, d.request_id)),
      h("td", { class: "prefill" }, d.prefill_id + (d.prefill_on_decode ? " (on decode)" : "")),
      h("td", { class: "decode" }, d.decode_id, d.affinity ? h("div", { class: "candidates" }, d.affinity) : null),
      h("td", { class: "num" }, d.rejected ? [h("span", { class: "bad" }, `rejected: ${d.rejected}`), h("div", { class: "candidates" }, d.why)]
        : `${ms(d.predicted_ttft_s)} / ${ms(d.predicted_tbt_s)}`),
      h("td", {}, reuse),
      h("td", { class: "num actual" }, a ? `${ms(a.ttft_s)} / ${a.cached_tokens} of ${a.prompt_tokens}` : "–"),
      h("td", { class: "candidates" }, candidateList(d)));
  }));
}

function renderKV(state) {
  fill("prefixes", state.kv_map.hot_prefixes.map((p) => h("tr", {},
    h("td", {}, h("code", { title: p.block_hash }, p.block_hash.slice(0, 12))), h("td", { class: "num" }, p.num_blocks),
    h("td", { class: "num" }, p.hits), h("td", { class: "wrap" }, Object.entries(p.holders).map(([i, t]) => `${i} (${t})`).join(", ") || "evicted"))));
  fill("requests", state.requests.map((r) => h("tr", { "data-request-id": r.request_id },
    h("td", {}, h("code", {}, r.request_id)), h("td", {}, `${r.prefill_id} → ${r.decode_id}`),
    h("td", { class: "num" }, r.num_prompt_tokens), h("td", { class: "num cached" }, r.num_cached_tokens),
    h("td", { class: "num" }, r.num_completion_tokens), h("td", { class: "num" }, ms(r.ttft_s)), h("td", { class: "num" }, ms(r.tpot_s)),
    h("td", { class: r.slo_met ? "good" : "bad" }, r.slo_met == null ? "–" : r.slo_met ? "met" : `missed: ${r.slo_missed}`))));
}

function renderTenants(state) {
  const rows = state.tenants || [];
  $("tenants-section").hidden = rows.length === 0;
  $("tenants-window").textContent = `${state.slo.window_s / 60} min`;
  const refused = (r) => Object.entries(r.refusals).sort().map(([k, n]) => `${k} ${n}`).join(", ") || "–";
  fill("tenants", rows.map((t) => h("tr", { "data-tenant": t.tenant },
    h("td", {}, t.tenant), h("td", { class: "num" }, t.requests), h("td", { class: "num" }, t.prompt_tokens),
    h("td", { class: "num cached" }, t.cached_tokens), h("td", { class: "num" }, t.completion_tokens),
    h("td", { class: "wrap" }, refused(t)), h("td", { class: "num good" }, t.slo_met ?? "–"),
    h("td", { class: t.slo_missed ? "num bad" : "num" }, t.slo_missed ?? "–"))));
}

// --- charts ------------------------------------------------------------------------
function makeChart(el, series, yRange) {
  const opts = {
    width: Math.max(el.clientWidth, 280), height: 170, legend: { live: false },
    scales: { x: { time: true }, y: yRange ? { range: yRange } : { auto: true } },
    series: [{}, ...series.map(([label, stroke]) => ({ label, stroke, width: 2, spanGaps: false, points: { show: true, size: 6 } }))],
    axes: [{}, { size: 50 }],
  };
  return new uPlot(opts, [[], ...series.map(() => [])], el);
}

function renderCharts(state) {
  if (typeof uPlot === "undefined") return;
  if (!charts) {
    charts = {
      ttft: makeChart($("chart-ttft"), [["p50", "#2f6feb"], ["p90", "#b42318"]]),
      tpot: makeChart($("chart-tpot"), [["p50", "#2f6feb"], ["p90", "#b42318"]]),
      slo: makeChart($("chart-slo"), [["attained", "#1a7f37"]], [0, 1]),
    };
  }
  const s = state.series;
  charts.ttft.setData([s.t, s.ttft_p50_s, s.ttft_p90_s]);
  charts.tpot.setData([s.t, s.tpot_p50_s, s.tpot_p90_s]);
  charts.slo.setData([s.t, s.attainment]);
}

function render(state) {
  $("console").hidden = false;
  $("key-form").hidden = true;
  renderTiles(state);
  renderInstances(state);
  renderDecisions(state);
  renderKV(state);
  renderTenants(state);
  renderCharts(state);
  document.body.dataset.updated = String(state.time);
}

// --- the feed ----------------------------------------------------------------------
function setFeed(state, text) {
  $("feed").dataset.state = state;
  $("feed").textContent = text;
}

function askForKey(message) {
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
  $("key").focus();
  setFeed("down", "needs the API key");
}

async function follow() {
  const key = sessionStorage.getItem(KEY);
  const headers = { Accept: "text/event-stream" };
  if (key) headers.Authorization = `Bearer ${key}`;
  $("change-key").hidden = !key;
  let response;
  try {
    response = await fetch("/console/api/events", { headers, cache: "no-store" });
  } catch (e) {
    return retry(`gateway unreachable: ${e.message}`);
  }
  if (response.status === 401) {
    return askForKey(key ? "That key was refused." : "");
  }
  if (!response.ok) return retry(`HTTP ${response.status}`);
  setFeed("live", "live");
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const data = buffer.slice(0, end).split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        buffer = buffer.slice(end + 2);
        if (data) render(JSON.parse(data));
      }
    }
  } catch (e) {
    return retry(`feed broken: ${e.message}`);
  }
  retry("feed ended");
}

function retry(why) {
  setFeed("down", `${why}; reconnecting…`);
  setTimeout(follow, 2000);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key").value.trim());
  $("key").value = "";
  follow();
});
$("change-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  askForKey("");
});
follow();
