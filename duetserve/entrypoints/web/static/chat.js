/* The chat page: streams from /v1/chat/completions (or /v1/completions for a model
   without a chat template) and times each reply as a client sees it. */
"use strict";

const Chat = (() => {
  const $ = (id) => document.getElementById(id);
  const SETTINGS = ["mode", "system", "temperature", "top_p", "max_tokens", "seed", "stop",
                    "schema"];
  const state = { history: [], info: null, model: null, busy: false, controller: null };

  function loadSettings() {
    for (const id of SETTINGS) {
      const saved = localStorage.getItem("duet-chat-" + id);
      if (saved !== null) $(id).value = saved;
      $(id).addEventListener("change", () => {
        localStorage.setItem("duet-chat-" + id, $(id).value);
        if (id === "mode") updateModeNote();
        if (id === "schema") checkSchema();
      });
    }
  }

  async function loadInfo() {
    try {
      state.info = await Duet.getJSON("/ui/info");
      state.model = state.info.model;
    } catch (e) {
      try {     // an older server or a proxy: the model list is enough to chat
        const models = await Duet.getJSON("/v1/models");
        state.model = models.data[0].id;
      } catch (e2) {
        $("model-name").textContent = e2.status === 401
          ? "this server needs an API key: enter it at the top right"
          : "server unreachable: " + e2.message;
        return;
      }
    }
    $("model-name").textContent = state.model + (state.info && state.info.router ? " (router)" : "");
    updateModeNote();
  }

  function effectiveMode() {
    const chosen = $("mode").value;
    if (chosen !== "auto") return chosen;
    return state.info && state.info.has_chat_template === false ? "completion" : "chat";
  }

  function updateModeNote() {
    const noTemplate = state.info && state.info.has_chat_template === false;
    let note = effectiveMode() === "chat"
      ? "Messages go to /v1/chat/completions through the model's chat template."
      : "Messages go to /v1/completions as a plain transcript (User: … / Assistant:), " +
        "stopping at the next \"User:\".";
    if (noTemplate) note = "This model has no chat template. " + note;
    $("mode-note").textContent = note;
  }

  function parseStops() {
    return $("stop").value.split("\n").map((s) => s.replace(/\\n/g, "\n").replace(/\\t/g, "\t"))
      .filter((s) => s.length > 0);
  }

  /* The schema box as an object, null when empty; throws with the parser's message. */
  function parseSchema() {
    const text = $("schema").value.trim();
    if (!text) return null;
    let schema;
    try { schema = JSON.parse(text); } catch (e) { throw new Error("JSON schema: " + e.message); }
    if (typeof schema !== "object" || schema === null || Array.isArray(schema)) {
      throw new Error("JSON schema: must be a JSON object");
    }
    return schema;
  }

  function checkSchema() {
    try { parseSchema(); $("schema-error").textContent = ""; return true; }
    catch (e) { $("schema-error").textContent = e.message; return false; }
  }

  function transcript() {
    const system = $("system").value.trim();
    let text = system ? system + "\n\n" : "";
    for (const m of state.history) {
      text += (m.role === "user" ? "User: " : "Assistant: ") + m.content + "\n";
    }
    return text + "Assistant:";
  }

  /* [url, body] of the request for the conversation so far. */
  function buildRequest(mode) {
    const body = { model: state.model, stream: true, stream_options: { include_usage: true } };
    const num = (id, parse) => { const v = $(id).value.trim(); return v === "" ? null : parse(v); };
    for (const [id, parse] of [["temperature", parseFloat], ["top_p", parseFloat],
                               ["max_tokens", (v) => parseInt(v, 10)],
                               ["seed", (v) => parseInt(v, 10)]]) {
      const v = num(id, parse);
      if (v !== null && !Number.isNaN(v)) body[id] = v;
    }
    const stops = parseStops();
    const schema = parseSchema();
    if (schema) {
      body.response_format = { type: "json_schema",
                               json_schema: { name: "playground", schema: schema } };
    }
    if (mode === "chat") {
      const system = $("system").value.trim();
      body.messages = (system ? [{ role: "system", content: system }] : []).concat(state.history);
      if (stops.length) body.stop = stops;
      return ["/v1/chat/completions", body];
    }
    body.prompt = transcript();
    body.stop = stops.concat(["\nUser:"]);
    return ["/v1/completions", body];
  }

  function addMessage(role, text) {
    const empty = $("empty");
    if (empty) empty.remove();
    const who = { user: "you", assistant: state.model || "assistant", system: "system" }[role];
    const body = Duet.el("div", { class: "body", text: text });
    const stats = Duet.el("div", { class: "stats" });
    const wrap = Duet.el("div", { class: "msg " + role }, Duet.el("div", { class: "who", text: who }),
                         body, stats);
    $("messages").append(wrap);
    $("messages").scrollTop = $("messages").scrollHeight;
    return { wrap, body, stats };
  }

  /* Reads an SSE stream of OpenAI chunks into reply.body; returns the timings. */
  async function stream(url, body, reply, signal) {
    const t0 = performance.now();
    const r = await fetch(url, { method: "POST", body: JSON.stringify(body), signal,
                                 headers: Duet.headers({ "Content-Type": "application/json" }) });
    if (!r.ok) {
      if (r.status === 401) Duet.showKeyBox();
      throw new Duet.HttpError(r.status, await Duet.errorOf(r));
    }
    const out = { text: "", chunks: 0, t0, tFirst: null, tLast: null, usage: null, finish: null };
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, nl).replace(/\r$/, "");
        buffer = buffer.slice(nl + 1);
        if (line.startsWith("data:")) onEvent(line.slice(5).trim(), out, reply);
      }
    }
    return out;
  }

  function onEvent(data, out, reply) {
    if (data === "[DONE]" || data === "") return;
    const ev = JSON.parse(data);
    if (ev.error) throw new Error(ev.error.message || JSON.stringify(ev.error));
    if (ev.usage) out.usage = ev.usage;
    for (const choice of ev.choices || []) {
      const piece = choice.delta ? (choice.delta.content || "") : (choice.text || "");
      if (piece) {
        const now = performance.now();
        if (out.tFirst === null) out.tFirst = now;
        out.tLast = now;
        out.text += piece;
        out.chunks += 1;
        reply.body.textContent = out.text;
        $("messages").scrollTop = $("messages").scrollHeight;
      }
      if (choice.finish_reason) out.finish = choice.finish_reason;
    }
  }

  /* The reply's stats line (and its data-* attributes, in ms and tokens). */
  function showStats(reply, out, note) {
    const tokens = out.usage ? out.usage.completion_tokens : out.chunks;
    const ttft = out.tFirst === null ? null : out.tFirst - out.t0;
    const decodeMs = out.tFirst === null ? 0 : out.tLast - out.tFirst;
    const tpot = tokens > 1 && decodeMs > 0 ? decodeMs / (tokens - 1) : null;
    const tps = tpot ? 1000 / tpot : null;
    const d = reply.stats.dataset;
    d.ttftMs = ttft ?? ""; d.tpotMs = tpot ?? ""; d.tps = tps ?? "";
    d.tokens = tokens; d.chunks = out.chunks; d.finish = out.finish || "";
    const part = (label, value) => [Duet.el("span", { text: label + " " }),
                                    Duet.el("b", { text: value }), Duet.el("span", { text: " · " })];
    reply.stats.replaceChildren(
      ...part("TTFT", ttft === null ? "–" : ttft.toFixed(0) + " ms"),
      ...part("TPOT", tpot === null ? "–" : tpot.toFixed(1) + " ms"),
      ...part("", tps === null ? "–" : tps.toFixed(1) + " tok/s"),
      Duet.el("span", { text: `${tokens} tokens${out.usage ? ` (prompt ${out.usage.prompt_tokens})` : ""}` +
                              (out.finish ? ` · ${out.finish}` : "") + (note ? ` · ${note}` : "") }));
  }

  function markJSON(reply, text) {
    let ok = true;
    try { JSON.parse(text); } catch (e) { ok = false; }
    reply.stats.append(Duet.el("span", { class: "badge", text: ok ? "valid JSON" : "not valid JSON" }));
    reply.stats.dataset.json = ok ? "valid" : "invalid";
  }

  function setBusy(busy) {
    state.busy = busy;
    $("send").disabled = busy;
    $("stop-btn").hidden = !busy;
  }

  async function send(text) {
    if (state.busy || !text.trim() || !checkSchema()) return;
    state.history.push({ role: "user", content: text });
    addMessage("user", text);
    const reply = addMessage("assistant", "");
    setBusy(true);
    state.controller = new AbortController();
    let mode = effectiveMode();
    let note = "";
    try {
      let out;
      try {
        out = await stream(...buildRequest(mode), reply, state.controller.signal);
      } catch (e) {
        if (!(e.status === 400 && mode === "chat" && $("mode").value === "auto" &&
              /chat template/i.test(e.message))) throw e;
        // The server says the model has no chat template: continue as completions.
        state.info = Object.assign({}, state.info || {}, { has_chat_template: false });
        updateModeNote();
        mode = "completion";
        note = "no chat template: sent to /v1/completions";
        out = await stream(...buildRequest(mode), reply, state.controller.signal);
      }
      const content = mode === "completion" ? out.text.trim() : out.text;
      state.history.push({ role: "assistant", content });
      showStats(reply, out, note);
      if ($("schema").value.trim()) markJSON(reply, out.text);
    } catch (e) {
      state.history.pop();     // the turn failed: it is not part of the conversation
      if (e.name === "AbortError") {
        reply.stats.textContent = "stopped";
      } else {
        reply.body.classList.add("err");
        reply.body.textContent = (e.status ? `${e.status}: ` : "") + e.message;
        reply.stats.dataset.error = String(e.status || "error");
      }
    } finally {
      setBusy(false);
      state.controller = null;
    }
  }

  function setup() {
    loadSettings();
    $("composer").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const text = $("input").value;
      $("input").value = "";
      send(text);
    });
    $("input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
    });
    $("stop-btn").addEventListener("click", () => state.controller && state.controller.abort());
    $("clear").addEventListener("click", () => {
      state.history = [];
      $("messages").replaceChildren(Duet.el("p", { class: "empty", id: "empty", text: "New conversation." }));
    });
    checkSchema();
    loadInfo();
  }

  setup();
  return { state, send, effectiveMode };
})();
