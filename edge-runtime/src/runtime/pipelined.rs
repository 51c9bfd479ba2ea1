//! Pipelined drafting, on the generation core's round in its halves
//! (`tandem_model::engine::propose_continuing` and `engine::settle`): once
//! block `d1..dk` is sent, the device keeps drafting while the verify is in
//! flight (`engine::draft_ahead`, run beside the exchange by
//! [`RemoteVerifier::beside`]), assuming full acceptance: `g` (its guess of
//! the verifier's token: its own argmax, or in sampled mode its keyed draw,
//! which the target's shares the key of), then `e1, e2, ...`. If the verdict
//! accepts all k and its token equals `g`, the core keeps `e1..` in the
//! draft cache and the next block starts with them, so the next round trip
//! leaves at once. Otherwise they are discarded (the draft cache is cut to
//! the accepted prefix), as in a plain round. Output is unaffected: every
//! emitted token still comes through a verdict.

use super::connection::{draft_positions, RemoteVerifier};
use super::generation::Generation;
use super::round::{ms, Apply, RoundOutcome, Rounds};
use crate::error::EdgeError;
use std::time::Instant;
use tandem_model::engine::{self, BlockVerifier, DraftAsk, ProposeAsk, RoundOutput, VerifyError};
use tandem_model::proposer::ProposerKind;
use tandem_model::speculative::StopReason;
use tandem_model::ModelError;

/// One pipelined round; `None` when it ended without a verdict.
pub(super) fn round(
    r: &mut Rounds<'_>,
    run: &mut Generation<'_, '_>,
) -> Result<Option<RoundOutcome>, EdgeError> {
    let limit = r.limit(run, 0);
    if limit == 0 {
        run.stop = Some(StopReason::ContextFull);
        return Ok(None);
    }
    // Drafts made ahead are valid only for the context they were made at.
    let mut ahead = std::mem::take(&mut run.ahead);
    if !ahead.is_empty() && run.ahead_at != run.ctx.len() {
        run.rollback_unverified();
        ahead.clear();
    }
    let k = r.block_len(run, limit);
    let ctx_before = run.ctx.len();
    let gen = run.gen;
    // Most tokens worth drafting (the block, the guess, the next block) and
    // room in the output and the cache: one slot of the cache stays free
    // for the verdict's token.
    let next_k = if r.spec.cfg.adaptive_k {
        r.spec.cfg.k_max
    } else {
        gen.k
    };
    let room_out = gen.max_tokens.saturating_sub(run.out_len());
    let room_after = room_out.saturating_sub(k + 1);
    let cap = k + 1 + next_k.min(room_after).min(r.conn.max_block);
    let capacity = run.capacity;
    let positions = draft_positions(k);

    let (parts, mut sink) = run.core();
    let mut st = parts.with(&mut r.spec.auto);
    let t0 = Instant::now();
    let ask = ProposeAsk {
        proposer: ProposerKind::Draft,
        k,
        room_out,
        draft: DraftAsk::default(),
    };
    let mut p = engine::propose_continuing(&mut st, sink.context(), ask, ahead)?;
    let draft_ms = ms(t0.elapsed());
    let block = p.block.clone();
    let ctx = sink.context();
    let (res, verify_time, rtt) = {
        let mut draft_ahead = || -> Result<bool, ModelError> {
            let drafted = p.block.len() + p.ahead.len();
            if drafted >= cap || ctx_before + drafted + 2 >= capacity {
                return Ok(false);
            }
            engine::draft_ahead(&mut st, ctx, &mut p)?;
            Ok(true)
        };
        let mut verifier = RemoteVerifier {
            conn: &mut r.conn,
            sampling: &gen.sampling,
            logprobs: gen.top_logprobs.is_some(),
            rtt: None,
            beside: Some(&mut draft_ahead),
        };
        let t = Instant::now();
        let res = verifier.verify(ctx, &block);
        (res, t.elapsed(), verifier.rtt)
    };
    let v = match res {
        Ok(v) => v,
        Err(VerifyError::Broken(e)) => {
            r.lost_block(run, e)?;
            return Ok(None);
        }
        Err(VerifyError::Refused(e)) => return Err(e),
        Err(VerifyError::Model(e)) => return Err(e.into()),
    };
    if let Some(rtt) = rtt {
        // What a verify of these rows costs the device.
        st.chooser.target_forward(positions, rtt);
    }
    let done = engine::settle(&mut st, p, v, verify_time, &mut sink)?;
    run.high_water = run.high_water.max(done.draft_peak);
    match done.ahead.last() {
        // The draft's cache holds the context and the tokens kept ahead
        // but their last.
        Some(&last) => run.pending = vec![last],
        None => run.sync_pending(),
    }
    run.ahead_at = run.ctx.len();
    run.ahead = done.ahead;
    r.observe_draft_forwards(&done.draft_forwards, done.reused == 0);
    Ok(Some(RoundOutcome {
        k: done.block.len(),
        accepted: done.accepted,
        rtt,
        positions,
        draft_ms,
        reused: done.reused,
        apply: Apply::Core,
    }))
}
