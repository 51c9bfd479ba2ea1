//! Tiny random-weight models of every supported family written as GGUF, for
//! fast tests here and in the crates that build on this one. Same
//! architecture metadata and tensor names as the real models, a few layers,
//! quantized with the same formats; optionally with a small byte-level BPE
//! tokenizer in the same file, so the whole user path
//! (`tandem generate --draft-model tiny.gguf`) runs on it.

use crate::arch::Arch;
use crate::{ModelError, Result};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::path::Path;

/// Shape and formats of a tiny model.
#[derive(Clone, Debug)]
pub struct TinyConfig {
    /// The family (tensor set and metadata keys); [`Arch::Qwen2`] by default.
    pub arch: Arch,
    pub n_layer: usize,
    pub d_model: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub d_ff: usize,
    pub vocab: usize,
    /// Per-head width (`{arch}.attention.key_length`); `None`: `d_model / n_head`.
    pub head_dim: Option<usize>,
    /// Gemma 3's `attention.sliding_window` (ignored by the other families).
    pub sliding_window: usize,
    /// Format of the attention/MLP matrices (the "Q4_K_M" mix uses Q4_K,
    /// with ffn_down and attn_v in Q6_K on even layers, like the target).
    pub matrix_format: GgmlDType,
    pub embd_format: GgmlDType,
    pub output_format: GgmlDType,
    pub seed: u64,
    /// Also write `tokenizer.ggml.*` metadata: [`tiny_tokenizer_metadata`]
    /// for `vocab` tokens.
    pub tokenizer: bool,
    /// Metadata written last, replacing generated keys of the same name
    /// (tests write malformed files with it).
    pub extra_metadata: Vec<(String, Value)>,
}

impl Default for TinyConfig {
    fn default() -> Self {
        Self {
            arch: Arch::Qwen2,
            n_layer: 2,
            d_model: 256,
            n_head: 4,
            n_kv_head: 2,
            d_ff: 512,
            vocab: 384,
            head_dim: None,
            sliding_window: 8,
            matrix_format: GgmlDType::Q4K,
            embd_format: GgmlDType::Q4K,
            output_format: GgmlDType::Q6K,
            seed: 1,
            tokenizer: false,
            extra_metadata: Vec::new(),
        }
    }
}

impl TinyConfig {
    /// A tiny model of `arch`, shaped like that family's real ones where the
    /// shape matters: Qwen3 and Gemma 3 with heads wider than
    /// `d_model / n_head`, Gemma 3 with tied output, sliding windows of 8
    /// positions on 5 of every 6 layers (7 layers: both kinds, twice).
    pub fn for_arch(arch: Arch) -> Self {
        let base = Self {
            arch,
            seed: 10 + arch as u64,
            ..Self::default()
        };
        match arch {
            Arch::Qwen2 | Arch::Llama => base,
            Arch::Qwen3 => Self {
                head_dim: Some(128),
                ..base
            },
            Arch::Gemma3 => Self {
                n_layer: 7,
                n_kv_head: 1,
                head_dim: Some(128),
                output_format: GgmlDType::Q4K,
                ..base
            },
        }
    }

    /// Like the draft model's mix: Q5_0 matrices, Q8_0 output.
    pub fn draft_like() -> Self {
        Self {
            matrix_format: GgmlDType::Q5_0,
            embd_format: GgmlDType::Q5_0,
            output_format: GgmlDType::Q8_0,
            seed: 2,
            ..Self::default()
        }
    }
}

/// splitmix64: a tiny deterministic generator for weights.
struct Rng(u64);
impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// `tokenizer.ggml.*` metadata of a byte-level BPE vocabulary of `n_tokens`
/// ids: the 256 byte tokens, merges of a space or a letter with a letter
/// (`Ġa`, `ab`, …), the three ChatML control tokens, then unused padding
/// slots (like the real models' `[PAD…]`). Needs at least 259 tokens.
pub fn tiny_tokenizer_metadata(n_tokens: usize) -> Result<Vec<(String, Value)>> {
    const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let room = n_tokens.checked_sub(256 + SPECIALS.len()).ok_or_else(|| {
        ModelError::InvalidArgument(format!(
            "a tiny tokenizer needs at least {} tokens, not {n_tokens}",
            256 + SPECIALS.len()
        ))
    })?;
    let chars = crate::tokenizer::byte_level_chars();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let space = chars[usize::from(b' ')];
    let firsts = std::iter::once(space).chain('a'..='z');
    let pairs = firsts.flat_map(|a| ('a'..='z').map(move |b| (a, b)));
    let mut merges = Vec::new();
    for (a, b) in pairs.take(room.min(100)) {
        merges.push(format!("{a} {b}"));
        tokens.push(format!("{a}{b}"));
    }
    let mut types = vec![1i32; tokens.len()];
    for t in SPECIALS {
        tokens.push(t.to_string());
        types.push(3);
    }
    let im_end = tokens.len() - 1;
    while tokens.len() < n_tokens {
        tokens.push(format!("[PAD{}]", tokens.len()));
        types.push(5);
    }
    let strings = |v: &[String]| Value::Array(v.iter().map(|t| Value::String(t.clone())).collect());
    Ok(vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
        ("tokenizer.ggml.tokens".into(), strings(&tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.merges".into(), strings(&merges)),
        (
            "tokenizer.ggml.eos_token_id".into(),
            Value::U32(im_end as u32),
        ),
        // The Qwen2.5 template, so chat requests render as on the real models.
        (
            "tokenizer.chat_template".into(),
            Value::String(crate::tokenizer::QWEN2_CHAT_TEMPLATE.into()),
        ),
    ])
}

fn err(e: candle_core::Error) -> ModelError {
    ModelError::InvalidArgument(format!("writing tiny model: {e}"))
}

/// Write a tiny random Qwen2 GGUF to `path` (any family: [`TinyConfig::arch`]).
pub fn write_tiny_qwen2(path: &Path, cfg: &TinyConfig) -> Result<()> {
    write_tiny_model(path, cfg)
}

/// Write a tiny random model of the family [`TinyConfig::arch`] to `path`.
pub fn write_tiny_model(path: &Path, cfg: &TinyConfig) -> Result<()> {
    let mut rng = Rng(cfg.seed);
    let hd = cfg.head_dim.unwrap_or(cfg.d_model / cfg.n_head.max(1));
    let (qd, kvd) = (cfg.n_head * hd, cfg.n_kv_head * hd);
    let traits = cfg.arch.traits();
    let bias = cfg.arch == Arch::Qwen2;
    let tied = cfg.arch == Arch::Gemma3;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut add =
        |name: String, dims: &[usize], scale: f32, offset: f32, fmt: GgmlDType| -> Result<()> {
            let n: usize = dims.iter().product();
            let data: Vec<f32> = (0..n).map(|_| offset + scale * rng.next_f32()).collect();
            let t = Tensor::from_vec(data, dims, &Device::Cpu).map_err(err)?;
            let q = QTensor::quantize(&t, fmt).map_err(err)?;
            tensors.push((name, q));
            Ok(())
        };
    let (d, f) = (cfg.d_model, cfg.d_ff);
    // Gemma scales the embeddings by sqrt(d): keep the hidden state's size
    // like the other families'.
    let embd_scale = if traits.scale_embeddings {
        1.0 / (d as f32).sqrt()
    } else {
        1.0
    };
    add(
        "token_embd.weight".into(),
        &[cfg.vocab, d],
        embd_scale,
        0.0,
        cfg.embd_format,
    )?;
    if !tied {
        add(
            "output.weight".into(),
            &[cfg.vocab, d],
            0.5,
            0.0,
            cfg.output_format,
        )?;
    }
    add("output_norm.weight".into(), &[d], 0.1, 1.0, GgmlDType::F32)?;
    for i in 0..cfg.n_layer {
        let p = |s: &str| format!("blk.{i}.{s}");
        let mix = if i % 2 == 0 && cfg.matrix_format == GgmlDType::Q4K {
            GgmlDType::Q6K
        } else {
            cfg.matrix_format
        };
        let ws = 1.0 / (d as f32).sqrt();
        add(p("attn_norm.weight"), &[d], 0.1, 1.0, GgmlDType::F32)?;
        add(
            p("attn_q.weight"),
            &[qd, d],
            ws * 2.0,
            0.0,
            cfg.matrix_format,
        )?;
        if bias {
            add(p("attn_q.bias"), &[qd], 0.1, 0.0, GgmlDType::F32)?;
        }
        add(
            p("attn_k.weight"),
            &[kvd, d],
            ws * 2.0,
            0.0,
            cfg.matrix_format,
        )?;
        if bias {
            add(p("attn_k.bias"), &[kvd], 0.1, 0.0, GgmlDType::F32)?;
        }
        add(p("attn_v.weight"), &[kvd, d], ws, 0.0, mix)?;
        if bias {
            add(p("attn_v.bias"), &[kvd], 0.1, 0.0, GgmlDType::F32)?;
        }
        if traits.qk_norm {
            add(p("attn_q_norm.weight"), &[hd], 0.1, 1.0, GgmlDType::F32)?;
            add(p("attn_k_norm.weight"), &[hd], 0.1, 1.0, GgmlDType::F32)?;
        }
        add(
            p("attn_output.weight"),
            &[d, qd],
            1.0 / (qd as f32).sqrt(),
            0.0,
            cfg.matrix_format,
        )?;
        if traits.post_norms {
            add(
                p("post_attention_norm.weight"),
                &[d],
                0.1,
                1.0,
                GgmlDType::F32,
            )?;
            add(p("post_ffw_norm.weight"), &[d], 0.1, 1.0, GgmlDType::F32)?;
        }
        add(p("ffn_norm.weight"), &[d], 0.1, 1.0, GgmlDType::F32)?;
        add(p("ffn_gate.weight"), &[f, d], ws, 0.0, cfg.matrix_format)?;
        add(p("ffn_up.weight"), &[f, d], ws, 0.0, cfg.matrix_format)?;
        add(
            p("ffn_down.weight"),
            &[d, f],
            1.0 / (f as f32).sqrt(),
            0.0,
            mix,
        )?;
    }
    let a = cfg.arch.name();
    let k = |s: &str| format!("{a}.{s}");
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(a.into())),
        (
            "general.name".into(),
            Value::String("tandem tiny test model".into()),
        ),
        (k("block_count"), Value::U32(cfg.n_layer as u32)),
        (k("context_length"), Value::U32(4096)),
        (k("embedding_length"), Value::U32(d as u32)),
        (k("feed_forward_length"), Value::U32(f as u32)),
        (k("attention.head_count"), Value::U32(cfg.n_head as u32)),
        (
            k("attention.head_count_kv"),
            Value::U32(cfg.n_kv_head as u32),
        ),
        (k("rope.freq_base"), Value::F32(1_000_000.0)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
    ];
    if cfg.head_dim.is_some() {
        meta.push((k("attention.key_length"), Value::U32(hd as u32)));
        meta.push((k("attention.value_length"), Value::U32(hd as u32)));
    }
    if cfg.arch == Arch::Llama {
        meta.push((k("rope.dimension_count"), Value::U32(hd as u32)));
    }
    if cfg.arch == Arch::Gemma3 {
        meta.push((
            k("attention.sliding_window"),
            Value::U32(cfg.sliding_window as u32),
        ));
    }
    if cfg.tokenizer {
        meta.extend(tiny_tokenizer_metadata(cfg.vocab)?);
    }
    for (key, value) in &cfg.extra_metadata {
        meta.retain(|(k, _)| k != key);
        meta.push((key.clone(), value.clone()));
    }
    write_gguf(path, &meta, &tensors)
}

/// Write metadata and tensors as a GGUF at `path` (through a temp file).
fn write_gguf(path: &Path, meta: &[(String, Value)], tensors: &[(String, QTensor)]) -> Result<()> {
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tmp = path.with_extension("gguf.tmp");
    let io = |source| ModelError::Io {
        path: tmp.clone(),
        source,
    };
    {
        let mut file = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(io)?);
        gguf_file::write(&mut file, &meta_refs, &tensor_refs).map_err(err)?;
        std::io::Write::flush(&mut file).map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    Ok(())
}

/// Write the model at `src` back to `dst` with every quantized matrix
/// dequantized into `to` (F16 or BF16; 1-D tensors and float matrices are
/// kept), and `pad_rows` zero rows appended to the embedding (and the output
/// matrix, when the model has its own) with `[PAD<id>]` tokens of type 5
/// ("unused"): the same weights in a target's float format, optionally with
/// a padded vocabulary like Qwen2.5-7B's (152,064 rows for 151,665 tokens).
/// The Rust twin of `scripts/gguf_dequant.py`, so tests need no Python.
pub fn write_dequantized(src: &Path, dst: &Path, to: GgmlDType, pad_rows: usize) -> Result<()> {
    let io = |source| ModelError::Io {
        path: src.to_path_buf(),
        source,
    };
    let mut f = std::fs::File::open(src).map_err(io)?;
    let content = gguf_file::Content::read(&mut f).map_err(err)?;
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort_by_key(|n| content.tensor_infos[*n].offset);
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let q = content.tensor(&mut f, name, &Device::Cpu).map_err(err)?;
        let padded = pad_rows > 0 && (name == "token_embd.weight" || name == "output.weight");
        let keep = q.shape().rank() < 2
            || matches!(q.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
        if keep && !padded {
            tensors.push((name.clone(), q));
            continue;
        }
        let mut t = q.dequantize(&Device::Cpu).map_err(err)?;
        if padded {
            let cols = t.dim(1).map_err(err)?;
            let zeros = Tensor::zeros((pad_rows, cols), candle_core::DType::F32, &Device::Cpu)
                .map_err(err)?;
            t = Tensor::cat(&[&t, &zeros], 0).map_err(err)?;
        }
        let fmt = if q.shape().rank() < 2 {
            GgmlDType::F32
        } else {
            to
        };
        tensors.push((name.clone(), QTensor::quantize(&t, fmt).map_err(err)?));
    }
    let mut meta: Vec<(String, Value)> = content.metadata.into_iter().collect();
    meta.sort_by(|a, b| a.0.cmp(&b.0));
    if pad_rows > 0 {
        for (key, value) in meta.iter_mut() {
            let Value::Array(items) = value else { continue };
            let n = items.len();
            let pad: Vec<Value> = match key.as_str() {
                "tokenizer.ggml.tokens" => (n..n + pad_rows)
                    .map(|i| Value::String(format!("[PAD{i}]")))
                    .collect(),
                "tokenizer.ggml.token_type" => vec![Value::I32(5); pad_rows],
                "tokenizer.ggml.scores" => vec![Value::F32(0.0); pad_rows],
                _ => continue,
            };
            items.extend(pad);
        }
    }
    write_gguf(dst, &meta, &tensors)
}

/// Rows per forward of [`target_greedy_mismatch`]: inside the block sizes
/// `tests/real_models.rs` proves bit-identical to one token at a time (1, 3,
/// 5, 8, 16), so each row's logits are those of the target's decode loop.
const TEACHER_FORCED_BLOCK: usize = 16;

/// Whether `tokens`, ended by `stop`, are `target`'s own greedy output of
/// `prompt` (what
/// [`crate::speculative::generate_single`] returns under `max_tokens` and
/// `stop_tokens`, unconstrained and without penalties), checked without
/// decoding it token by token: the target runs teacher-forced over prompt +
/// output in blocks of 16 rows; every output token must be its argmax given
/// the tokens before it and no stop token, and the generation must end where
/// the target's would (a stop token next, or `max_tokens` reached). By
/// induction on the position that is the target's decode loop's output, at
/// one forward per 16 tokens instead of one per token (the tests' CI time).
/// `None` when it is; otherwise what differs.
pub fn target_greedy_mismatch(
    target: &crate::transformer::Model,
    prompt: &[u32],
    tokens: &[u32],
    stop: crate::engine::StopReason,
    max_tokens: usize,
    stop_tokens: &[u32],
) -> Result<Option<String>> {
    use crate::engine::StopReason;
    let vocab = target.config().vocab;
    let all: Vec<u32> = prompt.iter().chain(tokens).copied().collect();
    let mut cache = target.new_cache();
    // choices[i]: the target's greedy choice after all[..prompt.len() + i].
    let mut choices = Vec::with_capacity(tokens.len() + 1);
    let mut pos = 0;
    for block in all.chunks(TEACHER_FORCED_BLOCK) {
        let logits = target.forward(block, pos, &mut cache)?;
        for (row, l) in logits.chunks(vocab).enumerate() {
            if pos + row + 1 >= prompt.len() {
                choices.push(crate::sampling::argmax(l));
            }
        }
        pos += block.len();
    }
    if let Some(i) = tokens
        .iter()
        .zip(&choices)
        .position(|(t, c)| t != c || stop_tokens.contains(t))
    {
        return Ok(Some(format!(
            "output token {i} is {} where the target chooses {} (stop tokens {stop_tokens:?}): \
             output {:?}, the target's choices {choices:?}",
            tokens[i], choices[i], tokens
        )));
    }
    let next = choices.get(tokens.len()).copied();
    Ok(match stop {
        StopReason::Stop if next.is_some_and(|t| stop_tokens.contains(&t)) => None,
        StopReason::MaxTokens if tokens.len() == max_tokens => None,
        stop => Some(format!(
            "the output ended by {stop:?} after {} tokens (max {max_tokens}), where the \
             target's next choice is {next:?}",
            tokens.len()
        )),
    })
}
