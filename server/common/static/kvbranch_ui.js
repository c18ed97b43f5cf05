// The kvbranch agent page: the caller's sessions, their branch trees, pins and last turns.
// Plain JavaScript, no build step. Everything the server sends is rendered with textContent
// (never innerHTML): a session or branch id is the client's own text. The key goes only in the
// Authorization header, and is kept in this tab's sessionStorage so a refresh keeps it.
"use strict";

(function () {
  const DATA_URL = "../v1/kvbranch/ui/data"; // relative to /kvbranch/ui: works under a prefix
  const KEY_ITEM = "kvbranch.ui.key";
  const DEFAULT_REFRESH_S = 3;
  const TURNS_SHOWN = 5;
  const SOURCES = [
    ["device", "device_hit_tokens", "device"],
    ["host", "host_hit_tokens", "host"],
    ["remote", "remote_hit_tokens", "pulled"],
    ["recomputed", "recomputed_tokens", "recomputed"],
  ];
  let timer = null;
  let loading = false;
  let memoryKey = ""; // where the key lives when this browser gives no sessionStorage

  function byId(id) {
    return document.getElementById(id);
  }

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function num(value) {
    return typeof value === "number" && isFinite(value) ? value : 0;
  }

  function storedKey() {
    try {
      return window.sessionStorage.getItem(KEY_ITEM) || memoryKey;
    } catch (e) {
      return memoryKey;
    }
  }

  function setStatus(text, isError) {
    const status = byId("status");
    status.textContent = text;
    status.className = isError ? "error" : "";
  }

  function count(n, one, many) {
    return n + " " + (n === 1 ? one : many || one + "s");
  }

  function seconds(value) {
    return num(value).toFixed(value >= 10 ? 0 : 2) + " s";
  }

  // A degraded pin (the pin budget was full: kept like any unpinned block, LRU) is not
  // "pinned" in the branch's data, yet still a pin with its expiry: say which.
  function pinText(branch) {
    if (!branch.pinned && !branch.degraded) return "not pinned";
    const left = branch.pin_expires_in_s;
    const when = typeof left === "number" ? ", " + Math.max(0, Math.round(left)) + " s left" : "";
    return (branch.degraded ? "pin degraded to LRU" : "pinned") + when;
  }

  function renderTurn(turn) {
    const item = el("li", "turn");
    const prompt = num(turn.prompt_tokens);
    const bar = el("span", "bar");
    bar.title = "prompt tokens by source";
    const parts = [];
    for (const [cls, field, label] of SOURCES) {
      const count = num(turn[field]);
      item.dataset[cls] = String(count);
      parts.push(label + " " + count);
      if (count > 0 && prompt > 0) {
        const seg = el("span", "seg " + cls);
        seg.style.width = ((100 * count) / prompt).toFixed(2) + "%";
        seg.title = label + ": " + count;
        bar.appendChild(seg);
      }
    }
    item.dataset.prompt = String(prompt);
    item.appendChild(bar);
    item.appendChild(el("span", "turn-tokens", "prompt " + prompt + ": " + parts.join(", ")));
    const time =
      turn.streamed && typeof turn.ttft_s === "number"
        ? "TTFT " + seconds(turn.ttft_s)
        : "answer in " + seconds(turn.latency_s) + " (not streamed)";
    item.appendChild(el("span", "ttft", time));
    if (turn.instance) item.appendChild(el("span", "instance", turn.instance));
    return item;
  }

  function renderBranch(branch, children, turnsOf) {
    const item = el("li", "branch");
    item.dataset.branchId = branch.branch_id;
    const row = el("div", "branch-row");
    row.appendChild(el("span", "branch-id", branch.branch_id));
    if (branch.parent) {
      const at = typeof branch.fork_offset_tokens === "number" ? branch.fork_offset_tokens : "?";
      row.appendChild(el("span", "fork", "forked from " + branch.parent + " at token " + at));
    }
    const tokens = el("span", "tokens", num(branch.num_tokens) + " tokens");
    tokens.dataset.tokens = String(num(branch.num_tokens));
    row.appendChild(tokens);
    const pin = el("span", "pin" + (branch.degraded ? " degraded" : branch.pinned ? " pinned" : ""));
    pin.textContent = pinText(branch);
    row.appendChild(pin);
    const blocks = el(
      "span",
      "blocks",
      "host store " + num(branch.stored_blocks) + " blocks, pinned " + num(branch.pinned_blocks),
    );
    blocks.dataset.stored = String(num(branch.stored_blocks));
    row.appendChild(blocks);
    item.appendChild(row);
    const turns = (turnsOf.get(branch.branch_id) || []).slice(-TURNS_SHOWN);
    if (turns.length) {
      const list = el("ol", "turns");
      for (const turn of turns) list.appendChild(renderTurn(turn));
      item.appendChild(list);
    }
    const kids = children.get(branch.branch_id) || [];
    if (kids.length) {
      const sub = el("ul", "tree");
      for (const kid of kids) sub.appendChild(renderBranch(kid, children, turnsOf));
      item.appendChild(sub);
    }
    return item;
  }

  function renderSession(session, turns) {
    const box = el("section", "session");
    box.dataset.sessionId = session.session_id;
    box.appendChild(el("h2", "session-id", session.session_id));
    const branches = Array.isArray(session.branches) ? session.branches : [];
    const created = new Date(num(session.created_at) * 1000).toLocaleString();
    box.appendChild(
      el(
        "p",
        "meta",
        count(branches.length, "branch", "branches") + ", " +
          count(num(session.pinned_blocks), "pinned block") + ", created " +
          created + (session.auto_pin ? ", auto-pin " + num(session.pin_ttl_s) + " s" : ""),
      ),
    );
    const known = new Set(branches.map((b) => b.branch_id));
    const children = new Map();
    const roots = [];
    for (const branch of branches) {
      if (branch.parent && known.has(branch.parent) && branch.parent !== branch.branch_id) {
        if (!children.has(branch.parent)) children.set(branch.parent, []);
        children.get(branch.parent).push(branch);
      } else {
        roots.push(branch);
      }
    }
    const turnsOf = new Map();
    for (const turn of turns) {
      if (turn.session_id !== session.session_id) continue;
      if (!turnsOf.has(turn.branch_id)) turnsOf.set(turn.branch_id, []);
      turnsOf.get(turn.branch_id).push(turn);
    }
    const tree = el("ul", "tree");
    for (const root of roots) tree.appendChild(renderBranch(root, children, turnsOf));
    box.appendChild(tree);
    return box;
  }

  function render(data) {
    const main = byId("sessions");
    const sessions = Array.isArray(data.sessions) ? data.sessions : [];
    const turns = Array.isArray(data.turns) ? data.turns : [];
    const boxes = sessions.map((s) => renderSession(s, turns));
    if (!boxes.length) boxes.push(el("p", "empty", "No sessions for this key yet."));
    main.replaceChildren(...boxes);
    const total = num(data.num_own_sessions);
    const more = total > sessions.length ? " (showing the " + sessions.length + " most recent)" : "";
    setStatus(count(total, "session") + more + ", updated " + new Date().toLocaleTimeString(), false);
  }

  function schedule(seconds) {
    if (timer !== null) window.clearTimeout(timer);
    timer = window.setTimeout(load, 1000 * seconds);
  }

  async function load() {
    if (loading) return;
    loading = true;
    let refresh = DEFAULT_REFRESH_S;
    try {
      const headers = { Accept: "application/json" };
      const key = storedKey();
      if (key) headers.Authorization = "Bearer " + key;
      const response = await fetch(DATA_URL, { headers, cache: "no-store", credentials: "omit" });
      let data = null;
      try {
        data = await response.json();
      } catch (e) {
        data = null;
      }
      if (!response.ok) {
        const message = data && data.error && data.error.message ? data.error.message : "";
        setStatus("HTTP " + response.status + (message ? ": " + message : ""), true);
        if (response.status === 401 || response.status === 403) {
          byId("sessions").replaceChildren();
        }
      } else if (data && typeof data === "object") {
        render(data);
        if (typeof data.refresh_s === "number" && data.refresh_s >= 1) refresh = data.refresh_s;
      }
    } catch (e) {
      setStatus("cannot reach the server: " + e, true);
    } finally {
      loading = false;
      schedule(refresh);
    }
  }

  function start() {
    byId("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const field = byId("key");
      memoryKey = field.value || memoryKey;
      try {
        if (field.value) window.sessionStorage.setItem(KEY_ITEM, field.value);
      } catch (e) {
        // no storage (a locked-down browser): the key lives in the field only
      }
      field.value = "";
      load();
    });
    byId("forget-key").addEventListener("click", () => {
      memoryKey = "";
      try {
        window.sessionStorage.removeItem(KEY_ITEM);
      } catch (e) {
        // nothing stored
      }
      byId("sessions").replaceChildren();
      setStatus("Key forgotten.", false);
    });
    load();
  }

  document.addEventListener("DOMContentLoaded", start);
})();
