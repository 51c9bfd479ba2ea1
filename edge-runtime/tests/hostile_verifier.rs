//! The device against a verifier that lies in one field of an Opened or a
//! Verdict (a fake gRPC server on loopback, tiny draft): every lie ends the
//! generation with a protocol error naming the field, and no token outside
//! the draft's vocabulary is ever streamed, not even with `max_tokens = 1`
//! (where the bad token would have been the whole, "successful", output).

// Tests may unwrap (helpers outside #[test] functions included).
#![allow(clippy::unwrap_used)]
mod common;
use common::{load, tiny_json_object_grammar};
use std::sync::Arc;
use tandem_edge::{EdgeConfig, EdgeError, EdgeEvent, EdgeRuntime};
use tandem_model::sampling::SamplingParams;
use tandem_model::speculative::GenerateConfig;
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_proto::v1::verifier_server::Verifier;
use tandem_proto::v1::{
    client_message, server_message, ClientMessage, HiddenStates, Opened, ServerMessage, Verdict,
};
use tokio_stream::wrappers::ReceiverStream;

const TOKEN: &str = "edge-test-token-0123456789";
const PROMPT: &[u32] = &[5, 17, 42, 99, 3, 250, 7];
const MODEL_ID: &str = "tiny-target";

/// The one field the fake lies in; everything else is what an honest verifier
/// would say (it rejects every drafted token and corrects with token 7).
#[derive(Clone, Copy, Debug)]
enum Lie {
    None,
    NextToken(u32),
    Accepted,
    Round,
    ContextLen,
    Hidden,
    OpenedVocab(u32),
    OpenedModel,
}

struct Fake {
    lie: Lie,
    vocab: u32,
}

#[tonic::async_trait]
impl Verifier for Fake {
    type SessionStream = ReceiverStream<Result<ServerMessage, tonic::Status>>;
    async fn session(
        &self,
        req: tonic::Request<tonic::Streaming<ClientMessage>>,
    ) -> Result<tonic::Response<Self::SessionStream>, tonic::Status> {
        let mut incoming = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let (lie, vocab) = (self.lie, self.vocab);
        tokio::spawn(async move {
            let mut ctx = 0u64;
            while let Ok(Some(m)) = incoming.message().await {
                let msg = match m.msg {
                    Some(client_message::Msg::Open(o)) => {
                        ctx = o.prompt_tokens.len() as u64;
                        server_message::Msg::Opened(Opened {
                            session_id: "hostile".into(),
                            model_id: match lie {
                                Lie::OpenedModel => "another-model".into(),
                                _ => MODEL_ID.into(),
                            },
                            vocab_size: match lie {
                                Lie::OpenedVocab(v) => v,
                                _ => vocab,
                            },
                            max_block: 16,
                            max_prompt_tokens: 4096,
                            context_len: ctx,
                            n_layer: 2,
                            d_model: 256,
                            ..Opened::default()
                        })
                    }
                    Some(client_message::Msg::Draft(d)) => {
                        ctx += 1;
                        let k = d.tokens.len() as u32;
                        server_message::Msg::Verdict(Verdict {
                            round: d.round + u64::from(matches!(lie, Lie::Round)),
                            accepted: if matches!(lie, Lie::Accepted) {
                                k + 1
                            } else {
                                0
                            },
                            next_token: match lie {
                                Lie::NextToken(t) => t,
                                _ => 7,
                            },
                            context_len: ctx + u64::from(matches!(lie, Lie::ContextLen)),
                            hidden: matches!(lie, Lie::Hidden).then(HiddenStates::default),
                            logprobs: Vec::new(),
                        })
                    }
                    _ => return,
                };
                let reply = ServerMessage { msg: Some(msg) };
                if tx.send(Ok(reply)).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

struct Served {
    rt: tokio::runtime::Runtime,
    url: String,
}

fn serve(lie: Lie, vocab: u32) -> Served {
    let (rt, url) = common::serve_fake(Fake { lie, vocab });
    Served { rt, url }
}

/// One generation of `max_tokens` against a fake telling `lie`: the result
/// and every streamed token id.
fn generate(lie: Lie, max_tokens: usize) -> (Result<Vec<u32>, EdgeError>, Vec<u32>, u32) {
    generate_with(lie, max_tokens, SamplingParams::default(), None, None)
}

/// [`generate`] under `sampling`.
fn generate_with(
    lie: Lie,
    max_tokens: usize,
    sampling: SamplingParams,
    top_logprobs: Option<usize>,
    grammar: Option<Arc<dyn tandem_model::engine::OutputGrammar>>,
) -> (Result<Vec<u32>, EdgeError>, Vec<u32>, u32) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("draft.gguf");
    write_tiny_qwen2(&path, &TinyConfig::draft_like()).unwrap();
    let draft = load(&path);
    let vocab = u32::try_from(draft.config().vocab).unwrap();
    let served = serve(lie, vocab);
    let cfg = EdgeConfig {
        verifier_url: Some(served.url.clone()),
        token: Some(TOKEN.into()),
        tokenizer_fingerprint: Some(common::FP.into()),
        model_id: MODEL_ID.into(),
        connect_timeout_ms: 500,
        backoff_base_ms: 5,
        backoff_max_ms: 20,
        ..EdgeConfig::default()
    };
    let mut edge = EdgeRuntime::builder(Arc::clone(&draft), cfg)
        .build()
        .unwrap();
    let gen = GenerateConfig {
        k: 4,
        max_tokens,
        sampling,
        top_logprobs,
        grammar,
        ..GenerateConfig::default()
    };
    let mut streamed = Vec::new();
    let r = edge.generate(PROMPT, &gen, &mut |e| {
        if let EdgeEvent::Token { id, .. } = e {
            streamed.push(*id);
        }
        true
    });
    drop(edge);
    drop(served.rt);
    (r.map(|g| g.tokens), streamed, vocab)
}

fn refused(lie: Lie, max_tokens: usize, names: &str) {
    let (r, streamed, vocab) = generate(lie, max_tokens);
    match r {
        Err(EdgeError::Protocol(m)) => assert!(m.contains(names), "{lie:?}: {m}"),
        other => panic!("{lie:?}: expected a protocol error naming {names:?}, got {other:?}"),
    }
    assert!(
        streamed.iter().all(|t| *t < vocab),
        "{lie:?}: streamed {streamed:?} (vocabulary {vocab})"
    );
}

#[test]
fn the_honest_fake_is_served() {
    // The control: the same fake without a lie gives its tokens (7 each
    // round), so the refusals below are the lies' doing.
    let (r, streamed, _) = generate(Lie::None, 3);
    assert_eq!(r.unwrap(), vec![7, 7, 7]);
    assert_eq!(streamed, vec![7, 7, 7]);
}

#[test]
fn an_out_of_vocabulary_next_token_is_refused_before_it_is_streamed() {
    // max_tokens = 1: the lie would have been the whole output.
    refused(Lie::NextToken(4_000_000_000), 1, "outside the vocabulary");
    let vocab = TinyConfig::draft_like().vocab as u32;
    refused(Lie::NextToken(vocab), 4, "outside the vocabulary");
}

#[test]
fn every_verdict_field_is_checked() {
    refused(Lie::Accepted, 4, "does not fit");
    refused(Lie::Round, 4, "does not fit");
    refused(Lie::ContextLen, 4, "does not fit");
    refused(Lie::Hidden, 4, "hidden states");
}

#[test]
fn an_opened_with_another_vocabulary_or_model_is_refused() {
    refused(Lie::OpenedVocab(1000), 4, "vocabulary of 1000 tokens");
    refused(Lie::OpenedVocab(0), 4, "vocabulary of 0 tokens");
    refused(Lie::OpenedModel, 4, "model_id");
}

#[test]
fn a_verifier_that_does_not_announce_penalties_logprobs_or_grammars_is_refused_for_them() {
    // The fake is an older verifier: its Opened lists no features, so it
    // would ignore the penalties and logit bias. The device refuses it
    // instead of streaming tokens that are not the target's.
    let sampling = SamplingParams {
        frequency_penalty: 0.5,
        ..SamplingParams::default()
    };
    let (r, streamed, _) = generate_with(Lie::None, 3, sampling, None, None);
    match r {
        Err(EdgeError::Protocol(m)) => assert!(m.contains("frequency_penalty"), "{m}"),
        other => panic!("expected a protocol error, got {other:?}"),
    }
    assert!(streamed.is_empty(), "{streamed:?}");
    // Logprobs likewise: verified tokens would come without the target's.
    let (r, streamed, _) = generate_with(Lie::None, 3, SamplingParams::default(), Some(2), None);
    match r {
        Err(EdgeError::Protocol(m)) => assert!(m.contains("logprobs"), "{m}"),
        other => panic!("expected a protocol error, got {other:?}"),
    }
    assert!(streamed.is_empty(), "{streamed:?}");
    // A grammar likewise (structured output): its verdicts would not be
    // masked.
    let dir = tempfile::tempdir().unwrap();
    let g = tiny_json_object_grammar(dir.path());
    let (r, streamed, _) = generate_with(Lie::None, 3, SamplingParams::default(), None, Some(g));
    match r {
        Err(EdgeError::Protocol(m)) => assert!(m.contains("grammar"), "{m}"),
        other => panic!("expected a protocol error, got {other:?}"),
    }
    assert!(streamed.is_empty(), "{streamed:?}");
}
