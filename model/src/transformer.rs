//! The decoder-only transformer of every supported family (Qwen2, Qwen3,
//! Llama, Gemma 3: GQA attention with RoPE, RMSNorm, a gated FFN), written
//! out explicitly. The families' differences are data ([`crate::arch`]) and
//! a few clear branches in [`Model::layer_forward`], not copies of the layer.
//!
//! Every step is computed row by row with the same code whatever the number of
//! rows in the block, and the quantized matmuls honour the kernel contract in
//! [`crate::quant`]; so the logits for a position are bit-identical whether it
//! is decoded alone or verified inside a block. Shapes are noted as
//! `[rows, features]`, row-major.

pub use crate::arch::{Arch, ModelConfig, MAX_LAYERS};
use crate::arch::{Bias, FfnAct, RopeParams, RopeStyle};
use crate::attention::attend;
use crate::expf::exp_in_place;
use crate::gelu;
use crate::gguf::{GgufFile, TensorEntry};
use crate::kv_cache::{KvCache, KvPrecision, KvStore};
use crate::quant::{self, QMatrix, QuantFormat};
use crate::vecops::dot;
use crate::{ModelError, Result};
use rayon::prelude::*;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

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
    /// The tile layout ([`LoadOptions::tiles`]): with it the kernels read
    /// only the layout (AMX tiles, or VNNI sums below the AMX thresholds),
    /// and the file's bytes only for rows past the last group of 16.
    tiles: Option<Arc<Vec<u8>>>,
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
            tiles: None,
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
            tiles: self.tiles.as_deref().map(Vec::as_slice),
        }
    }

    /// This weight with its tile layout when `on` and its format has one.
    /// Built from the mapped bytes, whose pages are then released: the
    /// kernels read the layout only ([`quant::build_tile_layout`]; rows
    /// past the last group of 16 fault their pages back in).
    fn with_tiles(mut self, on: bool, gguf: &GgufFile) -> Self {
        if on {
            self.tiles = quant::build_tile_layout(&self.view(gguf.bytes())).map(Arc::new);
            if let (Some(_), WeightBytes::Mapped { offset, len }) = (&self.tiles, &self.bytes) {
                gguf.release(*offset, *len);
            }
        }
        self
    }
}

/// One layer's weights. Optional parts are present as the family's
/// [`crate::arch::ArchTraits`] say (and biases where the file has them).
struct Layer {
    attn_norm: Vec<f32>,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    /// q, k, v biases (all three or none).
    qkv_bias: Option<[Vec<f32>; 3]>,
    /// Per-head RMSNorm weights of q and k (`[head_dim]` each).
    qk_norm: Option<[Vec<f32>; 2]>,
    wo: Weight,
    /// RMSNorm of the attention output before its residual add.
    post_attn_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
    /// RMSNorm of the FFN output before its residual add.
    post_ffn_norm: Option<Vec<f32>>,
    /// Which of [`Model::ropes`] this layer uses.
    rope: usize,
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
    /// Hold the Q4_K/Q5_K/Q6_K matrices in the tile layout
    /// ([`quant::build_tile_layout`]) for the AMX kernels and their VNNI
    /// side: read into memory at load (about the file's bytes; the file's
    /// pages are released, [`GgufFile::release`]). Default: when the
    /// selected instruction set is AMX ([`quant::tiles_pay`]).
    pub tiles: bool,
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
            tiles: quant::tiles_pay(quant::Isa::selected()),
        }
    }
}

/// A loaded model of any supported family: weights stay in the memory-mapped GGUF, except
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
    /// Per RoPE kind (global, then local layers'): the angle per position
    /// step of each rotated pair, `[rope_dims / 2]`.
    ropes: Vec<Vec<f64>>,
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
        let traits = cfg.arch.traits();
        let (d, hd) = (cfg.d_model, cfg.head_dim);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let w = |name: &str, rows: usize, cols: usize| -> Result<Weight> {
            Weight::from_entry(name, gguf.entry(name)?, rows, cols)
        };
        let lw = |name: &str, rows: usize, cols: usize| -> Result<Weight> {
            Ok(Weight::layer_matrix(&gguf, name, rows, cols, opts.repack)?
                .with_tiles(opts.tiles, &gguf))
        };
        let has = |name: &str| gguf.tensors.contains_key(name);
        // The table keeps all its rows (padding included); the logits cover
        // the model's vocabulary only (`cfg.vocab` ≤ `cfg.embd_rows`).
        let embd = w("token_embd.weight", cfg.embd_rows, d)?;
        let output = (if has("output.weight") {
            let out = gguf.entry("output.weight")?;
            let rows = out.dims.get(1).copied().unwrap_or(0);
            if rows < cfg.vocab {
                return Err(ModelError::BadTensor {
                    name: "output.weight".into(),
                    reason: format!("{rows} rows for a vocabulary of {}", cfg.vocab),
                });
            }
            w("output.weight", rows, d)?
        } else {
            embd.clone() // tied embeddings
        })
        .with_tiles(opts.tiles, &gguf);
        let output_norm = gguf.vector_f32("output_norm.weight", d)?;
        // Layers load in parallel (regrouping reads and converts ~7 MB per
        // draft layer); the first error in layer order is the one reported.
        let layers: Vec<Result<Layer>> = (0..cfg.n_layer)
            .into_par_iter()
            .map(|i| {
                let p = |s: &str| format!("blk.{i}.{s}");
                let v = |s: &str, len: usize| gguf.vector_f32(&p(s), len);
                let opt_v = |s: &str, len: usize, on: bool| -> Result<Option<Vec<f32>>> {
                    on.then(|| v(s, len)).transpose()
                };
                let bias = match traits.qkv_bias {
                    Bias::Required => true,
                    Bias::IfPresent => has(&p("attn_q.bias")),
                };
                Ok(Layer {
                    attn_norm: v("attn_norm.weight", d)?,
                    wq: lw(&p("attn_q.weight"), qd, d)?,
                    wk: lw(&p("attn_k.weight"), kvd, d)?,
                    wv: lw(&p("attn_v.weight"), kvd, d)?,
                    qkv_bias: match bias {
                        true => Some([
                            v("attn_q.bias", qd)?,
                            v("attn_k.bias", kvd)?,
                            v("attn_v.bias", kvd)?,
                        ]),
                        false => None,
                    },
                    qk_norm: match traits.qk_norm {
                        true => Some([v("attn_q_norm.weight", hd)?, v("attn_k_norm.weight", hd)?]),
                        false => None,
                    },
                    wo: lw(&p("attn_output.weight"), d, qd)?,
                    post_attn_norm: opt_v("post_attention_norm.weight", d, traits.post_norms)?,
                    ffn_norm: v("ffn_norm.weight", d)?,
                    w_gate: lw(&p("ffn_gate.weight"), cfg.d_ff, d)?,
                    w_up: lw(&p("ffn_up.weight"), cfg.d_ff, d)?,
                    w_down: lw(&p("ffn_down.weight"), d, cfg.d_ff)?,
                    post_ffn_norm: opt_v("post_ffw_norm.weight", d, traits.post_norms)?,
                    rope: usize::from(cfg.is_local(i)),
                })
            })
            .collect();
        let layers = layers.into_iter().collect::<Result<Vec<_>>>()?;
        // llama3-style RoPE scaling: one divisor per rotated pair.
        let factors = match has("rope_freqs.weight") {
            true => Some(gguf.vector_f32("rope_freqs.weight", cfg.rope_dims / 2)?),
            false => None,
        };
        let global = RopeParams {
            theta: cfg.rope_theta,
            scale: cfg.rope_scale,
        };
        let mut ropes = vec![rope_steps(&global, cfg.rope_dims, factors.as_deref())];
        if let Some(w) = &cfg.sliding_window {
            ropes.push(rope_steps(&w.rope, cfg.rope_dims, None));
        }
        let model = Self {
            gguf,
            cfg,
            opts,
            embd,
            output,
            output_norm,
            layers,
            ropes,
        };
        let (n, bytes) = model.regrouped();
        if n > 0 {
            tracing::debug!(matrices = n, bytes, "regrouped Q5_0 matrices into Q5_0x4");
        }
        let tile_bytes = model.tile_bytes();
        if tile_bytes > 0 {
            tracing::debug!(
                bytes = tile_bytes,
                "Q4_K/Q5_K/Q6_K matrices held in the tile layout"
            );
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

    /// Bytes held in the tile layout ([`LoadOptions::tiles`]).
    pub fn tile_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .chain([&self.output])
            .filter_map(|w| w.tiles.as_ref().map(|t| t.len()))
            .sum()
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
        if self.cfg.arch.traits().scale_embeddings {
            // Gemma: embeddings × sqrt(d_model), in f32 as llama.cpp does.
            let scale = (d as f32).sqrt();
            out.iter_mut().for_each(|x| *x *= scale);
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
        let (rows, rope) = self.row_tables(seqs);
        // Run the whole layer loop on a pool thread: the ~8 parallel calls per
        // layer then split work from inside the pool instead of each injecting
        // a job and parking the calling thread until it is done.
        // (On this thread's forward pool: crate::forward_threads.)
        let mut scratch = LayerScratch::default();
        crate::forward_threads::run(|| {
            for l in range {
                self.layer_forward(l, hidden, &rows, &rope, seqs, &mut scratch);
            }
        });
        Ok(())
    }

    /// Final norm + output head: logits `[n, vocab]` for `hidden` `[n, d]`.
    pub fn head(&self, hidden: &[f32]) -> Vec<f32> {
        let (mut normed, mut logits) = (Vec::new(), Vec::new());
        self.head_into(hidden, &mut normed, &mut logits);
        logits
    }

    /// [`Self::head`] into `logits` (resized to `[n, vocab]`), with `normed`
    /// as the normed rows' buffer: a caller that keeps both allocates nothing
    /// once they have held its largest batch.
    fn head_into(&self, hidden: &[f32], normed: &mut Vec<f32>, logits: &mut Vec<f32>) {
        let d = self.cfg.d_model;
        let n = hidden.len() / d;
        normed.resize(hidden.len(), 0.0);
        rms_norm(hidden, &self.output_norm, self.cfg.rms_eps, normed);
        logits.resize(n * self.cfg.vocab, 0.0);
        let output = self.output.view(self.bytes());
        // The model's vocabulary only: trailing padding rows get no logits.
        let output = QMatrix {
            rows: self.cfg.vocab,
            data: &output.data[..output.data.len() / output.rows.max(1) * self.cfg.vocab],
            // Units are in row order: the first groups' are a prefix.
            tiles: output.tiles.map(|t| {
                let len = quant::tile_layout_bytes(output.format, self.cfg.vocab, output.cols);
                &t[..len.unwrap_or(0).min(t.len())]
            }),
            ..output
        };
        crate::forward_threads::run(|| quant::matmul(&output, normed, n, logits));
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
        self.forward_batch_joined(seqs, &mut [])
    }

    /// [`Self::forward_batch`] with sequences of hidden states that join the
    /// forward at a later layer (a split session's prefill chunk: the device
    /// ran layers `[0, s)`). `joins` are sorted by their layer here; their
    /// rows run layers `[layer, N)` beside the token rows (every matmul of a
    /// layer over all rows that have reached it) and give no logits: their
    /// output rows are dropped. The logits are `seqs`' only. A row's result is
    /// bit-identical to running its sequence alone
    /// ([`Self::forward_layers`] for a join), as for any batch.
    pub fn forward_batch_joined<C: KvStore>(
        &self,
        seqs: &mut [BatchSeq<'_, C>],
        joins: &mut [HiddenSeq<'_, C>],
    ) -> Result<Vec<Vec<f32>>> {
        let mut scratch = ForwardScratch::default();
        self.forward_batch_in(&mut scratch, seqs, joins)?;
        Ok(scratch.into_logits())
    }

    /// [`Self::forward_batch_joined`] with the caller's buffers: the layers'
    /// intermediate rows, the head's input and the logits live in `scratch`
    /// and are reused by the next forward, so a caller that runs forward after
    /// forward (the verifier's scheduler) allocates none of them once
    /// `scratch` has held its largest batch. Sequence `i`'s logits are
    /// [`ForwardScratch::logits`]`(i)` until the next forward. The results
    /// are the same bits as [`Self::forward_batch_joined`]'s: every buffer is
    /// written whole before it is read.
    pub fn forward_batch_in<C: KvStore>(
        &self,
        scratch: &mut ForwardScratch,
        seqs: &mut [BatchSeq<'_, C>],
        joins: &mut [HiddenSeq<'_, C>],
    ) -> Result<()> {
        let d = self.cfg.d_model;
        let n_layer = self.cfg.n_layer;
        scratch.spans.clear();
        let mut tokens = Vec::with_capacity(seqs.iter().map(|s| s.tokens.len()).sum());
        for s in seqs.iter() {
            if s.tokens.is_empty() {
                return Err(ModelError::InvalidArgument("no tokens to run".into()));
            }
            tokens.extend_from_slice(s.tokens);
        }
        joins.sort_by_key(|j| j.layer);
        for j in joins.iter() {
            if j.layer > n_layer || j.hidden.is_empty() || j.hidden.len() % d.max(1) != 0 {
                return Err(ModelError::InvalidArgument(format!(
                    "a join at layer {} with {} floats (d_model {d}, {n_layer} layers)",
                    j.layer,
                    j.hidden.len()
                )));
            }
        }
        let token_rows = tokens.len();
        let mut h = if tokens.is_empty() {
            Vec::new()
        } else {
            self.embed(&tokens)?
        };
        for j in joins.iter() {
            h.extend_from_slice(j.hidden);
        }
        // Sequences in row order: the token sequences, then the joins by layer,
        // so the rows that have reached layer l are always a prefix.
        let mut rows: Vec<SeqRows<'_, C>> = seqs
            .iter_mut()
            .map(|s| SeqRows::new(s.start_pos, s.tokens.len(), &mut *s.cache))
            .collect();
        let mut first_layer = vec![0; rows.len()];
        for j in joins.iter_mut() {
            rows.push(SeqRows::new(j.start_pos, j.hidden.len() / d, &mut *j.cache));
            first_layer.push(j.layer);
        }
        self.forward_layers_staggered(&mut h, &mut rows, &first_layer, &mut scratch.layer)?;
        // Gather the rows whose logits are wanted; one head call over them.
        h.truncate(token_rows * d);
        let vocab = self.cfg.vocab;
        scratch.wanted.clear();
        let mut r0 = 0;
        for s in seqs.iter() {
            let r = s.logits.rows(s.tokens.len());
            let at = scratch.wanted.len() / d.max(1) * vocab;
            scratch.spans.push(at..at + r.len() * vocab);
            scratch
                .wanted
                .extend_from_slice(&h[(r0 + r.start) * d..(r0 + r.end) * d]);
            r0 += s.tokens.len();
        }
        if scratch.wanted.is_empty() {
            scratch.logits.clear();
        } else {
            self.head_into(&scratch.wanted, &mut scratch.normed, &mut scratch.logits);
        }
        Ok(())
    }

    /// Layers `[first_layer[i], N)` over sequence `i`'s rows of `hidden`
    /// (`first_layer` non-decreasing, so the rows that have reached a layer
    /// are a prefix). Checked as [`Self::forward_layers_batch`] is.
    fn forward_layers_staggered<C: KvStore>(
        &self,
        hidden: &mut [f32],
        seqs: &mut [SeqRows<'_, C>],
        first_layer: &[usize],
        scratch: &mut LayerScratch,
    ) -> Result<()> {
        let d = self.cfg.d_model;
        let n: usize = seqs.iter().map(|s| s.n).sum();
        if hidden.len() != n * d || n == 0 || seqs.iter().any(|s| s.n == 0) {
            return Err(ModelError::InvalidArgument(format!(
                "hidden has {} floats for {n} rows of d_model {d} (every sequence needs a row)",
                hidden.len()
            )));
        }
        for (s, &first) in seqs.iter().zip(first_layer) {
            if s.cache.n_layers() != self.cfg.n_layer {
                return Err(ModelError::InvalidArgument(
                    "KV cache was made for another model".into(),
                ));
            }
            for l in first..self.cfg.n_layer {
                s.cache.check_append(l, s.start_pos, s.n)?;
            }
        }
        let (rows, rope) = self.row_tables(seqs);
        crate::forward_threads::run(|| {
            for l in 0..self.cfg.n_layer {
                // The sequences (and their rows) that have reached layer l.
                let k = first_layer.iter().take_while(|&&f| f <= l).count();
                let m: usize = seqs[..k].iter().map(|s| s.n).sum();
                if m > 0 {
                    let rows = &rows[..m];
                    self.layer_forward(
                        l,
                        &mut hidden[..m * d],
                        rows,
                        &rope,
                        &mut seqs[..k],
                        scratch,
                    );
                }
            }
        });
        Ok(())
    }

    /// Each row's `(sequence, position)` and each RoPE kind's `(cos, sin)`
    /// table per row, for the rows of `seqs` in order.
    #[allow(clippy::type_complexity)]
    fn row_tables<C: KvStore>(
        &self,
        seqs: &[SeqRows<'_, C>],
    ) -> (Vec<(usize, usize)>, Vec<Vec<(f32, f32)>>) {
        let rows: Vec<(usize, usize)> = seqs
            .iter()
            .enumerate()
            .flat_map(|(i, s)| (s.start_pos..s.start_pos + s.n).map(move |p| (i, p)))
            .collect();
        let rope: Vec<Vec<(f32, f32)>> = (0..self.ropes.len())
            .map(|kind| self.rope_table(kind, rows.iter().map(|&(_, p)| p)))
            .collect();
        (rows, rope)
    }

    /// Layer `l` over the rows of `seqs` (`rows[i]` = row i's sequence and
    /// position; `rope[kind]` each RoPE kind's (cos, sin) table,
    /// `[rows, rope_dims / 2]`).
    fn layer_forward<C: KvStore>(
        &self,
        l: usize,
        hidden: &mut [f32],
        rows: &[(usize, usize)],
        rope: &[Vec<(f32, f32)>],
        seqs: &mut [SeqRows<'_, C>],
        scratch: &mut LayerScratch,
    ) {
        let n = rows.len();
        let cfg = &self.cfg;
        let traits = cfg.arch.traits();
        let hd = cfg.head_dim;
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let layer = &self.layers[l];
        let bytes = self.bytes();

        // Attention block: x = norm(h); q, k, v = x·W (+ b); per-head q/k
        // norm; RoPE; append k, v to each sequence's cache; attend.
        let LayerScratch {
            x,
            q,
            k,
            v,
            attn,
            o,
            gate,
            up,
        } = scratch.fit(n, cfg);
        rms_norm(hidden, &layer.attn_norm, cfg.rms_eps, x);
        quant::matmul_shared(
            &mut [
                (&layer.wq.view(bytes), &mut q[..]),
                (&layer.wk.view(bytes), &mut k[..]),
                (&layer.wv.view(bytes), &mut v[..]),
            ],
            x,
            n,
        );
        if let Some([bq, bk, bv]) = &layer.qkv_bias {
            add_bias(q, bq);
            add_bias(k, bk);
            add_bias(v, bv);
        }
        if let Some([q_norm, k_norm]) = &layer.qk_norm {
            rms_norm_in_place(q, q_norm, cfg.rms_eps);
            rms_norm_in_place(k, k_norm, cfg.rms_eps);
        }
        let half = cfg.rope_dims / 2;
        let table = &rope[layer.rope];
        for i in 0..n {
            let t = &table[i * half..(i + 1) * half];
            apply_rope(&mut q[i * qd..(i + 1) * qd], hd, t, traits.rope_style);
            apply_rope(&mut k[i * kvd..(i + 1) * kvd], hd, t, traits.rope_style);
        }
        let mut r0 = 0;
        for s in seqs.iter_mut() {
            let span = r0 * kvd..(r0 + s.n) * kvd;
            s.cache.append(l, s.start_pos, &k[span.clone()], &v[span]);
            r0 += s.n;
        }
        let caches: Vec<&C> = seqs.iter().map(|s| &*s.cache).collect();
        let group = cfg.n_head / cfg.n_kv_head;
        // One task per (tile of rows of one sequence, KV head): each output
        // is computed with a fixed loop order over its own sequence's
        // positions (all of them, or a local layer's window), independent of
        // the other rows (`attend`); the rows of a tile and the query heads
        // of one KV head share its K/V reads.
        let kv_heads = cfg.n_head / group;
        let width = group * hd;
        let tiles = attention_tiles(rows);
        let parts: Vec<Vec<f32>> = (0..tiles.len() * kv_heads)
            .into_par_iter()
            .map(|idx| {
                let (tile, g) = (&tiles[idx / kv_heads], idx % kv_heads);
                let spans: Vec<_> = tile
                    .clone()
                    .map(|i| cfg.attention_span(l, rows[i].1))
                    .collect();
                let mut out = vec![0f32; tile.len() * width];
                let q0 = tile.start * qd + g * width;
                let seq = rows[tile.start].0;
                let off = g * hd;
                let scale = cfg.attn_scale;
                attend(
                    &q[q0..],
                    qd,
                    &spans,
                    caches[seq],
                    l,
                    off,
                    hd,
                    group,
                    scale,
                    &mut out,
                );
                out
            })
            .collect();
        for (idx, part) in parts.iter().enumerate() {
            let (tile, g) = (&tiles[idx / kv_heads], idx % kv_heads);
            for (i, o) in tile.clone().zip(part.chunks_exact(width)) {
                attn[i * qd + g * width..i * qd + (g + 1) * width].copy_from_slice(o);
            }
        }
        quant::matmul(&layer.wo.view(bytes), attn, n, o);
        if let Some(w) = &layer.post_attn_norm {
            rms_norm_in_place(o, w, cfg.rms_eps);
        }
        add_in_place(hidden, o);

        // FFN block: h += down(act(gate(norm(h))) · up(norm(h))).
        rms_norm(hidden, &layer.ffn_norm, cfg.rms_eps, x);
        quant::matmul_shared(
            &mut [
                (&layer.w_gate.view(bytes), &mut gate[..]),
                (&layer.w_up.view(bytes), &mut up[..]),
            ],
            x,
            n,
        );
        gated(gate, up, traits.ffn_act);
        quant::matmul(&layer.w_down.view(bytes), gate, n, o);
        if let Some(w) = &layer.post_ffn_norm {
            rms_norm_in_place(o, w, cfg.rms_eps);
        }
        add_in_place(hidden, o);
    }

    /// `(cos, sin)` of `pos · step_j` for RoPE kind `kind` at each position
    /// (`[positions, rope_dims / 2]`); angles in f64, the same whatever the
    /// block.
    fn rope_table(&self, kind: usize, positions: impl Iterator<Item = usize>) -> Vec<(f32, f32)> {
        let steps = &self.ropes[kind];
        positions
            .flat_map(|pos| {
                steps.iter().map(move |f| {
                    let (s, c) = (pos as f64 * f).sin_cos();
                    (c as f32, s as f32)
                })
            })
            .collect()
    }
}

/// The buffers of a forward besides the hidden state and the KV: each layer's
/// intermediate rows, the head's input rows and the logits. A caller that runs
/// forward after forward keeps one ([`Model::forward_batch_in`]); what it
/// holds is the largest batch it has run (the logits: its verify rows ×
/// vocabulary × 4 bytes, 600 KB a row for a 151,936-token vocabulary), and
/// nothing is allocated for these per forward after that (issue 31 item 4).
#[derive(Debug, Default)]
pub struct ForwardScratch {
    layer: LayerScratch,
    wanted: Vec<f32>,
    normed: Vec<f32>,
    logits: Vec<f32>,
    spans: Vec<Range<usize>>,
}

impl ForwardScratch {
    /// Sequence `i`'s logits from the last [`Model::forward_batch_in`]: as its
    /// [`Logits`] asked, `[rows, vocab]` (empty for [`Logits::None`] or an `i`
    /// past the last sequence).
    pub fn logits(&self, i: usize) -> &[f32] {
        self.spans
            .get(i)
            .and_then(|r| self.logits.get(r.clone()))
            .unwrap_or_default()
    }

    /// Every sequence's logits as its own vector, the first keeping the
    /// buffer (one sequence is never copied).
    fn into_logits(mut self) -> Vec<Vec<f32>> {
        if self.spans.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(self.spans.len());
        for span in self.spans.iter().skip(1).rev() {
            out.push(self.logits.split_off(span.start));
        }
        out.push(self.logits);
        out.reverse();
        out
    }
}

/// One layer's intermediate rows (`[n, width]` each), reused from layer to
/// layer and, through [`ForwardScratch`], from forward to forward.
#[derive(Debug, Default)]
struct LayerScratch {
    x: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl LayerScratch {
    /// Sized for `n` rows of `cfg` (capacity kept when `n` shrinks). The
    /// stale values are never read: every buffer is written whole before use.
    fn fit(&mut self, n: usize, cfg: &ModelConfig) -> &mut Self {
        let (d, qd, kvd, ff) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim(), cfg.d_ff);
        for (buf, width) in [
            (&mut self.x, d),
            (&mut self.q, qd),
            (&mut self.k, kvd),
            (&mut self.v, kvd),
            (&mut self.attn, qd),
            (&mut self.o, d),
            (&mut self.gate, ff),
            (&mut self.up, ff),
        ] {
            buf.resize(n * width, 0.0);
        }
        self
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

/// Hidden rows that join a [`Model::forward_batch_joined`] at `layer`:
/// `hidden` is `[n, d_model]` (the output of layers `[0, layer)` at positions
/// `start_pos..start_pos + n`), run through layers `[layer, N)` into `cache`.
pub struct HiddenSeq<'a, C: KvStore> {
    pub layer: usize,
    pub hidden: &'a [f32],
    pub start_pos: usize,
    pub cache: &'a mut C,
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

/// The angle per position step of each rotated pair `j < dims / 2`:
/// `scale · theta^(-2j / dims) / factor_j` (f64; without a scale or factors
/// exactly `1 / theta^(2j / dims)`).
fn rope_steps(p: &RopeParams, dims: usize, factors: Option<&[f32]>) -> Vec<f64> {
    (0..dims / 2)
        .map(|j| {
            let mut f = 1.0 / (p.theta as f64).powf(2.0 * j as f64 / dims as f64);
            if p.scale != 1.0 {
                f *= p.scale as f64;
            }
            if let Some(ff) = factors {
                f /= ff[j] as f64;
            }
            f
        })
        .collect()
}

/// Rotary embedding over each head of `x` (`[heads * head_dim]`) with one
/// position's `(cos, sin)` table (`[rope_dims / 2]`): the first `rope_dims`
/// elements of each head rotate in pairs as `style` says, the rest pass.
fn apply_rope(x: &mut [f32], hd: usize, table: &[(f32, f32)], style: RopeStyle) {
    let half = table.len();
    for head in x.chunks_exact_mut(hd) {
        for (j, &(c, s)) in table.iter().enumerate() {
            let (ia, ib) = match style {
                RopeStyle::Neox => (j, j + half),
                RopeStyle::Adjacent => (2 * j, 2 * j + 1),
            };
            let (a, b) = (head[ia], head[ib]);
            head[ia] = a * c - b * s;
            head[ib] = a * s + b * c;
        }
    }
}

/// RMSNorm of each `w.len()`-wide chunk of `x` in place (q/k per head,
/// post-norms per row).
fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for xr in x.chunks_exact_mut(d) {
        let ss = dot(xr, xr);
        let scale = 1.0 / (ss / d as f32 + eps).sqrt();
        for (o, wv) in xr.iter_mut().zip(w) {
            *o = *o * scale * wv;
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

/// `g = silu(g) · u = (g / (1 + exp(−g))) · u`, element by element (the
/// exponentials a chunk at a time through [`exp_in_place`], same bits as
/// `f32::exp`).
fn silu_gated(g: &mut [f32], u: &[f32]) {
    let mut e = [0f32; 64];
    for (g, u) in g.chunks_mut(e.len()).zip(u.chunks(e.len())) {
        let e = &mut e[..g.len()];
        for (e, g) in e.iter_mut().zip(g.iter()) {
            *e = -*g;
        }
        exp_in_place(e);
        for ((g, u), e) in g.iter_mut().zip(u).zip(e.iter()) {
            *g = (*g / (1.0 + e)) * u;
        }
    }
}

/// Elements per task of [`gated`]; a one-token step (4,864 or 8,960 values)
/// stays on the calling thread.
const GATED_CHUNK: usize = 16 * 1024;

/// `gate = act(gate) · up`, element by element (so any split gives the same
/// bits). A 17-token verify of the 1.5B has 152k values per layer; its `exp`
/// was ~1.3 % of that forward's samples when done on one thread.
fn gated(gate: &mut [f32], up: &[f32], act: FfnAct) {
    let f = |(g, u): (&mut [f32], &[f32])| match act {
        FfnAct::Silu => silu_gated(g, u),
        // llama.cpp's f16-table GELU (crate::gelu, issue 28).
        FfnAct::GeluTanh => gelu::geglu_in_place(g, u),
    };
    if gate.len() <= GATED_CHUNK {
        f((gate, up));
    } else {
        gate.par_chunks_mut(GATED_CHUNK)
            .zip(up.par_chunks(GATED_CHUNK))
            .for_each(f);
    }
}

/// Most rows of one sequence that share a pass over its K/V rows in
/// attention (`attend`).
const ATTENTION_TILE_ROWS: usize = 8;

/// The forward's rows (`(sequence, position)`, each sequence's rows
/// together) cut into tiles of at most [`ATTENTION_TILE_ROWS`] rows of one
/// sequence.
fn attention_tiles(rows: &[(usize, usize)]) -> Vec<std::ops::Range<usize>> {
    let mut tiles = Vec::new();
    let mut start = 0;
    for i in 1..=rows.len() {
        if i == rows.len() || rows[i].0 != rows[start].0 || i - start == ATTENTION_TILE_ROWS {
            tiles.push(start..i);
            start = i;
        }
    }
    tiles
}

#[cfg(test)]
mod tests {
    use super::attention_tiles;

    #[test]
    fn attention_tiles_hold_one_sequence_and_at_most_the_tile_rows() {
        assert!(attention_tiles(&[]).is_empty());
        // Ten rows of sequence 0, then three of sequence 1, one of 2.
        let mut rows: Vec<(usize, usize)> = (0..10).map(|p| (0, 100 + p)).collect();
        rows.extend((0..3).map(|p| (1, p)));
        rows.push((2, 7));
        assert_eq!(attention_tiles(&rows), vec![0..8, 8..10, 10..13, 13..14]);
    }
}
