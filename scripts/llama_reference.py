#!/usr/bin/env python3
"""Reference data from llama.cpp (through llama-cpp-python) for Tandem's tests.

Writes the committed fixtures in model/tests/fixtures/ that Tandem's tokenizers,
chat templates and forward passes are compared against. Every fixture was made
with llama-cpp-python 0.3.36 built as docs/model-core.md ("Reference data from
llama.cpp") says, in a venv at /work/llama-venv:

    python3 -m venv /work/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_INT8=OFF" \
      /work/llama-venv/bin/pip install llama-cpp-python==0.3.36 numpy gguf jinja2

(-DGGML_NATIVE=ON builds segfault at their first decode on an AMX machine.)

The exact commands that made the committed files (models from
`tandem models fetch`, M=~/.cache/tandem/models, F=model/tests/fixtures):

    PY=/work/llama-venv/bin/python
    for m in qwen2:$M/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
             smollm2:$M/SmolLM2-135M-Instruct.Q4_1.gguf \
             gemma3:$M/gemma-3-270m-q4_k_m.gguf; do
      n=${m%%:*}; f=${m#*:}
      $PY scripts/llama_reference.py tokenize --model $f --out $F/tokenize_$n.jsonl \
          --meta-out $F/tokenize_$n.meta.json
      $PY scripts/llama_reference.py chat --model $f --out $F/chat_$n.jsonl
    done
    for m in qwen2_draft:$M/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
             qwen2_target:$M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
             smollm2:$M/SmolLM2-135M-Instruct.Q4_1.gguf \
             gemma3:$M/gemma-3-270m-q4_k_m.gguf; do
      n=${m%%:*}; f=${m#*:}
      $PY scripts/llama_reference.py greedy --model $f --out $F/greedy_$n.jsonl
    done
    # gemma3 only: one prompt of 1,502 tokens, past its 512-token sliding
    # window (n_ctx 2048 in one batch with swa_full: with n_ctx 1024 llama.cpp
    # finds no KV slot, "llama_decode returned 1")
    $PY scripts/llama_reference.py greedy --model $M/gemma-3-270m-q4_k_m.gguf \
        --long-prompt --max-tokens 16 --append --out $F/greedy_gemma3.jsonl

Subcommands:
  tokenize  one JSON object per text: {"text", "ids", "ids_nospecial", "ids_bos"}
            where ids = llm.tokenize(text, add_bos=False, special=True) (the
            meaning `ids` has in qwen2_tokenize.jsonl: control-token texts
            become their control ids), ids_nospecial = the same with
            special=False (control-token texts are plain text), ids_bos =
            add_bos=True, special=True (llama.cpp adds BOS only when the GGUF's
            tokenizer.ggml.add_bos_token says so). --meta-out writes the
            tokenizer metadata read from the GGUF.
  chat      one JSON object per conversation (and one more of them with
            add_generation_prompt false): {"name", "messages", "tools",
            "add_generation_prompt", "rendered", "ids"} with `rendered` the GGUF's
            tokenizer.chat_template rendered by jinja2 the way Hugging Face's
            apply_chat_template renders it, and ids =
            llm.tokenize(rendered, add_bos=False, special=True). A GGUF without
            a template gets one line {"no_chat_template": true}.
  greedy    one JSON object per raw prompt (no chat template): {"prompt",
            "prompt_ids", "generated", "top2", "margin", "text"}: prompt_ids =
            llm.tokenize(prompt, add_bos=True, special=False) (BOS as the
            metadata says), then greedy decoding one token at a time with
            llama.cpp's default f16 KV cache; at each generated position the
            runner-up id (top2) and the top-1 minus top-2 logit margin.
  meta      print the tokenizer metadata of a GGUF as JSON.
"""

import argparse
import json
import sys

# ---------------------------------------------------------------- texts

TEXTS = [
    # plain prose, contractions
    "Hello, world!",
    "Hello world",
    " Hello world",
    "hello",
    " hello",
    "It's a test. Don't stop! We'll see; they're here, I'm sure you've heard.",
    "THE QUICK BROWN FOX'S DOG WASN'T THERE'S",
    "The cat's toy, the dogs' toys; we'd, they'll, she'd've.",
    # code: Rust, Python, JS, with indentation and tabs
    "fn main() {\n\tlet v: Vec<u32> = (0..10).collect();\n    println!(\"{:?}\", v);\n}",
    "fn parse_config(path: &Path) -> Result<Config> {\n",
    "impl<'a> Iterator for Tokens<'a> {\n    type Item = &'a str;\n    fn next(&mut self) -> Option<Self::Item> {\n        None\n    }\n}\n",
    "def is_palindrome(s: str) -> bool:\n    s = ''.join(c.lower() for c in s if c.isalnum())\n    return s == s[::-1]\n",
    "class Foo:\n\tdef __init__(self):\n\t\tself.x = 1\n\n\n\tdef bar(self):\n\t\treturn self.x  # comment\n",
    "const add = (a, b) => a + b;\nconsole.log(`sum: ${add(1, 2)}`);\n",
    "function isPalindrome(s) {\n  return s === s.split('').reverse().join('');\n}\n",
    "SELECT id, name FROM users WHERE email = 'alice@example.com';",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
    "    indented\n        more indented\n\ttab",
    "\t\t\tthree tabs\n\t\t\t\tfour tabs",
    "x=1;y=2;z=x+y",
    "if (a && b || !c) { return a->b; } // done",
    "<div class=\"main\"><p>Hello</p></div>",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
    # CJK, mixed scripts
    "端侧大模型推理需要平衡精度、内存和功耗。",
    "我的身份证号是110101199003071234，手机号13800138000。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장입니다.",
    "Ünïcödé tëxt with ß and Ω≈ç√∫ and 日本語のテキスト",
    "Привет, мир! Это тест.",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "Ελληνικά κείμενα και English mixed 中文",
    # accented Latin
    "café naïve résumé façade jalapeño",
    "Ça va? Où est l'hôtel? Straße, Øresund, Åland",
    # emoji
    "Emoji 😀🚀 and accents: café naïve résumé",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 thumbs",
    "🤖🤖🤖",
    # whitespace runs
    "",
    " ",
    "  ",
    "   leading spaces",
    "trailing spaces   ",
    "  leading spaces and    multiple   spaces\n\n\nnewlines\r\nwindows",
    "\n",
    "\n\n\n\n",
    "a\r\nb\r\n\r\nc",
    "tab\tseparated\tvalues\t",
    "word \n word\n \n",
    "                                        forty spaces",
    # digit runs
    "Numbers: 1234567890 3.14159 -42 1e-9 0x1F",
    "12345678901234567890",
    "year 2024, v1.2.3, 1,000,000.00",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    # URLs and symbols
    "URL: https://example.com/path?query=1&b=2#frag",
    "~!@#$%^&*()_+-=[]{}|;':\",./<>?",
    # control-token texts
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nImplement quicksort in Rust.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|endoftext|>more text",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>Hello<eos>",
    "<s>Hello</s>",
    "<|im_start|>",
    "< |im_start| >",
]

# Raw greedy prompts: code, prose, one Chinese.
PROMPTS = [
    "fn parse_config(path: &Path) -> Result<Config> {\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "// Check whether a string is a palindrome.\nfunction isPalindrome(s) {\n",
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "端侧大模型推理的主要挑战是",
]


# More raw prompts for measurements (`greedy --more-prompts`; docs/model-core.md,
# "INT8 KV fidelity"): not in the committed fixtures.
MORE_PROMPTS = [
    "impl Display for Point {\n    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {\n",
    "import numpy as np\n\ndef softmax(x):\n",
    "#include <stdio.h>\n\nint main(int argc, char **argv) {\n",
    "SELECT name, COUNT(*) FROM orders\n",
    "The three laws of thermodynamics are",
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
]


def long_prompt():
    """~650 tokens of varied code, longer than Gemma 3 270M's 512-token window."""
    parts = []
    for i in range(24):
        parts.append(
            f"def handler_{i}(request, retries={i % 5}):\n"
            f"    # step {i}: validate and forward\n"
            f"    if request.size > {1000 + 37 * i}:\n"
            f"        raise ValueError(\"too large: {i}\")\n"
            f"    return forward(request, timeout={0.5 * (i + 1):.1f})\n\n"
        )
    parts.append("def handler_24(request, retries=4):\n")
    return "".join(parts)


# ---------------------------------------------------------------- chat

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city."}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS = [
    (
        "system_user",
        [
            {"role": "system", "content": "You are a concise coding assistant."},
            {"role": "user", "content": "Write a Rust function that reverses a string."},
        ],
        None,
    ),
    (
        "user_only",
        [{"role": "user", "content": "What is the capital of France?"}],
        None,
    ),
    (
        "multi_turn",
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello! How can I help you today?"},
            {"role": "user", "content": "Tell me a joke about compilers."},
        ],
        None,
    ),
    (
        "multi_turn_no_system",
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And times 3?"},
        ],
        None,
    ),
    (
        "unicode_code",
        [
            {"role": "system", "content": "用中文回答。"},
            {
                "role": "user",
                "content": "解释这段代码:\n```python\nfor i in range(3):\n\tprint(i)  # 😀\n```",
            },
        ],
        None,
    ),
    (
        "tool",
        [
            {"role": "user", "content": "What's the weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "name": "get_weather", "content": "{\"temperature_c\": 18, \"sky\": \"cloudy\"}"},
        ],
        TOOLS,
    ),
]

# (name, add_generation_prompt = False): the same messages rendered as a
# finished conversation (no assistant header at the end).
NO_GENERATION_PROMPT = ["multi_turn"]


def render_chat(template, messages, tools, bos_token, eos_token, add_generation_prompt=True):
    """Render like transformers' apply_chat_template (its jinja2 environment)."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox
    from datetime import datetime

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        # fixed, so the fixture is reproducible
        return datetime(2026, 1, 1).strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    kwargs = dict(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
    )
    if tools is not None:
        kwargs["tools"] = tools
    return env.from_string(template).render(**kwargs)


# ---------------------------------------------------------------- metadata


def field_value(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    from gguf import GGUFValueType

    t = f.types[0]
    if t == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    if t == GGUFValueType.ARRAY:
        return None  # arrays are summarised by the caller
    v = f.parts[f.data[0]][0]
    return v.item() if hasattr(v, "item") else v


def array_len(reader, key):
    f = reader.fields.get(key)
    return None if f is None else len(f.data)


def read_meta(path):
    from gguf import GGUFReader

    r = GGUFReader(path)
    arch = field_value(r, "general.architecture")
    keys = [
        "general.architecture",
        "general.name",
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_eos_token",
        "tokenizer.ggml.add_space_prefix",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.seperator_token_id",
        f"{arch}.context_length",
        f"{arch}.vocab_size",
        f"{arch}.attention.sliding_window",
    ]
    meta = {k: field_value(r, k) for k in keys}
    meta["tokenizer.ggml.tokens.len"] = array_len(r, "tokenizer.ggml.tokens")
    meta["tokenizer.ggml.scores.present"] = "tokenizer.ggml.scores" in r.fields
    meta["tokenizer.ggml.merges.len"] = array_len(r, "tokenizer.ggml.merges")
    tmpl = field_value(r, "tokenizer.chat_template")
    meta["tokenizer.chat_template.present"] = tmpl is not None
    meta["tokenizer.chat_template"] = tmpl
    meta["tokenizer.chat_template.sha256"] = (
        None if tmpl is None else __import__("hashlib").sha256(tmpl.encode()).hexdigest()
    )
    # token type counts (1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte)
    tt = r.fields.get("tokenizer.ggml.token_type")
    if tt is not None:
        counts = {}
        for i in tt.data:
            v = int(tt.parts[i][0])
            counts[str(v)] = counts.get(str(v), 0) + 1
        meta["tokenizer.ggml.token_type.counts"] = counts
    emb = [x for x in r.tensors if x.name == "token_embd.weight"]
    if emb:
        meta["token_embd.weight.shape"] = [int(d) for d in emb[0].shape]
        meta["token_embd.weight.type"] = emb[0].tensor_type.name
    return meta, tmpl


def special_texts(path, meta):
    """Texts of the BOS/EOS/EOT tokens (from the GGUF's vocabulary)."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    f = r.fields["tokenizer.ggml.tokens"]

    def text(i):
        if i is None:
            return None
        return bytes(f.parts[f.data[i]]).decode("utf-8")

    out = {}
    for k in ("bos", "eos", "eot"):
        out[k] = text(meta.get(f"tokenizer.ggml.{k}_token_id"))
    return out


# ---------------------------------------------------------------- commands


def load(path, **kw):
    from llama_cpp import Llama

    kw.setdefault("n_ctx", 1024)
    return Llama(model_path=path, n_threads=2, seed=0, verbose=False, **kw)


def cmd_meta(a):
    meta, _ = read_meta(a.model)
    print(json.dumps(meta, indent=1, ensure_ascii=False))


def tok(llm, text, add_bos, special):
    return llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)


def cmd_tokenize(a):
    llm = load(a.model, vocab_only=True)
    with open(a.out, "w", encoding="utf-8") as f:
        for text in TEXTS:
            row = {
                "text": text,
                "ids": tok(llm, text, False, True),
                "ids_nospecial": tok(llm, text, False, False),
                "ids_bos": tok(llm, text, True, True),
            }
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    if a.meta_out:
        meta, _ = read_meta(a.model)
        meta["special_token_texts"] = special_texts(a.model, meta)
        meta["made_by"] = "scripts/llama_reference.py tokenize (llama-cpp-python 0.3.36)"
        with open(a.meta_out, "w", encoding="utf-8") as f:
            f.write(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")


def cmd_chat(a):
    meta, tmpl = read_meta(a.model)
    with open(a.out, "w", encoding="utf-8") as f:
        if tmpl is None:
            f.write(json.dumps({"no_chat_template": True, "model": meta["general.name"]}) + "\n")
            return
        texts = special_texts(a.model, meta)
        llm = load(a.model, vocab_only=True)
        cases = [(n, m, t, True) for n, m, t in CONVERSATIONS]
        cases += [(n, m, t, False) for n, m, t in CONVERSATIONS if n in NO_GENERATION_PROMPT]
        for name, messages, tools, agp in cases:
            row = {"name": name, "messages": messages, "tools": tools, "add_generation_prompt": agp}
            try:
                rendered = render_chat(tmpl, messages, tools, texts["bos"] or "", texts["eos"] or "", agp)
                row["rendered"] = rendered
                row["ids"] = tok(llm, rendered, False, True)
            except Exception as e:  # a template may refuse a conversation
                row["error"] = f"{type(e).__name__}: {e}"
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def cmd_greedy(a):
    import numpy as np

    # The long prompt in one batch. Known failure: llama-cpp-python 0.3.36
    # answers "llama_decode returned 1" (no KV slot) for gemma3's ~700-token
    # prompt both in 512-token batches and in one 1024-token batch; not solved.
    llm = load(a.model, logits_all=True, n_ctx=2048, n_batch=2048, n_ubatch=2048, swa_full=True) if a.long_prompt else load(a.model, logits_all=True)
    prompts = [long_prompt()] if a.long_prompt else PROMPTS
    if a.more_prompts:
        prompts = prompts + MORE_PROMPTS
    mode = "a" if a.append else "w"
    with open(a.out, mode, encoding="utf-8") as f:
        for prompt in prompts:
            llm.reset()
            ids = tok(llm, prompt, True, False)
            llm.eval(ids)
            gen, top2, margin = [], [], []
            for _ in range(a.max_tokens):
                logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
                order = np.argsort(-logits, kind="stable")
                t1, t2 = int(order[0]), int(order[1])
                gen.append(t1)
                top2.append(t2)
                margin.append(round(float(logits[t1] - logits[t2]), 5))
                llm.eval([t1])
            row = {
                "prompt": prompt,
                "prompt_ids": ids,
                "generated": gen,
                "top2": top2,
                "margin": margin,
                "text": llm.detokenize(gen).decode("utf-8", errors="replace"),
            }
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            print(f"{len(ids)} prompt tokens, min margin {min(margin):.3f}", file=sys.stderr)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("meta")
    p.add_argument("--model", required=True)
    p = sub.add_parser("tokenize")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--meta-out")
    p = sub.add_parser("chat")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("greedy")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--long-prompt", action="store_true")
    p.add_argument("--append", action="store_true")
    p.add_argument("--more-prompts", action="store_true")
    a = ap.parse_args(argv)
    {"meta": cmd_meta, "tokenize": cmd_tokenize, "chat": cmd_chat, "greedy": cmd_greedy}[a.cmd](a)


if __name__ == "__main__":
    main(sys.argv[1:])
