//! The Qwen2 transformer (decoder-only, GQA attention with q/k/v biases,
//! NeoX-style RoPE, RMSNorm, SwiGLU MLP), written out explicitly.
//!
//! Every step is computed row by row with the same code whatever the number of
//! rows in the block, and the quantized matmuls honour the kernel contract in
//! [`crate::quant`]; so the logits for a position are bit-identical whether it
//! is decoded alone or verified inside a block. Shapes are noted as
//! `[rows, features]`, row-major.

use crate::gguf::{GgufFile, TensorEntry};
use crate::kv_cache::KvCache;
use crate::quant::{self, QMatrix, QuantFormat};
use crate::vecops::{axpy, dot};
use crate::{ModelError, Result};
use rayon::prelude::*;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// Hyper-parameters read from the GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen2Config {
    pub n_layer: usize,
    pub d_model: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub d_ff: usize,
    pub vocab: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub context_length: usize,
}

impl Qwen2Config {
    fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch = g.meta_str("general.architecture")?;
        if arch != "qwen2" {
            return Err(ModelError::UnsupportedArchitecture(arch.to_string()));
        }
        let u = |k: &str| g.meta_u32(&format!("qwen2.{k}")).map(|v| v as usize);
        let d_model = u("embedding_length")?;
        let n_head = u("attention.head_count")?;
        let n_kv_head = u("attention.head_count_kv")?;
        let embd = g.entry("token_embd.weight")?;
        let cfg = Self {
            n_layer: u("block_count")?,
            d_model,
            n_head,
            n_kv_head,
            head_dim: d_model.checked_div(n_head).unwrap_or(0),
            d_ff: u("feed_forward_length")?,
            vocab: embd.dims.get(1).copied().unwrap_or(0),
            rope_theta: g.meta_f32("qwen2.rope.freq_base").unwrap_or(10_000.0),
            rms_eps: g
                .meta_f32("qwen2.attention.layer_norm_rms_epsilon")
                .unwrap_or(1e-6),
            context_length: u("context_length").unwrap_or(32768),
        };
        cfg.validate().map_err(|reason| ModelError::BadGguf {
            path: g.path.clone(),
            reason,
        })?;
        Ok(cfg)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.n_layer == 0 || self.d_model == 0 || self.n_head == 0 || self.n_kv_head == 0 {
            return Err(format!("degenerate config {self:?}"));
        }
        if !self.d_model.is_multiple_of(self.n_head) || !self.n_head.is_multiple_of(self.n_kv_head)
        {
            return Err(format!(
                "heads do not divide: d_model {} n_head {} n_kv_head {}",
                self.d_model, self.n_head, self.n_kv_head
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {} must be even for RoPE", self.head_dim));
        }
        Ok(())
    }

    /// K+V bytes per cached token over all layers (f32 cache).
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.n_layer * self.n_kv_head * self.head_dim * 4
    }
}

/// Where a weight matrix's bytes are.
#[derive(Clone, Debug)]
enum WeightBytes {
    /// In the mapped file.
    Mapped { offset: usize, len: usize },
    /// Converted at load time ([`LoadOptions::repack`]); the mapped original
    /// is never touched, so it is not resident either.
    Owned(Arc<Vec<u8>>),
}

/// A weight matrix.
#[derive(Clone, Debug)]
struct Weight {
    format: QuantFormat,
    rows: usize,
    cols: usize,
    bytes: WeightBytes,
}

impl Weight {
    fn from_entry(name: &str, e: &TensorEntry, rows: usize, cols: usize) -> Result<Self> {
        if e.dims.len() != 2 || e.dims[0] != cols || e.dims[1] != rows {
            return Err(ModelError::BadTensor {
                name: name.into(),
                reason: format!("expected [{rows}, {cols}], got dims {:?}", e.dims),
            });
        }
        Ok(Self {
            format: e.format,
            rows,
            cols,
            bytes: WeightBytes::Mapped {
                offset: e.offset,
                len: e.len,
            },
        })
    }

    /// A layer matrix, regrouped into [`QuantFormat::Q5_0x4`] when `repack`
    /// is set and it is a Q5_0 matrix of whole groups (results are
    /// bit-identical either way; only the speed differs).
    fn layer_matrix(
        gguf: &GgufFile,
        name: &str,
        rows: usize,
        cols: usize,
        repack: bool,
    ) -> Result<Self> {
        let e = gguf.entry(name)?;
        let w = Self::from_entry(name, e, rows, cols)?;
        if !repack || !quant::can_regroup(w.format, cols) {
            return Ok(w);
        }
        // Read into memory and regrouped in place: one copy, and the mapped
        // pages are never touched (not resident).
        let mut bytes = gguf.read_tensor(e)?;
        quant::repack_q5_0x4_in_place(&mut bytes, rows, cols).map_err(|err| {
            ModelError::BadTensor {
                name: name.into(),
                reason: err.to_string(),
            }
        })?;
        Ok(Self {
            format: QuantFormat::Q5_0x4,
            bytes: WeightBytes::Owned(Arc::new(bytes)),
            ..w
        })
    }

    fn view<'a>(&'a self, mapped: &'a [u8]) -> QMatrix<'a> {
        let data = match &self.bytes {
            WeightBytes::Mapped { offset, len } => &mapped[*offset..*offset + *len],
            WeightBytes::Owned(b) => b,
        };
        QMatrix {
            format: self.format,
            rows: self.rows,
            cols: self.cols,
            data,
        }
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    wq: Weight,
    bq: Vec<f32>,
    wk: Weight,
    bk: Vec<f32>,
    wv: Weight,
    bv: Vec<f32>,
    wo: Weight,
    ffn_norm: Vec<f32>,
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
}

/// Options for loading a model.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Maximum sequence length of caches created by [`Qwen2Model::new_cache`].
    pub max_seq_len: usize,
    /// Regroup the layers' Q5_0 matrices into [`QuantFormat::Q5_0x4`] at load
    /// time (read from the file into memory instead of mapped; same size,
    /// bit-identical results). Default: where it is faster
    /// ([`quant::repack_pays`] for the selected instruction set).
    pub repack: bool,
}

impl LoadOptions {
    /// Default options with this sequence cap.
    pub fn with_max_seq_len(max_seq_len: usize) -> Self {
        Self {
            max_seq_len,
            ..Self::default()
        }
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            max_seq_len: 4096,
            repack: quant::repack_pays(quant::Isa::selected()),
        }
    }
}

/// A loaded Qwen2 model: weights stay in the memory-mapped GGUF, except
/// matrices regrouped at load time ([`LoadOptions::repack`]), which replace
/// their mapped originals.
pub struct Qwen2Model {
    gguf: GgufFile,
    cfg: Qwen2Config,
    opts: LoadOptions,
    embd: Weight,
    output: Weight,
    output_norm: Vec<f32>,
    layers: Vec<Layer>,
    inv_freq: Vec<f64>,
}

impl std::fmt::Debug for Qwen2Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qwen2Model")
            .field("path", &self.gguf.path)
            .field("cfg", &self.cfg)
            .finish()
    }
}

impl Qwen2Model {
    /// Open a GGUF file and map its weights (no copies; only norms, biases
    /// and the matrices regrouped by [`LoadOptions::repack`] are read into
    /// memory).
    pub fn load(path: impl AsRef<Path>, opts: LoadOptions) -> Result<Self> {
        let gguf = GgufFile::open(path)?;
        Self::from_gguf(gguf, opts)
    }

    pub fn from_gguf(gguf: GgufFile, opts: LoadOptions) -> Result<Self> {
        if opts.max_seq_len == 0 {
            return Err(ModelError::InvalidArgument(
                "max_seq_len must be at least 1".into(),
            ));
        }
        let cfg = Qwen2Config::from_gguf(&gguf)?;
        let (d, hd) = (cfg.d_model, cfg.head_dim);
        let kvd = cfg.n_kv_head * hd;
        let w = |name: &str, rows: usize, cols: usize| -> Result<Weight> {
            Weight::from_entry(name, gguf.entry(name)?, rows, cols)
        };
        let lw = |name: &str, rows: usize, cols: usize| -> Result<Weight> {
            Weight::layer_matrix(&gguf, name, rows, cols, opts.repack)
        };
        let embd = w("token_embd.weight", cfg.vocab, d)?;
        let output = if gguf.tensors.contains_key("output.weight") {
            w("output.weight", cfg.vocab, d)?
        } else {
            embd.clone() // tied embeddings
        };
        let output_norm = gguf.vector_f32("output_norm.weight", d)?;
        // Layers load in parallel (regrouping reads and converts ~7 MB per
        // draft layer); the first error in layer order is the one reported.
        let layers: Vec<Result<Layer>> = (0..cfg.n_layer)
            .into_par_iter()
            .map(|i| {
                let p = |s: &str| format!("blk.{i}.{s}");
                Ok(Layer {
                    attn_norm: gguf.vector_f32(&p("attn_norm.weight"), d)?,
                    wq: lw(&p("attn_q.weight"), d, d)?,
                    bq: gguf.vector_f32(&p("attn_q.bias"), d)?,
                    wk: lw(&p("attn_k.weight"), kvd, d)?,
                    bk: gguf.vector_f32(&p("attn_k.bias"), kvd)?,
                    wv: lw(&p("attn_v.weight"), kvd, d)?,
                    bv: gguf.vector_f32(&p("attn_v.bias"), kvd)?,
                    wo: lw(&p("attn_output.weight"), d, d)?,
                    ffn_norm: gguf.vector_f32(&p("ffn_norm.weight"), d)?,
                    w_gate: lw(&p("ffn_gate.weight"), cfg.d_ff, d)?,
                    w_up: lw(&p("ffn_up.weight"), cfg.d_ff, d)?,
                    w_down: lw(&p("ffn_down.weight"), d, cfg.d_ff)?,
                })
            })
            .collect();
        let layers = layers.into_iter().collect::<Result<Vec<_>>>()?;
        let inv_freq = (0..hd / 2)
            .map(|j| 1.0 / (cfg.rope_theta as f64).powf(2.0 * j as f64 / hd as f64))
            .collect();
        let model = Self {
            gguf,
            cfg,
            opts,
            embd,
            output,
            output_norm,
            layers,
            inv_freq,
        };
        let (n, bytes) = model.regrouped();
        if n > 0 {
            tracing::debug!(matrices = n, bytes, "regrouped Q5_0 matrices into Q5_0x4");
        }
        Ok(model)
    }

    pub fn config(&self) -> &Qwen2Config {
        &self.cfg
    }

    pub fn gguf(&self) -> &GgufFile {
        &self.gguf
    }

    pub fn max_seq_len(&self) -> usize {
        self.opts.max_seq_len
    }

    /// How many matrices were regrouped at load time ([`LoadOptions::repack`])
    /// and their bytes (held in memory instead of mapped).
    pub fn regrouped(&self) -> (usize, usize) {
        self.layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .filter_map(|w| match &w.bytes {
                WeightBytes::Owned(b) => Some(b.len()),
                WeightBytes::Mapped { .. } => None,
            })
            .fold((0, 0), |(n, bytes), len| (n + 1, bytes + len))
    }

    /// A fresh KV cache of the configured capacity.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(
            self.cfg.n_layer,
            self.cfg.n_kv_head,
            self.cfg.head_dim,
            self.opts.max_seq_len,
        )
    }

    fn bytes(&self) -> &[u8] {
        self.gguf.bytes()
    }

    /// Token embeddings `[n, d]`: rows are dequantized on lookup, the table is
    /// never expanded.
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let d = self.cfg.d_model;
        let table = self.embd.view(self.bytes());
        let mut out = vec![0f32; tokens.len() * d];
        for (t, row) in tokens.iter().zip(out.chunks_exact_mut(d)) {
            if *t as usize >= self.cfg.vocab {
                return Err(ModelError::TokenOutOfRange {
                    id: *t,
                    vocab: self.cfg.vocab,
                });
            }
            table.dequantize_row(*t as usize, row);
        }
        Ok(out)
    }

    /// Run layers `range` over `hidden` (`[n, d]`, updated in place) for
    /// positions `start_pos..start_pos + n`, appending to `cache`.
    pub fn forward_layers(
        &self,
        range: Range<usize>,
        hidden: &mut [f32],
        start_pos: usize,
        cache: &mut KvCache,
    ) -> Result<()> {
        let d = self.cfg.d_model;
        if range.start > range.end || range.end > self.cfg.n_layer {
            return Err(ModelError::InvalidArgument(format!(
                "layer range {range:?} outside 0..{}",
                self.cfg.n_layer
            )));
        }
        if !hidden.len().is_multiple_of(d) || hidden.is_empty() {
            return Err(ModelError::InvalidArgument(format!(
                "hidden has {} floats, not a positive multiple of d_model {d}",
                hidden.len()
            )));
        }
        if cache.n_layers() != self.cfg.n_layer {
            return Err(ModelError::InvalidArgument(
                "KV cache was made for another model".into(),
            ));
        }
        let n = hidden.len() / d;
        for l in range.clone() {
            cache.check_append(l, start_pos, n)?;
        }
        // RoPE (cos, sin) per position, computed once for all layers and heads.
        let rope = self.rope_table(start_pos, n);
        // Run the whole layer loop on a pool thread: the ~8 parallel calls per
        // layer then split work from inside the pool instead of each injecting
        // a job and parking the calling thread until it is done.
        rayon::scope(|_| {
            for l in range {
                self.layer_forward(l, hidden, n, start_pos, &rope, cache);
            }
        });
        Ok(())
    }

    /// Final norm + output head: logits `[n, vocab]` for `hidden` `[n, d]`.
    pub fn head(&self, hidden: &[f32]) -> Vec<f32> {
        let d = self.cfg.d_model;
        let n = hidden.len() / d;
        let mut normed = vec![0f32; hidden.len()];
        rms_norm(hidden, &self.output_norm, self.cfg.rms_eps, &mut normed);
        let mut logits = vec![0f32; n * self.cfg.vocab];
        quant::matmul(&self.output.view(self.bytes()), &normed, n, &mut logits);
        logits
    }

    /// Logits `[n, vocab]` for every position of `tokens`, which sit at
    /// `start_pos..` (the cache must hold exactly `start_pos` positions).
    pub fn forward(
        &self,
        tokens: &[u32],
        start_pos: usize,
        cache: &mut KvCache,
    ) -> Result<Vec<f32>> {
        let mut h = self.embed_checked(tokens)?;
        self.forward_layers(0..self.cfg.n_layer, &mut h, start_pos, cache)?;
        Ok(self.head(&h))
    }

    /// Like [`forward`](Self::forward) but only the last position's logits
    /// (prefill: the head over 151,936 rows is not paid per prompt token).
    pub fn forward_last(
        &self,
        tokens: &[u32],
        start_pos: usize,
        cache: &mut KvCache,
    ) -> Result<Vec<f32>> {
        let mut h = self.embed_checked(tokens)?;
        self.forward_layers(0..self.cfg.n_layer, &mut h, start_pos, cache)?;
        let d = self.cfg.d_model;
        Ok(self.head(&h[h.len() - d..]))
    }

    fn embed_checked(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(ModelError::InvalidArgument("no tokens to run".into()));
        }
        self.embed(tokens)
    }

    fn layer_forward(
        &self,
        l: usize,
        hidden: &mut [f32],
        n: usize,
        start_pos: usize,
        rope: &[(f32, f32)],
        cache: &mut KvCache,
    ) {
        let cfg = &self.cfg;
        let (d, hd) = (cfg.d_model, cfg.head_dim);
        let kvd = cfg.n_kv_head * hd;
        let layer = &self.layers[l];
        let bytes = self.bytes();

        // Attention block.
        let mut x = vec![0f32; n * d];
        rms_norm(hidden, &layer.attn_norm, cfg.rms_eps, &mut x);
        let mut q = vec![0f32; n * d];
        let mut k = vec![0f32; n * kvd];
        let mut v = vec![0f32; n * kvd];
        quant::matmul_shared(
            &mut [
                (&layer.wq.view(bytes), &mut q),
                (&layer.wk.view(bytes), &mut k),
                (&layer.wv.view(bytes), &mut v),
            ],
            &x,
            n,
        );
        add_bias(&mut q, &layer.bq);
        add_bias(&mut k, &layer.bk);
        add_bias(&mut v, &layer.bv);
        let half = hd / 2;
        for i in 0..n {
            let table = &rope[i * half..(i + 1) * half];
            apply_rope(&mut q[i * d..(i + 1) * d], hd, table);
            apply_rope(&mut k[i * kvd..(i + 1) * kvd], hd, table);
        }
        cache.append(l, start_pos, &k, &v);
        let total = start_pos + n;
        let (kc, vc) = cache.layer(l, total);
        let mut attn = vec![0f32; n * d];
        let group = cfg.n_head / cfg.n_kv_head;
        let scale = 1.0 / (hd as f32).sqrt();
        // One task per (position, head): each output is computed by exactly one
        // task with a fixed loop order, independent of n.
        attn.par_chunks_mut(hd).enumerate().for_each(|(idx, out)| {
            let (i, h) = (idx / cfg.n_head, idx % cfg.n_head);
            let g = h / group;
            let qh = &q[i * d + h * hd..i * d + (h + 1) * hd];
            let ctx = start_pos + i + 1;
            attend(qh, kc, vc, ctx, kvd, g * hd, hd, scale, out);
        });
        let mut o = vec![0f32; n * d];
        quant::matmul(&layer.wo.view(bytes), &attn, n, &mut o);
        add_in_place(hidden, &o);

        // MLP block.
        rms_norm(hidden, &layer.ffn_norm, cfg.rms_eps, &mut x);
        let mut gate = vec![0f32; n * cfg.d_ff];
        let mut up = vec![0f32; n * cfg.d_ff];
        quant::matmul_shared(
            &mut [
                (&layer.w_gate.view(bytes), &mut gate),
                (&layer.w_up.view(bytes), &mut up),
            ],
            &x,
            n,
        );
        swiglu(&mut gate, &up);
        quant::matmul(&layer.w_down.view(bytes), &gate, n, &mut o);
        add_in_place(hidden, &o);
    }

    /// `(cos, sin)` of `pos * inv_freq[j]` for positions `start_pos..start_pos + n`
    /// (`[n, head_dim / 2]`); angles in f64, the same whatever the block.
    fn rope_table(&self, start_pos: usize, n: usize) -> Vec<(f32, f32)> {
        (start_pos..start_pos + n)
            .flat_map(|pos| {
                self.inv_freq.iter().map(move |f| {
                    let (s, c) = (pos as f64 * f).sin_cos();
                    (c as f32, s as f32)
                })
            })
            .collect()
    }
}

/// NeoX-style rotary embedding over each head of `x` (`[heads * head_dim]`)
/// with one position's `(cos, sin)` table.
fn apply_rope(x: &mut [f32], hd: usize, table: &[(f32, f32)]) {
    let half = hd / 2;
    for head in x.chunks_exact_mut(hd) {
        for (j, &(c, s)) in table.iter().enumerate() {
            let (a, b) = (head[j], head[j + half]);
            head[j] = a * c - b * s;
            head[j + half] = a * s + b * c;
        }
    }
}

/// Causal attention of one query head over `ctx` cached positions.
#[allow(clippy::too_many_arguments)]
fn attend(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    ctx: usize,
    stride: usize,
    off: usize,
    hd: usize,
    scale: f32,
    out: &mut [f32],
) {
    let mut scores = vec![0f32; ctx];
    let mut max = f32::NEG_INFINITY;
    for (t, s) in scores.iter_mut().enumerate() {
        let kr = &kc[t * stride + off..t * stride + off + hd];
        *s = dot(q, kr) * scale;
        max = max.max(*s);
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    out.fill(0.0);
    for (t, s) in scores.iter().enumerate() {
        let w = s * inv;
        let vr = &vc[t * stride + off..t * stride + off + hd];
        axpy(out, w, vr);
    }
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss = dot(xr, xr);
        let scale = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, xv), wv) in or.iter_mut().zip(xr).zip(w) {
            *o = xv * scale * wv;
        }
    }
}

fn add_bias(x: &mut [f32], b: &[f32]) {
    for row in x.chunks_exact_mut(b.len()) {
        add_in_place(row, b);
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Elements per task of [`swiglu`]; a one-token step (4,864 or 8,960 values)
/// stays on the calling thread.
const SWIGLU_CHUNK: usize = 16 * 1024;

/// `gate = silu(gate) · up`, element by element (so any split gives the same
/// bits). A 17-token verify of the 1.5B has 152k values per layer; its `exp`
/// was ~1.3 % of that forward's samples when done on one thread.
fn swiglu(gate: &mut [f32], up: &[f32]) {
    let f = |(g, u): (&mut [f32], &[f32])| {
        for (g, u) in g.iter_mut().zip(u) {
            *g = silu(*g) * u;
        }
    };
    if gate.len() <= SWIGLU_CHUNK {
        f((gate, up));
    } else {
        gate.par_chunks_mut(SWIGLU_CHUNK)
            .zip(up.par_chunks(SWIGLU_CHUNK))
            .for_each(f);
    }
}
