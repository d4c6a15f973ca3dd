// Kedge web console. Plain JavaScript, no dependencies, no build step (see console.rs for why).
//
// Rules this file keeps:
// - Run data (prompts, tool arguments and results, model text, errors) is untrusted: it is
//   rendered with textContent / text nodes only, never parsed as HTML.
// - The bearer token stays in this tab's sessionStorage and goes out only in Authorization
//   headers. Event streams authenticate with the SSE ticket cookie the bridge sets on
//   POST /v1/runs/{id}/sse-ticket (HttpOnly, scoped to that run's stream), never a URL token.
// - Connection state, run state and the run's result are shown apart (design principle 9).
"use strict";

(() => {
  const TOKEN_KEY = "kedge.console.token";
  const PAGE_SIZES = [10, 20, 50, 100];
  const LIST_POLL_MS = 2000;
  const TICKET_RENEW_MS = 40000;
  // Past this many timeline items, off-screen items are skipped by layout (content-visibility).
  const LONG_TIMELINE = 200;
  const STATUSES = [
    "queued", "running", "waiting_tool", "waiting_user", "waiting_approval",
    "waiting_external", "waiting_provider", "cancelling", "compensating", "succeeded", "failed",
    "cancelled", "unknown",
  ];
  // Every public journal event type (docs/API.md, "Which events are public").
  const EVENT_TYPES = [
    "run.created", "run.started", "step.started", "model.attempt", "step.completed",
    "tool.requested", "tool.started", "tool.result", "question.asked", "question.answered",
    "approval.requested", "approval.decided", "approval.invalidated", "approval.expired",
    "timer.scheduled", "timer.fired", "callback.expected", "callback.received", "run.waiting",
    "run.cancelling", "run.unknown", "run.resumed", "run.revived", "run.succeeded",
    "run.failed", "run.cancelled", "user.message", "cancel.requested", "outcome.confirmed",
    "outcome.not_found", "outcome.ambiguous", "outcome.resolved", "target.moved",
    "tool.attempt", "output.rejected", "run.gated", "run.compensating", "provider.waiting",
    "provider.released", "context.compacted",
  ];

  // ------------------------------------------------------------------------------------------
  // Small helpers.
  // ------------------------------------------------------------------------------------------

  /** An element with attributes and children; strings become text nodes (never markup). */
  function h(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat(Infinity)) {
      if (c === undefined || c === null || c === false) continue;
      e.append(c instanceof Node ? c : String(c));
    }
    return e;
  }

  const main = () => document.getElementById("main");
  const pretty = (v) => (typeof v === "string" ? v : JSON.stringify(v, null, 2));
  const enc = encodeURIComponent;

  function fmtTime(iso) {
    if (!iso) return "";
    const d = new Date(iso);
    if (Number.isNaN(d.getTime())) return String(iso);
    return d.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
  }

  function fmtIn(iso) {
    const ms = new Date(iso).getTime() - Date.now();
    if (Number.isNaN(ms)) return "";
    const s = Math.round(Math.abs(ms) / 1000);
    const span = s < 120 ? s + " s" : s < 7200 ? Math.round(s / 60) + " min" : Math.round(s / 3600) + " h";
    return ms >= 0 ? "in " + span : span + " ago";
  }

  function fmtCost(usage) {
    if (!usage || typeof usage.cost !== "number") return null;
    return usage.cost.toFixed(6) + (usage.currency ? " " + usage.currency : "");
  }

  function badge(status) {
    return h("span", { class: "badge s-" + status, "data-status": status }, status);
  }

  let toastTimer = null;
  function toast(text) {
    const t = document.getElementById("toast");
    t.textContent = text;
    clearTimeout(toastTimer);
    toastTimer = setTimeout(() => { t.textContent = ""; }, 4000);
  }

  // ------------------------------------------------------------------------------------------
  // Session and API.
  // ------------------------------------------------------------------------------------------

  const session = { token: null, who: null };

  class ApiError extends Error {
    constructor(status, problem) {
      const title = (problem && problem.title) || "Error";
      const detail = (problem && problem.detail) || "";
      super(status + " " + title + (detail ? ": " + detail : ""));
      this.status = status;
      this.problem = problem || {};
    }
  }

  async function api(method, path, body, extraHeaders) {
    const headers = Object.assign({ Accept: "application/json" }, extraHeaders || {});
    if (session.token) headers.Authorization = "Bearer " + session.token;
    const init = { method, headers, credentials: "same-origin", cache: "no-store" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let resp;
    try {
      resp = await fetch(path, init);
    } catch (e) {
      throw new ApiError(0, { title: "Bridge unreachable", detail: String(e && e.message ? e.message : e) });
    }
    const text = await resp.text();
    let data = null;
    if (text) {
      try { data = JSON.parse(text); } catch (_) { data = { detail: text }; }
    }
    if (!resp.ok) {
      if (resp.status === 401 && path !== "/v1/whoami") signOut("Your token was refused (401); sign in again.");
      throw new ApiError(resp.status, data);
    }
    return data;
  }

  function signOut(why) {
    sessionStorage.removeItem(TOKEN_KEY);
    session.token = null;
    session.who = null;
    stopPage();
    renderNav();
    renderSignIn(why);
  }

  function renderNav() {
    const nav = document.getElementById("nav");
    nav.replaceChildren();
    if (!session.who) return;
    nav.append(
      h("a", { href: "#/" }, "Runs"),
      h("a", { href: "#/schedules" }, "Schedules"),
      h("span", { class: "who", "data-scope": session.who.scope },
        "tenant " + session.who.tenant + " · " + session.who.scope),
      h("button", { type: "button", id: "signout", onclick: () => signOut() }, "Sign out"),
    );
  }

  function renderSignIn(why) {
    const err = h("div", { class: "error", role: "alert" }, why || "");
    const input = h("input", {
      id: "token", type: "password", name: "token", autocomplete: "off", required: true,
      spellcheck: "false", "aria-describedby": "token-help",
    });
    const form = h("form", { class: "card signin", id: "signin" },
      h("h1", {}, "Sign in to the Kedge console"),
      h("label", { for: "token" }, "Bearer token", input),
      h("p", { class: "muted", id: "token-help" },
        "The token is kept in this tab only (session storage) and sent in the Authorization header; never in a URL."),
      err,
      h("button", { class: "primary", type: "submit" }, "Sign in"),
    );
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      err.textContent = "";
      session.token = input.value.trim();
      try {
        session.who = await api("GET", "/v1/whoami");
        sessionStorage.setItem(TOKEN_KEY, session.token);
        renderNav();
        route();
      } catch (e) {
        session.token = null;
        err.textContent = e.message;
      }
    });
    main().replaceChildren(form);
    input.focus();
  }

  // ------------------------------------------------------------------------------------------
  // Routing (URL fragments: never sent to a server).
  // ------------------------------------------------------------------------------------------

  let stopCurrent = null;
  function stopPage() {
    if (stopCurrent) { try { stopCurrent(); } catch (_) { /* ignore */ } }
    stopCurrent = null;
  }

  function route() {
    stopPage();
    if (!session.token) return renderSignIn();
    const hash = location.hash || "#/";
    const m = /^#\/runs\/([^/?#]+)$/.exec(hash);
    if (m) return runPage(decodeURIComponent(m[1]));
    if (hash === "#/schedules") return schedulesPage();
    return runsPage();
  }

  // ------------------------------------------------------------------------------------------
  // Schedules page (docs/API.md, "Schedules"): the tenant's schedules and their next fire time.
  // ------------------------------------------------------------------------------------------

  function schedulesPage() {
    const err = h("div", { class: "error", role: "alert" });
    const tbody = h("tbody");
    const table = h("table", { class: "runs", id: "schedules" },
      h("caption", { class: "muted" }, "Each firing starts a run; updates live"),
      h("thead", {}, h("tr", {}, ["Schedule", "Agent", "When", "Next fire", "State", "Fired", "Skipped", "Last run"].map((c) => h("th", { scope: "col" }, c)))),
      tbody);
    main().replaceChildren(h("h1", {}, "Schedules"), err, table);
    let timer = null;
    let stopped = false;
    async function load() {
      try {
        const data = await api("GET", "/v1/schedules");
        if (stopped) return;
        err.textContent = "";
        const items = data.schedules || [];
        tbody.replaceChildren(...items.map((s) => {
          const spec = s.schedule || {};
          const st = s.state || {};
          const when = spec.cron ? "cron " + spec.cron + " (" + (spec.time_zone || "UTC") + ")" : "every " + spec.interval_secs + " s";
          const last = st.last_run ? h("a", { href: "#/runs/" + enc(st.last_run) }, st.last_run) : "—";
          return h("tr", { "data-schedule": s.name },
            h("td", { class: "id", "data-label": "Schedule" }, s.name),
            h("td", { "data-label": "Agent" }, spec.agent || ""),
            h("td", { "data-label": "When" }, when + " · " + (spec.overlap || "") + " · catch-up " + (spec.catch_up || "")),
            h("td", { "data-label": "Next fire", "data-k": "next" }, s.next_fire_at ? fmtTime(s.next_fire_at) : "—"),
            h("td", { "data-label": "State" }, s.paused ? "paused" : "active"),
            h("td", { "data-label": "Fired" }, String(st.fired || 0)),
            h("td", { "data-label": "Skipped" }, String(st.skipped || 0)),
            h("td", { class: "id", "data-label": "Last run" }, last));
        }));
        if (items.length === 0) tbody.append(h("tr", {}, h("td", { colspan: 8, class: "muted" }, "No schedules.")));
      } catch (e) {
        if (!stopped) err.textContent = e.message;
      }
    }
    function poll() {
      clearTimeout(timer);
      timer = setTimeout(async () => {
        if (!document.hidden) await load();
        if (!stopped) poll();
      }, LIST_POLL_MS);
    }
    stopCurrent = () => { stopped = true; clearTimeout(timer); };
    load().then(poll);
  }

  // ------------------------------------------------------------------------------------------
  // Runs page.
  // ------------------------------------------------------------------------------------------

  const listState = { status: "", agent: "", size: 20, cursors: [null] };

  function runsPage() {
    const err = h("div", { class: "error", role: "alert" });
    const status = h("select", { id: "f-status", name: "status" },
      h("option", { value: "" }, "any status"),
      STATUSES.map((s) => h("option", { value: s }, s)));
    status.value = listState.status;
    const agent = h("input", { id: "f-agent", name: "agent", placeholder: "any agent", value: listState.agent });
    const size = h("select", { id: "f-size", name: "size" },
      PAGE_SIZES.map((n) => h("option", { value: n }, String(n))));
    size.value = String(listState.size);
    const filters = h("form", { class: "row card", id: "filters", role: "search" },
      h("label", { for: "f-status" }, "Status", status),
      h("label", { for: "f-agent" }, "Agent", agent),
      h("label", { for: "f-size" }, "Per page", size),
      h("button", { type: "submit" }, "Filter"));
    const tbody = h("tbody");
    const table = h("table", { class: "runs", id: "runs" },
      h("caption", { class: "muted" }, "Newest first; updates live"),
      h("thead", {}, h("tr", {}, ["Run", "Agent", "Status", "Step", "Tokens", "Cost", "Created", "Updated"].map((c) => h("th", { scope: "col" }, c)))),
      tbody);
    const newer = h("button", { type: "button", id: "page-newer" }, "← Newer");
    const older = h("button", { type: "button", id: "page-older" }, "Older →");
    const pageNo = h("span", { class: "muted" });
    main().replaceChildren(h("h1", {}, "Runs"), filters, err, table, h("div", { class: "pager" }, newer, pageNo, older));

    let timer = null;
    let stopped = false;
    let next = null;

    async function load() {
      const q = new URLSearchParams({ limit: String(listState.size) });
      if (listState.status) q.set("status", listState.status);
      if (listState.agent) q.set("agent", listState.agent);
      const cursor = listState.cursors[listState.cursors.length - 1];
      if (cursor) q.set("cursor", cursor);
      try {
        const data = await api("GET", "/v1/runs?" + q.toString());
        if (stopped) return;
        err.textContent = "";
        next = data.next_cursor;
        renderRows(tbody, data.runs || []);
        newer.disabled = listState.cursors.length <= 1;
        older.disabled = !next;
        pageNo.textContent = "page " + listState.cursors.length;
      } catch (e) {
        if (!stopped) err.textContent = e.message;
      }
    }
    function poll() {
      clearTimeout(timer);
      timer = setTimeout(async () => {
        if (!document.hidden) await load();
        if (!stopped) poll();
      }, LIST_POLL_MS);
    }
    filters.addEventListener("submit", (ev) => {
      ev.preventDefault();
      listState.status = status.value;
      listState.agent = agent.value.trim();
      listState.size = Number(size.value) || 20;
      listState.cursors = [null];
      load();
    });
    newer.addEventListener("click", () => { if (listState.cursors.length > 1) { listState.cursors.pop(); load(); } });
    older.addEventListener("click", () => { if (next) { listState.cursors.push(next); load(); } });
    stopCurrent = () => { stopped = true; clearTimeout(timer); };
    load().then(poll);
  }

  /** Updates rows in place (keyboard focus survives the live refresh). */
  function renderRows(tbody, runs) {
    const same = tbody.children.length === runs.length &&
      runs.every((r, i) => tbody.children[i].dataset.run === r.run_id);
    if (!same) {
      tbody.replaceChildren(...runs.map((r) => h("tr", { "data-run": r.run_id },
        h("td", { class: "id", "data-label": "Run" }, h("a", { href: "#/runs/" + enc(r.run_id) }, r.run_id)),
        ["agent", "status", "step", "tokens", "cost", "created", "updated"].map((k) =>
          h("td", { "data-label": k[0].toUpperCase() + k.slice(1), "data-k": k })))));
      if (runs.length === 0) tbody.append(h("tr", {}, h("td", { colspan: 8, class: "muted" }, "No runs match.")));
    }
    runs.forEach((r, i) => {
      const row = tbody.children[i];
      const cell = (k) => row.querySelector('[data-k="' + k + '"]');
      cell("agent").textContent = r.agent;
      const st = cell("status");
      if (st.dataset.status !== r.status) {
        st.dataset.status = r.status;
        st.replaceChildren(badge(r.status), r.waiting_on ? h("span", { class: "muted" }, " on " + r.waiting_on) : "");
      }
      cell("step").textContent = String(r.step);
      const u = r.usage || {};
      cell("tokens").textContent = String((u.input_tokens || 0) + (u.output_tokens || 0));
      cell("cost").textContent = fmtCost(u) || "—";
      cell("created").textContent = fmtTime(r.created_at);
      cell("updated").textContent = fmtTime(r.updated_at);
    });
  }

  // ------------------------------------------------------------------------------------------
  // Run page.
  // ------------------------------------------------------------------------------------------

  // Tools the step handles itself (their operation is a question, a timer or a callback).
  const STEP_TOOLS = ["ask_user", "wait", "await_callback"];

  const WAIT_WORDS = {
    tool: "Waiting for a tool to finish.",
    user: "Waiting for a person to answer a question.",
    approval: "Waiting for a person to approve or deny an operation.",
    external: "Waiting for a timer or an external callback.",
  };

  function explainWait(view) {
    const w = view.waiting;
    if (!w) return null;
    const parts = [WAIT_WORDS[w.on] || "Waiting (" + w.on + ")."];
    const n = (k) => (w[k] || []).length;
    if (n("questions")) parts.push(n("questions") + " open question(s).");
    if (n("approvals")) parts.push(n("approvals") + " approval(s) to decide.");
    for (const t of w.timers || []) parts.push("A timer is due at " + fmtTime(t.fire_at) + " (" + fmtIn(t.fire_at) + ").");
    for (const o of w.operations || []) {
      if (STEP_TOOLS.includes(o.tool)) continue; // a question, a timer or a callback: said above
      if (o.status === "ambiguous") parts.push("Operation " + o.op + " (" + o.tool + ") has an ambiguous outcome: a person must say what happened.");
      else if (o.status === "started") parts.push("Tool " + o.tool + " is running.");
      else if (o.status === "requested") parts.push("Tool " + o.tool + " is queued for a runner.");
    }
    return parts.join(" ");
  }

  function statusWords(view) {
    switch (view.status) {
      case "queued": return "Queued: no step has started yet.";
      case "running": return view.current_step && view.current_step.in_progress
        ? "Running: step " + view.current_step.number + " is calling the model (attempt " + (view.current_step.attempt || 1) + ")."
        : "Running.";
      case "cancelling": return "Cancelling: no new step or tool starts; the run is cancelled once every operation's fate is known.";
      case "compensating": return "Compensating: the run is ending and undoes the effects its agent declared compensable, newest first, one at a time.";
      case "cancelled": return "Cancelled.";
      case "succeeded": return "Succeeded" + (view.finished ? "." : "; a new message is about to start a new turn.");
      case "failed": return "Failed" + (view.failure ? ": " + view.failure.reason + " — " + view.failure.message : ".");
      case "unknown": return "Stopped on an operation whose outcome is ambiguous: resolve it below.";
      case "waiting_provider": {
        const p = view.provider;
        if (!p) return "Waiting on the model provider.";
        return "Waiting on the model provider " + p.endpoint + " (" + p.trouble.replace(/_/g, " ") + ") since " +
          fmtTime(p.since) + ": " + p.last_error + ". The fleet releases the run when the provider answers again; " +
          "it gives up at " + fmtTime(p.give_up_at) + " (" + fmtIn(p.give_up_at) + ").";
      }
      default: return explainWait(view) || view.status;
    }
  }

  function statusSentence(view) {
    const s = statusWords(view);
    if (view.cancel_requested && !["cancelling", "cancelled"].includes(view.status) && !view.finished) {
      return s + " Cancellation requested: the run is cancelled once every operation's fate is known.";
    }
    return s;
  }

  // Lifecycle events that change the run's status: shown at once, before the next run view.
  const STATUS_OF_EVENT = {
    "run.cancelling": "cancelling", "run.cancelled": "cancelled", "run.succeeded": "succeeded",
    "run.failed": "failed", "run.unknown": "unknown", "run.started": "running", "run.resumed": "running",
    "run.compensating": "compensating",
  };

  // One operation of a run's end: its fate, its declared level, and what compensating it did.
  function effectLine(o) {
    let text = o.op + ": " + o.fate;
    if (o.level) text += " (" + o.level + ")";
    if (o.compensation) text += " · compensation " + o.compensation.status + (o.compensation.op ? " by " + o.compensation.op : "") + (o.compensation.detail ? ": " + o.compensation.detail : "");
    return h("div", { class: "mono" }, text);
  }

  function runPage(runId) {
    const t = {
      runId,
      view: null,
      lastSeq: 0,
      seqs: [],
      steps: new Map(),
      ops: new Map(),
      approvals: new Map(),
      approvalOps: new Map(),
      opDetail: new Map(),
      queue: [],
      flushing: false,
      es: null,
      stopped: false,
      timers: [],
      conn: "connecting",
      connLog: [],
      caughtUp: 0,
      opens: 0,
      deltas: 0,
    };
    window.__kedge = t; // for tests and the curious: what the page has seen

    const statusBox = h("div", { class: "card", id: "run-status", "aria-live": "polite" });
    const conn = h("span", { id: "conn", class: "badge conn-connecting" }, "connecting");
    const err = h("div", { class: "error", role: "alert", id: "run-error" });
    const actions = h("section", { class: "actions", id: "actions", "aria-label": "Actions" });
    const timeline = h("ol", { class: "timeline", id: "timeline", "aria-label": "Timeline" });
    main().replaceChildren(
      h("p", {}, h("a", { href: "#/" }, "← Runs")),
      h("h1", {}, "Run ", h("span", { class: "mono", id: "run-id" }, runId)),
      h("p", { class: "muted" }, "Stream: ", conn),
      err, statusBox, actions,
      h("h2", {}, "Timeline"), timeline,
    );
    t.timeline = timeline;

    function setConn(c) {
      if (t.conn !== c) t.connLog.push(c + "@" + Math.round(performance.now()));
      t.conn = c;
      conn.textContent = c;
      conn.className = "badge conn-" + c;
    }

    // --- the run view (status, usage, result, what it waits on) ---
    let viewTimer = null;
    let viewBusy = false;
    let viewAgain = false;
    async function refreshView() {
      if (viewBusy) { viewAgain = true; return; }
      viewBusy = true;
      try {
        const v = await api("GET", "/v1/runs/" + enc(runId));
        if (t.stopped) return;
        t.view = v;
        err.textContent = "";
        renderStatus(v);
        renderActions(v);
      } catch (e) {
        if (!t.stopped) err.textContent = e.message;
      } finally {
        viewBusy = false;
        if (viewAgain && !t.stopped) { viewAgain = false; scheduleView(); }
      }
    }
    function scheduleView() {
      if (viewTimer) return;
      viewTimer = setTimeout(() => { viewTimer = null; refreshView(); }, 250);
    }

    function renderStatus(v) {
      const u = v.usage || {};
      const facts = h("dl", { class: "facts" },
        h("dt", {}, "Status"), h("dd", {}, badge(v.status), " ", h("span", { id: "status-words" }, statusSentence(v))),
        h("dt", {}, "Agent"), h("dd", {}, v.agent + " (revision " + v.agent_revision + ")"),
        h("dt", {}, "Turn / step"), h("dd", {}, "turn " + v.turn + (v.current_step ? ", step " + v.current_step.number : "")),
        h("dt", {}, "Created / updated"), h("dd", {}, fmtTime(v.created_at) + " / " + fmtTime(v.updated_at)),
        h("dt", {}, "Usage"), h("dd", { id: "usage" }, (u.input_tokens || 0) + " in + " + (u.output_tokens || 0) + " out = " + (u.total_tokens || 0) + " tokens"
          + (fmtCost(u) ? "; cost " + fmtCost(u) : "")),
        h("dt", {}, "Budget"), h("dd", {}, budgetWords(v.budget)),
        v.cancel_requested ? [h("dt", {}, "Cancel requested"), h("dd", {}, v.cancel_requested)] : null,
      );
      const parts = [facts];
      const wait = explainWait(v);
      if (wait) parts.push(h("p", { class: "card waitbox", id: "wait-words" }, wait));
      if (v.result) {
        const val = v.result.validation || {};
        parts.push(h("div", { id: "result" },
          h("h3", {}, "Result"),
          h("p", {}, "Validation: ", h("span", { class: "badge s-" + (val.status === "invalid" ? "failed" : val.status === "valid" ? "succeeded" : "queued") }, val.status || "not_checked"),
            val.status === "invalid" ? h("span", {}, " — the run succeeded, but its output failed validation") : null),
          val.errors ? h("pre", {}, pretty(val.errors)) : null,
          h("pre", {}, v.result.output)));
      }
      if (v.failure) parts.push(h("p", { class: "error", id: "failure" }, "Failure (" + v.failure.reason + "): " + v.failure.message));
      statusBox.replaceChildren(...parts);
    }

    // The status badge from a newer lifecycle event (the run view catches up right after).
    function showStatus(st) {
      const b = statusBox.querySelector("[data-status]");
      if (!b || b.dataset.status === st) return;
      b.replaceWith(badge(st));
    }

    function budgetWords(b) {
      if (!b) return "";
      const p = [b.max_steps + " steps", b.max_tokens + " tokens", b.max_attempts_per_step + " attempts per step"];
      if (b.deadline_secs) p.push("deadline " + b.deadline_secs + " s");
      if (typeof b.max_cost === "number") p.push("max cost " + b.max_cost);
      return p.join(", ");
    }

    // --- actions: only what the token's scope allows ---
    // Operations waiting for a person to say what happened: from the view, and from the
    // timeline (a run stopped in `unknown` is not "waiting" on anything).
    function ambiguousOps(v) {
      const out = new Map();
      for (const o of (v.waiting && v.waiting.operations) || []) {
        if (o.status === "ambiguous") out.set(o.op, { op: o.op, tool: o.tool });
      }
      if (!v.finished) {
        for (const [op, d] of t.opDetail) {
          if (d.ambiguous && !d.settled && !out.has(op)) out.set(op, { op, tool: d.tool || "?" });
        }
      }
      return [...out.values()];
    }

    let actionsKey = "";
    function renderActions(v) {
      const who = session.who || {};
      const w = v.waiting || {};
      const amb = ambiguousOps(v);
      const key = JSON.stringify([v.status, v.finished, (w.questions || []).map((q) => q.question_id),
        (w.approvals || []).map((a) => a.approval_id), amb.map((o) => o.op),
        [...t.approvals.keys()].length, [...t.opDetail.keys()].length]);
      if (key === actionsKey) return; // keep what a person is typing
      actionsKey = key;
      const cards = [];
      if (who.can_write) {
        for (const q of w.questions || []) cards.push(answerCard(q));
        for (const o of amb) cards.push(resolveCard(o));
      }
      if (who.can_approve) {
        for (const a of w.approvals || []) cards.push(approvalCard(a));
      } else if ((w.approvals || []).length && who.can_write) {
        cards.push(h("p", { class: "muted" }, "An approval is open; deciding it needs a token with the approve scope."));
      }
      if (who.can_write) {
        if (v.status !== "cancelled") cards.push(messageCard(v));
        if (!v.finished && !v.cancel_requested && !["cancelling", "cancelled", "succeeded", "failed"].includes(v.status)) cards.push(cancelCard(v));
      }
      // What a person was typing, and where the focus was, survive the re-render.
      const typed = new Map();
      for (const el of actions.querySelectorAll("textarea[id], input[id]:not([type=radio])")) {
        if (el.value) typed.set(el.id, el.value);
      }
      const focused = actions.contains(document.activeElement) ? document.activeElement.id : null;
      // A refusal a form shows (a 403, a conflict) too: a live update must not wipe it unread.
      const refusals = new Map();
      for (const el of actions.querySelectorAll("form[id] > .error")) {
        if (el.textContent) refusals.set(el.parentElement.id, el.textContent);
      }
      actions.replaceChildren(...(cards.length ? [h("h2", {}, "Actions"), ...cards] : []));
      for (const [id, text] of refusals) {
        const form = document.getElementById(id);
        const el = form && actions.contains(form) ? form.querySelector(":scope > .error") : null;
        if (el) el.textContent = text;
      }
      for (const [id, value] of typed) {
        const el = document.getElementById(id);
        if (el && actions.contains(el)) el.value = value;
      }
      if (focused) {
        const el = document.getElementById(focused);
        if (el && actions.contains(el)) el.focus();
      }
    }

    function formCard(id, title, fields, button, send) {
      const e = h("div", { class: "error", role: "alert" });
      const b = h("button", { type: "submit", class: button.cls || "primary" }, button.text);
      const f = h("form", { class: "card", id }, h("h3", {}, title), fields, e, b);
      f.addEventListener("submit", async (ev) => {
        ev.preventDefault();
        e.textContent = "";
        b.disabled = true;
        try {
          const r = await send();
          toast(button.done + (r && r.seq ? " (journal seq " + r.seq + ")" : ""));
          actionsKey = "";
          scheduleView();
        } catch (x) {
          e.textContent = x.message;
        } finally {
          b.disabled = false;
        }
      });
      return f;
    }

    function answerCard(q) {
      const id = "answer-" + q.question_id;
      const input = h("textarea", { id: id + "-text", required: true });
      return formCard(id, "Question", [h("p", { class: "prompt" }, q.prompt), h("label", { for: id + "-text" }, "Your answer", input)],
        { text: "Send answer", done: "Answer sent" },
        () => api("POST", "/v1/runs/" + enc(runId) + "/answers/" + enc(q.question_id), { answer: input.value }));
    }

    function messageCard(v) {
      const input = h("textarea", { id: "message-text", required: true });
      const revive = ["succeeded", "failed"].includes(v.status);
      return formCard("message", revive ? "Send a message (starts a new turn)" : "Send a message",
        [h("label", { for: "message-text" }, "Message", input)],
        { text: "Send message", done: "Message sent" },
        async () => {
          const key = (crypto.randomUUID ? crypto.randomUUID() : String(Date.now()) + Math.random()).replace(/[^A-Za-z0-9-]/g, "");
          const r = await api("POST", "/v1/runs/" + enc(runId) + "/messages", { text: input.value }, { "Idempotency-Key": key });
          if (t.conn === "ended") openStream();
          return r;
        });
    }

    function cancelCard() {
      const reason = h("input", { id: "cancel-reason", placeholder: "reason (optional)" });
      return formCard("cancel", "Cancel the run",
        [h("p", { class: "muted" }, "No new step or tool starts; running operations are asked to stop. The run shows cancelling until every operation's fate is known."),
          h("label", { for: "cancel-reason" }, "Reason", reason)],
        { text: "Cancel run", cls: "danger", done: "Cancellation requested" },
        () => api("POST", "/v1/runs/" + enc(runId) + "/cancel", reason.value.trim() ? { reason: reason.value.trim() } : {}));
    }

    function resolveCard(o) {
      const id = "resolve-" + o.op;
      const detail = t.opDetail.get(o.op) || {};
      const choice = (value, label) => h("label", { class: "choice" },
        h("input", { type: "radio", name: id + "-r", value, required: true }), label);
      const content = h("textarea", { id: id + "-content", placeholder: "for completed: the result to give the model; for failed: why" });
      const radios = h("div", { class: "row", role: "radiogroup", "aria-label": "What happened" },
        choice("completed", "It completed"), choice("retry", "Run it again"), choice("failed", "It failed"));
      return formCard(id, "Ambiguous operation: " + o.tool, [
        h("p", {}, "The runner of " + o.op + " stopped mid-effect, and the tool cannot tell whether it took effect. Check the target, then say what happened."),
        detail.arguments !== undefined ? [h("div", { class: "muted" }, "Arguments"), h("pre", {}, pretty(detail.arguments))] : null,
        detail.ambiguous ? h("p", { class: "muted" }, "Detail: " + detail.ambiguous) : null,
        radios, h("label", { for: id + "-content" }, "Result or reason", content),
      ], { text: "Resolve", done: "Resolution journaled" }, () => {
        const picked = radios.querySelector("input:checked");
        const r = picked ? picked.value : "";
        const body = { resolution: r };
        if (r === "completed") body.content = content.value;
        if (r === "failed") body.reason = content.value;
        return api("POST", "/v1/runs/" + enc(runId) + "/operations/" + enc(o.op) + "/resolve", body);
      });
    }

    function approvalCard(a) {
      const req = t.approvals.get(a.approval_id);
      const b = h("button", { type: "button", class: "primary", id: "review-" + a.approval_id, disabled: !req },
        "Review and decide");
      b.addEventListener("click", () => openApproval(a.approval_id));
      return h("div", { class: "card", id: "approval-" + a.approval_id },
        h("h3", {}, "Approval: " + a.tool),
        h("p", {}, "Expires " + fmtTime(a.expires_at) + " (" + fmtIn(a.expires_at) + ")."),
        req ? null : h("p", { class: "muted" }, "Loading what it covers…"), b);
    }

    function openApproval(approvalId) {
      const req = t.approvals.get(approvalId);
      if (!req) return;
      const e = h("div", { class: "error", role: "alert", id: "approval-error" });
      const comment = h("textarea", { id: "approval-comment" });
      const done = h("p", { id: "approval-done", role: "status" });
      const decide = async (verdict, btn) => {
        e.textContent = "";
        btn.disabled = true;
        try {
          const r = await api("POST", "/v1/runs/" + enc(runId) + "/approvals/" + enc(approvalId),
            { verdict, args_digest: req.args_digest, comment: comment.value.trim() || undefined });
          done.textContent = (verdict === "approve" ? "Approved" : "Denied") + " (journal seq " + r.seq + ").";
          toast(done.textContent);
          dlg.close();
          actionsKey = "";
          scheduleView();
        } catch (x) {
          e.textContent = x.message;
        } finally {
          btn.disabled = false;
        }
      };
      const approve = h("button", { type: "button", class: "primary", id: "approve" }, "Approve");
      const deny = h("button", { type: "button", class: "danger", id: "deny" }, "Deny");
      approve.addEventListener("click", () => decide("approve", approve));
      deny.addEventListener("click", () => decide("deny", deny));
      const close = h("button", { type: "button", id: "approval-close" }, "Close");
      const dlg = h("dialog", { id: "approval-dialog", "aria-labelledby": "approval-title" },
        h("h2", { id: "approval-title" }, "Approve " + req.tool + "?"),
        h("dl", { class: "facts" },
          h("dt", {}, "Tool"), h("dd", {}, req.tool),
          h("dt", {}, "Risk"), h("dd", {}, req.risk),
          h("dt", {}, "Why"), h("dd", {}, req.basis),
          h("dt", {}, "Target version"), h("dd", { id: "approval-target" },
            req.target_version ? req.target_version : "none (this tool has no precondition check)"),
          h("dt", {}, "Digest"), h("dd", { class: "mono", id: "approval-digest" }, req.args_digest),
          h("dt", {}, "Expires"), h("dd", {}, fmtTime(req.expires_at) + " (" + fmtIn(req.expires_at) + ")")),
        h("h3", {}, "Exactly these arguments"),
        h("pre", { id: "approval-args" }, pretty(req.arguments)),
        h("p", { class: "muted" }, "Your decision names this digest; if the arguments or the target changed since, it authorises nothing."),
        h("label", { for: "approval-comment" }, "Comment (optional)", comment),
        e, done,
        h("div", { class: "row" }, approve, deny, close));
      close.addEventListener("click", () => dlg.close());
      dlg.addEventListener("close", () => dlg.remove());
      document.body.append(dlg);
      dlg.showModal();
      approve.focus();
    }

    // --- the timeline ---
    function stepCard(step) {
      let s = t.steps.get(step);
      if (s) return s;
      const head = h("div", { class: "head" }, "Step " + step);
      const body = h("div", { class: "step-body" });
      const li = h("li", { class: "step", id: "step-" + step, "data-step": step }, head, body);
      t.timeline.append(li);
      s = { li, body, live: null };
      t.steps.set(step, s);
      return s;
    }

    function opCard(ev) {
      let o = t.ops.get(ev.op);
      if (o) return o;
      const parent = ev.step ? stepCard(ev.step).body : t.timeline;
      const head = h("div", { class: "head" }, "operation ", h("span", { class: "mono" }, ev.op));
      const outcome = h("div", { class: "outcome" });
      const el = h(ev.step ? "div" : "li", { class: "op", "data-op": ev.op }, head, outcome);
      parent.append(el);
      o = { el, head, outcome, started: null };
      t.ops.set(ev.op, o);
      return o;
    }

    function settle(op) {
      const d = t.opDetail.get(op);
      if (d && d.ambiguous) { d.settled = true; actionsKey = ""; }
    }

    function row(ev, title, ...body) {
      return h("div", { class: "ev", "data-seq": ev.seq, "data-type": ev.type },
        h("span", { class: "t" }, title),
        h("span", { class: "at" }, fmtTime(ev.at)),
        h("span", { class: "seq" }, "#" + ev.seq),
        body.length ? h("div", { class: "body" }, ...body) : null);
    }

    function place(ev, node) {
      // Decisions on an approval belong with the operation it holds back.
      const d = ev.data || {};
      if (!ev.op && d.approval_id && t.approvalOps.has(d.approval_id)) {
        const op = t.ops.get(t.approvalOps.get(d.approval_id));
        if (op) { op.el.append(node); return; }
      }
      if (ev.op) { opCard(ev).el.append(node); return; }
      if (ev.step && ev.type !== "run.waiting") { stepCard(ev.step).body.append(node); return; }
      t.timeline.append(h("li", {}, node));
    }

    function render(ev) {
      const d = ev.data || {};
      switch (ev.type) {
        case "run.created":
          return place(ev, row(ev, "Run created", h("div", {}, "agent " + d.agent + " rev " + d.agent_revision + " · model " + (d.model ? d.model.provider + "/" + d.model.name : "?")),
            h("pre", {}, d.input)));
        case "run.started": return place(ev, row(ev, "Run started"));
        case "step.started": {
          const s = stepCard(ev.step);
          s.body.append(row(ev, "Attempt " + (ev.attempt || 1) + " calling the model"));
          return;
        }
        case "model.attempt": {
          if (ev.step) { const s = stepCard(ev.step); if (s.live) { s.live.remove(); s.live = null; } }
          const o = d.outcome === "error"
            ? h("span", { class: "attempt-error" }, (d.trouble ? "provider " + d.trouble.replace(/_/g, " ") + " (not spent)" : (d.class || "") + " error") + (d.status ? " (HTTP " + d.status + ")" : "") + ": " + d.message + (d.retry_after_ms ? "; retry after " + d.retry_after_ms + " ms" : ""))
            : d.outcome === "held"
              ? h("span", { class: "attempt-error" }, "not sent: " + d.endpoint + " is failing (not spent)")
              : h("span", { class: "attempt-error" }, d.outcome === "lease_lost" ? "aborted: the worker lost its lease" : "aborted: cancellation requested");
          return place(ev, row(ev, "Attempt " + (ev.attempt || "?") + " did not complete", o));
        }
        case "step.completed": {
          const s = stepCard(ev.step);
          if (s.live) { s.live.remove(); s.live = null; }
          const m = d.message || {};
          const u = d.usage || {};
          return place(ev, row(ev, "Model answered",
            d.reused ? h("div", { class: "reused" }, "Reused the stored response: the model was not called (or billed) again") : null,
            m.text ? h("pre", { class: "msg" }, m.text) : null,
            (m.tool_calls || []).map((c) => h("div", { class: "muted" }, "calls " + c.name)),
            h("div", { class: "muted" }, "finish " + d.finish + " · " + (u.input_tokens || 0) + " in / " + (u.output_tokens || 0) + " out tokens" + (typeof u.cost === "number" ? " · cost " + u.cost.toFixed(6) : ""))));
        }
        case "tool.requested": {
          const o = opCard(ev);
          o.head.replaceChildren("Tool ", h("strong", {}, d.tool), " · ", h("span", { class: "mono" }, ev.op));
          t.opDetail.set(ev.op, Object.assign(t.opDetail.get(ev.op) || {}, { tool: d.tool, arguments: d.arguments }));
          return place(ev, row(ev, d.redispatch ? "Requested again (dispatch " + (d.redispatch + 1) + ")" : "Requested",
            h("pre", { class: "args" }, pretty(d.arguments)),
            d.expect_version ? h("div", { class: "muted" }, "runs only while the target is at " + d.expect_version) : null));
        }
        case "tool.started": {
          opCard(ev).started = ev.at;
          return place(ev, row(ev, "Started", h("span", { class: "muted" }, "runner " + d.runner)));
        }
        case "tool.result": {
          settle(ev.op);
          const o = opCard(ev);
          const dur = o.started ? (new Date(ev.at) - new Date(o.started)) : null;
          const outcome = d.stopped ? "stopped" : d.is_error ? "error" : "ok";
          o.el.classList.add(d.is_error || d.stopped ? "err" : "ok");
          return place(ev, row(ev, "Result: " + outcome + (dur !== null && !Number.isNaN(dur) ? " in " + dur + " ms" : ""),
            h("pre", { class: "result" }, d.content)));
        }
        case "tool.attempt":
          return place(ev, row(ev, "Attempt " + d.attempt + " failed (" + d.class + "); retry " + fmtIn(d.retry_at),
            h("pre", { class: "result" }, d.error)));
        case "output.rejected":
          return place(ev, row(ev, "Answer rejected by the output schema (retry " + d.retry + " of " + d.max_retries + ")",
            (d.errors || []).map((x) => h("div", { class: "attempt-error" }, x))));
        case "question.asked":
          return place(ev, row(ev, "Question asked", h("pre", {}, d.prompt)));
        case "question.answered":
          return place(ev, row(ev, "Answered", h("pre", {}, d.answer)));
        case "approval.requested":
          t.approvals.set(d.approval_id, d);
          if (ev.op) t.approvalOps.set(d.approval_id, ev.op);
          t.opDetail.set(ev.op, Object.assign(t.opDetail.get(ev.op) || {}, { tool: d.tool, arguments: d.arguments }));
          if (ev.op) opCard(ev).head.replaceChildren("Tool ", h("strong", {}, d.tool), " · ", h("span", { class: "mono" }, ev.op));
          actionsKey = "";
          return place(ev, row(ev, "Approval requested (" + d.risk + " risk)",
            h("div", {}, d.basis + " · expires " + fmtTime(d.expires_at)),
            h("pre", { class: "args" }, pretty(d.arguments)),
            h("div", { class: "muted mono" }, "digest " + d.args_digest + (d.target_version ? " · target " + d.target_version : ""))));
        case "approval.decided":
          return place(ev, row(ev, (d.verdict === "approve" ? "Approved" : "Denied") + " by " + d.approver, d.comment ? h("pre", {}, d.comment) : null));
        case "approval.invalidated":
          return place(ev, row(ev, "Approval invalidated", h("span", {}, d.reason)));
        case "approval.expired":
          return place(ev, row(ev, "Approval expired"));
        case "timer.scheduled":
          return place(ev, row(ev, "Timer (" + ((d.purpose && d.purpose.kind) || "?").replace(/_/g, " ") + ")",
            h("span", { "data-due": d.fire_at }, "due " + fmtTime(d.fire_at) + " (" + fmtIn(d.fire_at) + ")")));
        case "timer.fired":
          return place(ev, row(ev, "Timer fired"));
        case "callback.expected":
          return place(ev, row(ev, "Waiting for callback", h("span", { class: "mono" }, d.key), d.expires_at ? " until " + fmtTime(d.expires_at) : ""));
        case "callback.received":
          return place(ev, row(ev, "Callback received", h("pre", {}, pretty(d.payload))));
        case "run.waiting":
          return place(ev, row(ev, "Waiting", WAIT_WORDS[d.on] || d.on));
        case "provider.waiting":
          return place(ev, row(ev, "Waiting on the model provider", h("span", {},
            d.endpoint + " (" + d.trouble.replace(/_/g, " ") + ") since " + fmtTime(d.since) + ": " + d.message +
            "; gives up at " + fmtTime(d.give_up_at))));
        case "context.compacted":
          return place(ev, row(ev, "Context compacted for the model's window", h("span", {},
            (d.keep_from > 1 ? (d.keep_from - 1) + " earlier messages left out, " : "") +
            (d.elided || []).length + " tool result(s) elided (" + d.cause.replace(/_/g, " ") + "; ~" +
            d.estimated_tokens + " tokens for a budget of " + d.budget_tokens + "). The journal keeps them all.")));
        case "provider.released":
          return place(ev, row(ev, d.probe ? "Released as the fleet's probe" : "Released: the provider answers again"));
        case "run.gated":
          // A version gate's marker: from here on this run takes the gate's new branch (a step
          // that calls tools journals no run.waiting; the run view says what it waits on).
          return place(ev, row(ev, "Version gate", h("span", { class: "mono" }, d.gate)));
        case "run.cancelling":
          return place(ev, row(ev, "Cancelling", d.reason));
        case "run.unknown":
          return place(ev, row(ev, "Stopped: outcome unknown", d.reason));
        case "run.resumed": return place(ev, row(ev, "Resumed"));
        case "run.revived": return place(ev, row(ev, "Revived into turn " + d.turn));
        case "run.succeeded": {
          const val = (d.validation && d.validation.status) || "not_checked";
          return place(ev, row(ev, "Succeeded", h("div", {}, "validation: " + val), h("pre", {}, d.output)));
        }
        case "run.compensating":
          return place(ev, row(ev, "Compensating (" + d.cause + ")", (d.plan || []).map((p) => h("div", { class: "mono" },
            p.op + " ← " + (p.compensation ? p.tool + " " + p.compensation : "cannot: " + (p.error || ""))))));
        case "run.failed":
          return place(ev, row(ev, "Failed (" + d.reason + ")", d.message, (d.effects || []).map(effectLine)));
        case "run.cancelled":
          return place(ev, row(ev, "Cancelled", (d.operations || []).map(effectLine)));
        case "user.message":
          return place(ev, row(ev, "Message", h("pre", {}, d.text)));
        case "cancel.requested":
          return place(ev, row(ev, "Cancel requested" + (d.by ? " by " + d.by : ""), d.reason));
        case "outcome.confirmed":
          return place(ev, row(ev, "Confirmed by the tool", h("pre", {}, d.content)));
        case "outcome.not_found":
          return place(ev, row(ev, "The tool says it never ran"));
        case "outcome.ambiguous":
          t.opDetail.set(ev.op, Object.assign(t.opDetail.get(ev.op) || {}, { ambiguous: d.detail }));
          if (ev.op) opCard(ev).el.classList.add("amb");
          actionsKey = "";
          return place(ev, row(ev, "Outcome ambiguous", d.detail));
        case "outcome.resolved":
          settle(ev.op);
          return place(ev, row(ev, "Resolved by " + d.by + ": " + d.resolution, d.content || d.reason || ""));
        case "target.moved":
          return place(ev, row(ev, "Target moved", "expected " + d.expected + ", found " + d.found));
        default:
          return place(ev, row(ev, ev.type, h("pre", {}, pretty(d))));
      }
    }

    // Incremental rendering: events queue up and are rendered a bounded batch per frame, so a
    // run with thousands of events never blocks the page.
    function enqueue(ev) {
      t.queue.push(ev);
      if (!t.flushing) {
        t.flushing = true;
        requestAnimationFrame(flush);
      }
    }
    function flush() {
      const started = performance.now();
      let n = 0;
      while (t.queue.length && (n < 10 || performance.now() - started < 8)) {
        const ev = t.queue.shift();
        const st = STATUS_OF_EVENT[ev.type];
        if (st && t.view && ev.seq > t.view.last_seq) showStatus(st);
        try { render(ev); } catch (e) { t.timeline.append(h("li", { class: "error" }, "could not render event " + ev.seq + ": " + e.message)); }
        n++;
      }
      if (t.timeline.childElementCount > LONG_TIMELINE) t.timeline.classList.add("long");
      if (t.queue.length && !t.stopped) requestAnimationFrame(flush);
      else t.flushing = false;
      scheduleView();
    }

    function onEvent(e) {
      const seq = Number(e.lastEventId);
      if (!Number.isFinite(seq) || seq <= t.lastSeq) return; // already seen (never twice)
      let ev;
      try { ev = JSON.parse(e.data); } catch (_) { return; }
      t.lastSeq = seq;
      t.seqs.push(seq);
      enqueue(ev);
    }

    function onDelta(e) {
      let d;
      try { d = JSON.parse(e.data); } catch (_) { return; }
      if (!d || typeof d.step !== "number") return;
      t.deltas++;
      const s = stepCard(d.step);
      if (s.live && s.liveAttempt !== d.attempt) { s.live.remove(); s.live = null; }
      if (!s.live) {
        s.live = h("pre", { class: "live-text", "aria-live": "off", "data-attempt": d.attempt });
        s.liveAttempt = d.attempt;
        s.body.append(s.live);
      }
      s.live.append(String(d.text || ""));
    }

    // --- the event stream: ticket cookie, then EventSource; resumes by itself ---
    async function ticket() {
      await api("POST", "/v1/runs/" + enc(runId) + "/sse-ticket");
    }

    let retryDelay = 500;
    async function openStream() {
      if (t.stopped) return;
      if (t.es) { t.es.close(); t.es = null; }
      setConn("connecting");
      try {
        await ticket();
      } catch (e) {
        if (e.status === 401 || e.status === 404 || t.stopped) { setConn("ended"); if (e.status === 404) err.textContent = e.message; return; }
        setConn("reconnecting");
        t.timers.push(setTimeout(openStream, retryDelay));
        retryDelay = Math.min(retryDelay * 2, 8000);
        return;
      }
      const url = "/v1/runs/" + enc(runId) + "/events" + (t.lastSeq ? "?after=" + t.lastSeq : "");
      const es = new EventSource(url);
      t.es = es;
      es.onopen = () => { t.opens++; retryDelay = 500; setConn("live"); scheduleView(); };
      es.onerror = () => {
        if (t.stopped || es !== t.es) return;
        if (es.readyState === EventSource.CLOSED) streamClosed();
        else setConn("reconnecting");
      };
      for (const type of EVENT_TYPES) es.addEventListener(type, onEvent);
      es.addEventListener("delta", onDelta);
    }

    // EventSource closes for good on 204 (the run is finished and we have everything) or on an
    // error status (an expired ticket, a bridge that is not ready). Ask what the run is: if it is
    // finished, read any tail we may lack from /history; otherwise open a new stream after the
    // last event seen.
    async function streamClosed() {
      if (t.es) { t.es.close(); t.es = null; }
      try {
        const v = await api("GET", "/v1/runs/" + enc(runId));
        if (v.finished) {
          await catchUp();
          setConn("ended");
          scheduleView();
          return;
        }
      } catch (_) { /* fall through: retry */ }
      setConn("reconnecting");
      t.timers.push(setTimeout(openStream, retryDelay));
      retryDelay = Math.min(retryDelay * 2, 8000);
    }

    async function catchUp() {
      let after = t.lastSeq;
      for (;;) {
        const page = await api("GET", "/v1/runs/" + enc(runId) + "/history?after=" + after + "&limit=500");
        for (const ev of page.events || []) {
          if (ev.seq > t.lastSeq) t.caughtUp++;
          onEvent({ lastEventId: String(ev.seq), data: JSON.stringify(ev) });
        }
        if (page.next_after == null) return;
        after = page.next_after;
      }
    }

    t.timers.push(setInterval(() => { if (t.es && !t.stopped) ticket().catch(() => {}); }, TICKET_RENEW_MS));
    stopCurrent = () => {
      t.stopped = true;
      if (t.es) t.es.close();
      t.timers.forEach((x) => { clearTimeout(x); clearInterval(x); });
      const d = document.getElementById("approval-dialog");
      if (d) d.remove();
    };
    refreshView();
    openStream();
    main().focus();
  }

  // ------------------------------------------------------------------------------------------
  // Start.
  // ------------------------------------------------------------------------------------------

  async function start() {
    window.addEventListener("hashchange", route);
    const saved = sessionStorage.getItem(TOKEN_KEY);
    if (saved) {
      session.token = saved;
      try {
        session.who = await api("GET", "/v1/whoami");
      } catch (e) {
        session.token = null;
        sessionStorage.removeItem(TOKEN_KEY);
        renderNav();
        return renderSignIn(e.message);
      }
    }
    renderNav();
    route();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
