//! Generation loops in one process: draft-only, target-only, and speculative
//! decoding with a proposer ([`crate::proposer`]: the draft model, prompt
//! lookup, or a per-round choice) offering blocks of up to `k` tokens and the
//! target verifying each block in one forward pass.
//!
//! The speculative output is token for token the target's own output with the
//! same sampling parameters: in greedy mode its greedy output, in sampled mode
//! its output with the same seed. The verifier compares against the target's
//! token at each position ([`crate::sampling::next_token`]), and the target's
//! logits for a position do not depend on the block they were computed in (see
//! [`crate::qwen2`]).

use crate::kv_cache::{KvCache, KvPrecision};
use crate::proposer::{plan_round, AutoChooser, NgramIndex, ProposerKind, ProposerStats, Source};
use crate::sampling::{next_token, SamplingParams};
use crate::transformer::Model;
use crate::verify::{verdict_from_logits, Verdict};
use crate::{ModelError, Result};
use serde::{Deserialize, Serialize};
use std::time::Instant;

pub use crate::verify::MAX_K;

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
    /// Tokens that end the generation (not emitted).
    pub stop_tokens: Vec<u32>,
    /// What proposes the draft tokens (speculative mode).
    pub proposer: ProposerKind,
    /// How the draft model's KV cache stores keys and values. The target's
    /// cache is always f32; the draft's precision changes which tokens it
    /// proposes (acceptance), never the speculative output, but it decides
    /// the draft's own answers (draft mode, local and offline tokens).
    /// Default [`KvPrecision::F16`]: half the memory, and the draft agrees
    /// with llama.cpp as often as with f32 ([`KvPrecision::Int8`], a quarter,
    /// does not: docs/model-core.md, "Draft KV fidelity").
    pub draft_kv: KvPrecision,
    /// Report each token's logprob and this many most likely alternatives
    /// (0..=[`crate::logprobs::MAX_TOP_LOGPROBS`]; `None`: no logprobs). Read
    /// by the edge runtime (the draft's for local tokens, the verifier's for
    /// verified ones); the loops here do not report them.
    pub top_logprobs: Option<usize>,
}

impl Default for GenerateConfig {
    fn default() -> Self {
        Self {
            max_tokens: 128,
            k: 4,
            sampling: SamplingParams::default(),
            stop_tokens: Vec::new(),
            proposer: ProposerKind::Draft,
            draft_kv: KvPrecision::F16,
            top_logprobs: None,
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
        if let Some(n) = self
            .top_logprobs
            .filter(|&n| n > crate::logprobs::MAX_TOP_LOGPROBS)
        {
            return Err(ModelError::InvalidArgument(format!(
                "top_logprobs = {n} is out of range (0..={})",
                crate::logprobs::MAX_TOP_LOGPROBS
            )));
        }
        self.sampling.validate()
    }

    /// This configuration for a generation of a `prompt_len`-token prompt: the
    /// sampling's completion starts there (what the presence and frequency
    /// penalties count; [`SamplingParams::for_prompt`]).
    pub fn for_prompt(&self, prompt_len: usize) -> GenerateConfig {
        GenerateConfig {
            sampling: self.sampling.for_prompt(prompt_len),
            ..self.clone()
        }
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
    /// Rounds, drafted and accepted tokens per proposer.
    #[serde(default)]
    pub proposers: ProposerStats,
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

/// Plain autoregressive generation with one model (f32 KV cache).
pub fn generate_single(
    model: &Model,
    prompt: &[u32],
    cfg: &GenerateConfig,
    on_token: &mut OnToken<'_>,
) -> Result<Generation> {
    generate_single_with(model, KvPrecision::F32, prompt, cfg, on_token)
}

/// [`generate_single`] with the model's KV cache at `kv` (draft-only
/// generation with [`GenerateConfig::draft_kv`]).
pub fn generate_single_with(
    model: &Model,
    kv: KvPrecision,
    prompt: &[u32],
    cfg: &GenerateConfig,
    on_token: &mut OnToken<'_>,
) -> Result<Generation> {
    cfg.validate()?;
    let cfg = &cfg.for_prompt(prompt.len());
    let mut cache = model.new_cache_with(kv);
    check_prompt(prompt, cache.capacity())?;
    let start = Instant::now();
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        ..GenStats::default()
    };
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
        let t = next_token(&cfg.sampling, &logits, &history);
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

/// The draft model as a proposer. Its cache holds a prefix of the history
/// (and, during a round, the block it drafts); the tokens past that prefix are
/// fed on its next use, so a generation that never asks the draft never pays
/// for its prefill.
struct DraftModel<'m> {
    model: &'m Model,
    cache: KvCache,
}

impl DraftModel<'_> {
    /// History tokens the draft has not seen.
    fn backlog(&self, history: &[u32]) -> usize {
        history.len().saturating_sub(self.cache.len())
    }

    /// Draft `k` tokens after `history` (which ends with a token the draft
    /// has not seen), each drawn like the target's ([`next_token`]).
    fn propose(
        &mut self,
        history: &[u32],
        k: usize,
        params: &SamplingParams,
        stats: &mut GenStats,
        chooser: &mut AutoChooser,
    ) -> Result<Vec<u32>> {
        let mut pending = history[self.cache.len().min(history.len())..].to_vec();
        let mut block = Vec::with_capacity(k);
        let mut dhist = history.to_vec();
        for _ in 0..k {
            let t = Instant::now();
            let l = self
                .model
                .forward_last(&pending, self.cache.len(), &mut self.cache)?;
            chooser.draft_forward(pending.len(), t.elapsed());
            stats.draft_forwards += 1;
            let d = next_token(params, &l, &dhist);
            block.push(d);
            dhist.push(d);
            pending.clear();
            pending.push(d);
        }
        // The last drafted token is not fed: it may be rejected.
        Ok(block)
    }

    /// After a verdict: the first `verified` history positions are final;
    /// the cache keeps what it holds of them.
    fn rollback(&mut self, verified: usize) {
        if self.cache.len() > verified {
            self.cache.truncate(verified);
        }
    }
}

/// Speculative decoding with a draft and a target model in this process;
/// `cfg.proposer` chooses what proposes each block (with
/// [`ProposerKind::Lookup`] the draft model is never run).
pub fn generate_speculative(
    draft: &Model,
    target: &Model,
    prompt: &[u32],
    cfg: &GenerateConfig,
    on_token: &mut OnToken<'_>,
) -> Result<Generation> {
    cfg.validate()?;
    let cfg = &cfg.for_prompt(prompt.len());
    crate::pair::check_vocab(draft.config(), target.config()).map_err(|e| {
        ModelError::InvalidArgument(format!("the draft cannot pair with the target: {e}"))
    })?;
    let mut tcache = target.new_cache();
    let mut drafter = DraftModel {
        model: draft,
        cache: draft.new_cache_with(cfg.draft_kv),
    };
    let capacity = tcache.capacity().min(drafter.cache.capacity());
    check_prompt(prompt, capacity)?;
    let start = Instant::now();
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        ..GenStats::default()
    };
    let params = &cfg.sampling;
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
    let mut last = next_token(params, &logits, &history);
    history.push(last);
    if cfg.max_tokens == 0 {
        em.stop = Some(StopReason::MaxTokens);
    } else {
        em.emit(last);
    }
    let mut index = NgramIndex::new();
    index.extend(&history);
    let mut chooser = AutoChooser::default();

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
        let plan = plan_round(
            cfg.proposer,
            &index,
            &history,
            k,
            room_out,
            &chooser,
            || drafter.backlog(&history),
        );
        let (source, len, lookup_match) = (plan.source, plan.len, plan.lookup_match);
        let block = match source {
            Source::Draft => drafter.propose(&history, len, params, &mut stats, &mut chooser)?,
            Source::Lookup => plan.lookup,
            Source::Nothing => Vec::new(),
        };

        // Verify [last, block..] in one target forward.
        let base = tcache.len();
        let mut input = Vec::with_capacity(block.len() + 1);
        input.push(last);
        input.extend_from_slice(&block);
        let t = Instant::now();
        let tl = target.forward(&input, base, &mut tcache)?;
        chooser.target_forward(input.len(), t.elapsed());
        stats.target_forwards += 1;
        let verdict: Verdict = verdict_from_logits(params, &history, &block, &tl)?;
        let n = verdict.accepted;
        stats.record_round(block.len(), n);
        stats.proposers.record(source, block.len(), n);
        chooser.observe(source, lookup_match, block.len(), n);
        // Both caches keep [.., last, d1..dn].
        tcache.truncate(base + 1 + n);
        drafter.rollback(base + 1 + n);
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
        index.extend(&history);
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
