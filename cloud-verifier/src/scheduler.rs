//! The batching scheduler: one thread owns the target model and, each
//! iteration, packs work from many sessions into one forward (continuous
//! batching, as vLLM does it):
//!
//! ```text
//!   handlers ──Job──▶ queue ──▶ iteration: pick rows ≤ max_batch_rows ──▶ forward_batch ──▶ Done
//!                                 1. verify blocks / one-token steps, oldest first
//!                                 2. prefill chunks (≤ prefill_chunk rows each),
//!                                    identities taken round-robin; a split
//!                                    session's prefill chunk is hidden rows that
//!                                    join the forward at its layer s
//!                                 (split rounds run alone: other layer ranges)
//! ```
//!
//! - A verify block is `[last, d1..dk]` (k = 0: a cloud-only streaming step);
//!   its logits come back for all k + 1 rows and the verdict is computed here
//!   ([`tandem_model::verify::verdict_from_logits`]). A prefill chunk asks for
//!   no logits: the verifier never needs them for prompt rows.
//! - Each session's rows attend only to its own KV pages, and the kernels'
//!   row contract makes every session's logits bit-identical whatever shares
//!   the forward (`model/tests/batch_sessions.rs`).
//! - Fairness: work is taken oldest first, and a verify block (at most
//!   `max_block + 1 ≤ max_batch_rows` rows) always fits an iteration, so
//!   nothing waits more than one iteration behind a later arrival. Verifies go
//!   before prefill, but prefill always gets a floor of rows so a long Open
//!   progresses; prefill chunks rotate between identities, so one identity's
//!   flood of long Opens cannot starve another's.
//! - With batching disabled (`[batching] enabled = false`), an iteration runs
//!   one job whole: the old one-forward-per-message path, for comparisons.
//! - A panic inside a forward is caught: the sessions of that batch lose their
//!   state (their handlers remove them, the devices re-send their context) and
//!   the thread goes on.
//!
//! Sessions' pages are reserved by the handlers before a job is submitted;
//! the forward never allocates KV.

use crate::error::Refusal;
use crate::metrics::Metrics;
use crate::session::SessionState;
use crate::split_session::SplitAnswer;
use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tandem_model::kv_pages::PagedKv;
use tandem_model::transformer::{BatchSeq, ForwardScratch, HiddenSeq, Logits, Model};
use tandem_model::verify::Verdict;
use tandem_proto::v1::Reason;
use tokio::sync::oneshot;

/// The scheduler's knobs (from `[batching]`).
#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    pub enabled: bool,
    pub max_batch_rows: usize,
    pub prefill_chunk: usize,
    pub gather_window: Duration,
}

/// What a job asks of the target.
pub enum Work {
    /// Feed `tokens` at the end of the session's KV (a new context, or the
    /// part of a resumed one the KV does not hold), in chunks; no logits.
    /// (The scheduler moves `tokens` into its queue entry on arrival.)
    Prefill { tokens: Vec<u32> },
    /// A split session's prefill: `hidden` (`[rows, d_model]`, the device's
    /// layers `[0, layer)` over the prompt) runs layers `[layer, N)` at the end
    /// of the session's KV, in chunks beside the other sessions' rows, like
    /// [`Work::Prefill`]; no logits. Nothing runs at `layer = N`.
    SplitPrefill { layer: usize, hidden: Vec<f32> },
    /// One forward over `[last, draft..]`, the verdict, and the KV rolled back
    /// to the accepted prefix; `draft` may be empty (a streaming step).
    Verify { draft: Vec<u32> },
    /// A forward that cannot share the batch (a split session's layer range):
    /// runs alone, with the model and the state.
    Alone(AloneFn),
}

/// A forward run alone by the scheduler, with the model and the session's state.
pub type AloneFn = Box<dyn FnOnce(&Model, &mut SessionState) -> Result<Outcome, Refusal> + Send>;

/// What came of a job.
#[derive(Debug)]
pub enum Outcome {
    Prefilled,
    Verdict(Verdict),
    /// A split round's answer (from an [`Work::Alone`] job).
    Split(SplitAnswer),
}

/// The answer to a job: the session's state (`None` when it was lost: a
/// panic or an internal error left its KV in doubt) and the outcome.
pub struct Done {
    pub state: Option<SessionState>,
    pub outcome: Result<Outcome, Refusal>,
}

/// One session's job.
pub struct Job {
    pub identity: Arc<str>,
    pub session: Arc<str>,
    pub state: SessionState,
    pub work: Work,
    pub reply: oneshot::Sender<Done>,
}

/// The handle the service submits jobs through.
pub struct Scheduler {
    tx: mpsc::Sender<(Job, Instant)>,
    panic_next: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
}

impl Scheduler {
    /// Starts the scheduler thread.
    pub fn start(
        model: Arc<Model>,
        cfg: SchedulerConfig,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel();
        let panic_next = Arc::new(AtomicBool::new(false));
        let paused = Arc::new(AtomicBool::new(false));
        let mut worker = Worker {
            model,
            cfg,
            metrics,
            rx,
            pending: VecDeque::new(),
            turn: 0,
            panic_next: panic_next.clone(),
            paused: paused.clone(),
            scratch: ForwardScratch::default(),
        };
        std::thread::Builder::new()
            .name("tandem-scheduler".into())
            .spawn(move || worker.run())?;
        Ok(Self {
            tx,
            panic_next,
            paused,
        })
    }

    /// Runs `job`; the answer comes on its `reply`. Refused only when the
    /// scheduler thread is gone.
    pub fn submit(&self, job: Job) -> Result<(), Refusal> {
        self.tx.send((job, Instant::now())).map_err(|_| {
            Refusal::new(
                Reason::InternalError,
                "the verifier's scheduler has stopped",
            )
        })
    }

    /// Fault injection for tests: the next forward panics (inside the
    /// scheduler's guard), as a kernel bug would.
    #[doc(hidden)]
    pub fn panic_next_forward(&self) {
        self.panic_next.store(true, Ordering::SeqCst);
    }

    /// Fault injection for tests: while paused the worker queues jobs but
    /// runs no forward (a scheduler busy with others' work, made
    /// deterministic).
    #[doc(hidden)]
    pub fn set_paused(&self, paused: bool) {
        self.paused.store(paused, Ordering::SeqCst);
    }
}

/// A queued job and its progress.
struct Pending {
    job: Job,
    arrived: Instant,
    /// Input rows: `[last, d..]` for a verify, the tokens for a prefill.
    input: Vec<u32>,
    /// Input rows of a split prefill (`[rows, d_model]`).
    hidden: Vec<f32>,
    /// Rows to run in all (of `input` or of `hidden`).
    rows: usize,
    /// Rows already run (prefill progress).
    fed: usize,
    /// When the job first got rows (queue wait).
    started: Option<Instant>,
}

impl Pending {
    fn is_prefill(&self) -> bool {
        matches!(
            self.job.work,
            Work::Prefill { .. } | Work::SplitPrefill { .. }
        )
    }
    /// The layer a split prefill's rows join at.
    fn join_layer(&self) -> Option<usize> {
        match self.job.work {
            Work::SplitPrefill { layer, .. } => Some(layer),
            _ => None,
        }
    }
    fn is_alone(&self) -> bool {
        matches!(self.job.work, Work::Alone(_))
    }
    fn left(&self) -> usize {
        self.rows.saturating_sub(self.fed)
    }
}

struct Worker {
    model: Arc<Model>,
    cfg: SchedulerConfig,
    metrics: Arc<Metrics>,
    rx: mpsc::Receiver<(Job, Instant)>,
    pending: VecDeque<Pending>,
    /// Round-robin start among identities for prefill chunks.
    turn: usize,
    panic_next: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    /// The forwards' intermediate rows and logits, kept from iteration to
    /// iteration (the largest batch's worth): an iteration allocates none.
    scratch: ForwardScratch,
}

impl Worker {
    fn run(&mut self) {
        loop {
            if self.pending.is_empty() {
                // Idle: wait for work, then a short window for company.
                match self.rx.recv() {
                    Ok(j) => self.enqueue(j),
                    Err(_) => return, // every handle dropped: the server stopped
                }
                let until = Instant::now() + self.cfg.gather_window;
                while let Some(wait) = until.checked_duration_since(Instant::now()) {
                    match self.rx.recv_timeout(wait) {
                        Ok(j) => self.enqueue(j),
                        Err(_) => break,
                    }
                }
            }
            while let Ok(j) = self.rx.try_recv() {
                self.enqueue(j);
            }
            self.drop_abandoned();
            if self.paused.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            self.iteration();
        }
    }

    fn enqueue(&mut self, (mut job, arrived): (Job, Instant)) {
        let cfg = self.model.config();
        let (d, n_layer) = (cfg.d_model.max(1), cfg.n_layer);
        let mut hidden = Vec::new();
        let input = match &mut job.work {
            // The rows move to `input` (or `hidden`); the job keeps only its kind.
            Work::Prefill { tokens } => std::mem::take(tokens),
            Work::Verify { draft, .. } => {
                let mut v = Vec::with_capacity(draft.len() + 1);
                v.extend(job.state.context.last().copied());
                v.extend_from_slice(draft);
                v
            }
            Work::SplitPrefill { layer, hidden: h } => {
                if *layer < n_layer {
                    hidden = std::mem::take(h);
                }
                Vec::new()
            }
            Work::Alone(_) => Vec::new(),
        };
        let rows = input.len() + hidden.len() / d;
        let p = Pending {
            job,
            arrived,
            input,
            hidden,
            rows,
            fed: 0,
            started: None,
        };
        // Nothing to run (an empty prefill) or no `last`: answer at once.
        if p.is_prefill() && p.rows == 0 {
            return finish(p, Ok(Outcome::Prefilled));
        }
        if matches!(p.job.work, Work::Verify { .. }) && p.job.state.context.is_empty() {
            return finish(
                p,
                Err(Refusal::new(
                    Reason::InternalError,
                    "session has no context",
                )),
            );
        }
        self.pending.push_back(p);
    }

    /// Drops the jobs nobody waits for: their handler went away (the
    /// device's stream ended while the job queued or was part-way through a
    /// prefill, e.g. an Open the device gave up on). Running them would only
    /// spend forwards that others wait for; dropping one returns its pages.
    /// A checked-out session's entry is already gone from the store by then
    /// (`CheckedOut` removes it when its handler is dropped).
    fn drop_abandoned(&mut self) {
        let before = self.pending.len();
        self.pending.retain(|p| !p.job.reply.is_closed());
        let dropped = before - self.pending.len();
        if dropped > 0 {
            self.metrics.abandoned(dropped);
            tracing::debug!(dropped, "dropped jobs whose handler went away");
        }
    }

    /// One iteration: rows for each chosen job, one forward, the answers.
    fn iteration(&mut self) {
        // A job that must run alone goes when it is the oldest.
        if self.pending.front().is_some_and(Pending::is_alone) {
            if let Some(p) = self.pending.pop_front() {
                self.run_alone(p);
            }
            return;
        }
        let plan = self.plan();
        if plan.iter().all(|&r| r == 0) {
            return;
        }
        let now = Instant::now();
        let rows: usize = plan.iter().sum();
        let d = self.model.config().d_model;
        let mut prefill_rows = 0;
        let mut seqs: Vec<BatchSeq<'_, PagedKv>> = Vec::new();
        let mut joins: Vec<HiddenSeq<'_, PagedKv>> = Vec::new();
        for (p, &r) in self.pending.iter_mut().zip(&plan) {
            if r == 0 {
                continue;
            }
            if p.started.is_none() {
                p.started = Some(now);
                self.metrics
                    .queue_wait(now.saturating_duration_since(p.arrived));
            }
            let prefill = p.is_prefill();
            if prefill {
                prefill_rows += r;
            }
            let start_pos = p.job.state.kv.len();
            if let Some(layer) = p.join_layer() {
                joins.push(HiddenSeq {
                    layer,
                    hidden: &p.hidden[p.fed * d..(p.fed + r) * d],
                    start_pos,
                    cache: &mut p.job.state.kv,
                });
                continue;
            }
            seqs.push(BatchSeq {
                tokens: &p.input[p.fed..p.fed + r],
                start_pos,
                cache: &mut p.job.state.kv,
                logits: if prefill { Logits::None } else { Logits::All },
            });
        }
        let model = &self.model;
        let scratch = &mut self.scratch;
        let panic_now = self.panic_next.swap(false, Ordering::SeqCst);
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            if panic_now {
                panic!("injected fault: a forward panicked");
            }
            model.forward_batch_in(scratch, &mut seqs, &mut joins)
        }));
        drop((seqs, joins));
        self.metrics.batch(rows, prefill_rows);
        match result {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                // Checked before anything was written: states are intact.
                tracing::error!(error = %e, rows, "batched forward refused");
                return self.fail_planned(&plan, true, &e.to_string());
            }
            Err(_) => {
                tracing::error!(rows, "batched forward panicked; its sessions are dropped");
                return self.fail_planned(&plan, false, "the forward pass failed");
            }
        }
        // The token sequences' logits, in `seqs`' order.
        let mut seq = 0;
        for (mut p, &r) in std::mem::take(&mut self.pending).into_iter().zip(&plan) {
            if r == 0 {
                self.pending.push_back(p);
                continue;
            }
            p.fed += r;
            if p.join_layer().is_some() {
                // (No logits: joins give none.)
                if p.left() > 0 {
                    self.pending.push_back(p);
                } else {
                    finish(p, Ok(Outcome::Prefilled));
                }
                continue;
            }
            let rows_logits = self.scratch.logits(seq);
            seq += 1;
            match &p.job.work {
                Work::Prefill { .. } if p.left() > 0 => self.pending.push_back(p),
                Work::Prefill { .. } => finish(p, Ok(Outcome::Prefilled)),
                Work::Verify { draft } => {
                    let out = complete_verify(&mut p.job.state, draft, rows_logits);
                    finish(p, out.map(Outcome::Verdict));
                }
                Work::SplitPrefill { .. } => lose(p, "a split prefill lost its layer"),
                Work::Alone(_) => lose(p, "a split round was planned into a batch"),
            }
        }
    }

    /// Rows per pending job (same order as `pending`) for this iteration.
    fn plan(&mut self) -> Vec<usize> {
        let n = self.pending.len();
        let mut plan = vec![0usize; n];
        if !self.cfg.enabled {
            // One job whole: the first that is not an Alone job (those run on
            // their own when they reach the front).
            if let Some(i) = self.pending.iter().position(|p| !p.is_alone()) {
                plan[i] = self.pending[i].left();
            }
            return plan;
        }
        let budget = self.cfg.max_batch_rows;
        let prefill_wanted: usize = self
            .pending
            .iter()
            .filter(|p| p.is_prefill())
            .map(|p| p.left().min(self.cfg.prefill_chunk))
            .sum();
        // Prefill's floor: a quarter of a chunk (at least one row) per iteration.
        let floor = prefill_wanted.min((self.cfg.prefill_chunk / 4).max(1));
        let mut left = budget;
        for (i, p) in self.pending.iter().enumerate() {
            if matches!(p.job.work, Work::Verify { .. }) {
                let r = p.left();
                if r <= left.saturating_sub(floor) || (r <= left && plan.iter().all(|&x| x == 0)) {
                    plan[i] = r;
                    left -= r;
                }
            }
        }
        // Prefill chunks: identities in turn, oldest job of each first, a chunk
        // at a time until the budget is used.
        let mut idents: Vec<Arc<str>> = Vec::new();
        for p in self.pending.iter().filter(|p| p.is_prefill()) {
            if !idents.contains(&p.job.identity) {
                idents.push(p.job.identity.clone());
            }
        }
        if idents.is_empty() {
            return plan;
        }
        self.turn = self.turn.wrapping_add(1);
        let start = self.turn % idents.len();
        let mut progress = true;
        while left > 0 && progress {
            progress = false;
            for k in 0..idents.len() {
                let who = &idents[(start + k) % idents.len()];
                // The identity's oldest job without a chunk yet (one chunk per
                // job per iteration).
                let next = self
                    .pending
                    .iter()
                    .enumerate()
                    .find(|(i, p)| p.is_prefill() && p.job.identity == *who && plan[*i] == 0);
                if let Some((i, p)) = next {
                    let r = p.left().min(self.cfg.prefill_chunk).min(left);
                    if r > 0 {
                        plan[i] = r;
                        left -= r;
                        progress = true;
                    }
                }
                if left == 0 {
                    break;
                }
            }
        }
        plan
    }

    fn run_alone(&mut self, mut p: Pending) {
        let Work::Alone(f) = std::mem::replace(&mut p.job.work, Work::Prefill { tokens: vec![] })
        else {
            return;
        };
        let now = Instant::now();
        self.metrics
            .queue_wait(now.saturating_duration_since(p.arrived));
        let model = &self.model;
        let st = &mut p.job.state;
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| f(model, st)));
        match r {
            Ok(Ok(outcome)) => finish(p, Ok(outcome)),
            Ok(Err(refusal)) => finish(p, Err(refusal)),
            Err(_) => {
                tracing::error!(session = %p.job.session, "forward panicked; session dropped");
                lose(p, "the forward pass failed");
            }
        }
    }

    /// Answers every planned job with an internal error; `intact` says whether
    /// their states can be returned.
    fn fail_planned(&mut self, plan: &[usize], intact: bool, why: &str) {
        let mut rest = VecDeque::with_capacity(self.pending.len());
        for (p, &r) in std::mem::take(&mut self.pending).into_iter().zip(plan) {
            if r == 0 {
                rest.push_back(p);
            } else if intact {
                finish(p, Err(Refusal::new(Reason::InternalError, why)));
            } else {
                lose(p, why);
            }
        }
        self.pending = rest;
    }
}

/// The verdict of a verify block whose forward just ran (the KV holds its
/// `k + 1` rows), applied to the session ([`SessionState::verify_block`]).
fn complete_verify(
    st: &mut SessionState,
    draft: &[u32],
    logits: &[f32],
) -> Result<Verdict, Refusal> {
    let base = st.kv.len().saturating_sub(draft.len() + 1);
    st.verify_block(base, draft, logits)
}

/// Answers a job with its state.
fn finish(p: Pending, outcome: Result<Outcome, Refusal>) {
    let Job { state, reply, .. } = p.job;
    let _ = reply.send(Done {
        state: Some(state),
        outcome,
    });
}

/// Answers a job whose state is lost (dropped here: its pages go back).
fn lose(p: Pending, why: &str) {
    let Job { state, reply, .. } = p.job;
    drop(state);
    let _ = reply.send(Done {
        state: None,
        outcome: Err(Refusal::new(Reason::InternalError, why)),
    });
}
