// Drives headless Chromium through the web console for console_browser.rs.
//
// The page is the bridge's own console at "/" (nothing is intercepted): sign in, the runs list,
// a run's live timeline, answering, approving (and a stale approval refused), cancelling,
// resolving an ambiguous operation, a read-only token. The test process owns the services and
// the bridge; when this script needs the bridge restarted it prints "sync restart" and waits for
// a line on stdin. Progress lines start with "step "; the last line is one JSON object with
// what the page saw. Screenshots go to config.shots.
//
// Usage: node console.mjs <playwright-core dir> <config JSON>
//   config: {"base", "token", "read_token", "agent", "runs": {"cancel", "amb"}, "shots",
//            "profile", "timeout_ms"}

import { createRequire } from "node:module";
import path from "node:path";
import readline from "node:readline";

const [, , pwDir, configJson] = process.argv;
const require = createRequire(path.join(pwDir, "package.json"));
const { chromium } = require("playwright-core");
const config = JSON.parse(configJson);
const T = config.timeout_ms ?? 60000;

const stdin = readline.createInterface({ input: process.stdin });
const replies = [];
const waiting = [];
stdin.on("line", (l) => (waiting.length ? waiting.shift()(l) : replies.push(l)));
function sync(what) {
  console.log("sync " + what);
  return new Promise((resolve) => (replies.length ? resolve(replies.shift()) : waiting.push(resolve)));
}
const t0 = Date.now();
const step = (s) => console.log("step " + s + " @" + (Date.now() - t0));

async function api(method, p, body, token = config.token, headers = {}) {
  const r = await fetch(config.base + p, {
    method,
    headers: { Authorization: "Bearer " + token, "Content-Type": "application/json", ...headers },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await r.text();
  return { status: r.status, body: text ? JSON.parse(text) : null };
}

async function history(run) {
  const out = [];
  let after = 0;
  for (;;) {
    const r = await api("GET", `/v1/runs/${run}/history?after=${after}&limit=500`);
    out.push(...r.body.events);
    if (r.body.next_after == null) return out;
    after = r.body.next_after;
  }
}

async function signIn(page, token) {
  await page.goto(config.base + "/");
  await page.waitForSelector("#signin #token", { timeout: T });
  await page.fill("#token", token);
  await page.press("#token", "Enter"); // keyboard: submit with Enter
  await page.waitForSelector("#signout", { timeout: T });
}

async function statusOf(page) {
  return page.getAttribute("#run-status [data-status]", "data-status").catch(() => null);
}

async function waitStatus(page, statuses, seen) {
  const deadline = Date.now() + T;
  for (;;) {
    const s = await statusOf(page);
    if (s && seen && seen.at(-1) !== s) seen.push(s);
    if (statuses.includes(s)) return s;
    if (Date.now() > deadline) throw new Error(`status ${s}, wanted ${statuses}`);
    await page.waitForTimeout(50);
  }
}

const browser = await chromium.launchPersistentContext(config.profile, {
  executablePath: "/usr/bin/chromium",
  headless: true,
  viewport: { width: 1200, height: 900 },
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const result = { ok: false, console_errors: [], csp_violations: 0, urls: [] };
let exitCode = 0;
try {
  const page = browser.pages()[0] ?? (await browser.newPage());
  page.on("console", (m) => { if (m.type() === "error") result.console_errors.push(m.text()); });
  page.on("request", (r) => result.urls.push(r.url()));

  // --- a read-only token sees runs but no action ---
  step("read-only sign-in");
  await signIn(page, config.read_token);
  result.read_scope = await page.getAttribute("[data-scope]", "data-scope");
  await page.goto(config.base + "/#/runs/" + config.runs.cancel);
  await page.waitForSelector("#run-status [data-status]", { timeout: T });
  await page.waitForSelector("#timeline [data-type='timer.scheduled']", { timeout: T });
  result.read_only_buttons = await page.locator("#actions button, #actions form").count();
  result.read_only_timer_due = await page.getAttribute("#timeline [data-due]", "data-due");
  await page.click("#signout");
  await page.waitForSelector("#signin", { timeout: T });
  result.token_after_signout = await page.evaluate(() => sessionStorage.length);

  // A refusal is shown: the page is told (falsely) that the read-only token may write, so it
  // offers a cancel; the bridge answers 403, and the page says so.
  step("403 shown");
  await page.route("**/v1/whoami", (route) => route.fulfill({
    status: 200, contentType: "application/json",
    body: JSON.stringify({ tenant: "acme", scope: "write", caller: "x", can_write: true, can_approve: false }),
  }));
  await signIn(page, config.read_token);
  await page.goto(config.base + "/#/runs/" + config.runs.cancel);
  await page.waitForSelector("#actions form#cancel", { timeout: T });
  await page.click("#actions form#cancel button[type=submit]");
  await page.waitForFunction(() => (document.querySelector("#actions form#cancel .error") || {}).textContent, null, { timeout: T });
  result.forbidden_error = await page.textContent("#actions form#cancel .error");
  await page.unroute("**/v1/whoami");
  await page.click("#signout");
  await page.waitForSelector("#signin", { timeout: T });

  // --- sign in with a write+approve token; the runs list ---
  step("sign-in");
  await signIn(page, config.token);
  result.storage_has_token = await page.evaluate(
    (t) => Object.keys(sessionStorage).some((k) => sessionStorage.getItem(k) === t), config.token);
  result.local_storage_len = await page.evaluate(() => localStorage.length);
  await page.waitForSelector("#runs", { timeout: T });
  // Filters: by agent (one run), then a status no run has, then back to everything.
  const rowsAre = (pred) => page.waitForFunction(pred, null, { timeout: T });
  await page.waitForSelector(`#runs tr[data-run="${config.runs.cancel}"]`, { timeout: T });
  await page.fill("#f-agent", "slow");
  await page.click("#filters button[type=submit]");
  await rowsAre(() => {
    const rows = [...document.querySelectorAll("#runs tbody tr[data-run]")];
    return rows.length > 0 && rows.every((r) => r.querySelector("[data-k=agent]").textContent === "slow");
  });
  result.filtered_rows = await page.locator("#runs tbody tr[data-run]").count();
  await page.fill("#f-agent", "");
  await page.selectOption("#f-status", "queued");
  await page.click("#filters button[type=submit]");
  await rowsAre(() => document.querySelectorAll("#runs tbody tr[data-run]").length === 0);
  await page.selectOption("#f-status", "");
  await page.click("#filters button[type=submit]");
  await page.waitForSelector(`#runs tr[data-run="${config.runs.amb}"]`, { timeout: T });

  const sub = await api("POST", "/v1/runs", { agent: config.agent, input: "plan the trip" }, config.token,
    { "Idempotency-Key": "console-live-1" });
  if (sub.status !== 202) throw new Error("submit: " + JSON.stringify(sub));
  const run = sub.body.run_id;
  result.run = run;
  // The new run appears in the list without a reload (live updates).
  await page.waitForSelector(`#runs tr[data-run="${run}"]`, { timeout: T });
  result.list_status = await page.getAttribute(`#runs tr[data-run="${run}"] [data-k=status]`, "data-status");
  await page.focus(`#runs a[href="#/runs/${run}"]`);
  await page.keyboard.press("Enter"); // keyboard: follow the link

  // --- the run page; answer the question ---
  step("answer");
  await page.waitForSelector("#run-status [data-status]", { timeout: T });
  const answer = page.locator("#actions form[id^=answer-]");
  await answer.waitFor({ timeout: T });
  result.question_text = await answer.locator(".prompt").textContent();
  await answer.locator("textarea").fill("blue");
  await answer.locator("button[type=submit]").click();
  await page.waitForSelector("#timeline [data-type='question.answered']", { timeout: T });

  // --- the next step streams into the timeline; the bridge restarts underneath ---
  step("live");
  await page.waitForSelector(".live-text", { timeout: T });
  result.saw_live_text = true;
  step("restart");
  await sync("restart");
  await page.waitForFunction(() => window.__kedge && window.__kedge.opens >= 2, null, { timeout: T });
  result.reconnected = true;

  // --- approve the first operation, showing exactly what the digest covers ---
  step("approve");
  const review = page.locator("#actions button[id^=review-]:not([disabled])");
  await review.waitFor({ timeout: T });
  const firstApproval = (await review.getAttribute("id")).slice("review-".length);
  await review.click();
  await page.waitForSelector("#approval-dialog[open]", { timeout: T });
  result.dialog_args = JSON.parse(await page.textContent("#approval-args"));
  result.dialog_digest = await page.textContent("#approval-digest");
  result.dialog_target = await page.textContent("#approval-target");
  result.dialog_focused = await page.evaluate(() => document.activeElement && document.activeElement.id);
  await page.screenshot({ path: path.join(config.shots, "approval-dialog.png") });
  await page.keyboard.press("Enter"); // the focused Approve button
  await page.waitForSelector("#approval-dialog", { state: "detached", timeout: T });
  await page.waitForSelector("#timeline [data-type='approval.decided']", { timeout: T });
  const events1 = await history(run);
  const req1 = events1.find((e) => e.type === "approval.requested" && e.data.approval_id === firstApproval);
  const dec1 = events1.find((e) => e.type === "approval.decided" && e.data.approval_id === firstApproval);
  result.first_decision = dec1 && { verdict: dec1.data.verdict, digest: dec1.data.args_digest, shown: req1.data.args_digest };

  // --- the second approval goes stale under the open dialog: 409 shown ---
  step("stale approval");
  const review2 = page.locator(`#actions button[id^=review-]:not([id="review-${firstApproval}"]):not([disabled])`);
  await review2.waitFor({ timeout: T });
  const second = (await review2.getAttribute("id")).slice("review-".length);
  await review2.click();
  await page.waitForSelector("#approval-dialog[open]", { timeout: T });
  const req2 = (await history(run)).find((e) => e.type === "approval.requested" && e.data.approval_id === second);
  const other = await api("POST", `/v1/runs/${run}/approvals/${second}`,
    { verdict: "deny", args_digest: req2.data.args_digest, comment: "decided elsewhere" });
  result.other_decision = other.status;
  await page.click("#approve");
  await page.waitForFunction(() => (document.getElementById("approval-error") || {}).textContent, null, { timeout: T });
  result.stale_error = await page.textContent("#approval-error");
  await page.screenshot({ path: path.join(config.shots, "approval-stale-409.png") });
  await page.keyboard.press("Escape");
  await page.waitForSelector("#approval-dialog", { state: "detached", timeout: T });

  // --- the run ends; the stream closes; the timeline equals /history ---
  step("finish");
  await waitStatus(page, ["succeeded"]);
  await page.waitForFunction(() => window.__kedge.conn === "ended", null, { timeout: T });
  // A message revives the finished run into a new turn; the page opens a new stream for it.
  step("revive");
  await page.waitForSelector("#message-text", { timeout: T });
  await page.fill("#message-text", "and book the hotel");
  await page.click("#actions form#message button[type=submit]");
  await page.waitForSelector("#timeline [data-type='run.revived']", { timeout: T });
  await page.waitForFunction(() => {
    const types = [...document.querySelectorAll("#timeline [data-seq]")]
      .map((e) => [Number(e.dataset.seq), e.dataset.type]).sort((a, b) => a[0] - b[0]).map((x) => x[1]);
    return types.lastIndexOf("run.succeeded") > types.indexOf("run.revived");
  }, null, { timeout: T });
  await waitStatus(page, ["succeeded"]);
  await page.waitForFunction(() => window.__kedge.conn === "ended", null, { timeout: T });
  await page.waitForFunction(() => window.__kedge.queue.length === 0, null, { timeout: T });
  await page.waitForFunction(() => /turn 2/.test(document.querySelector("#run-status dl.facts dd:nth-of-type(3)").textContent), null, { timeout: T });
  result.revived_turn = await page.textContent("#run-status dl.facts dd:nth-of-type(3)");
  result.page_seqs = await page.evaluate(() => window.__kedge.seqs);
  result.dom_seqs = await page.evaluate(() => [...document.querySelectorAll("#timeline [data-seq]")].map((e) => Number(e.dataset.seq)));
  result.deltas = await page.evaluate(() => window.__kedge.deltas);
  result.opens = await page.evaluate(() => window.__kedge.opens);
  result.conn_log = await page.evaluate(() => window.__kedge.connLog);
  result.caught_up = await page.evaluate(() => window.__kedge.caughtUp);
  result.reused_marks = await page.locator("#timeline .reused").count();
  result.result_text = await page.textContent("#result pre:last-of-type");
  result.usage_text = await page.textContent("#usage");
  result.attempt_errors = await page.locator("#timeline [data-type='model.attempt'] .attempt-error").allTextContents();
  result.durations = await page.locator("#timeline [data-type='tool.result'] .t").allTextContents();
  await page.screenshot({ path: path.join(config.shots, "run-page.png"), fullPage: true });
  // A phone-width screen: nothing wider than the viewport.
  await page.setViewportSize({ width: 390, height: 844 });
  await page.waitForTimeout(100);
  result.phone_overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  if (result.phone_overflow > 0) {
    result.phone_wide = await page.evaluate(() => [...document.querySelectorAll("body *")]
      .filter((e) => e.getBoundingClientRect().right > window.innerWidth + 1)
      .slice(0, 5).map((e) => e.tagName + "." + e.className + " " + (e.textContent || "").slice(0, 60)));
  }
  await page.screenshot({ path: path.join(config.shots, "run-page-phone.png") });
  await page.setViewportSize({ width: 1200, height: 900 });

  // --- cancel a second run (waiting on a timer) ---
  step("cancel");
  await page.goto(config.base + "/#/runs/" + config.runs.cancel);
  await page.waitForSelector("#actions form#cancel", { timeout: T });
  result.cancel_timer_words = await page.textContent("#wait-words");
  await page.fill("#cancel-reason", "not needed any more");
  await page.click("#actions form#cancel button[type=submit]");
  const seen = [];
  await waitStatus(page, ["cancelled"], seen);
  result.cancel_statuses = seen;
  await page.waitForSelector("#actions form#cancel", { state: "detached", timeout: T });
  result.cancel_buttons_after = await page.locator("#actions form#cancel").count();

  // --- cancel a run while its command runs: cancelling until the command's fate is known ---
  step("cancel while running");
  const sleepySub = await api("POST", "/v1/runs", { agent: "sleepy", input: "sleep" }, config.token,
    { "Idempotency-Key": "console-sleepy-1" });
  if (sleepySub.status !== 202) throw new Error("submit: " + JSON.stringify(sleepySub));
  result.sleepy = sleepySub.body.run_id;
  await page.goto(config.base + "/#/runs/" + result.sleepy);
  await page.waitForSelector("#timeline [data-type='tool.started']", { timeout: T });
  await page.waitForSelector("#actions form#cancel", { timeout: T });
  const seen3 = [];
  await waitStatus(page, ["waiting_tool"], seen3);
  await page.click("#actions form#cancel button[type=submit]");
  await waitStatus(page, ["cancelled"], seen3);
  result.sleepy_statuses = seen3;
  await page.waitForSelector("#timeline [data-type='run.cancelled']", { timeout: T });
  // The events from the cancel request on, in journal order.
  result.sleepy_events = await page.evaluate(() => {
    const evs = [...document.querySelectorAll("#timeline [data-seq]")]
      .map((e) => [Number(e.dataset.seq), e.dataset.type])
      .sort((a, b) => a[0] - b[0]).map((x) => x[1]);
    return evs.slice(evs.indexOf("cancel.requested"));
  });
  await page.screenshot({ path: path.join(config.shots, "cancelled-while-running.png"), fullPage: true });

  // --- resolve an ambiguous operation ---
  step("resolve");
  await page.goto(config.base + "/#/runs/" + config.runs.amb);
  const resolve = page.locator("#actions form[id^=resolve-]");
  await resolve.waitFor({ timeout: T });
  result.amb_words = await page.textContent("#status-words");
  await resolve.locator("input[value=completed]").check();
  await resolve.locator("textarea").fill("it did run");
  await resolve.locator("button[type=submit]").click();
  await page.waitForSelector("#timeline [data-type='outcome.resolved']", { timeout: T });
  await waitStatus(page, ["succeeded"]);
  await page.screenshot({ path: path.join(config.shots, "resolved-run.png"), fullPage: true });

  // --- cancel a run whose operation's fate is unknown: cancelling until resolved ---
  step("cancel while ambiguous");
  await page.goto(config.base + "/#/runs/" + config.runs.amb_cancel);
  await page.waitForSelector("#actions form#cancel", { timeout: T });
  const seen2 = [];
  await waitStatus(page, ["unknown"], seen2);
  await page.click("#actions form#cancel button[type=submit]");
  await page.waitForSelector("#timeline [data-type='cancel.requested']", { timeout: T });
  await page.waitForFunction(() => (document.getElementById("status-words") || {}).textContent.includes("Cancellation requested"), null, { timeout: T });
  await page.waitForTimeout(1000);
  result.amb_cancel_still = await statusOf(page);
  result.amb_cancel_words = await page.textContent("#status-words");
  result.amb_cancel_form = await page.locator("#actions form#cancel").count();
  await page.screenshot({ path: path.join(config.shots, "cancel-requested-ambiguous.png"), fullPage: true });
  const resolve2 = page.locator("#actions form[id^=resolve-]");
  await resolve2.waitFor({ timeout: T });
  await resolve2.locator("input[value=failed]").check();
  await resolve2.locator("textarea").fill("killed before it wrote");
  await resolve2.locator("button[type=submit]").click();
  await waitStatus(page, ["cancelled"], seen2);
  result.amb_cancel_statuses = seen2;

  // --- paging: more runs than a page, newest first, no run on two pages ---
  step("paging");
  for (let i = 0; i < 8; i++) {
    const r = await api("POST", "/v1/runs", { agent: "slow", input: "filler " + i }, config.token,
      { "Idempotency-Key": "console-filler-" + i });
    if (r.status !== 202) throw new Error("submit: " + JSON.stringify(r));
  }
  await page.goto(config.base + "/#/");
  await page.waitForSelector("#runs", { timeout: T });
  await page.selectOption("#f-size", "10");
  await page.click("#filters button[type=submit]");
  const ids = () => page.evaluate(() => [...document.querySelectorAll("#runs tbody tr[data-run]")].map((r) => r.dataset.run));
  // Wait until the projection has every run (13 or more: a full first page and an older one).
  await page.waitForFunction(() => document.querySelectorAll("#runs tbody tr[data-run]").length === 10
    && !document.getElementById("page-older").disabled, null, { timeout: T });
  const page1 = await ids();
  result.page1_created = await page.locator("#runs tbody [data-k=created]").allTextContents();
  await page.click("#page-older");
  await page.waitForFunction((first) => {
    const rows = [...document.querySelectorAll("#runs tbody tr[data-run]")];
    return rows.length > 0 && rows[0].dataset.run !== first;
  }, page1[0], { timeout: T });
  const page2 = await ids();
  await page.screenshot({ path: path.join(config.shots, "runs-list.png"), fullPage: true });
  result.newer_enabled = !(await page.locator("#page-newer").isDisabled());
  await page.click("#page-newer");
  await page.waitForFunction((first) => {
    const rows = [...document.querySelectorAll("#runs tbody tr[data-run]")];
    return rows.length > 0 && rows[0].dataset.run === first;
  }, page1[0], { timeout: T });
  result.paging = { page1, page2, back: await ids() };

  // No token in any URL the browser asked for.
  result.token_in_url = result.urls.some((u) => u.includes(config.token) || u.includes(config.read_token));
  result.ok = true;
} catch (e) {
  console.error(String(e && e.stack ? e.stack : e));
  try {
    const page = browser.pages()[0];
    if (page) await page.screenshot({ path: path.join(config.shots, "failure.png"), fullPage: true });
  } catch (_) { /* ignore */ }
  exitCode = 1;
} finally {
  delete result.urls;
  console.log(JSON.stringify(result));
  await browser.close();
  stdin.close();
}
process.exit(exitCode);
