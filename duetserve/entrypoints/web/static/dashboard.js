/* The dashboard: polls the engine's own step records (/dashboard/data?since=SEQ, or the
   router's /dashboard/instance proxy), keeps the last WINDOW_S seconds of steps, and
   redraws the tiles and charts after each poll. */
"use strict";

const Dash = (() => {
  const $ = (id) => document.getElementById(id);
  const D = window.DUET || {};
  const WINDOW_S = 120, MAX_STEPS = 6000, POLL_MS = 1000;
  const store = { since: 0, rows: [], idx: null, last: null, info: null, instance: null,
                  polls: 0, error: null };
  let chain = Promise.resolve();

  function reset() {
    store.since = 0; store.rows = []; store.last = null; store.info = null;
  }

  function dataUrl() {
    if (D.router) {
      return `/dashboard/instance?name=${encodeURIComponent(store.instance)}&since=${store.since}`;
    }
    return `/dashboard/data?since=${store.since}`;
  }

  async function poll() {
    if (D.router && store.instance === null) return null;
    const instance = store.instance;
    let data = await Duet.getJSON(dataUrl());
    if (instance !== store.instance) return null;       // switched while in flight
    if (data.seq < store.since) {                         // the server restarted
      reset();
      data = await Duet.getJSON(dataUrl());
    }
    if (!store.idx) store.idx = Object.fromEntries(data.fields.map((f, i) => [f, i]));
    for (const r of data.steps) store.rows.push(r);
    const t = store.idx.t, cutoff = data.now - WINDOW_S;
    let drop = 0;
    while (drop < store.rows.length && (store.rows[drop][t] < cutoff ||
           store.rows.length - drop > MAX_STEPS)) drop++;
    if (drop) store.rows.splice(0, drop);
    store.since = data.seq; store.last = data; store.info = data.info; store.polls += 1;
    render(data);
    return data;
  }

  /* A poll that starts after every earlier one ended (the timer and callers share it). */
  function refresh() {
    const p = chain.then(poll);
    chain = p.then(() => setStatus(null), (e) => setStatus(e)).catch(() => {});
    return p;
  }

  /* refresh() for the page's own callers: a failed poll shows in the status line (not as an
     unhandled rejection in the console). */
  const tick = () => refresh().catch(() => null);

  function setStatus(error) {
    store.error = error ? error.message : null;
    $("status-dot").className = "dot " + (error ? "bad" : "ok");
    $("status").textContent = error ? "error: " + error.message
      : `live · ${store.rows.length} steps in view (recorded while this page is open)`;
  }

  /* Polls every POLL_MS while the page is visible; a hidden tab asks nothing (and after
     30 s the server stops recording steps), and polls again as soon as it is shown. */
  function loop() {
    if (document.hidden) { setTimeout(loop, POLL_MS); return; }
    tick().finally(() => setTimeout(loop, POLL_MS));
  }

  const col = (row, name) => row[store.idx[name]];
  const phaseOf = (row) => (col(row, "decode_tokens") === 0 ? "prefill"
                           : col(row, "prefill_tokens") === 0 ? "decode" : "mixed");
  const PHASE_COLOR = { prefill: "--prefill", decode: "--decode", mixed: "--mixed" };

  function render(data) {
    renderHeader(data.info);
    renderTiles(data);
    renderLatency(data.requests);
    const now = data.now;
    renderTokens(now);
    renderSteps();
    renderRoofline(data.info.hardware);
    renderKV(now);
    renderQueue(now);
    renderSpec(data, now);
    renderTransfers(data, now);
  }

  function renderHeader(info) {
    $("model-name").textContent = info.model + (D.router ? ` @ ${store.instance}` : "") +
      (info.role !== "both" ? ` (${info.role})` : "");
    const hw = info.hardware;
    $("hw-note").textContent = `Roofline ceilings: ${hw.name}, ${hw.compute_dtype} peak ` +
      `${Duet.fmt.si(hw.peak_flops, "FLOP/s")}, memory ${Duet.fmt.si(hw.mem_bandwidth, "B/s")}, ` +
      `ridge ${hw.ridge.toFixed(1)} FLOP/byte (${hw.measured ? "measured by duet roofline --measure"
      : "not measured: run duet roofline --measure"}).`;
  }

  function renderTiles(data) {
    const f = Duet.fmt, set = Duet.setValue, s = data.state, r = data.requests;
    const tot = data.totals;
    set("v-prefill-tps", data.recent.prefill_tokens_per_s, f.num(data.recent.prefill_tokens_per_s, 1));
    set("v-decode-tps", data.recent.decode_tokens_per_s, f.num(data.recent.decode_tokens_per_s, 1));
    set("v-running", s.running, f.num(s.running));
    set("v-waiting", s.waiting, f.num(s.waiting));
    set("v-preemptions", s.preemptions, f.num(s.preemptions));
    set("v-kv", s.kv_usage, f.pct(s.kv_usage));
    set("v-kv-blocks", s.used_blocks, f.num(s.used_blocks));
    set("v-num-blocks", data.info.num_blocks, f.num(data.info.num_blocks));
    const hit = s.prefix_queries ? s.prefix_hits / s.prefix_queries : null;
    set("v-hit-rate", hit, f.pct(hit));
    set("v-prefix-hits", s.prefix_hits, f.num(s.prefix_hits));
    set("v-prefix-queries", s.prefix_queries, f.num(s.prefix_queries));
    for (const k of ["ttft", "tpot"]) {
      for (const q of ["p50", "p90", "p99"]) set(`v-${k}-${q}`, r[k][q], f.ms(r[k][q]));
    }
    const spec = s.spec;
    const acc = spec && spec.draft_tokens ? spec.accepted_tokens / spec.draft_tokens : null;
    set("v-accept", acc, spec ? f.pct(acc) : "off");
    set("v-accepted", spec ? spec.accepted_tokens : null, spec ? f.num(spec.accepted_tokens) : "–");
    set("v-draft-tokens", spec ? spec.draft_tokens : null, spec ? f.num(spec.draft_tokens) : "–");
    set("v-finished", r.finished, f.num(r.finished));
    set("v-gen-tokens", r.generation_tokens, f.num(r.generation_tokens));
    set("v-prompt-tokens", r.prompt_tokens, f.num(r.prompt_tokens));
    set("v-steps", tot.all.steps, f.num(tot.all.steps));
    set("v-tokens", tot.all.tokens, f.num(tot.all.tokens));
    set("v-mfu-prefill", tot.prefill.time_weighted_mfu, f.pct(tot.prefill.time_weighted_mfu, 2));
    set("v-mbu-decode", tot.decode.time_weighted_mbu, f.pct(tot.decode.time_weighted_mbu, 2));
  }

  function renderLatency(r) {
    const rows = [["TTFT", "ttft"], ["TPOT", "tpot"], ["end to end", "e2e"], ["queue", "queue"]];
    $("latency").tBodies[0].replaceChildren(...rows.map(([label, k]) => Duet.el("tr", {},
      Duet.el("td", { text: label }),
      ...["p50", "p90", "p99", "mean"].map((q) => Duet.el("td", { id: `lat-${k}-${q}`, text: Duet.fmt.ms(r[k][q]) })),
      Duet.el("td", { text: String(r[k].n) }))));
    $("n-latency").textContent = `requests ended in the last ${r.window_s} s`;
  }

  /* Whole seconds before the current one (-1: the last complete second); fixed
     boundaries, so a second's sum does not change from one poll to the next. */
  const secondOf = (t, now) => Math.floor(t) - Math.floor(now);

  /* Per-second sums over the window: {second: {key: sum}} from the step rows. */
  function perSecond(keys, now) {
    const out = new Map();
    for (const row of store.rows) {
      const sec = secondOf(col(row, "t"), now);
      let b = out.get(sec);
      if (!b) { b = {}; for (const k of keys) b[k] = 0; out.set(sec, b); }
      for (const k of keys) b[k] += col(row, k);
    }
    return out;
  }

  /* Per-second deltas of cumulative columns (a step's delta against the step before). */
  function perSecondDeltas(keys, now) {
    const out = new Map();
    for (let i = 1; i < store.rows.length; i++) {
      const row = store.rows[i], prev = store.rows[i - 1];
      const sec = secondOf(col(row, "t"), now);
      let b = out.get(sec);
      if (!b) { b = {}; for (const k of keys) b[k] = 0; out.set(sec, b); }
      for (const k of keys) b[k] += Math.max(0, col(row, k) - col(prev, k));
    }
    return out;
  }

  function timeAxis() {
    return { xMin: -WINDOW_S, xMax: 0, xFmt: (x) => (x === 0 ? "now" : `${Math.round(x)} s`) };
  }

  function renderTokens(now) {
    const c = $("c-tps");
    if (!store.rows.length) return Charts.message(c, "no steps yet: send a request");
    const sums = perSecond(["prefill_tokens", "decode_tokens"], now);
    const first = secondOf(col(store.rows[0], "t"), now);
    const pre = [], dec = [];
    for (let s = Math.max(first, -WINDOW_S); s < 0; s++) {     // complete seconds only
      const b = sums.get(s) || { prefill_tokens: 0, decode_tokens: 0 };
      pre.push([s + 1, b.prefill_tokens]);
      dec.push([s + 1, b.decode_tokens]);
    }
    Charts.series(c, Object.assign(timeAxis(), { yFmt: (y) => Duet.fmt.si(y, "", 0),
      lines: [{ color: Charts.color("--prefill"), points: pre, fill: true },
              { color: Charts.color("--decode"), points: dec, fill: true }] }));
  }

  function renderSteps() {
    const c = $("c-steps");
    if (!store.rows.length) return Charts.message(c, "no steps yet");
    const last = store.rows.slice(-120);
    const bars = last.map((r) => {
      const decodeRows = col(r, "decode_rows");
      return [Math.max(0, col(r, "rows") - decodeRows), decodeRows];
    });
    Charts.stackedBars(c, { bars, slots: 120, colors: [Charts.color("--prefill"), Charts.color("--decode")],
                            yFmt: (y) => String(Math.round(y)) });
    const n = { prefill: 0, decode: 0, mixed: 0 };
    for (const r of store.rows) n[phaseOf(r)] += 1;
    $("n-phases").textContent = `in the window: ${n.prefill} prefill, ${n.decode} decode, ${n.mixed} mixed steps`;
  }

  function renderRoofline(hw) {
    const c = $("c-roof");
    const rows = store.rows.slice(-600);
    const points = rows.map((r, i) => ({ ai: col(r, "ai"), fps: col(r, "flops_per_s"),
      color: Charts.color(PHASE_COLOR[phaseOf(r)]), alpha: 0.15 + 0.6 * i / Math.max(rows.length, 1) }));
    const markers = [];
    const latest = (pred) => { for (let i = rows.length - 1; i >= 0; i--) if (pred(rows[i])) return rows[i]; return null; };
    const pre = latest((r) => col(r, "prefill_tokens") > 0);
    const dec = latest((r) => phaseOf(r) === "decode");
    const notes = [];
    for (const [row, label] of [[pre, pre && phaseOf(pre)], [dec, "decode"]]) {
      if (!row) continue;
      markers.push({ ai: col(row, "ai"), fps: col(row, "flops_per_s"), label,
                     color: Charts.color(PHASE_COLOR[phaseOf(row)]) });
      notes.push(`latest ${label}: AI ${col(row, "ai").toFixed(1)}, MFU ${Duet.fmt.pct(col(row, "mfu"), 2)}, ` +
                 `MBU ${Duet.fmt.pct(col(row, "mbu"), 1)}`);
    }
    $("n-roof").textContent = notes.join(" · ") || "no steps yet";
    Charts.roofline(c, { peak: hw.peak_flops, bw: hw.mem_bandwidth, points, markers,
                         yFmt: (y) => Duet.fmt.si(y, "", 0) });
  }

  function renderKV(now) {
    const c = $("c-kv");
    if (!store.rows.length) return Charts.message(c, "no steps yet");
    const kv = store.rows.map((r) => [col(r, "t") - now, 100 * col(r, "kv_usage")]);
    const deltas = perSecondDeltas(["prefix_queries", "prefix_hits"], now);
    const hits = [...deltas.entries()].filter(([, b]) => b.prefix_queries > 0)
      .sort((a, b) => a[0] - b[0]).map(([s, b]) => [s + 0.5, 100 * b.prefix_hits / b.prefix_queries]);
    Charts.series(c, Object.assign(timeAxis(), { yMax: 100, yFmt: (y) => `${y}%`,
      lines: [{ color: Charts.color("--accent"), points: kv, fill: true },
              { color: Charts.color("--ok"), points: hits, dots: true }] }));
  }

  function renderQueue(now) {
    const c = $("c-queue");
    if (!store.rows.length) return Charts.message(c, "no steps yet");
    Charts.series(c, Object.assign(timeAxis(), { yFmt: (y) => String(Math.round(y * 10) / 10),
      lines: [{ color: Charts.color("--decode"), points: store.rows.map((r) => [col(r, "t") - now, col(r, "running")]) },
              { color: Charts.color("--bad"), points: store.rows.map((r) => [col(r, "t") - now, col(r, "waiting")]) }] }));
  }

  function renderSpec(data, now) {
    const c = $("c-spec"), spec = data.state.spec;
    c.classList.toggle("hidden", !spec);
    if (!spec) {
      $("n-spec").textContent = "off on this instance (duet serve --speculative-config ...)";
      return;
    }
    const perPos = spec.accepted_per_pos.map((n) => (spec.drafts ? n / spec.drafts : 0));
    $("n-spec").textContent = `acceptance rate per second (dots); since start, by draft position: ` +
      perPos.map((v, j) => `#${j + 1} ${Duet.fmt.pct(v, 0)}`).join(", ");
    const deltas = perSecondDeltas(["spec_draft_tokens", "spec_accepted"], now);
    const pts = [...deltas.entries()].filter(([, b]) => b.spec_draft_tokens > 0)
      .sort((a, b) => a[0] - b[0]).map(([s, b]) => [s + 0.5, 100 * b.spec_accepted / b.spec_draft_tokens]);
    Charts.series(c, Object.assign(timeAxis(), { yMax: 100, yFmt: (y) => `${y}%`,
      lines: [{ color: Charts.color("--ok"), points: pts, dots: true }] }));
  }

  function renderTransfers(data, now) {
    const card = $("transfers-card");
    card.classList.toggle("hidden", data.info.role === "both");
    if (data.info.role === "both") return;
    const t = data.transfers;
    const counts = Object.entries(t.counts).map(([k, n]) => `${k} ${n}`).join(", ") || "none yet";
    $("n-transfers").textContent = `${data.info.role} instance · ended: ${counts} · read ` +
      `${Duet.fmt.si(t.bytes, "B")} in ${t.seconds.toFixed(2)} s · held now ${data.held_transfers}`;
    const c = $("c-xfer");
    if (!t.recent.length) return Charts.message(c, "no KV reads in the last minute");
    const per = new Map();
    for (const r of t.recent) {
      const s = secondOf(r[0], now);
      per.set(s, (per.get(s) || 0) + r[2]);
    }
    const pts = [...per.entries()].sort((a, b) => a[0] - b[0]).map(([s, b]) => [s + 0.5, b]);
    Charts.series(c, { xMin: -t.window_s, xMax: 0, xFmt: (x) => `${Math.round(x)} s`,
      yFmt: (y) => Duet.fmt.si(y, "B/s", 0), lines: [{ color: Charts.color("--accent"), points: pts }] });
  }

  function select(name) {
    if (store.instance === name) return;
    store.instance = name;
    reset();
    for (const tr of document.querySelectorAll("#summary tbody tr")) {
      tr.classList.toggle("on", tr.dataset.name === name);
    }
    tick();
  }

  function start() {
    if (D.router) {
      $("summary-card").classList.remove("hidden");
      Summary.start(select, () => store.instance);
    }
    loop();
    window.addEventListener("resize", () => store.last && render(store.last));
    document.addEventListener("visibilitychange", () => { if (!document.hidden) tick(); });
  }

  start();
  return { store, refresh, select };
})();
