"""The official `openai` Python client against `tandem serve-edge`.

Usage: python test_client.py BASE_URL MODEL PROMPT [API_KEY]
(BASE_URL like http://127.0.0.1:8080/v1; API_KEY: the server's --api-key-env
key, which the client sends as `Authorization: Bearer`, as it does for OpenAI). Driven by cli/tests/serve_edge_openai.rs,
which starts the server in front of a verifier with the real target and compares
the greedy (temperature 0) text and token ids with `tandem generate --mode target`.
The client is the judge of compatibility: every answer goes through its
parsing (pydantic models, SSE decoding, error classes). Exits non-zero on the
first failed check; prints one JSON line with what the Rust test compares.
"""

import concurrent.futures
import json
import sys

import openai
from openai import OpenAI

MAX_TOKENS = 16
FOLLOW_UP = "Now add type hints."
# Fill in the middle: the body of a function between its signature and a use.
LOGPROB_TOKENS = 4
FIM_PREFIX = "def larger(a: int, b: int) -> int:\n    "
FIM_SUFFIX = "\n\n\nprint(larger(3, 7))\n"
FIM_TOKENS = 8


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def main():
    base_url, model, prompt = sys.argv[1], sys.argv[2], sys.argv[3]
    api_key = sys.argv[4] if len(sys.argv) > 4 else None
    client = OpenAI(base_url=base_url, api_key=api_key or "not-needed", max_retries=0, timeout=600)
    if api_key:
        # A wrong key is refused the way OpenAI refuses one.
        wrong = OpenAI(base_url=base_url, api_key=api_key + "x", max_retries=0, timeout=60)
        try:
            wrong.models.list()
            check(False, "a wrong API key accepted")
        except openai.AuthenticationError as e:
            check(e.status_code == 401 and e.code == "invalid_api_key", e)

    ids = [m.id for m in client.models.list().data]
    check(ids == [model], f"models.list: {ids}")

    messages = [{"role": "user", "content": prompt}]
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    check(r.object == "chat.completion", r.object)
    check(len(r.choices) == 1, r.choices)
    choice = r.choices[0]
    check(choice.message.role == "assistant", choice.message)
    check(choice.finish_reason in ("stop", "length"), choice.finish_reason)
    text = choice.message.content
    check(isinstance(text, str) and text, f"content {text!r}")
    u = r.usage
    check(0 < u.completion_tokens <= MAX_TOKENS, u)
    check(u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens, u)
    ext = r.model_extra["tandem"]  # the extension field, kept by the client as an extra
    check(len(ext["token_status"]) == u.completion_tokens, ext["token_status"])
    check(len(ext["token_ids"]) == u.completion_tokens, ext["token_ids"])

    # Streaming with a usage chunk at the end.
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, finish, usage, chunks = [], None, None, 0
    stream_ids, stream_status, route = [], [], None
    for chunk in stream:
        chunks += 1
        check(chunk.object == "chat.completion.chunk", chunk.object)
        if chunk.usage is not None:
            usage = chunk.usage
            check(chunk.choices == [], "the usage chunk has no choices")
            continue
        cext = (chunk.model_extra or {}).get("tandem") or {}
        if "route" in cext:
            route = cext["route"]
        stream_ids += cext.get("token_ids", [])
        stream_status += cext.get("token_status", [])
        delta = chunk.choices[0].delta
        if delta.content:
            parts.append(delta.content)
        if chunk.choices[0].finish_reason:
            check(finish is None, "two chunks with a finish_reason")
            finish = chunk.choices[0].finish_reason
    streamed = "".join(parts)
    check(streamed == text, f"streamed {streamed!r} != {text!r}")
    check(stream_ids == ext["token_ids"], f"streamed ids {stream_ids} != {ext['token_ids']}")
    check(finish == choice.finish_reason, finish)
    check(usage is not None, "no usage chunk with include_usage")
    check(
        (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
        == (u.prompt_tokens, u.completion_tokens, u.total_tokens),
        f"stream usage {usage} != {u}",
    )

    # A stop list, streamed: greedy output is deterministic, so the answer is
    # the text above cut before the first match (a 5-character piece from its
    # middle, which may span tokens), with finish_reason "stop".
    mid = len(text) // 2
    cut = text[mid : mid + 5]
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stop=["<never-in-the-text>", cut],
    )
    parts, stop_finish = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            stop_finish = chunk.choices[0].finish_reason
    cut_text = "".join(parts)
    check(len(cut) == 5, f"text too short for the stop check: {text!r}")
    check(cut_text == text[: text.find(cut)], f"stop {cut!r}: {cut_text!r} from {text!r}")
    check(stop_finish == "stop", stop_finish)

    # A conversation, as chat apps send one: turn 2 carries the whole history.
    # serve-edge finds turn 1's kept state by the prefix (draft KV, verifier
    # session) and prefills only the new tokens; the Rust test checks the
    # output against the target's greedy output for the whole history.
    history = messages + [
        {"role": "assistant", "content": text},
        {"role": "user", "content": FOLLOW_UP},
    ]
    r2 = client.chat.completions.create(
        model=model, messages=history, max_tokens=MAX_TOKENS, temperature=0
    )
    ext2 = r2.model_extra["tandem"]
    turn2 = {
        "messages": history,
        "token_ids": ext2["token_ids"],
        "token_status": ext2["token_status"],
        "stats": ext2["stats"],
    }

    # Legacy completions: raw prompt.
    c = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=8, temperature=0)
    check(c.object == "text_completion", c.object)
    check(0 < c.usage.completion_tokens <= 8 and c.choices[0].text, c)

    # Fill in the middle through the legacy `suffix` (Qwen2.5-Coder's FIM
    # tokens); the Rust test compares the ids with the target's greedy ones.
    f = client.completions.create(
        model=model, prompt=FIM_PREFIX, suffix=FIM_SUFFIX, max_tokens=FIM_TOKENS, temperature=0
    )
    check(f.object == "text_completion" and f.choices[0].text, f)
    fext = f.model_extra["tandem"]
    fim = {"prefix": FIM_PREFIX, "suffix": FIM_SUFFIX, "max_tokens": FIM_TOKENS,
           "token_ids": fext["token_ids"], "token_status": fext["token_status"]}

    # Two requests at once (serve-edge runs 2 generations in parallel by
    # default): a chat and a short completion from two threads; each is what
    # it is alone (greedy), and they ran on different generation slots.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(
            client.chat.completions.create,
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        )
        short = pool.submit(
            client.completions.create,
            model=model, prompt="def add(a, b):", max_tokens=8, temperature=0,
        )
        pl, ps = long.result(), short.result()
    plx, psx = pl.model_extra["tandem"], ps.model_extra["tandem"]
    check(plx["token_ids"] == ext["token_ids"], f"parallel chat {plx['token_ids']} != {ext['token_ids']}")
    # Both verified: a short open sent just after the chat's long one waits
    # for it (edge-runtime/src/open_load.rs) instead of going provisional.
    check(all(s == "verified" for s in psx["token_status"]), psx["token_status"])
    check(psx["token_ids"] == c.model_extra["tandem"]["token_ids"],
          f"parallel completion {psx['token_ids']} != {c.model_extra['tandem']['token_ids']}")
    check(ps.choices[0].text == c.choices[0].text, "parallel completion text differs")
    check(plx["slot"] != psx["slot"], f"both on slot {plx['slot']}")

    # Errors, as the client classifies them.
    try:
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=4)
        check(False, "unknown model accepted")
    except openai.NotFoundError as e:
        check(e.status_code == 404 and e.code == "model_not_found", e)
    try:
        client.chat.completions.create(model=model, messages=messages, max_tokens=0)
        check(False, "max_tokens=0 accepted")
    except openai.BadRequestError as e:
        check(e.param == "max_tokens", e)
    try:
        client.chat.completions.create(model=model, messages=messages, max_tokens=4, n=9)
        check(False, "n=9 accepted")
    except openai.BadRequestError as e:
        check(e.param == "n" and "n" in str(e.message), e)

    # logprobs + top_logprobs (greedy, through the verifier): the target's
    # distribution for every verified token, in the client's typed objects;
    # the Rust test compares the numbers with the target's own.
    lp = client.chat.completions.create(
        model=model, messages=messages, max_tokens=LOGPROB_TOKENS, temperature=0,
        logprobs=True, top_logprobs=3,
    )
    content = lp.choices[0].logprobs.content
    check(content and len(content) == lp.usage.completion_tokens, content)
    for e in content:
        check(isinstance(e.token, str) and isinstance(e.bytes, list) and e.logprob <= 0, e)
        check(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob, e)
        check(all(a.logprob >= b.logprob for a, b in zip(e.top_logprobs, e.top_logprobs[1:])), e)
    lext = lp.model_extra["tandem"]
    check(lext["token_ids"] == ext["token_ids"][: len(content)], lext["token_ids"])
    logprobs = {
        "token_ids": lext["token_ids"],
        "from": lext["logprobs_from"],
        "logprob": [e.logprob for e in content],
        "top": [[t.logprob for t in e.top_logprobs] for e in content],
    }

    # A body over the server's 2 MB limit: 413 in OpenAI's error shape (the
    # client parses `error` into .code), not a plain-text refusal.
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x" * 3_000_000}], max_tokens=1
        )
        check(False, "a 3 MB body accepted")
    except openai.APIStatusError as e:
        check(e.status_code == 413, e)
        check(e.response.headers.get("content-type") == "application/json", e.response.headers)
        check(e.code == "request_too_large" and isinstance(e.body, dict), f"{e.code} {e.body!r:.200}")

    print(
        json.dumps(
            {
                "openai_version": openai.__version__,
                "content": text,
                "finish_reason": choice.finish_reason,
                "token_ids": ext["token_ids"],
                "token_status": ext["token_status"],
                "stream_token_status": stream_status,
                "route": ext["route"],
                "stream_route": route,
                "usage": [u.prompt_tokens, u.completion_tokens, u.total_tokens],
                "stream_chunks": chunks,
                "turn2": turn2,
                "fim": fim,
                "logprobs": logprobs,
            }
        )
    )


if __name__ == "__main__":
    main()
