// kvtool inspector: render a conversation to tokens, stream a generation, show a token's attention row.
// Plain JS, no build step. Endpoints: /v1/viz/* (kvtool.serving.inspect_http) and, when the server enables it,
// /v1/chat/completions with a raw-token opt-in.
"use strict";

const $ = (id) => document.getElementById(id);
const CHANNELS = ["special", "reasoning", "content", "tool_call", "tool_response"];
const state = { config: null, ids: [], nPrompt: 0, tokens: [], selected: null, row: null, abort: null, conv: null };

async function postJSON(url, body) {
  const resp = await fetch(url, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
  const data = await resp.json().catch(() => ({}));
  if (!resp.ok) throw new Error((data.error && data.error.message) || JSON.stringify(data.detail || data) || resp.statusText);
  return data;
}

function showError(msg) {
  const el = $("error");
  el.hidden = !msg;
  el.textContent = msg || "";
}

function parseConversation() {
  const text = $("conversation").value.trim();
  if (!text) throw new Error("the conversation is empty: paste JSON messages or type a message");
  if (text[0] === "[" || text[0] === "{") {
    let doc;
    try { doc = JSON.parse(text); } catch (e) { throw new Error("the conversation is not valid JSON: " + e.message); }
    return Array.isArray(doc) ? { messages: doc } : { messages: doc.messages, tools: doc.tools };
  }
  return { messages: [{ role: "user", content: text }] };
}

function shown(piece) {
  return piece.replace(/\n/g, "↵\n").replace(/\t/g, "⇥");
}

function tokenSpan(t) {
  const span = document.createElement("span");
  span.className = `tok ch-${t.channel} role-${t.role || "none"}` + (t.generated ? " gen" : "");
  span.dataset.i = t.i;
  span.textContent = shown(t.piece);
  span.title = `#${t.i} id ${t.id} · ${t.role || "-"} · ${t.channel}`;
  span.addEventListener("click", () => selectToken(t.i));
  return span;
}

function drawTokens() {
  const box = $("tokens");
  box.replaceChildren(...state.tokens.map(tokenSpan));
  if (state.selected !== null && state.row) paintRow();
}

function appendToken(t) {
  state.tokens.push(t);
  $("tokens").appendChild(tokenSpan(t));
}

function setStats(s) {
  for (const [k, v] of Object.entries(s)) if (v !== undefined && v !== null) $("stat-" + k).textContent = v;
}

async function render() {
  showError("");
  state.conv = parseConversation();
  const data = await postJSON("/v1/viz/render", state.conv);
  state.ids = data.ids.slice();
  state.nPrompt = data.ids.length;
  state.tokens = data.tokens;
  state.selected = null;
  state.row = null;
  drawTokens();
  clearStrip();
  setStats({ prompt: data.n_tokens, cached: "–", ttft: "–", generated: "–", speed: "–", finish: "–" });
  return data;
}

async function* sseEvents(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function findAll(obj, pred, out = []) {
  if (obj && typeof obj === "object") {
    if (pred(obj)) out.push(obj);
    for (const v of Object.values(obj)) findAll(v, pred, out);
  }
  return out;
}

function findKey(obj, key) {
  const hit = findAll(obj, (o) => !Array.isArray(o) && key in o)[0];
  return hit ? hit[key] : undefined;
}

function onToken(ev) {
  const i = state.ids.length;
  state.ids.push(ev.id);
  appendToken({ i, id: ev.id, piece: ev.piece, role: "assistant", channel: ev.channel || "content", generated: true });
  const raw = $("raw");
  raw.textContent += ev.piece;
  raw.scrollTop = raw.scrollHeight;
  setStats({ generated: i - state.nPrompt + 1 });
}

function onTimings(t, finish) {
  if (!t) return;
  const speed = t.decode_tokens_per_s ? `${t.decode_tokens_per_s.toFixed(1)} tok/s` : undefined;
  setStats({ ttft: t.ttft_ms !== undefined ? `${t.ttft_ms.toFixed(1)} ms` : undefined, cached: t.cached_tokens,
             prompt: t.prompt_tokens, speed, finish });
}

async function generate() {
  showError("");
  $("raw").textContent = "";
  await render();
  const cfg = state.config;
  const body = { ...state.conv, max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value) };
  const ctrl = new AbortController();
  state.abort = ctrl;
  $("generate").disabled = true;
  $("stop").disabled = false;
  try {
    if (cfg.stream === "chat") Object.assign(body, { model: cfg.model, stream: true, stream_options: { include_usage: true },
                                                      [cfg.chat_raw_field]: true });
    const resp = await fetch(cfg.generate_url, { method: "POST", headers: { "Content-Type": "application/json" },
                                                 body: JSON.stringify(body), signal: ctrl.signal });
    if (!resp.ok) {
      const data = await resp.json().catch(() => ({}));
      throw new Error((data.error && data.error.message) || resp.statusText);
    }
    for await (const ev of sseEvents(resp)) {
      if (cfg.stream === "chat") {
        for (const tok of findAll(ev, (o) => !Array.isArray(o) && "piece" in o && "id" in o)) onToken(tok);
        // kvtool's server puts `timings` on the finish chunk and cached_tokens in `usage`; take them wherever they are.
        const finish = findKey(ev, "finish_reason") || undefined;
        onTimings(findKey(ev, "timings") || { ttft_ms: findKey(ev, "ttft_ms"), cached_tokens: findKey(ev, "cached_tokens") },
                  finish);
      } else if (ev.type === "token") onToken(ev);
      else if (ev.type === "done") onTimings(ev.timings, ev.finish_reason);
      else if (ev.type === "error") throw new Error(ev.message);
    }
    const data = await postJSON("/v1/viz/tokens", { ids: state.ids, n_prompt: state.nPrompt });
    state.tokens = data.tokens;  // roles and channels of the whole sequence, now that it is complete
    drawTokens();
    document.body.dataset.generation = "done";
  } catch (e) {
    if (e.name !== "AbortError") showError(e.message);
    document.body.dataset.generation = "error";
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
    state.abort = null;
  }
}

function viridis(x) {
  // A few viridis stops, linearly interpolated; x in [0, 1].
  const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const f = Math.min(0.9999, Math.max(0, x)) * (stops.length - 1);
  const i = Math.floor(f), t = f - i;
  const c = stops[i].map((v, k) => Math.round(v + t * (stops[i + 1][k] - v)));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

function level(p, max) {
  if ($("scale").value === "log") {
    const lo = Math.log10(1e-4), hi = Math.log10(Math.max(max, 1e-3));
    return p <= 0 ? 0 : (Math.log10(Math.max(p, 1e-4)) - lo) / (hi - lo);
  }
  return max > 0 ? p / max : 0;
}

function clearStrip() {
  const c = $("strip");
  c.width = c.clientWidth || 800;
  c.getContext("2d").clearRect(0, 0, c.width, c.height);
  delete c.dataset.query;
  delete c.dataset.len;
  $("attention-info").textContent = "click a token to see where it attends";
}

function paintRow() {
  const row = state.row, n = state.tokens.length, c = $("strip");
  c.width = c.clientWidth || 800;
  const ctx = c.getContext("2d");
  ctx.clearRect(0, 0, c.width, c.height);
  const max = Math.max(...row);
  const w = c.width / n;
  // Keys beyond the query are in its future: grey. Several tokens per pixel keep the max.
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = i < row.length ? viridis(level(row[i], max)) : "#e0e0e0";
    ctx.fillRect(Math.floor(i * w), 0, Math.max(1, Math.ceil(w)), c.height);
  }
  ctx.strokeStyle = "#d50000";
  ctx.lineWidth = 2;
  ctx.strokeRect(Math.floor(state.selected * w), 1, Math.max(2, w), c.height - 2);
  for (const span of $("tokens").children) {
    const i = Number(span.dataset.i);
    span.style.backgroundColor = i < row.length ? `rgba(255, 87, 34, ${(0.85 * level(row[i], max)).toFixed(3)})` : "";
    span.classList.toggle("selected", i === state.selected);
  }
  c.dataset.query = state.selected;
  c.dataset.len = row.length;
}

async function selectToken(i) {
  showError("");
  state.selected = i;
  const layer = $("layer").value, head = $("head").value;
  const asIndex = (v) => (v === "mean" || v === "max" ? v : Number(v));
  try {
    const data = await postJSON("/v1/viz/attention",
      { ids: state.ids.slice(0, i + 1), query: i, layer: asIndex(layer), head: asIndex(head) });
    state.row = data.row;
    paintRow();
    const top = data.top.slice(0, 5).map(([k, p]) => `#${k} ${JSON.stringify(state.tokens[k].piece)} ${p.toFixed(3)}`);
    $("attention-info").textContent = `token #${i} ${JSON.stringify(state.tokens[i].piece)} (layer ${layer}, head ${head}) → ` + top.join(" · ");
  } catch (e) {
    showError(e.message);
  }
}

function fillSelect(sel, n) {
  sel.replaceChildren(...["mean", "max", ...Array.from({ length: n }, (_, i) => String(i))].map((v) => {
    const o = document.createElement("option");
    o.value = o.textContent = v;
    return o;
  }));
}

async function init() {
  const cfg = await (await fetch("/v1/viz/config")).json();
  state.config = cfg;
  $("model-info").textContent = `${cfg.model} · ${cfg.num_layers} layers · ${cfg.num_heads} heads · window ${cfg.context_window} · streaming via ${cfg.generate_url}`;
  fillSelect($("layer"), cfg.num_layers);
  fillSelect($("head"), cfg.num_heads);
  $("max-tokens").value = cfg.default_max_tokens;
  $("legend").replaceChildren(...CHANNELS.map((ch) => {
    const s = document.createElement("span");
    s.className = "tok ch-" + ch;
    s.textContent = ch.replace("_", " ");
    return s;
  }));
  const run = (fn) => () => fn().catch((e) => showError(e.message));
  $("render").addEventListener("click", run(render));
  $("generate").addEventListener("click", run(generate));
  $("stop").addEventListener("click", () => state.abort && state.abort.abort());
  for (const id of ["layer", "head"]) $(id).addEventListener("change", () => state.selected !== null && selectToken(state.selected));
  $("scale").addEventListener("change", () => state.row && paintRow());
  document.body.dataset.ready = "1";
}

init().catch((e) => showError("could not load /v1/viz/config: " + e.message));
