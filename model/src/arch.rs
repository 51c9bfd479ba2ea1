//! The supported model families and their hyper-parameters, read from GGUF
//! metadata: the one place where the architectures differ (as llama.cpp's
//! `llama-model.cpp` keeps one place per architecture).
//!
//! Every family is the same decoder-only transformer (RMSNorm, GQA attention
//! with RoPE, a gated FFN). What differs is data, listed in [`ArchTraits`]:
//!
//! | family   | q/k/v bias | q/k norm | post norms | FFN      | RoPE pairs | embeddings × √d | sliding window |
//! | -------- | ---------- | -------- | ---------- | -------- | ---------- | --------------- | -------------- |
//! | `qwen2`  | required   | –        | –          | SiLU     | NeoX       | –               | –              |
//! | `qwen3`  | if present | per head | –          | SiLU     | NeoX       | –               | –              |
//! | `llama`  | if present | –        | –          | SiLU     | adjacent   | –               | –              |
//! | `gemma3` | if present | per head | both       | GELU tanh| NeoX       | yes             | 5 local : 1 global |
//!
//! `llama` covers Llama 2/3.x (with `rope_freqs` / llama3 RoPE scaling as
//! stored by llama.cpp's converter), SmolLM2, TinyLlama and Mistral-style
//! models. Gemma's RMSNorm weights are used as stored: llama.cpp's converter
//! already folds Gemma's `1 + w` into the file.

use crate::gguf::GgufFile;
use crate::kv_cache::KvPrecision;
use crate::{ModelError, Result};

/// A supported `general.architecture`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    Qwen2,
    Qwen3,
    Llama,
    Gemma3,
}

/// Whether a family's q/k/v projections carry biases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bias {
    /// Every layer has them (a file without them is malformed).
    Required,
    /// Loaded where the file has them.
    IfPresent,
}

/// The activation of the gated FFN: `act(gate) · up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnAct {
    /// SiLU (SwiGLU).
    Silu,
    /// GELU, tanh approximation (GeGLU; ggml's `gelu`).
    GeluTanh,
}

/// Which elements of a head RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// `(j, j + n_rot/2)`: GPT-NeoX style (llama.cpp `LLAMA_ROPE_TYPE_NEOX`).
    Neox,
    /// `(2j, 2j + 1)`: the original Llama style (llama.cpp
    /// `LLAMA_ROPE_TYPE_NORM`; its converter permutes q/k rows to match).
    Adjacent,
}

/// How a family differs from the plain transformer, as data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArchTraits {
    pub qkv_bias: Bias,
    /// RMSNorm over each head of q and k before RoPE (`attn_q_norm`,
    /// `attn_k_norm`, `[head_dim]`).
    pub qk_norm: bool,
    /// RMSNorm of the attention and FFN outputs before each residual add
    /// (`post_attention_norm`, `post_ffw_norm`).
    pub post_norms: bool,
    pub ffn_act: FfnAct,
    pub rope_style: RopeStyle,
    /// Token embeddings multiplied by `sqrt(d_model)`.
    pub scale_embeddings: bool,
}

impl Arch {
    /// Every supported family.
    pub const ALL: [Arch; 4] = [Arch::Qwen2, Arch::Qwen3, Arch::Llama, Arch::Gemma3];

    /// The `general.architecture` value (also the metadata key prefix).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Llama => "llama",
            Arch::Gemma3 => "gemma3",
        }
    }

    /// The family named by `general.architecture`, or an error naming the
    /// supported ones.
    pub fn from_name(name: &str) -> Result<Self> {
        Arch::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| ModelError::UnsupportedArchitecture(name.to_string()))
    }

    pub fn traits(self) -> ArchTraits {
        let plain = ArchTraits {
            qkv_bias: Bias::IfPresent,
            qk_norm: false,
            post_norms: false,
            ffn_act: FfnAct::Silu,
            rope_style: RopeStyle::Neox,
            scale_embeddings: false,
        };
        match self {
            Arch::Qwen2 => ArchTraits {
                qkv_bias: Bias::Required,
                ..plain
            },
            Arch::Qwen3 => ArchTraits {
                qk_norm: true,
                ..plain
            },
            Arch::Llama => ArchTraits {
                rope_style: RopeStyle::Adjacent,
                ..plain
            },
            Arch::Gemma3 => ArchTraits {
                qk_norm: true,
                post_norms: true,
                ffn_act: FfnAct::GeluTanh,
                scale_embeddings: true,
                ..plain
            },
        }
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// RoPE of one kind of layer: angle `pos · scale · theta^(-2j/dims) / factor_j`
/// for `j < dims / 2`.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeParams {
    /// `{arch}.rope.freq_base`.
    pub theta: f32,
    /// Linear position scaling (`1 / {arch}.rope.scaling.factor`; 1 without).
    pub scale: f32,
}

/// Local (sliding-window) attention layers, as Gemma 3 interleaves them.
#[derive(Clone, Debug, PartialEq)]
pub struct SlidingWindow {
    /// A local layer's query at position `p` attends to positions
    /// `p + 1 - window ..= p` (llama.cpp's `LLAMA_SWA_TYPE_STANDARD`).
    pub window: usize,
    /// Every `pattern`-th layer (`l % pattern == pattern - 1`) is global.
    pub pattern: usize,
    /// The local layers' RoPE.
    pub rope: RopeParams,
}

/// Hyper-parameters read from the GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layer: usize,
    pub d_model: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    /// Per-head width of q, k and v (`{arch}.attention.key_length`, else
    /// `d_model / n_head`); `n_head · head_dim` need not be `d_model`.
    pub head_dim: usize,
    pub d_ff: usize,
    /// The model's tokens: the width of the logits and the ids it takes.
    /// The embedding's trailing padding rows (tokenizer slots of type
    /// "unused", like Qwen's `[PAD151665]`…) are not part of it, so a draft
    /// and a target whose tables differ only by padding have one vocabulary.
    pub vocab: usize,
    /// Rows of `token_embd.weight` (≥ `vocab`).
    pub embd_rows: usize,
    /// The global layers' RoPE base (`{arch}.rope.freq_base`).
    pub rope_theta: f32,
    /// The global layers' linear RoPE scale.
    pub rope_scale: f32,
    /// Leading dimensions of each head that RoPE rotates
    /// (`{arch}.rope.dimension_count`, else `head_dim`).
    pub rope_dims: usize,
    pub rms_eps: f32,
    pub context_length: usize,
    /// Multiplier of `q · k` in attention.
    pub attn_scale: f32,
    pub sliding_window: Option<SlidingWindow>,
}

/// Most transformer layers a model file may declare (the largest released
/// models have ~130; the cap keeps a hostile count from sizing allocations).
pub const MAX_LAYERS: usize = 4096;

/// The largest head a model may declare (real models use ≤ 256).
pub const MAX_HEAD_DIM: usize = 1024;

impl ModelConfig {
    /// Read and validate the configuration of the model in `g`.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch = Arch::from_name(g.meta_str("general.architecture")?)?;
        let a = arch.name();
        let key = |k: &str| format!("{a}.{k}");
        let u = |k: &str| g.meta_u32(&key(k)).map(|v| v as usize);
        let opt_u = |k: &str| match g.metadata.contains_key(&key(k)) {
            true => u(k).map(Some),
            false => Ok(None),
        };
        let opt_f = |k: &str| match g.metadata.contains_key(&key(k)) {
            true => g.meta_f32(&key(k)).map(Some),
            false => Ok(None),
        };
        let bad = |reason: String| ModelError::BadGguf {
            path: g.path.clone(),
            reason,
        };
        let d_model = u("embedding_length")?;
        let n_head = u("attention.head_count")?;
        // Older llama files omit head_count_kv: it is then head_count.
        let n_kv_head = opt_u("attention.head_count_kv")?.unwrap_or(n_head);
        let head_dim = match opt_u("attention.key_length")? {
            Some(k) => k,
            None => d_model.checked_div(n_head).unwrap_or(0),
        };
        if let Some(v) = opt_u("attention.value_length")? {
            if v != head_dim {
                return Err(bad(format!(
                    "metadata `{}` is {v} but the key length is {head_dim}: \
                     different key and value widths are not supported",
                    key("attention.value_length")
                )));
            }
        }
        let embd = g.entry("token_embd.weight")?;
        let embd_rows = embd.dims.get(1).copied().unwrap_or(0);
        let vocab = model_vocab(g, embd_rows)?;
        let scaling = rope_scaling(g, &key)?;
        let rms_default = if arch == Arch::Llama { 1e-5 } else { 1e-6 };
        let sliding_window = match arch {
            Arch::Gemma3 => Some(SlidingWindow {
                window: u("attention.sliding_window")?,
                pattern: 6,
                // llama.cpp: rope_freq_base_train_swa = 10000, scale 1.
                rope: RopeParams {
                    theta: 10_000.0,
                    scale: 1.0,
                },
            }),
            _ => None,
        };
        let n_layer = u("block_count")?;
        let attn_scale = match arch {
            // llama.cpp (after gemma_pytorch): the 27B (62 layers) scales by
            // d_model / n_head, the others by the head width.
            Arch::Gemma3 if n_layer == 62 => {
                1.0 / ((d_model.checked_div(n_head).unwrap_or(1)) as f32).sqrt()
            }
            _ => 1.0 / (head_dim as f32).sqrt(),
        };
        let cfg = Self {
            arch,
            n_layer,
            d_model,
            n_head,
            n_kv_head,
            head_dim,
            d_ff: u("feed_forward_length")?,
            vocab,
            embd_rows,
            rope_theta: opt_f("rope.freq_base")?.unwrap_or(10_000.0),
            rope_scale: scaling,
            rope_dims: opt_u("rope.dimension_count")?.unwrap_or(head_dim),
            rms_eps: opt_f("attention.layer_norm_rms_epsilon")?.unwrap_or(rms_default),
            context_length: opt_u("context_length")?.unwrap_or(32768),
            attn_scale,
            sliding_window,
        };
        cfg.validate().map_err(bad)?;
        // Layers are loaded side by side into a vector of `n_layer` slots:
        // a count the file does not back would allocate before any tensor
        // is found missing.
        let present = layers_present(g);
        if cfg.n_layer > present {
            return Err(bad(format!(
                "metadata `{}` is {} but the file holds tensors for {present} layers",
                key("block_count"),
                cfg.n_layer
            )));
        }
        Ok(cfg)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        let a = self.arch.name();
        for (key, v) in [
            ("block_count", self.n_layer),
            ("embedding_length", self.d_model),
            ("attention.head_count", self.n_head),
            ("attention.head_count_kv", self.n_kv_head),
            ("attention.key_length", self.head_dim),
            ("feed_forward_length", self.d_ff),
        ] {
            if v == 0 {
                return Err(format!("metadata `{a}.{key}` is 0"));
            }
        }
        if self.n_layer > MAX_LAYERS {
            return Err(format!(
                "metadata `{a}.block_count` is {}, more than the {MAX_LAYERS} layers a model may have",
                self.n_layer
            ));
        }
        if self.head_dim > MAX_HEAD_DIM {
            return Err(format!(
                "head width {} is more than the {MAX_HEAD_DIM} a model may have",
                self.head_dim
            ));
        }
        if self.vocab == 0 {
            return Err("the vocabulary is empty".into());
        }
        let mut ropes = vec![("rope.freq_base", self.rope_theta, self.rope_scale)];
        if let Some(w) = &self.sliding_window {
            ropes.push(("local layers' rope base", w.rope.theta, w.rope.scale));
            if w.window == 0 || w.pattern == 0 {
                return Err(format!("metadata `{a}.attention.sliding_window` is 0"));
            }
        }
        for (what, theta, scale) in ropes {
            if !(theta.is_finite() && theta > 0.0 && scale.is_finite() && scale > 0.0) {
                return Err(format!(
                    "{what} is {theta} (scale {scale}); both must be positive numbers"
                ));
            }
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return Err(format!(
                "metadata `{a}.attention.layer_norm_rms_epsilon` is {}; it must be a non-negative number",
                self.rms_eps
            ));
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) {
            return Err(format!(
                "heads do not divide: n_head {} n_kv_head {}",
                self.n_head, self.n_kv_head
            ));
        }
        if self.n_head.checked_mul(self.head_dim).is_none() {
            return Err("n_head × head_dim overflows".into());
        }
        if !self.rope_dims.is_multiple_of(2)
            || self.rope_dims == 0
            || self.rope_dims > self.head_dim
        {
            return Err(format!(
                "RoPE over {} of a head's {} dimensions: it must be even and at most the head width",
                self.rope_dims, self.head_dim
            ));
        }
        Ok(())
    }

    /// Width of all query heads together (`n_head · head_dim`).
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of all key (or value) heads together.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim
    }

    /// Whether layer `l` attends through a sliding window.
    pub fn is_local(&self, l: usize) -> bool {
        self.sliding_window
            .as_ref()
            .is_some_and(|w| l % w.pattern != w.pattern - 1)
    }

    /// The positions a query at `pos` attends to in layer `l`.
    pub fn attention_span(&self, l: usize, pos: usize) -> std::ops::Range<usize> {
        match &self.sliding_window {
            Some(w) if self.is_local(l) => (pos + 1).saturating_sub(w.window)..pos + 1,
            _ => 0..pos + 1,
        }
    }

    /// K+V bytes per cached token over all layers (f32 cache).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.kv_bytes_per_token_with(KvPrecision::F32)
    }

    /// K+V bytes per cached token over all layers of a cache at `precision`.
    pub fn kv_bytes_per_token_with(&self, precision: KvPrecision) -> usize {
        precision.bytes_per_token(self.n_layer, self.n_kv_head, self.head_dim)
    }
}

/// Linear RoPE scale from `{arch}.rope.scaling.*` (1 without scaling);
/// other scaling types (YaRN, LongRoPE) are refused by name.
fn rope_scaling(g: &GgufFile, key: &dyn Fn(&str) -> String) -> Result<f32> {
    let kind = match g.metadata.get(&key("rope.scaling.type")) {
        Some(_) => g.meta_str(&key("rope.scaling.type"))?.to_string(),
        None => "none".into(),
    };
    let factor = match g.metadata.get(&key("rope.scaling.factor")) {
        Some(_) => g.meta_f32(&key("rope.scaling.factor"))?,
        None => 1.0,
    };
    match kind.as_str() {
        "none" => Ok(1.0),
        // llama3-style scaling is stored as the `rope_freqs` tensor.
        "linear" if factor.is_finite() && factor > 0.0 => Ok(1.0 / factor),
        "linear" => Err(ModelError::BadGguf {
            path: g.path.clone(),
            reason: format!("metadata `{}` is {factor}", key("rope.scaling.factor")),
        }),
        other => Err(ModelError::Unsupported(format!(
            "RoPE scaling `{other}` (supported: none, linear, and llama3 `rope_freqs`)"
        ))),
    }
}

/// The model's vocabulary: the tokenizer's tokens without trailing padding
/// slots (type 5, "unused"), at most the embedding's rows; the embedding's
/// rows when the file has no tokenizer.
fn model_vocab(g: &GgufFile, embd_rows: usize) -> Result<usize> {
    use candle_core::quantized::gguf_file::Value;
    let Some(Value::Array(types)) = g.metadata.get("tokenizer.ggml.token_type") else {
        let tokens = match g.metadata.get("tokenizer.ggml.tokens") {
            Some(Value::Array(t)) => t.len(),
            _ => embd_rows,
        };
        return Ok(tokens.min(embd_rows));
    };
    let unused = |v: &Value| matches!(v.to_i32(), Ok(5));
    let padding = types.iter().rev().take_while(|v| unused(v)).count();
    Ok((types.len() - padding).min(embd_rows))
}

/// Number of consecutive layers `blk.0.`, `blk.1.`, … that have at least one
/// tensor in `g`.
fn layers_present(g: &GgufFile) -> usize {
    let mut seen = vec![false; g.tensors.len()];
    for name in g.tensors.keys() {
        let layer = name
            .strip_prefix("blk.")
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(i, _)| i.parse::<usize>().ok());
        if let Some(slot) = layer.and_then(|i| seen.get_mut(i)) {
            *slot = true;
        }
    }
    seen.iter().take_while(|&&s| s).count()
}
