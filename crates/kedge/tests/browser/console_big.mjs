// Drives headless Chromium for console_browser.rs's long-run and reused-response tests: the
// console's run page on one run (about 2,000 events for the first), first live while it
// executes, then reloaded (the whole run replayed at once). It records long tasks (PerformanceObserver 'longtask'), how long the page takes to
// answer a script while it renders, and what the timeline shows. One JSON line at the end.
//
// Usage: node console_big.mjs <playwright-core dir> <config JSON>
//   config: {"base", "token", "run", "shots", "shot", "profile", "timeout_ms"}

import { createRequire } from "node:module";
import path from "node:path";

const [, , pwDir, configJson] = process.argv;
const require = createRequire(path.join(pwDir, "package.json"));
const { chromium } = require("playwright-core");
const config = JSON.parse(configJson);
const T = config.timeout_ms ?? 120000;

const browser = await chromium.launchPersistentContext(config.profile, {
  executablePath: "/usr/bin/chromium",
  headless: true,
  viewport: { width: 1200, height: 900 },
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const result = { ok: false };
let exitCode = 0;

// Watches the page until its stream ended and its queue is empty: the slowest answer to a
// trivial script (how long a person's click would wait), and the time it took.
async function watch(page) {
  const started = Date.now();
  let slowest = 0;
  for (;;) {
    const t = Date.now();
    const s = await page.evaluate(() => window.__kedge
      ? { conn: window.__kedge.conn, queue: window.__kedge.queue.length, seen: window.__kedge.seqs.length }
      : null);
    slowest = Math.max(slowest, Date.now() - t);
    if (s && s.conn === "ended" && s.queue === 0) return { ms: Date.now() - started, slowest_answer_ms: slowest, seen: s.seen };
    if (Date.now() - started > T) throw new Error("the page did not finish: " + JSON.stringify(s));
    await page.waitForTimeout(20);
  }
}

try {
  const page = browser.pages()[0] ?? (await browser.newPage());
  await page.addInitScript(() => {
    window.__long = [];
    new PerformanceObserver((l) => l.getEntries().forEach((e) => window.__long.push(Math.round(e.duration))))
      .observe({ type: "longtask", buffered: true });
  });
  await page.goto(config.base + "/");
  await page.fill("#token", config.token);
  await page.press("#token", "Enter");
  await page.waitForSelector("#signout", { timeout: T });
  await page.goto(config.base + "/#/runs/" + config.run);
  result.live = await watch(page);
  result.live.long_tasks = await page.evaluate(() => window.__long.slice());
  result.live.rendered = await page.locator("#timeline [data-seq]").count();
  result.live.seqs = await page.evaluate(() => window.__kedge.seqs);

  // Reload: the finished run's whole journal arrives at once.
  await page.reload();
  result.replay = await watch(page);
  result.replay.long_tasks = await page.evaluate(() => window.__long.slice());
  result.replay.rendered = await page.locator("#timeline [data-seq]").count();
  result.replay.seqs = await page.evaluate(() => window.__kedge.seqs);
  result.reused = await page.locator("#timeline .reused").allTextContents();
  // Still usable: the keyboard reaches the message box and the page answers at once.
  const t = Date.now();
  await page.focus("#message-text");
  await page.keyboard.type("still here");
  result.replay.type_ms = Date.now() - t;
  await page.screenshot({ path: path.join(config.shots, config.shot || "long-run.png") });
  result.ok = true;
} catch (e) {
  console.error(String(e && e.stack ? e.stack : e));
  exitCode = 1;
} finally {
  console.log(JSON.stringify(result));
  await browser.close();
}
process.exit(exitCode);
