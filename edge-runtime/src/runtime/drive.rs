//! The loop of one generation against the verifier ([`drive`]): while no
//! session is there it drafts alone (provisional) and opens one (in the
//! foreground, or in the background after a failure); with a session it
//! runs the generation's kind of round (`super::plain`, `super::pipelined`,
//! `super::cloud_stream`, `super::gated`) and commits each outcome
//! (`super::round::Rounds::commit`); provisional spans are checked as soon
//! as a session is back.

use super::connection::Step;
use super::generation::Generation;
use super::round::{RoundKind, Rounds};
use super::{cloud_stream, gated, pipelined, plain};
use crate::breaker::lock;
use crate::client::{Counters, NetError};
use crate::error::EdgeError;
use crate::report::TokenStatus;
use std::time::Instant;
use tandem_model::speculative::StopReason;

pub(super) fn drive(r: &mut Rounds<'_>, run: &mut Generation<'_, '_>) -> Result<(), EdgeError> {
    // Rounds that run the draft (not cloud-streamed ones) want its backlog
    // prefilled; a foreground open does it beside the verifier's prefill.
    let drafts = r.kind != RoundKind::CloudStreamed
        && run.gen.proposer != tandem_model::proposer::ProposerKind::Lookup;
    while run.stop.is_none() {
        let opens_in_foreground = r.conn.stream.is_none()
            && r.conn.opening.is_none()
            && lock(r.conn.breaker).allows_request()
            && !r.conn.open_in_background();
        // Else the open prefills the backlog itself, beside the verifier.
        let prefill_first = !(opens_in_foreground && drafts);
        if prefill_first && !run.prefill_pending()? {
            break;
        }
        if let Some(op) = r.conn.opening.take() {
            if !op.task.is_finished() {
                // The verifier is not (yet) reachable: keep generating alone.
                r.conn.opening = Some(op);
                run.draft_alone(TokenStatus::Provisional)?;
                continue;
            }
            let (opened, c) = match r.conn.rt.block_on(op.task) {
                Ok(x) => x,
                Err(e) => (
                    Err(NetError::Unavailable(format!("open task failed: {e}"))),
                    Counters::default(),
                ),
            };
            r.conn.counters.add(c);
            let upto = op.context.len();
            let other = (!run.ctx.starts_with(&op.context)).then_some(&op.context[..]);
            let step = r.conn.opened(opened, upto, run.gen)?;
            if let Step::Lost = r.after_open(run, step, upto, other)? {
                continue;
            }
            r.check_provisional(run)?;
            continue;
        }
        let allowed = lock(r.conn.breaker).allows_request();
        if !allowed {
            run.draft_alone(TokenStatus::Provisional)?;
            continue;
        }
        if r.conn.stream.is_none() {
            if r.conn.open_in_background() {
                if r.conn.retry_at.is_some_and(|t| Instant::now() < t) {
                    run.draft_alone(TokenStatus::Provisional)?;
                } else {
                    r.conn.retry_at = None;
                    r.spawn_open(run)?;
                }
                continue;
            }
            if let Step::Lost = r.open(run, drafts)? {
                continue;
            }
            r.check_provisional(run)?;
            continue;
        }
        let outcome = match r.kind {
            RoundKind::Plain => plain::round(r, run)?,
            RoundKind::Pipelined => pipelined::round(r, run)?,
            RoundKind::CloudStreamed => cloud_stream::round(r, run)?,
            RoundKind::Gated => gated::round(r, run)?,
        };
        if let Some(o) = outcome {
            r.commit(run, o);
        }
    }
    // Gated tokens still waiting at the end: verify them now (one pass), so
    // the report says whether they were right (not after a cancel: nobody
    // is listening).
    let cancelled = run.stop == Some(StopReason::Cancelled);
    if run.gated && run.check.is_some() && r.conn.stream.is_some() && !cancelled {
        r.check_provisional(run)?;
    }
    Ok(())
}
