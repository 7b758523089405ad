/* The router's summary of its instances (/dashboard/summary, every SUMMARY_MS): one row
   per instance; clicking a row shows that instance's dashboard. */
"use strict";

const Summary = (() => {
  const SUMMARY_MS = 2000;
  let last = null;

  function cells(row) {
    const f = Duet.fmt, s = row.state || {}, rec = row.recent || {};
    const health = row.error ? "error" : row.draining ? "draining" : row.healthy ? "ok" : "down";
    return [
      Duet.el("td", { title: row.url }, Duet.el("span", { class: "dot " + (health === "ok" ? "ok" : "bad") }),
              " " + row.name),
      Duet.el("td", { text: row.role && row.role !== "both" ? row.role : row.kind }),
      Duet.el("td", { text: row.error ? row.error : health, title: row.last_error || "" }),
      Duet.el("td", { text: f.num(row.in_flight) }),
      Duet.el("td", { text: f.num(s.running) }),
      Duet.el("td", { text: f.num(s.waiting) }),
      Duet.el("td", { text: f.pct(s.kv_usage) }),
      Duet.el("td", { text: f.num(rec.prefill_tokens_per_s, 1) }),
      Duet.el("td", { text: f.num(rec.decode_tokens_per_s, 1) }),
      Duet.el("td", { text: f.ms(row.ttft ? row.ttft.p50 : null) }),
      Duet.el("td", { text: f.ms(row.tpot ? row.tpot.p50 : null) }),
      Duet.el("td", { class: "finished", text: f.num(row.finished) }),
    ];
  }

  function totals(rows) {
    const sum = (get) => rows.reduce((acc, r) => acc + (get(r) || 0), 0);
    const f = Duet.fmt;
    return Duet.el("tr", {}, Duet.el("td", { text: `all (${rows.length})` }), Duet.el("td"), Duet.el("td"),
      Duet.el("td", { text: f.num(sum((r) => r.in_flight)) }),
      Duet.el("td", { text: f.num(sum((r) => r.state && r.state.running)) }),
      Duet.el("td", { text: f.num(sum((r) => r.state && r.state.waiting)) }), Duet.el("td"),
      Duet.el("td", { text: f.num(sum((r) => r.recent && r.recent.prefill_tokens_per_s), 1) }),
      Duet.el("td", { text: f.num(sum((r) => r.recent && r.recent.decode_tokens_per_s), 1) }),
      Duet.el("td"), Duet.el("td"),
      Duet.el("td", { text: f.num(sum((r) => r.finished)) }));
  }

  function render(data, select, selected) {
    const table = document.getElementById("summary");
    table.tBodies[0].replaceChildren(...data.instances.map((row) => {
      const tr = Duet.el("tr", { "data-name": row.name, onclick: () => select(row.name) }, ...cells(row));
      tr.classList.toggle("on", row.name === selected());
      return tr;
    }));
    table.tFoot.replaceChildren(totals(data.instances));
    if (selected() === null) {
      const first = data.instances.find((r) => !r.error) || data.instances[0];
      if (first) select(first.name);
    }
  }

  async function poll(select, selected) {
    try {
      last = await Duet.getJSON("/dashboard/summary");
      render(last, select, selected);
    } catch (e) {
      document.getElementById("summary").tFoot.replaceChildren(
        Duet.el("tr", {}, Duet.el("td", { class: "error", colspan: "12", text: e.message })));
    }
  }

  function start(select, selected) {
    const loop = () => (document.hidden ? Promise.resolve() : poll(select, selected))
      .finally(() => setTimeout(loop, SUMMARY_MS));
    loop();
  }

  return { start, last: () => last };
})();
