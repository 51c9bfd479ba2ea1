//! `Close`: the session's pages go back to the pool now, or, with `keep`, the
//! session stays in the store as an idle session (counted in the byte budget,
//! evicted LRU or after the idle TTL like any other) for the next turn of a
//! conversation (`Open.continuation`).

use super::Bound;
use crate::state::VerifierState;
use crate::store::CheckedOut;
use tandem_proto::v1::{server_message, Close, Closed, ServerMessage};

pub fn close(s: &VerifierState, who: &str, b: &Bound, c: &Close) -> ServerMessage {
    let rounds = if c.keep {
        keep(s, who, b)
    } else {
        let rounds = s
            .store()
            .remove(&b.id, who, b.epoch)
            .map(|st| st.rounds)
            .unwrap_or(0);
        tracing::info!(session = %b.id, rounds, "session closed");
        rounds
    };
    ServerMessage {
        msg: Some(server_message::Msg::Closed(Closed { rounds })),
    }
}

/// Keeps the stream's session idle, holding only the pages its KV fills (the
/// room reserved for the next block goes back; a continuation reserves again).
/// A split session is freed: nothing can continue it. A session this stream
/// no longer drives (superseded, evicted) is left as it is.
fn keep(s: &VerifierState, who: &str, b: &Bound) -> u64 {
    let Ok(mut g) = CheckedOut::take(&s.store, &b.id, who, b.epoch) else {
        tracing::info!(session = %b.id, "session closed (keep: not held by this stream)");
        return 0;
    };
    let rounds = g.rounds;
    if g.split.is_some() {
        g.remove();
        tracing::info!(session = %b.id, rounds, "session closed (keep: split sessions are not continued)");
        return rounds;
    }
    g.kv.shrink_to(0);
    let context_len = g.context.len();
    drop(g); // checked in, idle
    s.metrics.session_kept();
    tracing::info!(session = %b.id, rounds, context_len, "session kept");
    rounds
}
