//! Pipelined drafting: once block `d1..dk` is sent, the device keeps drafting
//! while the verify is in flight, assuming full acceptance: `g` (its guess of the
//! verifier's bonus token: its own argmax, or in sampled mode its keyed draw,
//! which the target's shares the key of), then `e1, e2, ...`. If the verdict
//! accepts all k and its token equals `g`, `e1..` are already in the draft cache
//! and start the next block, so the next round trip leaves at once. Otherwise
//! they are discarded (the draft cache is truncated to the accepted prefix), as
//! in a plain round (both in [`super::round::Rounds::commit`]). Output is
//! unaffected: every emitted token still comes through a verdict.

use super::connection::draft_positions;
use super::generation::Generation;
use super::round::{note_verdict_logprobs, Apply, RoundOutcome, Rounds};
use crate::client::{Counters, NetError};
use crate::error::EdgeError;
use std::time::Duration;
use tandem_model::proposer::Source;
use tandem_model::speculative::StopReason;
use tandem_proto::v1::{
    self as pb, client_message::Msg as ClientMsg, server_message::Msg as ServerMsg,
};

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
    let mut held = std::mem::take(&mut r.spec.ahead);
    if !held.is_empty() && r.spec.ahead_at != run.ctx.len() {
        run.rollback_unverified();
        held.clear();
    }
    let k = r.block_len(run, limit);
    let ctx_before = run.ctx.len();
    let reused = held.len().min(k);
    let draft_ms = r.draft_block(run, &mut held, k)?;
    let round = r.conn.round;
    let msg = ClientMsg::Draft(pb::Draft {
        round,
        tokens: held[..k].to_vec(),
        ..pb::Draft::default()
    });
    // Longest next block worth preparing, and room in the output/cache.
    let next_k = if r.spec.cfg.adaptive_k {
        r.spec.cfg.k_max
    } else {
        run.gen.k
    };
    let room_out = run.gen.max_tokens.saturating_sub(run.out_len());
    let room_after = room_out.saturating_sub(k + 1);
    let cap = k + 1 + next_k.min(room_after).min(r.conn.max_block);
    let (answer, rtt) = match exchange_drafting(r, run, msg, &mut held, cap, ctx_before)? {
        Ok(a) => a,
        Err(e) => {
            r.lost_block(run, e)?;
            return Ok(None);
        }
    };
    let v = r
        .conn
        .codec
        .decode(answer, round, k, &run.ctx, &run.gen.sampling)?;
    note_verdict_logprobs(run, ctx_before, &held[..k.min(held.len())], &v)?;
    Ok(Some(RoundOutcome {
        ctx_before,
        drafted: held,
        k,
        accepted: v.accepted as usize,
        next_token: v.next_token,
        rtt: Some(rtt),
        positions: draft_positions(k),
        draft_ms,
        reused,
        source: Source::Draft,
        lookup_match: None,
        apply: Apply::Commit,
    }))
}

/// Sends `msg` from the I/O thread and keeps drafting (appending to `held`,
/// at most `cap` tokens) until the answer is there.
fn exchange_drafting(
    r: &mut Rounds<'_>,
    run: &mut Generation<'_, '_>,
    msg: ClientMsg,
    held: &mut Vec<u32>,
    cap: usize,
    ctx_before: usize,
) -> Result<Result<(ServerMsg, Duration), NetError>, EdgeError> {
    let k = match &msg {
        ClientMsg::Draft(d) => d.tokens.len(),
        _ => 0,
    };
    let deadline = r.conn.deadline(draft_positions(k));
    let Some(mut stream) = r.conn.stream.take() else {
        return Ok(Err(NetError::Unavailable("no session".into())));
    };
    let task = r.conn.rt.spawn(async move {
        let mut c = Counters::default();
        let res = stream.exchange(msg, deadline, &mut c).await;
        (stream, c, res)
    });
    let mut hist = run.ctx.clone();
    hist.extend_from_slice(held);
    // Keep one slot of the cache free for the verdict's token.
    while !task.is_finished() && held.len() < cap && ctx_before + held.len() + 2 < run.capacity {
        let d = run.draft_next(&hist)?;
        hist.push(d);
        held.push(d);
    }
    Ok(match r.conn.rt.block_on(task) {
        Ok((stream, c, res)) => {
            r.conn.counters.sent += c.sent;
            r.conn.counters.received += c.received;
            if res.is_ok() {
                r.conn.stream = Some(stream);
            }
            res
        }
        Err(e) => Err(NetError::Unavailable(format!("verify task failed: {e}"))),
    })
}
