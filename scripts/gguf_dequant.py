#!/usr/bin/env python3
"""Write a quantized GGUF back as F16 (or BF16): the same model, wider weights.

Every quantized tensor of two or more dimensions is dequantized (with the
`gguf` package's reference dequantizers, the arithmetic of llama.cpp's
`dequantize_row_*`) and stored as F16, or BF16 with `--to bf16`. F32/F16/BF16
tensors and 1-D tensors are copied unchanged, byte for byte. All metadata is
copied; `general.file_type` is set to MOSTLY_F16 (1) or MOSTLY_BF16 (32) so
the file says what it holds.

`--pad-vocab N` also makes a target "with padded embedding rows", the way
Qwen2.5-7B's 152,064-row tables relate to the 0.5B's 151,936: N rows of zeros
are appended to `token_embd.weight` (and `output.weight` if the model has
one), `tokenizer.ggml.tokens` gets N texts `[PAD<id>]`, `token_type` gets N
times 5 (unused) and `scores` (if present) N times -1000.0, as llama.cpp's
converter writes padding tokens; `<arch>.vocab_size` is updated if present.
A zero output row gives logit 0 for its padding id, which real logits can
exceed or not: verification must never accept or emit such an id.

Needs only `numpy` and `gguf` (pip install numpy gguf; made with gguf 0.19.0
and numpy 2.x). Usage:

    python3 scripts/gguf_dequant.py IN.gguf OUT.gguf [--to f16|bf16] [--pad-vocab N]

Memory: one tensor at a time (the input is memory-mapped, each output tensor
is written as soon as it is converted).
"""

import argparse
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

KEEP = {T.F32, T.F16, T.BF16, T.F64, T.I8, T.I16, T.I32, T.I64}
PADDED = ("token_embd.weight", "output.weight")


def out_type(t, to):
    """The type a tensor is written as."""
    if t.tensor_type in KEEP or len(t.shape) < 2:
        return t.tensor_type
    return T.BF16 if to == "bf16" else T.F16


def rows_of(t):
    """The tensor's values as f32, numpy shape (rows, ..., cols)."""
    return gguf.quants.dequantize(t.data, t.tensor_type)


def converted(t, to, pad):
    """(numpy array to write, raw_dtype or None) for tensor `t`."""
    kind = out_type(t, to)
    if kind == t.tensor_type and not pad:
        return t.data, (t.tensor_type if t.tensor_type not in (T.F32, T.F16) else None)
    if kind == t.tensor_type and kind in (T.F32, T.F16):
        x = np.asarray(t.data)
    else:
        x = rows_of(t)
    if pad:
        if x.ndim != 2:
            raise SystemExit(f"{t.name}: cannot pad a tensor of {x.ndim} dimensions")
        x = np.concatenate([x, np.zeros((pad, x.shape[1]), dtype=x.dtype)])
    if kind == T.F32:
        return x.astype(np.float32), None
    if kind == T.F16:
        return x.astype(np.float16), None
    if kind == T.BF16:
        return gguf.quants.quantize(x.astype(np.float32), T.BF16), T.BF16
    raise SystemExit(f"{t.name}: cannot pad a {t.tensor_type.name} tensor")


def copy_metadata(reader, writer, to, pad, arch):
    n_vocab = None
    for field in reader.fields.values():
        name = field.name
        if name == gguf.Keys.General.ARCHITECTURE or name.startswith("GGUF."):
            continue  # the writer writes these itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == V.ARRAY else None
        value = field.contents()
        if name == "general.file_type":
            value = 32 if to == "bf16" else 1
        if pad and name == "tokenizer.ggml.tokens":
            n_vocab = len(value)
            value = value + [f"[PAD{i}]" for i in range(n_vocab, n_vocab + pad)]
        elif pad and name == "tokenizer.ggml.token_type":
            value = list(value) + [5] * pad
        elif pad and name == "tokenizer.ggml.scores":
            value = list(value) + [-1000.0] * pad
        elif pad and name == f"{arch}.vocab_size":
            value = int(value) + pad
        writer.add_key_value(name, value, vtype, sub_type=sub)
    if pad and n_vocab is None:
        raise SystemExit("--pad-vocab: the file has no tokenizer.ggml.tokens")
    if "general.file_type" not in reader.fields:
        writer.add_uint32("general.file_type", 32 if to == "bf16" else 1)
    return n_vocab


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--to", choices=["f16", "bf16"], default="f16")
    ap.add_argument("--pad-vocab", type=int, default=0, metavar="N")
    a = ap.parse_args(argv)
    if a.pad_vocab < 0:
        raise SystemExit("--pad-vocab must be >= 0")

    reader = gguf.GGUFReader(a.input)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(a.output, arch)
    align = reader.fields.get("general.alignment")
    if align is not None:
        writer.data_alignment = int(align.contents())
    n_vocab = copy_metadata(reader, writer, a.to, a.pad_vocab, arch)

    # Tensor infos first (shapes and sizes), then the data one tensor at a time.
    plans = []
    for t in reader.tensors:
        pad = a.pad_vocab if t.name in PADDED else 0
        if pad and int(t.shape[-1]) != n_vocab:
            raise SystemExit(f"{t.name} has {int(t.shape[-1])} rows, the vocabulary {n_vocab}")
        kind = out_type(t, a.to)
        ne = [int(d) for d in t.shape]  # GGUF order: ne[0] = columns
        ne[-1] += pad
        n = int(np.prod(ne))
        if kind in (T.F32, T.F16, T.BF16) and (kind != t.tensor_type or pad):
            nbytes = n * (4 if kind == T.F32 else 2)
        else:
            nbytes = int(t.n_bytes)
        np_shape = list(reversed(ne))
        if kind == T.F32:
            writer.add_tensor_info(t.name, np_shape, np.dtype(np.float32), nbytes)
        elif kind == T.F16:
            writer.add_tensor_info(t.name, np_shape, np.dtype(np.float16), nbytes)
        else:  # BF16 or a kept quantized/integer type: raw bytes of that type
            writer.add_tensor_info(t.name, np_shape, np.dtype(np.float32), nbytes, raw_dtype=kind)
        plans.append((t, pad))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t, pad in plans:
        data, _ = converted(t, a.to, pad)
        writer.write_tensor_data(np.ascontiguousarray(data))
    writer.close()
    kinds = {}
    for t, _ in plans:
        k = out_type(t, a.to).name
        kinds[k] = kinds.get(k, 0) + 1
    print(f"wrote {a.output}: {len(plans)} tensors {kinds}, pad {a.pad_vocab}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
