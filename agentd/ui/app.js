// agentd's browser view: a few pages over the agent's own REST endpoints, nothing else.
// Pages (the URL's hash): #/cluster, #/node/NAME, #/pod/NODE/NS/NAME, #/services, #/flows?filters.
"use strict";

const view = document.getElementById("view");
let stopStream = null; // the live flow stream of the page shown, if any
// Counts the pages asked for: a page whose answers come after the reader went on to another
// (a slow node) shows nothing, and leaves that page's live stream alone.
let shown = 0;

// The browser view's key (`agentd ui` prints the address with it): what this agent gathers
// from the other nodes needs it.  Taken from the address once, kept for this origin once this
// agent takes it (a GET /cluster with it succeeds: any web page can send the browser here
// with a ?key= of its own, which must not replace the one kept), and taken out of the address
// bar (and so of the history it would otherwise stay in).
const KEY = "agentd-ui-key";
const keyTaken = (async () => {
  const q = new URLSearchParams(location.search);
  if (!q.has("key")) return;
  const key = q.get("key");
  q.delete("key");
  history.replaceState(null, "", location.pathname + (q.size ? "?" + q : "") + location.hash);
  try {
    const resp = await fetch("/cluster", { headers: { Accept: "application/json", Authorization: "Bearer " + key } });
    if (resp.ok) localStorage.setItem(KEY, key);
  } catch (err) {
    // not reached: the key kept stays
  }
})();

function withKey(headers) {
  const key = localStorage.getItem(KEY);
  return key ? { ...headers, Authorization: "Bearer " + key } : headers;
}

// ------------------------------------------------------------------ small helpers

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function svg(tag, attrs, ...children) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

async function getJSON(path) {
  const resp = await fetch(path, { headers: withKey({ Accept: "application/json" }) });
  const body = await resp.json().catch(() => ({ error: `${path}: not JSON (${resp.status})` }));
  if (!resp.ok) throw new Error(body.error || `${path}: ${resp.status}`);
  return body;
}

function table(headers, rows, rowAttrs) {
  return el("table", {},
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.map((r, i) => el("tr", rowAttrs ? rowAttrs(i) : {}, r.map((c) => c instanceof Node ? el("td", {}, c) : el("td", {}, c === null || c === undefined ? "–" : String(c)))))));
}

function when(ts) {
  if (!ts) return "–";
  const d = new Date(ts * 1000);
  return d.toLocaleTimeString([], { hour12: false }) + "." + String(d.getMilliseconds()).padStart(3, "0");
}

// ip:port, an IPv6 address in brackets ([fd00:10:96::a]:80): never ambiguous.
function hostPort(ip, port) { return String(ip).includes(":") ? `[${ip}]:${port}` : `${ip}:${port}`; }

function pill(text, cls) { return el("span", { class: "pill " + (cls || "") }, text); }

function labels(obj) { return Object.entries(obj || {}).map(([k, v]) => pill(`${k}=${v}`)); }

function failure(err) { return el("p", { class: "err" }, String(err.message || err)); }

function page(title, ...content) {
  view.replaceChildren(el("h1", {}, title), ...content.filter((c) => c !== null && c !== undefined));
}

// ------------------------------------------------------------------ the cluster

async function showCluster() {
  const me = shown;
  page("Cluster", el("p", { class: "muted" }, "Asking every node…"));
  let data;
  try { data = await getJSON("/cluster"); } catch (err) { if (me === shown) page("Cluster", failure(err)); return; }
  if (me !== shown) return;
  document.getElementById("where").textContent = `asked through ${data.node}`;
  const names = Object.keys(data.nodes).sort();
  const rows = names.map((name) => {
    const n = data.nodes[name];
    const s = n.status || {};
    const node = s.node || {};
    const peers = (s.bgp || {}).peers || [];
    const up = peers.filter((p) => p.state === "Established").length;
    return [
      el("a", { href: `#/node/${encodeURIComponent(name)}`, "data-node-link": name }, name),
      n.address || node.address,
      node.subnet,
      node.backend,
      n.error ? el("span", { class: "bad" }, "unreachable: " + n.error) : (s.ready ? el("span", { class: "ok" }, "ready") : el("span", { class: "warn" }, "not ready")),
      node.route_reflector ? "reflector" : (s.bgp ? "" : "–"),
      n.error ? "–" : `${up}/${peers.length} Established`,
    ];
  });
  page("Cluster",
    el("div", { class: "card" }, sessionGraph(data, names)),
    el("div", { class: "legend" },
      el("span", { class: "ok" }, "━ Established (both ends)"),
      el("span", { class: "warn" }, "┅ Established at one end only"),
      el("span", { class: "bad" }, "╍ not Established"),
      el("span", { class: "muted" }, "┈ the other end could not be asked"),
      el("span", {}, "● node  ◉ route reflector  ○ external peer  grey: unreachable")),
    el("h2", {}, "Nodes"),
    table(["node", "address", "subnet", "backend", "state", "role", "BGP sessions"], rows, (i) => ({ "data-node-row": names[i] })));
}

// The BGP sessions as a picture: nodes on a circle, one line per session, coloured by state.
function sessionGraph(data, names) {
  const byAddr = {};
  for (const name of names) {
    const n = data.nodes[name];
    const addr = n.address || ((n.status || {}).node || {}).address;
    if (addr) byAddr[addr] = name;
  }
  const external = new Set();
  const sessions = {}; // "a|b" -> {a, b, states: {a: state, b: state}}
  for (const name of names) {
    for (const p of (((data.nodes[name].status || {}).bgp || {}).peers || [])) {
      const other = byAddr[p.address] || p.address;
      if (!byAddr[p.address]) external.add(p.address);
      const [a, b] = [name, other].sort();
      const key = `${a}|${b}`;
      sessions[key] = sessions[key] || { a, b, states: {} };
      sessions[key].states[name] = p.state;
    }
  }
  const all = [...names, ...[...external].sort()];
  const W = 760, H = Math.max(360, 120 + all.length * 6), cx = W / 2, cy = H / 2, r = Math.min(W, H) / 2 - 60;
  const pos = {};
  all.forEach((n, i) => {
    const t = -Math.PI / 2 + (2 * Math.PI * i) / all.length;
    pos[n] = [cx + r * Math.cos(t), cy + r * Math.sin(t)];
  });
  const g = svg("svg", { class: "graph", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "BGP sessions", id: "session-graph" });
  for (const key of Object.keys(sessions).sort()) {
    const s = sessions[key];
    const states = Object.values(s.states);
    // The ends that are nodes of the cluster and answered: one that could not be asked says
    // nothing of the session (not "one end only").  An external peer is never asked.
    const asked = [s.a, s.b].filter((n) => names.includes(n) && !data.nodes[n].error).length;
    const unasked = [s.a, s.b].some((n) => names.includes(n) && data.nodes[n].error);
    const est = states.filter((x) => x === "Established").length;
    const state = est === 0 ? "down" : unasked ? "unknown" : (est < asked && asked === 2 ? "half" : "up");
    const [x1, y1] = pos[s.a], [x2, y2] = pos[s.b];
    const line = svg("line", { x1, y1, x2, y2, class: `session state-${state}`, "data-session": key, "data-state": state });
    line.append(svg("title", {}, `${s.a} ↔ ${s.b}: ` + Object.entries(s.states).map(([n, st]) => `${n} says ${st}`).join(", ") +
      (unasked ? " (the other end could not be asked)" : "")));
    g.append(line);
  }
  for (const n of all) {
    const [x, y] = pos[n];
    const info = data.nodes[n];
    const st = info && info.status ? info.status : null;
    const cls = !info ? "external" : info.error ? "unreachable" : (st.node || {}).route_reflector ? "reflector" : "";
    const group = svg("a", { href: info ? `#/node/${encodeURIComponent(n)}` : null });
    const circle = svg("circle", { cx: x, cy: y, r: cls === "reflector" ? 16 : 12, class: `node ${cls}`, "data-graph-node": n });
    circle.append(svg("title", {}, info ? `${n} ${info.address || ""}` : `external peer ${n}`));
    group.append(circle, svg("text", { x: x + 18, y: y + 4 }, n));
    g.append(group);
  }
  return g;
}

// ------------------------------------------------------------------ a node

async function showNode(name) {
  const me = shown;
  page(`Node ${name}`, el("p", { class: "muted" }, "Loading…"));
  const base = `/nodes/${encodeURIComponent(name)}`;
  let status, routes, policy;
  try {
    [status, routes, policy] = await Promise.all([getJSON(`${base}/status`), getJSON(`${base}/routes`),
      getJSON(`${base}/policy?view=pods`).catch((err) => ({ failed: err.message, pods: [] }))]);
  } catch (err) { if (me === shown) page(`Node ${name}`, failure(err)); return; }
  if (me !== shown) return;
  const node = status.node || {};
  const peers = (status.bgp || {}).peers || [];
  const pods = policy.pods || [];
  page(`Node ${name}`,
    el("div", { class: "card" },
      el("div", {}, `address ${node.address}  ·  AS ${node.asn}  ·  subnet ${node.subnet}  ·  backend ${node.backend} (${node.encap})  ·  MTU ${node.mtu}`),
      el("div", { class: "muted" }, status.ready ? "ready" : "not ready", node.route_reflector ? " · route reflector" : "")),
    el("h2", {}, "BGP peers"),
    table(["peer", "type", "state", "since", "received", "sent", "backend", "data path"],
      peers.map((p) => [p.address, p.description || p.type, el("span", { class: `state-${p.state}` }, p.state), when(p.since),
        p.prefixes_received, p.prefixes_sent, p.backend ? `${p.backend}${p.backend_reason ? " (" + p.backend_reason + ")" : ""}` : "–", p.datapath])),
    el("h2", {}, "Routes in the kernel"),
    table(["destination", "via", "device", "backend", "peer", "installed"],
      routes.map((r) => [r.dst, r.via, r.dev, r.backend, r.peer, r.installed === false ? el("span", { class: "bad" }, "no") : "yes"])),
    el("p", { class: "muted" }, "Why a route is there: the peer that advertised the subnet (BGP best path) and the backend chosen for that peer."),
    el("h2", {}, "Pods"),
    policy.failed ? failure(new Error(policy.failed)) : null,
    // The policy agent's last sync failed (nftables refused a change): what it lists is what
    // it wants, which the kernel does not have while the error stands.
    policy.error ? policyError(policy.error) : null,
    tooLarge(policy.too_large),
    policy.failed ? null : table(["pod", "address", "labels", "policies", "isolated", "dropped in/out"],
      pods.map((p) => [el("a", { href: `#/pod/${encodeURIComponent(name)}/${p.pod}`, "data-pod-link": p.pod }, p.pod), p.ip, el("span", {}, labels(p.labels)),
        p.policies.join(", ") || "–", [p.isolated.ingress ? "ingress" : "", p.isolated.egress ? "egress" : ""].filter(Boolean).join(", ") || "no",
        `${p.dropped.ingress}/${p.dropped.egress}`])));
}

// Policies refused as too large to program (GET /policy's too_large, "NS/NAME": why): each
// isolates the pods it selects and allows nothing, whatever its rules say.
function tooLarge(refused, only) {
  const names = Object.keys(refused || {}).filter((n) => !only || only.includes(n)).sort();
  if (!names.length) return null;
  return el("ul", { class: "err", id: "policy-too-large" }, names.map((n) =>
    el("li", { "data-too-large": n }, `${n} not programmed: ${refused[n]} -- it isolates the pods it selects and allows nothing`)));
}

function policyError(error) {
  return el("p", { class: "err", id: "policy-error" },
    `policy not in sync: ${error} -- what is shown is what the agent wants; the kernel does not have it while this error stands`);
}

// ------------------------------------------------------------------ a pod

async function showPod(node, pod) {
  const me = shown;
  page(`Pod ${pod}`, el("p", { class: "muted" }, "Loading…"));
  let policy;
  try { policy = await getJSON(`/nodes/${encodeURIComponent(node)}/policy?pod=${encodeURIComponent(pod)}`); }
  catch (err) { if (me === shown) page(`Pod ${pod}`, failure(err)); return; }
  if (me !== shown) return;
  const p = (policy.pods || [])[0];
  if (!p) { page(`Pod ${pod}`, failure(new Error(`${node} has no pod ${pod}`))); return; }
  const allow = (rules) => rules === null ? el("p", { class: "muted" }, "not isolated: everything is allowed") :
    rules.length === 0 ? el("p", { class: "bad" }, "isolated, and no rule allows anything (default deny)") :
    table(["policy", "rule", "peers", "addresses", "ports"], rules.map((r) => [
      r.programmed === false ? el("span", {}, r.policy, " ", el("span", { class: "bad" }, "(not programmed: allows nothing)")) : r.policy, r.rule,
      r.peers === "all" ? "all" : r.peers.map((x) => x.ipBlock ? `ipBlock ${x.ipBlock}${x.except && x.except.length ? " except " + x.except.join(", ") : ""}` : `ns ${x.namespace} pods ${x.pods}`).join("; "),
      r.peer_addresses === null ? "any" : (r.peer_addresses.join(", ") || (r.left_out ? "" : "none")) + (r.left_out ? ` (${r.left_out} more not listed)` : ""),
      r.ports === "all" ? "all" : r.ports.map((x) => `${x.port === null || x.port === undefined ? "all" : x.port}${x.endPort ? "-" + x.endPort : ""}/${x.protocol}`).join(", ")]),
      // A rule of a policy too large to program is not in the kernel: shown struck through.
      (i) => rules[i].programmed === false ? { class: "not-programmed", "data-programmed": "false" } : {});
  const flows = el("div", {});
  page(`Pod ${pod}`,
    policy.error ? policyError(policy.error) : null,
    tooLarge(policy.too_large, p.policies),
    el("div", { class: "card" }, el("div", {}, `node ${node} · address ${p.ip} · interface ${p.interface}`), el("div", {}, labels(p.labels))),
    el("div", { class: "card" }, el("b", {}, "Policies selecting it: "), p.policies.length ? p.policies.join(", ") : "none"),
    el("div", { class: "grid2" },
      el("div", {}, el("h2", {}, "Ingress allowed"), allow(p.ingress)),
      el("div", {}, el("h2", {}, "Egress allowed"), allow(p.egress))),
    el("h2", {}, "Recent flows in and out"), flows);
  flowTable(flows, new URLSearchParams({ pod }), true);
}

// ------------------------------------------------------------------ services

async function showServices() {
  const me = shown;
  page("Services", el("p", { class: "muted" }, "Loading…"));
  let data;
  try { data = await getJSON("/services"); } catch (err) { if (me === shown) page("Services", failure(err)); return; }
  if (me !== shown) return;
  const rows = [];
  for (const s of data.services || []) {
    for (const port of s.ports) {
      // What this node translates: an address or node port an older Service holds is not
      // this one's (REST: null, the one asked under "asked", the conflict in "errors").
      const asked = port.asked || {};
      const vip = port.clusterIP ? port.clusterIP : asked.clusterIP ?
        el("span", { class: "bad", "data-held": asked.clusterIP }, `${asked.clusterIP}: another Service's, not translated`) : "None";
      const nodePort = port.nodePort ? " (node port " + port.nodePort + (port.served && port.served.nodePort !== "translated" ? ": " + port.served.nodePort + " here" : "") + ")" :
        asked.nodePort ? ` (node port ${asked.nodePort}: another Service's, not translated)` : "";
      rows.push([`${s.namespace}/${s.name}`, vip, `${port.port}/${port.protocol}${nodePort}`,
        el("span", {}, port.endpoints.length ? port.endpoints.map((e) => pill(`${hostPort(e.ip, e.port)}${e.node ? " @" + e.node : ""} ${e.ready ? "ready" : e.terminating ? "terminating" : "not ready"}${e.used ? "" : " (unused)"}`, e.used ? "ok" : "warn")) : el("span", { class: "bad" }, "no endpoints")),
        s.connections]);
    }
  }
  const conflicts = (data.services || []).flatMap((s) => (s.errors || []).map((e) => el("li", {}, `${s.namespace}/${s.name}: ${e}`)));
  // Services whose records could not be built or compiled: not translated, so in no row.
  const failed = Object.entries(data.failed || {}).sort().map(([name, why]) => el("li", { "data-failed": name }, `${name}: ${why}`));
  page("Services",
    el("p", { class: "muted" }, `as node ${data.node} translates them (revision ${data.revision})`),
    data.error ? el("p", { class: "err", id: "services-error" }, `services not in sync: ${data.error}`) : null,
    data.dns_error ? el("p", { class: "err", id: "services-dns-error" }, `service DNS not served: ${data.dns_error}`) : null,
    failed.length ? el("ul", { class: "err", id: "services-failed" }, failed) : null,
    conflicts.length ? el("ul", { class: "err", id: "services-conflicts" }, conflicts) : null,
    table(["service", "cluster IP", "port", "endpoints", "connections"], rows));
}

// ------------------------------------------------------------------ flows

const FILTERS = ["pod", "namespace", "label", "verdict", "protocol", "port", "node"];
// Filters the form has no field for, but GET /flows and the CLI take: kept from the URL on Apply.
const MORE_FILTERS = ["from-pod", "to-pod", "ip", "event", "reason", "service"];

// GET /flows takes a verdict or protocol in any case (tcp, icmpv6): so does the form.
function same(a, b) { return (a || "").toLowerCase() === b.toLowerCase(); }

function showFlows(params) {
  const form = el("form", { class: "filters", id: "flow-filters" },
    FILTERS.map((f) => el("label", {}, f,
      f === "verdict" ? el("select", { name: f }, ["", "forwarded", "dropped"].map((v) => el("option", { value: v, selected: same(params.get(f), v) ? "" : null }, v || "any")))
        : f === "protocol" ? el("select", { name: f }, ["", "TCP", "UDP", "ICMP", "ICMPv6", "SCTP", "ARP"].map((v) => el("option", { value: v, selected: same(params.get(f), v) ? "" : null }, v || "any")))
          : el("input", { name: f, value: params.get(f) || "", placeholder: { pod: "ns/name", label: "key=value" }[f] || "" }))),
    el("button", { type: "submit" }, "Apply"));
  const out = el("div", {});
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const q = new URLSearchParams();
    // A filter repeated in the address means any of its values (as GET /flows and the CLI take
    // it): the form shows the first, the others are kept.
    for (const f of FILTERS) {
      const v = form.elements[f].value.trim();
      if (v) { q.set(f, v); for (const more of params.getAll(f).slice(1)) q.append(f, more); }
    }
    for (const f of MORE_FILTERS) for (const v of params.getAll(f)) q.append(f, v);
    location.hash = "#/flows" + (q.toString() ? "?" + q : "");
  });
  const kept = [...FILTERS.flatMap((f) => params.getAll(f).slice(1).map((v) => `${f}=${v}`)),
    ...MORE_FILTERS.flatMap((f) => params.getAll(f).map((v) => `${f}=${v}`))];
  page("Flows", el("p", { class: "muted" }, "Every node's flow records, live (GET /flows?cluster=1&follow=1)."), form,
    kept.length ? el("p", { class: "muted", id: "flow-more-filters" }, `also filtered by ${kept.join(", ")} (from the address)`) : null, out);
  flowTable(out, params, true);
}

function flowRow(r) {
  const end = (e) => el("span", {}, e.pod ? el("a", { href: e.node ? `#/pod/${encodeURIComponent(e.node)}/${e.pod}` : null }, e.pod) : "", " ", el("code", {}, hostPort(e.ip, e.port)));
  let info = r.event;
  if (r.event === "drop") {
    info = r.reason === "policy" ? `policy ${r.direction}: ${(r.policies || []).join(", ")}${r.default_deny ? " (default deny)" : ""}` : (r.reason_text || r.reason);
    if (r.sender) info += ` (sent by ${r.sender.pod ? r.sender.pod + " on " : ""}${r.sender.interface})`;
    if (r.suppressed) info += ` (+${r.suppressed} like it)`;
  } else if (r.event === "end") {
    const size = (n) => (n === null || n === undefined ? "unknown" : `${n} B`);
    info = `end · sent ${size(r.bytes_sent)} · received ${size(r.bytes_received)}${r.duration !== null && r.duration !== undefined ? " · " + r.duration.toFixed(3) + " s" : ""}`;
  }
  // A translated connection whose Service is not known (deleted since): name null, its address alone.
  const svc = r.service ? `svc ${r.service.name ? r.service.name + " " : ""}${hostPort(r.service.ip, r.service.port)}` : null;
  const dst = svc ? el("span", {}, pill(svc), " → ", end(r.dst)) : end(r.dst);
  return el("tr", { class: `verdict-${r.verdict}`, "data-verdict": r.verdict, "data-reason": r.reason || null, "data-node": r.node },
    el("td", { class: "mono" }, when(r.time)), el("td", {}, r.node), el("td", {}, end(r.src)), el("td", {}, dst),
    el("td", {}, r.protocol), el("td", { class: "verdict" }, r.verdict), el("td", { class: "info" }, info));
}

// A live table of flows: the last 100 matching records of every node, then each new one on top.
function flowTable(container, params, follow) {
  if (stopStream) stopStream();
  const q = new URLSearchParams(params);
  q.set("cluster", "1"); q.set("last", "100");
  if (follow) q.set("follow", "1");
  const body = el("tbody", { id: "flow-rows" });
  const status = el("p", { class: "muted", id: "flow-status" }, "connecting…");
  container.replaceChildren(status, el("table", { id: "flow-table" },
    el("thead", {}, el("tr", {}, ["time", "node", "source", "destination", "proto", "verdict", "info"].map((h) => el("th", {}, h)))), body));
  const controller = new AbortController();
  stopStream = () => controller.abort();
  let count = 0;
  (async () => {
    try {
      const resp = await fetch("/flows?" + q, { signal: controller.signal, headers: withKey({}) });
      if (!resp.ok) { const b = await resp.json().catch(() => ({})); throw new Error(b.error || `GET /flows: ${resp.status}`); }
      status.textContent = "live";
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf("\n")) >= 0) {
          const text = buf.slice(0, i).trim();
          buf = buf.slice(i + 1);
          if (!text) continue;
          // One line that cannot be shown is said in the status line; the table and the
          // stream go on (the other nodes' records are not lost with it).
          let r;
          try {
            r = JSON.parse(text);
            if (r === null || typeof r !== "object" || Array.isArray(r)) throw new Error("not a JSON object");
          } catch (err) {
            status.textContent = `a line of the stream left out (${err.message}): ${text.slice(0, 80)}`;
            continue;
          }
          if (r.error) { status.textContent = `node ${r.node}: ${r.error}`; continue; }
          if (r.lost) {  // gathered: a node's records lost name the node
            const whose = r.node ? `node ${r.node}: ` : "";
            status.textContent = `${whose}${r.lost} records lost (${r.why || (r.node ? "not read fast enough from it" : "the browser was too slow")})`;
            continue;
          }
          let row;
          try { row = flowRow(r); } catch (err) {
            status.textContent = `a record of node ${r.node} left out (${err.message})`;
            continue;
          }
          body.prepend(row);
          if (++count > 500) body.lastChild.remove();
        }
      }
      status.textContent = "stream ended";
    } catch (err) {
      if (err.name !== "AbortError") status.replaceWith(failure(err));
    }
  })();
}

// ------------------------------------------------------------------ routing

function route() {
  shown++;
  if (stopStream) { stopStream(); stopStream = null; }
  const [path, query] = (location.hash.slice(1) || "/cluster").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("active", a.dataset.nav === parts[0]);
  if (parts[0] === "node" && parts[1]) return showNode(parts[1]);
  if (parts[0] === "pod" && parts.length >= 4) return showPod(parts[1], `${parts[2]}/${parts[3]}`);
  if (parts[0] === "services") return showServices();
  if (parts[0] === "flows") return showFlows(new URLSearchParams(query || ""));
  return showCluster();
}

window.addEventListener("hashchange", route);
keyTaken.then(route);
