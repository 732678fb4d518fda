// lora-autotune's pages: new training, runs, one run. Plain JavaScript against the HTTP API (README); nothing is
// fetched from elsewhere. The token, when the server needs one, comes in the page's own URL (?token=...).
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token");
const view = document.getElementById("view");
const form = {dataset: "", model: "builtin:tiny-sd15", vram: "", gpu: "", goal: "character", priority: "balanced",
  engine: "autotune"};
let overrides = {};
let fileKeys = new Set();  // the model's files among the overrides: another model drops them
let besides = {};  // the files the page filled in from beside the model (said beside each)
let checkedModel = null;
let engines = ["autotune"];
let fields = [];  // the form: autotune run's options as the server validates them (GET /api/options)
let stream = null;

function withToken(path) {
  return TOKEN ? path + (path.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(TOKEN) : path;
}

async function api(method, path, body) {
  const init = {method, headers: {}};
  if (method === "POST") {  // every state change is a POST of JSON (the server refuses anything else)
    init.body = JSON.stringify(body ?? {});
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
    else if (key === "style") setStyle(node, value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

function setStyle(node, declarations) {  // through the CSSOM: the page's CSP refuses style attributes
  for (const declaration of declarations.split(";")) {
    const [property, value] = declaration.split(":").map(part => part.trim());
    if (property) node.style.setProperty(property, value);
  }
}

function typed(text) {  // a number the user typed is sent as a JSON number ("16" -> 16, "1e-4" -> 0.0001)
  const trimmed = String(text).trim();
  return trimmed !== "" && isFinite(Number(trimmed)) ? Number(trimmed) : trimmed;
}

function gib(bytes) { return (bytes / 2 ** 30).toFixed(2) + " GiB"; }

function size(bytes) {
  const units = ["bytes", "KiB", "MiB", "GiB"];
  let unit = 0;
  while (bytes >= 1024 && unit < units.length - 1) { bytes /= 1024; unit++; }
  return (unit ? bytes.toFixed(1) : bytes) + " " + units[unit];
}

function duration(seconds) {
  if (seconds == null || !isFinite(seconds)) return "-";
  const h = Math.floor(seconds / 3600), m = Math.floor(seconds % 3600 / 60), s = Math.round(seconds % 60);
  return h ? `${h} h ${m} min` : m ? `${m} min ${s} s` : `${s} s`;
}

// ---- new training -------------------------------------------------------------------------------

function planBody() {  // the plan takes the plan options among what the user set (a run's own go with Start)
  const planKeys = new Set(fields.filter(f => f.plan).map(f => f.key));
  const mine = Object.fromEntries(Object.entries(overrides).filter(([key]) => planKeys.has(key)));
  const body = {dataset: form.dataset, model: form.model, goal: form.goal, priority: form.priority, ...mine};
  if (form.vram) body.vram = Number(form.vram);
  if (form.gpu) body.gpu = form.gpu;
  return body;
}

function input(name, label, extra) {
  return el("label", {}, label + " ", el("input", {type: "text", id: "in-" + name, value: form[name],
    oninput: e => { form[name] = e.target.value; }, ...(extra || {})}));
}

function choice(name, label, options, changed) {
  const select = el("select", {id: "in-" + name, onchange: e => { form[name] = e.target.value; if (changed) changed(); }},
    ...options.map(o => el("option", o === form[name] ? {value: o, selected: ""} : {value: o}, o)));
  return el("label", {}, label + " ", select);
}

// the folder browser: only the folders the server allows (GET /api/browse refuses the rest); a model file picked
// is the model, or with ``pick`` the file of one of its fields; with ``pickFolder`` a folder is what is picked
async function showBrowser(box, path, pick, pickFolder) {
  const listing = await api("GET", "/api/browse" + (path ? "?path=" + encodeURIComponent(path) : ""));
  box.replaceChildren();
  box.setAttribute("data-path", listing.path || "");
  if (listing.path && pickFolder) {
    box.append(el("div", {}, "in ", el("code", {}, listing.path), " ",
      el("button", {id: "use-checkout", onclick: () => pickFolder(listing.path)}, "Use this folder")));
  } else if (listing.path && !pick) {
    box.append(el("div", {}, "in ", el("code", {}, listing.path), " ",
      el("button", {id: "use-folder", onclick: () => { form.dataset = listing.path; render(); }}, "Use this folder")));
  } else if (listing.path) {
    box.append(el("div", {}, "in ", el("code", {}, listing.path)));
  }
  const list = el("ul", {class: "browser"});
  if (listing.parent) list.append(el("li", {onclick: () => showBrowser(box, listing.parent, pick)}, ".."));
  for (const name of listing.folders) {
    const full = listing.path ? listing.path + "/" + name : name;
    list.append(el("li", {"data-folder": name, onclick: () => showBrowser(box, full, pick, pickFolder)},
      "\u{1F4C1} " + name));
  }
  for (const name of pickFolder ? [] : listing.files) {
    const full = listing.path + "/" + name;
    list.append(el("li", {"data-file": name, onclick: () => pick ? pick(full) : (form.model = full, render())}, name));
  }
  box.append(list);
}

const IMAGE = /\.(png|jpe?g|webp|bmp)$/i;

function thumbnail(report, file) {
  if (!IMAGE.test(file || "")) return "";
  const query = new URLSearchParams({dataset: report.dataset, file, resolution: report.settings.resolution});
  if (form.model) query.set("model", form.model);
  return el("img", {class: "thumb", loading: "lazy", alt: "as trained: " + file,
    src: withToken("/api/thumbnail?" + query)});
}

function doctorView(report) {
  const s = report.summary;
  const problems = el("table", {id: "problems"}, el("tr", {}, el("th", {}, "severity"), el("th", {}, "file"),
    el("th", {}, "as trained"), el("th", {}, "problem"), el("th", {}, "fix")),
    ...report.problems.map(p => el("tr", {}, el("td", {}, p.severity), el("td", {}, p.file),
      el("td", {}, thumbnail(report, p.file)), el("td", {}, p.message), el("td", {}, p.fix))));
  const most = Math.max(1, ...report.buckets.map(b => b.views));
  const buckets = el("table", {id: "buckets"}, ...report.buckets.map(b => el("tr", {},
    el("td", {}, `${b.width} x ${b.height}`), el("td", {}, `${b.images} images`),
    el("td", {}, el("div", {class: "bar"}, el("span", {style: `width:${100 * b.views / most}%`}))))));
  return el("div", {id: "doctor"}, el("h3", {}, "Dataset"),
    el("p", {id: "doctor-summary"}, `${s.images} images, ${s.errors} errors, ${s.warnings} warnings, ` +
      `${s.steps_per_epoch} steps per epoch`), buckets, report.problems.length ? problems : "");
}

const TOP = new Set(["dataset", "model", "vram", "gpu", "goal", "priority"]);  // the fields above the plan

function same(asked, planned) {
  const a = Array.isArray(asked) ? asked.join(",") : String(asked).trim(), p = String(planned);
  if (a === p || `${a},${a}` === p) return true;
  return a !== "" && !isNaN(Number(a)) && Number(a) === Number(p);
}

function shownValue(value) {  // a value as its field shows it (a list of values space-separated)
  return Array.isArray(value) ? value.join(" ") : value == null ? "" : String(value);
}

function settingInput(f, shown, changed) {  // one option's input, by its kind in the schema
  const attrs = {id: "set-" + f.key, "data-key": f.config, "data-option": f.key};
  if (f.kind === "flag") {
    return el("input", {...attrs, type: "checkbox", ...(shown === true ? {checked: ""} : {}),
      onchange: e => changed(e.target.checked ? true : null)});
  }
  if (f.kind === "choice") {
    return el("select", {...attrs, onchange: e => changed(e.target.value || null)},
      el("option", {value: ""}, "(the plan's)"), ...f.choices.map(o => el("option",
        String(o) === String(shown) ? {value: o, selected: ""} : {value: o}, o)));
  }
  const parse = f.kind === "list" ? text => text.split(/\s+/).filter(Boolean).map(typed)
    : f.kind === "text" || f.kind === "path" ? text => text.trim() : typed;
  return el("input", {...attrs, type: "text", value: shownValue(shown), placeholder: f.default == null ? "" :
    String(f.default), onchange: e => { const v = parse(e.target.value); changed(v === "" || v.length === 0 ? null : v); }});
}

function settingRow(f, c) {  // the option, the value the plan chose (or the user's, marked) and its reason
  const mine = f.key in overrides;
  const changed = value => { if (value === null) delete overrides[f.key]; else overrides[f.key] = value; repredict(); };
  const reason = el("td", {class: "reason"}, c ? c.reason : f.help);
  if (mine && c && !same(overrides[f.key], c.value)) {
    reason.prepend(el("div", {class: "flag", "data-flag": f.config},
      `${shownValue(overrides[f.key])} does not fit this card: ${shownValue(c.value)} does (predicted with it below)`));
  }
  const label = el("td", {title: f.help}, f.config, mine ? el("span", {class: "mine"}, " yours") : "");
  return el("tr", {class: mine ? "yours" : "", "data-row": f.key}, label,
    el("td", {}, settingInput(f, mine ? overrides[f.key] : c ? c.value : null, changed)), reason);
}

function settingsView(plan) {  // every option of autotune run, grouped as --help groups them, made from the schema
  const planned = new Map(plan.choices.map(c => [c.key, c]));
  const groups = new Map();
  for (const f of fields) {
    if (TOP.has(f.key) || f.group === "model and its files" && f.kind === "path") continue;  // above / the files
    if (!groups.has(f.group)) groups.set(f.group, []);
    groups.get(f.group).push(settingRow(f, f.plan ? planned.get(f.config) : undefined));  // a run's own: no plan key
  }
  return el("div", {id: "settings"}, ...[...groups].map(([title, rows]) =>
    el("fieldset", {"data-group": title}, el("legend", {}, title), el("table", {}, ...rows))));
}

function planRow(c) {  // a setting no option sets: what the plan chose and why
  return el("tr", {}, el("td", {}, c.key), el("td", {}, String(c.value)), el("td", {class: "reason"}, c.reason));
}

function download(name, text) {
  const type = name.endsWith(".json") ? "application/json" : name.endsWith(".sh") ? "text/x-sh" : "application/toml";
  const url = URL.createObjectURL(new Blob([text], {type}));
  return el("a", {href: url, download: name, "data-file": name}, "download " + name);
}

function configsView(configs) {
  return el("div", {id: "configs"}, el("h3", {}, "The files autotune plan --out writes, for the family's trainer"),
    ...Object.entries(configs).flatMap(([name, text]) => [el("h4", {}, name, " ", download(name, text)),
      el("pre", {"data-config": name}, text)]));
}

function folderOf(path) { return path.includes("/") ? path.slice(0, path.lastIndexOf("/")) : null; }

function fileRow(c) {  // one of the family's files: found beside the model, picked, typed or pasted; kept
  const picker = el("div", {class: "picker", id: "pick-" + c.key});
  const pick = path => { overrides[c.key] = path; delete besides[c.key]; repredict(); };
  const from = overrides[c.key] ? folderOf(overrides[c.key]) : form.model.startsWith("builtin:") ? null :
    folderOf(form.model);
  return el("div", {}, el("label", {}, c.key + " ", el("input", {type: "text", id: "in-file-" + c.key, size: 60,
    value: c.placeholder ? (overrides[c.key] || "") : String(c.value), placeholder: c.placeholder ? c.value : "",
    onchange: e => { overrides[c.key] = e.target.value.trim(); delete besides[c.key]; repredict(); }})),
    el("button", {id: "browse-" + c.key, onclick: () => showBrowser(picker, from, pick)}, "Browse"),
    el("span", {class: "reason", "data-beside": besides[c.key] ? "yes" : "no"},
      " " + (besides[c.key] ? "found beside the model" : c.reason)), picker);
}

function startState(plan) {  // the server says why a run of this plan cannot start with the chosen engine
  const why = (plan.start || {})[form.engine] || "";
  const button = document.getElementById("start");
  if (button) button.disabled = Boolean(why);
  const line = document.getElementById("start-why");
  if (line) line.textContent = why;
}

function checkoutRow(needed) {  // the trainer this family needs, when the server offers none: pick its checkout
  const box = el("div", {id: "checkout-browser"});
  const use = async folder => {
    const added = await api("POST", "/api/engines", {kind: needed.name, path: folder});
    engines = added.engines;
    form.engine = added.name;
    repredict();
  };
  return el("p", {id: "checkout"}, `${needed.name}: ${needed.checkout}, none chosen yet `,
    el("button", {id: "choose-checkout", onclick: () => showBrowser(box, null, null, use)}, "Choose"), box);
}

function planView(plan) {
  const p = plan.prediction || {};
  const usable = p.usable_bytes || 1, peak = p.peak_bytes || 0;
  const covered = new Set(fields.map(f => f.config));
  const rows = plan.choices.filter(c => c.kohya !== false && !c.model_file && !covered.has(c.key)).map(planRow);
  const files = plan.choices.filter(c => c.model_file);
  files.forEach(c => fileKeys.add(c.key));
  const configsBox = el("div", {id: "configs-box"});
  const engineChoice = engines.length > 1 ? choice("engine", "engine", engines, () => startState(plan)) : "";
  const why = (plan.start || {})[form.engine] || "";
  return el("div", {id: "plan"}, el("h3", {}, "Plan"),
    el("p", {id: "plan-message"}, plan.message),
    el("div", {}, plan.device === "CPU" ? "predicted memory (RAM) " : "predicted VRAM ", gib(peak), " of ", gib(usable),
      el("div", {class: "bar" + (peak > usable ? " over" : "")},
        el("span", {style: `width:${Math.min(100, 100 * peak / usable)}%`}))),
    el("p", {}, "host RAM ", p.ram_peak_bytes ? gib(p.ram_peak_bytes) : "-", ", time ",
      duration(p.total_seconds)),
    el("p", {id: "plan-sources"}, `memory: ${p.memory_source || "model"}`,
      p.memory_source && p.memory_source !== "model" ? ` (${p.memory_basis})` : "",
      `; speed: ${p.speed_source || "model"}`, p.speed_source && p.speed_source !== "model" ? ` (${p.speed_basis})` : ""),
    plan.fallbacks.length ? el("p", {id: "fallbacks"}, "to fit: " + plan.fallbacks.join("; ")) : "",
    files.length ? el("fieldset", {id: "model-files"}, el("legend", {}, "The model's files"),
      ...files.map(fileRow)) : "",
    settingsView(plan), el("h4", {}, "Set by the plan"), el("table", {id: "plan-table"}, ...rows),
    el("button", {id: "show-configs", onclick: () => configsBox.replaceChildren(configsView(plan.configs))},
      "Write configs"), plan.engine_needed ? checkoutRow(plan.engine_needed) : "", engineChoice,
    el("button", why ? {id: "start", onclick: start, disabled: ""} : {id: "start", onclick: start}, "Start training"),
    el("span", {id: "start-why", class: "why"}, why), configsBox);
}

let planning = 0;  // the latest plan asked for: an answer to an earlier one (the user changed more since) is dropped

async function repredict() {
  const box = document.getElementById("plan-box");
  const asked = ++planning;
  try {
    const plan = await api("POST", "/api/plan", planBody());
    if (asked !== planning) return;
    const found = Object.entries(plan.beside || {}).filter(([key]) => !(key in overrides));
    if (found.length) {  // the files sit beside the model: filled in, said so, planned with them
      found.forEach(([key, path]) => { overrides[key] = path; besides[key] = true; });
      return repredict();
    }
    box.replaceChildren(planView(plan));
  } catch (error) {  // the reason above the last plan, whose fields stay to change what was refused
    if (asked !== planning) return;
    const refused = el("p", {id: "plan-refused", class: "why"}, "not planned: " + error.message);
    const last = document.getElementById("plan");
    if (last) {
      document.getElementById("plan-refused")?.remove();
      last.prepend(refused);
      const button = document.getElementById("start");
      if (button) button.disabled = true;
      document.getElementById("start-why").textContent = "the last change was not planned (see above)";
    } else {
      box.replaceChildren(refused);
    }
  }
}

async function check() {  // what the user changed stays through another check; the files only with their model
  if (!fields.length) fields = (await api("GET", "/api/options")).fields;
  if (form.model !== checkedModel) {
    fileKeys.forEach(key => delete overrides[key]);
    fileKeys.clear();
    besides = {};
    checkedModel = form.model;
  }
  const doctorBox = document.getElementById("doctor-box");
  const body = {dataset: form.dataset};
  if (form.model) body.model = form.model;
  doctorBox.replaceChildren(doctorView(await api("POST", "/api/doctor", body)));
  await repredict();
}

async function start() {
  const run = await api("POST", "/api/runs", {...planBody(), ...overrides, engine: form.engine});
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
    presetsView(), el("button", {id: "check", onclick: check}, "Check and plan"),
    el("div", {id: "doctor-box"}), el("div", {id: "plan-box"}));
}

// ---- presets: a kohya_ss GUI preset or a sd-scripts TOML imported; the user's own kept in this browser ----------

const PRESET_PREFIX = "lora-autotune-preset:";

function savedPresets() {
  return Object.keys(localStorage).filter(k => k.startsWith(PRESET_PREFIX)).map(k => k.slice(PRESET_PREFIX.length))
    .sort();
}

function settingsOnly() {  // what a preset keeps: the options set, not this machine's files
  return Object.fromEntries(Object.entries(overrides).filter(([key]) => !fileKeys.has(key)));
}

async function usePreset(values) {
  for (const key of Object.keys(overrides)) if (!fileKeys.has(key)) delete overrides[key];
  Object.assign(overrides, values);
  if (document.getElementById("plan")) await repredict();
}

function importReport(answer) {  // every key of the file: taken, left to the plan, or not honoured and why
  const list = (title, entries) => entries.length ? el("div", {"data-part": title}, el("b", {}, title + ": "),
    entries.join("; ")) : "";
  return el("div", {id: "preset-report"},
    list("taken", Object.entries(answer.applied).map(([k, v]) => v === k ? k : `${k} (as ${v})`)),
    list("planned for this card", Object.entries(answer.planned).map(([k, v]) => `${k} (the file's ${v})`)),
    list("not honoured", Object.entries(answer.ignored).map(([k, v]) => `${k}: ${v}`)),
    list("left empty", answer.unset));
}

async function importPreset(fileInput, box) {
  const file = fileInput.files[0];
  if (!file) return;
  const format = file.name.toLowerCase().endsWith(".toml") ? "sd-scripts" : "kohya_ss";
  const answer = await api("POST", "/api/presets/import", {format, text: await file.text()});
  box.replaceChildren(importReport(answer));
  await usePreset(answer.values);
}

function presetsView() {
  const box = el("div", {id: "preset-box"});
  const names = el("select", {id: "preset-names"}, ...savedPresets().map(n => el("option", {value: n}, n)));
  const name = el("input", {type: "text", id: "preset-name", size: 20, placeholder: "a name"});
  const file = el("input", {type: "file", id: "preset-file", accept: ".json,.toml",
    onchange: e => importPreset(e.target, box)});
  const listed = () => names.replaceChildren(...savedPresets().map(n => el("option", {value: n}, n)));
  return el("fieldset", {id: "presets"}, el("legend", {}, "Presets"),
    el("label", {}, "import a kohya_ss GUI preset (.json) or a sd-scripts config (.toml) ", file), el("br"),
    el("label", {}, "saved in this browser ", names), el("button", {id: "preset-load", onclick: () => names.value
      && usePreset(JSON.parse(localStorage.getItem(PRESET_PREFIX + names.value) || "{}"))}, "Load"),
    el("button", {id: "preset-delete", onclick: () => { localStorage.removeItem(PRESET_PREFIX + names.value);
      listed(); }}, "Delete"), " ", name,
    el("button", {id: "preset-save", onclick: () => { if (!name.value.trim()) return;
      localStorage.setItem(PRESET_PREFIX + name.value.trim(), JSON.stringify(settingsOnly())); listed(); }},
      "Save the settings as"), box);
}

// ---- runs ---------------------------------------------------------------------------------------

function runLinks(r) {  // the run's report page and the config that trained, where it has them
  const links = r.links || {};
  return [links.report ? el("a", {href: withToken(links.report), target: "_blank", "data-link": "report"}, "report") : "",
    links.report && links.config ? " " : "",
    links.config ? el("a", {href: withToken(links.config), target: "_blank", "data-link": "config"},
      links.config.split("/").pop()) : ""];
}

async function renderRuns() {
  const data = await api("GET", "/api/runs");
  view.replaceChildren(el("h2", {}, "Runs"), el("table", {id: "runs"},
    el("tr", {}, ...["run", "family", "state", "step", "duration", "LoRA", "it/s", "ETA", "files", "why"].map(
      h => el("th", {}, h))),
    ...data.runs.map(r => el("tr", {"data-run": r.id}, el("td", {}, el("a", {href: "#/run/" + r.id}, r.id)),
      el("td", {class: "family"}, r.family || "-"), el("td", {class: "state"}, r.state),
      el("td", {class: "step"}, r.step == null ? "-" : `${r.step} / ${r.max_train_steps}`),
      el("td", {class: "duration"}, duration(r.duration_s)),
      el("td", {class: "size"}, r.lora_bytes == null ? "-" : size(r.lora_bytes)),
      el("td", {}, r.it_per_s ? r.it_per_s.toFixed(2) : "-"), el("td", {}, duration(r.eta_s)),
      el("td", {class: "links"}, ...runLinks(r)),
      el("td", {class: "why"}, EXPLAINED.includes(r.state) ? r.message || "" : "")))));
}

// ---- one run ------------------------------------------------------------------------------------

const LIVE = ["running", "stepping down", "rolled back", "queued"];  // what Stop can stop
const RESUMABLE = ["failed", "interrupted"];  // what the server resumes (it answers 409 to the others)
const EXPLAINED = ["failed", "interrupted", "unreadable"];  // states whose one line says why
const LOG_LINES = 300;  // of the run's console, what the page keeps

function svgNode(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function curve(id, points, label, unit) {  // a line over the steps, with both axes labelled in their units
  const width = 500, height = 120, left = 64, below = 30;
  if (points.length < 2) return el("div", {id}, label + ": waiting for steps");
  const xs = points.map(p => p[0]), ys = points.map(p => p[1]);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  const coords = points.map(([x, y]) =>
    `${left + (x - x0) / (x1 - x0 || 1) * width},${height - (y - y0) / (y1 - y0 || 1) * height}`);
  const svg = svgNode("svg", {width: left + width + 8, height: height + below});
  svg.append(svgNode("polyline", {points: coords.join(" "), fill: "none", stroke: "#36c"}),
    svgNode("line", {x1: left, y1: 0, x2: left, y2: height, stroke: "#888"}),
    svgNode("line", {x1: left, y1: height, x2: left + width, y2: height, stroke: "#888"}),
    svgNode("text", {x: left - 4, y: 10, "text-anchor": "end", "font-size": 10, "data-axis": "y-max"}, y1.toPrecision(3)),
    svgNode("text", {x: left - 4, y: height, "text-anchor": "end", "font-size": 10, "data-axis": "y-min"},
      y0.toPrecision(3)),
    svgNode("text", {x: left, y: height + 12, "font-size": 10, "data-axis": "x-min"}, x0),
    svgNode("text", {x: left + width, y: height + 12, "text-anchor": "end", "font-size": 10, "data-axis": "x-max"}, x1),
    svgNode("text", {x: left + width / 2, y: height + 26, "text-anchor": "middle", "font-size": 11, "data-axis": "x"},
      "optimizer step"));
  return el("div", {id}, `${label}${unit ? ` (${unit})` : ""}`, svg);
}

function series(map) { return [...map.entries()].sort((a, b) => a[0] - b[0]); }

function memoryView(info, peakMib) {
  const planned = info.planned || {};
  const usable = planned.usable_bytes, predicted = planned.peak_bytes;
  if (!usable) return el("p", {id: "memory"}, "memory: no plan in this run's folder");
  const used = peakMib == null ? null : peakMib * 2 ** 20;
  return el("div", {id: "memory"}, `memory on ${planned.device || "the device"}: peak so far `,
    used == null ? "-" : gib(used), ` of ${gib(usable)} usable, predicted ${predicted ? gib(predicted) : "-"}`,
    el("div", {class: "bar" + (used > usable ? " over" : "")},
      el("span", {style: `width:${used == null ? 0 : Math.min(100, 100 * used / usable)}%`}),
      predicted ? el("i", {class: "mark", title: "predicted peak",
        style: `left:${Math.min(100, 100 * predicted / usable)}%`}) : ""));
}

function loraView(lora, id) {
  const m = lora.modules, counts = o => Object.entries(o || {}).map(([k, v]) => `${k} (${v})`).join(", ") || "-";
  const rows = [["family", lora.family || lora.family_label || "-"], ["modules", `${m.total} (UNet ${m.unet})`],
    ["rank(s)", counts(lora.ranks)], ["alpha(s)", counts(lora.alphas)], ["precision", counts(lora.precision)],
    ["parameters", lora.parameters.toLocaleString()], ["file size", size(lora.file_size)],
    ["network module", lora.network_module || "-"],
    ...Object.entries(lora.training || {}).map(([k, v]) => [k, String(v)])];
  return el("div", {id: "lora"}, el("h3", {}, "LoRA"),
    lora.download ? el("a", {id: "lora-download", href: withToken(lora.download), download: ""}, "download " +
      lora.download.split("/").pop()) : el("p", {id: "lora-file"}, lora.file),
    el("table", {id: "lora-table"}, ...rows.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v)))));
}

async function showEnd(id, report) {
  const r = await api("GET", `/api/runs/${encodeURIComponent(id)}/report`);
  const lora = await api("GET", `/api/runs/${encodeURIComponent(id)}/lora`);
  report.replaceChildren(el("h3", {}, "Report"),
    el("p", {id: "bottleneck"}, r.bottleneck ? `${r.bottleneck.message}; ${r.bottleneck.fix}` : ""),
    el("p", {}, `${r.steps} steps, outcome ${r.outcome}`), loraView(lora, id));
}

async function renderRun(id) {
  const info = await api("GET", "/api/runs/" + encodeURIComponent(id));
  const losses = new Map(), rates = new Map(), lrs = new Map(), memory = new Map();
  const status = el("p", {id: "run-status"});
  const charts = el("div", {id: "charts"});
  const memoryBox = el("div", {}, memoryView(info, info.peak_memory_mib));
  const decisions = el("ol", {id: "decisions"});
  const samples = el("div", {class: "samples", id: "samples"});
  const report = el("div", {id: "report"});
  const why = el("p", {id: "run-message", class: "why"});
  const stop = el("button", {id: "stop", onclick: () => api("POST", `/api/runs/${id}/stop`)}, "Stop (state saved)");
  const resume = el("button", {id: "resume", onclick: async () => {
    await api("POST", `/api/runs/${id}/resume`); renderRun(id); }}, "Resume");
  const show = (state, step, total, rate) => {
    status.replaceChildren(el("span", {class: "state", id: "run-state"}, state),
      ` step ${step ?? "-"} / ${total ?? "-"}, ${rate ? rate.toFixed(2) + " it/s" : "-"}`);
    stop.disabled = !LIVE.includes(state);
    resume.disabled = !RESUMABLE.includes(state);
  };
  const explain = (state, message) => why.replaceChildren(EXPLAINED.includes(state) && message ? message : "");
  show(info.state, info.step, info.max_train_steps, info.it_per_s);
  explain(info.state, info.message);
  const log = el("pre", {id: "log"}), logLines = [];
  const about = el("div", {id: "run-about"});
  const describe = () => about.replaceChildren(el("p", {}, `engine ${info.engine}`,
    info.family ? `, family ${info.family}` : ""), el("p", {id: "run-links"}, ...runLinks(info)),
    info.tensorboard ? el("p", {id: "tensorboard"}, "TensorBoard logs: ", el("code", {}, info.tensorboard.logdir),
      " (", el("code", {}, info.tensorboard.command), ")") : "");
  const refresh = async () => {  // what the run has written since (its plan, config, report, logs): read again
    Object.assign(info, await api("GET", "/api/runs/" + encodeURIComponent(id)));
    describe();
    memoryBox.replaceChildren(memoryView(info, peak));
  };
  describe();
  view.replaceChildren(el("h2", {}, "Run ", id), why, status, stop, resume, about, memoryBox, charts,
    el("h3", {}, "Decisions"), decisions, el("h3", {}, "Samples"), samples, el("h3", {}, "Log"), log, report);
  if (stream) stream.close();
  stream = new EventSource(withToken(`/api/runs/${encodeURIComponent(id)}/events`));
  let last = {}, drawing = false, refreshed = false, peak = info.peak_memory_mib;
  const draw = () => {
    drawing = false;
    charts.replaceChildren(curve("loss-curve", series(losses), "loss"), curve("lr-curve", series(lrs), "learning rate"),
      curve("speed-curve", series(rates), "speed", "it/s"),
      curve("memory-curve", series(memory), "peak memory", "MiB"));
    memoryBox.replaceChildren(memoryView(info, peak));
  };
  stream.addEventListener("state", e => {
    const s = JSON.parse(e.data);
    last.state = s.state;
    show(last.state, last.step, last.total, last.rate);
    explain(s.state, s.message);
    refresh();
  });
  stream.addEventListener("progress", e => {
    const p = JSON.parse(e.data);
    Object.assign(last, {step: p.step, total: p.max_train_steps, rate: p.it_per_s});
    show(last.state || info.state, p.step, p.max_train_steps, p.it_per_s);
    if (p.loss != null) losses.set(p.step, p.loss);
    if (p.it_per_s != null) rates.set(p.step, p.it_per_s);
    if (p.lr != null) lrs.set(p.step, p.lr);
    if (p.peak_memory_mib != null) { memory.set(p.step, p.peak_memory_mib); peak = p.peak_memory_mib; }
    if (!info.planned && !refreshed) { refreshed = true; refresh(); }  // the plan is written as training starts
    if (!drawing) { drawing = true; requestAnimationFrame(draw); }  // a replayed history draws once a frame
  });
  stream.addEventListener("decision", e => {
    const d = JSON.parse(e.data);
    decisions.append(el("li", {"data-event": d.event}, `${d.time} ${d.event}: ${d.text}`));
  });
  stream.addEventListener("sample", e => {
    const s = JSON.parse(e.data);
    samples.append(el("img", {src: withToken(`/api/runs/${encodeURIComponent(id)}/files/${s.file}`), alt: s.file}));
  });
  stream.addEventListener("log", e => {  // the console as a terminal shows it: its last lines, the bar's text
    const l = JSON.parse(e.data);
    logLines.push(...l.lines);
    logLines.splice(0, Math.max(0, logLines.length - LOG_LINES));
    const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    log.textContent = [...logLines, l.current].join("\n");
    if (atEnd) log.scrollTop = log.scrollHeight;
  });
  stream.addEventListener("end", e => {
    stream.close();
    refresh();
    if (JSON.parse(e.data).state === "done") showEnd(id, report);
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
api("GET", "/api/health").then(health => { engines = health.engines; });  // the plan's engine choice
