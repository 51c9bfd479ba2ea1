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

#[test]
fn hidden_states_encode_exactly_in_f32_and_lossily_in_f16() {
    use tandem_proto::hidden::{decode, encode};
    use tandem_proto::v1::HiddenFormat;
    let v: Vec<f32> = (0..12).map(|i| (i as f32 - 5.5) * 0.123_456_7).collect();
    let h = encode(&v, 3, HiddenFormat::HiddenF32);
    assert_eq!((h.rows, h.data.len()), (3, 48));
    assert_eq!(decode(&h, 3, 4, HiddenFormat::HiddenF32).unwrap(), v);
    let h16 = encode(&v, 3, HiddenFormat::HiddenF16);
    assert_eq!(h16.data.len(), 24);
    let back = decode(&h16, 3, 4, HiddenFormat::HiddenF16).unwrap();
    assert_ne!(back, v, "f16 is lossy");
    for (a, b) in back.iter().zip(&v) {
        assert!((a - b).abs() <= b.abs() * 1e-3 + 1e-6, "{a} vs {b}");
    }
    // Wrong row count or byte count is an error naming it.
    assert!(decode(&h, 2, 4, HiddenFormat::HiddenF32)
        .unwrap_err()
        .to_string()
        .contains("rows"));
    assert!(decode(&h, 3, 5, HiddenFormat::HiddenF32)
        .unwrap_err()
        .to_string()
        .contains("bytes"));
}
