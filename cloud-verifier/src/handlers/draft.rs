//! `Draft`: one verify round (or a streaming step, k = 0) through the
//! scheduler, answered with a `Verdict`.

use super::{settle, wire_u64, wire_usize, Bound};
use crate::error::Refusal;
use crate::scheduler::{Outcome, Work};
use crate::split::{self, SplitAnswer};
use crate::state::{store_refusal, VerifierState};
use crate::store::CheckedOut;
use std::sync::Arc;
use std::time::Instant;
use tandem_proto::v1::{server_message, Draft, Reason, ServerMessage};

pub async fn draft(
    s: &VerifierState,
    who: &Arc<str>,
    b: &Bound,
    d: Draft,
) -> Result<ServerMessage, Refusal> {
    // U-shape drafts carry no tokens: k is the hidden rows - 1.
    let rows = d.hidden.as_ref().map_or(0, |h| h.rows as usize);
    let k = if d.tokens.is_empty() {
        rows.saturating_sub(1)
    } else {
        d.tokens.len()
    };
    if k > s.limits.max_block || rows > s.limits.max_block + 1 {
        return Err(Refusal::new(
            Reason::BlockTooLarge,
            format!(
                "block of {} tokens exceeds max_block = {}",
                k.max(rows.saturating_sub(1)),
                s.limits.max_block
            ),
        ));
    }
    s.check_tokens(&d.tokens)?;
    let start_pos = wire_usize(d.start_pos, "start_pos")?;
    let (guard, mut st) = CheckedOut::take(&s.store, &b.id, who, b.epoch).map_err(store_refusal)?;
    if d.round != st.next_round {
        let want = st.next_round;
        guard.checkin(st);
        return Err(Refusal::new(
            Reason::RoundOutOfOrder,
            format!("expected round {want}, got {}", d.round),
        ));
    }
    if st.next_round == u64::MAX {
        guard.checkin(st);
        return Err(Refusal::new(
            Reason::BadRequest,
            "round number 2^64 - 1 is the last: open a new session with first_round = 0",
        ));
    }
    // Pages for the block's rows, before any work is scheduled.
    // (An all-local split device, s = N, may skip positions: start_pos then
    // counts.)
    let cached = st.context.len().saturating_sub(1);
    let base = if st.split.is_some() {
        cached.max(start_pos)
    } else {
        cached
    };
    let need = base.saturating_add(rows.max(k + 1));
    if let Err(r) = s.reserve(&mut st.kv, need, who, Some(&b.id)) {
        guard.checkin(st);
        return Err(if r.reason == Reason::ContextFull || need > s.max_seq_len {
            Refusal::new(
                Reason::ContextFull,
                format!(
                    "context would exceed the KV capacity of {} tokens",
                    s.max_seq_len
                ),
            )
        } else {
            r
        });
    }
    let work = if st.split.is_some() {
        let (tokens, hidden) = (d.tokens, d.hidden);
        Work::Alone(Box::new(move |model, st| {
            split::split_round(model, st, &tokens, hidden.as_ref(), start_pos).map(Outcome::Split)
        }))
    } else {
        Work::Verify { draft: d.tokens }
    };
    let t0 = Instant::now();
    let (st, out) = s.run(who, &b.id, st, work).await;
    let latency = t0.elapsed();
    let (guard, mut st, outcome) = settle(guard, st, out)?;
    st.advance_round()?;
    // Keep pages for the next round's block, give back the rest.
    st.kv.shrink_to(s.room_for(st.context.len()));
    let ctx_len = st.context.len();
    guard.checkin(st);
    let (accepted, next_token, hidden, ctx_len) = match outcome {
        Outcome::Verdict(v) => (v.accepted, v.next_token, None, ctx_len),
        Outcome::Split(SplitAnswer::Verdict(v)) => (v.accepted, v.next_token, None, ctx_len),
        // U-shape: context_len = positions cached = start_pos + k + 1.
        Outcome::Split(SplitAnswer::Hidden(h)) => (0, 0, Some(h), ctx_len.saturating_sub(1)),
        Outcome::Prefilled => {
            return Err(Refusal::new(
                Reason::InternalError,
                "a round came back as a prefill",
            ))
        }
    };
    s.metrics.verify(latency, k, accepted);
    tracing::debug!(session = %b.id, round = d.round, k, accepted, "verified");
    Ok(ServerMessage {
        msg: Some(server_message::Msg::Verdict(tandem_proto::v1::Verdict {
            round: d.round,
            accepted: u32::try_from(accepted).unwrap_or(u32::MAX),
            next_token,
            context_len: wire_u64(ctx_len),
            hidden,
        })),
    })
}
