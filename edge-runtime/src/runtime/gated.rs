//! Uncertainty-gated rounds (`[gate]`, [`crate::config::GateConfig`]; greedy
//! only), on the generation core's round in its two halves
//! (`tandem_model::engine::propose` and `engine::settle`).
//!
//! Each round has the draft model propose a block as usual
//! (`engine::propose`, whatever the generation's proposer), noting the
//! draft's top-1 probability of every token. When all of them reach
//! `gate.confidence` (and the gated span stays within `gate.max_span` and
//! within one verify block with the next block), the block is shown at once
//! as **provisional** and nothing is sent. The next block that is not gated
//! goes out together with the waiting span ([`GatedVerifier`]: one `Draft`
//! from the start of the span): the verifier (whose context still ends where
//! the span starts) checks span and block in one forward pass.
//!
//! - Verdict accepts the whole span: a `ProvisionalChecked` event with no
//!   mismatches, then the core settles the block (`engine::settle`): its
//!   accepted drafts and the verifier's token as verified, exactly as in a
//!   plain round.
//! - Verdict stops inside the span ([`SpanBreak::StoppedInSpan`], the
//!   verifier's own outcome): the shown token there differs from the
//!   target's. It stays shown (streamed text is final) and is reported as a
//!   mismatch; the block is dropped, the verifier's session is moved to the
//!   shown context (`Resume`), and the rest of the span is checked as after
//!   an outage. What follows is the target's greedy output given the shown
//!   text.
//!
//! A span still waiting when the generation ends is verified in one last pass
//! (`super::drive`). The trade-off (round trips saved against shown tokens
//! that turn out wrong) is measured in docs/lab.md, "Uncertainty-gated
//! verification".

use super::connection::{draft_positions, RemoteVerifier, Step};
use super::generation::Generation;
use super::round::{ms, Apply, RoundOutcome, Rounds};
use crate::client::NetError;
use crate::error::EdgeError;
use crate::report::TokenStatus;
use std::time::Instant;
use tandem_model::engine::{
    self, BlockVerdict, BlockVerifier, DraftAsk, ProposeAsk, RoundOutput, VerifyError,
};
use tandem_model::proposer::ProposerKind;
use tandem_model::speculative::StopReason;
use tandem_model::ModelError;

/// Why a gated verify gave no verdict on the block.
#[derive(Debug, thiserror::Error)]
pub(super) enum SpanBreak {
    /// The exchange broke, as in a plain round.
    #[error("{0}")]
    Exchange(NetError),
    /// The verdict stopped inside the waiting provisional span: `at` of its
    /// tokens were accepted, and the target's token there, `next_token`,
    /// is not the one shown.
    #[error("the verifier disagrees with shown token {at} of the provisional span")]
    StoppedInSpan { at: usize, next_token: u32 },
}

/// The remote verifier with the gated span waiting before the block: each
/// verify sends `ctx[span_start..]` (the span, shown provisional) and the
/// block as one `Draft` after `ctx[..span_start]` (what the verifier
/// holds), and reports the verdict on the block, or that the verifier
/// stopped inside the span ([`SpanBreak::StoppedInSpan`]), or a broken
/// exchange or a refusal as [`RemoteVerifier`] does. It changes nothing of
/// the generation.
pub(super) struct GatedVerifier<'c, 'a> {
    pub(super) remote: RemoteVerifier<'c, 'a>,
    /// Where the waiting span starts in the context.
    pub(super) span_start: usize,
}

impl BlockVerifier for GatedVerifier<'_, '_> {
    type Broken = SpanBreak;
    type Refusal = EdgeError;

    fn verify(
        &mut self,
        ctx: &[u32],
        block: &[u32],
    ) -> Result<BlockVerdict, VerifyError<SpanBreak, EdgeError>> {
        let Some(span) = ctx.get(self.span_start..) else {
            return Err(VerifyError::Model(ModelError::InvalidArgument(format!(
                "the gated span starts at {}, past the context's {} tokens",
                self.span_start,
                ctx.len()
            ))));
        };
        let g = span.len();
        let mut tokens = span.to_vec();
        tokens.extend_from_slice(block);
        let v = match self.remote.verify(&ctx[..self.span_start], &tokens) {
            Ok(v) => v,
            Err(VerifyError::Broken(e)) => return Err(VerifyError::Broken(SpanBreak::Exchange(e))),
            Err(VerifyError::Refused(e)) => return Err(VerifyError::Refused(e)),
            Err(VerifyError::Model(e)) => return Err(VerifyError::Model(e)),
        };
        if v.accepted < g {
            return Err(VerifyError::Broken(SpanBreak::StoppedInSpan {
                at: v.accepted,
                next_token: v.next_token,
            }));
        }
        Ok(BlockVerdict {
            accepted: v.accepted - g,
            next_token: v.next_token,
            // The span's tokens are shown already: the block's logprobs.
            logprobs: v.logprobs.map(|mut l| l.split_off(g.min(l.len()))),
        })
    }
}

/// One gated round; `None` when nothing is left to commit (the block was
/// shown gated, a span was checked, or the exchange failed).
pub(super) fn round(
    r: &mut Rounds<'_>,
    run: &mut Generation<'_, '_>,
) -> Result<Option<RoundOutcome>, EdgeError> {
    if run.check.is_none() {
        run.gated = false;
    } else if !run.gated {
        // A provisional span from an outage: checked on its own first.
        r.check_provisional(run)?;
        return Ok(None);
    }
    let gen = run.gen;
    let room_out = gen.max_tokens.saturating_sub(run.out_len());
    // The gated span waiting for verification is out[p..].
    let p = match &run.check {
        Some(c) => c.next,
        None => run.out_len(),
    };
    let g = run.out_len() - p;
    let limit = r.limit(run, g);
    if limit == 0 {
        if g > 0 {
            r.check_provisional(run)?;
        } else {
            run.stop = Some(StopReason::ContextFull);
        }
        return Ok(None);
    }
    // Fixed k (adaptive k is not combined with gating: refused by the config).
    let k = r.block_len(run, limit);
    let ctx_before = run.ctx.len();
    let t0 = Instant::now();
    let proposal = {
        let (parts, sink) = run.core();
        let mut st = parts.with(&mut r.spec.auto);
        let ask = ProposeAsk {
            // The gate trusts the draft model's confidence.
            proposer: ProposerKind::Draft,
            k,
            room_out,
            draft: DraftAsk {
                conf: true,
                top_logprobs: gen.top_logprobs,
            },
        };
        engine::propose(&mut st, sink.context(), ask)?
    };
    run.high_water = run.high_water.max(proposal.draft_peak);
    let draft_ms = ms(t0.elapsed());
    // (Greedy only: every step has its confidence.)
    let conf = proposal.min_conf().unwrap_or(0.0);
    let gate = &r.conn.cfg.gate;
    let gated = f64::from(conf) >= gate.confidence
        && g + k <= gate.max_span
        && g + 2 * k <= r.conn.max_block
        && room_out > k;
    if gated {
        Rounds::start_gated_span(run);
        run.stats.gated_rounds += 1;
        run.stats.gated_tokens += k as u64;
        run.note_draft_steps(ctx_before, &proposal.steps);
        for &x in &proposal.block {
            if !run.emit(x, TokenStatus::Provisional) {
                break;
            }
        }
        // The draft holds ctx + block[..k-1]: pending = [block[k-1]].
        run.resync_draft();
        return Ok(None);
    }
    let span_start = run.prompt_len + p;
    let positions = draft_positions(g + k);
    let mut verifier = GatedVerifier {
        remote: RemoteVerifier {
            conn: &mut r.conn,
            sampling: &gen.sampling,
            logprobs: gen.top_logprobs.is_some(),
            rtt: None,
            beside: None,
        },
        span_start,
    };
    let t = Instant::now();
    let res = verifier.verify(&run.ctx, &proposal.block);
    let verify_time = t.elapsed();
    let rtt = verifier.remote.rtt;
    match res {
        Ok(v) => {
            if let Some(rtt) = rtt {
                // What a verify of these rows costs the device.
                r.spec.auto.target_forward(positions, rtt);
            }
            if let Some(c) = run.check.take() {
                run.complete_check(c, true);
            }
            run.gated = false;
            let done = {
                let (parts, mut sink) = run.core();
                let mut st = parts.with(&mut r.spec.auto);
                engine::settle(&mut st, proposal, v, verify_time, &mut sink)?
            };
            run.sync_pending();
            Ok(Some(RoundOutcome {
                k,
                accepted: done.accepted,
                rtt,
                positions,
                draft_ms,
                reused: 0,
                apply: Apply::Core,
            }))
        }
        Err(VerifyError::Broken(SpanBreak::StoppedInSpan { at: n, .. })) => {
            // The shown token out[p + n] is not the target's: count the
            // verifier's pass, report the token, drop the block, follow the
            // shown text, check the rest of the span.
            r.commit(
                run,
                RoundOutcome {
                    k,
                    accepted: 0,
                    rtt,
                    positions,
                    draft_ms,
                    reused: 0,
                    apply: Apply::Nobody,
                },
            );
            run.rollback_unverified();
            if let Some(c) = run.check.as_mut() {
                c.mismatches.push(p + n);
                c.next = p + n + 1;
            }
            if let Step::Lost = r.resume_shown(run, run.prompt_len + p + n + 1)? {
                return Ok(None);
            }
            r.check_provisional(run)?;
            Ok(None)
        }
        Err(VerifyError::Broken(SpanBreak::Exchange(e))) => {
            r.lost_block(run, e)?;
            Ok(None)
        }
        Err(VerifyError::Refused(e)) => Err(e),
        Err(VerifyError::Model(e)) => Err(e.into()),
    }
}
