// asyncroll's run report: the page of asyncroll.report.build. Plain JavaScript, no library and
// no network: data/run.js calls asyncrollReport.run(summary) and each data/chunk-NNNNN.js,
// added as a <script> when one of its groups is opened, calls asyncrollReport.chunk(...).
// The state of the view (step, group, sample, colour mode, page) lives in the URL's hash, so
// a link (or the browser test) opens a sample directly: index.html#group=12&sample=3&mode=gap.
"use strict";
(function () {
  var R = {
    data: null, chunks: {}, pending: {}, waiters: {}, uidIndex: {}, byStep: {}, steps: [],
    state: { page: 0, step: null, group: null, sample: null, mode: "mask" },
    busy: Promise.resolve(),
  };
  var PAGE_ROWS = 20;
  var MAX_RESULTS = 200;
  var GAP_SCALE = 0.5; // nats of |trainer - sampler| drawn at full colour
  var COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22", "#17becf"];
  var LAG_COLOURS = ["#c8f0c8", "#fff0a0", "#ffd199", "#ffb0b0"];
  var PANELS = [
    { title: "reward", match: function (k) {
      return k === "rollout/reward_mean" || k.indexOf("rollout/reward_mean_by_task/") === 0; } },
    { title: "evaluation", match: function (k) {
      return /^eval\/(pass@\d+|reward_mean)$/.test(k); } },
    { title: "staleness (versions behind)", match: function (k) {
      return k === "rollout/staleness_mean" || k === "rollout/staleness_max"; } },
    { title: "dropped groups per step, by reason", nonzero: true, match: function (k) {
      return k.indexOf("rollout/failed_groups_by_reason/") === 0 ||
        k === "rollout/filtered_groups" || k === "rollout/expired_groups"; } },
    { title: "generated tokens/s", match: function (k) { return k === "rollout/tokens_per_s"; } },
    { title: "trainer's waiting share", zero: true, match: function (k) {
      return k === "rollout/wait_ratio"; } },
  ];

  window.asyncrollReport = {
    run: function (summary) { R.data = summary; start(); },
    chunk: function (n, groups, train) {
      var byUid = {};
      groups.forEach(function (g) {
        g.samples.forEach(function (s) { s.train = null; });
        byUid[g.uid] = g;
      });
      train.forEach(function (t) { // a resumed run's later line wins
        var g = byUid[t.uid];
        var s = g && g.samples.find(function (x) { return x.index === t.index; });
        if (s) { s.train = t; }
      });
      R.chunks[n] = byUid;
      if (R.waiters[n]) { R.waiters[n](byUid); }
    },
    // A promise that settles when the view has drawn what it was last asked for (a group
    // waits for its chunk's script): what a script driving the page (the browser test) awaits.
    settled: function () { return R.busy; },
    // Show sample `sample` of group `uid` (and its step): a promise, settled once drawn.
    open: function (uid, sample) {
      openStep(R.data.groups.near[R.uidIndex[uid]]);
      return openGroup(uid, sample);
    },
    // The sample on screen as the page decoded it (NaN: none).
    view: function () {
      var s = R.sample, a = R.arrays;
      return s ? { index: s.index, tokens: s.tokens, logprobs: Array.from(a.logprobs),
        trainer: a.trainer ? Array.from(a.trainer) : null } : null;
    },
  };

  // -- helpers ---------------------------------------------------------------------------------
  function $(id) { return document.getElementById(id); }
  function el(tag, attrs, children) {
    var e = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      if (k === "text") { e.textContent = attrs[k]; } else if (k === "onclick") {
        e.addEventListener("click", attrs[k]);
      } else { e.setAttribute(k, attrs[k]); }
    });
    (children || []).forEach(function (c) {
      e.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
    return e;
  }
  function esc(s) {
    return String(s).replace(/[&<>"]/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c];
    });
  }
  function fmt(v, digits) {
    if (v === null || v === undefined || Number.isNaN(v)) { return "–"; }
    if (Number.isInteger(v)) { return String(v); }
    return Number(v).toPrecision(digits || 3);
  }
  // "f4:<base64>" / "f8:<base64>": little-endian float32 / float64 (asyncroll.report.data);
  // NaN stands for a value the record holds as null.
  function floats(text) {
    if (text === null || text === undefined) { return null; }
    var bin = atob(text.slice(3));
    var bytes = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) { bytes[i] = bin.charCodeAt(i); }
    return text.slice(0, 2) === "f4" ? new Float32Array(bytes.buffer) : new Float64Array(bytes.buffer);
  }
  function table(headers, rows, onRow) {
    var body = el("tbody");
    rows.forEach(function (row, i) {
      var tr = el("tr", {}, row.cells.map(function (c) {
        return el("td", c.cls ? { class: c.cls } : {}, [c.node || String(c.text)]);
      }));
      if (row.attrs) { Object.keys(row.attrs).forEach(function (k) { tr.setAttribute(k, row.attrs[k]); }); }
      if (onRow) { tr.addEventListener("click", function () { onRow(row, i); }); }
      body.appendChild(tr);
    });
    return el("table", {}, [el("thead", {}, [el("tr", {}, headers.map(function (h) {
      return el("th", { text: h });
    }))]), body]);
  }
  function rewardBars(rewards) {
    var span = el("span", { title: rewards.map(function (r) { return fmt(r); }).join(", ") });
    rewards.forEach(function (r) {
      var h = r === null ? 12 : Math.max(1, Math.round(12 * Math.min(Math.max(r, 0), 1)));
      span.appendChild(el("span", { class: r === null ? "bar none" : "bar", style: "height:" + h + "px" }));
    });
    return span;
  }
  function mean(xs) {
    var v = xs.filter(function (x) { return x !== null; });
    return v.length ? v.reduce(function (a, b) { return a + b; }, 0) / v.length : null;
  }
  function writeHash() {
    var s = R.state;
    var parts = ["page=" + s.page, "mode=" + s.mode];
    if (s.step !== null) { parts.push("step=" + s.step); }
    if (s.group !== null) { parts.push("group=" + s.group); }
    if (s.sample !== null) { parts.push("sample=" + s.sample); }
    try { history.replaceState(null, "", "#" + parts.join("&")); } catch (e) { /* file:// */ }
  }
  function readHash() {
    var out = {};
    location.hash.replace(/^#/, "").split("&").forEach(function (kv) {
      var p = kv.split("=");
      if (p[0]) { out[decodeURIComponent(p[0])] = decodeURIComponent(p[1] || ""); }
    });
    return out;
  }

  // -- start -------------------------------------------------------------------------------------
  function start() {
    var d = R.data;
    var G = d.groups;
    var seen = {};
    d.steps.step.forEach(function (s) { seen[s] = true; });
    G.uid.forEach(function (uid, i) {
      R.uidIndex[uid] = i;
      var s = G.near[i];
      (R.byStep[s] = R.byStep[s] || []).push(i);
      seen[s] = true;
    });
    R.steps = Object.keys(seen).map(Number).sort(function (a, b) { return a - b; });
    renderRun();
    renderCharts();
    document.querySelectorAll("#modes button").forEach(function (b) {
      b.addEventListener("click", function () { R.state.mode = b.dataset.mode; renderSample(); });
    });
    $("search").addEventListener("submit", function (e) { e.preventDefault(); search(); });
    $("tokens").addEventListener("mouseover", function (e) {
      var t = e.target.closest(".tok");
      if (t) { tokenInfo(Number(t.dataset.i)); }
    });
    var h = readHash();
    if (h.mode) { R.state.mode = h.mode; }
    R.state.page = Number(h.page || 0);
    if (h.group !== undefined && R.uidIndex[h.group] !== undefined) {
      var i = R.uidIndex[h.group];
      openStep(G.near[i]);
      openGroup(Number(h.group), h.sample === undefined ? null : Number(h.sample));
    } else if (h.step !== undefined) {
      openStep(Number(h.step));
    } else {
      renderSteps();
    }
  }

  function renderRun() {
    var d = R.data;
    var first = d.runs[0] || {};
    var size = d.chunks.reduce(function (a, c) { return a + c.bytes; }, 0);
    var parts = [
      "run folder " + d.run_dir,
      first.model ? "model " + first.model : null,
      first.started ? "started " + first.started : null,
      d.runs.length > 1 ? d.runs.length + " starts (resumed)" : null,
      R.steps.length + " steps",
      d.groups.uid.length + " groups",
      d.chunks.length + " data files (" + (size / 1048576).toFixed(1) + " MiB, " +
        d.steps_per_chunk + " steps each)",
      d.lines + " record lines",
    ];
    $("run").textContent = parts.filter(Boolean).join(" · ");
    if (first.config && Object.keys(first.config).length) {
      $("run").appendChild(el("div", { text: "config: " + JSON.stringify(first.config) }));
    }
  }

  // -- curves ----------------------------------------------------------------------------------
  function chart(title, keys, opts) {
    var W = 320, H = 160, L = 44, B = 18, T = 6, Rm = 8;
    var M = R.data.steps.metrics, xs = R.data.steps.step;
    var series = keys.map(function (k) { return { key: k, ys: M[k] }; });
    if (opts.nonzero) {
      series = series.filter(function (s) { return s.ys.some(function (y) { return y; }); });
    }
    var box = el("div", { class: "chart", "data-title": title }, [el("h3", { text: title })]);
    var ns = "http://www.w3.org/2000/svg";
    function svg(tag, attrs) {
      var e = document.createElementNS(ns, tag);
      Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); });
      return e;
    }
    var vals = [];
    series.forEach(function (s) { s.ys.forEach(function (y) { if (y !== null) { vals.push(y); } }); });
    if (!xs.length || !vals.length) {
      box.appendChild(el("div", { class: "empty", text: keys.length ? "all zero in this record" :
        "not in this record" }));
      return box;
    }
    var lo = Math.min.apply(null, vals), hi = Math.max.apply(null, vals);
    if (opts.zero || opts.nonzero) { lo = Math.min(lo, 0); }
    if (hi === lo) { hi = lo + 1; }
    var x0 = xs[0], x1 = xs[xs.length - 1] === x0 ? x0 + 1 : xs[xs.length - 1];
    function X(x) { return L + (x - x0) / (x1 - x0) * (W - L - Rm); }
    function Y(y) { return T + (hi - y) / (hi - lo) * (H - T - B); }
    var root = svg("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H });
    root.appendChild(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - Rm, y2: H - B }));
    root.appendChild(svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
    [[lo, H - B], [hi, T + 8]].forEach(function (p) {
      var t = svg("text", { x: L - 3, y: p[1], "text-anchor": "end" });
      t.textContent = fmt(p[0]);
      root.appendChild(t);
    });
    [[x0, "start"], [x1, "end"]].forEach(function (p) {
      var t = svg("text", { x: X(p[0]), y: H - 4, "text-anchor": p[1] });
      t.textContent = "step " + p[0];
      root.appendChild(t);
    });
    var legend = el("div");
    series.forEach(function (s, n) {
      var colour = COLOURS[n % COLOURS.length];
      var pts = [];
      s.ys.forEach(function (y, i) { if (y !== null) { pts.push(X(xs[i]).toFixed(1) + "," + Y(y).toFixed(1)); } });
      var line = svg("polyline", { class: "line", points: pts.join(" "), stroke: colour });
      var tip = svg("title", {});
      tip.textContent = s.key;
      line.appendChild(tip);
      root.appendChild(line);
      if (pts.length <= 40) {
        pts.forEach(function (p) {
          var xy = p.split(",");
          root.appendChild(svg("circle", { cx: xy[0], cy: xy[1], r: 2, fill: colour }));
        });
      }
      legend.appendChild(el("span", { class: "legend-item" }, [
        el("i", { style: "background:" + colour }), s.key.replace(/^rollout\//, "")]));
    });
    box.appendChild(root);
    box.appendChild(legend);
    return box;
  }

  function renderCharts() {
    var keys = Object.keys(R.data.steps.metrics).sort();
    var shown = {};
    PANELS.forEach(function (p) {
      var mine = keys.filter(p.match);
      mine.forEach(function (k) { shown[k] = true; });
      $("charts").appendChild(chart(p.title, mine, p));
    });
    var pick = $("metric-pick");
    keys.forEach(function (k) { pick.appendChild(el("option", { value: k, text: k })); });
    function draw() {
      $("metric-chart").replaceChildren(pick.value ? chart(pick.value, [pick.value], {}) : "");
    }
    pick.value = keys.find(function (k) { return !shown[k]; }) || keys[0] || "";
    pick.addEventListener("change", draw);
    draw();
  }

  // -- steps and groups ----------------------------------------------------------------------
  function stepRow(step) {
    var G = R.data.groups, idx = R.byStep[step] || [];
    var handed = idx.filter(function (i) { return G.step[i] !== null; });
    var rewards = [];
    handed.forEach(function (i) { rewards = rewards.concat(G.rewards[i]); });
    var at = R.data.steps.step.indexOf(step);
    return { step: step, cells: [
      { text: step, cls: "num" },
      { text: at >= 0 ? R.data.steps.version[at] : "–", cls: "num" },
      { text: at >= 0 ? fmt(R.data.steps.time_s[at]) : "–", cls: "num" },
      { text: handed.length, cls: "num" },
      { text: idx.length - handed.length, cls: "num" },
      { text: fmt(mean(rewards)), cls: "num" },
      { text: handed.reduce(function (a, i) { return a + G.tokens[i]; }, 0), cls: "num" },
    ], attrs: { "data-step": step } };
  }

  function renderSteps() {
    var pages = Math.max(1, Math.ceil(R.steps.length / PAGE_ROWS));
    var page = Math.min(Math.max(R.state.page, 0), pages - 1);
    R.state.page = page;
    var rows = R.steps.slice(page * PAGE_ROWS, (page + 1) * PAGE_ROWS).map(stepRow);
    var t = table(["step", "version", "time s", "groups", "dropped", "mean reward", "tokens"],
      rows, function (row) { openStep(row.step); });
    rows.forEach(function (row, i) {
      if (row.step === R.state.step) { t.tBodies[0].rows[i].classList.add("selected"); }
    });
    function go(p) { return function () { R.state.page = p; renderSteps(); writeHash(); }; }
    var pager = el("div", { class: "pager" }, [
      el("button", { text: "‹ previous", onclick: go(page - 1) }),
      "page " + (page + 1) + " of " + pages,
      el("button", { text: "next ›", onclick: go(page + 1) }),
    ]);
    $("steps").replaceChildren(pager, t);
  }

  function groupRow(i) {
    var G = R.data.groups;
    var status = G.step[i] === null ? "dropped: " + (G.drop_reason[i] || G.status[i]) : G.status[i];
    return { uid: G.uid[i], cells: [
      { text: G.uid[i], cls: "num" },
      { text: G.prompt_id[i] },
      { text: G.task[i] },
      { text: status, cls: "status-" + G.status[i] + (G.step[i] === null ? " dropped" : "") },
      { node: rewardBars(G.rewards[i]) },
      { text: fmt(mean(G.rewards[i])), cls: "num" },
      { text: G.tokens[i], cls: "num" },
      { text: G.prompt[i] === null ? "" : G.prompt[i], cls: "prompt" },
    ], attrs: { "data-uid": G.uid[i] } };
  }
  var GROUP_HEADERS = ["uid", "prompt id", "task", "status", "rewards", "mean", "tokens", "prompt"];

  function openStep(step) {
    R.state.step = step;
    var at = R.steps.indexOf(step);
    if (at >= 0) { R.state.page = Math.floor(at / PAGE_ROWS); }
    renderSteps();
    var idx = R.byStep[step] || [];
    $("groups-section").hidden = false;
    $("groups-title").textContent = "Step " + step + ": " + idx.length + " groups" +
      " (handed out, then those dropped while it ran)";
    var G = R.data.groups;
    idx = idx.slice().sort(function (a, b) { return (G.step[a] === null) - (G.step[b] === null); });
    $("groups").replaceChildren(table(GROUP_HEADERS, idx.map(groupRow), function (row) {
      openGroup(row.uid, null);
    }));
    writeHash();
  }

  function loadChunk(n) {
    if (R.chunks[n]) { return Promise.resolve(R.chunks[n]); }
    if (!R.pending[n]) {
      R.pending[n] = new Promise(function (resolve, reject) {
        var info = R.data.chunks.find(function (c) { return c.chunk === n; });
        if (!info) { reject(new Error("the report has no data file for chunk " + n)); return; }
        R.waiters[n] = resolve;
        var s = document.createElement("script");
        s.src = info.file;
        s.onerror = function () {
          delete R.pending[n];
          reject(new Error("could not load " + info.file + " (is the report's data/ folder there?)"));
        };
        document.body.appendChild(s);
      });
    }
    return R.pending[n];
  }

  function openGroup(uid, sample) {
    var i = R.uidIndex[uid];
    R.state.group = uid;
    R.state.sample = null;
    $("group-section").hidden = false;
    $("sample-section").hidden = true;
    $("group-title").textContent = "Group " + uid + " (loading data/chunk " + R.data.groups.chunk[i] + ")";
    $("group").replaceChildren();
    writeHash();
    R.busy = loadChunk(R.data.groups.chunk[i]).then(function (groups) {
      renderGroup(groups[uid]);
      if (sample !== null && sample !== undefined) { openSample(sample); }
    }, function (err) {
      $("group-title").textContent = "Group " + uid + ": " + err.message;
      console.error(err.message);
    });
    return R.busy;
  }

  function renderGroup(g) {
    R.current = g;
    var where = g.step === null ? "dropped (" + (g.drop_reason || g.status) + ") near step " + g.near :
      "handed out for step " + g.step;
    $("group-title").textContent = "Group " + g.uid + ", prompt " + g.prompt_id + ": " + where;
    var facts = el("div", { class: "facts", text: [
      "task " + g.task, "status " + g.status, "version " + g.version,
      "started at version " + g.start_version, "attempts " + g.attempts,
      "latency " + fmt(g.latency_s) + " s", g.prompt_tokens.length + " prompt tokens",
    ].join(" · ") });
    var parts = [facts];
    if (g.error) { parts.push(el("div", { class: "status-failed", text: "error: " + g.error })); }
    parts.push(el("pre", { class: "prompt-text", text: g.prompt_text === null ?
      "prompt tokens " + JSON.stringify(g.prompt_tokens) : g.prompt_text }));
    var rows = g.samples.map(function (s) {
      var trained = s.loss_mask ? s.loss_mask.reduce(function (a, b) { return a + b; }, 0) : s.tokens.length;
      return { index: s.index, cells: [
        { text: s.index, cls: "num" }, { text: s.status, cls: "status-" + s.status },
        { text: s.finish_reason || "–" }, { text: fmt(s.reward), cls: "num" },
        { text: s.tokens.length, cls: "num" }, { text: trained, cls: "num" },
        { text: s.turn_ends ? s.turn_ends.length : 1, cls: "num" },
        { text: s.train ? "step " + s.train.step : "–" }, { text: s.error || "" },
      ], attrs: { "data-sample": s.index } };
    });
    parts.push(table(["sample", "status", "finish", "reward", "tokens", "trained", "turns",
      "trainer", "error"], rows, function (row) { openSample(row.index); }));
    $("group").replaceChildren.apply($("group"), parts);
  }

  // -- a sample, token by token ------------------------------------------------------------
  function openSample(index) {
    var g = R.current;
    R.state.sample = index;
    R.sample = g.samples.find(function (s) { return s.index === index; }) || null;
    if (R.sample) {
      R.arrays = {
        logprobs: floats(R.sample.logprobs),
        trainer: R.sample.train ? floats(R.sample.train.logprobs) : null,
        advantages: R.sample.train ? floats(R.sample.train.advantages) : null,
      };
    }
    renderSample();
  }

  function lagColour(lag) { return LAG_COLOURS[Math.min(Math.max(lag, 0), LAG_COLOURS.length - 1)]; }
  function gapColour(d) {
    var t = Math.min(Math.abs(d) / GAP_SCALE, 1);
    var c = d > 0 ? [214, 39, 40] : [31, 119, 180];
    return "rgb(" + c.map(function (v) { return Math.round(255 + (v - 255) * t); }).join(",") + ")";
  }

  function renderSample() {
    var s = R.sample, g = R.current;
    $("sample-section").hidden = false;
    document.querySelectorAll("#modes button").forEach(function (b) {
      b.classList.toggle("on", b.dataset.mode === R.state.mode);
    });
    writeHash();
    if (!s) {
      $("sample-title").textContent = "Group " + g.uid + " has no sample " + R.state.sample;
      $("tokens").replaceChildren();
      return;
    }
    var a = R.arrays, mode = R.state.mode, n = s.tokens.length;
    var ends = {};
    (s.turn_ends || []).forEach(function (e, k) { ends[e - 1] = k + 1; });
    var html = [], gaps = [];
    for (var i = 0; i < n; i++) {
      var m = s.loss_mask ? s.loss_mask[i] : 1;
      var v = s.versions[i];
      var tr = a.trainer ? a.trainer[i] : NaN;
      var gap = tr - a.logprobs[i];
      if (!Number.isNaN(gap)) { gaps.push(Math.abs(gap)); }
      var bg = mode === "mask" ? (m ? "#cfe3ff" : "#e6e6e6") :
        mode === "version" ? lagColour(g.version - v) :
        Number.isNaN(gap) ? "#f0f0f0" : gapColour(gap);
      var piece = s.pieces ? s.pieces[i] : null;
      var text = piece === null || piece === "" ? "⟨" + s.tokens[i] + "⟩" : piece.replace(/\n/g, "↵\n");
      html.push('<span class="tok' + (m ? "" : " bridge") + '" data-i="' + i + '" data-mask="' + m +
        '" data-version="' + v + '" style="background:' + bg + '">' + esc(text) + "</span>");
      if (ends[i] !== undefined) {
        html.push('<span class="turn-end" data-turn="' + ends[i] + '" title="end of turn ' + ends[i] + '"></span>');
      }
    }
    $("tokens").innerHTML = html.join("");
    $("sample-title").textContent = "Sample " + s.index + " of group " + g.uid + " (" + n + " tokens)";
    var trained = s.loss_mask ? s.loss_mask.reduce(function (x, y) { return x + y; }, 0) : n;
    var lo = Math.min.apply(null, s.versions), hi = Math.max.apply(null, s.versions);
    $("sample-facts").textContent = [
      "reward " + fmt(s.reward), "status " + s.status, "finish " + (s.finish_reason || "–"),
      trained + " of " + n + " tokens trained", (s.turn_ends ? s.turn_ends.length : 1) + " turns",
      "versions " + (n ? lo + "–" + hi : "–") + " (group handed out at " + g.version + ")",
      s.train ? "trainer step " + s.train.step + ", mean |gap| " + fmt(mean(gaps)) +
        ", max " + fmt(gaps.length ? Math.max.apply(null, gaps) : null) : "no trainer logprobs",
    ].join(" · ");
    renderLegend(mode, s, g);
  }

  function renderLegend(mode, s, g) {
    var items = [];
    function item(colour, text, cls) {
      return el("span", { class: "legend-item" }, [el("i", { class: cls || "", style: "background:" + colour }), text]);
    }
    if (mode === "mask") {
      items = [item("#cfe3ff", "trained (loss mask 1)"),
        item("#e6e6e6", "not trained (loss mask 0: environment, tool, bridge)", "bridge")];
    } else if (mode === "version") {
      var seen = {};
      s.versions.forEach(function (v) { seen[v] = true; });
      items = Object.keys(seen).map(Number).sort(function (x, y) { return x - y; }).map(function (v) {
        return item(lagColour(g.version - v), "version " + v + " (" + (g.version - v) + " behind)");
      });
    } else {
      items = [item(gapColour(-GAP_SCALE), "trainer lower by ≥ " + GAP_SCALE),
        item("#fff", "equal"), item(gapColour(GAP_SCALE), "trainer higher by ≥ " + GAP_SCALE),
        item("#f0f0f0", "no trainer logprob")];
    }
    items.push(el("span", { class: "legend-item" }, [el("span", { class: "turn-end" }), " end of a turn"]));
    items.push(el("span", { class: "legend-item" }, [el("span", { class: "tok bridge", text: "x" }),
      " untrained span"]));
    $("legend").replaceChildren.apply($("legend"), items);
  }

  function tokenInfo(i) {
    var s = R.sample, a = R.arrays, g = R.current;
    var tr = a.trainer ? a.trainer[i] : NaN, adv = a.advantages ? a.advantages[i] : NaN;
    var turn = 1;
    (s.turn_ends || []).forEach(function (e) { if (i >= e) { turn += 1; } });
    $("token-info").textContent = [
      "token " + i + ": id " + s.tokens[i] + (s.pieces ? " " + JSON.stringify(s.pieces[i]) : ""),
      "turn " + turn, "loss mask " + (s.loss_mask ? s.loss_mask[i] : 1),
      "version " + s.versions[i] + " (" + (g.version - s.versions[i]) + " behind)",
      "sampler logprob " + fmt(a.logprobs[i], 6), "trainer logprob " + fmt(tr, 6),
      "gap " + fmt(tr - a.logprobs[i], 3), "advantage " + fmt(adv, 4),
    ].join(" · ");
  }

  // -- search ----------------------------------------------------------------------------------
  function search() {
    var G = R.data.groups;
    var q = $("q-prompt").value.trim().toLowerCase();
    var lo = $("q-min").value === "" ? -Infinity : Number($("q-min").value);
    var hi = $("q-max").value === "" ? Infinity : Number($("q-max").value);
    var byReward = $("q-min").value !== "" || $("q-max").value !== "";
    var found = [];
    for (var i = 0; i < G.uid.length; i++) {
      if (q && G.prompt_id[i].toLowerCase().indexOf(q) < 0) { continue; }
      var hits = [];
      G.rewards[i].forEach(function (r, k) { if (r !== null && r >= lo && r <= hi) { hits.push(k); } });
      if (byReward && !hits.length) { continue; }
      found.push({ i: i, hits: byReward ? hits : null });
    }
    var rows = found.slice(0, MAX_RESULTS).map(function (f) {
      var row = groupRow(f.i);
      row.cells.splice(4, 0, { text: f.hits === null ? "all" : f.hits.join(", ") });
      row.hits = f.hits;
      return row;
    });
    var headers = GROUP_HEADERS.slice();
    headers.splice(4, 0, "matching samples");
    $("results").replaceChildren(
      el("div", { id: "results-count", "data-count": found.length, text: found.length + " groups match" +
        (found.length > MAX_RESULTS ? " (the first " + MAX_RESULTS + " shown)" : "") }),
      table(headers, rows, function (row) {
        var i = R.uidIndex[row.uid];
        openStep(G.near[i]);
        openGroup(row.uid, row.hits && row.hits.length ? row.hits[0] : null);
      }));
  }
})();
