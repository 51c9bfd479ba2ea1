//! `Resume` (and the resume and continuation halves of `Open`): bring a
//! session's KV in line with the device's whole context, keeping the longest
//! common prefix and prefilling the rest through the scheduler.

use super::{settle, wire_u64, Bound};
use crate::error::Refusal;
use crate::scheduler::Work;
use crate::session::SessionState;
use crate::state::VerifierState;
use crate::store::CheckedOut;
use std::sync::Arc;
use tandem_proto::v1::{server_message, Reason, Resume, Resumed, ServerMessage};

/// Resyncs a checked-out state with `ctx` (already checked): truncates its
/// KV to the longest common prefix (giving pages back), admits and reserves
/// the rest, and prefills it. Returns the state (`None` when it was lost) and
/// the number of positions reused (also counted in the metrics).
pub async fn resync(
    s: &VerifierState,
    who: &Arc<str>,
    sid: &Arc<str>,
    mut st: SessionState,
    ctx: &[u32],
) -> (Option<SessionState>, Result<usize, Refusal>) {
    let lcp = st
        .context
        .iter()
        .zip(ctx)
        .take_while(|(a, b)| a == b)
        .count();
    let reuse = lcp.min(ctx.len().saturating_sub(1)).min(st.kv.len());
    st.kv.truncate(reuse);
    st.kv.shrink_to(reuse);
    st.context = ctx.to_vec();
    let todo = ctx.len().saturating_sub(1) - reuse.min(ctx.len().saturating_sub(1));
    // Refused before the prefill: the state keeps what its KV holds
    // (context = the reused prefix + its `last`), a consistent session.
    let refused = |mut st: SessionState, r: Refusal| {
        st.context.truncate(reuse + 1);
        (Some(st), Err(r))
    };
    let mut permit = match s.admission.prefill(who, todo).await {
        Ok(p) => p,
        Err(r) => return refused(st, r),
    };
    let room = s.room_for(ctx.len());
    if let Err(r) = s.reserve(&mut st.kv, room, who, Some(sid)) {
        return refused(st, r);
    }
    let tokens = ctx[reuse..ctx.len().saturating_sub(1).max(reuse)].to_vec();
    let (st, out) = s.run(who, sid, st, Work::Prefill { tokens }).await;
    permit.spent();
    drop(permit);
    if out.is_ok() {
        s.metrics.reused(reuse);
    }
    (st, out.map(|_| reuse))
}

pub async fn resume(
    s: &VerifierState,
    who: &Arc<str>,
    b: &Bound,
    r: Resume,
) -> Result<ServerMessage, Refusal> {
    s.check_context(&r.context_tokens)?;
    let mut g =
        CheckedOut::take(&s.store, &b.id, who, b.epoch).map_err(crate::state::store_refusal)?;
    if g.split.is_some() {
        return Err(Refusal::new(
            Reason::BadRequest,
            "Resume is not supported in split sessions: open a new session with the context's hidden states",
        ));
    }
    if let Some(c) = g.grammar.as_mut() {
        // Structured output: the new context's output must be one the
        // grammar allows (checked before any work; refused, the session is
        // checked back in as it was). The constraint follows it from here.
        c.sync(&r.context_tokens)
            .map_err(|e| Refusal::new(Reason::BadRequest, format!("grammar: {e}")))?;
    }
    let (lent, st) = g.lend();
    let (st, res) = resync(s, who, &b.id, st, &r.context_tokens).await;
    let (mut g, reused) = settle(lent, st, res)?;
    g.next_round = r.next_round;
    let len = wire_u64(g.context.len());
    drop(g); // checked in
    Ok(ServerMessage {
        msg: Some(server_message::Msg::Resumed(Resumed {
            context_len: len,
            reused_tokens: wire_u64(reused),
        })),
    })
}
