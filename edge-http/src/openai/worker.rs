//! The generation workers: `parallel` slot threads, each owning a
//! [`RoutedRuntime`] (the first one given, the others its siblings: the same
//! draft weights, shared conversation cache and privacy pins, their own
//! draft KV and verifier session per generation), so a long answer on one
//! slot does not hold back a short completion on another. Requests wait in
//! one bounded FIFO queue (`std::sync::mpsc`, taken by whichever slot is
//! free: strictly first come, first served); a request that finds `depth`
//! others waiting gets 429. Slots share the CPU: each forward a slot runs is
//! a job on the shared forward pool, and the pool serves the slots' jobs in
//! turn, so two generations progress at the same pace whatever their
//! lengths. Each job streams [`Event`]s back through its own channel; the
//! per-token callback returns false (which stops the runtime, and closes the
//! verifier session) once the job's cancel flag is set, its receiver is
//! gone, or the server shuts down.
//!
//! The runtimes live on plain threads (not tokio blocking-pool threads)
//! because each owns a tokio runtime of its own, which must neither be
//! driven nor dropped from async code.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use tandem_model::logprobs::TokenLogprobs;

use tandem_model::speculative::{GenerateConfig, StopReason};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use super::call_scan::{CallScan, Piece};
use super::error::ApiError;
use super::format::{forced_call, lazy_call, OutputFormat};
use super::metrics::{ServeCounters, ServeMetrics};
use super::request::{GenRequest, Input};
use super::tools::CallFormat;
use tandem_edge::context_policy::{fit_chat_cancellable, ContextError};
use tandem_edge::{EdgeEvent, EdgeStats, ProvisionalCheck, ProvisionalReport, TokenStatus};
use tandem_edge::{RoutedDecision, RoutedRuntime, Routing, Turn};
use tandem_grammar::{Grammar, GrammarVocab};

/// What a job reports, in order: `Started`, then `Delta`/`Checked`, then
/// `Done` — or `Failed` at any point.
#[derive(Debug)]
pub enum Event {
    Started {
        /// The privacy router's decision (None when the server does not route).
        route: Option<Box<RoutedDecision>>,
        prompt_tokens: usize,
    },
    /// Text and the tokens that produced it (a token may carry no text of its
    /// own, e.g. half of a UTF-8 character; its text comes with a later one).
    Delta {
        text: String,
        ids: Vec<u32>,
        statuses: Vec<TokenStatus>,
        /// Each token's logprobs (requests asking for them; else empty).
        logprobs: Vec<Option<Box<TokenLogprobs>>>,
    },
    /// A tool call the model made (chat with tools): the tokens since the
    /// last event produced it.
    ToolCall {
        /// 0, 1, … in the order of the calls.
        index: usize,
        /// `call_…`, unique.
        id: String,
        name: String,
        /// Compact JSON text.
        arguments: String,
        ids: Vec<u32>,
        statuses: Vec<TokenStatus>,
        /// The call's tokens' logprobs (requests asking for them; else empty).
        logprobs: Vec<Option<Box<TokenLogprobs>>>,
    },
    /// The verifier came back and judged a provisional span.
    Checked(ProvisionalCheck),
    Done(Box<Done>),
    Failed(ApiError),
}

/// The end of a successful job.
#[derive(Debug)]
pub struct Done {
    /// `stop` (end of turn or a stop sequence), `length`, or `tool_calls`
    /// (the model made at least one tool call).
    pub finish_reason: &'static str,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub stats: EdgeStats,
    pub provisional: ProvisionalReport,
    pub session_id: Option<String>,
    /// The server's sequence number of this generation (1, 2, …: the order
    /// in which slots took them).
    pub job: u64,
    /// The generation slot that ran it (0-based).
    pub slot: usize,
    /// Time the request waited in the queue.
    pub queue_wait_ms: f64,
}

/// One queued request.
pub struct Job {
    pub req: GenRequest,
    pub events: UnboundedSender<Event>,
    pub cancel: Arc<AtomicBool>,
    /// When the request was admitted.
    pub admitted: std::time::Instant,
}

/// A request's place in the server: counted in the worker's `pending` from
/// admission until its job ends or its client goes away (whichever comes
/// first), so abandoned requests never fill the queue.
pub struct QueueSlot {
    queued: Arc<AtomicUsize>,
    held: AtomicBool,
}

impl QueueSlot {
    /// Gives the place up (idempotent).
    pub fn release(&self) {
        if self.held.swap(false, Ordering::SeqCst) {
            self.queued.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A queued job with its queue place.
type Queued = (Job, Arc<QueueSlot>);

pub struct Worker {
    tx: Mutex<Option<mpsc::Sender<Queued>>>,
    /// Admitted requests whose job has not ended and whose client still
    /// waits: the running ones and those in the queue.
    pending: Arc<AtomicUsize>,
    depth: usize,
    /// Generation slots.
    parallel: usize,
    counters: Arc<Mutex<ServeCounters>>,
    shutdown: Arc<AtomicBool>,
    metrics: Arc<ServeMetrics>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What every slot thread shares.
struct Shared {
    rx: Mutex<mpsc::Receiver<Queued>>,
    counters: Arc<Mutex<ServeCounters>>,
    shutdown: Arc<AtomicBool>,
    metrics: Arc<ServeMetrics>,
    /// The last job number handed out.
    seq: AtomicU64,
    routed: bool,
    /// Admitted requests not yet ended (the worker's `pending`): an idle
    /// slot's catch-up yields as soon as one arrives.
    pending: Arc<AtomicUsize>,
    /// The tokenizer's grammar vocabulary (structured output), built on the
    /// first request that asks for a format (about half a second for a
    /// 151k-token vocabulary) and shared by the slots (one model).
    grammar_vocab: std::sync::OnceLock<Result<GrammarVocab, String>>,
}

impl Worker {
    /// Starts one slot thread per runtime in `rts` (at least one).
    /// `routed`: ask the privacy router before each generation when a
    /// verifier is configured (else every request goes to `generate`, which
    /// is local without a verifier).
    pub fn spawn(
        rts: Vec<RoutedRuntime>,
        routed: bool,
        depth: usize,
        metrics: Arc<ServeMetrics>,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Queued>();
        let pending = Arc::new(AtomicUsize::new(0));
        let parallel = rts.len();
        let counters = Arc::new(Mutex::new(ServeCounters {
            queue_depth: depth,
            parallel,
            ..ServeCounters::default()
        }));
        let shutdown = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            rx: Mutex::new(rx),
            counters: counters.clone(),
            shutdown: shutdown.clone(),
            metrics: metrics.clone(),
            seq: AtomicU64::new(0),
            pending: pending.clone(),
            routed,
            grammar_vocab: std::sync::OnceLock::new(),
        });
        let worker = Self {
            tx: Mutex::new(Some(tx)),
            pending,
            depth,
            parallel,
            counters,
            shutdown,
            metrics,
        };
        for (slot, rt) in rts.into_iter().enumerate() {
            let shared = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("tandem-serve-gen-{slot}"))
                .spawn(move || run_slot(rt, slot, &shared));
            if let Err(e) = spawned {
                worker.stop();
                return Err(e);
            }
        }
        Ok(worker)
    }

    /// Queues `job`, or refuses it with 429 when every slot is taken and
    /// `depth` jobs already wait (whether a free slot has woken up to take
    /// its job yet does not matter). The caller releases the returned place
    /// when its client goes away.
    pub fn submit(&self, job: Job) -> Result<Arc<QueueSlot>, ApiError> {
        let (depth, capacity) = (self.depth, self.depth.saturating_add(self.parallel));
        let admitted = self
            .pending
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < capacity).then_some(n + 1)
            })
            .is_ok();
        if !admitted {
            lock(&self.counters).rejected_queue_full += 1;
            return Err(ApiError::queue_full(depth));
        }
        let slot = Arc::new(QueueSlot {
            queued: self.pending.clone(),
            held: AtomicBool::new(true),
        });
        let sent = lock(&self.tx)
            .as_ref()
            .map(|tx| tx.send((job, slot.clone())).is_ok())
            .unwrap_or(false);
        if !sent {
            slot.release();
            return Err(ApiError::server("the generation worker has stopped"));
        }
        lock(&self.counters).admitted += 1;
        Ok(slot)
    }

    pub fn counters(&self) -> ServeCounters {
        let mut c = lock(&self.counters).clone();
        c.queued = self.pending.load(Ordering::SeqCst).saturating_sub(c.active);
        c
    }

    pub fn metrics(&self) -> &ServeMetrics {
        &self.metrics
    }

    /// Cancels the running generations and every queued one; the threads
    /// end (and drop their runtimes) once the queue is drained.
    pub fn stop(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
        lock(&self.tx).take();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One generation slot: takes the next queued job whenever it is free.
fn run_slot(mut rt: RoutedRuntime, slot: usize, shared: &Shared) {
    let tok = rt.tokenizer().clone();
    // Without a verifier nothing can leave the device: no decision to take.
    let routed = shared.routed && rt.runtime().config().verifier_url.is_some();
    loop {
        // The receiver's lock is held while waiting: the free slots queue
        // up behind it, and the queue stays strictly FIFO.
        let next = lock(&shared.rx).recv();
        let Ok((job, place)) = next else {
            break;
        };
        if job.cancel.load(Ordering::SeqCst)
            || job.events.is_closed()
            || shared.shutdown.load(Ordering::SeqCst)
        {
            lock(&shared.counters).cancelled += 1;
            place.release();
            continue;
        }
        {
            let mut c = lock(&shared.counters);
            c.active += 1;
            c.running = true;
        }
        let seq = shared.seq.fetch_add(1, Ordering::SeqCst) + 1;
        let ctx = JobCtx {
            routed,
            seq,
            slot,
            shutdown: &shared.shutdown,
            grammar_vocab: &shared.grammar_vocab,
        };
        let (outcome, last) = run_job(&mut rt, &tok, &job, &ctx);
        if let Some(Event::Done(d)) = &last {
            shared
                .metrics
                .generation(d.prompt_tokens, d.completion_tokens, &d.stats);
        }
        {
            // Counted before the last event goes out: a client that has its
            // answer sees it in the counters.
            let mut c = lock(&shared.counters);
            c.active = c.active.saturating_sub(1);
            c.running = c.active > 0;
            match outcome {
                Outcome::Completed => c.completed += 1,
                Outcome::Cancelled => c.cancelled += 1,
                Outcome::Failed => c.failed += 1,
            }
        }
        // Free before the answer goes out: a client that has it may send
        // the next request at once.
        place.release();
        if let Some(ev) = last {
            let _ = job.events.send(ev);
        }
        catch_up(&mut rt, slot, shared);
    }
    tracing::debug!(slot, "generation slot stopped");
}

/// Between requests: with nothing admitted (queued or running on any slot),
/// runs what kept conversations' draft KV lacks through the draft (a turn
/// that prompt lookup served leaves its reply behind: docs/edge.md
/// "Catching the draft up between turns"), so the next turn's first token
/// waits for its new tokens only. Background work: it yields, after at most
/// one chunk of rows, as soon as a request is admitted or a generation runs
/// on a sibling slot.
fn catch_up(rt: &mut RoutedRuntime, slot: usize, shared: &Shared) {
    let busy =
        || shared.pending.load(Ordering::SeqCst) > 0 || shared.shutdown.load(Ordering::SeqCst);
    if busy() {
        return;
    }
    match rt.catch_up(&busy) {
        Ok(c) => {
            if c.rows > 0 {
                tracing::debug!(
                    slot,
                    rows = c.rows,
                    yielded = c.yielded,
                    "draft caught up while idle"
                );
            }
            let mut n = lock(&shared.counters);
            n.draft_caught_up_rows += c.rows as u64;
            n.catch_up_yields += u64::from(c.yielded && c.rows > 0);
        }
        Err(e) => tracing::warn!(slot, error = %e, "catching the draft up failed"),
    }
}

/// What [`run_job`] needs of its slot.
struct JobCtx<'a> {
    routed: bool,
    seq: u64,
    slot: usize,
    shutdown: &'a AtomicBool,
    grammar_vocab: &'a std::sync::OnceLock<Result<GrammarVocab, String>>,
}

/// The request's output format compiled against the tokenizer: its
/// response_format, or a forced call's arguments' schema. A grammar that
/// does not compile (or is too large) is a 400 naming its parameter.
fn output_grammar(
    tok: &Tokenizer,
    vocab: &std::sync::OnceLock<Result<GrammarVocab, String>>,
    format: Option<OutputFormat>,
) -> Result<Option<Arc<dyn tandem_model::engine::OutputGrammar>>, ApiError> {
    let Some(f) = format else {
        return Ok(None);
    };
    let vocab = vocab
        .get_or_init(|| GrammarVocab::new(tok).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| {
            ApiError::invalid(
                format!("structured output is not available with this model's tokenizer: {e}"),
                Some(f.param),
            )
        })?;
    match Grammar::new(vocab, f.spec) {
        Ok(g) => Ok(Some(g.into_config())),
        Err(e) => Err(ApiError::invalid(
            format!("{}: {e}", f.param),
            Some(f.param),
        )),
    }
}

enum Outcome {
    Completed,
    Cancelled,
    Failed,
}

/// Text handed out so far and text held back because it might be the start
/// of a stop sequence.
struct StopScan<'a> {
    stops: &'a [String],
    /// Longest stop sequence in bytes (0: none).
    max_len: usize,
    full: String,
    sent: usize,
    hit: bool,
}

impl<'a> StopScan<'a> {
    fn new(stops: &'a [String]) -> Self {
        Self {
            stops,
            max_len: stops.iter().map(String::len).max().unwrap_or(0),
            full: String::new(),
            sent: 0,
            hit: false,
        }
    }

    /// Adds decoded text; returns the text that may be sent now.
    fn push(&mut self, piece: &str) -> String {
        self.full.push_str(piece);
        if self.max_len == 0 {
            let out = self.full[self.sent..].to_string();
            self.sent = self.full.len();
            return out;
        }
        // A match always starts at or after `sent` (see docs/api.md).
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.full[self.sent..].find(s.as_str()))
            .min();
        let end = match first {
            Some(p) => {
                self.hit = true;
                self.sent + p
            }
            None => {
                let mut e = self
                    .full
                    .len()
                    .saturating_sub(self.max_len - 1)
                    .max(self.sent);
                while !self.full.is_char_boundary(e) {
                    e -= 1;
                }
                e.max(self.sent)
            }
        };
        let out = self.full[self.sent..end].to_string();
        self.sent = end;
        if self.hit {
            self.full.truncate(end);
        }
        out
    }

    /// Everything not sent yet (at the end, without a match).
    fn rest(&mut self) -> String {
        if self.hit {
            return String::new();
        }
        let out = self.full[self.sent..].to_string();
        self.sent = self.full.len();
        out
    }
}

/// Turns the output text (after stop sequences) into events: plain
/// deltas, or, when the request's tools are parsed, content and tool calls
/// ([`CallScan`]). The tokens since the last event go with the next one.
struct Emitter {
    calls: Option<CallScan>,
    /// More than one call may be made (else the generation stops after the
    /// first).
    several: bool,
    /// The job's sequence number (call ids).
    seq: u64,
    ids: Vec<u32>,
    statuses: Vec<TokenStatus>,
    /// The request asked for logprobs: each token's go with it.
    want_logprobs: bool,
    logprobs: Vec<Option<Box<TokenLogprobs>>>,
}

impl Emitter {
    fn new(calls: Option<CallScan>, several: bool, seq: u64, want_logprobs: bool) -> Self {
        Self {
            calls,
            several,
            seq,
            ids: Vec::new(),
            statuses: Vec::new(),
            want_logprobs,
            logprobs: Vec::new(),
        }
    }

    fn token(&mut self, id: u32, status: TokenStatus, logprobs: &Option<Box<TokenLogprobs>>) {
        self.ids.push(id);
        self.statuses.push(status);
        if self.want_logprobs {
            self.logprobs.push(logprobs.clone());
        }
    }

    /// Calls made so far.
    fn calls(&self) -> usize {
        self.calls.as_ref().map_or(0, CallScan::calls)
    }

    /// Whether the generation should stop: one call was made and only one
    /// is wanted.
    fn call_limit_reached(&self) -> bool {
        !self.several && self.calls() > 0
    }

    /// Sends what `text` decides (`force`: a delta even when empty, so
    /// the tokens go out); false when the client is gone.
    fn text(&mut self, text: &str, force: bool, send: &dyn Fn(Event) -> bool) -> bool {
        let pieces = match &mut self.calls {
            None => vec![Piece::Text(text.to_string())],
            Some(c) => c.push(text),
        };
        self.send_pieces(pieces, force, send)
    }

    /// The end: what is still held is decided and sent with the last
    /// tokens.
    fn finish(&mut self, tail: &str, send: &dyn Fn(Event) -> bool) -> bool {
        let pieces = match &mut self.calls {
            None => vec![Piece::Text(tail.to_string())],
            Some(c) => {
                let mut p = c.push(tail);
                p.extend(c.finish());
                p
            }
        };
        let force = !self.ids.is_empty();
        self.send_pieces(pieces, force, send)
    }

    fn send_pieces(
        &mut self,
        pieces: Vec<Piece>,
        force: bool,
        send: &dyn Fn(Event) -> bool,
    ) -> bool {
        let mut sent = false;
        for p in pieces {
            if matches!(&p, Piece::Text(text) if text.is_empty()) {
                continue;
            }
            let (ids, statuses, logprobs) = (
                std::mem::take(&mut self.ids),
                std::mem::take(&mut self.statuses),
                std::mem::take(&mut self.logprobs),
            );
            let ev = match p {
                Piece::Text(text) => Event::Delta {
                    text,
                    ids,
                    statuses,
                    logprobs,
                },
                Piece::Call { name, arguments } => {
                    let index = self.calls().saturating_sub(1);
                    Event::ToolCall {
                        id: call_id(self.seq, index),
                        index,
                        name,
                        arguments,
                        ids,
                        statuses,
                        logprobs,
                    }
                }
            };
            sent = true;
            if !send(ev) {
                return false;
            }
        }
        if force && !sent {
            return send(Event::Delta {
                text: String::new(),
                ids: std::mem::take(&mut self.ids),
                statuses: std::mem::take(&mut self.statuses),
                logprobs: std::mem::take(&mut self.logprobs),
            });
        }
        true
    }
}

/// A tool call's id: `call_` and hex digits unique within this server
/// process (the clock, the job and the call's index).
fn call_id(seq: u64, index: usize) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("call_{nanos:08x}{seq:x}{index:02x}")
}

/// What the privacy router reads of a chat with tools: each message with
/// its calls' names and arguments after its content, and the tool
/// definitions after the first message's (the messages keep their indices
/// and the contents their offsets, which the decision reports).
fn routing_messages(messages: &[ChatMessage], tools: &[serde_json::Value]) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = messages
        .iter()
        .map(|m| {
            let mut text = m.content.clone();
            for c in &m.tool_calls {
                text.push('\n');
                text.push_str(&c.name);
                text.push(' ');
                text.push_str(&c.arguments.to_string());
            }
            ChatMessage::new(m.role, text)
        })
        .collect();
    if let (Some(first), false) = (out.first_mut(), tools.is_empty()) {
        first.content.push('\n');
        first
            .content
            .push_str(&serde_json::Value::Array(tools.to_vec()).to_string());
    }
    out
}

/// The tokens of a prompt without a chat template: a raw completion, or a
/// fill-in-the-middle one in the model's FIM format.
fn raw_prompt(tok: &Tokenizer, input: &Input) -> tandem_model::Result<Vec<u32>> {
    match input {
        Input::Chat(m) => tok.encode_chat(m, true),
        Input::Text(t) => tok.encode_prompt(t),
        Input::Fim { prefix, suffix } => tok.encode_fim(prefix, suffix),
        Input::Infill {
            prefix,
            suffix,
            prompt,
            extra,
        } => tok.encode_infill(prefix, suffix, prompt, extra),
    }
}

/// Runs one job, streaming its events; returns the outcome and the last
/// event (`Done` or `Failed`), which the caller sends after counting.
fn run_job(
    rt: &mut RoutedRuntime,
    tok: &Tokenizer,
    job: &Job,
    ctx: &JobCtx,
) -> (Outcome, Option<Event>) {
    let (routed, seq, shutdown) = (ctx.routed, ctx.seq, ctx.shutdown);
    let queue_wait_ms = job.admitted.elapsed().as_secs_f64() * 1000.0;
    let req = &job.req;
    let send = |e: Event| job.events.send(e).is_ok();
    let fail = |e: ApiError| (Outcome::Failed, Some(Event::Failed(e)));
    let cfg = rt.runtime().config();
    let offered: &[serde_json::Value] = req.tools.as_ref().map_or(&[], |t| t.offered());
    // The request was refused before queueing when the template's call
    // format is unknown (`tools_unsupported`).
    let format = tok.chat_template().and_then(CallFormat::of_template);
    let (messages, prompt, dropped_messages) = match &req.input {
        Input::Chat(m) => {
            // The context policy (refuse, or drop the oldest turns) applies here,
            // and the reply says how many messages were dropped.
            let limit = rt.runtime().context_limit();
            let policy = cfg.conversations.context_policy;
            let cancelled =
                || job.cancel.load(Ordering::Relaxed) || shutdown.load(Ordering::Relaxed);
            let fitted =
                fit_chat_cancellable(tok, m, offered, limit, req.max_tokens, policy, &cancelled);
            match fitted {
                Ok(f) => (routing_messages(m, offered), f.prompt, f.dropped_messages),
                Err(ContextError::Cancelled) => return (Outcome::Cancelled, None),
                Err(e @ ContextError::TooLong { .. }) => {
                    let e = ApiError::invalid(e.to_string(), Some("messages"))
                        .with_code("context_length_exceeded");
                    return fail(e);
                }
                Err(e) => return fail(ApiError::invalid(e.to_string(), None)),
            }
        }
        other => match raw_prompt(tok, other) {
            // The router sees every text the prompt carries.
            Ok(p) => (
                other.texts().into_iter().map(ChatMessage::user).collect(),
                p,
                0,
            ),
            Err(e) => return fail(ApiError::invalid(e.to_string(), None)),
        },
    };
    // A forced call (`required`, a named function): the prompt opens it and
    // the model continues (the scanner sees the opening first).
    let mut prompt = prompt;
    let mut calls = None;
    if let (Some(t), Some(f)) = (req.tools.as_ref().filter(|t| t.parses_calls()), format) {
        let mut scan = CallScan::new(f, t.names());
        let forced = f.forced_prefix(&t.choice);
        if !forced.is_empty() {
            match tok.encode(&forced, false) {
                Ok(ids) => prompt.extend(ids),
                Err(e) => return fail(ApiError::invalid(e.to_string(), Some("tool_choice"))),
            }
            scan.push(&forced);
        }
        calls = Some(scan);
    }
    // Structured output: a forced call's arguments, else the response_format,
    // else (`auto`) the lazy grammar of a call the model starts.
    let format = match (req.tools.as_ref().filter(|t| t.parses_calls()), format) {
        (Some(t), Some(f)) => forced_call(f, t)
            .or_else(|| req.format.clone())
            .or_else(|| lazy_call(f, t)),
        _ => req.format.clone(),
    };
    let grammar = match output_grammar(tok, ctx.grammar_vocab, format) {
        Ok(g) => g,
        Err(e) => return fail(e),
    };
    let several = req.tools.as_ref().is_none_or(|t| t.allows_several_calls());
    let mut out = Emitter::new(calls, several, seq, req.logprobs.is_some());
    let gen = GenerateConfig {
        max_tokens: req.max_tokens,
        k: cfg.k,
        proposer: cfg.proposer,
        sampling: req.sampling,
        top_logprobs: req.logprobs,
        stop_tokens: if req.ignore_eos {
            Vec::new()
        } else {
            tok.chat_stop_tokens()
        },
        grammar,
        ..GenerateConfig::default()
    };
    if let Err(e) = gen.validate() {
        return fail(ApiError::invalid(e.to_string(), None));
    }
    let conv = match &req.conversation_id {
        Some(c) => c.clone(),
        // Unique per job: slots route at once, and one anonymous request's
        // pin must not be seen by another's.
        None => format!("request-{}-{seq}", std::process::id()),
    };
    let turn = Turn {
        routing: if routed {
            Routing::Router
        } else {
            Routing::Speculative
        },
        // A named conversation keeps its state under its id; an anonymous one is
        // found again by its prompt's prefix (tandem_edge::conversation).
        state: req.conversation_id.as_deref(),
        // No caller-given id: nothing to remember across requests.
        ephemeral: req.conversation_id.is_none(),
        // Anonymous requests share kept state only within one identity (the API
        // key's holders, or one OS user on loopback: `super::peer`); one client
        // must not learn how much of its prompt matches another's cached one.
        anonymous_scope: req.anonymous_scope.clone(),
        // Asked before the first token too: between the draft's prefill
        // chunks, while the verifier opens.
        cancel: Some(job.cancel.clone()),
        ..Turn::new(&conv, &messages, &prompt, &gen)
    };
    let mut started = |route: Option<&RoutedDecision>| {
        send(Event::Started {
            route: route.cloned().map(Box::new),
            prompt_tokens: prompt.len(),
        })
    };
    let mut dec = tok.stream_decoder(true);
    let mut scan = StopScan::new(&req.stop);
    let mut gone = false;
    let mut on_event = |ev: &EdgeEvent| -> bool {
        if job.cancel.load(Ordering::Relaxed) || shutdown.load(Ordering::Relaxed) {
            gone = true;
            return false;
        }
        match ev {
            EdgeEvent::Token {
                id,
                status,
                logprobs,
                ..
            } => {
                out.token(*id, *status, logprobs);
                if let Some(piece) = dec.push(*id) {
                    let text = scan.push(&piece);
                    if (!text.is_empty() || scan.hit) && !out.text(&text, scan.hit, &send) {
                        gone = true;
                        return false;
                    }
                }
                !scan.hit && !out.call_limit_reached()
            }
            EdgeEvent::ProvisionalChecked(c) => {
                if !send(Event::Checked(c.clone())) {
                    gone = true;
                    return false;
                }
                true
            }
        }
    };
    let mut g = match rt.turn(turn, &mut started, &mut on_event) {
        Ok(Some(t)) => t.generation,
        // The client was gone when the route was decided.
        Ok(None) => return (Outcome::Cancelled, None),
        Err(e) => {
            tracing::warn!(error = %e, "generation failed");
            return fail(e.into());
        }
    };
    // Gone at a token, or before the first one (the runtime asked the
    // job's cancel flag: the generation stopped as cancelled).
    if gone || job.cancel.load(Ordering::SeqCst) || shutdown.load(Ordering::SeqCst) {
        return (Outcome::Cancelled, None);
    }
    let mut tail = String::new();
    if !scan.hit {
        if let Some(p) = dec.flush() {
            scan.push(&p);
        }
        tail = scan.rest();
    }
    out.finish(&tail, &send);
    g.stats.dropped_messages = dropped_messages;
    let finish_reason = match g.stop {
        StopReason::MaxTokens | StopReason::ContextFull if !out.call_limit_reached() => "length",
        _ if out.calls() > 0 => "tool_calls",
        _ if scan.hit => "stop",
        StopReason::Stop | StopReason::Cancelled => "stop",
        StopReason::MaxTokens | StopReason::ContextFull => "length",
    };
    let done = Event::Done(Box::new(Done {
        finish_reason,
        prompt_tokens: prompt.len(),
        completion_tokens: g.tokens.len(),
        stats: g.stats,
        provisional: g.provisional,
        session_id: g.session_id,
        job: seq,
        slot: ctx.slot,
        queue_wait_ms,
    }));
    (Outcome::Completed, Some(done))
}

#[cfg(test)]
mod tests {
    use super::StopScan;

    #[test]
    fn stop_sequences_cut_the_text_across_pieces() {
        let stops = vec!["END".to_string()];
        let mut s = StopScan::new(&stops);
        let mut out = String::new();
        for p in ["hello E", "N", "D world"] {
            out.push_str(&s.push(p));
            if s.hit {
                break;
            }
        }
        assert!(s.hit);
        assert_eq!(out, "hello ");
        let none: Vec<String> = Vec::new();
        let mut s = StopScan::new(&none);
        assert_eq!(s.push("héllo"), "héllo");
        let stops = vec!["xyz".to_string()];
        let mut s = StopScan::new(&stops);
        let mut out = s.push("ab é");
        out.push_str(&s.push("c"));
        out.push_str(&s.rest());
        assert!(!s.hit);
        assert_eq!(out, "ab éc");
    }
}
