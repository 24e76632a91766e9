// distdebug HTML report: draws the plots from the inline DATA object (no network, no library).
// Every plot records how many marks it drew in data-drawn, so a headless browser can check that
// the page really drew something; a plot that fails says so in its box and on the console.
"use strict";
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const SEV = { critical: "#9b1c1c", error: "#e02424", warning: "#d97706", info: "#3f83f8" };
  const PALETTE = ["#1a56db", "#e3a008", "#0e9f6e", "#e02424", "#7e3af2", "#ff5a1f", "#0694a2", "#d61f69",
    "#6b7280", "#8da2fb", "#31c48d", "#f98080", "#ac94fa", "#faca15", "#16bdca", "#f17eb8"];
  const MEM_COLORS = ["#1a56db", "#0e9f6e", "#e3a008", "#7e3af2", "#9ca3af"];
  const W = 640, H = 260, M = { l: 64, r: 16, t: 12, b: 36 };

  function el(tag, attrs, parent, text) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function title(e, text) { el("title", {}, e, text); return e; }
  function finite(v) { return v !== null && v !== undefined && Number.isFinite(v); }
  function fmt(v) {
    if (!finite(v)) return String(v);
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
    return Number(v.toPrecision(4)).toString();
  }
  function bytes(v) {
    const u = ["B", "KB", "MB", "GB", "TB"]; let i = 0;
    while (Math.abs(v) >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return v.toFixed(v >= 100 || i === 0 ? 0 : 1) + " " + u[i];
  }
  function svgBox(box, w, h) {
    const s = el("svg", { width: w, height: h, viewBox: `0 0 ${w} ${h}`, role: "img" }, box);
    return s;
  }
  function scale(d0, d1, r0, r1, log) {
    if (log) { d0 = Math.log10(d0); d1 = Math.log10(d1); }
    if (d1 === d0) { d1 = d0 + 1; d0 = d0 - 1; }
    const f = (v) => r0 + ((log ? Math.log10(v) : v) - d0) / (d1 - d0) * (r1 - r0);
    return f;
  }
  function ticks(lo, hi, n, log, integer) {
    if (log) {
      const out = [];
      for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) {
        const v = Math.pow(10, e); if (v >= lo * 0.999 && v <= hi * 1.001) out.push(v);
      }
      return out.length >= 2 ? out : [lo, hi];
    }
    const span = hi - lo || 1, step0 = span / n, mag = Math.pow(10, Math.floor(Math.log10(step0)));
    let step = [1, 2, 5, 10].map((m) => m * mag).find((s) => span / s <= n) || mag * 10;
    if (integer) step = Math.max(1, Math.round(step));
    const out = []; for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) out.push(v);
    return out;
  }
  function axes(s, x, y, xt, yt, xlabel, ylabel, xfmt) {
    const g = el("g", { class: "axes", "font-size": 11, fill: "#4b5563" }, s);
    el("line", { x1: M.l, x2: W - M.r, y1: H - M.b, y2: H - M.b, stroke: "#9ca3af" }, g);
    el("line", { x1: M.l, x2: M.l, y1: M.t, y2: H - M.b, stroke: "#9ca3af" }, g);
    for (const v of xt) {
      el("line", { x1: x(v), x2: x(v), y1: H - M.b, y2: H - M.b + 4, stroke: "#9ca3af" }, g);
      el("text", { x: x(v), y: H - M.b + 16, "text-anchor": "middle" }, g, (xfmt || fmt)(v));
    }
    for (const v of yt) {
      el("line", { x1: M.l, x2: W - M.r, y1: y(v), y2: y(v), stroke: "#eef0f3" }, g);
      el("text", { x: M.l - 6, y: y(v) + 4, "text-anchor": "end" }, g, fmt(v));
    }
    el("text", { x: (M.l + W - M.r) / 2, y: H - 4, "text-anchor": "middle" }, g, xlabel);
    el("text", { x: 12, y: (M.t + H - M.b) / 2, "text-anchor": "middle",
      transform: `rotate(-90 12 ${(M.t + H - M.b) / 2})` }, g, ylabel);
  }
  function legend(box, items) {
    const d = document.createElement("div"); d.className = "legend";
    for (const [name, color] of items) {
      const s = document.createElement("span");
      s.innerHTML = `<i style="background:${color}"></i>`; s.appendChild(document.createTextNode(name));
      d.appendChild(s);
    }
    box.appendChild(d);
  }
  function empty(box, text) {
    const d = document.createElement("div"); d.className = "empty"; d.textContent = text; box.appendChild(d);
    return 0;
  }
  function tooltip(box) {
    const t = document.createElement("div"); t.className = "tip"; box.appendChild(t); return t;
  }
  function markStep(s, x, step, text) {
    const g = el("g", { class: "first-bad" }, s);
    el("line", { x1: x(step), x2: x(step), y1: M.t, y2: H - M.b, stroke: "#e02424", "stroke-dasharray": "4 3",
      "stroke-width": 1.5 }, g);
    el("text", { x: x(step) + 4, y: H - M.b - 6, fill: "#e02424", "font-size": 11 }, g, text);
    return 1;
  }

  // --- plots ----------------------------------------------------------------------------------

  function lossPlot(box, D) {
    const L = D.loss, xs = D.steps.starts;
    const series = L.series.map((s, i) => ({ ...s, color: PALETTE[i % PALETTE.length] }));
    const all = [];
    for (const s of series) for (const v of s.y) if (finite(v)) all.push(v);
    if (L.band) for (const k of ["min", "max"]) for (const v of L.band[k]) if (finite(v)) all.push(v);
    if (!xs.length || !all.length) return empty(box, "No loss recorded.");
    let lo = Math.min(...all), hi = Math.max(...all);
    const log = lo > 0 && hi / lo > 50;
    if (!log && lo === hi) { lo -= 1; hi += 1; }
    const s = svgBox(box, W, H);
    const x = scale(xs[0], Math.max(xs[xs.length - 1], xs[0] + 1), M.l, W - M.r);
    const y = scale(lo, hi, H - M.b, M.t + 14, log);
    axes(s, x, y, ticks(xs[0], xs[xs.length - 1], 8, false, true), ticks(lo, hi, 5, log),
      D.steps.bin > 1 ? `step (mean of ${D.steps.bin} per point)` : "step", "loss" + (log ? " (log)" : ""));
    let n = 0;
    if (L.band) {
      let d = "";
      const pts = xs.map((v, i) => [v, L.band.min[i], L.band.max[i]]).filter((p) => finite(p[1]) && finite(p[2]));
      pts.forEach((p, i) => { d += (i ? "L" : "M") + x(p[0]).toFixed(1) + "," + y(p[2]).toFixed(1); });
      pts.slice().reverse().forEach((p) => { d += "L" + x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1); });
      title(el("path", { d: d + "Z", fill: "#c3ddfd", stroke: "none", class: "band" }, s), `min-max over ${L.ranks} ranks`);
      let m = "";
      xs.forEach((v, i) => { const w = L.band.median[i]; if (finite(w)) m += (m ? "L" : "M") + x(v).toFixed(1) + "," + y(w).toFixed(1); });
      title(el("path", { d: m, fill: "none", stroke: "#1e429f", "stroke-width": 1.5, class: "series" }, s), "median");
      n += 2;
    }
    const bad = el("g", { fill: "#e02424", "font-size": 12, "text-anchor": "middle" }, s);
    for (const sr of series) {
      let d = "", pen = false;
      sr.y.forEach((v, i) => {
        if (finite(v)) { d += (pen ? "L" : "M") + x(xs[i]).toFixed(1) + "," + y(v).toFixed(1); pen = true; }
        else { pen = false; if (v !== null && v !== undefined) { title(el("text", { x: x(xs[i]), y: M.t + 10, class: "nonfinite" }, bad, "\u00d7"), `${sr.name}: ${v} at step ${xs[i]}`); n++; } }
      });
      title(el("path", { d, fill: "none", stroke: sr.color, "stroke-width": L.band ? 1.6 : 1.3, class: "series" }, s), sr.name);
      n++;
    }
    if (D.first_bad) n += markStep(s, x, D.first_bad.step, `first bad step ${D.first_bad.step}`);
    const items = L.band ? [[`median of ${L.ranks} ranks`, "#1e429f"], ["min-max", "#c3ddfd"]] : [];
    legend(box, items.concat(series.map((sr) => [sr.name, sr.color])));
    return n;
  }

  function heatColor(ratio) {
    // ratio to the median step time: 1 -> pale, 2 -> orange, >=4 -> dark red; faster -> pale blue.
    if (!finite(ratio)) return "#e5e7eb";
    const t = Math.max(-1, Math.min(2, Math.log2(ratio)));
    if (t <= 0) { const a = -t; return `rgb(${Math.round(254 - 60 * a)},${Math.round(249 - 20 * a)},${Math.round(195 + 40 * a)})`; }
    const u = t / 2;
    return `rgb(${Math.round(254 - 100 * u)},${Math.round(240 - 225 * u)},${Math.round(195 - 180 * u)})`;
  }

  function canvasHeat(box, rows, cols, values, colorOf, tipOf, opts) {
    const left = opts.left || 110, top = 8, bottom = 34;
    const big = opts.maxCell || 24;
    const cw = Math.max(1, Math.min(big, Math.floor((W - left - 16) / Math.max(1, cols.length))));
    const rh = Math.max(2, Math.min(opts.maxCell || 22, Math.floor(420 / Math.max(1, rows.length))));
    const c = document.createElement("canvas");
    c.width = left + cw * cols.length + 16; c.height = top + rh * rows.length + bottom;
    box.appendChild(c);
    const g = c.getContext("2d");
    g.fillStyle = "#fff"; g.fillRect(0, 0, c.width, c.height);
    let n = 0;
    for (let r = 0; r < rows.length; r++) for (let k = 0; k < cols.length; k++) {
      g.fillStyle = colorOf(values[r][k], r, k); g.fillRect(left + k * cw, top + r * rh, cw, rh); n++;
    }
    g.fillStyle = "#374151"; g.font = "11px sans-serif"; g.textAlign = "right"; g.textBaseline = "middle";
    const every = Math.ceil(12 / rh);
    rows.forEach((name, r) => { if (r % every === 0) g.fillText(name, left - 6, top + r * rh + rh / 2); });
    g.textAlign = "center"; g.textBaseline = "top";
    const cevery = Math.ceil(40 / cw);
    cols.forEach((name, k) => { if (k % cevery === 0) g.fillText(String(name), left + k * cw + cw / 2, top + rows.length * rh + 4); });
    if (opts.xlabel) g.fillText(opts.xlabel, left + cw * cols.length / 2, top + rows.length * rh + 18);
    if (opts.markCol !== undefined && opts.markCol >= 0) {
      g.strokeStyle = "#e02424"; g.setLineDash([4, 3]); g.lineWidth = 1.5;
      const xm = left + opts.markCol * cw + cw / 2;
      g.beginPath(); g.moveTo(xm, top); g.lineTo(xm, top + rows.length * rh); g.stroke(); n++;
    }
    for (const [r, k] of opts.outline || []) {
      g.strokeStyle = "#e02424"; g.setLineDash([]); g.lineWidth = 2;
      g.strokeRect(left + k * cw + 1, top + r * rh + 1, cw - 2, rh - 2);
    }
    const tip = tooltip(box);
    c.addEventListener("mousemove", (ev) => {
      const b = c.getBoundingClientRect(), sx = c.width / b.width;
      const k = Math.floor(((ev.clientX - b.left) * sx - left) / cw), r = Math.floor(((ev.clientY - b.top) * sx - top) / rh);
      if (k < 0 || r < 0 || k >= cols.length || r >= rows.length) { tip.style.display = "none"; return; }
      tip.textContent = tipOf(r, k); tip.style.display = "block";
      tip.style.left = (ev.clientX - b.left + 12) + "px"; tip.style.top = (ev.clientY - b.top + 12) + "px";
    });
    c.addEventListener("mouseleave", () => { tip.style.display = "none"; });
    return n;
  }

  function stepTimePlot(box, D) {
    const T = D.step_time, xs = D.steps.starts;
    if (!xs.length || !T.rows.length || !finite(T.median_ms)) return empty(box, "No step times recorded.");
    let mark = -1;
    if (D.first_bad) mark = xs.findIndex((v, i) => v <= D.first_bad.step && (i === xs.length - 1 || xs[i + 1] > D.first_bad.step));
    const n = canvasHeat(box, T.rows, xs, T.values_ms, (v) => (v === null ? "#f3f4f6" : heatColor(v / T.median_ms)),
      (r, k) => `${T.rows[r]}, step ${xs[k]}${D.steps.bin > 1 ? "+" : ""}: ` +
        (T.values_ms[r][k] === null ? "no record" : `${fmt(T.values_ms[r][k])} ms (${fmt(T.values_ms[r][k] / T.median_ms)}x median)`),
      { xlabel: "step", markCol: mark });
    legend(box, [["faster than median", heatColor(0.5)], ["median " + fmt(T.median_ms) + " ms", heatColor(1)],
      ["2x", heatColor(2)], [">= 4x", heatColor(4)], ["no record", "#f3f4f6"]]);
    if (T.group > 1) { const p = document.createElement("div"); p.className = "note"; p.textContent = `${T.group} ranks per row: each cell shows the slowest of them.`; box.appendChild(p); }
    return n;
  }

  function timelinePlot(box, D) {
    const TL = D.timeline, last = Math.max(D.steps.last, 1);
    const lanes = [];
    for (const e of TL.events) if (!lanes.includes(e.detector)) lanes.push(e.detector);
    if (TL.injected.length) lanes.push("fault injected");
    if (TL.ends.length) lanes.push("rank ended early");
    if (!lanes.length) return empty(box, "Nothing went wrong: no finding, no fault, every rank finished.");
    const lh = 26, h = M.t + lanes.length * lh + M.b, s = svgBox(box, W, h);
    const x = scale(0, last + 1, M.l + 60, W - M.r);
    const g = el("g", { "font-size": 11, fill: "#4b5563" }, s);
    lanes.forEach((name, i) => {
      el("line", { x1: M.l + 60, x2: W - M.r, y1: M.t + i * lh + lh / 2, y2: M.t + i * lh + lh / 2, stroke: "#eef0f3" }, g);
      el("text", { x: M.l + 54, y: M.t + i * lh + lh / 2 + 4, "text-anchor": "end" }, g, name);
    });
    const base = M.t + lanes.length * lh;
    el("line", { x1: M.l + 60, x2: W - M.r, y1: base, y2: base, stroke: "#9ca3af" }, g);
    for (const v of ticks(0, last + 1, 8, false, true)) el("text", { x: x(v), y: base + 14, "text-anchor": "middle" }, g, v === 0 ? "start" : fmt(v));
    el("text", { x: (M.l + W) / 2, y: base + 28, "text-anchor": "middle" }, g, "step (findings without a step: at start if before training, at the end if after)");
    let n = 0;
    const where = (e) => (finite(e.step) ? e.step : (e.detector === "hang" || e.detector === "oom" ? last + 1 : 0));
    for (const e of TL.events) {
      const i = lanes.indexOf(e.detector), cy = M.t + i * lh + lh / 2;
      const who = e.nranks ? ` ranks ${e.ranks.join(",")}${e.nranks > e.ranks.length ? "..." : ""}` : "";
      title(el("circle", { cx: x(where(e)), cy, r: 6, fill: SEV[e.severity] || "#6b7280", stroke: "#fff", class: "event" }, s),
        `${e.severity} ${e.detector} step ${e.step ?? "-"}${who}: ${e.subject}\n${e.message}`);
      n++;
    }
    const fi = lanes.indexOf("fault injected");
    for (const f of TL.injected) {
      const cx = x(f.step || 0), cy = M.t + fi * lh + lh / 2;
      title(el("path", { d: `M${cx},${cy - 7}L${cx + 7},${cy + 6}L${cx - 7},${cy + 6}Z`, fill: "#7e3af2", class: "event" }, s),
        `${f.fault} injected on rank ${f.rank} at step ${f.step}`);
      n++;
    }
    const ei = lanes.indexOf("rank ended early");
    for (const e of TL.ends) {
      const cx = x(e.step || 0), cy = M.t + ei * lh + lh / 2;
      title(el("rect", { x: cx - 5, y: cy - 5, width: 10, height: 10, fill: "#6b7280", class: "event" }, s), `rank ${e.rank} after step ${e.step}: ${e.status}`);
      n++;
    }
    if (D.first_bad) {
      el("line", { x1: x(D.first_bad.step), x2: x(D.first_bad.step), y1: M.t, y2: base, stroke: "#e02424", "stroke-dasharray": "4 3", "stroke-width": 1.5, class: "first-bad" }, s);
      n++;
    }
    legend(box, Object.entries(SEV).map(([k, c]) => [k, c]).concat([["fault injected", "#7e3af2"], ["rank ended early", "#6b7280"]]));
    if (TL.unfinished > TL.ends.length) { const p = document.createElement("div"); p.className = "note"; p.textContent = `${TL.unfinished} ranks did not finish; the first ${TL.ends.length} shown.`; box.appendChild(p); }
    return n;
  }

  function hbars(box, rows, valueOf, total, colorOf, labelW, opts) {
    const bh = Math.max(6, Math.min(20, Math.floor(440 / Math.max(1, rows.length)))), h = M.t + rows.length * (bh + 3) + M.b;
    const s = svgBox(box, W, h), left = labelW;
    const x = scale(0, total, left, W - M.r);
    const g = el("g", { "font-size": 11, fill: "#374151" }, s);
    let n = 0;
    rows.forEach((row, i) => {
      const y0 = M.t + i * (bh + 3);
      if (bh >= 10 || i % Math.ceil(12 / (bh + 3)) === 0) el("text", { x: left - 6, y: y0 + bh / 2 + 4, "text-anchor": "end" }, g, row.label);
      let acc = 0;
      valueOf(row).forEach((v, j) => {
        if (v > 0) {
          title(el("rect", { x: x(acc), y: y0, width: Math.max(0.5, x(acc + v) - x(acc)), height: bh, fill: colorOf(row, j), class: "bar" }, s),
            opts.tip(row, j, v));
          n++;
        }
        acc += v;
      });
    });
    const base = M.t + rows.length * (bh + 3);
    el("line", { x1: left, x2: W - M.r, y1: base, y2: base, stroke: "#9ca3af" }, g);
    for (const v of opts.ticks) el("text", { x: x(v), y: base + 14, "text-anchor": "middle" }, g, opts.tfmt(v));
    el("text", { x: (left + W) / 2, y: base + 28, "text-anchor": "middle" }, g, opts.xlabel);
    return { s, x, base, n };
  }

  function memoryPlot(box, D) {
    const Mm = D.memory;
    if (!Mm.rows.length) return empty(box, "No memory records (the memory detector was off).");
    const total = Math.max(...Mm.rows.map((r) => r.values.reduce((a, b) => a + b, 0)), 1);
    const r = hbars(box, Mm.rows, (row) => row.values, total, (row, j) => MEM_COLORS[j], 200,
      { tip: (row, j, v) => `${row.label}, step ${row.step}: ${Mm.parts[j]} ${bytes(v)}`, ticks: ticks(0, total, 5),
        tfmt: bytes, xlabel: "bytes at each rank's peak step" });
    legend(box, Mm.parts.map((p, j) => [p.replace("_", " "), MEM_COLORS[j]]));
    return r.n;
  }

  function stragglerPlot(box, D) {
    const S = D.straggler;
    if (!S || !S.rows.length) return empty(box, "No straggler scores (needs 2+ ranks and 8+ steps).");
    const named = new Set((S.named || []).map((r) => "rank " + r));
    const r = hbars(box, S.rows, (row) => [row.score], 1.05,
      (row) => (row.score < S.threshold ? "#e02424" : named.has(row.label) ? "#d97706" : "#0e9f6e"), 200,
      { tip: (row, j, v) => `${row.label}: speed score ${fmt(v)} (1 = as fast as the fastest rank)`, ticks: [0, 0.25, 0.5, 0.7, 1],
        tfmt: fmt, xlabel: "speed score: fastest rank's median work / this rank's" });
    el("line", { x1: r.x(S.threshold), x2: r.x(S.threshold), y1: M.t, y2: r.base, stroke: "#e02424", "stroke-dasharray": "4 3", class: "threshold" }, r.s);
    legend(box, [["slower than the threshold " + S.threshold, "#e02424"], ["healthy", "#0e9f6e"]]);
    return r.n;
  }

  function sweepPlot(box, D) {
    const sw = (D.doctor || {}).sweep || [];
    if (!sw.length) return empty(box, "No bandwidth sweep (distdebug doctor --bandwidth).");
    const xs = sw.map((r) => r.bytes), ys = sw.map((r) => r.busbw_GBps);
    const lo = Math.max(Math.min(...ys.filter((v) => v > 0)), 1e-6), hi = Math.max(...ys, lo * 10);
    const s = svgBox(box, W, H);
    const x = scale(xs[0], xs[xs.length - 1], M.l, W - M.r, true), y = scale(lo, hi, H - M.b, M.t, true);
    const every = Math.ceil(xs.length / 7), xt = xs.filter((_, i) => i % every === 0);
    axes(s, x, y, xt, ticks(lo, hi, 5, true), "message size", "busbw GB/s (log)", bytes);
    let d = "";
    sw.forEach((r, i) => { if (r.busbw_GBps > 0) d += (d ? "L" : "M") + x(r.bytes).toFixed(1) + "," + y(r.busbw_GBps).toFixed(1); });
    el("path", { d, fill: "none", stroke: "#1a56db", "stroke-width": 1.8, class: "series" }, s);
    let n = 1;
    for (const r of sw) if (r.busbw_GBps > 0) {
      title(el("circle", { cx: x(r.bytes), cy: y(r.busbw_GBps), r: 3, fill: "#1a56db", class: "point" }, s),
        `${bytes(r.bytes)}: ${fmt(r.time_us)} us, algbw ${fmt(r.algbw_GBps)} GB/s, busbw ${fmt(r.busbw_GBps)} GB/s`);
      n++;
    }
    legend(box, [[`all_reduce busbw, ${D.doctor.backend}, ${D.doctor.world_size} ranks`, "#1a56db"]]);
    return n;
  }

  function linkPlot(box, D) {
    const mx = (D.doctor || {}).matrix;
    if (!mx || !mx.length) return empty(box, "No link matrix (distdebug doctor --bandwidth).");
    const vals = mx.flat().filter(finite), med = vals.slice().sort((a, b) => a - b)[Math.floor(vals.length / 2)] || 1;
    const names = mx.map((_, i) => "rank " + i), cols = mx.map((_, i) => i);
    const outline = [];
    for (const [a, b] of D.doctor.flagged || []) { outline.push([a, b]); outline.push([b, a]); }
    const n = canvasHeat(box, names, cols, mx, (v) => (v === null ? "#f3f4f6" : heatColor(med / v)),
      (r, k) => (r === k ? `rank ${r}` : `ranks ${r}-${k}: ${fmt(mx[r][k])} GB/s (median link ${fmt(med)})`),
      { left: 70, xlabel: "rank", outline, maxCell: 48 });
    legend(box, [["median link " + fmt(med) + " GB/s", heatColor(1)], ["2x slower", heatColor(2)], [">= 4x slower", heatColor(4)], ["flagged pair: red outline", "#e02424"]]);
    return n;
  }

  const PLOTS = { loss: lossPlot, step_time: stepTimePlot, timeline: timelinePlot, memory: memoryPlot,
    straggler: stragglerPlot, sweep: sweepPlot, links: linkPlot };

  function drawAll() {
    const D = JSON.parse(document.getElementById("distdebug-data").textContent, (k, v) =>
      (v === "NaN" ? NaN : v === "Infinity" ? Infinity : v === "-Infinity" ? -Infinity : v));
    const drawn = {};
    for (const box of document.querySelectorAll(".plot[data-plot]")) {
      const name = box.dataset.plot;
      try {
        const n = PLOTS[name](box, D);
        box.dataset.drawn = String(n);
        drawn[name] = n;
      } catch (err) {
        box.dataset.drawn = "error";
        empty(box, `This plot failed: ${err}`);
        console.error(`distdebug report: plot ${name} failed`, err);
      }
    }
    window.distdebugDrawn = drawn;
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", drawAll);
  else drawAll();
})();
