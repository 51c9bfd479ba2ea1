#!/usr/bin/env python3
"""A short completion while a long chat answer runs, against `tandem serve-edge`.

Usage: scripts/parallel-latency.py HOST:PORT [LONG_TOKENS=192] [SHORT_TOKENS=16]

1. the short completion alone (its latency is the reference);
2. the long chat (streamed) starts; once its first token arrived, the short
   completion is sent; both are timed to their last byte.
Prints one JSON line: short_alone_s, short_during_long_s, long_s, and each
answer's tandem.slot / queue_wait_ms. Greedy with ignore_eos, so every run does
the same work. Standard library only. docs/api.md, "Concurrency, queue, cancellation".
"""

import http.client
import json
import sys
import threading
import time

ADDR = sys.argv[1]
LONG = int(sys.argv[2]) if len(sys.argv) > 2 else 192
SHORT = int(sys.argv[3]) if len(sys.argv) > 3 else 16
HOST, PORT = ADDR.rsplit(":", 1)


def post(path, body):
    c = http.client.HTTPConnection(HOST, int(PORT), timeout=3600)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return c.getresponse()


def short():
    t = time.monotonic()
    r = post("/v1/completions", {"model": "tandem", "prompt": "def fibonacci(n):",
                                  "max_tokens": SHORT, "ignore_eos": True, "temperature": 0})
    j = json.loads(r.read())
    assert r.status == 200, j
    return time.monotonic() - t, j["tandem"]


alone, _ = short()
started = threading.Event()
long_out = {}


def long_chat():
    t = time.monotonic()
    r = post("/v1/chat/completions", {"model": "tandem", "stream": True, "max_tokens": LONG,
                                       "ignore_eos": True, "temperature": 0,
                                       "messages": [{"role": "user", "content":
                                                     "Explain how a hash map works, in detail."}]})
    assert r.status == 200
    last = None
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev["tandem"].get("token_ids"):
            started.set()
        if "job" in ev["tandem"]:
            last = ev["tandem"]
    long_out["s"] = time.monotonic() - t
    long_out["tandem"] = last


th = threading.Thread(target=long_chat)
th.start()
started.wait()
during, ext = short()
th.join()
print(json.dumps({
    "long_tokens": LONG, "short_tokens": SHORT,
    "short_alone_s": round(alone, 2), "short_during_long_s": round(during, 2),
    "long_s": round(long_out["s"], 2),
    "short_slot": ext["slot"], "short_queue_wait_ms": round(ext["queue_wait_ms"], 1),
    "long_slot": long_out["tandem"]["slot"],
}))
