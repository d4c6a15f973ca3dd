#!/usr/bin/env python3
"""Performs docs/RUNBOOK.md's `nats` CLI inspections with nats-py, a NATS client that is not Kedge's.

The `nats` CLI cannot be installed from the package registries this project uses, so this script
reads the recipes from the runbook itself (every `nats …` line of its ```sh blocks, and every
`nats …` code span in its prose) and does what each read-only one does, with the same stream,
bucket, consumer, subject filter and key: docs and check cannot drift apart.

    python3 scripts/runbook_check.py --server nats://127.0.0.1:4222 \
        --run done=run_… --run failed=run_… [--json] [--runbook docs/RUNBOOK.md]

What it does per recipe (anything else, such as `pub`, `req`, `purge` or `context add`, changes
something or needs another identity, and is listed as skipped):

    nats stream view S [--subject F]     an ordered consumer on F, every message
    nats stream get S --last-for F       a JetStream message get, last_by_subj F
    nats stream subjects S [F]           stream info with subjects_filter F
    nats stream info S --json | jq …     stream info; the fields the jq object names
    nats kv ls B [F] / get B K / watch B [F] [| grep -E RE] / history B K
    nats consumer info S C [--json]      consumer info
    nats object ls B / get B NAME        object store listing / the object
    nats sub F                           a subscription for --sub-seconds

Placeholders: `run_…`, `<run_id>` and `<run>` are replaced by each run given with --run (the recipe
is done once per run); `req_…`, `op_…` and `<operation id>` by the ids derived from that run (its
model requests and operations, found among the bucket's keys); any other `…`, `<…>` or NAME-like
word is a wildcard resolved against the keys or objects that exist.

Output: a line per recipe, or with --json one JSON document {"runbook", "results": [...]}, each
result {"line", "section", "command", "op", "run", "target", "ok", "error", "skipped", "found"}.
Exit status: 0 when every inspection could be done (nothing found is not an error; a stream,
bucket or consumer that does not exist is), 1 otherwise, 2 on bad usage or no recipes at all.
Credentials: in the URL (nats://user:password@host:port) or NATS_USER / NATS_PASSWORD.
"""

import argparse
import asyncio
import fnmatch
import json
import os
import re
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    import nats  # noqa: E402
    from nats.js.api import DeliverPolicy  # noqa: E402
except ImportError as e:  # pragma: no cover - reported to the caller
    print(f"runbook_check: nats-py is not importable ({e}); scripts/setup.sh --tests installs it "
          f"into .tools/nats-py (PYTHONPATH)", file=sys.stderr)
    sys.exit(3)

ELLIPSIS = "\u2026"
# Placeholder spellings: <run_id> and <run> are the run; <operation id> / <op> its operations.
RUN_PLACEHOLDERS = ("<run_id>", "<run>")
OP_PLACEHOLDERS = ("<operation id>", "<operation_id>", "<op>")
# Ids whose body starts with their run's body (crates/core/src/ids.rs).
DERIVED_PREFIXES = ("req_", "op_")
SUBJECT_RUN = re.compile(r"(?:^|\.)(run_[A-Za-z0-9_-]+)(?=\.|$)")
MAX_MESSAGES = 2000


# ---------------------------------------------------------------------------------------------
# Reading the runbook


def recipes(text):
    """Every `nats …` command of the runbook: (line, section, command)."""
    found = []
    section = ""
    in_sh = False
    in_other = False
    for n, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("```"):
            if in_sh or in_other:
                in_sh = in_other = False
            elif stripped in ("```sh", "```bash", "```shell"):
                in_sh = True
            else:
                in_other = True
            continue
        if in_other:
            continue
        if in_sh:
            if stripped.startswith("nats "):
                found.append((n, section, stripped))
            continue
        if line.startswith("## "):
            section = line[3:].strip()
            continue
        for span in re.findall(r"`(nats [^`]+)`", line):
            # A mention with an elided part (`nats stream subjects … --names`) is not a recipe.
            if ELLIPSIS not in span.split():
                found.append((n, section, span.strip()))
    return found


def tokenize(command):
    """The command's words (comments dropped), split into pipeline stages."""
    # `<operation id>` is one placeholder, not a redirection and two words.
    protected = re.sub(r"<([^<>]+)>", lambda m: "<" + m.group(1).replace(" ", "\x00") + ">", command)
    try:
        words = shlex.split(protected, comments=True)
    except ValueError as e:
        raise ValueError(f"cannot split: {e}")
    words = [w.replace("\x00", " ") for w in words]
    stages, current = [], []
    for w in words:
        if w == "|":
            stages.append(current)
            current = []
        else:
            current.append(w)
    stages.append(current)
    return stages


def parse_flags(words, with_value):
    """(positional args, {flag: value or True}) of the words after the subcommand."""
    args, flags = [], {}
    i = 0
    while i < len(words):
        w = words[i]
        if w.startswith("--") and "=" in w:
            k, v = w[2:].split("=", 1)
            flags[k] = v
        elif w.startswith("--"):
            k = w[2:]
            if k in with_value and i + 1 < len(words):
                flags[k] = words[i + 1]
                i += 1
            else:
                flags[k] = True
        elif w.startswith("-") and len(w) == 2:
            k = {"-j": "json", "-S": "last-for", "-H": "header", "-s": "server"}.get(w, w)
            if k in with_value and i + 1 < len(words):
                flags[k] = words[i + 1]
                i += 1
            else:
                flags[k] = True
        else:
            args.append(w)
        i += 1
    return args, flags


VALUE_FLAGS = {
    "subject", "last-for", "context", "server", "revision", "sort", "output", "id", "since",
    "translate", "header", "timeout", "replies", "config", "user", "password", "nkey", "creds",
}


def plan(command, admin_contexts):
    """What the command asks: {"op", "target": {...}, "post": [...]} or {"skip": reason}."""
    stages = tokenize(command)
    words = stages[0]
    if not words or words[0] != "nats":
        return {"skip": "not a nats command"}
    args, flags = parse_flags(words[1:], VALUE_FLAGS)
    ctx = flags.get("context")
    if ctx and ctx not in admin_contexts:
        return {"skip": f"needs the identity of context {ctx!r}"}
    post = stages[1:]
    if len(args) < 2:
        return {"skip": "not an inspection"}
    group, verb, rest = args[0], args[1], args[2:]
    if not rest and group not in ("sub", "subscribe"):
        return {"skip": "a mention without a target"}
    if group == "stream":
        if verb == "view" and rest:
            return {"op": "stream_view", "target": {"stream": rest[0], "filter": flags.get("subject")}}
        if verb == "get" and rest and "last-for" in flags:
            return {"op": "stream_last", "target": {"stream": rest[0], "filter": flags["last-for"]}}
        if verb in ("subjects", "subj") and rest:
            return {"op": "stream_subjects",
                    "target": {"stream": rest[0], "filter": rest[1] if len(rest) > 1 else ">"}}
        if verb == "info" and rest:
            return {"op": "stream_info", "target": {"stream": rest[0], "jq": jq_fields(post)}}
    if group == "kv" and rest:
        bucket = rest[0]
        if verb in ("ls", "list"):
            return {"op": "kv_ls", "target": {"bucket": bucket, "filter": rest[1] if len(rest) > 1 else ">"}}
        if verb == "get" and len(rest) > 1:
            return {"op": "kv_get", "target": {"bucket": bucket, "key": rest[1]}}
        if verb == "history" and len(rest) > 1:
            return {"op": "kv_history", "target": {"bucket": bucket, "key": rest[1]}}
        if verb == "watch":
            return {"op": "kv_watch",
                    "target": {"bucket": bucket, "filter": rest[1] if len(rest) > 1 else ">",
                               "grep": grep_pattern(post)}}
    if group == "consumer" and verb in ("info", "nfo") and len(rest) > 1:
        return {"op": "consumer_info", "target": {"stream": rest[0], "consumer": rest[1]}}
    if group in ("object", "obj") and rest:
        if verb == "ls":
            return {"op": "object_ls", "target": {"bucket": rest[0]}}
        if verb == "get" and len(rest) > 1:
            return {"op": "object_get", "target": {"bucket": rest[0], "name": rest[1]}}
    if group in ("sub", "subscribe"):
        return {"op": "sub", "target": {"subject": args[1]}}
    return {"skip": "changes something or is not an inspection"}


def jq_fields(post):
    """The field names of a `jq '… {a, b}'` stage, if any."""
    for stage in post:
        if stage and stage[0] == "jq":
            for expr in stage[1:]:
                m = re.search(r"\{([^{}]*)\}", expr)
                if m:
                    return [f.strip() for f in m.group(1).split(",") if f.strip()]
                m = re.fullmatch(r"\.(\w+)", expr.strip())
                if m:
                    return [m.group(1)]
    return None


def grep_pattern(post):
    """The regular expression of a `grep [-E] RE` stage, if any."""
    for stage in post:
        if stage and stage[0] in ("grep", "egrep"):
            pats = [w for w in stage[1:] if not w.startswith("-")]
            if pats:
                return pats[0]
    return None


# ---------------------------------------------------------------------------------------------
# Placeholders


def has_run_placeholder(value):
    """Whether `value` names a run, or ids derived from one."""
    if not isinstance(value, str):
        return False
    names = ["run_" + ELLIPSIS, *RUN_PLACEHOLDERS, *OP_PLACEHOLDERS]
    names += [p + ELLIPSIS for p in DERIVED_PREFIXES]
    return any(p in value for p in names)


def bind(value, run):
    """`value` with the run's placeholders replaced by `run`, then `…`, `<…>` and NAME-like words
    as `*` (the derived ids `req_…` / `op_…` of a bound run as `req_<body>*`)."""
    if not isinstance(value, str):
        return value
    if run:
        body = run[len("run_"):] if run.startswith("run_") else run
        value = value.replace("run_" + ELLIPSIS, run)
        for p in RUN_PLACEHOLDERS:
            value = value.replace(p, run)
        for prefix in DERIVED_PREFIXES:
            value = value.replace(prefix + ELLIPSIS, prefix + body + "*")
        for p in OP_PLACEHOLDERS:
            value = value.replace(p, "op_" + body + "*")
    value = re.sub(r"<[^<>]+>", "*", value)
    value = value.replace(ELLIPSIS, "*")
    value = re.sub(r"(?<![A-Za-z0-9_])(NAME|SEQ|KEY|BUCKET)(?![A-Za-z0-9_])", "*", value)
    return value


def is_pattern(value):
    return isinstance(value, str) and "*" in value and not value.startswith("$")


def runs_in(value, into):
    """Collects run ids named by subjects or keys (a `run_…` token) and by `run_id` / `subject`
    fields of JSON documents."""
    if isinstance(value, str):
        for m in SUBJECT_RUN.finditer(value):
            into.add(m.group(1))
    elif isinstance(value, dict):
        for k, v in value.items():
            if k == "run_id" and isinstance(v, str):
                into.add(v)
            elif k == "subject" and isinstance(v, str):
                runs_in(v, into)
            elif isinstance(v, (dict, list)):
                runs_in(v, into)
    elif isinstance(value, list):
        for v in value:
            runs_in(v, into)
    return into


def maybe_json(data):
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError):
        try:
            return data.decode()
        except UnicodeDecodeError:
            return None


# ---------------------------------------------------------------------------------------------
# Doing it


class Failed(Exception):
    pass


class KvEntry:
    """A key's current value, as a KV watcher hands it over."""

    def __init__(self, key, value):
        self.key = key
        self.value = value


class Inspector:
    def __init__(self, nc, sub_seconds):
        self.nc = nc
        self.js = nc.jetstream()
        self.sub_seconds = sub_seconds

    async def api(self, subject, body=None):
        payload = json.dumps(body).encode() if body is not None else b""
        try:
            msg = await self.nc.request("$JS.API." + subject, payload, timeout=5)
        except nats.errors.NoRespondersError:
            raise Failed("no JetStream responded")
        resp = json.loads(msg.data)
        if "error" in resp:
            err = resp["error"]
            raise Failed(f"{err.get('description')} ({err.get('err_code')})")
        return resp

    async def subjects(self, stream, filt):
        info = await self.api(f"STREAM.INFO.{stream}", {"subjects_filter": filt or ">"})
        return info.get("state", {}).get("subjects") or {}

    async def stream_view(self, stream, filt):
        counts = await self.subjects(stream, filt)
        total = sum(counts.values())
        messages = []
        if total:
            sub = await self.js.subscribe(filt or ">", stream=stream, ordered_consumer=True,
                                          deliver_policy=DeliverPolicy.ALL)
            try:
                while len(messages) < min(total, MAX_MESSAGES):
                    msg = await sub.next_msg(timeout=5)
                    messages.append({"seq": msg.metadata.sequence.stream, "subject": msg.subject,
                                     "data": maybe_json(msg.data)})
                    if msg.metadata.num_pending == 0:
                        break
            finally:
                await sub.unsubscribe()
        runs = set()
        for m in messages:
            runs_in(m["subject"], runs)
            runs_in(m["data"], runs)
        return {"count": len(messages), "subjects": sorted({m["subject"] for m in messages}),
                "runs": sorted(runs), "messages": messages[:50]}

    async def stream_last(self, stream, filt):
        await self.api(f"STREAM.INFO.{stream}")
        try:
            msg = await self.js.get_msg(stream, subject=filt)
        except nats.js.errors.NotFoundError:
            return {"count": 0, "subjects": [], "runs": []}
        data = maybe_json(msg.data)
        return {"count": 1, "seq": msg.seq, "subject": msg.subject, "data": data,
                "subjects": [msg.subject], "runs": sorted(runs_in(data, runs_in(msg.subject, set())))}

    async def stream_subjects(self, stream, filt):
        counts = await self.subjects(stream, filt)
        return {"count": len(counts), "subjects": counts, "runs": sorted(runs_in(list(counts), set()))}

    async def stream_info(self, stream, fields):
        info = await self.api(f"STREAM.INFO.{stream}")
        config = info.get("config", {})
        found = {"subjects": config.get("subjects"), "messages": info.get("state", {}).get("messages")}
        if fields:
            found["fields"] = {f: config.get(f) for f in fields}
        return found

    async def bucket(self, bucket):
        try:
            return await self.js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            raise Failed(f"bucket {bucket} not found")

    async def watch(self, kv, filt, meta_only=False):
        """The current entries under `filt`, as a watcher's initial values.

        Not nats-py's `kv.watch`: its end-of-initial-values marker comes from a consumer info
        taken while the values are already on their way, so on a loaded machine it can say "none"
        before the first value is read. Here the stream's subject counts say whether there is
        anything, and an ordered consumer is read until a message says nothing is pending.
        """
        stream, pre = f"KV_{kv._name}", f"$KV.{kv._name}."
        if not await self.subjects(stream, pre + (filt or ">")):
            return []
        sub = await self.js.subscribe(pre + (filt or ">"), stream=stream, ordered_consumer=True,
                                      deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                                      headers_only=meta_only)
        entries = []
        try:
            while True:
                msg = await sub.next_msg(timeout=5)
                op = (msg.headers or {}).get("KV-Operation")
                marker = (msg.headers or {}).get("Nats-Marker-Reason")
                if op not in ("DEL", "PURGE") and marker is None:
                    entries.append(KvEntry(msg.subject[len(pre):], msg.data))
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        return entries

    async def kv_keys(self, kv, pattern):
        keys = [e.key for e in await self.watch(kv, ">", meta_only=True)]
        return [k for k in keys if fnmatch.fnmatchcase(k, pattern)]

    async def kv_ls(self, bucket, filt):
        kv = await self.bucket(bucket)
        keys = [e.key for e in await self.watch(kv, filt, meta_only=True)]
        return {"count": len(keys), "keys": keys, "runs": sorted(runs_in(keys, set()))}

    async def kv_get(self, bucket, key):
        kv = await self.bucket(bucket)
        keys = await self.kv_keys(kv, key) if is_pattern(key) else [key]
        values = {}
        for k in keys[:20]:
            try:
                e = await kv.get(k)
            except nats.js.errors.KeyNotFoundError:
                continue
            values[k] = maybe_json(e.value) if e.value is not None else None
        runs = runs_in(list(values), set())
        runs_in(list(values.values()), runs)
        return {"count": len(values), "keys": list(values), "values": values, "runs": sorted(runs)}

    async def kv_history(self, bucket, key):
        kv = await self.bucket(bucket)
        keys = await self.kv_keys(kv, key) if is_pattern(key) else [key]
        history = {}
        for k in keys[:20]:
            try:
                history[k] = [e.revision for e in await kv.history(k)]
            except nats.js.errors.NoKeysError:
                continue
        return {"count": len(history), "keys": list(history), "revisions": history,
                "runs": sorted(runs_in(list(history), set()))}

    async def kv_watch(self, bucket, filt, grep):
        kv = await self.bucket(bucket)
        lines = []
        for e in await self.watch(kv, filt):
            value = e.value.decode(errors="replace") if e.value is not None else ""
            # As the `nats` CLI prints a PUT: "[time] PUT bucket > key: value".
            lines.append((e.key, f"[-] PUT {bucket} > {e.key}: {value}", maybe_json(e.value or b"")))
        if grep:
            rx = re.compile(grep)
            lines = [line for line in lines if rx.search(line[1])]
        runs = runs_in([k for k, _, _ in lines], set())
        runs_in([v for _, _, v in lines], runs)
        return {"count": len(lines), "keys": [k for k, _, _ in lines], "lines": [t for _, t, _ in lines][:50],
                "runs": sorted(runs)}

    async def consumer_info(self, stream, consumer):
        info = await self.api(f"CONSUMER.INFO.{stream}.{consumer}")
        cfg = info.get("config", {})
        return {"name": info.get("name"), "num_pending": info.get("num_pending"),
                "num_ack_pending": info.get("num_ack_pending"),
                "num_redelivered": info.get("num_redelivered"),
                "delivered": (info.get("delivered") or {}).get("stream_seq"),
                "filter_subjects": cfg.get("filter_subjects") or
                ([cfg["filter_subject"]] if cfg.get("filter_subject") else [])}

    async def object_store(self, bucket):
        try:
            return await self.js.object_store(bucket)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            raise Failed(f"object store {bucket} not found")

    async def object_names(self, obs):
        try:
            return [o.name for o in await obs.list(ignore_deletes=True)]
        except nats.js.errors.NotFoundError:
            return []

    async def object_ls(self, bucket):
        obs = await self.object_store(bucket)
        names = await self.object_names(obs)
        return {"count": len(names), "names": names, "runs": sorted(runs_in(
            [n.replace("/", ".").removesuffix(".jsonl") for n in names], set()))}

    async def object_get(self, bucket, name):
        obs = await self.object_store(bucket)
        names = [n for n in await self.object_names(obs) if fnmatch.fnmatchcase(n, name)] \
            if is_pattern(name) else [name]
        objects = {}
        for n in names[:20]:
            try:
                res = await obs.get(n)
            except nats.js.errors.NotFoundError:
                continue
            data = res.data or b""
            objects[n] = {"size": len(data), "lines": data.count(b"\n")}
        runs = runs_in([n.replace("/", ".").removesuffix(".jsonl") for n in objects], set())
        return {"count": len(objects), "objects": objects, "runs": sorted(runs)}

    async def sub(self, subject):
        got = []
        sub = await self.nc.subscribe(subject)
        try:
            deadline = asyncio.get_running_loop().time() + self.sub_seconds
            while len(got) < 1000:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                try:
                    msg = await sub.next_msg(timeout=left)
                except nats.errors.TimeoutError:
                    break
                got.append(msg.subject)
        finally:
            await sub.unsubscribe()
        return {"count": len(got), "subjects": sorted(set(got))[:50], "runs": sorted(runs_in(got, set()))}

    async def do(self, op, target):
        t = target
        if op == "stream_view":
            return await self.stream_view(t["stream"], t["filter"])
        if op == "stream_last":
            return await self.stream_last(t["stream"], t["filter"])
        if op == "stream_subjects":
            return await self.stream_subjects(t["stream"], t["filter"])
        if op == "stream_info":
            return await self.stream_info(t["stream"], t["jq"])
        if op == "kv_ls":
            return await self.kv_ls(t["bucket"], t["filter"])
        if op == "kv_get":
            return await self.kv_get(t["bucket"], t["key"])
        if op == "kv_history":
            return await self.kv_history(t["bucket"], t["key"])
        if op == "kv_watch":
            return await self.kv_watch(t["bucket"], t["filter"], t["grep"])
        if op == "consumer_info":
            return await self.consumer_info(t["stream"], t["consumer"])
        if op == "object_ls":
            return await self.object_ls(t["bucket"])
        if op == "object_get":
            return await self.object_get(t["bucket"], t["name"])
        if op == "sub":
            return await self.sub(t["subject"])
        raise Failed(f"unknown operation {op}")


async def check(args, runs):
    with open(args.runbook, encoding="utf-8") as f:
        text = f.read()
    found = recipes(text)
    if not found:
        print(f"runbook_check: no `nats` recipes in {args.runbook}", file=sys.stderr)
        return 2, []
    options = {"servers": [args.server], "connect_timeout": 5, "max_reconnect_attempts": 0,
               "name": "runbook-check"}
    if os.environ.get("NATS_USER"):
        options["user"] = os.environ["NATS_USER"]
        options["password"] = os.environ.get("NATS_PASSWORD", "")
    nc = await nats.connect(**options)
    inspector = Inspector(nc, args.sub_seconds)
    results = []
    try:
        for line, section, command in found:
            base = {"line": line, "section": section, "command": command}
            try:
                p = plan(command, set(args.admin_context))
            except ValueError as e:
                results.append({**base, "ok": False, "error": str(e), "skipped": None, "op": None,
                                "run": None, "target": None, "found": None})
                continue
            if "skip" in p:
                results.append({**base, "ok": True, "error": None, "skipped": p["skip"], "op": None,
                                "run": None, "target": None, "found": None})
                continue
            per_run = any(has_run_placeholder(v) for v in p["target"].values())
            bindings = list(runs.items()) if per_run else [(None, None)]
            if per_run and not bindings:
                results.append({**base, "ok": True, "error": None, "op": p["op"], "run": None,
                                "target": p["target"], "found": None,
                                "skipped": "names a run, and no --run was given"})
                continue
            for label, run in bindings:
                target = {k: bind(v, run) if k != "grep" else v for k, v in p["target"].items()}
                r = {**base, "op": p["op"], "run": label, "run_id": run, "target": target,
                     "skipped": None}
                try:
                    r["found"] = await inspector.do(p["op"], target)
                    r["ok"], r["error"] = True, None
                except Failed as e:
                    r["ok"], r["error"], r["found"] = False, str(e), None
                except Exception as e:  # a client error is the recipe's failure, reported
                    r["ok"], r["error"], r["found"] = False, f"{type(e).__name__}: {e}", None
                results.append(r)
    finally:
        await nc.close()
    return (0 if all(r["ok"] for r in results) else 1), results


def summary(r):
    where = f"line {r['line']} [{r['section']}]"
    run = f" (run {r['run']})" if r.get("run") else ""
    if r["skipped"]:
        return f"{where} {r['command']}\n    skipped: {r['skipped']}"
    if not r["ok"]:
        return f"{where} {r['command']}{run}\n    FAILED: {r['error']}"
    found = r["found"] or {}
    what = ", ".join(f"{k}={found[k]}" for k in ("count", "num_pending", "num_ack_pending") if k in found)
    if found.get("runs"):
        what += f", runs={','.join(found['runs'])}"
    return f"{where} {r['command']}{run}\n    -> {what}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    ap.add_argument("--runbook", default=os.path.join(ROOT, "docs", "RUNBOOK.md"))
    ap.add_argument("--run", action="append", default=[], metavar="LABEL=RUN_ID",
                    help="a run to bind run_… placeholders to (repeatable)")
    ap.add_argument("--admin-context", action="append", default=["kedge-admin"],
                    help="`--context` names whose recipes this connection may do (default kedge-admin)")
    ap.add_argument("--sub-seconds", type=float, default=1.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    runs = {}
    for spec in args.run:
        label, sep, run = spec.partition("=")
        if not sep or not run:
            ap.error(f"--run {spec!r}: expected LABEL=RUN_ID")
        runs[label] = run
    status, results = asyncio.run(check(args, runs))
    if args.json:
        json.dump({"runbook": args.runbook, "results": results}, sys.stdout, default=str)
        print()
    else:
        for r in results:
            print(summary(r))
        done = [r for r in results if not r["skipped"]]
        bad = [r for r in done if not r["ok"]]
        print(f"runbook_check: {len(done)} inspections, {len(bad)} failed, "
              f"{len(results) - len(done)} recipes skipped")
    sys.exit(status)


if __name__ == "__main__":
    main()
