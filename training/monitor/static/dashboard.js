// The training-run dashboard: polls api/state and updates the page in place.
// Every string that comes from a peer (names, hashes, prompts, paths) is written with textContent, never as HTML.
(function () {
  "use strict";

  const { $, setText } = tttMonitor;
  const MIN_POLL_SECONDS = 2;
  const CHART_HEIGHT = 220;
  const OUTLIERS_TITLE =
    "contributions the other peers dropped (non-finite or far larger than the group's) or clipped (CenteredClip)";
  const CONVICTED_TITLE =
    "two or more auditors recomputed microbatches of this peer and got another gradient than it committed to";
  const PROBATION_TITLE =
    "no audit has passed this peer's committed work yet: the reducers hold its gradient to one median peer's";
  const CLAIMS_TITLE =
    "claims more than twice the median peer's samples: averaging and the swarm's progress count it as twice the median";

  let state = null; // the last state rendered
  let receivedAt = 0; // Date.now() when it arrived
  let clockOffset = 0; // the server's clock minus the browser's, in seconds (from the Date header)
  let unreachable = false;
  let waiting = false; // the monitor answered, but before its first refresh
  let lastError = "";
  let renders = 0;
  let previewsKey = "";
  const charts = {};

  function isNum(v) {
    return typeof v === "number" && Number.isFinite(v);
  }

  // ---- formatting ------------------------------------------------------------------------------------------

  const intFormat = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });

  function fmtInt(v) {
    return isNum(v) ? intFormat.format(v) : "–";
  }

  function fmtLoss(v) {
    if (!isNum(v)) return "–";
    return Math.abs(v) >= 100 ? v.toFixed(1) : v.toFixed(3);
  }

  function fmtRate(v) {
    if (!isNum(v)) return "–";
    if (Math.abs(v) >= 1000) return intFormat.format(v);
    return Math.abs(v) >= 100 ? v.toFixed(0) : v.toFixed(1);
  }

  // 42 -> "42 s", 4320 -> "1 h 12 min", 180000 -> "2 d 2 h"
  function fmtDuration(seconds) {
    if (!isNum(seconds)) return "unknown";
    const s = Math.max(0, Math.round(seconds));
    if (s < 60) return s + " s";
    const m = Math.floor(s / 60);
    if (m < 60) return m + " min";
    const h = Math.floor(m / 60);
    const mm = m % 60;
    if (h < 24) return mm ? h + " h " + mm + " min" : h + " h";
    const d = Math.floor(h / 24);
    const hh = h % 24;
    return hh ? d + " d " + hh + " h" : d + " d";
  }

  function plural(n, one, many) {
    return n === 1 ? one : many;
  }

  // Now on the server's clock (the browser's, corrected by the response's Date header), so that ages computed from
  // the server's timestamps do not depend on a skewed browser clock.
  function serverNow() {
    return Date.now() / 1000 + clockOffset;
  }

  // ---- charts ----------------------------------------------------------------------------------------------

  const AXIS = { stroke: "#5b6472", grid: { stroke: "#eceff3", width: 1 }, ticks: { stroke: "#dde1e7", width: 1 } };

  function chartSpec(id, label, color, format, options) {
    return { id: id, label: label, color: color, format: format, options: options || {} };
  }

  const CHARTS = [
    chartSpec("loss", "Loss", "#d9480f", fmtLoss, { key: "loss" }),
    chartSpec("sps", "Samples/s", "#1c7ed6", fmtRate, { key: "samples_per_second", zero: true }),
    chartSpec("peers", "Active peers", "#2b8a3e", fmtInt, { key: "active_peers", zero: true, integer: true }),
  ];

  function plotWidth(el) {
    return Math.max(200, Math.floor(el.clientWidth || 300));
  }

  function makeChart(spec) {
    const el = $("chart-" + spec.id);
    const yScale = { auto: true };
    if (spec.options.zero) {
      yScale.range = (u, min, max) => [0, isNum(max) && max > 0 ? max * 1.1 : 1];
    }
    const yAxis = Object.assign({}, AXIS, { size: 56 });
    if (spec.options.integer) {
      yAxis.incrs = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000];
    }
    const series = {
      label: spec.label,
      stroke: spec.color,
      width: 2,
      fill: spec.color + "1a",
      spanGaps: false, // a refresh without a loss is a gap, not a straight line
      value: (u, v) => (v == null ? "–" : spec.format(v)),
    };
    if (spec.options.integer && uPlot.paths && uPlot.paths.stepped) {
      series.paths = uPlot.paths.stepped({ align: 1 });
    }
    const chart = {
      zoomed: false,
      plot: null,
    };
    const opts = {
      width: plotWidth(el),
      height: CHART_HEIGHT,
      cursor: { sync: { key: "ttt-run" }, drag: { x: true, y: false } },
      scales: { x: { time: true }, y: yScale },
      axes: [Object.assign({}, AXIS), yAxis],
      series: [{ label: "Time", value: "{YYYY}-{MM}-{DD} {HH}:{mm}:{ss}" }, series],
      legend: { live: true },
      hooks: {
        // Away from the cursor the legend shows the latest values.
        setCursor: [
          (u) => {
            const n = u.data[0] ? u.data[0].length : 0;
            if (u.cursor.idx == null && n > 0) u.setLegend({ idx: n - 1 }, false);
          },
        ],
        // Dragging zooms in (double-click zooms out); a zoomed chart keeps its range while new data comes in.
        setSelect: [
          (u) => {
            if (u.select.width > 0) chart.zoomed = true;
          },
        ],
        setScale: [
          (u, key) => {
            if (key !== "x") return;
            const xs = u.data[0];
            if (!xs || xs.length < 2) {
              chart.zoomed = false;
              return;
            }
            const lo = u.scales.x.min;
            const hi = u.scales.x.max;
            chart.zoomed = lo > xs[0] + 1e-6 || hi < xs[xs.length - 1] - 1e-6;
          },
        ],
      },
    };
    chart.plot = new uPlot(opts, [[], []], el);
    chart.el = el;
    chart.note = document.createElement("div");
    chart.note.className = "chart-note";
    chart.note.textContent = "no data yet";
    el.appendChild(chart.note);
    return chart;
  }

  function historyColumn(history, key, n) {
    const column = Array.isArray(history[key]) ? history[key] : [];
    const out = new Array(n);
    for (let i = 0; i < n; i++) {
      const v = column[i];
      out[i] = isNum(v) ? v : null;
    }
    return out;
  }

  function updateCharts(history) {
    history = history || {};
    const times = Array.isArray(history.time) ? history.time.filter(isNum) : [];
    const n = times.length;
    for (const spec of CHARTS) {
      if (!charts[spec.id]) charts[spec.id] = makeChart(spec);
      const chart = charts[spec.id];
      const values = historyColumn(history, spec.options.key, n);
      chart.note.hidden = values.some((v) => v != null);
      chart.plot.setData([times, values], !chart.zoomed);
      // uPlot keeps the legend's index while the cursor is away: point it at the newest values.
      if (chart.plot.cursor.idx == null) chart.plot.setLegend({ idx: n > 0 ? n - 1 : null }, false);
    }
  }

  function resizeCharts() {
    for (const id in charts) {
      const chart = charts[id];
      const width = plotWidth(chart.el);
      if (width !== chart.plot.width) chart.plot.setSize({ width: width, height: CHART_HEIGHT });
    }
  }

  // ---- the page --------------------------------------------------------------------------------------------

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text != null) node.textContent = String(text);
    return node;
  }

  function renderHeader(s) {
    const runId = typeof s.run_id === "string" && s.run_id ? s.run_id : "?";
    setText($("run-id"), runId);
    const step = isNum(s.global_step) ? s.global_step : null;
    const total = isNum(s.total_steps) ? s.total_steps : null;
    document.title = "Run " + runId + (step != null ? " · step " + step + (total ? "/" + total : "") : "") + " · ttt";

    // DiLoCo (--local-steps H): the peers average every H local steps, and the run counts outer steps.
    const diloco = isNum(s.local_steps) && s.local_steps > 0;
    setText($("stat-step-label"), diloco ? "Outer step" : "Global step");
    $("stat-mode").hidden = !diloco;
    setText($("stat-mode"), diloco ? "DiLoCo: averaging every " + fmtInt(s.local_steps) + " local steps" : "");
    setText($("stat-step"), fmtInt(step));
    setText($("stat-total-steps"), fmtInt(total));
    const fraction = step != null && total ? Math.min(1, Math.max(0, step / total)) : 0;
    $("stat-progress").style.width = (fraction * 100).toFixed(1) + "%";

    setText($("stat-loss"), fmtLoss(s.loss));
    setText($("stat-sps"), fmtRate(s.samples_per_second));
    setText($("stat-peers"), fmtInt(s.active_peers));
    setText($("stat-samples"), fmtInt(s.total_samples));
    const v = s.verified_samples || {};
    setText($("stat-verified"), "verified " + fmtInt(v.estimate) + " (" + fmtInt(v.low) + "–" + fmtInt(v.high) + ")");
    let eta;
    if (step != null && total && step >= total) eta = "done";
    else eta = fmtDuration(s.time_left_seconds);
    setText($("stat-eta"), eta);
  }

  function renderIndicators(s) {
    const box = $("agreement");
    const h = s.hashes || {};
    const distinct = isNum(h.distinct) ? h.distinct : 0;
    const at = isNum(h.step) ? " at step " + h.step : "";
    let cls;
    let text;
    if (distinct <= 0) {
      cls = "indicator-unknown";
      text = "parameter agreement unknown";
    } else if (distinct === 1 && h.agree !== false) {
      cls = "indicator-ok";
      text = "peers agree" + at;
    } else {
      // Compressed (8-bit) averaging leaves each peer slightly different parameters between state averaging
      // rounds; peers that stopped averaging drift apart for good. The leaderboard marks the odd ones out.
      cls = "indicator-warn";
      text = distinct + " parameter versions" + at + " (compressed averaging leaves small differences)";
    }
    box.className = "indicator " + cls;
    setText($("agreement-text"), text);

    const rejected = isNum(s.rejected_records) ? s.rejected_records : 0;
    $("rejected").hidden = rejected <= 0;
    setText(
      $("rejected-text"),
      rejected + " metrics " + plural(rejected, "record", "records") + " rejected at the last refresh",
    );

    // What the reducers of the last step's averaging rounds threw out or clipped; the leaderboard says whose.
    const o = s.outliers || {};
    const dropped = isNum(o.dropped) ? o.dropped : 0;
    const clipped = isNum(o.clipped) ? o.clipped : 0;
    $("outliers").hidden = dropped + clipped <= 0;
    const parts = [];
    if (dropped > 0) parts.push(dropped + " " + plural(dropped, "contribution", "contributions") + " dropped");
    if (clipped > 0) parts.push(clipped + " " + plural(clipped, "contribution", "contributions") + " clipped");
    setText($("outliers-text"), parts.join(", ") + (isNum(o.step) ? " at step " + o.step : ""));

    // How far the swarm read its data epoch: each block of rows is leased to one peer at a time.
    const c = s.coverage;
    $("coverage").hidden = !c || !isNum(c.blocks);
    if (c && isNum(c.blocks)) {
      const read = [c.done + " of " + c.blocks + " " + plural(c.blocks, "block", "blocks") + " read"];
      if (c.reading > 0) read.push(c.reading + " being read");
      if (c.left > 0) read.push(c.left + " left part-read by peers that went away");
      if (c.taken_over > 0) read.push(c.taken_over + " taken over");
      setText($("coverage-text"), "data epoch " + c.epoch + ": " + read.join(", "));
    }
  }

  // The hash most active peers at the agreement step hold, to mark the odd ones out.
  function majorityHash(peers, step) {
    const counts = new Map();
    for (const p of peers) {
      if (!p || !p.online || p.step !== step || typeof p.parameters_hash !== "string") continue;
      counts.set(p.parameters_hash, (counts.get(p.parameters_hash) || 0) + 1);
    }
    let best = null;
    let bestCount = 0;
    for (const [hash, count] of counts) {
      if (count > bestCount) {
        best = hash;
        bestCount = count;
      }
    }
    return best;
  }

  function cell(row, label, className, text) {
    const td = el("td", className, text);
    td.dataset.label = label;
    row.appendChild(td);
    return td;
  }

  function renderLeaderboard(s) {
    const peers = Array.isArray(s.peers) ? s.peers.filter((p) => p && typeof p === "object") : [];
    const tbody = $("leaderboard").tBodies[0];
    const now = serverNow();
    const hashStep = s.hashes && isNum(s.hashes.step) ? s.hashes.step : null;
    const majority = s.hashes && s.hashes.distinct > 1 ? majorityHash(peers, hashStep) : null;
    const rows = document.createDocumentFragment();
    if (!peers.length) {
      const tr = el("tr", "empty");
      const td = el("td", null, "no peers yet");
      td.colSpan = 11;
      tr.appendChild(td);
      rows.appendChild(tr);
    }
    peers.forEach((p, i) => {
      const tr = el("tr", p.online ? "online" : "offline");
      cell(tr, "#", "num rank", isNum(p.rank) ? p.rank : i + 1);
      const name = typeof p.name === "string" && p.name ? p.name : "(unnamed)";
      const nameCell = cell(tr, "Peer", "name", name);
      nameCell.title = name;

      const status = el("span");
      status.appendChild(el("span", "badge " + (p.online ? "badge-online" : "badge-offline"), p.online ? "online" : "offline"));
      if (!p.online && isNum(p.last_seen)) {
        status.appendChild(el("span", "seen", "seen " + fmtDuration(now - p.last_seen) + " ago"));
      }
      cell(tr, "Status", "status-cell").appendChild(status);

      cell(tr, "Samples", "num", fmtInt(p.samples));
      const verified = Array.isArray(p.verified) && p.verified.length === 3 ? p.verified : [null, null, null];
      const verifiedCell = cell(tr, "Verified", "num", fmtInt(verified[0]));
      verifiedCell.appendChild(el("span", "interval", fmtInt(verified[1]) + "–" + fmtInt(verified[2])));
      const rateCell = cell(tr, "Samples/s", "num", p.online ? fmtRate(p.samples_per_second) : "–");
      if (p.online && p.claims_capped === true) {
        rateCell.classList.add("claims-capped");
        rateCell.title = CLAIMS_TITLE;
        rateCell.appendChild(el("span", "badge badge-capped", "capped"));
      }
      cell(tr, "Time contributed", "num", fmtDuration(p.seconds_online));
      cell(tr, "Step", "num", isNum(p.step) ? fmtInt(p.step) : "–");
      const outliersCell = cell(tr, "Outliers", "num", fmtInt(p.outliers));
      if (isNum(p.outliers) && p.outliers > 0) {
        outliersCell.classList.add("outliers-sent");
        outliersCell.title = OUTLIERS_TITLE;
      }

      const audits = Array.isArray(p.audits) && p.audits.length === 2 ? p.audits : [0, 0];
      const auditsCell = cell(tr, "Audits", "num", audits[0] + audits[1] > 0 ? fmtInt(audits[0]) + " / " + fmtInt(audits[1]) : "–");
      if (p.convicted === true) {
        auditsCell.classList.add("convicted");
        auditsCell.title = CONVICTED_TITLE;
        auditsCell.appendChild(el("span", "badge badge-convicted", "convicted"));
      } else if (p.probation === true) {
        auditsCell.title = PROBATION_TITLE;
        auditsCell.appendChild(el("span", "badge badge-probation", "on probation"));
      }

      const hashCell = cell(tr, "Parameters hash", "hash");
      if (typeof p.parameters_hash === "string" && p.parameters_hash) {
        const code = el("code", null, p.parameters_hash.slice(0, 8));
        code.title = p.parameters_hash;
        if (majority && p.online && p.step === hashStep && p.parameters_hash !== majority) {
          code.className = "hash-odd";
          code.title += " (differs from most peers at step " + hashStep + ")";
        }
        hashCell.appendChild(code);
      } else {
        hashCell.textContent = "–";
      }
      rows.appendChild(tr);
    });
    tbody.replaceChildren(rows);

    const online = peers.filter((p) => p.online).length;
    setText(
      $("leaderboard-summary"),
      peers.length ? online + " of " + peers.length + " " + plural(peers.length, "peer", "peers") + " online" : "",
    );
  }

  function renderPreviews(s) {
    const p = s.previews && typeof s.previews === "object" ? s.previews : null;
    const images = p && Array.isArray(p.images) ? p.images.filter((im) => im && typeof im.url === "string") : [];
    const key = p ? JSON.stringify([p.step, images.map((im) => [im.url, im.prompt])]) : "";
    if (key === previewsKey) return;
    previewsKey = key;
    const box = $("previews");
    setText($("previews-step"), p && isNum(p.step) ? "step " + fmtInt(p.step) : "");
    if (!images.length) {
      box.replaceChildren(el("p", "muted", "no preview yet"));
      return;
    }
    const grid = document.createDocumentFragment();
    for (const im of images) {
      const figure = el("figure", "preview");
      const prompt = typeof im.prompt === "string" ? im.prompt : "";
      const img = document.createElement("img");
      img.alt = prompt || "preview";
      img.decoding = "async";
      img.addEventListener("error", () => figure.classList.add("broken"));
      img.src = im.url;
      const link = el("a");
      link.href = im.url;
      link.target = "_blank";
      link.rel = "noopener";
      link.appendChild(img);
      figure.appendChild(link);
      figure.appendChild(el("figcaption", null, prompt || "(no prompt)"));
      grid.appendChild(figure);
    }
    box.replaceChildren(grid);
  }

  function renderCheckpoint(s) {
    const c = s.checkpoint && typeof s.checkpoint === "object" ? s.checkpoint : null;
    const box = $("checkpoint");
    if (!c) {
      box.replaceChildren(el("p", "muted", "no checkpoint yet"));
      return;
    }
    const dl = el("dl", "facts");
    const add = (term, value, code) => {
      dl.appendChild(el("dt", null, term));
      const dd = el("dd");
      dd.appendChild(code ? el("code", null, value) : document.createTextNode(value));
      dl.appendChild(dd);
    };
    add("Step", isNum(c.step) ? fmtInt(c.step) : "–");
    add("Path", typeof c.path === "string" && c.path ? c.path : "–", true);
    add("Pushed to", typeof c.pushed_to === "string" && c.pushed_to ? c.pushed_to : "not pushed", !!c.pushed_to);
    box.replaceChildren(dl);
  }

  function renderStatus() {
    const status = $("status");
    const banner = $("banner");
    if (unreachable) {
      status.className = "status status-down";
      setText(status, "monitor unreachable, retrying");
      banner.hidden = false;
      const since = state ? " The figures below arrived " + fmtDuration((Date.now() - receivedAt) / 1000) + " ago." : "";
      setText(banner, "Cannot reach the monitor (" + lastError + ")." + since);
      return;
    }
    banner.hidden = true;
    if (!state) {
      status.className = "status status-pending";
      setText(status, waiting ? "waiting for the monitor's first refresh" : "connecting…");
      return;
    }
    const age = isNum(state.updated_at) ? Math.max(0, serverNow() - state.updated_at) : null;
    const refresh = isNum(state.refresh_seconds) ? state.refresh_seconds : 10;
    const stale = age != null && age > 3 * refresh + 10;
    status.className = "status " + (stale ? "status-stale" : "status-ok");
    setText(status, age == null ? "updated: unknown" : "updated " + fmtDuration(age) + " ago");
  }

  function render(s) {
    renderHeader(s);
    renderIndicators(s);
    updateCharts(s.history);
    renderLeaderboard(s);
    renderPreviews(s);
    renderCheckpoint(s);
    renderStatus();
    renders += 1;
    document.body.dataset.renders = String(renders);
  }

  // ---- polling ---------------------------------------------------------------------------------------------

  function isReady(s) {
    return typeof s.run_id === "string" && s.run_id !== "";
  }

  function pollSeconds() {
    const r = state && isNum(state.refresh_seconds) ? state.refresh_seconds : 10;
    return Math.max(MIN_POLL_SECONDS, r);
  }

  async function fetchStateWithClock() {
    const { state: s, serverDate } = await tttMonitor.fetchState();
    // The header has whole seconds: +0.5 s is the middle of the second it names.
    clockOffset = isNum(serverDate) ? serverDate / 1000 + 0.5 - Date.now() / 1000 : 0;
    if (Math.abs(clockOffset) < 1.5) clockOffset = 0; // same clock, give or take the header's rounding
    return s;
  }

  async function poll() {
    let s = null;
    try {
      s = await fetchStateWithClock();
    } catch (err) {
      unreachable = true;
      lastError = err && err.name === "AbortError" ? "timed out" : String((err && err.message) || err);
      renderStatus();
    }
    if (s && !isReady(s)) {
      // The monitor is up but has not refreshed yet (it serves {} until then): ask again soon.
      unreachable = false;
      waiting = true;
      renderStatus();
      setTimeout(poll, MIN_POLL_SECONDS * 1000);
      return;
    }
    if (s) {
      unreachable = false;
      state = s;
      receivedAt = Date.now();
      try {
        render(s);
      } catch (err) {
        console.error("dashboard: could not render the state", err);
      }
    }
    setTimeout(poll, pollSeconds() * 1000);
  }

  let resizePending = false;
  function scheduleResize() {
    if (resizePending) return;
    resizePending = true;
    requestAnimationFrame(() => {
      resizePending = false;
      resizeCharts();
    });
  }

  if (typeof ResizeObserver === "function") {
    new ResizeObserver(scheduleResize).observe($("charts"));
  } else {
    window.addEventListener("resize", scheduleResize);
  }
  setInterval(renderStatus, 1000);
  poll();
})();
