//! One handler per client message kind. Each takes the shared state, the
//! caller's identity and the stream's session binding, and answers with a
//! server message or a [`Refusal`](crate::error::Refusal).

pub mod close;
pub mod draft;
pub mod open;
pub mod resume;

use crate::error::Refusal;
use crate::session::SessionState;
use crate::store::{CheckedOut, Lent};
use std::sync::Arc;
use tandem_proto::v1::Reason;

/// A stream's session binding: the session it drives and the epoch it got
/// (a stream superseded by a resume elsewhere is refused).
#[derive(Debug, Clone)]
pub struct Bound {
    pub id: Arc<str>,
    pub epoch: u64,
}

/// A wire integer as a `usize`, or a BAD_REQUEST naming the field.
pub(crate) fn wire_usize(v: u64, field: &str) -> Result<usize, crate::error::Refusal> {
    usize::try_from(v).map_err(|_| {
        crate::error::Refusal::new(
            tandem_proto::v1::Reason::BadRequest,
            format!("{field} = {v} does not fit this verifier's address space"),
        )
    })
}

/// A length as a wire `u64` (lengths are bounded by the store's limits; the
/// saturation never applies).
pub(crate) fn wire_u64(v: usize) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// What came back from work on a lent session. `Ok` puts the state back
/// into a guard (checked in when the caller drops it) beside the outcome; a
/// refusal checks the state back in, or removes the session when its state
/// was lost or the error is internal (its KV is in doubt: the device re-sends
/// its context).
pub(crate) fn settle<'a, T>(
    lent: Lent<'a>,
    st: Option<SessionState>,
    out: Result<T, Refusal>,
) -> Result<(CheckedOut<'a>, T), Refusal> {
    match (st, out) {
        (Some(st), Ok(v)) => Ok((lent.restore(st), v)),
        (Some(st), Err(e)) if e.reason != Reason::InternalError => {
            drop(lent.restore(st));
            Err(e)
        }
        (_, Err(e)) => {
            lent.remove();
            Err(e)
        }
        (None, Ok(_)) => {
            lent.remove();
            Err(lost())
        }
    }
}

/// The state a new session's prefill gave back, or why there is none.
pub(crate) fn prefilled<T>(
    st: Option<SessionState>,
    out: Result<T, Refusal>,
) -> Result<SessionState, Refusal> {
    match (st, out) {
        (Some(st), Ok(_)) => Ok(st),
        (_, Err(e)) => Err(e),
        (None, Ok(_)) => Err(lost()),
    }
}

fn lost() -> Refusal {
    Refusal::new(Reason::InternalError, "the session's state was lost")
}
