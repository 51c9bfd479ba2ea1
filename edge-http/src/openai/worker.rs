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
use tandem_router::Action;
use tokio::sync::mpsc::UnboundedSender;

use super::error::ApiError;
use super::metrics::{ServeCounters, ServeMetrics};
use super::request::{GenRequest, Input};
use tandem_edge::context_policy::{fit_messages_cancellable, ContextError};
use tandem_edge::{EdgeEvent, EdgeStats, ProvisionalCheck, ProvisionalReport, TokenStatus};
use tandem_edge::{RoutedDecision, RoutedRuntime};

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
    /// The verifier came back and judged a provisional span.
    Checked(ProvisionalCheck),
    Done(Box<Done>),
    Failed(ApiError),
}

/// The end of a successful job.
#[derive(Debug)]
pub struct Done {
    /// `stop` (end of turn or a stop sequence) or `length`.
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
            routed,
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
        // Asked before the first token too: while fitting the context,
        // between the draft's prefill chunks, while the verifier opens.
        rt.runtime_mut().set_cancel_flag(Some(job.cancel.clone()));
        let ctx = JobCtx {
            routed,
            seq,
            slot,
            shutdown: &shared.shutdown,
        };
        let (outcome, last) = run_job(&mut rt, &tok, &job, &ctx);
        rt.runtime_mut().set_cancel_flag(None);
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
    }
    tracing::debug!(slot, "generation slot stopped");
}

/// What [`run_job`] needs of its slot.
struct JobCtx<'a> {
    routed: bool,
    seq: u64,
    slot: usize,
    shutdown: &'a AtomicBool,
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
    let (messages, prompt, dropped_messages) = match &req.input {
        Input::Chat(m) => {
            // The context policy (refuse, or drop the oldest turns) applies here,
            // and the reply says how many messages were dropped.
            let limit = rt.runtime().context_limit();
            let policy = cfg.conversations.context_policy;
            let cancelled =
                || job.cancel.load(Ordering::Relaxed) || shutdown.load(Ordering::Relaxed);
            match fit_messages_cancellable(tok, m, limit, req.max_tokens, policy, &cancelled) {
                Ok(f) => (m.clone(), f.prompt, f.dropped_messages),
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
    let route = routed.then(|| rt.route(&conv, &messages));
    let local = route.as_ref().is_some_and(|r| r.action() == Action::Local);
    if req.conversation_id.is_none() {
        // No caller-given id: nothing to remember across requests.
        rt.forget(&conv);
    }
    if !send(Event::Started {
        route: route.map(Box::new),
        prompt_tokens: prompt.len(),
    }) {
        return (Outcome::Cancelled, None);
    }
    let mut dec = tok.stream_decoder(true);
    let mut scan = StopScan::new(&req.stop);
    let (mut ids, mut statuses, mut lps) = (Vec::new(), Vec::new(), Vec::new());
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
                ids.push(*id);
                statuses.push(*status);
                if req.logprobs.is_some() {
                    lps.push(logprobs.clone());
                }
                if let Some(piece) = dec.push(*id) {
                    let text = scan.push(&piece);
                    if !text.is_empty() || scan.hit {
                        let d = Event::Delta {
                            text,
                            ids: std::mem::take(&mut ids),
                            statuses: std::mem::take(&mut statuses),
                            logprobs: std::mem::take(&mut lps),
                        };
                        if !send(d) {
                            gone = true;
                            return false;
                        }
                    }
                }
                !scan.hit
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
    // A named conversation keeps its state under its id; an anonymous one is
    // found again by its prompt's prefix (tandem_edge::conversation).
    let name = req.conversation_id.as_deref();
    let res = if local {
        rt.runtime_mut()
            .generate_local_in(name, &prompt, &gen, &mut on_event)
    } else {
        rt.runtime_mut()
            .generate_in(name, &prompt, &gen, &mut on_event)
    };
    let mut g = match res {
        Ok(g) => g,
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
    if !tail.is_empty() || !ids.is_empty() {
        send(Event::Delta {
            text: tail,
            ids,
            statuses,
            logprobs: lps,
        });
    }
    g.stats.dropped_messages = dropped_messages;
    let finish_reason = match g.stop {
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
