//! `Close`: the session's pages go back to the pool now.

use super::Bound;
use crate::state::VerifierState;
use tandem_proto::v1::{server_message, Closed, ServerMessage};

pub fn close(s: &VerifierState, who: &str, b: &Bound) -> ServerMessage {
    let rounds = s
        .store()
        .remove(&b.id, who, b.epoch)
        .map(|st| st.rounds)
        .unwrap_or(0);
    tracing::info!(session = %b.id, rounds, "session closed");
    ServerMessage {
        msg: Some(server_message::Msg::Closed(Closed { rounds })),
    }
}
