//! One handler per client message kind. Each takes the shared state, the
//! caller's identity and the stream's session binding, and answers with a
//! server message or a [`Refusal`](crate::error::Refusal).

pub mod close;
pub mod draft;
pub mod open;
pub mod resume;

use std::sync::Arc;

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
