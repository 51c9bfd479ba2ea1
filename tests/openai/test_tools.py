"""Tools (function calling) through the official `openai` Python client
against `tandem serve-edge`.

Usage: python test_tools.py BASE_URL MODEL [API_KEY]
Driven by cli/tests/serve_edge_openai.rs (the real draft in front of a
verifier serving the real target). A tool is declared and called: non
streamed with a named `tool_choice` (forced: a small model calls it
reliably), streamed with `tool_choice` auto (the model decides; deltas as
OpenAI streams them: `index`, `id`, `type`, `function.name`, empty
`arguments`, then argument fragments); the call is answered with a `tool`
message and the final answer must use the result.
Prints one JSON line with what the Rust test compares against the target's
own greedy output.
"""

import json
import sys

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city's name."}},
                "required": ["city"],
            },
        },
    }
]
QUESTION = "What is the weather in Paris right now?"
RESULT = '{"temperature_c": 21, "condition": "sunny"}'
CALL_TOKENS = 16
ANSWER_TOKENS = 10


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def main():
    base_url, model = sys.argv[1], sys.argv[2]
    api_key = sys.argv[3] if len(sys.argv) > 3 else "not-needed"
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    messages = [{"role": "user", "content": QUESTION}]
    forced = {"type": "function", "function": {"name": "get_weather"}}

    r = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice=forced,
        max_tokens=CALL_TOKENS, temperature=0,
    )
    choice = r.choices[0]
    check(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason}: {r}")
    calls = choice.message.tool_calls
    check(calls is not None and len(calls) == 1, f"tool_calls: {choice.message}")
    call = calls[0]
    check(call.type == "function" and call.id.startswith("call_"), call)
    check(call.function.name == "get_weather", call)
    args = json.loads(call.function.arguments)
    check(isinstance(args, dict) and "paris" in str(args.get("city", "")).lower(), args)
    check(choice.message.content is None, f"content beside the call: {choice.message.content!r}")
    call_ext = r.model_extra["tandem"]

    # Streamed, with `tool_choice` "auto" (the default): the model writes
    # the call on its own (Qwen2.5-Coder as a bare JSON object, without its
    # <tool_call> tags); it comes in OpenAI's delta shape, nothing as content.
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS,
        max_tokens=2 * CALL_TOKENS, temperature=0, stream=True,
    )
    first, fragments, content, finish, stream_ids = None, [], "", None, []
    for chunk in stream:
        stream_ids += ((chunk.model_extra or {}).get("tandem") or {}).get("token_ids", [])
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            check(tc.index == 0, tc)
            if first is None:
                first = tc
                check(tc.id and tc.type == "function" and tc.function.name == "get_weather", tc)
                check(tc.function.arguments == "", f"first delta's arguments: {tc}")
            else:
                check(tc.id is None and tc.function.name is None, f"a later delta renames: {tc}")
                fragments.append(tc.function.arguments)
        if chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    check(first is not None, "no tool call streamed")
    check("".join(fragments) == call.function.arguments, f"{fragments} != {call.function.arguments}")
    check(content == "", f"streamed content {content!r}")
    check(finish == "tool_calls", finish)
    check(len(stream_ids) > 0, "no token ids streamed")

    # The tool's answer, and the final answer that uses it.
    history = messages + [
        choice.message,
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    # `tool_choice: "none"`: the answer is text (the tools are not offered;
    # with them the small model tends to call again).
    f = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="none",
        max_tokens=ANSWER_TOKENS, temperature=0,
    )
    final = f.choices[0]
    check(final.message.tool_calls is None, f"another call: {final.message}")
    text = final.message.content or ""
    check("21" in text, f"the final answer does not use the result: {text!r}")

    print(
        json.dumps(
            {
                "tools": TOOLS,
                "question": QUESTION,
                "call": {"id": call.id, "name": call.function.name,
                         "arguments": call.function.arguments,
                         "token_ids": call_ext["token_ids"],
                         "token_status": call_ext["token_status"]},
                "auto": {"content": content, "arguments": "".join(fragments),
                         "token_ids": stream_ids},
                "result": RESULT,
                "final": {"content": text, "finish_reason": final.finish_reason,
                          "token_ids": f.model_extra["tandem"]["token_ids"],
                          "token_status": f.model_extra["tandem"]["token_status"]},
            }
        )
    )


if __name__ == "__main__":
    main()
