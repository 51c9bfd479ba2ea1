//! What every kind of round shares ([`Rounds`]): the round kind, chosen once
//! per generation ([`RoundKind`]); the outcome each round returns
//! ([`RoundOutcome`]) and the one place it is accounted ([`Rounds::commit`]:
//! what the network and adaptive k add to the core's accounting: RTT,
//! breaker, round numbers, the adaptive-k chooser, the round log); block
//! limits, a lost block, and the check of provisional spans. The kinds
//! (`super::plain`, `super::pipelined`, `super::cloud_stream`,
//! `super::gated`) use it; the loop that runs them is `super::drive`.
//!
//! It is also where what the connection reports ([`Step`], the session's
//! capacity) is applied to the generation ([`Rounds::settle`],
//! [`Rounds::open`], [`Rounds::after_open`]): the connection never touches
//! the generation itself.

use super::connection::{
    draft_positions, verdict_logprobs, Connection, Step, OPEN_BESIDE_MIN_ROWS,
};
use super::generation::{Check, Generation};
use crate::adaptive::{RoundRecord, SpecState};
use crate::client::NetError;
use crate::codec::check_verdict;
use crate::conversation::common_prefix;
use crate::error::EdgeError;
use crate::report::TokenStatus;
use std::time::Duration;
use tandem_model::engine::DraftForward;
use tandem_proto::v1::{self as pb, client_message::Msg as ClientMsg};

/// How the rounds of a generation go (chosen once, by [`RoundKind::choose`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RoundKind {
    /// Draft a block, exchange it, apply the verdict (`super::plain`).
    Plain,
    /// Keep drafting while the verify is in flight (`super::pipelined`).
    Pipelined,
    /// The verifier generates and streams, k = 0 (`super::cloud_stream`).
    CloudStreamed,
    /// Blocks the draft is sure of are shown provisional without a round
    /// trip (`super::gated`).
    Gated,
}

impl RoundKind {
    /// The kind for a generation: gating, cloud streaming and pipelining need
    /// a session that carries token ids only. Pipelining guesses the verdict's
    /// token with the draft's own (its argmax, or its keyed draw in sampled
    /// mode: the same key as the target's).
    pub(super) fn choose(gated: bool, spec: &SpecState, tokens_only: bool) -> Self {
        if !tokens_only {
            Self::Plain
        } else if gated {
            Self::Gated
        } else if spec.cfg.target_stream {
            Self::CloudStreamed
        } else if spec.cfg.pipeline {
            Self::Pipelined
        } else {
            Self::Plain
        }
    }
}

/// What one round came to.
pub(super) struct RoundOutcome {
    /// Proposed tokens the verifier judged.
    pub k: usize,
    /// Of those, accepted.
    pub accepted: usize,
    /// The round trip; `None` when the device answered the block itself (an
    /// all-local split round): no verifier pass.
    pub rtt: Option<Duration>,
    /// Positions the verifier's forward covered (sets the RTT model).
    pub positions: usize,
    /// Time spent drafting the block.
    pub draft_ms: f64,
    /// Block tokens that had been drafted ahead in the previous round.
    pub reused: usize,
    /// Who applies the verdict to the draft and emits.
    pub apply: Apply,
}

/// Who applied a round's verdict ([`RoundOutcome::apply`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Apply {
    /// The generation core's round (`tandem_model::engine::round`, or its
    /// halves) has counted it, rolled the draft back and emitted: `commit`
    /// accounts only what the network and adaptive k add.
    Core,
    /// Nobody: the caller handles the tokens (a gated span the verifier
    /// disagreed with); `commit` counts the round and the verifier's pass.
    Nobody,
}

/// Notes the target's logprobs a verdict carries for the tokens it emits on
/// `block` (the accepted drafts, then its token) at context positions
/// `start..`, when the generation asks for logprobs
/// ([`verdict_logprobs`]: one per emitted token, or a protocol error).
pub(super) fn note_verdict_logprobs(
    run: &mut Generation<'_, '_>,
    start: usize,
    block: &[u32],
    v: &pb::Verdict,
) -> Result<(), EdgeError> {
    if run.gen.top_logprobs.is_none() {
        return Ok(());
    }
    let (emitted, lps) = verdict_logprobs(block, v)?;
    run.note_target_logprobs(start, &emitted, lps);
    Ok(())
}

pub(super) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The rounds of one generation: its connection, the speculation state and
/// the kind of round.
pub(super) struct Rounds<'a> {
    pub conn: Connection<'a>,
    pub spec: &'a mut SpecState,
    pub kind: RoundKind,
}

impl Rounds<'_> {
    /// Most tokens the next block may have: the session's block limit less
    /// `reserved` (tokens sent with it), the room in the draft's cache and in
    /// the output (at least 1, for the verifier's token). 0: the context is full.
    pub(super) fn limit(&self, run: &Generation<'_, '_>, reserved: usize) -> usize {
        let room_out = run.gen.max_tokens.saturating_sub(run.out_len());
        self.conn
            .max_block
            .saturating_sub(reserved)
            .min(run.capacity.saturating_sub(run.ctx.len()))
            .min(room_out.max(1))
    }

    /// The block length of this round: the chooser's (adaptive k) or the
    /// configured k, within `limit`.
    pub(super) fn block_len(&self, run: &Generation<'_, '_>, limit: usize) -> usize {
        if self.spec.cfg.adaptive_k && self.kind != RoundKind::Gated {
            self.spec.chooser.choose(limit, run.gen.k)
        } else {
            run.gen.k.min(limit)
        }
    }

    /// Whether rounds feed the chooser and the round log
    /// ([`crate::adaptive::SpeculationConfig::active`]).
    fn tuned(&self) -> bool {
        self.spec.active()
    }

    /// Feeds the adaptive-k chooser (when on) the draft forwards of a block:
    /// the block's first forward (when `starts_block`: it also runs the
    /// verifier's token) apart from the later ones, without forwards that
    /// also (pre)filled more than a couple of pending tokens (the prompt's
    /// prefill in the first round, a catch-up after target streaming).
    pub(super) fn observe_draft_forwards(&mut self, forwards: &[DraftForward], starts_block: bool) {
        if !self.tuned() {
            return;
        }
        let (mut first, mut timed, mut timed_ms) = (None, 0usize, 0.0f64);
        for (i, f) in forwards.iter().enumerate() {
            if f.rows > 2 {
                continue;
            }
            if i == 0 && starts_block {
                first = Some(ms(f.time));
            } else {
                timed += 1;
                timed_ms += ms(f.time);
            }
        }
        self.spec
            .chooser
            .observe_draft_forwards(first, timed, timed_ms);
    }

    /// A block whose verdict never came: the draft and the codec go back to
    /// the context, and the failure is handled.
    pub(super) fn lost_block(
        &mut self,
        run: &mut Generation<'_, '_>,
        e: NetError,
    ) -> Result<(), EdgeError> {
        run.rollback_unverified();
        self.conn.codec.rollback(run.ctx.len());
        self.fail(run, e)?;
        Ok(())
    }

    /// Applies what the connection reported to the generation: an end
    /// ([`Step::Ended`]) stops it (unless it has stopped already) and is a
    /// lost session from here on.
    pub(super) fn settle(run: &mut Generation<'_, '_>, step: Step) -> Step {
        match step {
            Step::Ended(reason) => {
                run.stop.get_or_insert(reason);
                Step::Lost
            }
            s => s,
        }
    }

    /// A failed exchange: the connection reacts, the generation takes the
    /// outcome.
    pub(super) fn fail(
        &mut self,
        run: &mut Generation<'_, '_>,
        e: NetError,
    ) -> Result<Step, EdgeError> {
        let step = self.conn.fail(e)?;
        Ok(Self::settle(run, step))
    }

    /// How much of the context the next open gives the verifier: up to where
    /// the provisional span starts (it is checked next), or all of it (split
    /// sessions do not check provisional spans: the span is reported
    /// unchecked).
    fn open_upto(&mut self, run: &mut Generation<'_, '_>) -> usize {
        if !self.conn.codec.tokens_only() {
            if let Some(c) = run.check.take() {
                run.complete_check(c, false);
            }
        }
        match &run.check {
            Some(c) => run.prompt_len + c.next,
            None => run.ctx.len(),
        }
    }

    /// Opens (or resumes) the session in the foreground and waits for it.
    /// With `drafts` (the rounds run the draft) and a backlog of at least
    /// [`OPEN_BESIDE_MIN_ROWS`], the draft's backlog is prefilled while the
    /// verifier prefills.
    pub(super) fn open(
        &mut self,
        run: &mut Generation<'_, '_>,
        drafts: bool,
    ) -> Result<Step, EdgeError> {
        let upto = self.open_upto(run);
        let gen = run.gen;
        let msg = self
            .conn
            .open_message(&run.ctx, upto, gen, run.prompt_len)?;
        let beside =
            drafts && self.conn.codec.tokens_only() && run.backlog_rows() >= OPEN_BESIDE_MIN_ROWS;
        let step = if beside {
            let mut prefill = || {
                let rows = run.backlog_rows();
                let prefilled = run.prefill_backlog();
                run.stats.draft_rows_beside_open += (rows - run.backlog_rows()) as u64;
                prefilled
            };
            self.conn.open(msg, upto, gen, Some(&mut prefill))?
        } else {
            self.conn.open(msg, upto, gen, None)?
        };
        self.after_open(run, step, upto, None)
    }

    /// Starts opening the session in the background (`super::drive` drafts
    /// alone meanwhile).
    pub(super) fn spawn_open(&mut self, run: &mut Generation<'_, '_>) -> Result<(), EdgeError> {
        let upto = self.open_upto(run);
        let msg = self
            .conn
            .open_message(&run.ctx, upto, run.gen, run.prompt_len)?;
        self.conn.spawn_open(msg, run.ctx[..upto].to_vec(), run.gen);
        Ok(())
    }

    /// After an open of `ctx[..upto]` (or, with `other`, of a context
    /// `other` of `upto` tokens that is not a prefix of this generation's:
    /// an adopted open of an earlier generation): the generation takes the
    /// session's capacity, and the session is moved to where this
    /// generation needs it.
    pub(super) fn after_open(
        &mut self,
        run: &mut Generation<'_, '_>,
        step: Step,
        upto: usize,
        other: Option<&[u32]>,
    ) -> Result<Step, EdgeError> {
        if Self::settle(run, step) != Step::Ok {
            return Ok(Step::Lost);
        }
        run.capacity = run.capacity.min(self.conn.capacity);
        if let Some(held) = other {
            return self.resume_adopted(run, held);
        }
        if upto < run.ctx.len() {
            // Opened in the background while the device drafted alone.
            // `check_provisional` verifies those tokens from `upto` on
            // (greedy or keyed draws alike). Otherwise they are not
            // checked: give the verifier the rest of the context.
            let checks = self.conn.codec.tokens_only()
                && run.check.as_ref().map(|c| run.prompt_len + c.next) == Some(upto);
            if !checks {
                if let Some(c) = run.check.take() {
                    run.complete_check(c, false);
                }
                let fresh = run.ctx.len().saturating_sub(upto);
                let step = self.conn.resume_at(&run.ctx, fresh)?;
                return Ok(Self::settle(run, step));
            }
        }
        Ok(Step::Ok)
    }

    /// An adopted session holds another generation's context `held`: move it
    /// to this one's. Token sessions: to where the provisional span starts (it
    /// is checked next); split sessions leave the span unchecked and the
    /// session gets the whole context.
    fn resume_adopted(
        &mut self,
        run: &mut Generation<'_, '_>,
        held: &[u32],
    ) -> Result<Step, EdgeError> {
        let checks = self.conn.codec.tokens_only();
        let upto = match run.check.as_ref() {
            Some(c) if checks => run.prompt_len + c.next,
            _ => {
                if let Some(c) = run.check.take() {
                    run.complete_check(c, false);
                }
                run.ctx.len()
            }
        };
        let fresh = upto.saturating_sub(common_prefix(held, &run.ctx[..upto]));
        let step = self.conn.resume_at(&run.ctx[..upto], fresh.max(1))?;
        Ok(Self::settle(run, step))
    }

    /// The one place a round's outcome is accounted and applied.
    pub(super) fn commit(&mut self, run: &mut Generation<'_, '_>, o: RoundOutcome) {
        let by_core = o.apply == Apply::Core;
        if let Some(rtt) = o.rtt {
            // The round trip is what a verify of these rows costs the device
            // (the core's round has told `auto` already).
            if !by_core {
                self.spec.auto.target_forward(o.positions, rtt);
            }
            self.conn.record_rtt(rtt, o.positions);
            self.conn.success();
            // Round numbers and passes count the verifier's rounds (an
            // all-local split round has neither).
            self.conn.round += 1;
            run.stats.verifier_passes += 1;
        }
        if !by_core {
            // (A gated span the verifier stopped in: its block is dropped.)
            run.stats.gen.rounds += 1;
            run.stats.gen.drafted += o.k as u64;
            return;
        }
        let rtt_ms = o.rtt.map(ms).unwrap_or(0.0);
        let observes = matches!(self.kind, RoundKind::Plain | RoundKind::Pipelined);
        if self.tuned() && observes {
            self.spec.chooser.observe_round(o.k, o.accepted, rtt_ms);
        }
        if self.tuned() || self.kind == RoundKind::Gated {
            self.spec.rounds.push(RoundRecord {
                k: o.k,
                accepted: o.accepted,
                rtt_ms,
                draft_ms: o.draft_ms,
                reused: o.reused,
            });
        }
    }

    /// Verify-only pass over the provisional span (greedy): the verifier holds the
    /// context up to `check.next`; send the streamed tokens as drafts and compare.
    pub(super) fn check_provisional(
        &mut self,
        run: &mut Generation<'_, '_>,
    ) -> Result<Step, EdgeError> {
        loop {
            let Some(c) = run.check.as_ref() else {
                return Ok(Step::Ok);
            };
            let (p, e) = (c.next, run.out_len());
            if p >= e {
                if let Some(c) = run.check.take() {
                    run.complete_check(c, true);
                }
                return Ok(Step::Ok);
            }
            let chunk = run.out()[p..e.min(p + self.conn.max_block)].to_vec();
            let k = chunk.len();
            let draft = pb::Draft {
                round: self.conn.round,
                tokens: chunk.clone(),
                ..pb::Draft::default()
            };
            let (answer, rtt) = match self
                .conn
                .exchange(ClientMsg::Draft(draft), draft_positions(k))
            {
                Ok(a) => a,
                Err(e) => return self.fail(run, e),
            };
            let vocab = self.conn.codec.vocab();
            let v = check_verdict(answer, self.conn.round, k, run.prompt_len + p, vocab)?;
            note_verdict_logprobs(run, run.prompt_len + p, &chunk, &v)?;
            self.conn.record_rtt(rtt, draft_positions(k));
            self.conn.success();
            self.conn.round += 1;
            run.stats.check_rounds += 1;
            run.stats.verifier_passes += 1;
            let n = v.accepted as usize;
            if p + n < e {
                let differs = v.next_token != run.out()[p + n];
                if let Some(c) = run.check.as_mut() {
                    c.next = p + n + 1;
                    if differs {
                        c.mismatches.push(p + n);
                    }
                }
                if differs {
                    if let Step::Lost = self.resume_shown(run, run.prompt_len + p + n + 1)? {
                        return Ok(Step::Lost);
                    }
                }
            } else {
                // The whole rest matched; the verdict's token follows the span and
                // is the target's own: emit it (the verifier already holds it).
                if let Some(mut c) = run.check.take() {
                    c.next = e;
                    run.complete_check(c, true);
                }
                run.pending.push(v.next_token);
                run.emit(v.next_token, TokenStatus::Verified);
                return Ok(Step::Ok);
            }
        }
    }

    /// After a verdict that disagreed with a shown (provisional) token: move the
    /// verifier's session to the shown context `ctx[..upto]`.
    /// The session holds `ctx[..upto - 1]` plus the target's own token.
    pub(super) fn resume_shown(
        &mut self,
        run: &mut Generation<'_, '_>,
        upto: usize,
    ) -> Result<Step, EdgeError> {
        let step = self.conn.resume_at(&run.ctx[..upto], 1)?;
        let step = Self::settle(run, step);
        if let Step::Ok = step {
            // Part of checking provisional tokens.
            run.stats.check_rounds += 1;
        }
        Ok(step)
    }

    /// Opens a gated span at the current end of the output (if none is open).
    pub(super) fn start_gated_span(run: &mut Generation<'_, '_>) {
        if run.check.is_none() {
            let n = run.out_len();
            run.check = Some(Check {
                start: n,
                next: n,
                mismatches: Vec::new(),
            });
            run.gated = true;
        }
    }
}
