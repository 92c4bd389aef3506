#!/usr/bin/env python3
"""Diagnostics around one scripts/bench-p99 run: where a stall came from.

  probe.py start ADMIN OUT   -> snapshot of the server's latency histogram and /proc/stat,
                                and a SCHED_FIFO sleeper (1 ms period) writing its worst
                                oversleep to OUT.sleeper until OUT.stop appears
  probe.py end ADMIN OUT     -> stops the sleeper and prints one JSON object:
       server_p99_ms  p99 of the server's own CreateCertificate histogram over the run
                      (the upper bound of the bucket it falls in, so a coarse figure)
       server_over_50ms  requests the server itself saw take more than 51.2 ms
       host_max_gap_ms   worst oversleep of a real-time 1 ms sleeper on the machine:
                      only the hypervisor (or an interrupt storm) can delay it
       steal_ms       CPU time the hypervisor gave to others, both cores, over the run
"""
import json, os, sys, time, urllib.request

def histogram(admin):
    body = urllib.request.urlopen(f"http://{admin}/metrics", timeout=5).read().decode()
    b = {}
    for line in body.splitlines():
        if line.startswith('meshca_request_duration_seconds_bucket{') and 'decision="allow"' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            b[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return b

def steal_ticks():
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])

def sleeper(out):
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    except OSError:
        pass  # not root: an ordinary sleeper still shows long gaps
    worst, at = 0.0, 0.0
    while not os.path.exists(out + ".stop"):
        t0 = time.monotonic()
        time.sleep(0.001)
        gap = (time.monotonic() - t0) * 1000 - 1.0
        if gap > worst:
            worst, at = gap, time.time()
            with open(out + ".sleeper", "w") as f:
                json.dump({"host_max_gap_ms": round(worst, 2), "at": at}, f)

def main():
    cmd, admin, out = sys.argv[1:4]
    if cmd == "start":
        for p in (out + ".stop", out + ".sleeper"):
            if os.path.exists(p):
                os.remove(p)
        with open(out + ".start", "w") as f:
            json.dump({"hist": {str(k): v for k, v in histogram(admin).items()}, "steal": steal_ticks()}, f)
        if os.fork() == 0:
            os.setsid()
            sleeper(out)
            os._exit(0)
        return
    with open(out + ".stop", "w"):
        pass
    time.sleep(0.05)
    with open(out + ".start") as f:
        s = json.load(f)
    h0 = {float(k): v for k, v in s["hist"].items()}
    h1 = histogram(admin)
    d = sorted((le, h1[le] - h0.get(le, 0.0)) for le in h1)
    total = d[-1][1] if d else 0
    p99 = next((le for le, c in d if total and c >= 0.99 * total), None)
    over = total - next((c for le, c in d if abs(le - 0.0512) < 1e-6), total)
    hz = os.sysconf("SC_CLK_TCK")
    try:
        with open(out + ".sleeper") as f:
            gap = json.load(f)["host_max_gap_ms"]
    except (OSError, ValueError):
        gap = None
    print(json.dumps({
        "server_p99_ms": None if p99 is None else round(p99 * 1000, 2),
        "server_over_50ms": int(over),
        "host_max_gap_ms": gap,
        "steal_ms": round((steal_ticks() - s["steal"]) * 1000 / hz),
    }))

if __name__ == "__main__":
    main()
