//! `tandem-proto`: Tandem's wire contract between the device and the cloud verifier,
//! package `tandem.verifier.v1` (see `tandem/verifier/v1/verifier.proto`, the source of
//! truth, documented message by message).
//!
//! This crate holds only the `.proto` file and the code tonic/prost generate from it
//! (client and server), plus the encoded descriptor set for gRPC server reflection and
//! the name of the metadata key that carries machine-readable error reasons. No logic.
//! Code generation uses `protox`, a pure-Rust protobuf compiler: no system `protoc`.

/// Version 1 of the verifier protocol.
pub mod verifier {
    pub mod v1 {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("tandem.verifier.v1");
    }
}

pub use verifier::v1;

/// Encoded `FileDescriptorSet` of `tandem.verifier.v1`, for
/// `tonic_reflection::server::Builder::register_encoded_file_descriptor_set`.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(
    env!("OUT_DIR"),
    "/tandem_verifier_v1_descriptor.bin"
));

/// Metadata key of an error status whose value is a [`v1::Reason`] name
/// (e.g. `SESSION_EVICTED`).
pub const REASON_METADATA_KEY: &str = "tandem-reason";

/// Fully qualified service name, as used by the health service and reflection.
pub const VERIFIER_SERVICE_NAME: &str = "tandem.verifier.v1.Verifier";
