//! Generation loops in one process: draft-only, target-only, and speculative
//! decoding with the draft proposing blocks of `k` tokens and the target
//! verifying each block in one forward pass.
//!
//! In greedy mode the speculative output is token for token the target's own
//! greedy output: the verifier compares against the target's argmax, and the
//! target's logits for a position do not depend on the block they were computed
//! in (see [`crate::qwen2`]).

use crate::kv_cache::KvCache;
use crate::qwen2::Qwen2Model;
use crate::sampling::{self, distribution, top_k_truncate, Distribution, Sampler, SamplingParams};
use crate::verify::{verdict_from_logits, Verdict};
use crate::{ModelError, Result};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Largest draft block a verify accepts.
pub const MAX_K: usize = 16;

/// Which model(s) generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Draft,
    Target,
    Speculative,
}

/// Settings of one generation.
#[derive(Clone, Debug)]
pub struct GenerateConfig {
    pub max_tokens: usize,
    /// Draft block length (1..=16), speculative mode only.
    pub k: usize,
    pub sampling: SamplingParams,
    /// In sampled mode the draft samples from its top-`draft_top_k` tokens and
    /// hands those (token, prob) pairs to the verifier.
    pub draft_top_k: usize,
    /// Tokens that end the generation (not emitted).
    pub stop_tokens: Vec<u32>,
}

impl Default for GenerateConfig {
    fn default() -> Self {
        Self {
            max_tokens: 128,
            k: 4,
            sampling: SamplingParams::default(),
            draft_top_k: 32,
            stop_tokens: Vec::new(),
        }
    }
}

impl GenerateConfig {
    pub fn validate(&self) -> Result<()> {
        if self.k == 0 || self.k > MAX_K {
            return Err(ModelError::InvalidArgument(format!(
                "draft length k = {} is out of range (1..={MAX_K})",
                self.k
            )));
        }
        if self.draft_top_k == 0 {
            return Err(ModelError::InvalidArgument(
                "draft_top_k must be at least 1".into(),
            ));
        }
        self.sampling.validate()
    }
}

/// Acceptance at one draft position: how often it was reached and accepted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PositionStat {
    pub attempted: u64,
    pub accepted: u64,
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// A stop token (end of turn) was produced.
    Stop,
    /// `max_tokens` reached.
    MaxTokens,
    /// The KV cache capacity was reached.
    ContextFull,
    /// The token callback asked to stop.
    Cancelled,
}

/// Statistics of one generation (schema documented in docs/cli.md).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct GenStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Time to first token, including prefill.
    pub ttft_ms: f64,
    pub total_ms: f64,
    /// Generated tokens per second over the whole generation (after the prompt).
    pub tokens_per_s: f64,
    /// Tokens per second after the first token (decode speed).
    pub decode_tokens_per_s: f64,
    pub rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// accepted / drafted.
    pub acceptance_rate: f64,
    /// Mean accepted draft tokens per round.
    pub mean_accepted_len: f64,
    pub per_position: Vec<PositionStat>,
    pub target_forwards: u64,
    pub draft_forwards: u64,
}

impl GenStats {
    fn finish(&mut self, start: Instant, first: Option<Instant>) {
        let now = Instant::now();
        self.total_ms = ms(now - start);
        if let Some(f) = first {
            self.ttft_ms = ms(f - start);
            let decode = (now - f).as_secs_f64();
            if self.generated_tokens > 1 && decode > 0.0 {
                self.decode_tokens_per_s = (self.generated_tokens - 1) as f64 / decode;
            }
        }
        if self.total_ms > 0.0 {
            self.tokens_per_s = self.generated_tokens as f64 / (self.total_ms / 1000.0);
        }
        if self.drafted > 0 {
            self.acceptance_rate = self.accepted as f64 / self.drafted as f64;
        }
        if self.rounds > 0 {
            self.mean_accepted_len = self.accepted as f64 / self.rounds as f64;
        }
    }

    fn record_round(&mut self, k: usize, accepted: usize) {
        if self.per_position.len() < k {
            self.per_position.resize(k, PositionStat::default());
        }
        for (i, p) in self.per_position.iter_mut().enumerate().take(k) {
            if i <= accepted {
                p.attempted += 1;
            }
            if i < accepted {
                p.accepted += 1;
            }
        }
        self.rounds += 1;
        self.drafted += k as u64;
        self.accepted += accepted as u64;
    }
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The result of a generation.
#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    pub stats: GenStats,
}

/// Receives each generated token as soon as it is final; returns `false` to
/// cancel the generation.
pub type OnToken<'a> = dyn FnMut(u32) -> bool + 'a;

/// The next token under `params` from one row of logits (greedy: argmax of the
/// penalised logits; no randomness).
fn pick(params: &SamplingParams, logits: &[f32], history: &[u32], rng: &mut Sampler) -> u32 {
    if params.is_greedy() {
        sampling::greedy_token(params, logits, history)
    } else {
        rng.next_token(params, logits, history)
    }
}

struct Emitter<'a, 'b> {
    cfg: &'a GenerateConfig,
    capacity: usize,
    prompt_len: usize,
    out: Vec<u32>,
    first: Option<Instant>,
    on_token: &'a mut OnToken<'b>,
    stop: Option<StopReason>,
}

impl Emitter<'_, '_> {
    /// Emit one token; returns false when generation must end.
    fn emit(&mut self, t: u32) -> bool {
        if self.stop.is_some() {
            return false;
        }
        if self.cfg.stop_tokens.contains(&t) {
            self.first.get_or_insert_with(Instant::now);
            self.stop = Some(StopReason::Stop);
            return false;
        }
        self.out.push(t);
        self.first.get_or_insert_with(Instant::now);
        if !(self.on_token)(t) {
            self.stop = Some(StopReason::Cancelled);
            return false;
        }
        if self.out.len() >= self.cfg.max_tokens {
            self.stop = Some(StopReason::MaxTokens);
            return false;
        }
        // The last emitted token must still fit in the cache to be extended.
        if self.prompt_len + self.out.len() >= self.capacity {
            self.stop = Some(StopReason::ContextFull);
            return false;
        }
        true
    }
}

fn check_prompt(prompt: &[u32], capacity: usize) -> Result<()> {
    if prompt.is_empty() {
        return Err(ModelError::InvalidArgument("the prompt is empty".into()));
    }
    if prompt.len() >= capacity {
        return Err(ModelError::SequenceTooLong {
            needed: prompt.len() + 1,
            capacity,
        });
    }
    Ok(())
}

/// Plain autoregressive generation with one model.
pub fn generate_single(
    model: &Qwen2Model,
    prompt: &[u32],
    cfg: &GenerateConfig,
    on_token: &mut OnToken<'_>,
) -> Result<Generation> {
    cfg.validate()?;
    let mut cache = model.new_cache();
    check_prompt(prompt, cache.capacity())?;
    let start = Instant::now();
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        ..GenStats::default()
    };
    let mut rng = Sampler::from_params(&cfg.sampling);
    let mut history = prompt.to_vec();
    let mut em = Emitter {
        cfg,
        capacity: cache.capacity(),
        prompt_len: prompt.len(),
        out: Vec::new(),
        first: None,
        on_token,
        stop: None,
    };
    let mut logits = model.forward_last(prompt, 0, &mut cache)?;
    stats.target_forwards += 1;
    if cfg.max_tokens == 0 {
        em.stop = Some(StopReason::MaxTokens);
    }
    while em.stop.is_none() {
        let t = pick(&cfg.sampling, &logits, &history, &mut rng);
        history.push(t);
        if !em.emit(t) {
            break;
        }
        let pos = cache.len();
        logits = model.forward(&[t], pos, &mut cache)?;
        stats.target_forwards += 1;
    }
    let stop = em.stop.unwrap_or(StopReason::MaxTokens);
    stats.generated_tokens = em.out.len();
    stats.finish(start, em.first);
    Ok(Generation {
        tokens: em.out,
        stop,
        stats,
    })
}

/// Speculative decoding with a draft and a target model in this process.
pub fn generate_speculative(
    draft: &Qwen2Model,
    target: &Qwen2Model,
    prompt: &[u32],
    cfg: &GenerateConfig,
    on_token: &mut OnToken<'_>,
) -> Result<Generation> {
    cfg.validate()?;
    if draft.config().vocab != target.config().vocab {
        return Err(ModelError::InvalidArgument(format!(
            "draft vocabulary ({}) differs from target vocabulary ({})",
            draft.config().vocab,
            target.config().vocab
        )));
    }
    let mut tcache = target.new_cache();
    let mut dcache = draft.new_cache();
    let capacity = tcache.capacity().min(dcache.capacity());
    check_prompt(prompt, capacity)?;
    let start = Instant::now();
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        ..GenStats::default()
    };
    let params = &cfg.sampling;
    let mut rng = Sampler::from_params(params);
    let mut history = prompt.to_vec();
    let mut em = Emitter {
        cfg,
        capacity,
        prompt_len: prompt.len(),
        out: Vec::new(),
        first: None,
        on_token,
        stop: None,
    };
    // The target's first token comes from its prefill.
    let logits = target.forward_last(prompt, 0, &mut tcache)?;
    stats.target_forwards += 1;
    let mut last = pick(params, &logits, &history, &mut rng);
    history.push(last);
    if cfg.max_tokens == 0 {
        em.stop = Some(StopReason::MaxTokens);
    } else {
        em.emit(last);
    }
    // Tokens the draft has not yet seen, beginning with the prompt.
    let mut draft_pending: Vec<u32> = prompt.to_vec();
    draft_pending.push(last);

    while em.stop.is_none() {
        // Never draft past the cache or past max_tokens (+1 for the token the
        // verifier adds).
        let room_cache = capacity.saturating_sub(tcache.len() + 1);
        let room_out = cfg.max_tokens.saturating_sub(em.out.len());
        let k = cfg.k.min(room_cache).min(room_out.max(1));
        if k == 0 {
            em.stop = Some(StopReason::ContextFull);
            break;
        }
        // Draft k tokens.
        let mut block = Vec::with_capacity(k);
        let mut qs: Vec<Distribution> = Vec::new();
        let mut dhist = history.clone();
        for _ in 0..k {
            let pos = dcache.len();
            let l = draft.forward_last(&draft_pending, pos, &mut dcache)?;
            stats.draft_forwards += 1;
            let d = if params.is_greedy() {
                pick(params, &l, &dhist, &mut rng)
            } else {
                let q = top_k_truncate(&distribution(params, &l, &dhist), cfg.draft_top_k);
                let d = rng.sample(&q);
                qs.push(q);
                d
            };
            block.push(d);
            dhist.push(d);
            draft_pending.clear();
            draft_pending.push(d);
        }
        // The last drafted token has not been fed to the draft yet; it stays pending.

        // Verify [last, d1..dk] in one target forward.
        let base = tcache.len();
        let mut input = Vec::with_capacity(k + 1);
        input.push(last);
        input.extend_from_slice(&block);
        let tl = target.forward(&input, base, &mut tcache)?;
        stats.target_forwards += 1;
        let verdict: Verdict = verdict_from_logits(params, &history, &block, &qs, &tl, &mut rng)?;
        stats.record_round(k, verdict.accepted);
        let n = verdict.accepted;
        // Roll both caches back to [.., last, d1..dn].
        tcache.truncate(base + 1 + n);
        rollback_draft(&mut dcache, &mut draft_pending, base + 1 + n, &block[..n]);
        for &t in &block[..n] {
            history.push(t);
            if !em.emit(t) {
                break;
            }
        }
        if em.stop.is_some() {
            break;
        }
        last = verdict.next_token;
        history.push(last);
        draft_pending.push(last);
        em.emit(last);
    }
    let stop = em.stop.unwrap_or(StopReason::MaxTokens);
    stats.generated_tokens = em.out.len();
    stats.finish(start, em.first);
    Ok(Generation {
        tokens: em.out,
        stop,
        stats,
    })
}

/// After a verdict, make the draft cache hold exactly the first `keep` positions
/// and queue whatever accepted tokens it has not seen yet.
fn rollback_draft(cache: &mut KvCache, pending: &mut Vec<u32>, keep: usize, accepted: &[u32]) {
    // Before this call the cache holds [.., last, d1..d(k-1)] and `pending` is
    // [dk]. Positions up to `keep` are [.., last, d1..dn].
    let have = cache.len();
    if have >= keep {
        cache.truncate(keep);
        pending.clear();
    } else {
        // All k accepted: dk is accepted but not in the cache.
        debug_assert_eq!(have + 1, keep);
        pending.clear();
        if let Some(&dk) = accepted.last() {
            pending.push(dk);
        }
    }
}
