// skulkp2p dashboard: polls this node's JSON routes and draws the cluster, its placements and
// every model's requests. Plain JavaScript, no libraries; it talks to this node only. On a node
// with API keys the data routes answer 401 without one: the page then asks for the key once,
// keeps it for this tab (sessionStorage) and sends it as a Bearer token on every fetch.
"use strict";

const POLL_MS = 1000;
const RECENT_ROWS = 10; // the page shows the newest; /v1/stats has more
const state = { cluster: null, stats: null, models: [], lastOk: 0, polls: 0 };

// ---- small helpers -------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("data-")) e.setAttribute(k, String(v));
    else e.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function replace(parent, ...children) {
  parent.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined));
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  let v = Number(n);
  while (v >= 1000 && i < units.length - 1) { v /= 1000; i++; }
  return `${v.toFixed(v >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
}

function pct(x) { return x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`; }
function num(x, d = 1) { return x === null || x === undefined ? "–" : Number(x).toFixed(d); }
function ms(s) { return s === null || s === undefined ? "–" : `${Math.round(1000 * s)} ms`; }

function ago(seconds) {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  return `${Math.floor(s / 3600)} h ago`;
}

// ---- the API key ---------------------------------------------------------------------------

const KEY_STORE = "skulkp2p-api-key";
const auth = { prompts: 0, asking: false, refused: false };

function apiKey() {
  try { return sessionStorage.getItem(KEY_STORE) || ""; } catch (e) { return ""; }
}

function withKey(headers, key) {
  return key ? { ...headers, Authorization: `Bearer ${key}` } : headers;
}

// A 401 to a fetch that sent `sent` (the stored key, or ""): show the key form, once.
function askForKey(sent) {
  if (sent) {
    auth.refused = true;
    if (apiKey() === sent) {
      try { sessionStorage.removeItem(KEY_STORE); } catch (e) { /* storage off */ }
    }
  }
  const form = document.getElementById("key-form");
  document.getElementById("key-note").textContent = auth.refused
    ? "This node refused that API key; enter another." : "This node asks for an API key.";
  if (!auth.asking) {
    auth.asking = true;
    auth.prompts++;
    form.dataset.prompts = String(auth.prompts);
    form.hidden = false;
    document.getElementById("key-input").focus();
  }
}

function useKey(ev) {
  ev.preventDefault();
  const input = document.getElementById("key-input");
  const key = input.value.trim();
  if (!key) return;
  try { sessionStorage.setItem(KEY_STORE, key); } catch (e) { /* storage off */ }
  input.value = "";
  auth.asking = false;
  auth.refused = false;
  document.getElementById("key-form").hidden = true;
  poll();
}

async function getJSON(path) {
  const key = apiKey();
  const r = await fetch(path, { headers: withKey({ Accept: "application/json" }, key),
    cache: "no-store" });
  if (r.status === 401) askForKey(key);
  let body = null;
  try { body = await r.json(); } catch (e) { body = null; }
  return { ok: r.ok, status: r.status, body };
}

// ---- the cluster ---------------------------------------------------------------------------

function renderHead(cluster, stats) {
  const st = cluster || {};
  document.getElementById("node-name").textContent = st.node || (stats && stats.node) || "?";
  document.getElementById("leader").textContent = cluster ? (st.leader || "none") : "–";
  document.getElementById("term").textContent = cluster ? String(st.term) : "–";
  document.getElementById("role").textContent = cluster ? st.role : "single node";
  if (st.node || (stats && stats.node)) document.title = `skulkp2p · ${st.node || stats.node}`;
}

// A tensor-parallel group: every member holds a slice of every layer and the FIRST runs the
// decode loop (a pipeline ring's last stage does).
function tensor(p) { return p.parallel === "tensor"; }
function entry(p) { return tensor(p) ? p.ring[0] : p.ring[p.ring.length - 1]; }

// A model placed as several replicas: each replica drawn as a placement of its own.
function copies(placements) {
  return placements.flatMap((p) => {
    const extra = p.replicas || [];
    if (!extra.length) return [p];
    const of = extra.length + 1;
    return [{ ...p, replica: 1, of }, ...extra.map((r, i) => ({ ...r, model: p.model, replica: i + 2, of }))];
  });
}

function holdings(member, placements) {
  const tags = [];
  for (const p of placements) {
    const i = p.ring.indexOf(member.name);
    if (i < 0) continue;
    const [a, b] = p.layers[i];
    const stage = (member.stages || {})[p.model];
    const size = stage && stage.param_bytes ? `, ${bytes(stage.param_bytes)}` : "";
    const what = tensor(p) ? `rank ${i + 1}/${p.ring.length}, 1/${p.ring.length} of layers ${a}–${b - 1}`
      : p.ring.length > 1 ? `stage ${i + 1}/${p.ring.length}, layers ${a}–${b - 1}`
      : `layers ${a}–${b - 1}`;
    tags.push(el("span", { class: "tag", "data-holds": p.model }, `${p.model}: ${what}${size}`));
  }
  return tags.length ? tags : [el("span", { class: "muted", text: "nothing placed here" })];
}

function renderCluster(cluster) {
  const tbody = document.querySelector("#members tbody");
  const note = document.getElementById("cluster-note");
  if (!cluster) {
    note.hidden = false;
    note.textContent = "This node runs outside any cluster.";
    replace(tbody);
    return;
  }
  note.hidden = true;
  const placements = copies(cluster.placements || []);
  const rows = (cluster.members || []).map((m) => el("tr", { "data-member": m.name },
    el("td", {},
      m.name === cluster.leader ? el("span", { class: "leader-mark", title: "leader" }, "★ ") : null,
      el("b", { text: m.name }),
      m.name === cluster.node ? el("span", { class: "muted", text: " (this node)" }) : null),
    el("td", {}, el("span", { class: `badge ${m.state}`, "data-state": m.state, text: m.state })),
    el("td", { text: m.addr || "–" }),
    el("td", { text: m.http || "–" }),
    el("td", { text: bytes(m.memory) }),
    el("td", {}, (m.engines || []).map((e) => el("span", { class: "tag", text: e }))),
    el("td", { text: m.dtype || "–" }),
    el("td", {}, holdings(m, placements))));
  replace(tbody, rows);
}

function renderPlacements(cluster) {
  const box = document.getElementById("placements");
  const errs = document.getElementById("placement-errors");
  if (!cluster) { replace(box, el("p", { class: "muted", text: "–" })); replace(errs); return; }
  const placements = copies(cluster.placements || []);
  if (!placements.length) {
    replace(box, el("p", { class: "empty", text: "No model is placed yet." }));
  } else {
    replace(box, placements.map((p) => {
      const total = tensor(p) ? p.ring.length
        : p.layers.reduce((s, [a, b]) => s + (b - a), 0) || 1;
      const spans = p.ring.map((name, i) => {
        const [a, b] = p.layers[i];
        const need = Array.isArray(p.needs) && p.needs[i] ? `, needs ${bytes(p.needs[i])}` : "";
        const share = tensor(p) ? `1/${p.ring.length} of layers ${a}–${b - 1}`
          : `layers ${a}–${b - 1}`;
        const span = el("div", { class: `span c${i % 6}`, title: `${name}: ${share}${need}` },
          tensor(p) ? `${name} · 1/${p.ring.length}` : `${name} · ${a}–${b - 1}`);
        const width = tensor(p) ? 1 : b - a;
        span.style.flexGrow = String(width);
        span.style.flexBasis = `${(100 * width) / total}%`;
        return span;
      });
      const kind = (tensor(p) ? `tensor group of ${p.ring.length}`
        : p.ring.length > 1 ? `ring of ${p.ring.length}` : "one node")
        + (p.replica ? ` · replica ${p.replica} of ${p.of}` : "");
      const needs = Array.isArray(p.needs) ? p.needs.reduce((x, y) => x + y, 0) : p.needs;
      // which engine serves it, and why (its /v1/models entry)
      const m = state.models.find((x) => x.id === p.model);
      const eng = m && m.engine ? ` · ${m.engine === "llama_server" ? "llama-server" : "MLX"}` : "";
      return el("div", { class: "placement", "data-placement": p.model },
        el("div", {}, el("b", { text: p.model }),
          el("div", { class: "muted", text: kind + eng, title: (m && m.engine_reason) || "" })),
        el("div", { class: "ring" }, spans),
        el("div", {},
          "served by ", el("b", { "data-served-by": entry(p), text: entry(p) }),
          el("div", { class: "muted",
            text: `term ${p.term}${p.explicit ? " · placed by request" : ""}` +
              (needs ? ` · needs ${bytes(needs)}` : "") })));
    }));
  }
  replace(errs, (cluster.errors || []).map((e) => el("div", { class: "placement-error",
    text: `✗ ${e.error}` })));
}

// ---- models and requests -------------------------------------------------------------------

function kpi(label, value, cls) {
  return el("div", { class: `kpi ${cls || ""}` }, el("div", { class: "v", text: value }),
    el("div", { class: "k", text: label }));
}

function drafterText(s) {
  if (!s) return "none";
  const depth = s.max_depth ? `, k=${s.max_depth}` : "";
  return `${s.drafter} (${s.mode}${depth})`;
}

function perDrafter(s) {
  // Only worth a column when several drafters shared the request (auto: lookup + the head).
  if (!s || !s.by_drafter || Object.keys(s.by_drafter).length < 2) return "";
  return Object.entries(s.by_drafter)
    .map(([name, c]) => `${name} ${pct(c.acceptance)} (${c.accepted}/${c.drafted})`).join(" · ");
}

function gates(s) {
  if (!s || !s.gate_events || !s.gate_events.length) return "";
  return s.gate_events.map((g) => `${g.drafter ? g.drafter + " " : ""}${g.event}@${g.at_token}` +
    (g.reason ? ` (${g.reason})` : "")).join("; ");
}

function drafterTable(m) {
  const names = Object.keys(m.drafters || {});
  if (!names.length) return el("div", { class: "empty", text: "No drafter ran yet." });
  return el("table", { class: "drafters" },
    el("thead", {}, el("tr", {}, ["drafter", "rounds", "drafted", "accepted", "acceptance",
      "gate off / on"].map((h) => el("th", { text: h })))),
    el("tbody", {}, names.map((name) => {
      const d = m.drafters[name];
      return el("tr", { "data-drafter": name },
        el("td", {}, el("b", { text: name })), el("td", { text: d.rounds }),
        el("td", { text: d.drafted }), el("td", { text: d.accepted }),
        el("td", { class: "acceptance", "data-acceptance": d.acceptance,
          text: pct(d.acceptance) }),
        el("td", { text: `${d.gate_off} / ${d.gate_on}` }));
    })));
}

function recentTable(m, now) {
  if (!m.recent.length) return el("div", { class: "empty", text: "No request finished yet." });
  const rows = m.recent.slice(0, RECENT_ROWS).map((r) => {
    const s = r.speculation;
    return el("tr", { "data-request": r.id },
      el("td", { text: ago(now - r.finished) }),
      el("td", { text: `#${r.id}` }),
      el("td", {}, el("span", { class: `badge ${r.outcome}`, text: r.outcome })),
      el("td", { text: r.completion_tokens === undefined ? "–"
        : `${r.prompt_tokens} → ${r.completion_tokens}` }),
      el("td", { text: ms(r.ttft_s) }),
      el("td", { class: "tok-s", text: num(r.decode_tok_s) }),
      el("td", { class: "drafter", text: drafterText(s) }),
      el("td", { class: "acceptance", "data-acceptance": s ? s.acceptance : null,
        text: s ? `${pct(s.acceptance)} (${s.accepted}/${s.drafted})` : "–" }),
      el("td", { text: perDrafter(s) }),
      el("td", { class: "gates", text: gates(s) }));
  });
  return el("table", { class: "recent" },
    el("thead", {}, el("tr", {}, ["finished", "request", "outcome", "tokens in → out", "TTFT",
      "tok/s", "drafter", "acceptance", "per drafter", "gate events"].map((h) =>
      el("th", { text: h })))),
    el("tbody", {}, rows));
}

function inFlightTable(m) {
  if (!m.in_flight.length) return el("div", { class: "empty", text: "Nothing running." });
  return el("table", { class: "in-flight" },
    el("thead", {}, el("tr", {}, ["request", "running for", "prompt tokens", "tokens so far",
      "tok/s so far"].map((h) => el("th", { text: h })))),
    el("tbody", {}, m.in_flight.map((r) => el("tr", { "data-request": r.id },
      el("td", { text: `#${r.id}` }), el("td", { text: `${num(r.elapsed_s)} s` }),
      el("td", { text: r.prompt_tokens }),
      el("td", { text: r.tokens === null ? "–" : r.tokens }),
      el("td", { text: r.tokens && r.elapsed_s > 0 ? num(r.tokens / r.elapsed_s) : "–" })))));
}

function verifyCostsTable(m, now) {
  // The verify-cost table the model's engine measured where it runs (a tensor group's, on the
  // member running its loop): what one verify call of w rows costs, and relative to one row.
  const v = m.verify_costs;
  if (!v) return null;
  return el("div", { class: "verify-costs", "data-where": v.where },
    el("h4", { text: "verify cost by width" }),
    el("div", { class: "muted", text: `${v.where} · measured ${ago(now - v.measured_at)}` }),
    el("table", {},
      el("thead", {}, el("tr", {}, ["width (rows)", "ms per call", "relative to 1 row"]
        .map((h) => el("th", { text: h })))),
      el("tbody", {}, v.widths.map((w) => el("tr", { "data-width": w.width },
        el("td", { text: w.width }),
        el("td", { "data-seconds": w.seconds, text: num(1000 * w.seconds, 2) }),
        el("td", { "data-relative": w.relative, text: `${num(w.relative, 2)}×` }))))));
}

function modelCard(node, name, m, now, windowS) {
  const t = m.totals || {};
  const lastTokS = [...m.series].reverse().find((p) => p.tok_s !== null);
  const span = chartSpan(m.series, now, windowS);
  const canvas = el("canvas", { width: 520, height: 190, "aria-label":
    `acceptance and decode speed of ${name} over the last ${Math.round(span / 60)} minutes` });
  const card = el("div", { class: "model-card", "data-model": name, "data-node": node },
    el("div", { class: "model-head" },
      el("h3", {}, `${name} `, el("span", { class: "muted", text: `on ${node}` })),
      m.state ? el("span", { class: `badge ${m.state}`, text: m.state }) : null),
    el("div", { class: "kpis" },
      kpi("in flight", String(m.in_flight.length)),
      kpi("queued", m.waiting === undefined ? "–" : String(m.waiting)),
      kpi("requests", String(t.requests || 0)),
      kpi("tokens out", String(t.generated_tokens || 0)),
      kpi("acceptance", pct(t.acceptance), "acceptance-total"),
      kpi("last tok/s", lastTokS ? num(lastTokS.tok_s) : "–")),
    el("div", { class: "model-body" },
      el("div", { class: "chart-box" }, canvas,
        el("div", { class: "legend" },
          el("span", {}, el("span", { class: "sw speed" }), "decode tok/s (left)"),
          el("span", {}, el("span", { class: "sw accept" }), "acceptance % (right)"),
          el("span", { class: "muted", text: `last ${Math.round(span / 60)} min` }))),
      el("div", { class: "tables" },
        el("h4", { text: "acceptance by drafter" }), drafterTable(m),
        el("h4", { text: "in flight" }), inFlightTable(m),
        verifyCostsTable(m, now))),
    el("div", { class: "tables" },
      el("h4", { text: m.recent.length > RECENT_ROWS
        ? `recent (newest ${RECENT_ROWS} of ${m.recent.length})` : "recent" }),
      recentTable(m, now)));
  return { card, draw: () => drawChart(canvas, m.series, now, windowS) };
}

function renderModels(stats) {
  const box = document.getElementById("models");
  if (!stats) return;
  const nodes = stats.nodes || [stats];
  const cards = [];
  const draws = [];
  const quiet = [];
  for (const n of nodes) {
    if (n.error) {
      cards.push(el("div", { class: "placement-error", text: `${n.node}: ${n.error}` }));
      continue;
    }
    const names = Object.keys(n.models || {}).sort();
    if (!names.length) quiet.push(n.node);
    for (const name of names) {
      const { card, draw } = modelCard(n.node, name, n.models[name], n.time, n.window_s);
      cards.push(card);
      draws.push(draw);
    }
  }
  if (quiet.length) {
    cards.push(el("p", { class: "muted",
      text: `Serving no model here: ${quiet.join(", ")} (requests sent there are forwarded).` }));
  }
  if (!cards.length) cards.push(el("p", { class: "empty", text: "No model yet." }));
  replace(box, cards);
  draws.forEach((d) => d());
}

// ---- the chart: decode tok/s (left axis) and acceptance (right axis) over the window -------

function niceMax(v) {
  if (!(v > 0)) return 10;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function chartSpan(series, now, windowS) {
  // Zoom to the data: from its first point (at least 2 minutes) up to the whole window.
  const first = series.length ? series[0].t : now;
  return Math.min(windowS, Math.max(120, Math.ceil((now - first + 10) / 60) * 60));
}

function tickLabel(s) {
  if (s === 0) return "now";
  const m = Math.floor(s / 60);
  const r = Math.round(s % 60);
  return m ? `-${m}m${r ? r + "s" : ""}` : `-${r}s`;
}

function drawChart(canvas, series, now, windowS) {
  const dpr = window.devicePixelRatio || 1;
  const cssW = canvas.clientWidth || 520;
  const cssH = canvas.clientHeight || 190;
  canvas.width = Math.round(cssW * dpr);
  canvas.height = Math.round(cssH * dpr);
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, cssW, cssH);
  const css = getComputedStyle(document.documentElement);
  const speedColor = css.getPropertyValue("--speed").trim() || "#0f766e";
  const acceptColor = css.getPropertyValue("--accept").trim() || "#c2410c";
  const pad = { l: 44, r: 44, t: 10, b: 24 };
  const w = cssW - pad.l - pad.r;
  const h = cssH - pad.t - pad.b;
  const span = chartSpan(series, now, windowS);
  const t0 = now - span;
  const x = (t) => pad.l + ((t - t0) / span) * w;
  series = series.filter((p) => p.t >= t0);
  const speeds = series.filter((p) => p.tok_s !== null);
  const accepts = series.filter((p) => p.acceptance !== null);
  const maxSpeed = niceMax(Math.max(0, ...speeds.map((p) => p.tok_s)) * 1.1);
  const ySpeed = (v) => pad.t + h - (v / maxSpeed) * h;
  const yAccept = (v) => pad.t + h - v * h;

  g.font = "11px system-ui, sans-serif";
  g.lineWidth = 1;
  // grid and axes
  for (let i = 0; i <= 4; i++) {
    const y = pad.t + (h * i) / 4;
    g.strokeStyle = "#e5e7eb";
    g.beginPath(); g.moveTo(pad.l, y); g.lineTo(pad.l + w, y); g.stroke();
    g.fillStyle = speedColor;
    g.textAlign = "right"; g.textBaseline = "middle";
    g.fillText(String(+(maxSpeed * (1 - i / 4)).toFixed(1)), pad.l - 6, y);
    g.fillStyle = acceptColor;
    g.textAlign = "left";
    g.fillText(`${100 - 25 * i}%`, pad.l + w + 6, y);
  }
  g.fillStyle = "#6b7280";
  g.textAlign = "center"; g.textBaseline = "top";
  const step = [15, 30, 60, 120, 300, 600].find((s) => span / s <= 6) || 600;
  for (let s = 0; s <= span; s += step) {
    const xx = x(now - s);
    g.strokeStyle = "#f0f1f3";
    g.beginPath(); g.moveTo(xx, pad.t); g.lineTo(xx, pad.t + h); g.stroke();
    g.fillText(tickLabel(s), xx, pad.t + h + 6);
  }
  g.strokeStyle = "#9ca3af";
  g.strokeRect(pad.l, pad.t, w, h);

  const line = (points, y, color) => {
    if (!points.length) return;
    g.strokeStyle = color; g.fillStyle = color; g.lineWidth = 2;
    g.beginPath();
    points.forEach((p, i) => (i ? g.lineTo(x(p.t), y(p)) : g.moveTo(x(p.t), y(p))));
    g.stroke();
    for (const p of points) { g.beginPath(); g.arc(x(p.t), y(p), 3, 0, 2 * Math.PI); g.fill(); }
    g.lineWidth = 1;
  };
  line(speeds, (p) => ySpeed(p.tok_s), speedColor);
  line(accepts, (p) => yAccept(p.acceptance), acceptColor);
  if (!speeds.length && !accepts.length) {
    g.fillStyle = "#9ca3af"; g.textAlign = "center"; g.textBaseline = "middle";
    g.fillText("no finished request in this window", pad.l + w / 2, pad.t + h / 2);
  }
}

// ---- the try form --------------------------------------------------------------------------

function renderModelChoices(models) {
  const select = document.getElementById("try-model");
  const current = select.value;
  const ids = models.map((m) => m.id);
  if (ids.join("\n") === [...select.options].map((o) => o.value).join("\n")) return;
  replace(select, ids.map((id) => el("option", { value: id, text: id })));
  if (ids.includes(current)) select.value = current;
}

function speculationValue(v) {
  if (v === "auto" || v === "off") return v;
  const [drafter, depth] = v.split(":");
  return { drafter, depth: Number(depth) };
}

async function sendTry(ev) {
  ev.preventDefault();
  const button = document.getElementById("try-send");
  const out = document.getElementById("try-output");
  const info = document.getElementById("try-stats");
  const body = {
    model: document.getElementById("try-model").value || undefined,
    messages: [{ role: "user", content: document.getElementById("try-prompt").value }],
    max_tokens: Number(document.getElementById("try-max").value) || 64,
    temperature: Number(document.getElementById("try-temp").value) || 0,
    speculation: speculationValue(document.getElementById("try-spec").value),
    stream: true, stream_options: { include_usage: true },
  };
  button.disabled = true;
  out.textContent = "";
  info.textContent = "waiting for the first token…";
  try {
    const key = apiKey();
    const r = await fetch("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
      headers: withKey({ "Content-Type": "application/json", Accept: "text/event-stream" },
        key) });
    if (r.status === 401) askForKey(key);
    if (!r.ok) {
      let msg = `HTTP ${r.status}`;
      try { msg += `: ${(await r.json()).error.message}`; } catch (e) { /* not JSON */ }
      info.textContent = msg;
      return;
    }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    let extras = null;
    let usage = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) { info.textContent = `error: ${chunk.error.message}`; continue; }
          const c = chunk.choices && chunk.choices[0];
          if (c && c.delta && c.delta.content) out.textContent += c.delta.content;
          if (chunk.timing) extras = chunk;
          if (chunk.usage) usage = chunk.usage;
        }
      }
      if (out.textContent) info.textContent = "generating…";
    }
    const parts = [];
    if (usage) parts.push(`${usage.prompt_tokens} prompt → ${usage.completion_tokens} tokens`);
    if (extras && extras.timing) {
      parts.push(`TTFT ${ms(extras.timing.ttft_s)}`, `${num(extras.timing.decode_tok_s)} tok/s`);
    }
    if (extras && extras.speculation) {
      const s = extras.speculation;
      parts.push(`${s.drafter}: acceptance ${pct(s.acceptance)} (${s.accepted}/${s.drafted})`);
    }
    info.textContent = parts.join(" · ");
  } catch (e) {
    info.textContent = `failed: ${e}`;
  } finally {
    button.disabled = false;
    poll();
  }
}

// ---- polling -------------------------------------------------------------------------------

async function poll() {
  state.polls++;
  try {
    const [cl, st] = await Promise.all([getJSON("/v1/cluster"),
      getJSON("/v1/stats?scope=cluster")]);
    if (cl.status === 401 || st.status === 401) {
      const u = document.getElementById("updated");
      u.dataset.ok = "false";
      u.textContent = "waiting for an API key";
      return;
    }
    state.cluster = cl.ok ? cl.body : null;
    state.stats = st.ok ? st.body : null;
    if (state.polls % 5 === 1 || !state.models.length) {
      const got = await getJSON("/v1/models");
      if (got.ok && got.body) state.models = got.body.data || [];
    }
    renderHead(state.cluster, state.stats);
    renderCluster(state.cluster);
    renderPlacements(state.cluster);
    renderModels(state.stats);
    renderModelChoices(state.models);
    state.lastOk = Date.now();
    const u = document.getElementById("updated");
    u.dataset.ok = "true";
    u.textContent = `live · ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    const u = document.getElementById("updated");
    u.dataset.ok = "false";
    u.textContent = `cannot reach this node (${e.message || e})`;
  }
}

document.getElementById("try-form").addEventListener("submit", sendTry);
document.getElementById("key-form").addEventListener("submit", useKey);
poll();
setInterval(poll, POLL_MS);
