"use strict";
/* The tunewright dashboard: every number on it comes from the REST API, read with the user's own bearer token
   (kept in this tab's sessionStorage), so it shows exactly what the API shows that token. Views are hash routes:
   #/jobs[?status=S], #/jobs/{id}, #/plan. Nothing is written as HTML: every node is built from text. */

const TOKEN_KEY = "tunewright.token";
const LOSS_SCALE_KEY = "tunewright.lossScale"; // "log" or "linear": the loss chart's y axis, as last chosen
const POLL_MS = 2000; // while a job is queued or running
const IDLE_POLL_MS = 10000; // the list when nothing in it moves (a job submitted elsewhere still appears)
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const STATUSES = ["queued", "running", "succeeded", "failed", "cancelled"];
const STEP_EVENT = /^step \d+: training loss/; // one a logged step: hidden unless asked for

// --- small helpers ---------------------------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

const integer = new Intl.NumberFormat("en-US", {maximumFractionDigits: 0});
const isNum = (v) => typeof v === "number" && Number.isFinite(v);
const dash = "—";
const fmtInt = (v) => (isNum(v) ? integer.format(v) : dash);
const fmtPct = (v, digits = 1) => (isNum(v) ? `${(v * 100).toFixed(digits)}%` : dash);
const fmtLoss = (v) => (!isNum(v) ? dash : Math.abs(v) >= 100 ? v.toFixed(1) : Math.abs(v) >= 1 ? v.toFixed(3)
  : v.toPrecision(3));
const fmtUSD = (v) => (isNum(v) ? `$${v.toLocaleString("en-US", {minimumFractionDigits: 2, maximumFractionDigits: 2})}` : dash);
const fmtGiB = (v) => (isNum(v) ? `${v.toFixed(1)} GiB` : dash);

function fmtSeconds(v) {
  if (!isNum(v)) return dash;
  if (v < 1) return `${(v * 1000).toFixed(0)} ms`;
  if (v < 90) return `${v.toFixed(v < 10 ? 1 : 0)} s`;
  if (v < 5400) return `${Math.round(v / 60)} min`;
  if (v < 172800) return `${(v / 3600).toFixed(1)} h`;
  return `${(v / 86400).toFixed(1)} days`;
}

function parseTime(value) {
  if (!value) return null;
  // the API's times are UTC; SQLite gives them back without a zone
  return new Date(/[zZ]|[+-]\d\d:\d\d$/.test(value) ? value : `${value}Z`);
}

function age(value) {
  const when = parseTime(value);
  if (!when) return dash;
  const seconds = Math.max(0, (Date.now() - when.getTime()) / 1000);
  return seconds < 60 ? "just now" : `${fmtSeconds(seconds)} ago`;
}

function difference(predicted, measured) {
  if (!isNum(predicted) || !isNum(measured) || predicted === 0) return {text: dash, cls: ""};
  const gap = measured / predicted - 1;
  return {text: `${gap >= 0 ? "+" : ""}${(gap * 100).toFixed(0)}%`, cls: Math.abs(gap) < 0.1 ? "" : gap > 0 ? "over" : "under"};
}

function shortModel(source) {
  return (source || "").replace(/\/+$/, "").split("/").pop() || source;
}

function methodOf(job) {
  const method = (job.spec && job.spec.method) || {};
  // a 4-bit base as the plan loads it (auto resolved), else as the spec asks
  const quantization = (job.plan && job.plan.quantization) || (method.lora && method.lora.quantization);
  const lora = quantization === "nf4" ? "QLoRA (4-bit NF4 base)" : "LoRA";
  const light = job.plan && job.plan.optimizerState === "bf16" ? " (bf16 weights and moments)" : "";
  const fp8 = job.plan && job.plan.precision === "fp8" ? " · FP8 products" : "";
  const weights = (method.type === "lora" ? `${lora} r${(method.lora && method.lora.r) || 16}`
    : method.type ? `${method.type}${light}` : dash) + fp8;
  // the objective beside it where it is not the default (sft): DPO and its beta
  return method.objective === "dpo" ? `${weights} · DPO β ${(method.dpo && method.dpo.beta) ?? 0.1}` : weights;
}

const ordinal = (n) => `${n}${n % 100 >= 10 && n % 100 <= 20 ? "th" : {1: "st", 2: "nd", 3: "rd"}[n % 10] ?? "th"}`;

// What the plan does to fit in memory. Plans made before selective checkpointing and kept weights lack
// their fields: every block checkpointed, weights resharded.
function bandText(band) {
  return `${fmtInt(band.tokensPerSecondLow)}-${fmtInt(band.tokensPerSecondHigh)} tokens/s, ` +
    `${fmtSeconds(band.durationSecondsLow)}-${fmtSeconds(band.durationSecondsHigh)}, ` +
    `${fmtUSD(band.costUSDLow)}-${fmtUSD(band.costUSDHigh)}`;
}

function memoryLayoutOf(plan) {
  const every = plan.activationCheckpointingEvery ?? 1;
  return [
    !plan.activationCheckpointing ? "no activation checkpointing"
      : every > 1 ? `activation checkpointing (every ${ordinal(every)} block)` : "activation checkpointing",
    plan.reshardAfterForward === false ? "weights kept unsharded until backward" : null,
    plan.cpuOffload ? "states offloaded to the CPU" : null,
  ].filter(Boolean);
}

function layoutOf(plan) {
  if (!plan) return dash;
  const where = plan.device === "cpu" ? `${plan.workers} CPU worker${plan.workers === 1 ? "" : "s"}`
    : `${plan.gpus} GPU${plan.gpus === 1 ? "" : "s"}${plan.nodes > 1 ? ` on ${plan.nodes} nodes` : ""}`;
  return `${plan.strategy} · ${where}`;
}

function statusBadge(status) {
  return h("span", {class: `status status-${status}`, dataset: {status}}, status);
}

function announce(text) {
  const live = document.getElementById("live");
  live.textContent = "";
  // a change of text is what screen readers announce: set it on the next frame
  requestAnimationFrame(() => { live.textContent = text; });
}

// --- the token and the API -------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message, param, code) {
    super(message);
    Object.assign(this, {status, param, code});
  }
}

const token = () => sessionStorage.getItem(TOKEN_KEY);

function takeTokenFromFragment() {
  // `make demo` prints /ui/#token=...&to=/jobs/ID: a fragment never reaches a server or its logs; once read it
  // is moved to sessionStorage and cleared from the address bar (and the history)
  const fragment = location.hash.slice(1);
  if (!fragment.startsWith("token=")) return;
  const params = new URLSearchParams(fragment);
  if (params.get("token")) sessionStorage.setItem(TOKEN_KEY, params.get("token"));
  const to = params.get("to");
  history.replaceState(null, "", `${location.pathname}#${to && to.startsWith("/") ? to : "/jobs"}`);
}

async function api(method, path, body) {
  const headers = {Authorization: `Bearer ${token()}`};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(path, {method, headers, cache: "no-store",
                                  body: body === undefined ? undefined : JSON.stringify(body)});
  } catch (err) {
    throw new ApiError(0, `the API cannot be reached (${err.message})`);
  }
  if (response.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    signIn("The API refused this token (401): sign in again.");
    throw new ApiError(401, "invalid token");
  }
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = null; }
  if (!response.ok) {
    const error = (data && data.error) || {};
    throw new ApiError(response.status, error.message || `${response.status} ${response.statusText}`,
                       error.param, error.code);
  }
  return data;
}

// --- views and their polling -----------------------------------------------------------------------------

let view = 0; // the current view's number: a poll of a view left behind stops itself
let timer = null;
const charts = [];

function leaveView() {
  view += 1;
  clearTimeout(timer);
  timer = null;
  charts.splice(0).forEach((chart) => chart.destroy());
}

function every(ms, refresh) {
  // `refresh` returns false when there is nothing more to follow; hidden tabs are not polled
  const mine = view;
  const tick = async () => {
    if (mine !== view) return;
    if (document.visibilityState === "hidden") { timer = setTimeout(tick, ms); return; }
    let again = true;
    try { again = await refresh(); } catch (err) { if (err.status === 401) return; }
    if (mine === view && again !== false) timer = setTimeout(tick, typeof again === "number" ? again : ms);
  };
  timer = setTimeout(tick, ms);
}

function render(...nodes) {
  const main = document.getElementById("main");
  main.replaceChildren(...nodes);
  return main;
}

function markNav(name) {
  document.querySelectorAll("[data-nav]").forEach((a) => {
    if (a.dataset.nav === name) a.setAttribute("aria-current", "page"); else a.removeAttribute("aria-current");
  });
}

function route() {
  leaveView();
  const [path, query] = (location.hash.slice(1) || "/jobs").split("?");
  document.getElementById("sign-out").hidden = !token();
  if (!token()) return signIn();
  const job = path.match(/^\/jobs\/([^/]+)$/);
  if (job) return jobPage(decodeURIComponent(job[1]));
  if (path === "/plan") return planPage();
  return jobsPage(new URLSearchParams(query || ""));
}

function signIn(message) {
  leaveView();
  markNav("");
  document.getElementById("sign-out").hidden = true;
  document.title = "Sign in · tunewright";
  const input = h("input", {id: "token-input", type: "password", autocomplete: "off", spellcheck: "false",
                            "aria-describedby": "signin-error"});
  const error = h("p", {id: "signin-error", class: "error-text", role: "alert"}, message || "");
  const form = h("form", {id: "signin-form", onsubmit: async (event) => {
    event.preventDefault();
    const value = input.value.trim();
    if (!value) { error.textContent = "Paste a token first."; return; }
    sessionStorage.setItem(TOKEN_KEY, value);
    try {
      await api("GET", "/v1/jobs?limit=1");
    } catch (err) {
      if (err.status !== 401) error.textContent = err.message;
      return;
    }
    route();
  }},
  h("div", {class: "field"}, h("label", {for: "token-input"}, "API token"), input),
  h("button", {type: "submit", class: "primary"}, "Sign in"));
  render(h("section", {class: "signin panel", "aria-labelledby": "signin-title"},
    h("h1", {id: "signin-title"}, "Sign in"),
    h("p", {}, "Paste a tunewright API token: an administrator makes one with ",
      h("code", {}, "tunewright tokens create TEAM"), "; ", h("code", {}, "make demo"),
      " prints a link that signs you in."),
    form, error,
    h("p", {class: "muted"}, "The token stays in this browser tab (sessionStorage) and goes only to this API, as ",
      h("code", {}, "Authorization: Bearer"), ". You see what it may see: your tenant's jobs.")));
  input.focus();
}

// --- the jobs list ---------------------------------------------------------------------------------------

function jobsPage(query) {
  markNav("jobs");
  document.title = "Jobs · tunewright";
  const status = STATUSES.includes(query.get("status")) ? query.get("status") : "";
  const filter = h("select", {id: "status-filter", onchange: () => {
    location.hash = filter.value ? `#/jobs?status=${filter.value}` : "#/jobs";
  }}, h("option", {value: ""}, "all"), STATUSES.map((s) => h("option", {value: s, selected: s === status}, s)));
  const updated = h("span", {class: "updated", id: "jobs-updated"});
  const tbody = h("tbody");
  const table = h("table", {class: "jobs", id: "jobs-table"},
    h("caption", {class: "visually-hidden"}, "Your tenant's jobs, newest first"),
    h("thead", {}, h("tr", {}, ["Job", "Model", "Method", "Status", "Strategy", "Cost so far", "Age"].map(
      (name) => h("th", {scope: "col"}, name)))),
    tbody);
  const empty = h("p", {class: "panel", id: "jobs-empty", hidden: true});
  const more = h("p", {class: "muted", hidden: true}, "The newest 100 are shown; ", h("code", {}, "tunewright jobs"),
                 " pages through the rest.");
  const error = h("p", {class: "panel notice bad", role: "alert", hidden: true});
  const listed = h("div", {class: "table-wrap panel jobs-panel"}, table);
  render(h("section", {"aria-labelledby": "jobs-title"},
    h("div", {class: "toolbar"}, h("h1", {id: "jobs-title"}, "Jobs"),
      h("label", {for: "status-filter"}, "Status"), filter, updated),
    error, listed, empty, more));

  const seen = new Map(); // job id -> status last shown, to announce changes
  const refresh = async () => {
    let page;
    try {
      page = await api("GET", `/v1/jobs?limit=100${status ? `&status=${status}` : ""}`);
      error.hidden = true;
    } catch (err) {
      error.hidden = false;
      error.textContent = `Could not read the jobs: ${err.message}`;
      return IDLE_POLL_MS;
    }
    updateJobRows(tbody, page.data, seen);
    listed.hidden = page.data.length === 0;
    empty.hidden = page.data.length > 0;
    empty.replaceChildren(status ? `No ${status} jobs.` : "No jobs yet. Submit one with ",
      status ? "" : h("code", {}, "tunewright submit job.yaml"), status ? "" : " (or POST /v1/jobs); see what it would run on the ",
      status ? "" : h("a", {href: "#/plan"}, "Plan"), status ? "" : " page first.");
    more.hidden = !page.hasMore;
    updated.textContent = `updated ${new Date().toLocaleTimeString()}`;
    return page.data.some((job) => !TERMINAL.has(job.status)) ? POLL_MS : IDLE_POLL_MS;
  };
  refresh().catch(() => IDLE_POLL_MS).then((next) => every(next, refresh));
}

function jobCells(job) {
  const p = job.progress || {};
  const cost = (job.telemetry || {}).costUSD;
  const progress = job.status === "running" || (job.status === "queued" && p.step) ?
    h("div", {class: "progress"},
      h("progress", {max: p.totalSteps || 1, value: p.totalSteps ? p.step : 0,
                     "aria-label": `${job.id}: step ${p.step} of ${p.totalSteps || "?"}`}),
      h("span", {class: "muted"}, `${fmtInt(p.step)}/${p.totalSteps ? fmtInt(p.totalSteps) : "?"}`,
        isNum(p.percent) ? ` · ${p.percent.toFixed(0)}%` : "",
        job.status === "running" && isNum(p.etaSeconds) ? ` · ETA ${fmtSeconds(p.etaSeconds)}` : "")) : null;
  return [
    ["Job", h("a", {href: `#/jobs/${encodeURIComponent(job.id)}`, class: "wrap"}, job.id)],
    ["Model", h("span", {title: job.model, class: "wrap"}, shortModel(job.model))],
    ["Method", methodOf(job)],
    ["Status", h("div", {}, statusBadge(job.status), progress)],
    ["Strategy", layoutOf(job.plan)],
    ["Cost so far", h("span", {title: cost === null || cost === undefined ? "the pool has no price, or nothing held yet" : ""},
                      fmtUSD(cost))],
    ["Age", h("span", {title: parseTime(job.createdAt)?.toISOString() || ""}, age(job.createdAt))],
  ];
}

function updateJobRows(tbody, jobs, seen) {
  const rows = new Map([...tbody.children].map((row) => [row.dataset.jobId, row]));
  const ordered = jobs.map((job) => {
    const signature = JSON.stringify([job.status, job.progress, job.telemetry && job.telemetry.costUSD, job.plan && job.plan.strategy,
                                      age(job.createdAt)]);
    let row = rows.get(job.id);
    if (!row || row.dataset.signature !== signature) {
      const fresh = h("tr", {dataset: {jobId: job.id, status: job.status, signature}},
        jobCells(job).map(([label, value], index) => h(index === 0 ? "th" : "td",
          {"data-label": label, scope: index === 0 ? "row" : undefined}, value)));
      if (row) row.replaceWith(fresh);
      row = fresh;
    }
    if (seen.has(job.id) && seen.get(job.id) !== job.status) announce(`${job.id} is now ${job.status}`);
    seen.set(job.id, job.status);
    return row;
  });
  tbody.replaceChildren(...ordered);
}

// --- charts (uPlot) --------------------------------------------------------------------------------------

function palette() {
  const css = getComputedStyle(document.documentElement);
  const v = (name) => css.getPropertyValue(name).trim();
  return {text: v("--muted"), grid: v("--grid"), series: [v("--chart-1"), v("--chart-2"), v("--chart-3"), v("--chart-4")]};
}

class Chart {
  /* One figure: a uPlot of series against the step, its text summary, and `data-points` (the steps it holds)
     and `data-series-points` (each series' non-empty points, by label) read from the plot's own data.
     `logKey`: the first axis may be logarithmic, switched beside the title and remembered in localStorage under
     that key; `data-scale` says which the plot draws. */
  constructor({id, title, series, axes, summary, empty, logKey}) {
    Object.assign(this, {title, series, axes, logKey, summaryOf: summary, emptyText: empty, plot: null, data: null,
                         log: Boolean(logKey) && localStorage.getItem(logKey) === "log"});
    this.area = h("div", {class: "chart-area"});
    this.summary = h("p", {class: "chart-summary", id: `${id}-summary`});
    const toggle = logKey ? h("label", {class: "scale-toggle"},
      h("input", {type: "checkbox", id: `${id}-log`, checked: this.log,
                  onchange: (event) => this.setLog(event.currentTarget.checked)}), " log scale") : null;
    this.figure = h("figure", {class: "chart", id, role: "group", "aria-label": title, "aria-describedby": `${id}-summary`,
                               dataset: {points: "0", seriesPoints: "{}"}},
      h("figcaption", {}, h("span", {}, title), toggle), this.area, this.summary);
    this.resize = new ResizeObserver(() => this.plot && this.plot.setSize(this.size()));
    this.resize.observe(this.area);
    charts.push(this);
  }

  size() { return {width: Math.max(200, this.area.clientWidth), height: 220}; }

  options() {
    const colors = palette();
    const axis = (extra) => ({stroke: colors.text, grid: {stroke: colors.grid, width: 1}, ticks: {stroke: colors.grid, width: 1},
                              ...extra});
    return {
      ...this.size(),
      scales: {x: {time: false}, ...Object.fromEntries(this.axes.map((a, i) => [a.scale,
        this.log && i === 0 ? {distr: 3, log: 10} : a.range ? {range: a.range} : {}]))},
      axes: [axis({label: "step"}), ...this.axes.map((a, i) => axis({scale: a.scale, side: i === 0 ? 3 : 1, label: a.label,
                                                                     // uPlot's own tick labels unless the unit needs saying
                                                                     ...(a.format ? {values: (u, ticks) => ticks.map(a.format)} : {}),
                                                                     grid: {show: i === 0, stroke: colors.grid, width: 1},
                                                                     size: 60}))],
      series: [{label: "step"}, ...this.series.map((s, i) => ({
        label: s.label, scale: s.scale, stroke: colors.series[i % colors.series.length], width: 2, spanGaps: true,
        dash: s.dash, points: s.points ? {show: true, size: s.line === false ? 7 : 6} : {},
        ...(s.line === false ? {paths: () => null} : {}), // measured now and then: points, nothing drawn between
      }))],
      legend: {show: true, live: false}, // the series' names; values are read on the axes and in the summary
      cursor: {drag: {x: true, y: false}},
    };
  }

  update(data) {
    this.data = data;
    const counts = Object.fromEntries(this.series.map((s, i) => [s.label, data[i + 1].filter(isNum).length]));
    this.figure.dataset.points = String(data[0].length);
    this.figure.dataset.seriesPoints = JSON.stringify(counts);
    // empty: the summary (the figure's description) says so, once; no plot area above it
    this.summary.textContent = data[0].length ? this.summaryOf(data) : this.emptyText;
    this.area.hidden = !data[0].length;
    if (!data[0].length) this.destroyPlot();
    else if (this.plot) this.plot.setData(data);
    else this.draw();
  }

  draw() {
    this.destroyPlot();
    this.plot = new uPlot(this.options(), this.data, this.area);
    if (this.logKey) this.figure.dataset.scale = this.plot.scales[this.axes[0].scale].distr === 3 ? "log" : "linear";
  }

  restyle() { // light and dark: the colours are read again
    if (this.plot) this.draw();
  }

  setLog(on) {
    this.log = on;
    localStorage.setItem(this.logKey, on ? "log" : "linear");
    if (this.plot) this.draw();
  }

  destroyPlot() { if (this.plot) { this.plot.destroy(); this.plot = null; } }
  destroy() { this.destroyPlot(); this.resize.disconnect(); }
}

matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => charts.forEach((c) => c.restyle()));

function aligned(steps, ...columns) {
  // uPlot plots columns over one x array: every series' steps, sorted, with nulls where a series has none
  const xs = [...new Set(steps.flat())].sort((a, b) => a - b);
  const index = new Map(xs.map((x, i) => [x, i]));
  return [xs, ...columns.map(([at, values]) => {
    const out = new Array(xs.length).fill(null);
    at.forEach((x, i) => { out[index.get(x)] = isNum(values[i]) ? values[i] : null; });
    return out;
  })];
}

const first = (values) => values.find(isNum);
const last = (values) => [...values].reverse().find(isNum);
const median = (values) => { // as the API's (Python's statistics.median): an even count averages its middle two
  const sorted = values.filter(isNum).sort((a, b) => a - b);
  const middle = Math.floor(sorted.length / 2);
  return !sorted.length ? null : sorted.length % 2 ? sorted[middle] : (sorted[middle - 1] + sorted[middle]) / 2;
};

function lossChart() {
  return new Chart({
    id: "chart-loss", title: "Loss", empty: "No step logged yet.", logKey: LOSS_SCALE_KEY,
    axes: [{scale: "loss", label: "loss"}],
    series: [{label: "training loss", scale: "loss"},
             {label: "validation loss", scale: "loss", points: true, line: false}],
    summary: ([, train, valid]) => {
      const trained = train.filter(isNum).length, evaluated = valid.filter(isNum).length;
      return `Training loss ${fmtLoss(first(train))} → ${fmtLoss(last(train))} over ${trained} logged steps` +
        (evaluated ? `; validation loss ${fmtLoss(first(valid))} → ${fmtLoss(last(valid))} over ${evaluated} evaluations.`
          : "; no validation set evaluated yet.");
    },
  });
}

function throughputChart() {
  return new Chart({
    id: "chart-throughput", title: "Throughput: tokens/s and MFU", empty: "No step logged yet.",
    axes: [{scale: "tps", label: "tokens/s"},
           {scale: "mfu", label: "MFU", format: (v) => fmtPct(v, 0), range: [0, 1]}],
    series: [{label: "tokens/s", scale: "tps"}, {label: "MFU", scale: "mfu"}],
    summary: ([, tps, mfu]) => `Trained tokens/s: median ${fmtInt(median(tps))}, last ${fmtInt(last(tps))} over ` +
      `${tps.filter(isNum).length} logged steps; ` + (mfu.some(isNum) ? `MFU median ${fmtPct(median(mfu))}.`
        : "MFU not measured (it needs the plan's predictions: none on the CPU)."),
  });
}

function communicationChart() {
  return new Chart({
    id: "chart-comm", title: "Communication and GPU busy share, per profiler window",
    empty: "No profiler window measured yet (the first is at steps 3-4).",
    axes: [{scale: "share", label: "share of the step", format: (v) => fmtPct(v, 0), range: [0, 1]}],
    series: [{label: "communication", scale: "share", points: true},
             {label: "exposed communication", scale: "share", points: true, dash: [6, 4]},
             {label: "GPU busy", scale: "share", points: true}],
    summary: ([steps, total, exposed, busy]) => `${steps.length} profiler window${steps.length === 1 ? "" : "s"}; ` +
      `the last, at step ${steps[steps.length - 1]}: ${fmtPct(last(total))} of the step in collectives, ` +
      `${fmtPct(last(exposed))} not hidden by compute; ` + (busy.some(isNum) ? `GPU busy ${fmtPct(last(busy))}.`
        : "GPU busy share not measured (no GPU kernels: the CPU)."),
  });
}

function gpuChart(unavailable) {
  return new Chart({
    id: "chart-gpu", title: "GPU utilization, per logged step", empty: "No step logged yet.",
    axes: [{scale: "share", label: "share of the step", format: (v) => fmtPct(v, 0), range: [0, 1]}],
    series: [{label: "SM-active", scale: "share"}, {label: "tensor-active", scale: "share"},
             {label: "DRAM bandwidth", scale: "share", dash: [6, 4]},
             {label: "kernel-active", scale: "share", dash: [2, 3]}],
    summary: ([, sm, tensor, dram, kernel]) => (sm.some(isNum)
      ? `NVML GPM: SM-active median ${fmtPct(median(sm))}, tensor-active ${fmtPct(median(tensor))}, DRAM ` +
        `bandwidth ${fmtPct(median(dram))}; kernel-active ${fmtPct(median(kernel))} (NVML utilization.gpu: ` +
        "any kernel running, however small)."
      : `SM-active not measured: ${unavailable() || "no step has reported it yet"}.`),
  });
}

function preferenceChart() {
  // dpo's step records carry these; an sft job's never do, and its page has no such chart
  return new Chart({
    id: "chart-preference", title: "Preference: reward margin and accuracy", empty: "No step logged yet.",
    axes: [{scale: "margin", label: "reward margin"},
           {scale: "accuracy", label: "preference accuracy", format: (v) => fmtPct(v, 0), range: [0, 1]}],
    series: [{label: "reward margin", scale: "margin"}, {label: "preference accuracy", scale: "accuracy"}],
    summary: ([, margin, accuracy]) => `Reward margin (chosen less rejected) ${fmtLoss(first(margin))} → ` +
      `${fmtLoss(last(margin))}; preference accuracy (pairs whose chosen answer has the higher reward) ` +
      `${fmtPct(first(accuracy))} → ${fmtPct(last(accuracy))} over ${margin.filter(isNum).length} logged steps.`,
  });
}

// --- the job page ----------------------------------------------------------------------------------------

function jobPage(jobId) {
  markNav("jobs");
  document.title = `${jobId} · tunewright`;
  const statusSlot = h("span", {id: "job-status"});
  const cancelButton = h("button", {type: "button", class: "danger", id: "cancel-job", hidden: true}, "Cancel job");
  const head = h("div", {class: "job-head"}, h("h1", {id: "job-title"}, jobId), statusSlot, cancelButton);
  const facts = h("p", {class: "facts"});
  const progress = h("div", {class: "job-progress"});
  const problem = h("div", {class: "panel notice bad", role: "alert", hidden: true});
  const figures = h("dl", {class: "figures", id: "figures"});
  const evaluationPanel = h("section", {class: "panel", id: "evaluation", "aria-labelledby": "evaluation-title", hidden: true});
  let gpuUnavailable = null;  // the runtime's reason, shown where SM-active is missing
  const loss = lossChart(), throughput = throughputChart(), comm = communicationChart();
  const gpu = gpuChart(() => gpuUnavailable);
  const preference = preferenceChart();
  const preferencePanel = h("div", {class: "panel", id: "preference", hidden: true}, preference.figure);
  // every chart but one is over the logged steps: before the first, the page says so once, not in each
  const chartGrid = h("div", {class: "grid", id: "charts", hidden: true},
    h("div", {class: "panel"}, loss.figure), h("div", {class: "panel"}, throughput.figure),
    h("div", {class: "panel"}, comm.figure), h("div", {class: "panel"}, gpu.figure), preferencePanel);
  const noSteps = h("p", {class: "panel muted", id: "charts-empty", hidden: true});
  const planPanel = h("section", {class: "panel", id: "plan", "aria-labelledby": "plan-title"});
  const diagnosisPanel = h("section", {class: "panel", id: "diagnosis", "aria-labelledby": "diagnosis-title"});
  const modelPanel = h("section", {class: "panel", id: "trained-model", "aria-labelledby": "model-title"});
  const checkpointsPanel = h("section", {class: "panel", id: "checkpoints", "aria-labelledby": "checkpoints-title"});
  const stepToggle = h("input", {type: "checkbox", id: "show-step-events"});
  const stepCount = h("span");
  const eventRows = h("tbody");
  const eventsPanel = h("section", {class: "panel", id: "events", "aria-labelledby": "events-title"},
    h("h2", {id: "events-title"}, "Events"),
    h("p", {}, stepToggle, " ", h("label", {for: "show-step-events"}, "Show each step's loss ", stepCount)),
    h("div", {class: "table-wrap scroll"}, h("table", {id: "events-table"},
      h("thead", {}, h("tr", {}, h("th", {scope: "col"}, "When"), h("th", {scope: "col"}, "Event"))), eventRows)));
  const logs = h("pre", {class: "log", id: "log-lines", tabindex: "0", "aria-label": "the run's last lines"});
  const logPanel = h("details", {class: "panel", id: "logs"}, h("summary", {}, "Run log (last 200 lines)"), logs);
  const page = h("article", {"aria-labelledby": "job-title", id: "job-page", dataset: {state: "loading"}},
    h("p", {class: "crumbs"}, h("a", {href: "#/jobs"}, "Jobs"), " / ", jobId),
    head, facts, progress, problem, figures, evaluationPanel, noSteps, chartGrid,
    h("div", {class: "sections"}, planPanel, diagnosisPanel, modelPanel, h("div", {class: "grid"}, checkpointsPanel, eventsPanel),
      logPanel));
  render(page);

  const events = new Map(); // id -> event: the first read takes many, each refresh the newest
  let lastStatus = null, job = null, artifactsRead = false;
  stepToggle.addEventListener("change", () => drawEvents());

  cancelButton.addEventListener("click", async () => {
    if (!confirm(`Cancel ${jobId}? Its run is stopped and its GPUs freed; it cannot be resumed.`)) return;
    cancelButton.disabled = true;
    cancelButton.textContent = "Cancelling…";
    try {
      job = await api("POST", `/v1/jobs/${encodeURIComponent(jobId)}/cancel`);
      drawJob(job);
      announce(`${jobId} is now ${job.status}`);
      await refresh();
    } catch (err) {
      problem.hidden = false;
      problem.replaceChildren(h("p", {}, `Cancel refused: ${err.message}`));
      cancelButton.disabled = false;
      cancelButton.textContent = "Cancel job";
    }
  });

  logPanel.addEventListener("toggle", () => { if (logPanel.open) readLogs(); });
  async function readLogs() {
    try {
      const lines = (await api("GET", `/v1/jobs/${encodeURIComponent(jobId)}/logs?lines=200`)).data;
      logs.textContent = lines.length ? lines.join("\n") : "No output yet (the run has not started).";
    } catch (err) {
      logs.textContent = `Could not read the log: ${err.message}`;
    }
  }

  function drawJob(j) {
    const p = j.progress || {};
    page.dataset.state = "ready";
    page.dataset.status = j.status;
    cancelButton.hidden = TERMINAL.has(j.status);
    statusSlot.replaceChildren(statusBadge(j.status));
    const started = parseTime(j.startedAt), finished = parseTime(j.finishedAt);
    facts.replaceChildren(`${shortModel(j.model)} · ${methodOf(j)} · ${layoutOf(j.plan)} · submitted ${age(j.createdAt)}`,
      started ? ` · ${finished ? "ran" : "running for"} ${fmtSeconds(((finished || new Date()) - started) / 1000)}` : "",
      h("br"), h("span", {title: "the model it started from"}, j.model));
    progress.replaceChildren(h("div", {class: "progress"},
      h("progress", {max: p.totalSteps || 1, value: p.totalSteps ? p.step : 0, id: "job-progress-bar",
                     "aria-label": `step ${p.step} of ${p.totalSteps || "unknown"}`}),
      h("span", {}, `step ${fmtInt(p.step)} of ${p.totalSteps ? fmtInt(p.totalSteps) : "?"}`,
        isNum(p.percent) ? ` (${p.percent.toFixed(0)}%)` : "",
        j.status === "running" && isNum(p.etaSeconds) ? ` · ETA ${fmtSeconds(p.etaSeconds)}` : "",
        j.status === "queued" ? " · waiting for the workers" : "")));
    problem.hidden = !j.error;
    if (j.error) {
      problem.replaceChildren(h("h2", {}, `Failed: ${j.error.code}`), h("p", {class: "explanation"}, j.error.message),
        h("p", {class: "muted"}, "The run's own output is in the run log below; what happened, in the events."));
    }
    if (lastStatus && lastStatus !== j.status) announce(`${j.id} is now ${j.status}`);
    lastStatus = j.status;
  }

  function drawFigures(j, t) {
    const latest = (t && t.latest) || {};
    const p = j.progress || {};
    const figure = (label, value, note, id) => h("div", {}, h("dt", {}, label), h("dd", {id}, value, note ? h("small", {}, note) : null));
    figures.replaceChildren(
      figure("Loss", fmtLoss(p.loss), `step ${fmtInt(p.step)}`, "figure-loss"),
      figure("Tokens/s (median)", fmtInt(latest.tokensPerSecondMedian), `${fmtInt(p.trainedTokens)} trained`, "figure-tps"),
      figure("MFU", fmtPct(latest.mfu), latest.mfu === null || latest.mfu === undefined ? "needs a prediction" : "measured", "figure-mfu"),
      figure("Communication", fmtPct(latest.commShare), isNum(latest.commShareExposed)
        ? `${fmtPct(latest.commShareExposed)} exposed` : "no window yet", "figure-comm"),
      figure("Goodput", fmtPct(latest.goodput, 0), "steps / time held", "figure-goodput"),
      figure("Cost so far", fmtUSD(latest.costUSD), isNum(latest.projectedCostUSD) ? `${fmtUSD(latest.projectedCostUSD)} projected`
        : latest.costUSD === null || latest.costUSD === undefined ? "the pool has no price" : "", "figure-cost"));
  }

  function drawEvaluation(j, t) {
    // before training and after it, as the run's end reported them (with how many answers exact match scored);
    // until it ends, the evaluations so far
    const evaluations = t.evaluations || [];
    const result = j.result || {};
    const latest = evaluations[evaluations.length - 1];
    const before = result.evalBefore ?? evaluations.find((e) => e.step === 0);
    const after = result.evalAfter ?? (latest && latest.step > 0 ? latest : null);
    const examples = after?.exactMatchExamples ?? before?.exactMatchExamples;
    const points = (v) => `${v >= 0 ? "+" : "−"}${Math.abs(v * 100).toFixed(1)} points`;
    const rows = [
      ["Validation loss", "valLoss", fmtLoss, (v) => `${v >= 0 ? "+" : "−"}${fmtLoss(Math.abs(v))}`],
      ["Preference accuracy", "preferenceAccuracy", fmtPct, points],  // dpo: held-out pairs ranked right
      ["Reward margin", "rewardMargin", fmtLoss, (v) => `${v >= 0 ? "+" : "−"}${fmtLoss(Math.abs(v))}`],  // dpo
      ["Token accuracy", "valTokenAccuracy", fmtPct, points],
      [isNum(examples) ? `Exact match (${fmtInt(examples)} examples)` : "Exact match", "exactMatch", fmtPct, points],
    ].filter(([, key]) => isNum(before?.[key]) || isNum(after?.[key]));
    evaluationPanel.hidden = !rows.length;
    if (!rows.length) { evaluationPanel.replaceChildren(); return; }
    evaluationPanel.replaceChildren(h("h2", {id: "evaluation-title"}, "Evaluation: before → after"),
      h("div", {class: "table-wrap"}, h("table", {id: "evaluation-table"},
        h("caption", {class: "visually-hidden"}, "The validation set's scores before training and after"),
        h("thead", {}, h("tr", {}, h("th", {scope: "col"}, "Metric"), h("th", {scope: "col", class: "num"}, "Before training"),
          h("th", {scope: "col", class: "num"}, result.evalAfter ? `After training (step ${fmtInt(result.steps)})`
            : after ? `Latest (step ${fmtInt(after.step)})` : "After training"),
          h("th", {scope: "col", class: "num"}, "Change"))),
        h("tbody", {}, rows.map(([name, key, format, change]) => h("tr", {dataset: {metric: key}},
          h("th", {scope: "row"}, name), h("td", {class: "num"}, format(before?.[key])), h("td", {class: "num"}, format(after?.[key])),
          h("td", {class: "num"}, isNum(before?.[key]) && isNum(after?.[key]) ? change(after[key] - before[key]) : dash)))))));
  }

  function drawCharts(j, t) {
    const series = t.series || [];
    chartGrid.hidden = !series.length;
    noSteps.hidden = series.length > 0;
    const ended = {failed: "failed", cancelled: "was cancelled", succeeded: "ended"}[j.status];
    noSteps.textContent = series.length ? "" : `No step logged yet. ${ended ? `The job ${ended} before its first logged step.`
      : "The charts start with the first one."}`;
    loss.update(aligned([series.map((s) => s.step), (t.evaluations || []).map((e) => e.step)],
                        [series.map((s) => s.step), series.map((s) => s.loss)],
                        [(t.evaluations || []).map((e) => e.step), (t.evaluations || []).map((e) => e.valLoss)]));
    throughput.update(aligned([series.map((s) => s.step)], [series.map((s) => s.step), series.map((s) => s.tokensPerSecond)],
                              [series.map((s) => s.step), series.map((s) => s.mfu)]));
    const windows = t.comm || [];
    const steps = windows.map((w) => w.step);
    comm.update(aligned([steps], [steps, windows.map((w) => w.commShare)], [steps, windows.map((w) => w.commShareExposed)],
                        [steps, windows.map((w) => w.gpuBusyShare)]));
    gpuUnavailable = t.latest?.smActiveUnavailable;
    const at = series.map((s) => s.step);
    gpu.update(aligned([at], [at, series.map((s) => s.smActive)], [at, series.map((s) => s.tensorActive)],
                       [at, series.map((s) => s.dramBandwidth)], [at, series.map((s) => s.kernelActive)]));
    // dpo: shown once a step reports it (drawn after it is shown, so that it takes the panel's width)
    preferencePanel.hidden = !series.some((s) => isNum(s.rewardMargin) || isNum(s.preferenceAccuracy));
    if (!preferencePanel.hidden) {
      preference.update(aligned([at], [at, series.map((s) => s.rewardMargin)], [at, series.map((s) => s.preferenceAccuracy)]));
    }
  }

  function drawPlan(j, t, diagnosis) {
    const plan = j.plan;
    if (!plan) {
      planPanel.replaceChildren(h("h2", {id: "plan-title"}, "Plan"), h("p", {}, "Not planned yet."));
      return;
    }
    const predicted = plan.predicted;
    const latest = (t && t.latest) || {};
    const peaks = ((t && t.series) || []).map((s) => s.peakMemoryGiB).filter(isNum);
    const started = parseTime(j.startedAt), finished = parseTime(j.finishedAt);
    const elapsed = started ? ((finished || new Date()) - started) / 1000 : null;
    const duration = finished ? elapsed : isNum(elapsed) && isNum(j.progress.etaSeconds) ? elapsed + j.progress.etaSeconds : null;
    const rows = [
      ["Tokens/s", predicted?.tokensPerSecond, latest.tokensPerSecond, fmtInt, "latest step"],
      ["MFU", predicted?.mfu, latest.mfu, (v) => fmtPct(v), "latest step"],
      ["Step time", predicted?.stepSeconds, diagnosis?.measuredStepSeconds, fmtSeconds, "median of recent steps"],
      ["Communication share", predicted?.commShare, latest.commShare, (v) => fmtPct(v), "last profiler window"],
      ["Exposed communication", predicted?.exposedCommShare, latest.commShareExposed, (v) => fmtPct(v), "last profiler window"],
      ["Peak memory per GPU", predicted?.peakMemoryGiB, peaks.length ? Math.max(...peaks) : null, fmtGiB, "highest logged"],
      ["Duration", predicted?.durationSeconds, duration, fmtSeconds, finished ? "as run" : "so far + ETA"],
      ["Cost", predicted?.costUSD, finished ? latest.costUSD : latest.projectedCostUSD ?? latest.costUSD, fmtUSD,
       finished ? "as run" : "projected"],
    ];
    planPanel.replaceChildren(
      h("h2", {id: "plan-title"}, "Plan: predicted and measured"),
      h("dl", {class: "layout"},
        h("dt", {}, "Strategy"), h("dd", {id: "plan-strategy"}, layoutOf(plan)),
        h("dt", {}, "Pool"), h("dd", {}, plan.pool),
        h("dt", {}, "Batch"), h("dd", {}, `micro-batch ${plan.microBatch} × ${plan.gradAccum} accumulation × ${plan.workers} ` +
          `worker${plan.workers === 1 ? "" : "s"} = ${plan.microBatch * plan.gradAccum * plan.workers} sequences a step`),
        h("dt", {}, "Memory"), h("dd", {}, [...memoryLayoutOf(plan),
          plan.shardGroup > 1 ? `sharded over ${plan.shardGroup}` : null].filter(Boolean).join(", "))),
      // replaceChildren writes a null as the text "null": what is absent is an empty list, spread
      ...(predicted?.band ? [h("p", {class: "muted", id: "plan-band"},
        `Likely (P10-P90): ${bandText(predicted.band)}. ${predicted.band.basis}`)] : []),
      h("p", {class: "explanation", id: "plan-explanation"}, plan.explanation),
      ...(predicted ? [] : [h("p", {class: "muted"}, "Nothing is predicted for this pool (the planner models GPU pools, " +
        "not this machine's CPUs): the measured values stand alone.")]),
      h("div", {class: "table-wrap"}, h("table", {id: "predicted-measured"},
        h("caption", {class: "visually-hidden"}, "The plan's predictions beside what the run measured"),
        h("thead", {}, h("tr", {}, h("th", {scope: "col"}, "Quantity"), h("th", {scope: "col", class: "num"}, "Predicted"),
          h("th", {scope: "col", class: "num"}, "Measured"), h("th", {scope: "col", class: "num"}, "Difference"),
          h("th", {scope: "col"}, "Measured as"))),
        h("tbody", {}, rows.map(([name, want, got, format, how]) => {
          const gap = difference(want, got);
          return h("tr", {}, h("th", {scope: "row"}, name), h("td", {class: "num"}, format(want)),
            h("td", {class: "num"}, format(got)), h("td", {class: `num ${gap.cls}`}, gap.text), h("td", {class: "muted"}, how));
        })))),
      h("h3", {}, "Alternatives rejected"),
      plan.rejected.length ? h("div", {class: "table-wrap"}, h("table", {id: "rejected"},
        h("thead", {}, h("tr", {}, h("th", {scope: "col"}, "Strategy"), h("th", {scope: "col", class: "num"}, "GPUs"),
          h("th", {scope: "col"}, "Why not"))),
        h("tbody", {}, plan.rejected.map((r) => h("tr", {}, h("td", {}, r.strategy), h("td", {class: "num"}, r.gpus ?? dash),
          h("td", {class: "wrap"}, r.reason))))))
        : h("p", {class: "muted"}, plan.device === "cpu" ? "None: on the CPU the layout is DDP over the local workers."
          : "None: every alternative the planner considered was feasible; this one was the best for the objective."));
  }

  function drawDiagnosis(d) {
    const ms = (v) => (isNum(v) ? `${integer.format(v * 1000)} ms` : dash);
    const head = d.gap !== null && d.gap !== undefined
      ? `${d.status}: a step takes ${ms(d.measuredStepSeconds)} against ${ms(d.predictedStepSeconds)} predicted ` +
        `(${d.gap >= 0 ? "+" : ""}${(d.gap * 100).toFixed(0)}%)`
      : isNum(d.measuredStepSeconds) ? `${d.status}: a step takes ${ms(d.measuredStepSeconds)}` : d.status;
    diagnosisPanel.replaceChildren(h("h2", {id: "diagnosis-title"}, "Diagnosis: where a step's time goes"),
      h("p", {id: "diagnosis-status"}, head),
      ...(d.components.length ? [h("div", {class: "table-wrap"}, h("table", {},
        h("thead", {}, h("tr", {}, h("th", {scope: "col"}, "Component"), h("th", {scope: "col", class: "num"}, "Predicted"),
          h("th", {scope: "col", class: "num"}, "Measured"), h("th", {scope: "col", class: "num"}, "Share"))),
        h("tbody", {}, d.components.map((c) => h("tr", {},
          h("th", {scope: "row"}, c.name, c.name === d.dominant ? " (dominant)" : "", c.name === d.explainsGap ? " (explains the gap)" : ""),
          h("td", {class: "num"}, ms(c.predictedSeconds)), h("td", {class: "num"}, ms(c.measuredSeconds)),
          h("td", {class: "num"}, fmtPct(c.measuredShare, 0)))))))] : []),
      ...(d.findings.length ? [h("ul", {class: "findings"}, d.findings.map((f) => h("li", {}, f)))] : []));
  }

  async function drawModel(j) {
    const exported = Object.entries((j.result && j.result.export) || {}).filter(([, where]) => where);
    const title = h("h2", {id: "model-title"}, "The trained model");
    if (j.status !== "succeeded" || !exported.length) {
      modelPanel.replaceChildren(title, h("p", {class: "muted"}, j.status === "succeeded" ? "This job exported no model."
        : TERMINAL.has(j.status) ? `The job ${j.status}: nothing was exported. Its checkpoints, if any, are listed below.`
          : "When the job succeeds, its adapter (or model) is listed here, with how to download and load it."));
      return;
    }
    const [kind] = exported[0];
    const folder = `my-${kind}`;
    const files = h("div", {id: "artifacts"}, h("p", {class: "muted"}, "Reading the exported files…"));
    modelPanel.replaceChildren(title,
      h("dl", {class: "layout"}, exported.flatMap(([name, where]) => [h("dt", {}, name), h("dd", {class: "wrap"}, h("code", {}, where))])),
      h("h3", {}, "Download it"),
      h("pre", {id: "download-command"}, `tunewright download ${j.id} --dir ${folder}`),
      h("h3", {}, "Load it"),
      h("pre", {}, kind === "adapter"
        ? `from peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer\n\n` +
          `model = AutoPeftModelForCausalLM.from_pretrained("${folder}/adapter")\ntokenizer = AutoTokenizer.from_pretrained("${folder}/adapter")`
        : `from transformers import AutoModelForCausalLM, AutoTokenizer\n\n` +
          `model = AutoModelForCausalLM.from_pretrained("${folder}/${kind}")\ntokenizer = AutoTokenizer.from_pretrained("${folder}/${kind}")`),
      h("h3", {}, "Its files"), files);
    try {
      const listing = (await api("GET", `/v1/jobs/${encodeURIComponent(j.id)}/artifacts`)).data;
      files.replaceChildren(h("div", {class: "table-wrap"}, h("table", {},
        h("thead", {}, h("tr", {}, h("th", {scope: "col"}, "File"), h("th", {scope: "col", class: "num"}, "Bytes"),
          h("th", {scope: "col"}, h("span", {class: "visually-hidden"}, "Download")))),
        h("tbody", {}, listing.map((a) => h("tr", {}, h("td", {class: "wrap"}, h("code", {}, a.path)),
          h("td", {class: "num"}, fmtInt(a.bytes)),
          h("td", {}, h("button", {type: "button", dataset: {path: a.path}, "aria-label": `Download ${a.path}`,
                                  onclick: (event) => download(j.id, a.path, event.currentTarget)}, "Download"))))))));
    } catch (err) {
      files.replaceChildren(h("p", {class: "muted"}, err.message));
    }
  }

  async function download(id, path, button) {
    // the file needs the token, which a plain link cannot send: fetched, then saved from memory
    button.disabled = true;
    try {
      const response = await fetch(`/v1/jobs/${encodeURIComponent(id)}/artifacts/${path.split("/").map(encodeURIComponent).join("/")}`,
                                   {headers: {Authorization: `Bearer ${token()}`}});
      if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
      const url = URL.createObjectURL(await response.blob());
      const link = h("a", {href: url, download: path.split("/").pop()});
      document.body.append(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    } catch (err) {
      announce(`Download failed: ${err.message}`);
    } finally {
      button.disabled = false;
    }
  }

  function drawCheckpoints(list) {
    checkpointsPanel.replaceChildren(h("h2", {id: "checkpoints-title"}, "Checkpoints"),
      list.length ? h("div", {class: "table-wrap"}, h("table", {id: "checkpoints-table"},
        h("thead", {}, h("tr", {}, h("th", {scope: "col", class: "num"}, "Step"), h("th", {scope: "col", class: "num"}, "Training loss"),
          h("th", {scope: "col"}, "Where"))),
        h("tbody", {}, list.map((c) => h("tr", {}, h("td", {class: "num"}, fmtInt(c.stepNumber)),
          h("td", {class: "num"}, fmtLoss(c.metrics && c.metrics.trainLoss)),
          h("td", {class: "wrap"}, h("code", {}, c.fineTunedModelCheckpoint))))))) :
        h("p", {class: "muted"}, "None committed yet (checkpoint.everySteps sets how often)."),
      ...(list.length ? [h("p", {class: "muted"}, "A retried or resumed run starts from the newest.")] : []));
  }

  function drawEvents() {
    const all = [...events.values()].sort((a, b) => Number(b.id.split("-").pop()) - Number(a.id.split("-").pop()));
    const lifecycle = all.filter((e) => !STEP_EVENT.test(e.message));
    stepCount.textContent = `(${all.length - lifecycle.length})`;
    eventRows.replaceChildren(...(stepToggle.checked ? all : lifecycle).slice(0, 300).map((e) => h("tr", {dataset: {level: e.level}},
      h("td", {title: new Date(e.createdAt * 1000).toISOString()}, new Date(e.createdAt * 1000).toLocaleTimeString()),
      h("td", {class: `wrap ${e.level === "error" ? "error-text" : ""}`}, e.message))));
  }

  async function refresh() {
    const path = `/v1/jobs/${encodeURIComponent(jobId)}`;
    try {
      job = await api("GET", path);
    } catch (err) {
      if (err.status === 404) {
        notFound(page, jobId);
        return false;
      }
      problem.hidden = false;
      problem.replaceChildren(h("p", {}, `Could not read the job: ${err.message}`));
      return IDLE_POLL_MS;
    }
    const [t, diagnosis, newest, checkpoints] = await Promise.all([
      api("GET", `${path}/telemetry`), api("GET", `${path}/diagnosis`),
      api("GET", `${path}/events?limit=${events.size ? 100 : 1000}`), api("GET", `${path}/checkpoints`)]);
    newest.data.forEach((e) => events.set(e.id, e));
    drawJob(job);
    drawFigures(job, t);
    drawEvaluation(job, t);
    drawCharts(job, t);
    drawPlan(job, t, diagnosis);
    drawDiagnosis(diagnosis);
    drawCheckpoints(checkpoints.data);
    drawEvents();
    if (logPanel.open) readLogs();
    if (!artifactsRead || !TERMINAL.has(job.status)) {
      artifactsRead = TERMINAL.has(job.status);
      await drawModel(job);
    }
    return !TERMINAL.has(job.status); // a finished job changes no more: polling stops
  }

  refresh().catch(() => true).then((again) => {
    if (again !== false) every(typeof again === "number" ? again : POLL_MS, refresh);
  });
}

function notFound(page, jobId) {
  charts.splice(0).forEach((chart) => chart.destroy());
  page.dataset.state = "not-found";
  page.replaceChildren(h("p", {class: "crumbs"}, h("a", {href: "#/jobs"}, "Jobs"), " / ", jobId),
    h("div", {class: "panel notice bad", id: "not-found", role: "alert"},
      h("h1", {id: "job-title"}, "Job not found (404)"),
      h("p", {}, `No job ${jobId} is visible to this token: it may have been deleted, or belong to another tenant.`),
      h("p", {}, h("a", {href: "#/jobs"}, "Your jobs"))));
}

// --- the plan page ---------------------------------------------------------------------------------------

function enumOf(schemas, model, property) {
  // the choices the API accepts, from its own OpenAPI schema (nothing copied here)
  const owner = schemas[model] || schemas[`${model}-Input`]; // FastAPI's name when input and output differ
  let schema = owner && owner.properties[property];
  const resolve = (s) => (s && s.$ref ? schemas[s.$ref.split("/").pop()] : s);
  schema = resolve(schema);
  if (!schema) return [];
  if (schema.enum) return schema.enum;
  for (const option of schema.anyOf || schema.allOf || []) {
    const found = resolve(option);
    if (found && found.enum) return found.enum;
  }
  return [];
}

function field({id, label, param, hint, input}) {
  input.id = id;
  input.dataset.param = param;
  input.setAttribute("aria-describedby", `${id}-error${hint ? ` ${id}-hint` : ""}`);
  return h("div", {class: "field"}, h("label", {for: id}, label), input,
    hint ? h("span", {class: "hint", id: `${id}-hint`}, hint) : null,
    h("p", {class: "field-error", id: `${id}-error`}));
}

const numberInput = (value, attrs = {}) => h("input", {type: "number", inputmode: "decimal", value, ...attrs});
const select = (choices, chosen) => h("select", {}, choices.map(([value, label]) =>
  h("option", {value, selected: value === chosen}, label)));

async function planPage() {
  markNav("plan");
  document.title = "Plan · tunewright";
  render(h("section", {"aria-labelledby": "plan-page-title"},
    h("div", {class: "toolbar"}, h("h1", {id: "plan-page-title"}, "Plan a job")),
    h("p", {class: "muted"}, "Describe a GPU pool (or pick one the API knows) and a job: the planner says what it would run, with " +
      "its predictions and the alternatives it rejected. Nothing is submitted or kept.")));
  const mine = view;
  let schemas, pools, files;
  try {
    [schemas, pools, files] = await Promise.all([
      fetch("/openapi.json", {cache: "no-store"}).then((r) => r.json()).then((s) => s.components.schemas),
      api("GET", "/v1/pools").then((p) => p.data.filter((pool) => pool.gpu)), // the planner models GPU pools
      api("GET", "/v1/files?purpose=fine-tune").then((f) => f.data).catch(() => [])]);
  } catch (err) {
    if (mine === view && err.status !== 401) render(h("p", {class: "panel notice bad", role: "alert"}, `Could not read the API: ${err.message}`));
    return;
  }
  if (mine !== view) return;
  const choices = (model, property) => enumOf(schemas, model, property).map((v) => [v, v]);

  const inputs = {
    pool: select([["", "described here"], ...pools.map((p) => [p.name, `${p.name}: ${p.maxNodes} × ${p.gpusPerNode} ${p.gpu}`])], ""),
    gpu: select(choices("PoolDescription", "gpu"), "H100"),
    gpusPerNode: numberInput(8, {min: 1}),
    maxNodes: numberInput(2, {min: 1}),
    intraNode: select(choices("PoolDescription", "intraNode"), "nvlink4"),
    interNode: select([["", "none (one node)"], ...choices("PoolDescription", "interNode")], "ib-8x400g"),
    pricePerGPUHour: numberInput(2.5, {min: 0, step: "any"}),
    hostMemoryGiB: numberInput("", {min: 0, step: "any", placeholder: "2 × GPU memory"}),
    source: h("input", {type: "text", value: "meta-llama/Llama-3.1-8B-Instruct", spellcheck: "false", autocomplete: "off"}),
    method: select(choices("MethodSpec", "type"), "lora"),
    rank: numberInput(16, {min: 1}),
    train: h("input", {type: "text", list: "uploaded-files", spellcheck: "false", autocomplete: "off",
                       value: files.length ? files[0].id : "pvc://datasets/train.jsonl"}),
    seqLen: numberInput(2048, {min: 1}),
    globalBatchSize: numberInput(64, {min: 1}),
    maxSteps: numberInput(1000, {min: 1}),
    epochs: numberInput("", {min: 1, placeholder: "with dataset tokens"}),
    datasetTokens: numberInput("", {min: 1, placeholder: "from the file if uploaded"}),
    strategy: select(choices("ResourcesSpec", "strategy"), "auto"),
    maxGPUs: numberInput("", {min: 1}),
    budgetUSD: numberInput("", {min: 0, step: "any"}),
    deadlineSeconds: numberInput("", {min: 1}),
  };
  const datalist = h("datalist", {id: "uploaded-files"}, files.map((f) => h("option", {value: f.id}, `${f.filename}, ${f.examples} examples`)));
  const describe = h("fieldset", {id: "pool-spec"}, h("legend", {}, "The pool, described"), h("div", {class: "fields"},
    field({id: "plan-gpu", label: "GPU type", param: "poolSpec.gpu", input: inputs.gpu}),
    field({id: "plan-gpus-per-node", label: "GPUs per node", param: "poolSpec.gpusPerNode", input: inputs.gpusPerNode}),
    field({id: "plan-max-nodes", label: "Nodes (at most)", param: "poolSpec.maxNodes", input: inputs.maxNodes}),
    field({id: "plan-intra-node", label: "Link within a node", param: "poolSpec.intraNode", input: inputs.intraNode}),
    field({id: "plan-inter-node", label: "Network between nodes", param: "poolSpec.interNode", input: inputs.interNode}),
    field({id: "plan-price", label: "Price per GPU-hour (USD)", param: "poolSpec.pricePerGPUHour", input: inputs.pricePerGPUHour}),
    field({id: "plan-host-memory", label: "Host memory per node (GiB)", param: "poolSpec.hostMemoryGiB", input: inputs.hostMemoryGiB,
           hint: "for CPU-offload plans"})));
  const formError = h("div", {class: "panel notice bad", role: "alert", id: "plan-error", hidden: true});
  const result = h("section", {id: "plan-result", "aria-live": "polite", "aria-labelledby": "plan-result-title"});
  const submit = h("button", {type: "submit", class: "primary", id: "plan-submit"}, "Plan it");
  const form = h("form", {class: "plan", id: "plan-form", novalidate: true},
    h("fieldset", {}, h("legend", {}, "Pool"), h("div", {class: "fields"},
      field({id: "plan-pool", label: "Pool", param: "pool", input: inputs.pool,
             hint: pools.length ? "a registered pool, or describe one below" : "no pool is registered: describe one below"}))),
    describe,
    h("fieldset", {}, h("legend", {}, "The job"), h("div", {class: "fields"},
      field({id: "plan-model", label: "Model", param: "spec.model.source", input: inputs.source,
             hint: "a catalog or hub name (org/name), or a model folder on the server"}),
      field({id: "plan-method", label: "Method", param: "spec.method.type", input: inputs.method}),
      field({id: "plan-rank", label: "LoRA rank", param: "spec.method.lora.r", input: inputs.rank}),
      field({id: "plan-train", label: "Training data", param: "spec.dataset.train", input: inputs.train,
             hint: "an uploaded file id (its size gives the tokens an epoch takes), or where the workers read it"}),
      field({id: "plan-seq-len", label: "Sequence length (tokens)", param: "spec.hyperparameters.seqLen", input: inputs.seqLen}),
      field({id: "plan-batch", label: "Global batch (sequences)", param: "spec.hyperparameters.globalBatchSize", input: inputs.globalBatchSize}),
      field({id: "plan-max-steps", label: "Optimizer steps", param: "spec.hyperparameters.maxSteps", input: inputs.maxSteps,
             hint: "or leave empty and give epochs"}),
      field({id: "plan-epochs", label: "Epochs", param: "spec.hyperparameters.epochs", input: inputs.epochs}),
      field({id: "plan-dataset-tokens", label: "Dataset tokens", param: "datasetTokens", input: inputs.datasetTokens}))),
    h("fieldset", {}, h("legend", {}, "Constraints"), h("div", {class: "fields"},
      field({id: "plan-strategy", label: "Strategy", param: "spec.resources.strategy", input: inputs.strategy,
             hint: "auto: the planner chooses"}),
      field({id: "plan-max-gpus", label: "GPUs (at most)", param: "spec.resources.maxGPUs", input: inputs.maxGPUs}),
      field({id: "plan-budget", label: "Budget (USD)", param: "spec.resources.budgetUSD", input: inputs.budgetUSD,
             hint: "the fastest plan within it"}),
      field({id: "plan-deadline", label: "Deadline (seconds)", param: "spec.resources.deadlineSeconds", input: inputs.deadlineSeconds,
             hint: "without a budget: the cheapest within it"}))),
    h("div", {class: "form-actions"}, submit, h("span", {class: "muted", id: "plan-busy"})),
    formError, datalist);
  document.getElementById("main").append(form, result);

  const syncPool = () => { describe.disabled = inputs.pool.value !== ""; };
  inputs.pool.addEventListener("change", syncPool);
  syncPool();

  const number = (input) => (input.value === "" ? undefined : Number(input.value));
  const clean = (object) => Object.fromEntries(Object.entries(object).filter(([, v]) => v !== undefined && v !== ""));
  function request() {
    const lora = inputs.method.value === "lora" ? {lora: clean({r: number(inputs.rank)})} : {};
    const spec = {
      model: {source: inputs.source.value.trim()},
      method: {type: inputs.method.value, ...lora},
      dataset: {train: inputs.train.value.trim()},
      hyperparameters: clean({seqLen: number(inputs.seqLen), globalBatchSize: number(inputs.globalBatchSize),
                              maxSteps: number(inputs.maxSteps), epochs: number(inputs.epochs)}),
      resources: clean({strategy: inputs.strategy.value, maxGPUs: number(inputs.maxGPUs), budgetUSD: number(inputs.budgetUSD),
                        deadlineSeconds: number(inputs.deadlineSeconds)}),
    };
    const pool = inputs.pool.value ? {pool: inputs.pool.value} : {poolSpec: clean({
      gpu: inputs.gpu.value, gpusPerNode: number(inputs.gpusPerNode), maxNodes: number(inputs.maxNodes),
      intraNode: inputs.intraNode.value, interNode: inputs.interNode.value || undefined,
      pricePerGPUHour: number(inputs.pricePerGPUHour), hostMemoryGiB: number(inputs.hostMemoryGiB)})};
    return clean({spec, ...pool, datasetTokens: number(inputs.datasetTokens)});
  }

  function clearErrors() {
    formError.hidden = true;
    form.querySelectorAll("[aria-invalid]").forEach((input) => input.removeAttribute("aria-invalid"));
    form.querySelectorAll(".field-error").forEach((p) => { p.textContent = ""; });
  }

  function showError(err) {
    // the API names the field it refuses (`param`): the message goes beside that field, and above the form
    const inputsByParam = [...form.querySelectorAll("[data-param]")];
    const target = inputsByParam.find((input) => input.dataset.param === err.param);
    if (target) {
      target.setAttribute("aria-invalid", "true");
      document.getElementById(`${target.id}-error`).textContent = err.message;
    }
    formError.hidden = false;
    formError.replaceChildren(h("p", {}, err.code === "no_plan" ? "No plan fits: " : `Refused (${err.status}${err.param ? `, ${err.param}` : ""}): `,
      err.message), target ? h("p", {}, h("a", {href: `#${target.id}`, onclick: (event) => { event.preventDefault(); target.focus(); }},
      "Go to the field")) : null);
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors();
    submit.disabled = true;
    document.getElementById("plan-busy").textContent = "Planning…";
    const body = request();
    try {
      const answer = await api("POST", "/v1/plans", body);
      drawPlanAnswer(result, answer, body);
    } catch (err) {
      result.replaceChildren();
      if (err.status !== 401) showError(err);
    } finally {
      submit.disabled = false;
      document.getElementById("plan-busy").textContent = "";
    }
  });
}

function drawPlanAnswer(result, answer, body) {
  const plan = answer.plan, p = plan.predicted || {};
  const model = answer.model;
  const item = (label, value, id) => [h("dt", {}, label), h("dd", {id}, value)];
  result.replaceChildren(h("div", {class: "panel"},
    h("h2", {id: "plan-result-title"}, `${model.name} (${(model.parameters / 1e9).toFixed(2)}B parameters, ${model.layers} layers) ` +
      `on ${answer.pool === "described" ? "the pool described" : `pool ${answer.pool}`}`),
    h("dl", {class: "layout"},
      item("Strategy", layoutOf(plan), "plan-result-strategy"),
      item("Batch", `micro-batch ${plan.microBatch} × ${plan.gradAccum} accumulation × ${plan.workers} GPUs`),
      item("Memory", memoryLayoutOf(plan).join(", ")),
      item("Peak memory per GPU", fmtGiB(p.peakMemoryGiB)),
      item("Step", fmtSeconds(p.stepSeconds)),
      item("Tokens/s", fmtInt(p.tokensPerSecond)),
      item("MFU", fmtPct(p.mfu)),
      item("Communication", `${fmtPct(p.commShare)} of the step (${fmtPct(p.exposedCommShare)} exposed)`),
      item("Duration", fmtSeconds(p.durationSeconds)),
      item("Cost", fmtUSD(p.costUSD), "plan-result-cost"),
      p.band ? item("Likely (P10-P90)", bandText(p.band), "plan-result-band") : null),
    p.band ? h("p", {class: "muted", id: "plan-result-band-basis"}, p.band.basis) : null,
    h("p", {class: "explanation"}, plan.explanation),
    h("h3", {}, `Alternatives rejected (${plan.rejected.length})`),
    plan.rejected.length ? h("div", {class: "table-wrap"}, h("table", {id: "plan-rejected"},
      h("thead", {}, h("tr", {}, h("th", {scope: "col"}, "Strategy"), h("th", {scope: "col", class: "num"}, "GPUs"),
        h("th", {scope: "col"}, "Why not"))),
      h("tbody", {}, plan.rejected.map((r) => h("tr", {}, h("td", {}, r.strategy), h("td", {class: "num"}, r.gpus ?? dash),
        h("td", {class: "wrap"}, r.reason))))))
      : h("p", {class: "muted"}, "None."),
    h("details", {}, h("summary", {}, "The request (POST /v1/plans)"), h("pre", {}, JSON.stringify(body, null, 2))),
    h("p", {class: "muted"}, "To run it: put this spec in a job file and ", h("code", {}, "tunewright submit job.yaml"),
      " (a cluster's pool: ", h("code", {}, "spec.resources.pool"), ").")));
}

// --- start -----------------------------------------------------------------------------------------------

document.getElementById("sign-out").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  location.hash = "#/jobs";
  signIn("Signed out.");
});
function start() {
  takeTokenFromFragment();
  route();
}
window.addEventListener("hashchange", start); // a sign-in link opened in a tab already on the dashboard too
start();
