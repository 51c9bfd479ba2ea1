#!/usr/bin/env python3
"""llama.cpp column of `tandem bench`, through llama-cpp-python.

Measures one GGUF model the way `tandem bench` measures its own engines and
prints one JSON object (the `Measured` fields of docs/cli.md) on stdout:
load time, prefill tok/s over the given prompt ids, greedy decode tok/s one
token at a time, the verify-cost curve (time of one forward over k tokens at
the prompt's context, divided by k = 1; logits for all k positions, as a
verifier needs them) and peak RSS (VmHWM) of this process.

`tandem bench` embeds this file and runs it with `python3 -c`; it also runs on
its own:

    python3 scripts/llama_cpp_bench.py --model M.gguf --threads 2 \
        --prompt-ids 1,2,3 [--repeats 5] [--decode-tokens 64] [--ks 1,2,3,5,9,17,24,40,64]

Install: `pip install llama-cpp-python` (builds llama.cpp from source; see
docs/benchmarks.md).
"""

import argparse
import json
import statistics
import sys
import time


def status_bytes(key):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def ms_since(t):
    return (time.perf_counter() - t) * 1000.0


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--ks", default="1,2,3,5,9,17,24,40,64")
    ap.add_argument(
        "--no-extra-bufts",
        action="store_true",
        help="load without llama.cpp's extra buffer types (AMX, weight repacking); "
        "a workaround for builds whose AMX path crashes",
    )
    a = ap.parse_args(argv)

    prompt = [int(x) for x in a.prompt_ids.split(",") if x]
    ks = [int(x) for x in a.ks.split(",") if x]
    if not prompt:
        ap.error("--prompt-ids is empty")
    if not ks or ks[0] != 1:
        ap.error("--ks must start at 1")
    if a.repeats < 1 or a.decode_tokens < 1:
        ap.error("--repeats and --decode-tokens must be at least 1")

    import llama_cpp
    import numpy as np

    if a.no_extra_bufts:
        # Llama() takes its model params from llama_model_default_params();
        # there is no keyword for use_extra_bufts in llama-cpp-python 0.3.x.
        default_params = llama_cpp.llama_model_default_params

        def params_without_extra_bufts():
            p = default_params()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama_model_default_params = params_without_extra_bufts
        llama_cpp.llama.llama_cpp.llama_model_default_params = params_without_extra_bufts

    n = len(prompt)
    n_ctx = n + max(a.decode_tokens, max(ks)) + 8
    t = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=a.model,
        n_ctx=n_ctx,
        n_batch=max(n, max(ks)),
        n_threads=a.threads,
        n_threads_batch=a.threads,
        logits_all=True,
        verbose=False,
    )
    load_ms = ms_since(t)
    rss_after_load = status_bytes("VmRSS:")
    vocab = llm.n_vocab()

    def prefill():
        # Prefill needs the last row's logits only, like the other engines.
        llm.reset()
        llm._logits_all = False
        try:
            llm.eval(prompt)
        finally:
            llm._logits_all = True
        # One output row was requested: row 0 of the logits buffer.
        row = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))
        return int(np.argmax(row))

    prefill_ms, decode_ms = [], []
    for r in range(a.repeats + 1):  # r = 0 is the warm-up
        t = time.perf_counter()
        tok = prefill()
        p = ms_since(t)
        t = time.perf_counter()
        for _ in range(a.decode_tokens):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        d = ms_since(t)
        if r > 0:
            prefill_ms.append(p)
            decode_ms.append(d)

    vt = [prompt[i % n] for i in range(max(ks))]
    verify_ms = [[] for _ in ks]
    for r in range(a.repeats + 1):
        for i, k in enumerate(ks):
            llm.n_tokens = n  # eval() drops the KV cache past n_tokens
            t = time.perf_counter()
            llm.eval(vt[:k])
            ms = ms_since(t)
            if r > 0:
                verify_ms[i].append(ms)

    one = statistics.median(verify_ms[0])
    out = {
        "version": "llama-cpp-python "
        + getattr(llama_cpp, "__version__", "?")
        + (" (extra buffer types off)" if a.no_extra_bufts else ""),
        "threads": a.threads,
        "load_ms": load_ms,
        "prefill_tokens": n,
        "prefill_tok_s": n / (statistics.median(prefill_ms) / 1000.0),
        "decode_tokens": a.decode_tokens,
        "decode_tok_s": statistics.median(
            [a.decode_tokens / (d / 1000.0) for d in decode_ms]
        ),
        "verify_context": n,
        "verify": [
            {"k": k, "ms": statistics.median(xs), "cost_ratio": statistics.median(xs) / one}
            for k, xs in zip(ks, verify_ms)
        ],
        "rss_after_load_bytes": rss_after_load,
        "peak_rss_bytes": status_bytes("VmHWM:"),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
