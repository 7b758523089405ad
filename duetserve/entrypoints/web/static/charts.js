/* Small canvas charts drawn by hand (no library): time series, stacked bars, a log-log
   roofline and horizontal bars. Each call redraws the whole canvas. */
"use strict";

const Charts = (() => {
  const PAD = { l: 56, r: 18, t: 10, b: 24 };
  const TICKS = 5;          // grid intervals on a linear axis (niceMax divides by 5)

  function color(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
  }

  /* The canvas at its CSS size times the device pixel ratio, cleared. */
  function setup(canvas) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 400, h = canvas.clientHeight || 200;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    return { ctx, w, h };
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 5, 10]) if (m * p >= v * 0.999) return m * p;
    return 10 * p;
  }

  function message(canvas, text) {
    const { ctx, w, h } = setup(canvas);
    ctx.fillStyle = color("--muted");
    ctx.textAlign = "center";
    ctx.fillText(text, w / 2, h / 2);
  }

  /* Linear axes: y from 0 to yMax, x from xMin to xMax. Returns the mapping. */
  function linearFrame(ctx, w, h, o) {
    const X = (x) => PAD.l + (x - o.xMin) / (o.xMax - o.xMin || 1) * (w - PAD.l - PAD.r);
    const Y = (y) => h - PAD.b - y / o.yMax * (h - PAD.t - PAD.b);
    ctx.strokeStyle = color("--line");
    ctx.fillStyle = color("--muted");
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    // Counts below 5 (requests, rows) get one grid line per unit, not fractions.
    const ticks = Number.isInteger(o.yMax) && o.yMax < TICKS ? o.yMax : TICKS;
    for (let i = 0; i <= ticks; i++) {
      const y = o.yMax * i / ticks;
      ctx.beginPath(); ctx.moveTo(PAD.l, Y(y)); ctx.lineTo(w - PAD.r, Y(y)); ctx.stroke();
      ctx.fillText(o.yFmt ? o.yFmt(y) : String(y), PAD.l - 6, Y(y));
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (let i = 0; i <= 4; i++) {
      const x = o.xMin + (o.xMax - o.xMin) * i / 4;
      ctx.fillText(o.xFmt ? o.xFmt(x) : String(Math.round(x)), X(x), h - PAD.b + 5);
    }
    return { X, Y };
  }

  /* Lines over time: {xMin, xMax, yMax?, yFmt, xFmt, lines: [{color, points: [[x, y]],
     fill, dots}]} (dots: a dot per point, no line). yMax defaults to a round number above the data. */
  function series(canvas, o) {
    const { ctx, w, h } = setup(canvas);
    let top = 0;
    for (const l of o.lines) for (const p of l.points) top = Math.max(top, p[1]);
    const f = linearFrame(ctx, w, h, Object.assign({}, o, { yMax: o.yMax || niceMax(top) }));
    for (const l of o.lines) {
      if (!l.points.length) continue;
      if (l.dots) {                     // sparse samples: no line across the gaps
        ctx.fillStyle = l.color;
        for (const p of l.points) {
          ctx.beginPath(); ctx.arc(f.X(p[0]), f.Y(p[1]), 2.5, 0, 2 * Math.PI); ctx.fill();
        }
        continue;
      }
      ctx.strokeStyle = l.color;
      ctx.lineWidth = l.width || 1.6;
      ctx.beginPath();
      l.points.forEach((p, i) => (i ? ctx.lineTo(f.X(p[0]), f.Y(p[1])) : ctx.moveTo(f.X(p[0]), f.Y(p[1]))));
      ctx.stroke();
      if (l.fill) {
        ctx.lineTo(f.X(l.points[l.points.length - 1][0]), f.Y(0));
        ctx.lineTo(f.X(l.points[0][0]), f.Y(0));
        ctx.closePath();
        ctx.globalAlpha = 0.15;
        ctx.fillStyle = l.color;
        ctx.fill();
        ctx.globalAlpha = 1;
      }
    }
  }

  /* One stacked bar per entry: {bars: [[a, b, ...]], colors: [...], yFmt}. */
  function stackedBars(canvas, o) {
    const { ctx, w, h } = setup(canvas);
    const n = Math.max(o.slots || o.bars.length, 1);
    let top = 0;
    for (const b of o.bars) top = Math.max(top, b.reduce((s, v) => s + v, 0));
    const f = linearFrame(ctx, w, h, { xMin: 0, xMax: n, yMax: niceMax(top), yFmt: o.yFmt,
                                       xFmt: (x) => (x === n ? "now" : String(Math.round(x - n))) });
    const bw = Math.max(1, (w - PAD.l - PAD.r) / n - 1);
    const offset = n - o.bars.length;
    o.bars.forEach((b, i) => {
      let base = 0;
      b.forEach((v, k) => {
        if (v <= 0) return;
        ctx.fillStyle = o.colors[k];
        ctx.fillRect(f.X(offset + i), f.Y(base + v), bw, f.Y(base) - f.Y(base + v));
        base += v;
      });
    });
  }

  function decades(lo, hi) {
    const out = [];
    for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) out.push(Math.pow(10, e));
    return out;
  }

  /* Log-log roofline: {peak, bw, points: [{ai, fps, color, alpha}], markers: [{ai, fps,
     color, label}], yFmt}. The roof is min(peak, AI x bandwidth); dotted: the ridge. */
  function roofline(canvas, o) {
    const { ctx, w, h } = setup(canvas);
    const ridge = o.peak / o.bw;
    const all = o.points.concat(o.markers).filter((p) => p.ai > 0 && p.fps > 0);
    const xLo = Math.pow(10, Math.floor(Math.log10(Math.min(ridge / 100, ...all.map((p) => p.ai)))));
    const xHi = Math.pow(10, Math.ceil(Math.log10(Math.max(ridge * 10, ...all.map((p) => p.ai)))));
    const yHi = Math.pow(10, Math.ceil(Math.log10(o.peak * 1.5)));
    const yLo = Math.pow(10, Math.floor(Math.log10(Math.min(o.peak / 1e4, ...all.map((p) => p.fps)))));
    const L = Math.log10;
    const X = (x) => PAD.l + (L(x) - L(xLo)) / (L(xHi) - L(xLo)) * (w - PAD.l - PAD.r);
    const Y = (y) => h - PAD.b - (L(y) - L(yLo)) / (L(yHi) - L(yLo)) * (h - PAD.t - PAD.b);
    ctx.strokeStyle = color("--line");
    ctx.fillStyle = color("--muted");
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    for (const y of decades(yLo, yHi)) {
      ctx.beginPath(); ctx.moveTo(PAD.l, Y(y)); ctx.lineTo(w - PAD.r, Y(y)); ctx.stroke();
      ctx.fillText(o.yFmt ? o.yFmt(y) : String(y), PAD.l - 6, Y(y));
    }
    ctx.textAlign = "center"; ctx.textBaseline = "top";
    for (const x of decades(xLo, xHi)) {
      ctx.beginPath(); ctx.moveTo(X(x), PAD.t); ctx.lineTo(X(x), h - PAD.b); ctx.stroke();
      ctx.fillText(x >= 1 ? String(x) : x.toPrecision(1), X(x), h - PAD.b + 5);
    }
    ctx.strokeStyle = color("--text"); ctx.lineWidth = 2;
    ctx.beginPath(); ctx.moveTo(X(xLo), Y(xLo * o.bw)); ctx.lineTo(X(ridge), Y(o.peak));
    ctx.lineTo(X(xHi), Y(o.peak)); ctx.stroke();
    ctx.setLineDash([3, 4]); ctx.lineWidth = 1;
    ctx.beginPath(); ctx.moveTo(X(ridge), Y(o.peak)); ctx.lineTo(X(ridge), h - PAD.b); ctx.stroke();
    ctx.setLineDash([]);
    for (const p of o.points) {
      if (!(p.ai > 0 && p.fps > 0)) continue;
      ctx.globalAlpha = p.alpha ?? 0.5; ctx.fillStyle = p.color;
      ctx.beginPath(); ctx.arc(X(p.ai), Y(p.fps), 2.5, 0, 2 * Math.PI); ctx.fill();
    }
    ctx.globalAlpha = 1;
    ctx.textAlign = "left"; ctx.textBaseline = "bottom"; ctx.font = "bold 11px system-ui, sans-serif";
    for (const m of o.markers) {
      if (!(m.ai > 0 && m.fps > 0)) continue;
      ctx.fillStyle = m.color; ctx.strokeStyle = color("--panel"); ctx.lineWidth = 2;
      ctx.beginPath(); ctx.arc(X(m.ai), Y(m.fps), 6, 0, 2 * Math.PI); ctx.fill(); ctx.stroke();
      ctx.fillText(m.label, X(m.ai) + 8, Y(m.fps) - 4);
    }
    return { xLo, xHi, yLo, yHi };
  }

  /* Horizontal bars in [0, 1]: {labels, values, color}. */
  function hbars(canvas, o) {
    const { ctx, w, h } = setup(canvas);
    const n = o.values.length;
    const rowH = Math.min(26, (h - 8) / Math.max(n, 1));
    ctx.textBaseline = "middle";
    o.values.forEach((v, i) => {
      const y = 4 + i * rowH;
      ctx.fillStyle = color("--muted"); ctx.textAlign = "right";
      ctx.fillText(o.labels[i], PAD.l - 6, y + rowH / 2);
      ctx.fillStyle = color("--line");
      ctx.fillRect(PAD.l, y + 3, w - PAD.l - PAD.r - 50, rowH - 6);
      ctx.fillStyle = o.color;
      ctx.fillRect(PAD.l, y + 3, (w - PAD.l - PAD.r - 50) * Math.max(0, Math.min(1, v)), rowH - 6);
      ctx.fillStyle = color("--text"); ctx.textAlign = "left";
      ctx.fillText((v * 100).toFixed(0) + "%", w - PAD.r - 44, y + rowH / 2);
    });
  }

  return { color, setup, message, series, stackedBars, roofline, hbars, niceMax };
})();
