//! The generation worker: one dedicated thread owns the [`RoutedRuntime`] and
//! runs one generation at a time (the device's CPU is the bottleneck; two
//! at once would only slow both). Requests wait in a bounded FIFO queue
//! (`std::sync::mpsc`, so strictly first come, first served); a request that
//! finds `depth` others waiting gets 429. Each job streams [`Event`]s back
//! through its own channel; the per-token callback returns false (which
//! stops the runtime, and closes the verifier session) once the job's cancel
//! flag is set, its receiver is gone, or the server shuts down.
//!
//! The runtime lives on a plain thread (not a tokio blocking-pool thread)
//! because it owns a tokio runtime of its own, which must neither be driven
//! nor dropped from async code.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};

use serde::Serialize;
use tandem_model::speculative::{GenerateConfig, StopReason};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_router::Action;
use tokio::sync::mpsc::UnboundedSender;

use super::error::ApiError;
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
    /// The server's sequence number of this generation (1, 2, …: run order).
    pub job: u64,
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

/// Counters of the server's life (`GET /admin/v1/serve/stats`). No text.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ServeCounters {
    /// Generation requests admitted to the queue.
    pub admitted: u64,
    /// Refused with 429 because the queue was full.
    pub rejected_queue_full: u64,
    pub completed: u64,
    /// Stopped because the client went away (or the server shut down),
    /// while running or still queued.
    pub cancelled: u64,
    pub failed: u64,
    /// Requests waiting now (not counting the running one).
    pub queued: usize,
    /// A generation is running now.
    pub running: bool,
    pub queue_depth: usize,
}

/// A request's place in the queue: counted in the worker's `queued` from
/// admission until the worker takes the job or the client goes away
/// (whichever comes first), so abandoned requests never fill the queue.
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
    queued: Arc<AtomicUsize>,
    depth: usize,
    counters: Arc<Mutex<ServeCounters>>,
    shutdown: Arc<AtomicBool>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Worker {
    /// Starts the worker thread around `rt`. `routed`: ask the privacy router
    /// before each generation when a verifier is configured (else every
    /// request goes to `generate`, which is local without a verifier).
    pub fn spawn(rt: RoutedRuntime, routed: bool, depth: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Queued>();
        let queued = Arc::new(AtomicUsize::new(0));
        let counters = Arc::new(Mutex::new(ServeCounters {
            queue_depth: depth,
            ..ServeCounters::default()
        }));
        let shutdown = Arc::new(AtomicBool::new(false));
        let (c, sd) = (counters.clone(), shutdown.clone());
        std::thread::Builder::new()
            .name("tandem-serve-gen".into())
            .spawn(move || run_worker(rt, routed, rx, c, sd))?;
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            queued,
            depth,
            counters,
            shutdown,
        })
    }

    /// Queues `job`, or refuses it with 429 when `depth` jobs already wait.
    /// The caller releases the returned slot when its client goes away.
    pub fn submit(&self, job: Job) -> Result<Arc<QueueSlot>, ApiError> {
        let depth = self.depth;
        let admitted = self
            .queued
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < depth).then_some(n + 1)
            })
            .is_ok();
        if !admitted {
            lock(&self.counters).rejected_queue_full += 1;
            return Err(ApiError::queue_full(depth));
        }
        let slot = Arc::new(QueueSlot {
            queued: self.queued.clone(),
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
        c.queued = self.queued.load(Ordering::SeqCst);
        c
    }

    /// Cancels the running generation and every queued one; the thread ends
    /// (and drops the runtime) once the queue is drained.
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

fn run_worker(
    mut rt: RoutedRuntime,
    routed: bool,
    rx: mpsc::Receiver<Queued>,
    counters: Arc<Mutex<ServeCounters>>,
    shutdown: Arc<AtomicBool>,
) {
    let tok = rt.tokenizer().clone();
    // Without a verifier nothing can leave the device: no decision to take.
    let routed = routed && rt.runtime().config().verifier_url.is_some();
    let mut seq = 0u64;
    for (job, slot) in rx {
        slot.release();
        if job.cancel.load(Ordering::SeqCst)
            || job.events.is_closed()
            || shutdown.load(Ordering::SeqCst)
        {
            lock(&counters).cancelled += 1;
            continue;
        }
        lock(&counters).running = true;
        seq += 1;
        // Asked before the first token too: while fitting the context,
        // between the draft's prefill chunks, while the verifier opens.
        rt.runtime_mut().set_cancel_flag(Some(job.cancel.clone()));
        let (outcome, last) = run_job(&mut rt, &tok, routed, &job, seq, &shutdown);
        rt.runtime_mut().set_cancel_flag(None);
        {
            // Counted before the last event goes out: a client that has its
            // answer sees it in the counters.
            let mut c = lock(&counters);
            c.running = false;
            match outcome {
                Outcome::Completed => c.completed += 1,
                Outcome::Cancelled => c.cancelled += 1,
                Outcome::Failed => c.failed += 1,
            }
        }
        if let Some(ev) = last {
            let _ = job.events.send(ev);
        }
    }
    tracing::debug!("generation worker stopped");
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

/// Runs one job, streaming its events; returns the outcome and the last
/// event (`Done` or `Failed`), which the caller sends after counting.
fn run_job(
    rt: &mut RoutedRuntime,
    tok: &Tokenizer,
    routed: bool,
    job: &Job,
    seq: u64,
    shutdown: &AtomicBool,
) -> (Outcome, Option<Event>) {
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
        Input::Text(t) => match tok.encode_prompt(t) {
            Ok(p) => (vec![ChatMessage::user(t.clone())], p, 0),
            Err(e) => return fail(ApiError::invalid(e.to_string(), None)),
        },
    };
    let gen = GenerateConfig {
        max_tokens: req.max_tokens,
        k: cfg.k,
        proposer: cfg.proposer,
        sampling: req.sampling,
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
        None => format!("request-{}", std::process::id()),
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
    let (mut ids, mut statuses) = (Vec::new(), Vec::new());
    let mut gone = false;
    let mut on_event = |ev: &EdgeEvent| -> bool {
        if job.cancel.load(Ordering::Relaxed) || shutdown.load(Ordering::Relaxed) {
            gone = true;
            return false;
        }
        match ev {
            EdgeEvent::Token { id, status, .. } => {
                ids.push(*id);
                statuses.push(*status);
                if let Some(piece) = dec.push(*id) {
                    let text = scan.push(&piece);
                    if !text.is_empty() || scan.hit {
                        let d = Event::Delta {
                            text,
                            ids: std::mem::take(&mut ids),
                            statuses: std::mem::take(&mut statuses),
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
