//! The one speculative generation core: the settings of a generation
//! ([`GenerateConfig`]), its statistics ([`GenStats`]) and end
//! ([`StopReason`]), the one emit rule ([`Emitter`]), the draft model as a
//! proposer ([`DraftModel`], one draft step: [`DraftModel::step`]), and the
//! round ([`SpecEngine::round`]): plan (the proposers of
//! [`crate::proposer`]), propose a block, have a [`BlockVerifier`] judge it,
//! roll the draft back, emit, and count.
//!
//! A verifier is anything that answers "this block after this context:
//! how many accepted, and your next token": the local target
//! ([`TargetVerifier`], `crate::speculative::generate_speculative` and the
//! recording of `tandem bench verifier`'s trace), or, in the edge runtime,
//! the remote verifier. The edge runtime emits with [`Emitter`] and drafts
//! with [`DraftModel::step`], adding its token statuses and logprobs on top.
//!
//! Structured output ([`GenerateConfig::grammar`], docs/grammar.md) is
//! applied here, once: the draft's own constraint ([`DraftModel::guide`])
//! masks its logits before every draw ([`choose`]) and cuts lookup's
//! proposals at the first token it refuses ([`DraftModel::allowed`]); the
//! local target masks its choice at every position of a block
//! ([`TargetVerifier::with_guide`], [`masked_verdict`]). The remote verifier
//! masks its own (`tandem_grammar::masked_verdict`).

use crate::kv_cache::{KvCache, KvPrecision};
use crate::logprobs::{chosen_logprobs, TokenLogprobs};
use crate::proposer::{
    plan_round, AutoChooser, NgramIndex, Plan, ProposerKind, ProposerStats, Source,
};
use crate::sampling::{adjusted_logits, next_token, token_prob, SamplingParams};
use crate::transformer::Model;
use crate::verify::{verdict_from_logits, MAX_K};
use crate::{ModelError, Result};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;

/// One generation's constraint on its output (structured output: a grammar;
/// implemented by `tandem_grammar::Guide`). It follows whatever context it is
/// asked about: rejected draft tokens are taken back by the next call, so a
/// caller never rolls it back by hand.
pub trait OutputConstraint: Send {
    /// Sets to −∞ the logit of every token it does not allow after `context`
    /// (the prompt and the output so far). An error when a token of the
    /// output is one it refuses, or when it allows nothing.
    fn mask(&mut self, context: &[u32], logits: &mut [f32]) -> Result<()>;
    /// How many leading `tokens` it allows after `context`.
    fn allowed_prefix(&mut self, context: &[u32], tokens: &[u32]) -> Result<usize>;
}

/// What a generation's output is constrained to ([`GenerateConfig::grammar`]):
/// its wire form (what a verifier session's Open carries) and a fresh
/// [`OutputConstraint`] per generation side (the draft's, the local
/// target's). Implemented by `tandem_grammar::Grammar`.
pub trait OutputGrammar: std::fmt::Debug + Send + Sync {
    /// (kind, text): `tandem_grammar::GrammarSpec::to_wire`.
    fn wire(&self) -> (&'static str, String);
    /// A constraint on the output that starts at context position
    /// `output_start` (the prompt's length).
    fn constraint(&self, output_start: usize) -> Result<Box<dyn OutputConstraint>>;
}

/// The token after `hist` from `logits` (masked in place first by `guide`,
/// when the output is constrained): [`next_token`] of what is allowed. The
/// one choice of every loop under a grammar.
pub fn choose(
    params: &SamplingParams,
    logits: &mut [f32],
    hist: &[u32],
    guide: Option<&mut (dyn OutputConstraint + '_)>,
) -> Result<u32> {
    if let Some(g) = guide {
        g.mask(hist, logits)?;
    }
    Ok(next_token(params, logits, hist))
}

/// The verdict on `block` after `ctx` from the target's `logits` (`[k + 1,
/// vocab]` over `[last, d1..dk]`) under `guide`: at each position the
/// target's choice among the tokens allowed there ([`choose`]), accepting
/// drafts while they equal it. Unconstrained, it is
/// [`verdict_from_logits`]; the remote verifier's is
/// `tandem_grammar::masked_verdict`, the same choices.
pub fn masked_verdict(
    params: &SamplingParams,
    ctx: &[u32],
    block: &[u32],
    logits: &[f32],
    guide: &mut dyn OutputConstraint,
) -> Result<crate::verify::Verdict> {
    let k = block.len();
    let vocab = logits.len() / (k + 1);
    if vocab == 0 || logits.len() != (k + 1) * vocab {
        return Err(ModelError::InvalidArgument(format!(
            "a verdict on {k} draft tokens needs {} rows of logits, got {} floats",
            k + 1,
            logits.len()
        )));
    }
    let mut hist = ctx.to_vec();
    for i in 0..=k {
        let mut row = logits[i * vocab..(i + 1) * vocab].to_vec();
        let t = choose(params, &mut row, &hist, Some(&mut *guide))?;
        match block.get(i) {
            Some(&d) if d == t => hist.push(t),
            _ => {
                return Ok(crate::verify::Verdict {
                    accepted: i,
                    next_token: t,
                })
            }
        }
    }
    // Unreachable: the last position has no draft to agree with.
    Err(ModelError::InvalidArgument("verdict past the block".into()))
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
    /// Structured output: every token the generation emits (verified, local
    /// or provisional) is one this grammar allows, and in greedy mode the
    /// output is the target's own greedy output under it (docs/grammar.md).
    /// `None`: unconstrained.
    pub grammar: Option<Arc<dyn OutputGrammar>>,
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
            grammar: None,
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
    /// Sets the times (from `start`; `first`: when the first token came),
    /// the rates and the means, once `generated_tokens` is set.
    pub fn finish(&mut self, start: Instant, first: Option<Instant>) {
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

/// The one emit rule of every generation loop (local, trace, edge): a stop
/// token ends the generation unemitted; an emitted token is appended to the
/// context and delivered; then `max_tokens` and the context capacity are
/// checked. Also notes when the first token came (time to first token).
#[derive(Clone, Copy, Debug)]
pub struct Emitter {
    /// Context tokens before the output (the prompt).
    pub prompt_len: usize,
    pub max_tokens: usize,
    /// Context positions the caches hold: the last emitted token must still
    /// fit to be extended.
    pub capacity: usize,
    /// Why the generation ended (`None`: it goes on).
    pub stop: Option<StopReason>,
    /// When the first token (or the stop token that ended the output) came.
    pub first: Option<Instant>,
}

impl Emitter {
    /// An emitter for a `prompt_len`-token prompt; with `max_tokens` 0 the
    /// generation has ended before it began.
    pub fn new(prompt_len: usize, max_tokens: usize, capacity: usize) -> Self {
        Self {
            prompt_len,
            max_tokens,
            capacity,
            stop: (max_tokens == 0).then_some(StopReason::MaxTokens),
            first: None,
        }
    }

    /// Emits `t` onto `ctx` (the prompt and the output so far): unless the
    /// generation has ended or `t` is one of `stop_tokens`, appends it and
    /// calls `deliver` with its output index (false: cancel). Returns false
    /// when the generation must end (`stop` says why).
    pub fn emit(
        &mut self,
        stop_tokens: &[u32],
        ctx: &mut Vec<u32>,
        t: u32,
        deliver: impl FnOnce(usize) -> bool,
    ) -> bool {
        if self.stop.is_some() {
            return false;
        }
        self.first.get_or_insert_with(Instant::now);
        if stop_tokens.contains(&t) {
            self.stop = Some(StopReason::Stop);
            return false;
        }
        ctx.push(t);
        let out_len = ctx.len() - self.prompt_len;
        if !deliver(out_len - 1) {
            self.stop = Some(StopReason::Cancelled);
            return false;
        }
        if out_len >= self.max_tokens {
            self.stop = Some(StopReason::MaxTokens);
            return false;
        }
        if ctx.len() >= self.capacity {
            self.stop = Some(StopReason::ContextFull);
            return false;
        }
        true
    }
}

pub(crate) fn check_prompt(prompt: &[u32], capacity: usize) -> Result<()> {
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

/// What a draft step computes besides its token.
#[derive(Clone, Copy, Debug, Default)]
pub struct DraftAsk {
    /// The draft's top-1 probability of its token (greedy only: uncertainty
    /// gating).
    pub conf: bool,
    /// The token's logprobs with this many alternatives.
    pub top_logprobs: Option<usize>,
}

/// One draft step's token, and what was asked of it ([`DraftAsk`]).
#[derive(Clone, Debug)]
pub struct Drafted {
    pub token: u32,
    /// Greedy with [`DraftAsk::conf`] only.
    pub conf: Option<f32>,
    pub logprobs: Option<TokenLogprobs>,
}

/// The draft model as a proposer. Its cache holds a prefix of the context
/// (and, during a round, of the block it drafts); the tokens past that
/// prefix are fed on its next step, so a generation that never asks the
/// draft never pays for its prefill.
pub struct DraftModel<'m> {
    pub model: &'m Model,
    pub cache: KvCache,
    /// The draft's own constraint on the output (structured output): masks
    /// every draw and cuts lookup's proposals ([`Self::allowed`]).
    pub guide: Option<Box<dyn OutputConstraint>>,
}

impl<'m> DraftModel<'m> {
    /// The draft with an empty cache at `kv` ([`GenerateConfig::draft_kv`]).
    pub fn new(model: &'m Model, kv: KvPrecision) -> Self {
        Self {
            model,
            cache: model.new_cache_with(kv),
            guide: None,
        }
    }

    /// The draft's constraint for a generation of `cfg` whose output starts
    /// at context position `output_start` (none without a grammar).
    pub fn guide_for(
        cfg: &GenerateConfig,
        output_start: usize,
    ) -> Result<Option<Box<dyn OutputConstraint>>> {
        cfg.grammar
            .as_ref()
            .map(|g| g.constraint(output_start))
            .transpose()
    }

    /// How many leading `tokens` (a lookup proposal after `hist`) the
    /// draft's constraint allows: all of them without one.
    pub fn allowed(&mut self, hist: &[u32], tokens: &[u32]) -> Result<usize> {
        match self.guide.as_mut() {
            Some(g) => g.allowed_prefix(hist, tokens),
            None => Ok(tokens.len()),
        }
    }

    /// History tokens the draft has not seen.
    pub fn backlog(&self, history: &[u32]) -> usize {
        history.len().saturating_sub(self.cache.len())
    }

    /// Runs `tokens` into the cache (a prefill) without drawing.
    pub fn feed(&mut self, tokens: &[u32]) -> Result<()> {
        let pos = self.cache.len();
        self.model.forward_last(tokens, pos, &mut self.cache)?;
        Ok(())
    }

    /// The one draft step: one forward over `feed` (the tokens of `hist`
    /// the cache has not seen, at least its last), then the draft's token
    /// after `hist`, picked like the target's ([`next_token`]: the argmax of
    /// the penalised logits, or the keyed draw at position `hist.len()`),
    /// among the tokens its constraint allows ([`choose`]); with
    /// [`DraftAsk::conf`] (greedy) its softmax probability under the
    /// penalised (and masked) logits.
    pub fn step(
        &mut self,
        feed: &[u32],
        hist: &[u32],
        params: &SamplingParams,
        ask: DraftAsk,
    ) -> Result<Drafted> {
        let pos = self.cache.len();
        let mut logits = self.model.forward_last(feed, pos, &mut self.cache)?;
        let token = choose(params, &mut logits, hist, self.guide.as_deref_mut())?;
        let conf = (ask.conf && params.is_greedy())
            .then(|| token_prob(&adjusted_logits(params, &logits, hist), token));
        let logprobs = ask
            .top_logprobs
            .map(|top| chosen_logprobs(params, &logits, hist, token, top));
        Ok(Drafted {
            token,
            conf,
            logprobs,
        })
    }

    /// Drafts `k` tokens after `history` (which ends with a token the draft
    /// has not seen), one [`Self::step`] each, each also computing what
    /// `ask` asks; counts and times the forwards (each one's rows and time
    /// also go to `forwards`). The last drafted token is not fed: it may be
    /// rejected.
    #[allow(clippy::too_many_arguments)]
    pub fn propose(
        &mut self,
        history: &[u32],
        k: usize,
        params: &SamplingParams,
        ask: DraftAsk,
        stats: &mut GenStats,
        chooser: &mut AutoChooser,
        forwards: &mut Vec<DraftForward>,
    ) -> Result<Vec<Drafted>> {
        let mut pending = history[self.cache.len().min(history.len())..].to_vec();
        let mut steps = Vec::with_capacity(k);
        let mut dhist = history.to_vec();
        for _ in 0..k {
            let t = Instant::now();
            let d = self.step(&pending, &dhist, params, ask)?;
            let time = t.elapsed();
            chooser.draft_forward(pending.len(), time);
            forwards.push(DraftForward {
                rows: pending.len(),
                time,
            });
            stats.draft_forwards += 1;
            dhist.push(d.token);
            pending.clear();
            pending.push(d.token);
            steps.push(d);
        }
        Ok(steps)
    }

    /// After a verdict: the first `verified` context positions are final;
    /// the cache keeps what it holds of them.
    pub fn rollback(&mut self, verified: usize) {
        if self.cache.len() > verified {
            self.cache.truncate(verified);
        }
    }
}

/// One forward of the draft while it proposed a block: the rows it ran
/// (the tokens it had not seen, then 1) and how long it took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftForward {
    pub rows: usize,
    pub time: std::time::Duration,
}

/// A verifier's judgement of one block.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockVerdict {
    /// Leading block tokens the target accepts.
    pub accepted: usize,
    /// The target's token after them.
    pub next_token: u32,
    /// The target's logprobs of the emitted tokens (`block[..accepted]`,
    /// then `next_token`), when the verifier gives them.
    pub logprobs: Option<Vec<TokenLogprobs>>,
}

/// Why a [`BlockVerifier`] gave no verdict on a block: the three outcomes of
/// a verify besides the verdict itself.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError<B, R>
where
    B: std::fmt::Display + std::fmt::Debug,
    R: std::fmt::Display + std::fmt::Debug,
{
    /// The exchange broke (a stream reset or ended, a timeout, a busy or
    /// lost session): no verdict came and the block is lost. The engine has
    /// rolled the draft back to the context; the generation can go on once
    /// the caller has reacted (re-open, back off, draft alone).
    #[error("no verdict on the block: {0}")]
    Broken(B),
    /// The verifier answered with something the generation cannot take (a
    /// protocol violation, a refused session): it cannot go on against it.
    #[error("{0}")]
    Refused(R),
    /// This process's own model failed (or the verdict was impossible).
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// A verifier that always answers (the local target): its only failures
/// are the model's.
impl From<VerifyError<std::convert::Infallible, std::convert::Infallible>> for ModelError {
    fn from(e: VerifyError<std::convert::Infallible, std::convert::Infallible>) -> Self {
        match e {
            VerifyError::Model(e) => e,
            VerifyError::Broken(never) | VerifyError::Refused(never) => match never {},
        }
    }
}

/// What judges a proposed block: given the context (which ends with the
/// last emitted token, the one the verifier has not run yet) and a block of
/// proposed tokens after it, how many the target accepts and its next token
/// (a verdict), or why there is none ([`VerifyError`]: a broken exchange, a
/// refusal, a model error). After a verdict the verifier holds the context
/// and the accepted tokens.
pub trait BlockVerifier {
    /// What a broken exchange reports ([`VerifyError::Broken`]).
    type Broken: std::fmt::Display + std::fmt::Debug;
    /// What a refusal reports ([`VerifyError::Refused`]).
    type Refusal: std::fmt::Display + std::fmt::Debug;
    fn verify(
        &mut self,
        ctx: &[u32],
        block: &[u32],
    ) -> std::result::Result<BlockVerdict, VerifyError<Self::Broken, Self::Refusal>>;
}

/// The target model in this process as the verifier: one forward over
/// `[last, block..]`, the verdict from its logits
/// ([`verdict_from_logits`]), the cache cut to what was accepted.
pub struct TargetVerifier<'m> {
    model: &'m Model,
    cache: KvCache,
    params: SamplingParams,
    /// The target's own constraint (structured output).
    guide: Option<Box<dyn OutputConstraint>>,
}

impl<'m> TargetVerifier<'m> {
    /// The target with an empty f32 cache, judging with `params` (those of
    /// [`GenerateConfig::for_prompt`]).
    pub fn new(model: &'m Model, params: SamplingParams) -> Self {
        Self {
            model,
            cache: model.new_cache(),
            params,
            guide: None,
        }
    }

    /// Judges under `guide` (its own constraint on the output: every choice
    /// is among the tokens it allows, [`masked_verdict`]).
    pub fn with_guide(mut self, guide: Option<Box<dyn OutputConstraint>>) -> Self {
        self.guide = guide;
        self
    }

    /// The target's token after `ctx` from `logits` (its prefill's last
    /// row), under its constraint.
    pub fn choose(&mut self, ctx: &[u32], mut logits: Vec<f32>) -> Result<u32> {
        choose(&self.params, &mut logits, ctx, self.guide.as_deref_mut())
    }

    pub fn capacity(&self) -> usize {
        self.cache.capacity()
    }

    /// Runs `tokens` after what the cache holds; the last row's logits.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let pos = self.cache.len();
        self.model.forward_last(tokens, pos, &mut self.cache)
    }
}

impl BlockVerifier for TargetVerifier<'_> {
    type Broken = std::convert::Infallible;
    type Refusal = std::convert::Infallible;
    fn verify(
        &mut self,
        ctx: &[u32],
        block: &[u32],
    ) -> std::result::Result<BlockVerdict, VerifyError<Self::Broken, Self::Refusal>> {
        let base = self.cache.len();
        let Some(&last) = ctx.last().filter(|_| base + 1 == ctx.len()) else {
            return Err(ModelError::InvalidArgument(format!(
                "the target holds {base} positions, not the context's {} less its last",
                ctx.len()
            ))
            .into());
        };
        let mut input = Vec::with_capacity(block.len() + 1);
        input.push(last);
        input.extend_from_slice(block);
        let logits = self.model.forward(&input, base, &mut self.cache)?;
        let v = match self.guide.as_deref_mut() {
            Some(g) => masked_verdict(&self.params, ctx, block, &logits, g)?,
            None => verdict_from_logits(&self.params, ctx, block, &logits)?,
        };
        // The cache keeps [.., last, d1..dn].
        self.cache.truncate(base + 1 + v.accepted);
        Ok(BlockVerdict {
            accepted: v.accepted,
            next_token: v.next_token,
            logprobs: None,
        })
    }
}

/// What one round ([`round`], [`SpecEngine::round`]) did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineRound {
    /// What proposed the block, and the block.
    pub source: Source,
    pub block: Vec<u32>,
    /// Leading block tokens drafted ahead in the round before.
    pub reused: usize,
    /// Tokens drafted ahead that the next block starts with
    /// ([`propose_continuing`]): the whole block was accepted and the
    /// verifier's token was the draft's guess. The draft's cache holds the
    /// context and them but the last.
    pub ahead: Vec<u32>,
    /// Lookup's match for the round (`None`: not asked; `Some(0)`: none).
    pub lookup_match: Option<usize>,
    /// Of it, accepted; then the verifier's token.
    pub accepted: usize,
    pub next_token: u32,
    /// The draft's forwards while it proposed (empty unless the draft
    /// proposed), and the most positions its cache held meanwhile.
    pub draft_forwards: Vec<DraftForward>,
    pub draft_peak: usize,
    /// How long the verifier took to judge the block.
    pub verify_time: std::time::Duration,
}

/// The state one round works on, borrowed from its generation: a
/// [`SpecEngine`]'s own, or the edge runtime's (whose generation adds
/// token statuses, provisional spans and a connection around the same
/// round).
pub struct RoundState<'r, 'm> {
    pub cfg: &'r GenerateConfig,
    pub draft: &'r mut DraftModel<'m>,
    /// Prompt lookup's n-gram index over the context (extended here before
    /// a proposer that reads it plans).
    pub index: &'r mut NgramIndex,
    /// `auto`'s estimates (what each proposer's tokens cost and earn).
    pub chooser: &'r mut AutoChooser,
    pub stats: &'r mut GenStats,
}

/// Where a round's tokens go: the generation's context and whoever listens.
pub trait RoundOutput {
    /// The prompt and the output so far (ends with the last emitted token,
    /// the one the verifier has not run yet).
    fn context(&self) -> &[u32];
    /// Emits `t`, a token the verifier judged (an accepted proposal or its
    /// own), with the logprobs its verdict gave for it; false when the
    /// generation has ended (the emit rule, [`Emitter::emit`]).
    fn emit_verified(&mut self, t: u32, logprobs: Option<TokenLogprobs>) -> bool;
}

/// What [`propose`] is asked for.
#[derive(Clone, Copy, Debug)]
pub struct ProposeAsk {
    /// What proposes ([`GenerateConfig::proposer`]; the edge's gated rounds
    /// always ask the draft model).
    pub proposer: ProposerKind,
    /// At most this many tokens; 0: no proposal (no proposer is asked).
    pub k: usize,
    /// Output tokens left (for `auto`).
    pub room_out: usize,
    /// What each draft step also computes ([`DraftAsk`]: the edge's gated
    /// rounds ask the confidence, and the logprobs of the tokens they show
    /// provisional).
    pub draft: DraftAsk,
}

/// A proposed block before its verdict ([`propose`]): [`settle`] applies
/// the verdict, [`Proposal::discard`] forgets it when none came.
#[derive(Clone, Debug)]
pub struct Proposal {
    /// What proposed the block, and the block.
    pub source: Source,
    pub block: Vec<u32>,
    /// Leading block tokens drafted ahead in the previous round
    /// ([`propose_continuing`]); the draft's steps cover the rest.
    pub reused: usize,
    /// Tokens drafted past the block while its verify was in flight
    /// ([`draft_ahead`]): the draft's guess of the verifier's token, then
    /// what follows it. [`settle`] keeps them for the next block when the
    /// verdict accepts the whole block and its token is the guess.
    pub ahead: Vec<u32>,
    /// The draft's steps, one per block token past the `reused` ones, with
    /// what [`ProposeAsk::draft`] asked (empty unless the draft proposed).
    pub steps: Vec<Drafted>,
    /// Lookup's match for the round (`None`: not asked; `Some(0)`: none).
    pub lookup_match: Option<usize>,
    /// The draft's forwards while it proposed, and the most positions its
    /// cache held meanwhile.
    pub draft_forwards: Vec<DraftForward>,
    pub draft_peak: usize,
    /// The context length it was proposed after.
    pub ctx_len: usize,
}

impl Proposal {
    /// No verdict came (a broken exchange, a refusal, a verdict on another
    /// block): the draft goes back to the context (its last token stays
    /// unseen, for the next step's logits).
    pub fn discard(&self, draft: &mut DraftModel<'_>) {
        draft.rollback(self.ctx_len.saturating_sub(1));
    }

    /// The lowest confidence of its draft steps ([`DraftAsk::conf`], greedy
    /// only): `None` when one was not computed or nothing was drafted.
    pub fn min_conf(&self) -> Option<f32> {
        let mut confs = self.steps.iter().map(|d| d.conf);
        let first = confs.next()??;
        confs.try_fold(first, |m, c| c.map(|c| m.min(c)))
    }
}

/// The first half of a round: plan (the proposers of [`crate::proposer`])
/// and propose a block of at most `ask.k` tokens after `ctx` (the prompt
/// and the output so far; `ask.k = 0`: no proposal, an empty block from
/// [`Source::Nothing`]). The draft's cache then holds `ctx` and the block
/// but its last token.
pub fn propose(st: &mut RoundState<'_, '_>, ctx: &[u32], ask: ProposeAsk) -> Result<Proposal> {
    propose_continuing(st, ctx, ask, Vec::new())
}

/// [`propose`], continuing from `ahead`: the tokens the last round's
/// [`settle`] kept ([`EngineRound::ahead`], pipelined drafting), drafted
/// after `ctx` by the draft model (whose cache holds `ctx` and them but the
/// last). The block starts with them (at most `ask.k`; the rest stay
/// drafted past the block, [`Proposal::ahead`]) and the draft proposes what
/// is left. Only the draft model continues a block: `ahead` with another
/// proposer is an error.
pub fn propose_continuing(
    st: &mut RoundState<'_, '_>,
    ctx: &[u32],
    ask: ProposeAsk,
    mut ahead: Vec<u32>,
) -> Result<Proposal> {
    let plan = if !ahead.is_empty() {
        if ask.proposer != ProposerKind::Draft || ask.k == 0 {
            return Err(ModelError::InvalidArgument(format!(
                "a block continues drafted-ahead tokens with the draft model and k > 0, \
                 not {:?} and k = {}",
                ask.proposer, ask.k
            )));
        }
        // The draft drafts what the kept tokens leave of the block.
        Plan {
            source: Source::Draft,
            len: ask.k.saturating_sub(ahead.len()),
            lookup: Vec::new(),
            lookup_match: None,
        }
    } else if ask.k == 0 {
        Plan {
            source: Source::Nothing,
            len: 0,
            lookup: Vec::new(),
            lookup_match: None,
        }
    } else {
        if ask.proposer != ProposerKind::Draft {
            st.index.extend(ctx);
        }
        let draft = &*st.draft;
        plan_round(
            ask.proposer,
            st.index,
            ctx,
            ask.k,
            ask.room_out,
            st.chooser,
            || draft.backlog(ctx),
        )
    };
    // The block's first tokens are the kept ones (at most k); the rest of
    // them stay drafted past it.
    let reused = ahead.len().min(ask.k);
    let past = ahead.split_off(reused);
    let mut draft_forwards = Vec::new();
    let (block, steps) = match plan.source {
        Source::Draft => {
            let continued;
            let history = if ahead.is_empty() {
                ctx
            } else {
                continued = [ctx, &ahead[..]].concat();
                &continued[..]
            };
            let steps = st.draft.propose(
                history,
                plan.len,
                &st.cfg.sampling,
                ask.draft,
                st.stats,
                st.chooser,
                &mut draft_forwards,
            )?;
            ahead.extend(steps.iter().map(|d| d.token));
            (ahead, steps)
        }
        Source::Lookup => {
            // The draft model does not run (it catches up when it is
            // needed). Cut at the first token the grammar refuses.
            let mut block = plan.lookup;
            let n = st.draft.allowed(ctx, &block)?;
            block.truncate(n);
            (block, Vec::new())
        }
        // No proposal: the verifier's next token (k = 0).
        Source::Nothing => (Vec::new(), Vec::new()),
    };
    Ok(Proposal {
        source: plan.source,
        block,
        reused,
        ahead: past,
        steps,
        lookup_match: plan.lookup_match,
        draft_forwards,
        draft_peak: st.draft.cache.len(),
        ctx_len: ctx.len(),
    })
}

/// One draft step past `p`'s block while its verify is in flight
/// (pipelined drafting): the draft's token after `ctx`, the block and what
/// it drafted ahead so far, appended to [`Proposal::ahead`]. The first is
/// its guess of the verifier's token (its argmax, or in sampled mode its
/// keyed draw, whose key the target's shares). Counted as a draft forward;
/// not timed for the proposers' estimates (it runs beside the verify).
pub fn draft_ahead(st: &mut RoundState<'_, '_>, ctx: &[u32], p: &mut Proposal) -> Result<u32> {
    if p.source != Source::Draft || p.block.is_empty() {
        return Err(ModelError::InvalidArgument(
            "only a block the draft model proposed is drafted past".into(),
        ));
    }
    let mut hist = ctx.to_vec();
    hist.extend_from_slice(&p.block);
    hist.extend_from_slice(&p.ahead);
    let held = st.draft.cache.len().min(hist.len() - 1);
    let d = st
        .draft
        .step(&hist[held..], &hist, &st.cfg.sampling, DraftAsk::default())?;
    st.stats.draft_forwards += 1;
    p.ahead.push(d.token);
    p.draft_peak = p.draft_peak.max(st.draft.cache.len());
    Ok(d.token)
}

/// The second half of a round: applies `v`, the verdict on `p` (which took
/// `verify_time`): counts it, rolls the draft back to what was accepted,
/// emits the accepted tokens and the verifier's to `out`. When the verdict
/// accepts the whole block and its token is the first drafted ahead
/// ([`draft_ahead`]), the draft keeps the rest ([`EngineRound::ahead`]: the
/// next block starts with them, [`propose_continuing`]). A verdict that
/// accepts more than the block is an error (nothing emitted or counted but
/// the verifier's forward; the draft back to the context).
pub fn settle(
    st: &mut RoundState<'_, '_>,
    p: Proposal,
    v: BlockVerdict,
    verify_time: std::time::Duration,
    out: &mut dyn RoundOutput,
) -> Result<EngineRound> {
    st.stats.target_forwards += 1;
    let n = v.accepted;
    if n > p.block.len() {
        p.discard(st.draft);
        return Err(ModelError::InvalidArgument(format!(
            "the verifier accepted {n} of {} tokens",
            p.block.len()
        )));
    }
    st.stats.record_round(p.block.len(), n);
    st.stats.proposers.record(p.source, p.block.len(), n);
    st.chooser
        .observe(p.source, p.lookup_match, p.block.len(), n);
    // The context's last token and block[..n] are final; with the whole
    // block accepted and the guess right, so is the guess, and the draft's
    // cache (context, block, ahead but its last) stays.
    let guessed = n == p.block.len() && p.ahead.first() == Some(&v.next_token);
    if !guessed {
        st.draft.rollback(p.ctx_len + n);
    }
    let mut logprobs = v.logprobs.map(Vec::into_iter);
    let mut lp = || logprobs.as_mut().and_then(Iterator::next);
    let mut going = true;
    for &d in &p.block[..n] {
        if !out.emit_verified(d, lp()) {
            going = false;
            break;
        }
    }
    if going {
        going = out.emit_verified(v.next_token, lp());
    }
    let ahead = match (guessed, going) {
        (true, true) => p.ahead[1..].to_vec(),
        (true, false) => {
            // The generation ended: the draft holds only what was emitted.
            st.draft.rollback(p.ctx_len + n);
            Vec::new()
        }
        (false, _) => Vec::new(),
    };
    Ok(EngineRound {
        source: p.source,
        block: p.block,
        reused: p.reused,
        ahead,
        lookup_match: p.lookup_match,
        accepted: n,
        next_token: v.next_token,
        draft_forwards: p.draft_forwards,
        draft_peak: p.draft_peak,
        verify_time,
    })
}

/// The one speculative round, over borrowed state: [`propose`] a block of
/// at most `k` tokens with the generation's proposer (`room_out`: output
/// tokens left, for `auto`), have `verifier` judge it, [`settle`] the
/// verdict (roll the draft back to what was accepted, emit the accepted
/// tokens and the verifier's, count). `k = 0` means no proposal: no
/// proposer is asked, the block is empty and the round is the verifier's
/// next token alone ([`Source::Nothing`], counted as a round with nothing
/// drafted and in [`ProposerStats::none_rounds`]; the edge's cloud-streamed
/// rounds). Without a verdict (a broken exchange, a refusal) the draft is
/// rolled back to the context and nothing is emitted or counted; the error
/// says which.
pub fn round<V: BlockVerifier + ?Sized>(
    mut st: RoundState<'_, '_>,
    k: usize,
    room_out: usize,
    out: &mut dyn RoundOutput,
    verifier: &mut V,
) -> std::result::Result<EngineRound, VerifyError<V::Broken, V::Refusal>> {
    let ctx = out.context();
    let ask = ProposeAsk {
        proposer: st.cfg.proposer,
        k,
        room_out,
        draft: DraftAsk::default(),
    };
    let p = propose(&mut st, ctx, ask)?;
    let t = Instant::now();
    let v = match verifier.verify(ctx, &p.block) {
        Ok(v) => v,
        Err(e) => {
            p.discard(st.draft);
            return Err(e);
        }
    };
    let verify_time = t.elapsed();
    st.chooser.target_forward(p.block.len() + 1, verify_time);
    Ok(settle(&mut st, p, v, verify_time, out)?)
}

/// A [`SpecEngine`]'s context, emitter and caller as a [`RoundOutput`].
struct LocalOutput<'x, 'b> {
    ctx: &'x mut Vec<u32>,
    em: &'x mut Emitter,
    stop_tokens: &'x [u32],
    index: Option<&'x mut NgramIndex>,
    on_token: &'x mut OnToken<'b>,
}

impl RoundOutput for LocalOutput<'_, '_> {
    fn context(&self) -> &[u32] {
        self.ctx
    }

    fn emit_verified(&mut self, t: u32, _logprobs: Option<TokenLogprobs>) -> bool {
        let on_token = &mut self.on_token;
        let going = self.em.emit(self.stop_tokens, self.ctx, t, |_| on_token(t));
        if going {
            if let Some(index) = self.index.as_mut() {
                index.extend(self.ctx);
            }
        }
        going
    }
}

/// One speculative generation, round by round, against any
/// [`BlockVerifier`]: the context, the draft, the proposers' state
/// (lookup's n-gram index, `auto`'s estimates), the emitter and the
/// statistics. The verifier must hold the context less its last token
/// when a round starts (then every round keeps it so).
pub struct SpecEngine<'m, 'a, 'b> {
    cfg: GenerateConfig,
    draft: DraftModel<'m>,
    ctx: Vec<u32>,
    em: Emitter,
    index: NgramIndex,
    chooser: AutoChooser,
    stats: GenStats,
    start: Instant,
    on_token: &'a mut OnToken<'b>,
}

impl<'m, 'a, 'b> SpecEngine<'m, 'a, 'b> {
    /// A generation of `prompt` with `draft` (its cache at `cfg.draft_kv`)
    /// proposing; `verifier_capacity`: the positions the verifier holds.
    /// `on_token` receives every emitted token (false: cancel).
    pub fn new(
        draft: &'m Model,
        prompt: &[u32],
        cfg: &GenerateConfig,
        verifier_capacity: usize,
        on_token: &'a mut OnToken<'b>,
    ) -> Result<Self> {
        cfg.validate()?;
        let cfg = cfg.for_prompt(prompt.len());
        let mut draft = DraftModel::new(draft, cfg.draft_kv);
        draft.guide = DraftModel::guide_for(&cfg, prompt.len())?;
        let capacity = verifier_capacity.min(draft.cache.capacity());
        check_prompt(prompt, capacity)?;
        let mut index = NgramIndex::new();
        index.extend(prompt);
        Ok(Self {
            em: Emitter::new(prompt.len(), cfg.max_tokens, capacity),
            cfg,
            draft,
            ctx: prompt.to_vec(),
            index,
            chooser: AutoChooser::default(),
            stats: GenStats {
                prompt_tokens: prompt.len(),
                ..GenStats::default()
            },
            start: Instant::now(),
            on_token,
        })
    }

    /// The prompt and the output so far.
    pub fn context(&self) -> &[u32] {
        &self.ctx
    }

    pub fn output(&self) -> &[u32] {
        &self.ctx[self.em.prompt_len..]
    }

    /// Why the generation ended (`None`: it goes on).
    pub fn stop(&self) -> Option<StopReason> {
        self.em.stop
    }

    /// The statistics so far (a caller counts the forwards it runs itself,
    /// such as the target's prefill).
    pub fn stats_mut(&mut self) -> &mut GenStats {
        &mut self.stats
    }

    /// Emits a token the verifier produced without a block (the local
    /// target's first token, from its prefill).
    pub fn emit_verified(&mut self, t: u32) {
        LocalOutput {
            ctx: &mut self.ctx,
            em: &mut self.em,
            stop_tokens: &self.cfg.stop_tokens,
            index: Some(&mut self.index),
            on_token: &mut *self.on_token,
        }
        .emit_verified(t, None);
    }

    /// One round of at most `k` proposed tokens (fewer near the end of the
    /// output or the cache; `k = 0`: no proposal, the verifier's next token
    /// alone): the core's [`round`]. `None` when the generation has ended
    /// (the context is full: `stop` says so).
    pub fn round<V: BlockVerifier + ?Sized>(
        &mut self,
        k: usize,
        verifier: &mut V,
    ) -> std::result::Result<Option<EngineRound>, VerifyError<V::Broken, V::Refusal>> {
        if self.em.stop.is_some() {
            return Ok(None);
        }
        // Never draft past the cache or past max_tokens (+1 for the token
        // the verifier adds).
        let room_cache = self.em.capacity.saturating_sub(self.ctx.len());
        let room_out = self.cfg.max_tokens.saturating_sub(self.output().len());
        if room_cache == 0 {
            self.em.stop = Some(StopReason::ContextFull);
            return Ok(None);
        }
        let k = k.min(room_cache).min(room_out.max(1));
        let st = RoundState {
            cfg: &self.cfg,
            draft: &mut self.draft,
            index: &mut self.index,
            chooser: &mut self.chooser,
            stats: &mut self.stats,
        };
        let mut out = LocalOutput {
            ctx: &mut self.ctx,
            em: &mut self.em,
            stop_tokens: &self.cfg.stop_tokens,
            index: None,
            on_token: &mut *self.on_token,
        };
        round(st, k, room_out, &mut out, verifier).map(Some)
    }

    /// The result: the output, why it ended, the statistics.
    pub fn finish(self) -> Generation {
        let mut stats = self.stats;
        let tokens = self.ctx[self.em.prompt_len..].to_vec();
        stats.generated_tokens = tokens.len();
        stats.finish(self.start, self.em.first);
        Generation {
            tokens,
            stop: self.em.stop.unwrap_or(StopReason::MaxTokens),
            stats,
        }
    }
}
