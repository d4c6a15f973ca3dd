// Drives headless Chromium (Debian's, through playwright-core) for bridge_browser.rs.
//
// It opens a page on the bridge's origin (the page itself is served by Playwright's request
// interception, so the bridge serves nothing but its API) whose script watches a run with a
// plain EventSource, exactly as a web console would. The page collects every event id it
// receives; the browser reconnects by itself (Last-Event-ID) when the bridge goes away and comes
// back. When the stream is over (the bridge answers 204 to the reconnect after the run's last
// event, and EventSource closes), the driver prints one JSON line with what the page saw.
//
// Usage: node sse.mjs <playwright-core dir> <config JSON>
//   config: {"base": "http://127.0.0.1:PORT", "run": "run_…", "token": "…", "types": [...],
//            "timeout_ms": 60000, "profile": "/tmp/…"}
// Progress lines ("progress <n>") go to stdout as events arrive, so the test can act mid-run.

import { createRequire } from "node:module";
import path from "node:path";

const [, , pwDir, configJson] = process.argv;
const require = createRequire(path.join(pwDir, "package.json"));
const { chromium } = require("playwright-core");
const config = JSON.parse(configJson);

const page_html = `<!doctype html>
<html><head><meta charset="utf-8"><title>kedge sse test</title></head>
<body><pre id="log"></pre>
<script>
  const cfg = ${JSON.stringify({ run: config.run, token: config.token, types: config.types })};
  window.seen = { ids: [], types: [], opens: 0, errors: 0, deltas: 0, closed: false };
  const url = "/v1/runs/" + cfg.run + "/events?access_token=" + encodeURIComponent(cfg.token);
  const es = new EventSource(url);
  es.onopen = () => { window.seen.opens += 1; };
  es.onerror = () => {
    window.seen.errors += 1;
    if (es.readyState === EventSource.CLOSED) { window.seen.closed = true; }
  };
  const onEvent = (e) => {
    window.seen.ids.push(Number(e.lastEventId));
    window.seen.types.push(e.type);
    document.getElementById("log").textContent += e.lastEventId + " " + e.type + "\\n";
  };
  for (const t of cfg.types) { es.addEventListener(t, onEvent); }
  es.addEventListener("delta", () => { window.seen.deltas += 1; });
</script></body></html>`;

const browser = await chromium.launchPersistentContext(config.profile, {
  executablePath: "/usr/bin/chromium",
  headless: true,
  args: [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
  ],
});
let exitCode = 0;
try {
  const page = browser.pages()[0] ?? (await browser.newPage());
  const pageUrl = config.base + "/__browser_test__/index.html";
  await page.route(pageUrl, (route) =>
    route.fulfill({ status: 200, contentType: "text/html", body: page_html }),
  );
  await page.goto(pageUrl);
  const deadline = Date.now() + (config.timeout_ms ?? 60000);
  let reported = -1;
  for (;;) {
    const seen = await page.evaluate(() => window.seen);
    if (seen.ids.length !== reported) {
      reported = seen.ids.length;
      console.log("progress " + reported);
    }
    if (seen.closed) {
      console.log(JSON.stringify(seen));
      break;
    }
    if (Date.now() > deadline) {
      console.log(JSON.stringify({ ...seen, timed_out: true }));
      exitCode = 2;
      break;
    }
    await new Promise((r) => setTimeout(r, 50));
  }
} catch (e) {
  console.error(String(e && e.stack ? e.stack : e));
  exitCode = 1;
} finally {
  await browser.close();
}
process.exit(exitCode);
