//! The Qwen2 transformer (decoder-only, GQA attention with q/k/v biases,
//! NeoX-style RoPE, RMSNorm, SwiGLU MLP), written out explicitly.
//!
//! Every step is computed row by row with the same code whatever the number of
//! rows in the block, and the quantized matmuls honour the kernel contract in
//! [`crate::quant`]; so the logits for a position are bit-identical whether it
//! is decoded alone or verified inside a block. Shapes are noted as
//! `[rows, features]`, row-major.

use crate::attention::attend;
use crate::gguf::{GgufFile, TensorEntry};
use crate::kv_cache::{KvCache, KvPrecision, KvStore};
use crate::quant::{self, QMatrix, QuantFormat};
use crate::vecops::dot;
use crate::{ModelError, Result};
use rayon::prelude::*;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// Hyper-parameters read from the GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
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

impl ModelConfig {
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
        let bad = |reason| ModelError::BadGguf {
            path: g.path.clone(),
            reason,
        };
        cfg.validate().map_err(bad)?;
        // Layers are loaded side by side into a vector of `n_layer` slots:
        // a count the file does not back would allocate before any tensor
        // is found missing.
        let present = layers_present(g);
        if cfg.n_layer > present {
            return Err(bad(format!(
                "metadata `qwen2.block_count` is {} but the file holds tensors for {present} layers",
                cfg.n_layer
            )));
        }
        Ok(cfg)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        for (key, v) in [
            ("block_count", self.n_layer),
            ("embedding_length", self.d_model),
            ("attention.head_count", self.n_head),
            ("attention.head_count_kv", self.n_kv_head),
        ] {
            if v == 0 {
                return Err(format!("metadata `qwen2.{key}` is 0"));
            }
        }
        if self.n_layer > MAX_LAYERS {
            return Err(format!(
                "metadata `qwen2.block_count` is {}, more than the {MAX_LAYERS} layers a model may have",
                self.n_layer
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(format!(
                "metadata `qwen2.rope.freq_base` is {}; it must be a positive number",
                self.rope_theta
            ));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return Err(format!(
                "metadata `qwen2.attention.layer_norm_rms_epsilon` is {}; it must be a non-negative number",
                self.rms_eps
            ));
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
        self.kv_bytes_per_token_with(KvPrecision::F32)
    }

    /// K+V bytes per cached token over all layers of a cache at `precision`.
    pub fn kv_bytes_per_token_with(&self, precision: KvPrecision) -> usize {
        precision.bytes_per_token(self.n_layer, self.n_kv_head, self.head_dim)
    }
}

/// Most transformer layers a model file may declare (the largest released
/// models have ~130; the cap keeps a hostile count from sizing allocations).
pub const MAX_LAYERS: usize = 4096;

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
    /// Maximum sequence length of caches created by [`Model::new_cache`].
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
pub struct Model {
    gguf: GgufFile,
    cfg: ModelConfig,
    opts: LoadOptions,
    embd: Weight,
    output: Weight,
    output_norm: Vec<f32>,
    layers: Vec<Layer>,
    inv_freq: Vec<f64>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("path", &self.gguf.path)
            .field("cfg", &self.cfg)
            .finish()
    }
}

impl Model {
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
        let cfg = ModelConfig::from_gguf(&gguf)?;
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

    pub fn config(&self) -> &ModelConfig {
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

    /// A fresh f32 KV cache of the configured capacity (the target's: its
    /// numerics are the reference the identity invariant rests on).
    pub fn new_cache(&self) -> KvCache {
        self.new_cache_with(KvPrecision::F32)
    }

    /// A fresh KV cache of the configured capacity at `precision`
    /// ([`KvPrecision::Int8`] is for a draft model: it changes its logits
    /// slightly, hence which tokens it proposes, never what is verified).
    pub fn new_cache_with(&self, precision: KvPrecision) -> KvCache {
        KvCache::with_precision(
            self.cfg.n_layer,
            self.cfg.n_kv_head,
            self.cfg.head_dim,
            self.opts.max_seq_len,
            precision,
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
    pub fn forward_layers<C: KvStore>(
        &self,
        range: Range<usize>,
        hidden: &mut [f32],
        start_pos: usize,
        cache: &mut C,
    ) -> Result<()> {
        let n = hidden.len() / self.cfg.d_model.max(1);
        self.forward_layers_batch(range, hidden, &mut [SeqRows::new(start_pos, n, cache)])
    }

    /// Run layers `range` over the rows of several sequences at once:
    /// `hidden` is `[Σ n_s, d]`, sequence after sequence in `seqs` order, and
    /// sequence `s`'s rows sit at positions `start_pos_s..start_pos_s + n_s`
    /// of its own cache. Every matmul runs over all rows; each row attends
    /// only to its own sequence's KV. A row's result is bit-identical to
    /// running its sequence alone (the kernel contract of [`crate::quant`]
    /// plus per-row attention, norms and RoPE).
    pub fn forward_layers_batch<C: KvStore>(
        &self,
        range: Range<usize>,
        hidden: &mut [f32],
        seqs: &mut [SeqRows<'_, C>],
    ) -> Result<()> {
        let d = self.cfg.d_model;
        if range.start > range.end || range.end > self.cfg.n_layer {
            return Err(ModelError::InvalidArgument(format!(
                "layer range {range:?} outside 0..{}",
                self.cfg.n_layer
            )));
        }
        let n: usize = seqs.iter().map(|s| s.n).sum();
        if hidden.len() != n * d || n == 0 || seqs.iter().any(|s| s.n == 0) {
            return Err(ModelError::InvalidArgument(format!(
                "hidden has {} floats for {n} rows of d_model {d} (every sequence needs a row)",
                hidden.len()
            )));
        }
        for s in seqs.iter() {
            if s.cache.n_layers() != self.cfg.n_layer {
                return Err(ModelError::InvalidArgument(
                    "KV cache was made for another model".into(),
                ));
            }
            for l in range.clone() {
                s.cache.check_append(l, s.start_pos, s.n)?;
            }
        }
        // Each row's sequence and position, and RoPE (cos, sin) per row,
        // computed once for all layers and heads.
        let rows: Vec<(usize, usize)> = seqs
            .iter()
            .enumerate()
            .flat_map(|(i, s)| (s.start_pos..s.start_pos + s.n).map(move |p| (i, p)))
            .collect();
        let rope = self.rope_table(rows.iter().map(|&(_, p)| p));
        // Run the whole layer loop on a pool thread: the ~8 parallel calls per
        // layer then split work from inside the pool instead of each injecting
        // a job and parking the calling thread until it is done.
        // (On this thread's forward pool: crate::forward_threads.)
        crate::forward_threads::run(|| {
            for l in range {
                self.layer_forward(l, hidden, &rows, &rope, seqs);
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
        crate::forward_threads::run(|| {
            quant::matmul(&self.output.view(self.bytes()), &normed, n, &mut logits)
        });
        logits
    }

    /// Logits `[n, vocab]` for every position of `tokens`, which sit at
    /// `start_pos..` (the cache must hold exactly `start_pos` positions).
    pub fn forward<C: KvStore>(
        &self,
        tokens: &[u32],
        start_pos: usize,
        cache: &mut C,
    ) -> Result<Vec<f32>> {
        self.forward_one(tokens, start_pos, cache, Logits::All)
    }

    /// Like [`forward`](Self::forward) but only the last position's logits
    /// (prefill: the head over 151,936 rows is not paid per prompt token).
    pub fn forward_last<C: KvStore>(
        &self,
        tokens: &[u32],
        start_pos: usize,
        cache: &mut C,
    ) -> Result<Vec<f32>> {
        self.forward_one(tokens, start_pos, cache, Logits::Last)
    }

    fn forward_one<C: KvStore>(
        &self,
        tokens: &[u32],
        start_pos: usize,
        cache: &mut C,
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let mut out = self.forward_batch(&mut [BatchSeq {
            tokens,
            start_pos,
            cache,
            logits,
        }])?;
        Ok(out.pop().unwrap_or_default())
    }

    /// One forward over the tokens of several sequences (verify blocks,
    /// one-token steps and prefill chunks of different sessions together).
    /// Returns each sequence's logits as it asked ([`Logits`]): the head runs
    /// only over those rows. Each sequence's logits are bit-identical to a
    /// forward of that sequence alone, whatever shares the batch.
    pub fn forward_batch<C: KvStore>(&self, seqs: &mut [BatchSeq<'_, C>]) -> Result<Vec<Vec<f32>>> {
        let mut tokens = Vec::with_capacity(seqs.iter().map(|s| s.tokens.len()).sum());
        for s in seqs.iter() {
            if s.tokens.is_empty() {
                return Err(ModelError::InvalidArgument("no tokens to run".into()));
            }
            tokens.extend_from_slice(s.tokens);
        }
        let mut h = self.embed(&tokens)?;
        let mut rows: Vec<SeqRows<'_, C>> = seqs
            .iter_mut()
            .map(|s| SeqRows::new(s.start_pos, s.tokens.len(), &mut *s.cache))
            .collect();
        self.forward_layers_batch(0..self.cfg.n_layer, &mut h, &mut rows)?;
        // Gather the rows whose logits are wanted; one head call over them.
        let d = self.cfg.d_model;
        let mut wanted = Vec::new();
        let mut r0 = 0;
        for s in seqs.iter() {
            let r = s.logits.rows(s.tokens.len());
            wanted.extend_from_slice(&h[(r0 + r.start) * d..(r0 + r.end) * d]);
            r0 += s.tokens.len();
        }
        let mut logits = if wanted.is_empty() {
            Vec::new()
        } else {
            self.head(&wanted)
        };
        // Split the logits per sequence from the back: the first sequence
        // keeps the head's buffer (a single sequence is never copied).
        let vocab = self.cfg.vocab;
        let mut out = Vec::with_capacity(seqs.len());
        for (i, s) in seqs.iter().enumerate().rev() {
            out.push(if i == 0 {
                std::mem::take(&mut logits)
            } else {
                let rows = s.logits.rows(s.tokens.len()).len();
                logits.split_off(logits.len() - rows * vocab)
            });
        }
        out.reverse();
        Ok(out)
    }

    /// Layer `l` over the rows of `seqs` (`rows[i]` = row i's sequence and
    /// position; `rope` its (cos, sin) table, `[rows, head_dim / 2]`).
    fn layer_forward<C: KvStore>(
        &self,
        l: usize,
        hidden: &mut [f32],
        rows: &[(usize, usize)],
        rope: &[(f32, f32)],
        seqs: &mut [SeqRows<'_, C>],
    ) {
        let n = rows.len();
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
        let mut r0 = 0;
        for s in seqs.iter_mut() {
            let span = r0 * kvd..(r0 + s.n) * kvd;
            s.cache.append(l, s.start_pos, &k[span.clone()], &v[span]);
            r0 += s.n;
        }
        let caches: Vec<&C> = seqs.iter().map(|s| &*s.cache).collect();
        let mut attn = vec![0f32; n * d];
        let group = cfg.n_head / cfg.n_kv_head;
        let scale = 1.0 / (hd as f32).sqrt();
        // One task per (row, head): each output is computed by exactly one
        // task with a fixed loop order over its own sequence's positions,
        // independent of the other rows.
        attn.par_chunks_mut(hd).enumerate().for_each(|(idx, out)| {
            let (i, h) = (idx / cfg.n_head, idx % cfg.n_head);
            let (seq, pos) = rows[i];
            let g = h / group;
            let qh = &q[i * d + h * hd..i * d + (h + 1) * hd];
            attend(qh, caches[seq], l, 0..pos + 1, g * hd, hd, scale, out);
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

    /// `(cos, sin)` of `pos * inv_freq[j]` for each position
    /// (`[positions, head_dim / 2]`); angles in f64, the same whatever the block.
    fn rope_table(&self, positions: impl Iterator<Item = usize>) -> Vec<(f32, f32)> {
        positions
            .flat_map(|pos| {
                self.inv_freq.iter().map(move |f| {
                    let (s, c) = (pos as f64 * f).sin_cos();
                    (c as f32, s as f32)
                })
            })
            .collect()
    }
}

/// Which logits a sequence of [`Model::forward_batch`] wants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Every row's (a verify block).
    All,
    /// The last row's (the end of a prefill, a one-token step).
    Last,
    /// None (a prefill chunk that is not the last).
    None,
}

impl Logits {
    /// Which of a sequence's `n` rows (`n ≥ 1`) get logits.
    fn rows(self, n: usize) -> Range<usize> {
        match self {
            Logits::All => 0..n,
            Logits::Last => n - 1..n,
            Logits::None => n..n,
        }
    }
}

/// One sequence of a [`Model::forward_batch`]: its tokens, where they
/// start, its KV and which logits it wants.
pub struct BatchSeq<'a, C: KvStore> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub cache: &'a mut C,
    pub logits: Logits,
}

/// One sequence's rows in [`Model::forward_layers_batch`]: `n` rows at
/// positions `start_pos..start_pos + n` of `cache`.
pub struct SeqRows<'a, C: KvStore> {
    pub start_pos: usize,
    pub n: usize,
    pub cache: &'a mut C,
}

impl<'a, C: KvStore> SeqRows<'a, C> {
    pub fn new(start_pos: usize, n: usize, cache: &'a mut C) -> Self {
        Self {
            start_pos,
            n,
            cache,
        }
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
