/* Shared by the pages: the API key, JSON requests, number formats, the header. */
"use strict";

const Duet = (() => {
  const KEY = "duet-api-key";

  class HttpError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  function apiKey() { return localStorage.getItem(KEY) || ""; }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = apiKey();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  /* The server's error message from an OpenAI-style body, else the status line. */
  async function errorOf(r) {
    let text = "";
    try { text = await r.text(); } catch (e) { /* body gone */ }
    try {
      const body = JSON.parse(text);
      if (body && body.error && body.error.message) return body.error.message;
    } catch (e) { /* not JSON */ }
    return `HTTP ${r.status} ${r.statusText}${text ? ": " + text.slice(0, 300) : ""}`;
  }

  async function getJSON(path) {
    const r = await fetch(path, { headers: headers(), cache: "no-store" });
    if (!r.ok) {
      if (r.status === 401) showKeyBox();
      throw new HttpError(r.status, await errorOf(r));
    }
    return r.json();
  }

  function showKeyBox() {
    const box = document.getElementById("key-box");
    if (box) box.hidden = false;
  }

  function setupHeader() {
    const box = document.getElementById("key-box");
    const input = document.getElementById("api-key");
    if (!box || !input) return;
    input.value = apiKey();
    if (apiKey()) box.hidden = false;
    input.addEventListener("change", () => {
      localStorage.setItem(KEY, input.value.trim());
      location.reload();
    });
  }

  /* Numbers: SI prefixes, fixed decimals, durations in ms, percentages. */
  const fmt = {
    num(x, digits) {
      if (x === null || x === undefined || Number.isNaN(x)) return "–";
      return Number(x).toLocaleString("en-US", { maximumFractionDigits: digits ?? 0 });
    },
    fixed(x, digits) {
      if (x === null || x === undefined || !Number.isFinite(x)) return "–";
      return Number(x).toFixed(digits);
    },
    si(x, unit, digits) {
      if (x === null || x === undefined || !Number.isFinite(x)) return "–";
      const prefixes = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
      for (const [v, p] of prefixes) {
        if (Math.abs(x) >= v) return (x / v).toFixed(digits ?? 1) + " " + p + (unit || "");
      }
      return x.toFixed(digits ?? 1) + (unit ? " " + unit : "");
    },
    ms(seconds) {
      if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
      const ms = seconds * 1000;
      return ms >= 100 ? ms.toFixed(0) + " ms" : ms.toFixed(1) + " ms";
    },
    pct(x, digits) {
      if (x === null || x === undefined || !Number.isFinite(x)) return "–";
      return (x * 100).toFixed(digits ?? 1) + "%";
    },
  };

  /* A DOM element: el("div", {class: "x", text: "..."}, child, ...). */
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null) continue;
      if (k === "text") e.textContent = v;
      else if (k === "class") e.className = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v);
    }
    for (const c of children) if (c !== null && c !== undefined) e.append(c);
    return e;
  }

  /* Sets an element's text and its data-value (the raw number, for tests and tools). */
  function setValue(id, value, text) {
    const e = document.getElementById(id);
    if (!e) return;
    e.textContent = text;
    e.dataset.value = value === null || value === undefined ? "" : String(value);
  }

  document.addEventListener("DOMContentLoaded", setupHeader);
  return { HttpError, apiKey, headers, errorOf, getJSON, showKeyBox, fmt, el, setValue };
})();
