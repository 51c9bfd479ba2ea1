//! The generated contract: messages round-trip through protobuf encoding, the
//! reason enum names are what the verifier sends, and the descriptor set for
//! reflection describes the service.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use prost::Message;
use tandem_proto::v1::{client_message, ClientMessage, Draft, Reason};

#[test]
fn draft_round_trips_through_the_wire_encoding() {
    let msg = ClientMessage {
        msg: Some(client_message::Msg::Draft(Draft {
            round: 7,
            tokens: vec![1, 150_000, 3],
            ..Draft::default()
        })),
    };
    let bytes = msg.encode_to_vec();
    let back = ClientMessage::decode(bytes.as_slice()).unwrap();
    assert_eq!(back, msg);
}

#[test]
fn an_old_clients_draft_distributions_are_skipped() {
    let draft = Draft {
        round: 7,
        tokens: vec![1, 150_000, 3],
        ..Draft::default()
    };
    let mut bytes = draft.encode_to_vec();
    // Field 3 (reserved, once `draft_dists`): one distribution whose field 1
    // holds the packed tokens [1, 2].
    bytes.extend_from_slice(&[0x1a, 4, 0x0a, 2, 1, 2]);
    assert_eq!(Draft::decode(bytes.as_slice()).unwrap(), draft);
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

#[test]
fn conversation_fields_and_the_context_digest_are_pinned() {
    use tandem_proto::v1::{Close, Continuation, Open, Opened};
    assert_eq!(Reason::ContextNotHeld.as_str_name(), "CONTEXT_NOT_HELD");
    assert_eq!(Reason::ContextNotHeld as i32, 20);
    // sha256 over each id as 4 little-endian bytes: [] is sha256(""), [1, 258]
    // is sha256(01 00 00 00 02 01 00 00).
    let hex = |d: [u8; 32]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
    assert_eq!(
        hex(tandem_proto::context_digest(&[])),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
    use sha2::{Digest, Sha256};
    let want: [u8; 32] = Sha256::digest([1u8, 0, 0, 0, 2, 1, 0, 0]).into();
    assert_eq!(tandem_proto::context_digest(&[1, 258]), want);
    // The new fields survive the wire; their defaults are the old behaviour.
    let o = Open {
        prompt_tokens: vec![9],
        continuation: Some(Continuation {
            session_id: "s".into(),
            prefix_len: 3,
            prefix_sha256: tandem_proto::context_digest(&[1, 2, 3]).to_vec(),
        }),
        ..Open::default()
    };
    assert_eq!(Open::decode(o.encode_to_vec().as_slice()).unwrap(), o);
    assert!(!Close::default().keep);
    assert_eq!(Opened::default().reused_tokens, 0);
}

#[test]
fn penalties_and_logprobs_fields_are_optional_and_survive_the_wire() {
    use tandem_proto::v1::{
        LogitBias, Open, Opened, SamplingParams, TokenLogprobs, TopLogprob, Verdict,
    };
    // Absent (an older peer): no penalty, no bias, no logprobs, no feature.
    let s = SamplingParams::default();
    assert_eq!((s.presence_penalty, s.frequency_penalty), (0.0, 0.0));
    assert!(s.logit_bias.is_empty() && s.completion_start == 0);
    assert_eq!(Open::default().top_logprobs, None);
    assert!(Opened::default().features.is_empty());
    assert!(Verdict::default().logprobs.is_empty());
    // Set: they round-trip (top_logprobs = 0 is distinct from absent).
    let o = Open {
        sampling: Some(SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: -1.0,
            logit_bias: vec![LogitBias {
                token: 7,
                bias: -100.0,
            }],
            completion_start: 12,
            ..SamplingParams::default()
        }),
        top_logprobs: Some(0),
        ..Open::default()
    };
    assert_eq!(Open::decode(o.encode_to_vec().as_slice()).unwrap(), o);
    let v = Verdict {
        logprobs: vec![TokenLogprobs {
            logprob: -0.25,
            top: vec![TopLogprob {
                token: 3,
                logprob: -0.25,
            }],
        }],
        ..Verdict::default()
    };
    assert_eq!(Verdict::decode(v.encode_to_vec().as_slice()).unwrap(), v);
    let f = Opened {
        features: vec![
            tandem_proto::FEATURE_PENALTIES.into(),
            tandem_proto::FEATURE_LOGPROBS.into(),
        ],
        ..Opened::default()
    };
    assert_eq!(Opened::decode(f.encode_to_vec().as_slice()).unwrap(), f);
}
