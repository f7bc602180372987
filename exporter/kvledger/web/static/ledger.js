// The live ledger page: draws ui/ledger.json (the daemon's latest accounts, every number a
// sample of /metrics with its basis) and fetches it again every REFRESH_MS. Text from the
// daemon (engine, pool and tenant names) is only ever set as text, never as markup.
"use strict";

(() => {
  const REFRESH_MS = 2000;
  const root = document.getElementById("ledger");
  const statusLine = document.getElementById("status");
  const nodeSources = document.getElementById("node-sources");
  let renders = 0;
  let lastTakenAt = null;

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === null || value === undefined) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key === "style") Object.assign(node.style, value);
      else if (key === "data") Object.entries(value).forEach(([k, v]) => { if (v !== null && v !== undefined) node.dataset[k] = String(v); });
      else node.setAttribute(key, value);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
    return node;
  }

  const UNITS = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];

  function fmtBytes(value) {
    const abs = Math.abs(value);
    for (const [suffix, scale] of UNITS) {
      if (abs >= scale) {
        const v = value / scale;
        const digits = Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 2;
        return `${v.toFixed(digits)} ${suffix}`.replace("-", "\u2212");
      }
    }
    return `${value} B`.replace("-", "\u2212");
  }

  function fmt(value, unit) {
    return unit === "bytes" ? fmtBytes(value) : `${value} ${unit}`;
  }

  // A quantity is {basis: value} as /metrics exports it: exact, or lower_bound and/or upper_bound.
  const low = (q) => (q ? q.exact ?? q.lower_bound ?? null : null);
  const high = (q) => (q ? q.exact ?? q.upper_bound ?? null : null);

  function basisOf(q) {
    if (!q) return "unknown";
    if (q.exact !== undefined) return "exact";
    if (q.lower_bound !== undefined && q.upper_bound !== undefined) return "range";
    return q.lower_bound !== undefined ? "lower_bound" : "upper_bound";
  }

  function describe(q, unit) {
    switch (basisOf(q)) {
      case "exact": return fmt(q.exact, unit);
      case "range": return `${fmt(q.lower_bound, unit)} \u2013 ${fmt(q.upper_bound, unit)}`;
      case "lower_bound": return `\u2265 ${fmt(q.lower_bound, unit)}`;
      case "upper_bound": return `\u2264 ${fmt(q.upper_bound, unit)}`;
      default: return "unknown";
    }
  }

  function figure(quantity, label, q, unit, note) {
    const basis = basisOf(q);
    return el("span", {
      class: `figure${basis === "unknown" ? " unknown" : ""}`,
      data: {
        quantity, basis,
        exact: q ? q.exact : null,
        lowerBound: q ? q.lower_bound : null,
        upperBound: q ? q.upper_bound : null,
      },
    }, el("span", { class: "label", text: `${label} ` }), el("span", { class: "value", text: describe(q, unit) }),
    note ? el("span", { class: "note", text: note }) : null);
  }

  // The bar: [0, C] cut at two boundaries, in use | reclaimable at in_use and reclaimable | free
  // at allocated. An exact boundary is a line; a bounded one a hatched span covering its range.
  function segments(pool) {
    const C = pool.capacity;
    const clamp = (v) => Math.min(C, Math.max(0, v));
    let aLo = low(pool.allocated);
    let aHi = high(pool.allocated);
    if (aLo === null && high(pool.free) !== null) aLo = C - high(pool.free);
    if (aHi === null && low(pool.free) !== null) aHi = C - low(pool.free);
    let uLo = low(pool.in_use);
    let uHi = high(pool.in_use);
    if (uLo === null && uHi === null && aLo === null && aHi === null) {
      return [["unknown", 0, C]];
    }
    uLo = clamp(uLo ?? 0);
    uHi = clamp(Math.max(uLo, uHi ?? aHi ?? C));
    aLo = clamp(Math.max(uHi, aLo ?? uHi));
    aHi = clamp(Math.max(aLo, aHi ?? C));
    return [
      ["in_use", 0, uLo], ["in_use|reclaimable", uLo, uHi], ["reclaimable", uHi, aLo],
      ["reclaimable|free", aLo, aHi], ["free", aHi, C],
    ].filter(([, from, to]) => to > from);
  }

  const SEGMENT_CLASS = {
    "in_use": "seg seg-in_use", "reclaimable": "seg seg-reclaimable", "free": "seg seg-free",
    "in_use|reclaimable": "seg range range-in_use-reclaimable",
    "reclaimable|free": "seg range range-reclaimable-free", "unknown": "seg range range-unknown",
  };
  const SEGMENT_TITLE = {
    "in_use": "in use", "reclaimable": "reclaimable", "free": "free",
    "in_use|reclaimable": "in use or reclaimable: the source knows only bounds",
    "reclaimable|free": "reclaimable or free: the source knows only bounds",
    "unknown": "physical state unknown: the source does not say",
  };

  function bar(pool) {
    const C = pool.capacity;
    const node = el("div", { class: "bar", data: { capacity: C } });
    for (const [kind, from, to] of segments(pool)) {
      node.append(el("div", {
        class: SEGMENT_CLASS[kind], title: `${SEGMENT_TITLE[kind]}: ${fmt(to - from, pool.unit)}`,
        data: { segment: kind, from, to }, style: { width: `${(100 * (to - from)) / C}%` },
      }));
    }
    return node;
  }

  function reserveTrack(pool) {
    const C = pool.capacity;
    const track = el("div", { class: "reserve-track" });
    const q = pool.reserved;
    if (!q) return track;
    const pos = (v) => `${Math.min(100, Math.max(0, (100 * v) / C))}%`;
    const basis = basisOf(q);
    if (basis !== "exact") {
      const from = low(q) ?? 0;
      const to = high(q) ?? C;
      track.append(el("div", { class: "reserve-range", title: `reserved: ${describe(q, pool.unit)}`,
        style: { left: pos(from), width: `calc(${pos(to)} - ${pos(from)})` } }));
    }
    const at = high(q) ?? low(q);
    track.append(el("div", {
      class: `reserve-mark${basis === "exact" ? "" : " bound"}${at > C ? " over" : ""}`,
      title: `reserved: ${describe(q, pool.unit)}`, data: { at }, style: { left: pos(at) },
    }));
    return track;
  }

  function share(q, C) {
    const at = high(q);
    if (at === null || !C) return null;
    const pct = Math.round((100 * at) / C);
    const basis = basisOf(q);
    const prefix = basis === "exact" ? "" : basis === "lower_bound" ? "\u2265 " : "\u2264 ";
    const over = (low(q) ?? 0) > C; // overcommit only when even the lower bound exceeds capacity
    return ` (${prefix}${pct}% of capacity${over ? ": overcommit" : ""})`;
  }

  function poolCard(engine, pool) {
    const unit = pool.unit;
    const C = pool.capacity;
    const title = `pool ${pool.pool}` + (pool.capacity_blocks !== null && pool.capacity_blocks !== undefined
      ? ` \u00b7 ${pool.capacity_blocks} blocks of ${pool.block_size_tokens} tokens` : "")
      + (unit === "blocks" ? " \u00b7 bytes per block unknown: drawn in blocks" : "");
    return el("div", { class: "pool", data: { engine: engine.engine, pool: pool.pool, unit } },
      el("div", { class: "pool-title", text: title }),
      bar(pool),
      reserveTrack(pool),
      el("div", { class: "figures" },
        figure("capacity", "capacity", { exact: C }, unit),
        figure("in_use", "in use", pool.in_use, unit),
        figure("reclaimable", "reclaimable", pool.reclaimable, unit),
        figure("free", "free", pool.free, unit),
        figure("reserved", "reserved", pool.reserved, unit, pool.reserved ? share(pool.reserved, C) : null)),
      el("div", { class: "figures" },
        figure("quota_headroom", "quota headroom (capacity \u2212 reserved)", pool.quota_headroom, unit),
        figure("physical_headroom", "physical headroom (free + reclaimable)", pool.physical_headroom, unit)),
      ...(pool.groups || []).map((g) => groupLine(g)));
  }

  // one KV-cache group of a pool shared by several (a hybrid model), in blocks of the pool
  function groupLine(g) {
    const kind = g.layer_type.replace(/_/g, " ") + (g.window_tokens ? ` (${g.window_tokens} tokens)` : "");
    return el("div", { class: "figures group", data: { group: g.group, layerType: g.layer_type } },
      el("span", { class: "label", text: `group ${g.group}: ${kind} ` }),
      figure("group_in_use", "in use", g.in_use, "blocks"),
      figure("group_reserved", "reserved", g.reserved, "blocks"));
  }

  function sourceChips(sources) {
    return sources.map((s) => el("span", {
      class: `chip ${s.up ? "up" : "down"}`, data: { source: s.source, up: s.up ? "1" : "0" },
      title: s.message || (s.up ? "the latest poll succeeded" : `down: ${s.reason}`),
      text: s.up ? `${s.source} up` : `${s.source} down (${s.reason})`,
    }));
  }

  function engineCard(engine, jsonView) {
    const p = engine.policy;
    const r = engine.requests;
    const identity = [engine.kind, engine.version].filter((x) => x).join(" ");
    const card = el("article", { class: "engine", data: { engine: engine.engine } },
      el("h2", {}, el("span", { class: "name", text: engine.engine }),
        el("span", { class: "identity", text: identity })),
      el("p", { class: "policy", data: { sharing: p.sharing, admission: p.admission, overflow: p.overflow } },
        "policy: sharing ", el("b", { text: p.sharing ?? "unknown" }),
        " \u00b7 admission ", el("b", { text: p.admission ?? "unknown" }),
        " \u00b7 overflow ", el("b", { text: p.overflow ?? "unknown" }),
        " \u00b7 tenant figures ", el("b", { text: p.tenant_rule ?? "per-request" })),
      el("p", { class: "requests" }, "requests: ",
        ...["running", "waiting", "preempted"].flatMap((state, i) => [
          i ? " \u00b7 " : "", `${state} `, el("b", { data: { state }, text: r[state] ?? "unknown" })])),
      el("p", { class: "sources" }, "sources: ", ...sourceChips(engine.sources)));
    if (engine.pools.length === 0) {
      card.append(el("p", { class: "muted", text: "no pools: the engine's source is down (only configured facts remain)" }));
    }
    for (const pool of engine.pools) card.append(poolCard(engine, pool));
    if (jsonView && engine.tenants && engine.tenants.length) {
      const table = el("table", { class: "tenants" },
        el("tr", {}, el("th", { text: "tenant" }), el("th", { text: "reserved (per-request)" }), el("th", { text: "quota" })));
      for (const t of engine.tenants) {
        table.append(el("tr", { data: { tenant: t.tenant } }, el("td", { text: t.tenant }),
          el("td", { class: "num", text: t.reserved_bytes === null ? "unknown" : fmtBytes(t.reserved_bytes) }),
          el("td", { class: "num", text: t.quota_bytes === null ? "none" : fmtBytes(t.quota_bytes) })));
      }
      card.append(table);
    }
    return card;
  }

  function timeOf(seconds) {
    return new Date(seconds * 1000).toLocaleTimeString([], { hour12: false });
  }

  function render(doc) {
    const cards = doc.engines.map((e) => engineCard(e, doc.json_view));
    if (!doc.json_view && doc.engines.length) {
      cards.push(el("p", { class: "muted", text: "Tenants are not listed: the JSON view is off (json_view: true in the configuration lists them)." }));
    }
    root.replaceChildren(...cards);
    nodeSources.replaceChildren(...(doc.node_sources.length
      ? [el("span", { class: "muted", text: "node sources: " }), ...sourceChips(doc.node_sources)] : []));
    statusLine.className = "status";
    statusLine.textContent = doc.taken_at === null
      ? "No accounting cycle has completed yet."
      : `Accounts of ${timeOf(doc.taken_at)} (sharing rule ${doc.sharing}), refreshed every ${REFRESH_MS / 1000} s.`;
    renders += 1;
    lastTakenAt = doc.taken_at;
    root.dataset.takenAt = doc.taken_at === null ? "" : String(doc.taken_at);
    root.dataset.renders = String(renders);
    document.dispatchEvent(new CustomEvent("kvledger:rendered", { detail: { takenAt: doc.taken_at, renders } }));
  }

  async function refresh() {
    try {
      const response = await fetch("ui/ledger.json", { cache: "no-store", credentials: "same-origin" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      render(await response.json());
    } catch (err) {
      statusLine.className = "status error";
      statusLine.textContent = `Cannot read the accounts (${err.message}); `
        + (lastTakenAt === null ? "nothing to show yet." : `showing those of ${timeOf(lastTakenAt)}.`);
    } finally {
      setTimeout(refresh, REFRESH_MS);
    }
  }

  refresh();
})();
