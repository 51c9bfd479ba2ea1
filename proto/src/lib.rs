//! `tandem-proto`: Tandem's wire contract between the device and the cloud verifier,
//! package `tandem.verifier.v1` (see `tandem/verifier/v1/verifier.proto`, the source of
//! truth, documented message by message).
//!
//! This crate holds only the `.proto` file and the code tonic/prost generate from it
//! (client and server), plus the encoded descriptor set for gRPC server reflection and
//! the name of the metadata key that carries machine-readable error reasons, the
//! session-affinity header for load balancers ([`SESSION_AFFINITY_HEADER`]),
//! [`context_digest`]: the prefix digest of a continued conversation, and
//! [`hidden`]: the byte encoding of split sessions' hidden states (both sides must
//! agree on it bit for bit), and [`bearer`]: reading and comparing the bearer token a
//! device presents. No other logic.
//! Code generation uses `protox`, a pure-Rust protobuf compiler: no system `protoc`.

/// Version 1 of the verifier protocol.
pub mod verifier {
    pub mod v1 {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("tandem.verifier.v1");
    }
}

pub use verifier::v1;

pub mod bearer;

/// Encoded `FileDescriptorSet` of `tandem.verifier.v1`, for
/// `tonic_reflection::server::Builder::register_encoded_file_descriptor_set`.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(
    env!("OUT_DIR"),
    "/tandem_verifier_v1_descriptor.bin"
));

/// Metadata key of an error status whose value is a [`v1::Reason`] name
/// (e.g. `SESSION_EVICTED`).
pub const REASON_METADATA_KEY: &str = "tandem-reason";

/// Request metadata key (an HTTP/2 header) that every `Session` stream carries:
/// a random 128-bit hex key the device draws once per generation and keeps for
/// every re-open and resume of that generation, and for the later turns of a
/// conversation that continue its kept session (so they reach the replica that
/// holds it). It carries no prompt text and
/// nothing about the device; it exists so that a load balancer in front of
/// several verifier replicas can hash on it (nginx `hash $http_x_tandem_session
/// consistent`, Envoy `ring_hash` on this header) and keep one generation on one
/// replica, re-homing it only when that replica goes away (docs/deploy.md).
/// The verifier itself ignores it.
pub const SESSION_AFFINITY_HEADER: &str = "x-tandem-session";

/// Digest of a context prefix, as `Open.continuation.prefix_sha256` carries it:
/// sha256 over the token ids, each as 4 little-endian bytes. Both sides compute
/// it with this one function.
pub fn context_digest(tokens: &[u32]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// `Opened.features` name of a verifier that applies the OpenAI penalties and
/// logit bias of `SamplingParams` (presence_penalty, frequency_penalty,
/// logit_bias, completion_start).
pub const FEATURE_PENALTIES: &str = "penalties";

/// `Opened.features` name of a verifier that honours `Open.top_logprobs`
/// (`Verdict.logprobs`).
pub const FEATURE_LOGPROBS: &str = "logprobs";

/// `Opened.features` name of a verifier that honours `Open.grammar`
/// (structured output; docs/grammar.md).
pub const FEATURE_GRAMMAR: &str = "grammar";

/// Fully qualified service name, as used by the health service and reflection.
pub const VERIFIER_SERVICE_NAME: &str = "tandem.verifier.v1.Verifier";

/// Encoding of [`v1::HiddenStates`]: row-major `[rows, d_model]`, little-endian f32
/// ([`v1::HiddenFormat::HiddenF32`], exact) or f16 ([`v1::HiddenFormat::HiddenF16`],
/// round to nearest even, lossy).
pub mod hidden {
    use crate::v1::{HiddenFormat, HiddenStates};

    /// Why a [`HiddenStates`] message cannot be decoded.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct HiddenError(pub String);

    impl std::fmt::Display for HiddenError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.0)
        }
    }

    impl std::error::Error for HiddenError {}

    /// Bytes per element of `format`.
    pub fn element_bytes(format: HiddenFormat) -> usize {
        match format {
            HiddenFormat::HiddenF32 => 4,
            HiddenFormat::HiddenF16 => 2,
        }
    }

    /// Encodes `values` (`rows * d_model` floats) as `rows` rows.
    pub fn encode(values: &[f32], rows: usize, format: HiddenFormat) -> HiddenStates {
        let mut data = Vec::with_capacity(values.len() * element_bytes(format));
        match format {
            HiddenFormat::HiddenF32 => {
                for v in values {
                    data.extend_from_slice(&v.to_le_bytes());
                }
            }
            HiddenFormat::HiddenF16 => {
                for v in values {
                    data.extend_from_slice(&half::f16::from_f32(*v).to_le_bytes());
                }
            }
        }
        HiddenStates {
            rows: rows as u32,
            data,
        }
    }

    /// Decodes `h`, checking that it holds exactly `rows` rows of `d_model` values.
    pub fn decode(
        h: &HiddenStates,
        rows: usize,
        d_model: usize,
        format: HiddenFormat,
    ) -> Result<Vec<f32>, HiddenError> {
        let eb = element_bytes(format);
        if h.rows as usize != rows {
            return Err(HiddenError(format!(
                "hidden states have {} rows, expected {rows}",
                h.rows
            )));
        }
        if h.data.len() != rows * d_model * eb {
            return Err(HiddenError(format!(
                "hidden states hold {} bytes, expected {rows} rows x {d_model} x {eb} = {}",
                h.data.len(),
                rows * d_model * eb
            )));
        }
        let out = match format {
            HiddenFormat::HiddenF32 => h
                .data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            HiddenFormat::HiddenF16 => h
                .data
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        };
        Ok(out)
    }
}
