"""Structured output through the official `openai` Python client against
`tandem serve-edge`.

Usage: python test_format.py BASE_URL MODEL [API_KEY]
Driven by cli/tests/serve_edge_openai.rs (the real draft in front of a
verifier serving the real target). A JSON schema (`response_format`
json_schema, strict) answered non-streamed and validated against the schema
by hand; JSON mode streamed and parsed; the client's own `parse` with a
Pydantic model (the client turns it into a strict schema and validates the
answer with Pydantic); a schema llguidance cannot compile is a 400 naming
`response_format`. Prints one JSON line with what the Rust test compares
against the target's own greedy output under the schema.
"""

import json
import sys
from typing import List, Literal

from openai import BadRequestError, OpenAI
from pydantic import BaseModel, Field

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "langs": {"type": "array", "items": {"enum": ["rust", "c", "go"]}, "maxItems": 3},
    },
    "required": ["name", "age", "langs"],
    "additionalProperties": False,
}
QUESTION = "Describe a programmer as JSON."
TOKENS = 64
# JSON mode runs free-form: a few tokens show its shape (CI time).
JSON_MODE_TOKENS = 16


class Programmer(BaseModel):
    name: str = Field(max_length=20)
    age: int
    langs: List[Literal["rust", "c", "go"]] = Field(max_length=3)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def valid(v):
    """SCHEMA, checked by hand."""
    check(isinstance(v, dict) and set(v) == {"name", "age", "langs"}, v)
    check(isinstance(v["name"], str) and len(v["name"]) <= 20, v)
    check(isinstance(v["age"], int) and not isinstance(v["age"], bool), v)
    langs = v["langs"]
    check(isinstance(langs, list) and len(langs) <= 3, v)
    check(all(x in ("rust", "c", "go") for x in langs), v)


def main():
    base_url, model = sys.argv[1], sys.argv[2]
    api_key = sys.argv[3] if len(sys.argv) > 3 else "not-needed"
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    messages = [{"role": "user", "content": QUESTION}]

    fmt = {"type": "json_schema",
           "json_schema": {"name": "programmer", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(
        model=model, messages=messages, response_format=fmt,
        max_tokens=TOKENS, temperature=0,
    )
    choice = r.choices[0]
    check(choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}: {r}")
    content = choice.message.content
    valid(json.loads(content))
    ext = r.model_extra["tandem"]

    # JSON mode, streamed: the concatenated deltas are one JSON object.
    stream = client.chat.completions.create(
        model=model, messages=messages, response_format={"type": "json_object"},
        max_tokens=JSON_MODE_TOKENS, temperature=0, stream=True,
    )
    text, finish = "", None
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    # (Free-form JSON can outrun max_tokens: then it is a cut object.)
    if finish == "stop":
        check(isinstance(json.loads(text), dict), text)
    else:
        check(finish == "length" and text.startswith("{"), f"json_object {finish}: {text!r}")

    # The client's structured outputs: a Pydantic model.
    completions = client.chat.completions
    parse = getattr(completions, "parse", None) or client.beta.chat.completions.parse
    p = parse(model=model, messages=messages, response_format=Programmer,
              max_tokens=2 * TOKENS, temperature=0)
    parsed = p.choices[0].message.parsed
    check(isinstance(parsed, Programmer), f"parsed: {p}")

    # A schema that does not compile: 400 naming response_format.
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}
    try:
        client.chat.completions.create(model=model, messages=messages, response_format=bad,
                                       max_tokens=4)
        check(False, "a bad schema was accepted")
    except BadRequestError as e:
        check(e.status_code == 400 and e.param == "response_format", f"{e}")

    print(
        json.dumps(
            {
                "schema": SCHEMA,
                "question": QUESTION,
                "max_tokens": TOKENS,
                "content": content,
                "parsed": parsed.model_dump(),
                "token_ids": ext["token_ids"],
                "token_status": ext["token_status"],
            }
        )
    )


if __name__ == "__main__":
    main()
