//! The plain round: the generation core's round
//! (`tandem_model::engine::round`: plan with the generation's proposer, the
//! draft model, prompt lookup or `auto`'s choice; propose a block of up to
//! k, fixed or the chooser's with adaptive k; roll back, emit, count)
//! against the remote verifier ([`RemoteVerifier`]: the block encoded with
//! the session's codec, exchanged, or answered by the codec on the device in
//! an all-local split round, and the verdict decoded). What it returns is
//! what the network and adaptive k add (`super::round::Rounds::commit`).

use super::connection::{draft_positions, RemoteVerifier};
use super::generation::Generation;
use super::round::{ms, Apply, RoundOutcome, Rounds};
use crate::error::EdgeError;
use tandem_model::engine::{self, VerifyError};
use tandem_model::proposer::Source;
use tandem_model::speculative::StopReason;

/// One plain round; `None` when it ended without a verdict (the failure is
/// handled) or the context is full.
pub(super) fn round(
    r: &mut Rounds<'_>,
    run: &mut Generation<'_, '_>,
) -> Result<Option<RoundOutcome>, EdgeError> {
    let limit = r.limit(run, 0);
    if limit == 0 {
        run.stop = Some(StopReason::ContextFull);
        return Ok(None);
    }
    let k_max = r.block_len(run, limit);
    let gen = run.gen;
    let room_out = gen.max_tokens.saturating_sub(run.out_len());
    let mut verifier = RemoteVerifier {
        conn: &mut r.conn,
        sampling: &gen.sampling,
        logprobs: gen.top_logprobs.is_some(),
        rtt: None,
        beside: None,
    };
    let (draft, mut sink) = run.core();
    let res = engine::round(
        draft.with(&mut r.spec.auto),
        k_max,
        room_out,
        &mut sink,
        &mut verifier,
    );
    // (`auto`'s target cost in this round is the verify call's time, which
    // the core measures: the round trip plus the codec's work.)
    let rtt = verifier.rtt;
    let done = match res {
        Ok(done) => done,
        Err(VerifyError::Broken(e)) => {
            // The core has rolled the draft back to the context.
            run.sync_pending();
            r.conn.codec.rollback(run.ctx.len());
            r.fail(run, e)?;
            return Ok(None);
        }
        Err(VerifyError::Refused(e)) => return Err(e),
        Err(VerifyError::Model(e)) => return Err(e.into()),
    };
    run.sync_pending();
    run.high_water = run.high_water.max(done.draft_peak);
    if done.source == Source::Draft {
        r.observe_draft_forwards(&done.draft_forwards, true);
    }
    let k = done.block.len();
    Ok(Some(RoundOutcome {
        k,
        accepted: done.accepted,
        rtt,
        positions: draft_positions(k),
        draft_ms: done.draft_forwards.iter().map(|f| ms(f.time)).sum(),
        reused: 0,
        apply: Apply::Core,
    }))
}
