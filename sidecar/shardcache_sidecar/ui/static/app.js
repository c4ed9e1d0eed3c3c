// The web inspector's page. All state is in the query string, so a URL restores a
// view. Values from the dataset are inserted as text (textContent), never as HTML.
// JSON numbers are doubles here: where the server sends a `display` string (an
// integer beyond 2^53 - 1), the page shows that string, never the rounded number.
"use strict";

const FIELDS = [
  "epoch", "rank", "world_size", "step", "batch_size", "seed", "block_size", "granularity", "window",
  // Which pass over an epoch the followed run read more than once (from 1; empty: the newest).
  "pass",
];
const form = document.getElementById("controls");
const statusBox = document.getElementById("status");

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function say(message, isError) {
  statusBox.textContent = message || "";
  statusBox.className = isError ? "error" : "";
}

async function getJSON(path, params) {
  const url = path + (params ? "?" + params.toString() : "");
  const response = await fetch(url, { headers: { Accept: "application/json" } });
  const body = await response.json().catch(() => ({ error: response.statusText }));
  if (!response.ok) {
    // Our API answers {"error": "…"}; the sidecar's own errors (starting, refused) nest it.
    const e = body.error;
    throw new Error(typeof e === "string" ? e : (e && e.message) || response.statusText);
  }
  return body;
}

function viewParams() {
  const p = new URLSearchParams();
  for (const name of FIELDS) p.set(name, form.elements[name].value);
  p.set("shuffle", form.elements.shuffle.checked ? "true" : "false");
  return p;
}

function fillForm(params, defaults) {
  for (const name of FIELDS) {
    const given = params.get(name);
    const fallback = defaults && name in defaults ? defaults[name] : form.elements[name].value;
    form.elements[name].value = given !== null && given !== "" ? given : fallback;
  }
  const shuffle = params.get("shuffle");
  form.elements.shuffle.checked =
    shuffle !== null ? shuffle === "true" || shuffle === "1" : defaults ? defaults.shuffle : true;
}

function renderCell(cell) {
  switch (cell.kind) {
    case "null":
      return el("span", { class: "note" }, "null");
    case "text": {
      // A long text clipped for the page is measured in bytes (counting its characters
      // would read all of it).
      const size = cell.length !== null ? `${cell.length.toLocaleString()} chars` : `${cell.bytes.toLocaleString()} bytes`;
      return el("div", {},
        el("div", { class: "text" }, cell.value + (cell.truncated ? "…" : "")),
        el("span", { class: "note" }, `${size}${cell.truncated ? ", truncated" : ""}`));
    }
    case "tokens": {
      const ids = "display" in cell ? cell.display : cell.ids.join(", ");
      const box = el("div", {},
        el("code", { class: "ids" }, "[" + ids + (cell.truncated ? ", …" : "") + "]"),
        el("span", { class: "note" }, `${cell.length.toLocaleString()} tokens`));
      if ("decoded" in cell) {
        box.append(el("div", { class: "text" }, el("span", { class: "note" }, "decoded: "),
          cell.decoded + (cell.decoded_truncated ? "…" : "")));
      }
      return box;
    }
    case "image": {
      const size = cell.width !== null ? `${cell.width}×${cell.height}` : "size unknown";
      const img = el("img", { class: "thumb", src: cell.src, alt: `${cell.format} image ${size}`, loading: "lazy" });
      return el("div", {}, img, el("span", { class: "note" }, `${cell.format.toUpperCase()} ${size}, ${cell.bytes.toLocaleString()} bytes`));
    }
    case "binary":
      return el("span", { class: "note" }, `${cell.bytes.toLocaleString()} bytes, starts ${cell.head}`);
    case "turns": {
      const table = el("table", { class: "turns" },
        el("tr", {}, ...cell.columns.map((c) => el("th", {}, c))));
      for (const row of cell.rows) table.append(el("tr", {}, ...row.map((v) => el("td", {}, v))));
      const note = el("span", { class: "note" }, `${cell.length} turn(s)${cell.truncated ? ", first shown" : ""}`);
      return el("div", {}, table, note);
    }
    case "struct": {
      const dl = el("dl", { class: "cells" });
      for (const [name, sub] of Object.entries(cell.fields)) dl.append(el("dt", {}, name), el("dd", {}, renderCell(sub)));
      return dl;
    }
    case "list": {
      const items = "display" in cell ? cell.display : JSON.stringify(cell.value);
      return el("code", {}, items + ` (${cell.length} items${cell.truncated ? ", first shown" : ""})`);
    }
    default:
      if ("display" in cell) return el("span", {}, cell.display);
      return el("span", {}, typeof cell.value === "string" ? cell.value : JSON.stringify(cell.value));
  }
}

// The opening view's batch size when nobody gave the run's (info.defaults): step N is
// batch N of it, other samples at another size, so the page says it was assumed, as
// `shardcache inspect` does.
let assumedBatchSize = null;

function batchAssumed(size) {
  return assumedBatchSize !== null && Number(size) === assumedBatchSize;
}

function assumedNote(size) {
  return `batch size ${size} is assumed (the default): give the run's with --batch-size, ` +
    `or follow its checkpoints with --checkpoint-uri; step N is batch N of that size`;
}

function renderStep(data) {
  const q = data.query;
  const samples = document.getElementById("samples");
  samples.replaceChildren();
  const first = data.samples.length ? data.samples[0].provenance.position : 0;
  document.getElementById("summary").textContent =
    `epoch ${q.epoch} · rank ${q.rank} of ${q.world_size} · step ${q.step} of ${data.steps} · ` +
    `samples ${first}–${first + data.samples.length - 1} of ${data.rank_samples} for this rank` +
    (batchAssumed(q.batch_size) ? ` · ${assumedNote(q.batch_size)}` : "");
  document.getElementById("batch-assumed").hidden = !batchAssumed(q.batch_size);
  data.samples.forEach((sample, slot) => {
    const p = sample.provenance;
    const cells = el("dl", { class: "cells" });
    for (const [name, cell] of Object.entries(sample.values)) {
      cells.append(el("dt", {}, name), el("dd", { "data-column": name }, renderCell(cell)));
    }
    samples.append(el("article", { class: "sample", "data-index": p.index },
      el("h3", {}, `#${slot} · sample ${p.index}`,
        el("span", { class: "prov" }, `shard ${p.shard} · row ${p.row} · position ${p.position}`)),
      cells));
  });
  samples.dataset.loaded = `${q.epoch},${q.rank},${q.step}`;
}

async function show(push) {
  const params = viewParams();
  if (push) history.pushState(null, "", "/ui?" + params.toString());
  say("loading…");
  try {
    const data = await getJSON("/ui/api/step", params);
    renderStep(data);
    say((data.run_notes || []).join("; "));
  } catch (err) {
    document.getElementById("samples").dataset.loaded = "error";
    say(err.message, true);
  }
}

function move(field, by) {
  const input = form.elements[field];
  let value = Number(input.value) + by;
  if (field === "rank") {
    const world = Number(form.elements.world_size.value);
    value = ((value % world) + world) % world;
  }
  if (value < 0) return;
  input.value = value;
  show(true);
}

async function find(event) {
  event.preventDefault();
  const where = event.target;
  const params = viewParams();
  params.set("expr", where.elements.expr.value);
  params.set("epochs", where.elements.epochs.value);
  const list = document.getElementById("where-results");
  list.replaceChildren();
  try {
    const data = await getJSON("/ui/api/where", params);
    for (const note of data.run_notes || []) list.append(el("li", { class: "note" }, note));
    if (!data.sightings.length) list.append(el("li", {}, noMatch(data)));
    for (const s of data.sightings) {
      if (s.before_resize) {
        // No rank of this world size reads it in that epoch: the run's earlier one did.
        list.append(el("li", {}, `sample ${s.index}: epoch ${s.epoch}: consumed before the elastic resume (the lineage view says by whom)`));
        continue;
      }
      if (s.skipped) {
        list.append(el("li", {}, `sample ${s.index}: epoch ${s.epoch}, rank ${s.rank}: skipped, never read`));
        continue;
      }
      const link = el("a", { href: "#" }, `sample ${s.index}: epoch ${s.epoch}, rank ${s.rank}, step ${s.step}`);
      link.addEventListener("click", (e) => {
        e.preventDefault();
        form.elements.epoch.value = s.epoch;
        form.elements.rank.value = s.rank;
        form.elements.step.value = s.step;
        show(true);
      });
      list.append(el("li", {}, link));
    }
    if (data.truncated) list.append(el("li", { class: "note", "data-stopped": data.stopped || "" }, scanNote(data)));
  } catch (err) {
    list.append(el("li", { class: "error" }, err.message));
  }
}

// A lookup that stopped at its row budget has not looked at every sample: say how far
// it got, never "no sample matches".
function noMatch(data) {
  if (data.stopped === "budget") {
    return `no match in the first ${data.scanned_rows.toLocaleString()} of ${data.dataset_rows.toLocaleString()} rows searched for ${data.expression}`;
  }
  return `no sample matches ${data.expression}`;
}

function scanNote(data) {
  if (data.stopped === "budget") {
    return `searched the first ${data.scanned_rows.toLocaleString()} of ${data.dataset_rows.toLocaleString()} rows (the lookup's budget): later rows were not searched`;
  }
  return "more matches not shown";
}

// The lineage view: which (epoch, step, rank) of the run read the matches, and which
// checkpoints include them; a link shows the step with the run's plan (and its skips).
function runParams(run, read) {
  // After an elastic resize the rank number is a reader of the read's generation: its
  // world size and batch size, not the first generation's (`run.world_size`), give the
  // rows it was handed. Seed, shuffle, block size and window are one for the whole run
  // (lineage refuses a run whose plan changed), so the run's are the read's.
  const gen = (run.generations || [])[read.generation] || run;
  const p = new URLSearchParams();
  p.set("epoch", read.epoch);
  // The pass that read it: its skips, not the newest pass's, give that step's rows.
  p.set("pass", (read.pass_index || 0) + 1);
  p.set("rank", read.rank);
  p.set("step", read.step);
  p.set("world_size", read.world_size || run.world_size);
  p.set("seed", run.seed);
  p.set("block_size", run.block_size);
  p.set("granularity", run.granularity);
  p.set("window", run.window);
  p.set("batch_size", gen.batch_size || form.elements.batch_size.value);
  p.set("shuffle", run.shuffle ? "true" : "false");
  return p;
}

// "world size 4, batch size 8", or for a resized run each generation's in turn. A
// generation whose checkpoints were saved outside batches() records no batch size.
function runSizes(run) {
  const gens = run.generations && run.generations.length > 1 ? run.generations : [run];
  const worlds = gens.map((g) => g.world_size).join(" → ");
  const batches = gens.map((g) => g.batch_size ?? "not recorded").join(" → ");
  return `world size ${worlds}, batch size ${batches}`;
}

function describeRead(r, run) {
  // pass_index > 0: the rank read the epoch again from its start (a second pass).
  const pass = r.pass_index ? ` pass ${r.pass_index + 1}` : "";
  // Rank numbers are per world size once the run was resumed at another.
  const world = run.generations && run.generations.length > 1 ? ` of ${r.world_size}` : "";
  const where = `sample ${r.index}: epoch ${r.epoch}${pass}, rank ${r.rank}${world}`;
  if (r.status === "skipped") return `${where}: skipped, never read`;
  const at = r.step !== null ? `, step ${r.step}` : "";
  if (r.status === "pending") return `${where}${at}: after the newest checkpoint`;
  const since = r.after !== null ? `after checkpoint ${r.after}` : "before the oldest kept";
  return `${where}${at}: read ${since}; in checkpoints ${r.checkpoints.join(", ")}`;
}

async function follow(event) {
  event.preventDefault();
  const list = document.getElementById("lineage-results");
  list.replaceChildren();
  list.dataset.loaded = "";
  try {
    const data = await getJSON("/ui/api/lineage", new URLSearchParams({ expr: event.target.elements.expr.value }));
    const run = data.run;
    document.getElementById("lineage-run").textContent =
      `run: ${runSizes(run)}, seed ${run.seed}, ` +
      `checkpoints ${run.checkpoints.map((c) => c.step).join(", ") || "none"}`;
    if (!data.reads.length) list.append(el("li", {}, noMatch(data)));
    for (const r of data.reads) {
      if (r.status === "skipped" || r.step === null) {
        list.append(el("li", { class: "note", "data-status": r.status }, describeRead(r, run)));
        continue;
      }
      const link = el("a", { href: "#", "data-status": r.status }, describeRead(r, run));
      link.addEventListener("click", (e) => {
        e.preventDefault();
        fillForm(runParams(run, r));
        show(true);
      });
      list.append(el("li", {}, link));
    }
    if (data.truncated) list.append(el("li", { class: "note", "data-stopped": data.stopped || "" }, scanNote(data)));
    list.dataset.loaded = "reads";
  } catch (err) {
    list.append(el("li", { class: "error" }, err.message));
    list.dataset.loaded = "error";
  }
}

async function consumed(event) {
  event.preventDefault();
  const list = document.getElementById("lineage-results");
  list.replaceChildren();
  list.dataset.loaded = "";
  try {
    const data = await getJSON("/ui/api/lineage", new URLSearchParams({ consumed: event.target.elements.consumed.value }));
    list.append(el("li", {}, `checkpoint ${data.step}: ${data.samples.toLocaleString()} samples since the previous one` +
      (data.complete ? "" : " (not published by every rank)")));
    for (const r of data.ranks) {
      const ranges = r.epochs.map((e) => `epoch ${e.epoch}: ` + e.ranges.map(([lo, hi]) => `[${lo}, ${hi})`).join(" ")).join("; ");
      const skipped = (r.skips || []).map((s) => ` skipped epoch ${s.epoch} [${s.start}, ${s.stop})`).join(";");
      list.append(el("li", { class: "consumed" }, r.published ? `rank ${r.rank}: ${ranges}${skipped}` : `rank ${r.rank}: not published`));
    }
    list.dataset.loaded = "consumed";
  } catch (err) {
    list.append(el("li", { class: "error" }, err.message));
    list.dataset.loaded = "error";
  }
}

function histogram(h) {
  const width = 300, height = 70, n = h.counts.length;
  const max = Math.max(...h.counts, 1);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "hist");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height + 14);
  h.counts.forEach((count, i) => {
    const rect = document.createElementNS(ns, "rect");
    const barHeight = (count / max) * height;
    rect.setAttribute("x", (i * width) / n);
    rect.setAttribute("y", height - barHeight);
    rect.setAttribute("width", Math.max(1, width / n - 1));
    rect.setAttribute("height", barHeight);
    const title = document.createElementNS(ns, "title");
    title.textContent = `${h.edges[i]}–${h.edges[i + 1] - 1}: ${count}`;
    rect.append(title);
    svg.append(rect);
  });
  for (const [x, anchor, text] of [[0, "start", h.edges[0]], [width, "end", h.edges[n] - 1]]) {
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", x);
    label.setAttribute("y", height + 12);
    label.setAttribute("text-anchor", anchor);
    label.setAttribute("font-size", "10");
    label.textContent = text;
    svg.append(label);
  }
  return svg;
}

function summary(s) {
  if (s && s.display) return s.display;
  return s && s.min !== null ? `${s.min} / ${s.mean} / ${s.max}` : "";
}

async function loadStats() {
  const body = document.getElementById("stats-body");
  try {
    const data = await getJSON("/ui/api/stats");
    const table = el("table", { class: "stats" },
      el("tr", {}, el("th", {}, "column"), el("th", {}, "type"), el("th", {}, "nulls"), el("th", {}, "min / mean / max")));
    const hists = el("div", {});
    for (const c of data.columns) {
      const s = c.values || c.length_chars || c.length_bytes || c.length_items;
      const unit = c.values ? "" : c.length_chars ? " chars" : c.length_bytes ? " bytes" : " items";
      table.append(el("tr", {}, el("td", {}, c.name), el("td", {}, c.type), el("td", {}, c.nulls), el("td", {}, summary(s) + (s ? unit : ""))));
      if (c.histogram && c.histogram.counts.length) {
        hists.append(el("h2", {}, `${c.tokens ? "Token" : "Length"} histogram: ${c.name}`), histogram(c.histogram));
      }
    }
    body.className = "";
    body.replaceChildren(el("p", { class: "note" }, `first ${data.rows.toLocaleString()} of ${data.dataset_rows.toLocaleString()} rows`), table, hists);
  } catch (err) {
    body.textContent = err.message;
  }
}

async function start() {
  try {
    const info = await getJSON("/ui/api/info");
    const d = info.dataset;
    document.getElementById("dataset").textContent =
      `${d.root} · ${d.format} · ${d.shards} shards · ${d.rows.toLocaleString()} samples · ${d.digest.slice(0, 19)}…`;
    fillForm(new URLSearchParams(location.search), info.defaults);
    if (info.defaults.batch_size_from === "assumed") assumedBatchSize = info.defaults.batch_size;
    const marker = document.getElementById("batch-assumed");
    marker.title = assumedNote(info.defaults.batch_size);
    marker.hidden = !batchAssumed(form.elements.batch_size.value);
    document.getElementById("lineage").hidden = !info.lineage;
  } catch (err) {
    say(err.message, true);
    return;
  }
  form.addEventListener("submit", (e) => { e.preventDefault(); show(true); });
  for (const button of form.querySelectorAll("button[data-move]")) {
    button.addEventListener("click", () => move(button.dataset.move, Number(button.dataset.by)));
  }
  document.getElementById("where-form").addEventListener("submit", find);
  document.getElementById("lineage-form").addEventListener("submit", follow);
  document.getElementById("consumed-form").addEventListener("submit", consumed);
  window.addEventListener("popstate", () => { fillForm(new URLSearchParams(location.search)); show(false); });
  show(false);
  loadStats();
}

start();
