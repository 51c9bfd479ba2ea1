//! One generation's device side ([`Generation`]): the context, the draft
//! model and its cache, emitting tokens, applying a verdict to the draft, and
//! the final statistics. Knows nothing of the network. Emitting and drafting
//! are the generation core's (`tandem_model::engine`: [`Emitter::emit`],
//! [`DraftModel::step`]); this adds token statuses, provisional spans and
//! logprobs notes on top. [`Generation::core`] lends it to the core's round
//! (`tandem_model::engine::round`: the plain and cloud-streamed rounds; its
//! halves `engine::propose` and `engine::settle`: the gated rounds): its
//! draft side and its [`Sink`], the one emit of the edge.

use crate::breaker::RttTracker;
use crate::client::Counters;
use crate::conversation::{common_prefix, ConversationCache, Kept, KeptSession, Who};
use crate::error::EdgeError;
use crate::report::{
    EdgeEvent, EdgeGeneration, EdgeStats, ProvisionalCheck, ProvisionalReport, TokenStatus,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tandem_model::engine::{DraftAsk, DraftModel, Drafted, Emitter, RoundOutput, RoundState};
use tandem_model::kv_cache::KvCache;
use tandem_model::logprobs::TokenLogprobs;
use tandem_model::proposer::{AutoChooser, NgramIndex};
use tandem_model::speculative::{GenStats, GenerateConfig, StopReason};
use tandem_model::transformer::Model;

/// Progress of checking a provisional span.
pub(super) struct Check {
    pub(super) start: usize,
    pub(super) next: usize,
    pub(super) mismatches: Vec<usize>,
}

/// One generation's device-side state: the context, the draft model's cache and
/// what has been emitted. Invariant: the draft cache plus `pending` hold
/// exactly `ctx` (pending: tokens the draft has not run yet, never empty),
/// or, after a pipelined round that kept tokens drafted ahead, `ctx` and
/// `ahead`.
/// `stop`, `first` and `capacity` are the core's [`Emitter`] state (kept as
/// fields: the connection shrinks `capacity` to the verifier's).
pub(super) struct Generation<'a, 'b> {
    /// The draft model and its cache.
    pub(super) draft: DraftModel<'a>,
    pub(super) gen: &'a GenerateConfig,
    pub(super) prompt_len: usize,
    pub(super) ctx: Vec<u32>,
    pub(super) statuses: Vec<TokenStatus>,
    pub(super) pending: Vec<u32>,
    pub(super) capacity: usize,
    pub(super) stop: Option<StopReason>,
    pub(super) on_event: &'a mut (dyn FnMut(&EdgeEvent) -> bool + 'b),
    pub(super) stats: EdgeStats,
    pub(super) report: ProvisionalReport,
    pub(super) check: Option<Check>,
    /// The open `check` is a gated span (verified with the next block sent).
    pub(super) gated: bool,
    pub(super) start: Instant,
    pub(super) first: Option<Instant>,
    /// The verifier session a kept conversation left (taken by `generate`).
    pub(super) continuation: Option<KeptSession>,
    /// Most positions `cache` has held (for the conversation cache's budget).
    pub(super) high_water: usize,
    /// Prompt lookup's n-gram index over `ctx` (`lookup`/`auto`; extended as
    /// the context grows).
    pub(super) lookup: NgramIndex,
    /// The caller's cancel flag (`EdgeRuntime::set_cancel_flag`).
    pub(super) cancel: Option<Arc<AtomicBool>>,
    /// Pipelined drafting: tokens drafted past the context that the next
    /// block starts with (`tandem_model::engine::EngineRound::ahead`), valid
    /// while the context has `ahead_at` tokens.
    pub(super) ahead: Vec<u32>,
    pub(super) ahead_at: usize,
    /// Logprobs of tokens not emitted yet, by context position (only with
    /// `gen.top_logprobs`): the draft's of its draws ([`Self::draft_next`])
    /// and the target's of verdicts ([`Self::note_target_logprobs`]);
    /// [`Self::emit`] attaches the one of its position, token and source.
    pub(super) noted: Vec<Noted>,
}

/// Logprobs noted for the token `lp.token` at context position `pos`.
pub(super) struct Noted {
    pub(super) pos: usize,
    /// From the target (a verdict) rather than the draft.
    pub(super) target: bool,
    pub(super) lp: TokenLogprobs,
}

/// The logprobs in `noted` for token `t` at context position `pos`, from the
/// target or the draft; drops every note before that position.
fn take_noted(
    noted: &mut Vec<Noted>,
    pos: usize,
    t: u32,
    target: bool,
) -> Option<Box<TokenLogprobs>> {
    let found = noted
        .iter()
        .rposition(|n| n.pos == pos && n.target == target && n.lp.token == t)
        .map(|i| Box::new(noted.swap_remove(i).lp));
    noted.retain(|n| n.pos > pos);
    found
}

/// Keeps `n` until its token is emitted or passed (the oldest go first
/// past [`MAX_NOTED`]).
fn note(noted: &mut Vec<Noted>, n: Noted) {
    if noted.len() >= MAX_NOTED {
        noted.remove(0);
    }
    noted.push(n);
}

/// The draft side of a [`Generation`] (borrowed apart from its [`Sink`]):
/// with `auto`'s estimates, the state of the core's round.
pub(super) struct DraftParts<'s, 'a> {
    gen: &'s GenerateConfig,
    draft: &'s mut DraftModel<'a>,
    lookup: &'s mut NgramIndex,
    stats: &'s mut GenStats,
}

impl<'s, 'a> DraftParts<'s, 'a> {
    /// The core round's state, with `auto` (`auto`'s estimates, kept by the
    /// runtime across generations).
    pub(super) fn with(self, auto: &'s mut AutoChooser) -> RoundState<'s, 'a> {
        RoundState {
            cfg: self.gen,
            draft: self.draft,
            index: self.lookup,
            chooser: auto,
            stats: self.stats,
        }
    }
}

/// Where a [`Generation`]'s tokens go: its context, their statuses and
/// noted logprobs, and the caller's `on_event`, under the core's emit rule.
pub(super) struct Sink<'s, 'b> {
    gen: &'s GenerateConfig,
    prompt_len: usize,
    capacity: usize,
    ctx: &'s mut Vec<u32>,
    statuses: &'s mut Vec<TokenStatus>,
    noted: &'s mut Vec<Noted>,
    on_event: &'s mut (dyn FnMut(&EdgeEvent) -> bool + 'b),
    stop: &'s mut Option<StopReason>,
    first: &'s mut Option<Instant>,
}

impl Sink<'_, '_> {
    /// The one emit of the edge: the core's rule ([`Emitter::emit`]), the
    /// token as `status`, with the logprobs noted for it.
    fn emit(&mut self, t: u32, status: TokenStatus) -> bool {
        let mut em = Emitter {
            prompt_len: self.prompt_len,
            max_tokens: self.gen.max_tokens,
            capacity: self.capacity,
            stop: *self.stop,
            first: *self.first,
        };
        let prompt_len = self.prompt_len;
        let (noted, statuses, on_event) =
            (&mut *self.noted, &mut *self.statuses, &mut *self.on_event);
        let going = em.emit(&self.gen.stop_tokens, self.ctx, t, |index| {
            let target = status == TokenStatus::Verified;
            let logprobs = take_noted(noted, prompt_len + index, t, target);
            statuses.push(status);
            on_event(&EdgeEvent::Token {
                index,
                id: t,
                status,
                logprobs,
            })
        });
        *self.stop = em.stop;
        *self.first = em.first;
        going
    }
}

/// The core's round emits verified tokens, with the target's logprobs
/// when its verdict carried them.
impl RoundOutput for Sink<'_, '_> {
    fn context(&self) -> &[u32] {
        self.ctx
    }

    fn emit_verified(&mut self, t: u32, logprobs: Option<TokenLogprobs>) -> bool {
        if let Some(lp) = logprobs.filter(|lp| lp.token == t) {
            let pos = self.ctx.len();
            note(
                self.noted,
                Noted {
                    pos,
                    target: true,
                    lp,
                },
            );
        }
        self.emit(t, TokenStatus::Verified)
    }
}

/// Most logprobs [`Generation::noted`] keeps (the oldest go first): more than
/// a block drafted ahead and a verdict's.
const MAX_NOTED: usize = 4 * tandem_model::speculative::MAX_K;

/// Rows per forward of the draft's prompt prefill when a cancel flag is set
/// (the flag is asked between chunks). A row's result does not depend on the
/// other rows of its forward (the kernel contract, model/src/quant/mod.rs),
/// so chunks leave the same KV as one forward.
pub(super) const PREFILL_CHUNK: usize = 256;

/// How [`feed_chunks`] cuts `pending` into forwards.
pub(super) struct Feed {
    /// Feed while more than this many tokens are pending.
    pub(super) while_more_than: usize,
    /// Tokens a chunk never takes from the end (1: the last one, which the
    /// draft's next step runs for its logits).
    pub(super) leave: usize,
    /// Most rows per forward.
    pub(super) chunk: usize,
}

/// What [`feed_chunks`] did.
pub(super) struct Fed {
    pub(super) rows: usize,
    pub(super) forwards: u64,
    /// `stop` answered true before the work was done.
    pub(super) stopped: bool,
}

/// The one chunked prefill of the draft: runs the front of `pending` into
/// its cache, `feed.chunk` rows per forward, asking `stop` before each
/// forward. A generation's prompt and backlog prefill (`Generation`) and the
/// idle catch-up between turns (`EdgeRuntime::catch_up`) both go through it.
/// A row's result does not depend on the other rows of its forward (the
/// kernel contract, model/src/quant/mod.rs), so the chunks leave the same KV
/// as one forward, or as the draft step that would have run them.
pub(super) fn feed_chunks(
    draft: &mut DraftModel<'_>,
    pending: &mut Vec<u32>,
    feed: Feed,
    stop: &mut dyn FnMut() -> bool,
) -> Result<Fed, EdgeError> {
    let mut fed = Fed {
        rows: 0,
        forwards: 0,
        stopped: false,
    };
    while pending.len() > feed.while_more_than {
        if stop() {
            fed.stopped = true;
            break;
        }
        let n = (pending.len() - feed.leave).min(feed.chunk.max(1));
        if n == 0 {
            break;
        }
        let chunk: Vec<u32> = pending.drain(..n).collect();
        draft.feed(&chunk)?;
        fed.rows += n;
        fed.forwards += 1;
    }
    Ok(fed)
}

impl<'a, 'b> Generation<'a, 'b> {
    /// A generation of `prompt` as a turn of `conversation`: takes its kept
    /// state from `conversations` (which gives none when disabled) and puts
    /// it back when the request is refused, so a refusal loses nothing.
    pub(super) fn begin(
        draft: &'a Model,
        conversations: &mut ConversationCache,
        conversation: Who<'_>,
        prompt: &[u32],
        gen: &'a GenerateConfig,
        on_event: &'a mut (dyn FnMut(&EdgeEvent) -> bool + 'b),
    ) -> Result<Self, EdgeError> {
        let mut kept = conversations.take(conversation, prompt);
        Self::new(draft, prompt, gen, on_event, &mut kept).inspect_err(|_| {
            if let Some(k) = kept.take() {
                conversations.put(conversation, k);
            }
        })
    }

    /// A generation of `prompt`; with `kept` (a conversation's earlier turn)
    /// its draft KV is reused for the longest common prefix, exactly. `kept`
    /// is taken only once the request is valid (a refused request leaves the
    /// conversation's state where it was).
    pub(super) fn new(
        draft: &'a Model,
        prompt: &[u32],
        gen: &'a GenerateConfig,
        on_event: &'a mut (dyn FnMut(&EdgeEvent) -> bool + 'b),
        kept: &mut Option<Kept>,
    ) -> Result<Self, EdgeError> {
        gen.validate()?;
        let capacity = draft.max_seq_len();
        if prompt.is_empty() {
            return Err(EdgeError::Model(tandem_model::ModelError::InvalidArgument(
                "the prompt is empty".into(),
            )));
        }
        if prompt.len() >= capacity {
            return Err(EdgeError::Model(
                tandem_model::ModelError::SequenceTooLong {
                    needed: prompt.len() + 1,
                    capacity,
                },
            ));
        }
        // The draft's KV in the generation's precision (`draft_kv`, f16 by
        // default: it changes acceptance only, never a verified token).
        let fresh = draft.new_cache_with(gen.draft_kv);
        let (mut cache, reuse, continuation, high_water, caught_up) = match kept.take() {
            Some(k)
                if k.cache.capacity() == fresh.capacity()
                    && k.cache.precision() == fresh.precision() =>
            {
                // Keep at least the prompt's last token to run (its logits).
                let reuse = common_prefix(&k.tokens, prompt)
                    .min(k.cache.len())
                    .min(prompt.len().saturating_sub(1));
                // Of those, the rows the idle catch-up computed (the cache's
                // last `caught_up`).
                let caught_up =
                    reuse.saturating_sub(k.cache.len() - k.caught_up.min(k.cache.len()));
                (k.cache, reuse, k.session, k.high_water, caught_up)
            }
            Some(k) => (fresh, 0, k.session, 0, 0),
            None => (fresh, 0, None, 0, 0),
        };
        cache.truncate(reuse);
        let stop = Emitter::new(prompt.len(), gen.max_tokens, capacity).stop;
        // Structured output: the draft's own constraint masks every token it
        // drafts, provisional and local ones included.
        let guide = DraftModel::guide_for(gen, prompt.len())?;
        Ok(Self {
            draft: DraftModel {
                model: draft,
                cache,
                guide,
            },
            gen,
            prompt_len: prompt.len(),
            ctx: prompt.to_vec(),
            statuses: Vec::new(),
            pending: prompt[reuse..].to_vec(),
            capacity,
            stop,
            on_event,
            stats: EdgeStats {
                gen: GenStats {
                    prompt_tokens: prompt.len(),
                    ..GenStats::default()
                },
                draft_reused_tokens: reuse,
                draft_prefill_tokens: prompt.len() - reuse,
                draft_caught_up_tokens: caught_up,
                ..EdgeStats::default()
            },
            report: ProvisionalReport::default(),
            check: None,
            gated: false,
            start: Instant::now(),
            first: None,
            continuation,
            high_water,
            lookup: NgramIndex::new(),
            cancel: None,
            ahead: Vec::new(),
            ahead_at: 0,
            noted: Vec::new(),
        })
    }

    /// The state this turn leaves for the conversation's next one: the draft
    /// KV, cut to the context (a stop token or a cancelled block may have run
    /// past it), and the context.
    pub(super) fn take_kept(&mut self, session: Option<KeptSession>) -> Kept {
        let mut cache = std::mem::replace(&mut self.draft.cache, KvCache::new(0, 0, 0, 0));
        let high_water = self.high_water.max(cache.len());
        cache.truncate(cache.len().min(self.ctx.len()));
        Kept {
            cache,
            tokens: self.ctx.clone(),
            session,
            high_water,
            caught_up: 0,
        }
    }

    pub(super) fn out_len(&self) -> usize {
        self.ctx.len() - self.prompt_len
    }

    pub(super) fn out(&self) -> &[u32] {
        &self.ctx[self.prompt_len..]
    }

    /// Emits one token (already in the draft's view via `pending` by the
    /// caller) with the core's emit rule ([`Emitter::emit`]), as `status`,
    /// with the logprobs noted for it; false when generation must end.
    pub(super) fn emit(&mut self, t: u32, status: TokenStatus) -> bool {
        self.core().1.emit(t, status)
    }

    /// The generation as the core's round sees it
    /// (`tandem_model::engine::round`): the state a round works on (the
    /// draft, lookup's index, `auto`'s estimates in `auto`, the core's
    /// statistics) and where its tokens go ([`Sink`]), borrowed apart.
    pub(super) fn core<'s>(&'s mut self) -> (DraftParts<'s, 'a>, Sink<'s, 'b>) {
        let Generation {
            draft,
            gen,
            prompt_len,
            ctx,
            statuses,
            capacity,
            stop,
            on_event,
            stats,
            first,
            lookup,
            noted,
            ..
        } = self;
        let gen: &'a GenerateConfig = gen;
        (
            DraftParts {
                gen,
                draft,
                lookup,
                stats: &mut stats.gen,
            },
            Sink {
                gen,
                prompt_len: *prompt_len,
                capacity: *capacity,
                ctx,
                statuses,
                noted,
                on_event: &mut **on_event,
                stop,
                first,
            },
        )
    }

    /// Notes logprobs for the token at context position `pos` (kept until
    /// it is emitted or passed).
    fn note(&mut self, pos: usize, target: bool, lp: TokenLogprobs) {
        note(&mut self.noted, Noted { pos, target, lp });
    }

    /// Notes the target's logprobs of a verdict's emitted tokens: `lps[i]`
    /// for `emitted[i]` at context position `start + i`.
    pub(super) fn note_target_logprobs(
        &mut self,
        start: usize,
        emitted: &[u32],
        lps: Vec<TokenLogprobs>,
    ) {
        for (i, lp) in lps.into_iter().enumerate() {
            if emitted.get(i) == Some(&lp.token) {
                self.note(start + i, true, lp);
            }
        }
    }

    /// Whether the caller's cancel flag is set (then the generation stops as
    /// cancelled).
    pub(super) fn cancel_requested(&mut self) -> bool {
        let c = self
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::SeqCst));
        if c && self.stop.is_none() {
            self.stop = Some(StopReason::Cancelled);
        }
        c
    }

    /// With a cancel flag set: runs all but the last pending token through
    /// the draft in chunks of [`PREFILL_CHUNK`], asking the flag before each.
    /// False when cancelled (the generation stops).
    pub(super) fn prefill_pending(&mut self) -> Result<bool, EdgeError> {
        if self.cancel.is_none() {
            return Ok(true);
        }
        self.feed_chunks(PREFILL_CHUNK + 1)
    }

    /// Tokens the draft has not run yet, besides the last (which its next
    /// step runs): the work [`Self::prefill_backlog`] would do.
    pub(super) fn backlog_rows(&self) -> usize {
        self.pending.len().saturating_sub(1)
    }

    /// Runs all but the last pending token through the draft in chunks of
    /// [`PREFILL_CHUNK`], asking the cancel flag (if any) before each: the
    /// device's prefill beside the verifier's (`Connection::open`). False
    /// when cancelled (the generation stops).
    pub(super) fn prefill_backlog(&mut self) -> Result<bool, EdgeError> {
        self.feed_chunks(1)
    }

    /// Feeds `pending` to the draft in chunks of up to [`PREFILL_CHUNK`]
    /// (never its last token) while more than `keep` (≥ 1) are left,
    /// asking the cancel flag first.
    fn feed_chunks(&mut self, keep: usize) -> Result<bool, EdgeError> {
        let cancel = self.cancel.clone();
        let fed = feed_chunks(
            &mut self.draft,
            &mut self.pending,
            Feed {
                while_more_than: keep.max(1),
                leave: 1,
                chunk: PREFILL_CHUNK,
            },
            &mut || cancel.as_ref().is_some_and(|c| c.load(Ordering::SeqCst)),
        );
        self.high_water = self.high_water.max(self.draft.cache.len());
        let fed = fed?;
        self.stats.gen.draft_forwards += fed.forwards;
        // (Sets `stop` when cancelled.)
        let cancelled = self.cancel_requested();
        Ok(!fed.stopped && !cancelled)
    }

    /// Runs the draft over `pending` (the core's draft step,
    /// [`DraftModel::step`]); returns its next token after `hist` (sampled:
    /// its keyed draw at position `hist.len()`, the same key the verifier's
    /// draw uses), notes its logprobs when asked. Leaves `pending = [token]`.
    pub(super) fn draft_next(&mut self, hist: &[u32]) -> Result<u32, EdgeError> {
        let ask = DraftAsk {
            conf: false,
            top_logprobs: self.gen.top_logprobs,
        };
        let d = self
            .draft
            .step(&self.pending, hist, &self.gen.sampling, ask)?;
        self.stats.gen.draft_forwards += 1;
        self.high_water = self.high_water.max(self.draft.cache.len());
        if let Some(lp) = d.logprobs {
            self.note(hist.len(), false, lp);
        }
        self.pending.clear();
        self.pending.push(d.token);
        Ok(d.token)
    }

    /// One token from the draft alone.
    pub(super) fn draft_alone(&mut self, status: TokenStatus) -> Result<(), EdgeError> {
        let hist = self.ctx.clone();
        let t = self.draft_next(&hist)?;
        if status == TokenStatus::Provisional && self.check.is_none() {
            let n = self.out_len();
            self.check = Some(Check {
                start: n,
                next: n,
                mismatches: Vec::new(),
            });
        }
        self.emit(t, status);
        Ok(())
    }

    /// After the core's round (which rolled the draft back to what it
    /// keeps): `pending` is the context the draft's cache does not hold.
    pub(super) fn sync_pending(&mut self) {
        let held = self.draft.cache.len().min(self.ctx.len());
        self.pending = self.ctx[held..].to_vec();
    }

    /// After a proposal's tokens were emitted without a verdict (shown
    /// provisional by a gated round): the draft keeps of its cache what is
    /// context less the last token, which is `pending`.
    pub(super) fn resync_draft(&mut self) {
        self.draft.rollback(self.ctx.len().saturating_sub(1));
        self.sync_pending();
    }

    /// Notes the draft's logprobs of a proposal's steps (`steps[i]` for the
    /// token at context position `start + i`), for tokens it shows.
    pub(super) fn note_draft_steps(&mut self, start: usize, steps: &[Drafted]) {
        for (i, d) in steps.iter().enumerate() {
            if let Some(lp) = d.logprobs.clone() {
                self.note(start + i, false, lp);
            }
        }
    }

    /// Undo a drafted block whose verdict never came: the draft holds `ctx`.
    pub(super) fn rollback_unverified(&mut self) {
        let keep = self.ctx.len() - 1;
        let cache = &mut self.draft.cache;
        cache.truncate(keep.min(cache.len()));
        if cache.len() < keep {
            // Cannot happen after drafting (the cache covered ctx), but stay exact.
            self.pending = self.ctx[cache.len()..].to_vec();
        } else {
            self.pending = vec![self.ctx[keep]];
        }
    }

    pub(super) fn finish(
        mut self,
        session_id: Option<String>,
        gen_rtt: &RttTracker,
        counters: Counters,
    ) -> EdgeGeneration {
        let mut s = std::mem::take(&mut self.stats);
        // Times, rates and means as every loop computes them.
        s.gen.generated_tokens = self.out_len();
        s.gen.finish(self.start, self.first);
        let count = |st| self.statuses.iter().filter(|&&x| x == st).count();
        s.verified_tokens = count(TokenStatus::Verified);
        s.provisional_tokens = count(TokenStatus::Provisional);
        s.local_tokens = count(TokenStatus::Local);
        s.rtt_mean_ms = gen_rtt.mean_ms().unwrap_or(0.0);
        s.rtt_p95_ms = gen_rtt.p95_ms().unwrap_or(0.0);
        s.bytes_sent = counters.sent;
        s.bytes_received = counters.received;
        if s.gen.generated_tokens > 0 {
            s.verifier_passes_per_token = s.verifier_passes as f64 / s.gen.generated_tokens as f64;
        }
        // A span still unchecked at the end stays in the report as unchecked.
        if let Some(c) = self.check.take() {
            let end = self.out_len();
            self.report.checked_tokens += c.next - c.start;
            self.report.mismatched_tokens += c.mismatches.len();
            if self.report.first_mismatch.is_none() {
                self.report.first_mismatch = c.mismatches.first().copied();
            }
            self.report.spans.push(ProvisionalCheck {
                start: c.start,
                end,
                mismatches: c.mismatches,
                checked: false,
            });
        }
        self.report.provisional_tokens = s.provisional_tokens;
        let stop = self.stop.unwrap_or(StopReason::MaxTokens);
        EdgeGeneration {
            tokens: self.ctx[self.prompt_len..].to_vec(),
            statuses: self.statuses,
            stop,
            stats: s,
            provisional: self.report,
            session_id,
        }
    }

    /// Records a finished span check and tells the caller.
    pub(super) fn complete_check(&mut self, c: Check, checked: bool) {
        let end = self.out_len();
        let span = ProvisionalCheck {
            start: c.start,
            end,
            mismatches: c.mismatches,
            checked,
        };
        if checked {
            self.report.checked_tokens += end - c.start;
        }
        self.report.mismatched_tokens += span.mismatches.len();
        if self.report.first_mismatch.is_none() {
            self.report.first_mismatch = span.mismatches.first().copied();
        }
        if !span.mismatches.is_empty() {
            tracing::warn!(
                start = span.start,
                end = span.end,
                mismatches = span.mismatches.len(),
                "provisional tokens differ from the verifier's"
            );
        }
        self.report.spans.push(span.clone());
        if !(self.on_event)(&EdgeEvent::ProvisionalChecked(span)) && self.stop.is_none() {
            self.stop = Some(StopReason::Cancelled);
        }
    }
}
