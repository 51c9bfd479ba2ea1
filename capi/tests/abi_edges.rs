//! The C ABI at its edges, called the way a C host calls it (the `extern "C"`
//! functions, raw pointers, a C callback), on the real draft model:
//!
//! * calls from inside a token callback: `tandem_conversation_new` and
//!   `tandem_conversation_free` work there (they used to wait for the engine
//!   the running generation holds: a deadlock), and a generation started
//!   there gets `TANDEM_STATUS_BUSY`;
//! * a hostile verifier (a fake on loopback answering an out-of-vocabulary
//!   `next_token`): the turn fails with `TANDEM_STATUS_PROTOCOL` and the
//!   conversation's history is as it was (the next turn's Open carries only
//!   the next message).
//!
//! Generations are at most 4 tokens; each test runs under a watchdog so a
//! deadlock fails instead of hanging.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tandem_capi::*;
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::transformer::{LoadOptions, Model};
use tandem_proto::v1::verifier_server::{Verifier, VerifierServer};
use tandem_proto::v1::{
    client_message, server_message, ClientMessage, Opened, ServerMessage, Verdict,
};
use tokio_stream::wrappers::ReceiverStream;

fn serial() -> MutexGuard<'static, ()> {
    static M: Mutex<()> = Mutex::new(());
    M.lock().unwrap_or_else(|p| p.into_inner())
}

fn draft_path() -> PathBuf {
    tandem_fetch::model_path(tandem_fetch::ModelRole::Draft)
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Runs `f` on its own thread; fails the test when it does not end in
/// `secs` (a deadlock).
fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs))
        .unwrap_or_else(|_| panic!("no answer within {secs} s: a deadlock"))
}

/// A runtime from `config`; panics with the library's message on failure.
fn runtime(config: &Path) -> usize {
    let path = CString::new(config.to_str().unwrap()).unwrap();
    let mut rt: *mut TandemRuntime = ptr::null_mut();
    let mut err: *mut c_char = ptr::null_mut();
    // SAFETY: valid pointers as the header asks.
    let st = unsafe { tandem_runtime_new(path.as_ptr(), ptr::null(), &mut rt, &mut err) };
    assert_eq!(st, TandemStatus::Ok, "{}", take_message(err));
    rt as usize
}

fn take_message(err: *mut c_char) -> String {
    if err.is_null() {
        return String::new();
    }
    // SAFETY: a message from the library, freed once.
    let m = unsafe { CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned();
    unsafe { tandem_string_free(err) };
    m
}

fn new_conversation(rt: *const TandemRuntime) -> *mut TandemConversation {
    let mut c: *mut TandemConversation = ptr::null_mut();
    let mut err: *mut c_char = ptr::null_mut();
    // SAFETY: valid pointers.
    let st = unsafe { tandem_conversation_new(rt, &mut c, &mut err) };
    assert_eq!(st, TandemStatus::Ok, "{}", take_message(err));
    c
}

/// Sends `message` on `c`: the status and the error message.
fn send(
    rt: *const TandemRuntime,
    c: *mut TandemConversation,
    message: &str,
    callback: TandemTokenCallback,
    user: *mut c_void,
) -> (TandemStatus, String) {
    let m = CString::new(message).unwrap();
    let mut err: *mut c_char = ptr::null_mut();
    // SAFETY: valid pointers; the callback's user data is the caller's.
    let st = unsafe {
        tandem_conversation_send(
            rt,
            c,
            m.as_ptr(),
            4,
            callback,
            user,
            ptr::null_mut(),
            &mut err,
        )
    };
    (st, take_message(err))
}

/// What the re-entrant callback did.
struct Reentry {
    rt: *const TandemRuntime,
    /// A conversation to free from inside the callback.
    to_free: *mut TandemConversation,
    made: Vec<usize>,
    new_status: Vec<TandemStatus>,
    generate_status: Vec<TandemStatus>,
}

unsafe extern "C" fn reentrant(
    _piece: *const c_char,
    _len: usize,
    _status: TandemTokenStatus,
    user: *mut c_void,
) -> bool {
    // SAFETY: `user` is the test's `Reentry`, alive for the call.
    let r = unsafe { &mut *user.cast::<Reentry>() };
    let mut c: *mut TandemConversation = ptr::null_mut();
    let mut err: *mut c_char = ptr::null_mut();
    // SAFETY: valid pointers.
    let st = unsafe { tandem_conversation_new(r.rt, &mut c, &mut err) };
    take_message(err);
    r.new_status.push(st);
    r.made.push(c as usize);
    if !r.to_free.is_null() {
        // SAFETY: a conversation of this runtime, freed once.
        unsafe { tandem_conversation_free(r.rt, r.to_free) };
        r.to_free = ptr::null_mut();
    }
    let p = CString::new("hi").unwrap();
    let mut err: *mut c_char = ptr::null_mut();
    // SAFETY: valid pointers.
    let st = unsafe {
        tandem_generate(
            r.rt,
            p.as_ptr(),
            1,
            None,
            ptr::null_mut(),
            ptr::null_mut(),
            &mut err,
        )
    };
    take_message(err);
    r.generate_status.push(st);
    true
}

#[test]
fn calls_from_a_token_callback_do_not_deadlock() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(
        dir.path(),
        "local.toml",
        &format!("draft_model = {:?}\nmax_seq_len = 256\n", draft_path()),
    );
    let rt = runtime(&cfg);
    let (made, new_status, generate_status, st) = within(120, move || {
        let rt = rt as *const TandemRuntime;
        let c = new_conversation(rt);
        let other = new_conversation(rt);
        let mut r = Reentry {
            rt,
            to_free: other,
            made: Vec::new(),
            new_status: Vec::new(),
            generate_status: Vec::new(),
        };
        let (st, msg) = send(
            rt,
            c,
            "Say hi.",
            Some(reentrant),
            ptr::addr_of_mut!(r).cast(),
        );
        // The conversation made inside the callback works afterwards.
        let made = r.made.clone();
        let first = made[0] as *mut TandemConversation;
        let (st2, msg2) = send(rt, first, "Say hi.", None, ptr::null_mut());
        assert_eq!(st2, TandemStatus::Ok, "{msg2}");
        for m in &made {
            // SAFETY: conversations of this runtime, freed once.
            unsafe { tandem_conversation_free(rt, *m as *mut TandemConversation) };
        }
        // SAFETY: c from this runtime.
        unsafe { tandem_conversation_free(rt, c) };
        (made, r.new_status, r.generate_status, (st, msg))
    });
    assert_eq!(st.0, TandemStatus::Ok, "{}", st.1);
    assert!(!made.is_empty());
    assert!(
        new_status.iter().all(|s| *s == TandemStatus::Ok),
        "{new_status:?}"
    );
    assert!(
        generate_status.iter().all(|s| *s == TandemStatus::Busy),
        "{generate_status:?}"
    );
    // SAFETY: no generation runs.
    unsafe { tandem_runtime_free(rt as *mut TandemRuntime) };
}

/// A verifier that opens every session honestly (the draft's vocabulary,
/// the expected model id) and answers every Draft with an out-of-vocabulary
/// token; it records each Open's prompt.
struct Hostile {
    vocab: u32,
    opens: Arc<Mutex<Vec<Vec<u32>>>>,
}

#[tonic::async_trait]
impl Verifier for Hostile {
    type SessionStream = ReceiverStream<Result<ServerMessage, tonic::Status>>;
    async fn session(
        &self,
        req: tonic::Request<tonic::Streaming<ClientMessage>>,
    ) -> Result<tonic::Response<Self::SessionStream>, tonic::Status> {
        let mut incoming = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let (vocab, opens) = (self.vocab, self.opens.clone());
        tokio::spawn(async move {
            let mut ctx = 0u64;
            while let Ok(Some(m)) = incoming.message().await {
                let msg = match m.msg {
                    Some(client_message::Msg::Open(o)) => {
                        ctx = o.prompt_tokens.len() as u64;
                        opens.lock().unwrap().push(o.prompt_tokens);
                        server_message::Msg::Opened(Opened {
                            session_id: "hostile".into(),
                            model_id: o.model_id,
                            vocab_size: vocab,
                            max_block: 16,
                            max_prompt_tokens: 4096,
                            context_len: ctx,
                            ..Opened::default()
                        })
                    }
                    Some(client_message::Msg::Draft(d)) => server_message::Msg::Verdict(Verdict {
                        round: d.round,
                        accepted: 0,
                        next_token: 4_000_000_000,
                        context_len: ctx + 1,
                        hidden: None,
                        logprobs: Vec::new(),
                    }),
                    _ => return,
                };
                if tx.send(Ok(ServerMessage { msg: Some(msg) })).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

#[test]
fn a_turn_a_hostile_verifier_breaks_leaves_the_history_as_it_was() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let draft = Model::load(draft_path(), LoadOptions::with_max_seq_len(256)).unwrap();
    let tok = Tokenizer::from_gguf(draft.gguf()).unwrap();
    let vocab = u32::try_from(draft.config().vocab).unwrap();
    drop(draft);
    let io = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = io
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let opens: Arc<Mutex<Vec<Vec<u32>>>> = Arc::default();
    io.spawn(
        tonic::transport::Server::builder()
            .add_service(VerifierServer::new(Hostile {
                vocab,
                opens: opens.clone(),
            }))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    // No privacy router: every turn goes to the verifier.
    let cfg = write(
        dir.path(),
        "hostile.toml",
        &format!(
            "draft_model = {:?}\nmax_seq_len = 256\nprivacy_router = false\n[edge]\n\
             verifier_url = \"http://{addr}\"\ntoken = \"capi-test-device-token-0123456789\"\n\
             connect_timeout_ms = 2000\n",
            draft_path()
        ),
    );
    let rt = runtime(&cfg);
    let (first, second) = within(120, move || {
        let rt = rt as *const TandemRuntime;
        let c = new_conversation(rt);
        let first = send(rt, c, "Say hi.", None, ptr::null_mut());
        let second = send(rt, c, "Say bye.", None, ptr::null_mut());
        // SAFETY: from this runtime, no generation runs.
        unsafe {
            tandem_conversation_free(rt, c);
            tandem_runtime_free(rt as *mut TandemRuntime);
        }
        (first, second)
    });
    for (st, msg) in [&first, &second] {
        assert_eq!(*st, TandemStatus::Protocol, "{msg}");
        assert!(msg.contains("outside the vocabulary"), "{msg}");
    }
    // The second turn's Open carries the second message alone: the refused
    // first turn left nothing in the history.
    let opens = opens.lock().unwrap().clone();
    assert_eq!(opens.len(), 2, "one Open per turn");
    let want = tok
        .encode_chat(&[ChatMessage::user("Say bye.")], true)
        .unwrap();
    assert_eq!(opens[1], want);
    drop(io);
}
