//! `Draft`: one verify round (or a streaming step, k = 0) through the
//! scheduler, answered with a `Verdict`.

use super::{settle, wire_u64, wire_usize, Bound};
use crate::error::Refusal;
use crate::scheduler::{Outcome, Work};
use crate::split_session::{self, SplitAnswer};
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
    // Every refusal below drops the guard: the session goes back as it was.
    let mut g = CheckedOut::take(&s.store, &b.id, who, b.epoch).map_err(store_refusal)?;
    if d.round != g.next_round {
        return Err(Refusal::new(
            Reason::RoundOutOfOrder,
            format!("expected round {}, got {}", g.next_round, d.round),
        ));
    }
    if g.next_round == u64::MAX {
        return Err(Refusal::new(
            Reason::BadRequest,
            "round number 2^64 - 1 is the last: open a new session with first_round = 0",
        ));
    }
    // Pages for what this message carries, before any work is scheduled:
    // the block's rows after the positions they start at, checked here so a
    // bogus start_pos reserves nothing.
    let need = pages_needed(s, &g, k, rows, start_pos)?;
    if let Err(r) = s.reserve(&mut g.kv, need, who, Some(&b.id)) {
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
    let work = if g.split.is_some() {
        let (tokens, hidden) = (d.tokens, d.hidden);
        Work::Alone(Box::new(move |model, st| {
            split_session::split_round(model, st, &tokens, hidden.as_ref(), start_pos)
                .map(Outcome::Split)
        }))
    } else {
        Work::Verify { draft: d.tokens }
    };
    let (lent, st) = g.lend();
    let t0 = Instant::now();
    let (mut st, out) = s.run(who, &b.id, st, work).await;
    let latency = t0.elapsed();
    if out.is_err() {
        // A refused round keeps only the pages its context needs (what was
        // reserved for the block goes back to the pool at once).
        if let Some(st) = st.as_mut() {
            st.kv.shrink_to(s.room_for(st.context.len()));
        }
    }
    let (mut g, outcome) = settle(lent, st, out)?;
    if let Err(e) = g.advance_round() {
        g.remove();
        return Err(e);
    }
    // Keep pages for the next round's block, give back the rest.
    let room = s.room_for(g.context.len());
    g.kv.shrink_to(room);
    let ctx_len = g.context.len();
    let logprobs = std::mem::take(&mut g.last_logprobs)
        .into_iter()
        .map(|t| tandem_proto::v1::TokenLogprobs {
            logprob: t.logprob,
            top: t
                .top
                .into_iter()
                .map(|(token, logprob)| tandem_proto::v1::TopLogprob { token, logprob })
                .collect(),
        })
        .collect();
    if all_local(s, &g) {
        // s = N: this verifier holds no KV for the session.
        g.kv.shrink_to(0);
    }
    drop(g); // checked in
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
            logprobs,
        })),
    })
}

/// A U-shape split session at s = N: the device runs every layer, this
/// verifier only relays (no KV held here; an all-local device may skip
/// positions, so any bounded start_pos is consistent).
fn all_local(s: &VerifierState, st: &crate::session::SessionState) -> bool {
    st.split
        .is_some_and(|sp| sp.pin_head && sp.layer >= s.model.config().n_layer)
}

/// Positions the session's KV must hold for a Draft of `k` tokens and `rows`
/// hidden rows at `start_pos`: unsplit and head-here sessions continue at
/// their cached positions (start_pos must be those); U-shape sessions at
/// `start_pos` (at most the cached positions; at s = N nothing is held).
fn pages_needed(
    s: &VerifierState,
    st: &crate::session::SessionState,
    k: usize,
    rows: usize,
    start_pos: usize,
) -> Result<usize, Refusal> {
    let cached = st.context.len().saturating_sub(1);
    let bad = |m: String| Refusal::new(Reason::BadRequest, m);
    let Some(sp) = st.split else {
        return Ok(cached.saturating_add(k + 1));
    };
    if start_pos.saturating_add(rows.max(k + 1)) > s.max_seq_len {
        return Err(Refusal::new(
            Reason::ContextFull,
            format!(
                "start_pos {start_pos} + {} rows would exceed the KV capacity of {} tokens",
                rows.max(k + 1),
                s.max_seq_len
            ),
        ));
    }
    if !sp.pin_head {
        if start_pos != cached {
            return Err(bad(format!(
                "start_pos {start_pos} differs from the {cached} positions this session holds"
            )));
        }
        return Ok(cached.saturating_add(rows.max(k + 1)));
    }
    if all_local(s, st) {
        return Ok(0);
    }
    if start_pos > cached {
        return Err(bad(format!(
            "start_pos {start_pos} is beyond the {cached} positions this session holds"
        )));
    }
    Ok(start_pos.saturating_add(rows))
}
