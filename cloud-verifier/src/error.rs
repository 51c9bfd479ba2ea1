//! A refusal with its gRPC code and machine-readable reason.

use tandem_proto::v1::Reason;
use tonic::{Code, Status};

/// Why a request was refused: becomes a gRPC status whose `tandem-reason` metadata
/// names the [`Reason`].
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}: {message}", reason.as_str_name())]
pub struct Refusal {
    pub code: Code,
    pub reason: Reason,
    pub message: String,
}

impl Refusal {
    pub fn new(reason: Reason, message: impl Into<String>) -> Self {
        let code = match reason {
            Reason::SessionUnknown | Reason::SessionEvicted => Code::NotFound,
            Reason::FingerprintMismatch
            | Reason::ModelMismatch
            | Reason::RoundOutOfOrder
            | Reason::ContextNotHeld => Code::FailedPrecondition,
            Reason::BlockTooLarge
            | Reason::TokenOutOfVocab
            | Reason::PromptTooLong
            | Reason::BadRequest
            | Reason::Unspecified => Code::InvalidArgument,
            Reason::RateLimited
            | Reason::TooManySessions
            | Reason::ContextFull
            | Reason::QuotaExceeded
            | Reason::MessageTooLarge => Code::ResourceExhausted,
            Reason::StreamIdle => Code::DeadlineExceeded,
            Reason::Unauthenticated => Code::Unauthenticated,
            Reason::SessionForbidden => Code::PermissionDenied,
            Reason::ShuttingDown => Code::Unavailable,
            Reason::InternalError => Code::Internal,
        };
        Self {
            code,
            reason,
            message: message.into(),
        }
    }

    /// The gRPC status, with `tandem-reason: <REASON>` metadata.
    pub fn to_status(&self) -> Status {
        let mut st = Status::new(self.code, self.to_string());
        if let Ok(v) = self.reason.as_str_name().parse() {
            st.metadata_mut()
                .insert(tandem_proto::REASON_METADATA_KEY, v);
        }
        st
    }
}

/// The reason carried by a status, if any (for clients and tests).
pub fn reason_of(status: &Status) -> Option<Reason> {
    status
        .metadata()
        .get(tandem_proto::REASON_METADATA_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(Reason::from_str_name)
}
