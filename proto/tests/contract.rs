//! The generated contract: messages round-trip through protobuf encoding, the
//! reason enum names are what the verifier sends, and the descriptor set for
//! reflection describes the service.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use prost::Message;
use tandem_proto::v1::{client_message, ClientMessage, Draft, Reason, TokenDistribution};

#[test]
fn draft_round_trips_through_the_wire_encoding() {
    let msg = ClientMessage {
        msg: Some(client_message::Msg::Draft(Draft {
            round: 7,
            tokens: vec![1, 150_000, 3],
            draft_dists: vec![TokenDistribution {
                tokens: vec![1, 2],
                probs: vec![0.75, 0.25],
            }],
            ..Draft::default()
        })),
    };
    let bytes = msg.encode_to_vec();
    let back = ClientMessage::decode(bytes.as_slice()).unwrap();
    assert_eq!(back, msg);
}

#[test]
fn reason_names_are_stable() {
    assert_eq!(Reason::SessionEvicted.as_str_name(), "SESSION_EVICTED");
    assert_eq!(
        Reason::from_str_name("FINGERPRINT_MISMATCH"),
        Some(Reason::FingerprintMismatch)
    );
    assert_eq!(Reason::from_str_name("NO_SUCH_REASON"), None);
}

#[test]
fn descriptor_set_names_the_service() {
    let fds = prost_types::FileDescriptorSet::decode(tandem_proto::FILE_DESCRIPTOR_SET).unwrap();
    let file = fds
        .file
        .iter()
        .find(|f| f.package() == "tandem.verifier.v1")
        .unwrap();
    let svc = &file.service[0];
    assert_eq!(
        format!("{}.{}", file.package(), svc.name()),
        tandem_proto::VERIFIER_SERVICE_NAME
    );
    assert_eq!(svc.method[0].name(), "Session");
    assert!(svc.method[0].client_streaming() && svc.method[0].server_streaming());
}
