//! Shared helpers: tiny models, an in-process verifier on 127.0.0.1:0, a client.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use tandem_model::sampling::argmax;
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::transformer::{LoadOptions, Model};
use tandem_proto::v1::verifier_client::VerifierClient;
use tandem_proto::v1::{
    client_message, server_message, ClientMessage, Draft, Open, Opened, Reason, ServerMessage,
    Verdict,
};
use tandem_verifier::{reason_of, RunningVerifier, VerifierConfig};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Status, Streaming};

pub const TOKEN_A: &str = "device-a-token-0123456789";
pub const TOKEN_B: &str = "device-b-token-0123456789";
pub const MODEL_ID: &str = "tiny-target";

pub struct Models {
    pub dir: tempfile::TempDir,
    pub target: PathBuf,
    pub draft: PathBuf,
}

pub fn tiny_models() -> Models {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("target.gguf");
    let draft = dir.path().join("draft.gguf");
    write_tiny_qwen2(&target, &TinyConfig::default()).unwrap();
    write_tiny_qwen2(&draft, &TinyConfig::draft_like()).unwrap();
    Models { dir, target, draft }
}

pub fn load(p: &Path) -> Model {
    Model::load(p, LoadOptions::with_max_seq_len(512)).unwrap()
}

/// TOML for a plain-text loopback verifier on OS-assigned ports; `extra` is appended
/// (more [limits] keys go in `limits`).
pub fn config_toml(model: &Path, limits: &str, extra: &str) -> String {
    format!(
        r#"
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
model_path = "{}"
model_id = "{MODEL_ID}"
max_seq_len = 512
{extra}

[[devices]]
id = "a"
token = "{TOKEN_A}"

[[devices]]
id = "b"
token = "{TOKEN_B}"

[limits]
max_prompt_tokens = 256
{limits}
"#,
        model.display()
    )
}

pub fn parse(dir: &Path, toml: &str) -> VerifierConfig {
    let p = dir.join(format!("verifier-{}.toml", rand_suffix()));
    std::fs::write(&p, toml).unwrap();
    VerifierConfig::from_file(&p).unwrap()
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::SeqCst)
}

pub async fn start_plain(models: &Models, limits: &str) -> RunningVerifier {
    start_plain_with(models, limits, "").await
}

/// [`start_plain`] with `[batching]` keys.
pub async fn start_plain_with(models: &Models, limits: &str, batching: &str) -> RunningVerifier {
    let toml = format!(
        "{}\n[batching]\n{batching}\n",
        config_toml(&models.target, limits, "insecure_loopback = true")
    );
    let cfg = parse(models.dir.path(), &toml);
    tandem_verifier::start(cfg).await.unwrap()
}

pub async fn client(v: &RunningVerifier) -> VerifierClient<Channel> {
    VerifierClient::connect(format!("http://{}", v.grpc_addr))
        .await
        .unwrap()
}

/// One open stream.
pub struct Conn {
    pub tx: mpsc::Sender<ClientMessage>,
    pub rx: Streaming<ServerMessage>,
}

pub async fn connect(
    client: &mut VerifierClient<Channel>,
    token: Option<&str>,
) -> Result<Conn, Status> {
    let (tx, rx) = mpsc::channel(8);
    let mut req = tonic::Request::new(ReceiverStream::new(rx));
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let resp = client.session(req).await?;
    Ok(Conn {
        tx,
        rx: resp.into_inner(),
    })
}

impl Conn {
    pub async fn call(&mut self, m: client_message::Msg) -> Result<server_message::Msg, Status> {
        self.tx
            .send(ClientMessage { msg: Some(m) })
            .await
            .map_err(|_| Status::cancelled("stream closed"))?;
        match self.rx.message().await? {
            Some(ServerMessage { msg: Some(m) }) => Ok(m),
            other => Err(Status::internal(format!("unexpected {other:?}"))),
        }
    }

    pub async fn open(&mut self, o: Open) -> Result<Opened, Status> {
        match self.call(client_message::Msg::Open(o)).await? {
            server_message::Msg::Opened(o) => Ok(o),
            m => Err(Status::internal(format!("expected Opened, got {m:?}"))),
        }
    }

    pub async fn draft(&mut self, round: u64, tokens: &[u32]) -> Result<Verdict, Status> {
        let m = client_message::Msg::Draft(Draft {
            round,
            tokens: tokens.to_vec(),
            ..Draft::default()
        });
        match self.call(m).await? {
            server_message::Msg::Verdict(v) => Ok(v),
            m => Err(Status::internal(format!("expected Verdict, got {m:?}"))),
        }
    }
}

pub fn open_msg(fp: &str, prompt: &[u32]) -> Open {
    Open {
        model_id: MODEL_ID.into(),
        tokenizer_fingerprint: fp.into(),
        prompt_tokens: prompt.to_vec(),
        sampling: None,
        resume_session_id: None,
        first_round: 0,
        ..Open::default()
    }
}

pub fn reason(st: &Status) -> Reason {
    reason_of(st).unwrap_or_else(|| panic!("status without reason: {st:?}"))
}

/// The target's own greedy output: `n` tokens after `prompt`.
pub fn target_greedy(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = model.new_cache();
    let mut logits = model.forward_last(prompt, 0, &mut cache).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = argmax(&logits);
        out.push(t);
        logits = model.forward(&[t], cache.len(), &mut cache).unwrap();
    }
    out
}

/// `k` greedy draft tokens after `ctx` (fresh cache: simple, fine for tiny models).
pub fn draft_greedy(model: &Model, ctx: &[u32], k: usize) -> Vec<u32> {
    let mut c = ctx.to_vec();
    let mut out = Vec::new();
    for _ in 0..k {
        let mut cache = model.new_cache();
        let t = argmax(&model.forward_last(&c, 0, &mut cache).unwrap());
        out.push(t);
        c.push(t);
    }
    out
}

pub fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 384).collect()
}

/// Client-side speculative loop against the verifier: returns the generated tokens.
/// Handles SESSION_EVICTED / SESSION_UNKNOWN by re-opening with the full context.
/// Drafts come from `draft` (a different model gives rejections), k cycling
/// through 0..=4. As device A; [`generate_as`] for another identity.
pub async fn generate(
    conn_for: &mut VerifierClient<Channel>,
    fp: &str,
    draft: &tandem_model::transformer::Model,
    prompt: &[u32],
    n: usize,
    on_round: impl FnMut(u64, &str),
) -> (Vec<u32>, usize) {
    generate_as(TOKEN_A, conn_for, fp, draft, prompt, n, on_round).await
}

/// [`generate`] as the device whose bearer token is `token`.
pub async fn generate_as(
    token: &str,
    conn_for: &mut VerifierClient<Channel>,
    fp: &str,
    draft: &tandem_model::transformer::Model,
    prompt: &[u32],
    n: usize,
    mut on_round: impl FnMut(u64, &str),
) -> (Vec<u32>, usize) {
    let mut client = conn_for.clone();
    let mut conn = connect(&mut client, Some(token)).await.unwrap();
    let opened = conn.open(open_msg(fp, prompt)).await.unwrap();
    let mut sid = opened.session_id;
    let mut ctx = prompt.to_vec();
    let mut round = 0u64;
    let mut resumes = 0;
    while ctx.len() - prompt.len() < n {
        on_round(round, &sid);
        let k = (round % 5) as usize; // k = 0..4, including an empty block
        let d = draft_greedy(draft, &ctx, k);
        match conn.draft(round, &d).await {
            Ok(v) => {
                assert_eq!(v.round, round);
                ctx.extend_from_slice(&d[..v.accepted as usize]);
                ctx.push(v.next_token);
                assert_eq!(v.context_len as usize, ctx.len());
                round += 1;
            }
            Err(st) => {
                let r = reason(&st);
                assert!(
                    matches!(r, Reason::SessionEvicted | Reason::SessionUnknown),
                    "unexpected refusal {st:?}"
                );
                resumes += 1;
                conn = connect(&mut client, Some(token)).await.unwrap();
                let mut o = open_msg(fp, &ctx);
                o.resume_session_id = Some(sid.clone());
                o.first_round = round;
                let opened = conn.open(o).await.unwrap();
                assert_eq!(opened.context_len as usize, ctx.len());
                sid = opened.session_id;
            }
        }
    }
    ctx.truncate(prompt.len() + n);
    (ctx[prompt.len()..].to_vec(), resumes)
}
