#!/usr/bin/env python3
"""Where the journal stops: a diagnostic for a bench's nats-server (docs/PERFORMANCE.md).

Publishes to the journal (`KEDGE_RUNS`) every 10 ms, one publish at a time, on a subject no
Kedge consumer reads (`agent.run.zzprobe.x.ping`), and logs each publish's time to its
acknowledgement. Whenever one is outstanding longer than the threshold, it fetches the server's
goroutines from its profiling port: the dump shows what holds the stream (docs/ARCHITECTURE.md,
"The broker's cost per run, and the journal's stalls").

    KEDGE_BENCH_NATS_CONFIG='prof_port: 18222' cargo bench -p kedge --bench noisy_neighbour &
    python3 scripts/journal_stalls.py 18222 /tmp/stalls 40

It finds the bench's server by its profiling port in the config of the newest
`/tmp/kedge-nats-*` directory, writes `lat.txt` (monotonic time, ms) and `dump_<time>_<ms>.txt`
to the output directory, and prints a summary when the server goes away. Standard library only;
each dump stops the server's world briefly, so judge latencies from a sitting without dumps
(a threshold of `inf`). In the noisy-neighbour bench the server has reset the probe's connection
50-100 s in (the cause is not known yet), so it covers the bench's first two bursts.
"""
import glob
import os
import re
import socket
import sys
import threading
import time
import urllib.request

SUBJECT = b"agent.run.zzprobe.x.ping"


def server_port(prof):
    while True:
        confs = sorted(glob.glob("/tmp/kedge-nats-*/nats.conf"), key=os.path.getmtime, reverse=True)
        for conf in confs:
            text = open(conf).read()
            if f"prof_port: {prof}" in text:
                return int(re.search(r"listen: 127\.0\.0\.1:(\d+)", text).group(1))
        time.sleep(0.2)


def main():
    prof, out = int(sys.argv[1]), sys.argv[2]
    thresh = float(sys.argv[3]) if len(sys.argv) > 3 else 40.0
    os.makedirs(out, exist_ok=True)
    port = server_port(prof)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = sock.makefile("rb")
    reader.readline()  # INFO
    sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nSUB _PROBE.r 1\r\nPING\r\n')
    while reader.readline().strip() != b"PONG":
        pass
    sent = [None]
    lock = threading.Lock()

    def watch():
        last = 0.0
        while True:
            time.sleep(0.005)
            with lock:
                at = sent[0]
            now = time.monotonic()
            if at and (now - at) * 1e3 > thresh and now - last > 0.3:
                last = now
                url = f"http://127.0.0.1:{prof}/debug/pprof/goroutine?debug=2"
                try:
                    dump = urllib.request.urlopen(url, timeout=5).read()
                except OSError as e:
                    print("no dump:", e, file=sys.stderr)
                    continue
                with open(os.path.join(out, f"dump_{now:.3f}_{(now - at) * 1e3:.0f}ms.txt"), "wb") as f:
                    f.write(dump)

    threading.Thread(target=watch, daemon=True).start()
    lats = []
    with open(os.path.join(out, "lat.txt"), "w") as log:
        try:
            while True:
                t = time.monotonic()
                with lock:
                    sent[0] = t
                sock.sendall(b"PUB " + SUBJECT + b" _PROBE.r 2\r\nhi\r\n")
                while True:
                    line = reader.readline()
                    if not line:
                        raise ConnectionError("the server closed the connection")
                    if line.startswith(b"MSG"):
                        reader.read(int(line.split()[-1]) + 2)
                        break
                    if line.startswith(b"PING"):
                        sock.sendall(b"PONG\r\n")
                    elif line.startswith(b"-ERR"):
                        raise ConnectionError(line.decode(errors="replace").strip())
                lat = (time.monotonic() - t) * 1e3
                with lock:
                    sent[0] = None
                lats.append(lat)
                log.write(f"{t:.4f} {lat:.2f}\n")
                time.sleep(0.01)
        except (OSError, ConnectionError) as e:
            print("stopped:", e, file=sys.stderr)
    lats.sort()
    if lats:
        n = len(lats)
        print(f"{n} publishes: p50 {lats[n // 2]:.2f} ms, p99 {lats[int(n * 0.99)]:.1f} ms, "
              f"max {lats[-1]:.0f} ms, over 50 ms: {sum(1 for x in lats if x > 50)}")


if __name__ == "__main__":
    main()
