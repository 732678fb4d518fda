// lora-autotune's pages: new training, runs, one run. Plain JavaScript against the HTTP API (README); nothing is
// fetched from elsewhere. The token, when the server needs one, comes in the page's own URL (?token=...).
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token");
const view = document.getElementById("view");
const form = {dataset: "", model: "builtin:tiny-sd15", vram: "", gpu: "", goal: "character", priority: "balanced"};
let overrides = {};
let stream = null;

function withToken(path) {
  return TOKEN ? path + (path.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(TOKEN) : path;
}

async function api(method, path, body) {
  const init = {method, headers: {}};
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  const response = await fetch(withToken(path), init);
  const data = await response.json();
  document.getElementById("error").textContent = response.ok ? "" : data.error;
  if (!response.ok) throw new Error(data.error);
  return data;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

function gib(bytes) { return (bytes / 2 ** 30).toFixed(2) + " GiB"; }

function duration(seconds) {
  if (seconds == null || !isFinite(seconds)) return "-";
  const h = Math.floor(seconds / 3600), m = Math.floor(seconds % 3600 / 60), s = Math.round(seconds % 60);
  return h ? `${h} h ${m} min` : m ? `${m} min ${s} s` : `${s} s`;
}

// ---- new training -------------------------------------------------------------------------------

function planBody() {
  const body = {dataset: form.dataset, model: form.model, goal: form.goal, priority: form.priority, ...overrides};
  if (form.vram) body.vram = Number(form.vram);
  if (form.gpu) body.gpu = form.gpu;
  return body;
}

function input(name, label, extra) {
  return el("label", {}, label + " ", el("input", {type: "text", id: "in-" + name, value: form[name],
    oninput: e => { form[name] = e.target.value; }, ...(extra || {})}));
}

function choice(name, label, options) {
  const select = el("select", {id: "in-" + name, onchange: e => { form[name] = e.target.value; }},
    ...options.map(o => el("option", o === form[name] ? {value: o, selected: ""} : {value: o}, o)));
  return el("label", {}, label + " ", select);
}

async function showBrowser(box, path) {
  const listing = await api("GET", "/api/browse" + (path ? "?path=" + encodeURIComponent(path) : ""));
  box.replaceChildren();
  box.setAttribute("data-path", listing.path || "");
  if (listing.path) {
    box.append(el("div", {}, "in ", el("code", {}, listing.path), " ",
      el("button", {id: "use-folder", onclick: () => { form.dataset = listing.path; render(); }}, "Use this folder")));
  }
  const list = el("ul", {class: "browser"});
  if (listing.parent) list.append(el("li", {onclick: () => showBrowser(box, listing.parent)}, ".."));
  for (const name of listing.folders) {
    const full = listing.path ? listing.path + "/" + name : name;
    list.append(el("li", {"data-folder": name, onclick: () => showBrowser(box, full)}, "\u{1F4C1} " + name));
  }
  for (const name of listing.files) {
    list.append(el("li", {onclick: () => { form.model = listing.path + "/" + name; render(); }}, name));
  }
  box.append(list);
}

function doctorView(report) {
  const s = report.summary;
  const problems = el("table", {id: "problems"}, el("tr", {}, el("th", {}, "severity"), el("th", {}, "file"),
    el("th", {}, "problem"), el("th", {}, "fix")),
    ...report.problems.map(p => el("tr", {}, el("td", {}, p.severity), el("td", {}, p.file),
      el("td", {}, p.message), el("td", {}, p.fix))));
  const most = Math.max(1, ...report.buckets.map(b => b.views));
  const buckets = el("table", {id: "buckets"}, ...report.buckets.map(b => el("tr", {},
    el("td", {}, `${b.width} x ${b.height}`), el("td", {}, `${b.images} images`),
    el("td", {}, el("div", {class: "bar"}, el("span", {style: `width:${100 * b.views / most}%`}))))));
  return el("div", {id: "doctor"}, el("h3", {}, "Dataset"),
    el("p", {id: "doctor-summary"}, `${s.images} images, ${s.errors} errors, ${s.warnings} warnings, ` +
      `${s.steps_per_epoch} steps per epoch`), buckets, report.problems.length ? problems : "");
}

const EDITABLE = {train_batch_size: "batch", gradient_accumulation_steps: "accum", network_dim: "rank",
  network_alpha: "alpha", learning_rate: "lr", max_train_steps: "steps", max_train_epochs: "epochs",
  optimizer_type: "optimizer", resolution: "resolution"};

function planView(plan) {
  const p = plan.prediction || {};
  const usable = p.usable_bytes || 1, peak = p.peak_bytes || 0;
  const rows = plan.choices.filter(c => c.kohya !== false).map(c => {
    const pin = EDITABLE[c.key];
    const value = pin ? el("input", {type: "text", "data-key": c.key, value: String(c.value),
      onchange: e => { overrides[pin] = e.target.value; repredict(); }}) : String(c.value);
    return el("tr", {}, el("td", {}, c.key), el("td", {}, value), el("td", {class: "reason"}, c.reason));
  });
  return el("div", {id: "plan"}, el("h3", {}, "Plan"),
    el("p", {id: "plan-message"}, plan.message),
    el("div", {}, "predicted VRAM ", gib(peak), " of ", gib(usable),
      el("div", {class: "bar" + (peak > usable ? " over" : "")},
        el("span", {style: `width:${Math.min(100, 100 * peak / usable)}%`}))),
    el("p", {}, "host RAM ", p.ram_peak_bytes ? gib(p.ram_peak_bytes) : "-", ", time ",
      duration(p.total_seconds)),
    el("table", {id: "plan-table"}, ...rows),
    el("button", {id: "start", onclick: start}, "Start training"));
}

async function repredict() {
  const box = document.getElementById("plan-box");
  try {
    box.replaceChildren(planView(await api("POST", "/api/plan", planBody())));
  } catch (error) {
    box.replaceChildren(el("p", {id: "plan-refused"}, error.message));
  }
}

async function check() {
  overrides = {};
  const doctorBox = document.getElementById("doctor-box");
  doctorBox.replaceChildren(doctorView(await api("POST", "/api/doctor", {dataset: form.dataset})));
  await repredict();
}

async function start() {
  const run = await api("POST", "/api/runs", planBody());
  location.hash = "#/run/" + encodeURIComponent(run.id);
}

function renderNew() {
  const browser = el("div", {id: "browser"});
  view.replaceChildren(el("h2", {}, "New training"),
    el("fieldset", {}, el("legend", {}, "Dataset and model"), input("dataset", "dataset folder"),
      el("button", {id: "browse", onclick: () => showBrowser(browser, form.dataset || null)}, "Browse"), browser,
      el("br"), input("model", "model (file, folder or builtin:ID)")),
    el("fieldset", {}, el("legend", {}, "Target"), input("vram", "card memory GB (empty: this machine)", {size: 6}),
      input("gpu", "or a named card"), choice("goal", "goal", ["character", "style", "concept"]),
      choice("priority", "priority", ["speed", "balanced", "quality"])),
    el("button", {id: "check", onclick: check}, "Check and plan"),
    el("div", {id: "doctor-box"}), el("div", {id: "plan-box"}));
}

// ---- runs ---------------------------------------------------------------------------------------

async function renderRuns() {
  const data = await api("GET", "/api/runs");
  view.replaceChildren(el("h2", {}, "Runs"), el("table", {id: "runs"},
    el("tr", {}, ...["run", "state", "step", "it/s", "ETA"].map(h => el("th", {}, h))),
    ...data.runs.map(r => el("tr", {"data-run": r.id}, el("td", {}, el("a", {href: "#/run/" + r.id}, r.id)),
      el("td", {class: "state"}, r.state), el("td", {}, r.step == null ? "-" : `${r.step} / ${r.max_train_steps}`),
      el("td", {}, r.it_per_s ? r.it_per_s.toFixed(2) : "-"), el("td", {}, duration(r.eta_s))))));
}

// ---- one run ------------------------------------------------------------------------------------

function curve(id, points, label) {
  const width = 500, height = 120;
  if (points.length < 2) return el("div", {id}, label + ": waiting for steps");
  const xs = points.map(p => p[0]), ys = points.map(p => p[1]);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  const coords = points.map(([x, y]) => `${(x - x0) / (x1 - x0 || 1) * width},${height - (y - y0) / (y1 - y0 || 1) * height}`);
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", coords.join(" "));
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", "#36c");
  svg.append(line);
  return el("div", {id}, `${label} (${y0.toPrecision(3)} .. ${y1.toPrecision(3)})`, svg);
}

async function renderRun(id) {
  const info = await api("GET", "/api/runs/" + encodeURIComponent(id));
  const losses = [], rates = [];
  const status = el("p", {id: "run-status"});
  const charts = el("div", {id: "charts"});
  const decisions = el("ol", {id: "decisions"});
  const samples = el("div", {class: "samples", id: "samples"});
  const report = el("div", {id: "report"});
  const show = (state, step, total, rate) => status.replaceChildren(el("span", {class: "state", id: "run-state"},
    state), ` step ${step ?? "-"} / ${total ?? "-"}, ${rate ? rate.toFixed(2) + " it/s" : "-"}`);
  show(info.state, info.step, info.max_train_steps, info.it_per_s);
  view.replaceChildren(el("h2", {}, "Run ", id), status,
    el("button", {id: "stop", onclick: () => api("POST", `/api/runs/${id}/stop`)}, "Stop (state saved)"),
    el("button", {id: "resume", onclick: async () => { await api("POST", `/api/runs/${id}/resume`); renderRun(id); }},
      "Resume"),
    charts, el("h3", {}, "Decisions"), decisions, el("h3", {}, "Samples"), samples, report);
  if (stream) stream.close();
  stream = new EventSource(withToken(`/api/runs/${encodeURIComponent(id)}/events`));
  let last = {};
  stream.addEventListener("state", e => { last.state = JSON.parse(e.data).state; show(last.state, last.step, last.total, last.rate); });
  stream.addEventListener("progress", e => {
    const p = JSON.parse(e.data);
    Object.assign(last, {step: p.step, total: p.max_train_steps, rate: p.it_per_s});
    show(last.state || info.state, p.step, p.max_train_steps, p.it_per_s);
    if (p.loss != null) losses.push([p.step, p.loss]);
    if (p.it_per_s != null) rates.push([p.step, p.it_per_s]);
    charts.replaceChildren(curve("loss-curve", losses, "loss"), curve("speed-curve", rates, "it/s"));
  });
  stream.addEventListener("decision", e => {
    const d = JSON.parse(e.data);
    decisions.append(el("li", {"data-event": d.event}, `${d.time} ${d.event}: ${d.text}`));
  });
  stream.addEventListener("sample", e => {
    const s = JSON.parse(e.data);
    samples.append(el("img", {src: withToken(`/api/runs/${encodeURIComponent(id)}/files/${s.file}`), alt: s.file}));
  });
  stream.addEventListener("end", async e => {
    stream.close();
    if (JSON.parse(e.data).state !== "done") return;
    const r = await api("GET", `/api/runs/${encodeURIComponent(id)}/report`);
    report.replaceChildren(el("h3", {}, "Report"), el("p", {id: "bottleneck"}, r.bottleneck ? `${r.bottleneck.message}; ${r.bottleneck.fix}` : ""),
      el("p", {}, `${r.steps} steps, outcome ${r.outcome}`));
  });
}

// ---- routing ------------------------------------------------------------------------------------

function render() {
  if (stream && !location.hash.startsWith("#/run/")) { stream.close(); stream = null; }
  const hash = location.hash || "#/new";
  const run = hash.match(/^#\/run\/(.+)$/);
  const page = run ? renderRun(decodeURIComponent(run[1])) : hash === "#/runs" ? renderRuns() : renderNew();
  Promise.resolve(page).catch(error => { document.getElementById("error").textContent = error.message; });
}

window.addEventListener("hashchange", render);
render();
