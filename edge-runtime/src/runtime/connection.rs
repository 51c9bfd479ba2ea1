//! The connection lifecycle of a generation ([`Connection`]): opening the
//! verifier session (in the foreground, or in the background while the device
//! drafts alone), resuming it, reacting to failures (retries, the circuit
//! breaker and its health probe), and the deadlines of every exchange. A round
//! (`super::round`, `super::drive`) only asks it to exchange a message.
//!
//! It never touches the generation: it is given the context it sends, and
//! reports what happened ([`Step`]: the session is there, it is gone, or the
//! generation has to end) and what it counted ([`SessionCounts`]); the
//! rounds apply that to the generation.

use crate::breaker::{lock, BreakerState, CircuitBreaker, OpenCost, RttTracker};
use crate::client::{Connector, Counters, NetError, OpenDeadlines, Stream};
use crate::codec::BlockCodec;
use crate::config::EdgeConfig;
use crate::conversation::{common_prefix, KeptSession};
use crate::error::EdgeError;
use crate::open_load::{OpenLoad, PrefillHold};
use crate::report::EdgeStats;
use std::collections::VecDeque;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tandem_model::engine::{BlockVerdict, BlockVerifier, VerifyError};
use tandem_model::logprobs::{TokenLogprobs, MAX_TOP_LOGPROBS};
use tandem_model::sampling::SamplingParams;
use tandem_model::speculative::{GenerateConfig, StopReason};
use tandem_model::ModelError;
use tandem_proto::v1::{
    self as pb, client_message::Msg as ClientMsg, server_message::Msg as ServerMsg, ClientMessage,
};

/// One generation's connection to the verifier: the session's stream and its
/// lifecycle (open, background re-open, resume, failure handling, breaker and
/// probe, deadlines). The rounds (`super::round`, `super::drive`) use it to exchange blocks.
pub(super) struct Connection<'a> {
    pub(super) cfg: &'a EdgeConfig,
    pub(super) fingerprint: &'a str,
    pub(super) connector: Connector,
    pub(super) rt: &'a tokio::runtime::Runtime,
    pub(super) breaker: &'a Arc<Mutex<CircuitBreaker>>,
    pub(super) rtt: &'a mut RttTracker,
    pub(super) open_cost: &'a mut OpenCost,
    /// The verifier prefill this device's runtimes are waiting for
    /// (shared with sibling runtimes; `crate::open_load`).
    pub(super) open_load: &'a Arc<OpenLoad>,
    /// A session open running in the background (after a failure) while the
    /// device drafts alone.
    pub(super) opening: Option<Opening>,
    /// No new open before this instant (backoff after a failure); the device
    /// drafts alone meanwhile.
    pub(super) retry_at: Option<Instant>,
    /// The last failure was a timeout or a broken link (not a busy verifier).
    pub(super) outage: bool,
    pub(super) probe: &'a mut Option<tokio::task::JoinHandle<()>>,
    pub(super) gen_rtt: RttTracker,
    pub(super) counters: Counters,
    pub(super) stream: Option<Stream>,
    /// When each request still unanswered on the stream was sent (cloud-streamed
    /// rounds keep a window of them).
    pub(super) in_flight: VecDeque<Instant>,
    pub(super) session_id: Option<String>,
    /// This generation's session-affinity key, sent on every stream
    /// ([`tandem_proto::SESSION_AFFINITY_HEADER`]).
    pub(super) session_key: String,
    /// A verifier session kept by this conversation's earlier turn: the first
    /// open continues it (`Open.continuation`); taken by that open, so a
    /// refused continuation is followed by an open of the whole context.
    pub(super) continuation: Option<KeptSession>,
    /// Immediate re-opens left before a failure counts
    /// ([`IMMEDIATE_REOPENS`] again after every success); see
    /// [`Connection::fail`].
    pub(super) reopens_left: u32,
    /// A stream is (or was, until the failure being handled) open.
    pub(super) live: bool,
    pub(super) round: u64,
    pub(super) max_block: usize,
    /// Most drafts per round the device state allows (`crate::device`):
    /// bounds `max_block`, so every kind of round is capped.
    pub(super) k_cap: usize,
    pub(super) resends_in_a_row: u32,
    /// The wire form of blocks (token ids, or split hidden states).
    pub(super) codec: &'a mut dyn BlockCodec,
    /// The caller's cancel flag (an open waiting for the verifier gives up
    /// when it is set: [`Step::Ended`]).
    pub(super) cancel: Option<Arc<AtomicBool>>,
    /// Most context positions the session holds (`Opened.max_prompt_tokens`;
    /// `usize::MAX`: no limit said). The rounds cap the generation by it.
    pub(super) capacity: usize,
    /// What happened to the session, for the generation's report.
    pub(super) counts: SessionCounts,
}

/// What a [`Connection`] counts for its generation's statistics
/// ([`EdgeStats`]; added by [`SessionCounts::add_to`] at the end).
#[derive(Clone, Debug, Default)]
pub(super) struct SessionCounts {
    pub(super) opens: u64,
    pub(super) background_opens: u64,
    pub(super) immediate_reopens: u64,
    pub(super) resends: u64,
    pub(super) timeouts: u64,
    pub(super) failures: u64,
    pub(super) breaker_opens: u64,
    /// The verifier's prefills for opens and resumes (the rounds count the
    /// verify passes).
    pub(super) prefill_passes: u64,
    pub(super) verifier_reused_tokens: u64,
    pub(super) verifier_prefill_tokens: u64,
    pub(super) continued_session: bool,
}

impl SessionCounts {
    /// Adds these counts to a generation's statistics.
    pub(super) fn add_to(&self, s: &mut EdgeStats) {
        s.opens += self.opens;
        s.background_opens += self.background_opens;
        s.immediate_reopens += self.immediate_reopens;
        s.resends += self.resends;
        s.timeouts += self.timeouts;
        s.failures += self.failures;
        s.breaker_opens += self.breaker_opens;
        s.verifier_passes += self.prefill_passes;
        s.verifier_reused_tokens = s
            .verifier_reused_tokens
            .saturating_add(self.verifier_reused_tokens);
        s.verifier_prefill_tokens = s
            .verifier_prefill_tokens
            .saturating_add(self.verifier_prefill_tokens);
        s.continued_session |= self.continued_session;
    }
}

/// How long a Close may take before the session is left to the verifier's
/// idle TTL.
pub(super) const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

pub(super) type OpenResult = Result<(Stream, pb::ServerMessage, Duration), NetError>;

/// Positions a verifier's forward covers for a draft of `k` tokens: the last
/// committed token and the k drafts.
pub(crate) fn draft_positions(k: usize) -> usize {
    k + 1
}

/// A session open in flight on the I/O runtime. It outlives the generation
/// that started it: the runtime keeps it, and the next generation adopts it
/// ([`Connection::adopt`]) instead of starting another (docs/edge.md,
/// "Re-opens outlive a generation").
pub(crate) struct Opening {
    pub(super) task: tokio::task::JoinHandle<(OpenResult, Counters)>,
    /// The context the Open carries (the verifier will hold it).
    pub(super) context: Vec<u32>,
    /// The sampling the session was opened with, and its logprobs.
    pub(super) sampling: pb::SamplingParams,
    pub(super) top_logprobs: Option<u32>,
    /// It carries a grammar (never adopted: its output starts at another
    /// generation's prompt).
    pub(super) grammar: bool,
    /// The affinity key of its stream, and its first round number.
    pub(super) session_key: String,
    pub(super) first_round: u64,
}

impl Opening {
    /// Abandons the open (the runtime is dropped, or the next generation
    /// cannot use it).
    pub(crate) fn abandon(self) {
        self.task.abort();
    }
}

/// Foreground re-opens at once, per success, of a broken stream or an open
/// refused as unavailable, before the failure counts and the device drafts
/// alone. Two, the second after [`EdgeConfig::backoff`]`(1)`: a balancer can
/// pass the first re-open to the replica that is dying (nginx retries another
/// upstream only before it has passed the request on, and takes a replica
/// out of the ring only after a failed attempt), and answer 502; the second
/// goes to a live replica. Measured in `cli/tests/load_balancer.rs` under CPU
/// load: with one, a device met the killed replica on its re-open and drafted
/// all 12 tokens provisionally.
pub(super) const IMMEDIATE_REOPENS: u32 = 2;

/// The draft backlog (rows) from which a foreground open prefills it beside
/// the verifier's prefill (`Connection::open`): below, the draft's next step
/// runs it in the same forward as its first token, which costs about the
/// same as one row.
pub(super) const OPEN_BESIDE_MIN_ROWS: usize = 16;

/// Outcome of a network step, as the connection reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Step {
    Ok,
    /// The stream is gone; the loop decides what next.
    Lost,
    /// The stream is gone and the generation has to end (the verifier's
    /// context is full, or the caller cancelled while an open waited).
    Ended(StopReason),
}

impl Connection<'_> {
    /// After a failure the device does not wait for a session: it opens one in
    /// the background and drafts alone (provisional) until it is there. Split
    /// sessions always open in the foreground (the device's layers would have
    /// to follow the provisional tokens).
    pub(super) fn open_in_background(&self) -> bool {
        self.outage && self.codec.tokens_only() && lock(self.breaker).consecutive_failures() > 0
    }

    /// Deadlines of the next open of a context of `ctx_len` tokens. The headers
    /// come after about one round trip on a live link; `Opened` after the
    /// prefill, estimated from the measured cost of earlier opens of this
    /// runtime scaled by the context (none measured yet: `open_timeout_ms`).
    /// Both double with every consecutive failure (a slow verifier is
    /// eventually waited for), within `open_timeout_ms`.
    pub(super) fn open_deadlines(&self, ctx_len: usize) -> OpenDeadlines {
        let c = self.cfg;
        let total = c.open_timeout();
        let fails = lock(self.breaker).consecutive_failures();
        let scale = f64::from(1u32 << fails.clamp(1, 5).saturating_sub(1));
        let headers = (c.connect_timeout() + self.deadline(1)).mul_f64(scale);
        let opened = match self.open_cost.estimate(ctx_len) {
            Some(est) => {
                let rtt = Duration::from_secs_f64(self.rtt.p95_ms().unwrap_or(0.0) / 1000.0);
                (est + rtt)
                    .mul_f64(c.deadline_factor)
                    .max(Duration::from_millis(c.deadline_floor_ms))
                    .mul_f64(scale)
            }
            _ => total,
        };
        OpenDeadlines {
            headers: headers.min(total),
            opened: opened.min(total),
            total,
        }
    }

    /// Deadline of an exchange whose verifier forward covers `positions` tokens
    /// (a draft of k: k + 1).
    pub(super) fn deadline(&self, positions: usize) -> Duration {
        let c = self.cfg;
        self.rtt.deadline(
            positions,
            Duration::from_millis(c.deadline_initial_ms),
            Duration::from_millis(c.deadline_floor_ms),
            c.deadline_factor,
            Duration::from_millis(c.deadline_max_ms),
        )
    }

    /// Reacts to a failed exchange; Err only for fatal conditions.
    pub(super) fn fail(&mut self, e: NetError) -> Result<Step, EdgeError> {
        // The failure came from an opened stream (not from an open); pipelined
        // exchanges hold the stream elsewhere, so this is tracked on its own.
        let was_live = std::mem::take(&mut self.live);
        self.stream = None;
        tracing::debug!(error = %e, session = ?self.session_id, "verifier exchange failed");
        // A live stream that broke (reset, ended; not a timeout): the link to
        // the verifier's address often still works and only what was behind it
        // went away (a verifier replica behind a load balancer, which sends the
        // re-open to another replica). Re-open at once, in the foreground
        // (up to IMMEDIATE_REOPENS times per success), before counting a
        // failure and drafting alone; a re-open refused each time then takes
        // the usual path below. The same holds for an open refused as
        // unavailable while nothing has failed (a balancer's 502 from a
        // replica that died as the open reached it: the next open goes to a
        // live one); during an outage an open takes the usual path.
        let link_worked = was_live || lock(self.breaker).consecutive_failures() == 0;
        if link_worked && self.reopens_left > 0 && matches!(e, NetError::Unavailable(_)) {
            if self.reopens_left < IMMEDIATE_REOPENS {
                // The last re-open met the dying replica: give the balancer
                // the time to take it out.
                std::thread::sleep(self.cfg.backoff(1));
            }
            self.reopens_left -= 1;
            self.outage = false;
            self.counts.immediate_reopens += 1;
            tracing::info!(error = %e, session = ?self.session_id, "verifier unavailable (stream broke or open refused): re-opening at once");
            return Ok(Step::Lost);
        }
        // Only a silent or broken link makes the next open a background one; a
        // verifier that answers (busy, evicting) is retried in the foreground.
        let outage = matches!(e, NetError::Timeout | NetError::Unavailable(_));
        match e {
            NetError::Fatal(e) => return Err(e),
            NetError::ContextFull => return Ok(Step::Ended(StopReason::ContextFull)),
            NetError::Resend(_) if self.resends_in_a_row < 3 => {
                self.resends_in_a_row += 1;
                self.counts.resends += 1;
                return Ok(Step::Lost);
            }
            NetError::Timeout => self.counts.timeouts += 1,
            NetError::Resend(_) | NetError::Unavailable(_) | NetError::Busy(_) => {}
        }

        self.counts.failures += 1;
        self.outage = outage;
        let (opened, attempt) = {
            let mut b = lock(self.breaker);
            (b.on_failure(), b.consecutive_failures())
        };
        if opened {
            self.counts.breaker_opens += 1;
            tracing::warn!(session = ?self.session_id, "verifier unreachable: circuit breaker open, drafting alone");
            self.start_probe();
        } else if lock(self.breaker).state() == BreakerState::Closed {
            if self.open_in_background() {
                // The device drafts alone until then (see `drive`).
                self.retry_at = Some(Instant::now() + self.cfg.backoff(attempt));
            } else {
                std::thread::sleep(self.cfg.backoff(attempt));
            }
        }
        Ok(Step::Lost)
    }

    pub(super) fn start_probe(&mut self) {
        if let Some(p) = self.probe.take() {
            p.abort();
        }
        let (b, c) = (self.breaker.clone(), self.connector.clone());
        let (every, timeout) = (self.cfg.probe_interval(), self.cfg.probe_timeout());
        *self.probe = Some(self.rt.spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if c.probe(timeout).await {
                    lock(&b).probe_succeeded();
                    tracing::info!("verifier healthy again: circuit breaker half-open");
                    return;
                }
            }
        }));
    }

    pub(super) fn success(&mut self) {
        self.outage = false;
        self.reopens_left = IMMEDIATE_REOPENS;
        lock(self.breaker).on_success();
        self.resends_in_a_row = 0;
    }

    /// The Open (or resume) carrying `ctx[..upto]`, the context the
    /// verifier must hold, of a generation of `gen` whose output starts at
    /// `prompt_len`.
    pub(super) fn open_message(
        &mut self,
        ctx: &[u32],
        upto: usize,
        gen: &GenerateConfig,
        prompt_len: usize,
    ) -> Result<ClientMessage, EdgeError> {
        let tokens_only = self.codec.tokens_only();
        let mut open = pb::Open {
            model_id: self.cfg.model_id.clone(),
            tokenizer_fingerprint: self.fingerprint.to_owned(),
            prompt_tokens: ctx[..upto].to_vec(),
            sampling: Some(to_pb_sampling(&gen.sampling)),
            top_logprobs: wire_top_logprobs(gen.top_logprobs),
            grammar: wire_grammar(gen, prompt_len),
            resume_session_id: self.session_id.clone(),
            first_round: self.round,
            ..pb::Open::default()
        };
        // A conversation's kept session: send only what follows the prefix
        // both sides hold (at least the last token). Taken here, so a refusal
        // (CONTEXT_NOT_HELD) is followed by an open of the whole context.
        if let Some(kept) = self.continuation.take().filter(|_| tokens_only) {
            let ctx = &ctx[..upto];
            let prefix = common_prefix(&kept.context, ctx).min(upto.saturating_sub(1));
            if prefix > 0 {
                open.prompt_tokens = ctx[prefix..].to_vec();
                open.resume_session_id = None;
                open.continuation = Some(pb::Continuation {
                    session_id: kept.id.clone(),
                    prefix_len: prefix as u64,
                    prefix_sha256: tandem_proto::context_digest(&ctx[..prefix]).to_vec(),
                });
                self.session_id = Some(kept.id);
            }
        }
        let open = self.codec.open(&ctx[..upto], open)?;
        Ok(ClientMessage {
            msg: Some(ClientMsg::Open(open)),
        })
    }

    /// Sends `msg`, the Open of a context of `upto` tokens, and waits for
    /// the session. With `beside` (the caller's prefill of the draft's
    /// backlog: false when cancelled) it runs while the verifier prefills
    /// ([`Self::open_beside_prefill`]).
    pub(super) fn open(
        &mut self,
        msg: ClientMessage,
        upto: usize,
        gen: &GenerateConfig,
        beside: Option<&mut dyn FnMut() -> Result<bool, EdgeError>>,
    ) -> Result<Step, EdgeError> {
        let d = self.open_deadlines(upto);
        if let Some(prefill) = beside {
            return self.open_beside_prefill(msg, upto, gen, d, prefill);
        }
        let open = self.connector.open(
            msg,
            &self.session_key,
            d,
            Some(self.open_load),
            None,
            &mut self.counters,
        );
        let r = match self.cancel.clone() {
            None => self.rt.block_on(open),
            Some(flag) => {
                let r = self.rt.block_on(async {
                    tokio::select! {
                        r = open => Some(r),
                        () = until_set(&flag) => None,
                    }
                });
                match r {
                    Some(r) => r,
                    None => {
                        // The caller went away while the verifier prefilled:
                        // the dropped stream closes the session.
                        return Ok(Step::Ended(StopReason::Cancelled));
                    }
                }
            }
        };
        self.opened(r, upto, gen)
    }

    /// Sends the Open, prefills the draft's backlog while the verifier
    /// prefills the context (the two add up otherwise: a conversation turn
    /// after `auto` let lookup answer has the last reply and the new message
    /// to run through both), then waits for `Opened`. The open's deadlines
    /// count from the end of the device's prefill ([`PrefillHold`]): before
    /// it, the device was not waiting, and on one machine its prefill slows
    /// the verifier's. A cancel during either ends the generation; the
    /// dropped stream closes the verifier's half.
    fn open_beside_prefill(
        &mut self,
        msg: ClientMessage,
        upto: usize,
        gen: &GenerateConfig,
        d: OpenDeadlines,
        prefill: &mut dyn FnMut() -> Result<bool, EdgeError>,
    ) -> Result<Step, EdgeError> {
        let hold = Arc::new(PrefillHold::default());
        let task = {
            let (load, hold) = (Arc::clone(self.open_load), Arc::clone(&hold));
            let connector = self.connector.clone();
            let key = self.session_key.clone();
            self.rt.spawn(async move {
                let mut c = Counters::default();
                let r = connector
                    .open(msg, &key, d, Some(&load), Some(&hold), &mut c)
                    .await;
                (r, c)
            })
        };
        let abort = task.abort_handle();
        let started = Instant::now();
        let prefilled = prefill();
        hold.release();
        tracing::debug!(
            session = ?self.session_id,
            ms = started.elapsed().as_secs_f64() * 1000.0,
            "draft backlog prefilled beside the verifier's open"
        );
        match prefilled {
            Ok(true) => {}
            Ok(false) => {
                // Cancelled during the prefill.
                abort.abort();
                return Ok(Step::Ended(StopReason::Cancelled));
            }
            Err(e) => {
                abort.abort();
                return Err(e);
            }
        }
        let joined = match self.cancel.clone() {
            None => Some(self.rt.block_on(task)),
            Some(flag) => self.rt.block_on(async {
                tokio::select! {
                    r = task => Some(r),
                    () = until_set(&flag) => None,
                }
            }),
        };
        let Some(joined) = joined else {
            abort.abort();
            return Ok(Step::Ended(StopReason::Cancelled));
        };
        let (r, c) = joined.unwrap_or_else(|e| {
            (
                Err(NetError::Unavailable(format!("open task failed: {e}"))),
                Counters::default(),
            )
        });
        self.counters.add(c);
        self.opened(r, upto, gen)
    }

    /// Takes over an open an earlier generation left in flight when it is
    /// usable (same sampling: the Open fixed it; a token-id session); else
    /// abandons it. A taken one continues the earlier session's rounds and
    /// affinity; the kept conversation session (if any) is not continued.
    pub(super) fn adopt(&mut self, op: Opening, gen: &GenerateConfig) {
        let same = op.sampling == to_pb_sampling(&gen.sampling)
            && op.top_logprobs == wire_top_logprobs(gen.top_logprobs)
            && !op.grammar
            && gen.grammar.is_none();
        if !same || !self.codec.tokens_only() {
            op.abandon();
            return;
        }
        tracing::debug!(
            context = op.context.len(),
            "adopting the re-open of an earlier generation"
        );
        self.session_key = op.session_key.clone();
        self.round = op.first_round;
        self.continuation = None;
        self.outage = true;
        self.opening = Some(op);
    }

    /// Starts opening the session with `msg`, the Open of `context`, on the
    /// I/O runtime; `drive` drafts alone until it completes.
    pub(super) fn spawn_open(
        &mut self,
        msg: ClientMessage,
        context: Vec<u32>,
        gen: &GenerateConfig,
    ) {
        let upto = context.len();
        let d = self.open_deadlines(upto);
        let load = Arc::clone(self.open_load);
        let connector = self.connector.clone();
        let key = self.session_key.clone();
        let task = self.rt.spawn(async move {
            let mut c = Counters::default();
            let r = connector
                .open(msg, &key, d, Some(&load), None, &mut c)
                .await;
            (r, c)
        });
        self.counts.background_opens += 1;
        tracing::debug!(session = ?self.session_id, context = upto, ?d, "re-opening in the background");
        self.opening = Some(Opening {
            task,
            context,
            sampling: to_pb_sampling(&gen.sampling),
            top_logprobs: wire_top_logprobs(gen.top_logprobs),
            grammar: gen.grammar.is_some(),
            session_key: self.session_key.clone(),
            first_round: self.round,
        });
    }

    /// Takes the answer to an Open of a context of `upto` tokens for a
    /// generation of `gen`: the session is there ([`Step::Ok`]; the
    /// verifier holds those `upto` tokens, and [`Self::capacity`] says how
    /// many it takes), or the failure is handled.
    pub(super) fn opened(
        &mut self,
        r: OpenResult,
        upto: usize,
        gen: &GenerateConfig,
    ) -> Result<Step, EdgeError> {
        match r {
            Ok((
                stream,
                pb::ServerMessage {
                    msg: Some(ServerMsg::Opened(o)),
                },
                after_headers,
            )) => {
                if o.context_len != upto as u64 {
                    return Err(EdgeError::Protocol(format!(
                        "Opened.context_len {} != {upto}",
                        o.context_len
                    )));
                }
                if o.model_id != self.cfg.model_id {
                    return Err(EdgeError::Protocol(format!(
                        "the verifier serves model {:?}; the device expects {:?} (model_id)",
                        o.model_id, self.cfg.model_id
                    )));
                }
                self.codec.check_opened(&o)?;
                check_features(gen, &o)?;
                // Not a success for the breaker yet: a verifier that opens sessions
                // but never answers a verify must still trip it. The first verdict
                // closes it.
                let n = &mut self.counts;
                n.opens += 1;
                n.prefill_passes += 1;
                let positions = (upto as u64).saturating_sub(1);
                let reused = o.reused_tokens.min(positions);
                let prefilled = positions - reused;
                n.verifier_reused_tokens = n.verifier_reused_tokens.saturating_add(reused);
                n.verifier_prefill_tokens = n.verifier_prefill_tokens.saturating_add(prefilled);
                if n.opens == 1 && o.resumed {
                    // The first open of a turn resumed: a kept session.
                    n.continued_session = true;
                }
                // The open's cost per position it prefilled (a continued
                // session's cheap open must not shorten a later full open's
                // deadline).
                let prefilled = usize::try_from(prefilled).unwrap_or(upto);
                self.open_cost
                    .record(prefilled.saturating_add(1), after_headers);
                self.max_block = (o.max_block as usize)
                    .clamp(1, tandem_model::speculative::MAX_K)
                    .min(self.k_cap);
                if o.max_prompt_tokens > 0 {
                    let most = usize::try_from(o.max_prompt_tokens).unwrap_or(usize::MAX);
                    self.capacity = self.capacity.min(most);
                }
                tracing::debug!(session = %o.session_id, resumed = o.resumed, "session open");
                self.session_id = Some(o.session_id);
                self.stream = Some(stream);
                self.live = true;
                Ok(Step::Ok)
            }
            Ok(_) => Err(EdgeError::Protocol("first answer was not Opened".into())),
            Err(e) => self.fail(e),
        }
    }

    /// Moves the session to the context `context` (`Resume`); the verifier
    /// prefills `fresh` tokens for it (sets the deadline).
    pub(super) fn resume_at(&mut self, context: &[u32], fresh: usize) -> Result<Step, EdgeError> {
        let upto = context.len();
        let resume = pb::Resume {
            context_tokens: context.to_vec(),
            next_round: self.round,
        };
        match self.exchange(ClientMsg::Resume(resume), fresh) {
            Ok((ServerMsg::Resumed(r), _)) => {
                if r.context_len != upto as u64 {
                    return Err(EdgeError::Protocol("Resumed.context_len differs".into()));
                }
                self.counts.prefill_passes += 1;
                Ok(Step::Ok)
            }
            Ok(_) => Err(EdgeError::Protocol("expected Resumed".into())),
            Err(e) => self.fail(e),
        }
    }

    /// One request and its answer; `positions`: what the verifier's forward
    /// covers (sets the deadline; [`draft_positions`] for a `Draft`).
    pub(super) fn exchange(
        &mut self,
        msg: ClientMsg,
        positions: usize,
    ) -> Result<(ServerMsg, Duration), NetError> {
        let deadline = self.deadline(positions);
        let Some(s) = self.stream.as_mut() else {
            return Err(NetError::Unavailable("no session".into()));
        };
        self.rt
            .block_on(s.exchange(msg, deadline, &mut self.counters))
    }

    /// [`Self::exchange`], with `beside` run on this thread while the
    /// answer is in flight (pipelined drafting), again and again until it
    /// returns false or the answer is there. Its error (the device's own
    /// model failed) comes second, once the exchange has ended.
    pub(super) fn exchange_beside(
        &mut self,
        msg: ClientMsg,
        positions: usize,
        beside: &mut Beside<'_>,
    ) -> (
        Result<(ServerMsg, Duration), NetError>,
        Result<(), ModelError>,
    ) {
        let deadline = self.deadline(positions);
        let Some(mut stream) = self.stream.take() else {
            return (Err(NetError::Unavailable("no session".into())), Ok(()));
        };
        let task = self.rt.spawn(async move {
            let mut c = Counters::default();
            let res = stream.exchange(msg, deadline, &mut c).await;
            (stream, c, res)
        });
        let mut beside_res = Ok(());
        while !task.is_finished() {
            match beside() {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    beside_res = Err(e);
                    break;
                }
            }
        }
        let res = match self.rt.block_on(task) {
            Ok((stream, c, res)) => {
                self.counters.add(c);
                if res.is_ok() {
                    self.stream = Some(stream);
                }
                res
            }
            Err(e) => Err(NetError::Unavailable(format!("verify task failed: {e}"))),
        };
        (res, beside_res)
    }

    /// A round trip whose verifier forward covered `positions` tokens.
    pub(super) fn record_rtt(&mut self, rtt: Duration, positions: usize) {
        self.rtt.record(rtt, positions);
        self.gen_rtt.record(rtt, positions);
    }

    /// Closes the session (not kept) so that the next round opens a new one.
    pub(super) fn close_for_reopen(&mut self) {
        self.live = false;
        if let Some(mut st) = self.stream.take() {
            let c = &mut self.counters;
            let _ = self.rt.block_on(st.exchange(
                ClientMsg::Close(pb::Close::default()),
                CLOSE_TIMEOUT,
                c,
            ));
        }
    }
}

/// Resolves once `flag` is set (polled every 10 ms).
async fn until_set(flag: &std::sync::atomic::AtomicBool) {
    while !flag.load(std::sync::atomic::Ordering::SeqCst) {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// The wire form of the generation's sampling parameters. The OpenAI
/// penalties' fields stay at their zero values when none is on (what an older
/// verifier reads, and what lets an adopted open match).
pub(super) fn to_pb_sampling(p: &SamplingParams) -> pb::SamplingParams {
    let penalties = p.has_openai_penalties();
    pb::SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k as u32,
        top_p: p.top_p,
        repetition_penalty: p.repetition_penalty,
        seed: p.seed,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        logit_bias: p
            .logit_bias
            .entries()
            .iter()
            .map(|&(token, bias)| pb::LogitBias { token, bias })
            .collect(),
        completion_start: if penalties {
            p.completion_start as u64
        } else {
            0
        },
    }
}

/// Refuses a verifier that does not list a feature this generation's
/// sampling needs (an older verifier would ignore the fields and break the
/// output's identity with the target's).
pub(super) fn check_features(gen: &GenerateConfig, o: &pb::Opened) -> Result<(), EdgeError> {
    let has = |f: &str| o.features.iter().any(|g| g == f);
    if gen.sampling.has_openai_penalties() && !has(tandem_proto::FEATURE_PENALTIES) {
        return Err(EdgeError::Protocol(
            "the verifier does not apply presence_penalty, frequency_penalty or logit_bias (an older version): upgrade it, or generate without them".into(),
        ));
    }
    if gen.top_logprobs.is_some() && !has(tandem_proto::FEATURE_LOGPROBS) {
        return Err(EdgeError::Protocol(
            "the verifier does not return logprobs (an older version): upgrade it, or generate without them".into(),
        ));
    }
    if gen.grammar.is_some() && !has(tandem_proto::FEATURE_GRAMMAR) {
        return Err(EdgeError::Protocol(
            "the verifier does not constrain its choices to a grammar (structured output; an older version): upgrade it, or generate without response_format".into(),
        ));
    }
    Ok(())
}

/// `Open.grammar` of a generation whose output starts at context position
/// `output_start` (the verifier replays what follows it).
pub(super) fn wire_grammar(gen: &GenerateConfig, output_start: usize) -> Option<pb::Grammar> {
    gen.grammar.as_ref().map(|g| {
        let (kind, text) = g.wire();
        pb::Grammar {
            kind: kind.to_string(),
            text,
            output_start: output_start as u64,
        }
    })
}

/// `Open.top_logprobs` of a generation asking for `top` alternatives.
pub(super) fn wire_top_logprobs(top: Option<usize>) -> Option<u32> {
    top.map(|n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// The target's logprobs a verdict carries for the tokens it emits on
/// `block` (the accepted drafts, then its token). A verdict without one per
/// emitted token is a protocol error (alternatives past
/// [`MAX_TOP_LOGPROBS`] are dropped).
pub(super) fn verdict_logprobs(
    block: &[u32],
    v: &pb::Verdict,
) -> Result<(Vec<u32>, Vec<TokenLogprobs>), EdgeError> {
    let n = usize::try_from(v.accepted).map_or(block.len(), |n| n.min(block.len()));
    let mut emitted = block[..n].to_vec();
    emitted.push(v.next_token);
    if v.logprobs.len() != emitted.len() {
        return Err(EdgeError::Protocol(format!(
            "the verdict carries {} logprobs for {} emitted tokens (Verdict.logprobs)",
            v.logprobs.len(),
            emitted.len()
        )));
    }
    let lps = v
        .logprobs
        .iter()
        .zip(&emitted)
        .map(|(l, &token)| TokenLogprobs {
            token,
            logprob: l.logprob,
            top: l
                .top
                .iter()
                .take(MAX_TOP_LOGPROBS)
                .map(|x| (x.token, x.logprob))
                .collect(),
        })
        .collect();
    Ok((emitted, lps))
}

/// The remote verifier as the generation core's [`BlockVerifier`]: one
/// `Draft` through the session's codec (or answered by the codec on the
/// device: an all-local split round), the verdict decoded and checked. It
/// reports the outcome and changes nothing of the generation: a verdict
/// (with the target's logprobs when asked), a broken exchange
/// ([`VerifyError::Broken`] with the [`NetError`], for [`Connection::fail`]),
/// or a refusal ([`VerifyError::Refused`]: a protocol violation, fatal).
pub(super) struct RemoteVerifier<'c, 'a> {
    pub(super) conn: &'c mut Connection<'a>,
    pub(super) sampling: &'c SamplingParams,
    /// The generation asks for logprobs.
    pub(super) logprobs: bool,
    /// The last verify's round trip (`None`: the device answered it).
    pub(super) rtt: Option<Duration>,
    /// Work done while an exchange is in flight (pipelined drafting,
    /// [`Connection::exchange_beside`]).
    pub(super) beside: Option<&'c mut Beside<'c>>,
}

/// What the device does while a verify is in flight: one step per call;
/// false when it has nothing more to do.
pub(super) type Beside<'b> = dyn FnMut() -> Result<bool, ModelError> + 'b;

impl BlockVerifier for RemoteVerifier<'_, '_> {
    type Broken = NetError;
    type Refusal = EdgeError;

    fn verify(
        &mut self,
        ctx: &[u32],
        block: &[u32],
    ) -> Result<BlockVerdict, VerifyError<NetError, EdgeError>> {
        let conn = &mut *self.conn;
        let (k, round) = (block.len(), conn.round);
        let draft = pb::Draft {
            round,
            tokens: block.to_vec(),
            ..pb::Draft::default()
        };
        let draft = conn
            .codec
            .encode(ctx, draft)
            .map_err(VerifyError::Refused)?;
        let (answer, rtt) = match conn.codec.answer_locally(round, ctx.len()) {
            Some(v) => (ServerMsg::Verdict(v), None),
            None => {
                let msg = ClientMsg::Draft(draft);
                let res = match self.beside.as_deref_mut() {
                    Some(beside) => {
                        let (res, beside_res) =
                            conn.exchange_beside(msg, draft_positions(k), beside);
                        beside_res?;
                        res
                    }
                    None => conn.exchange(msg, draft_positions(k)),
                };
                match res {
                    Ok((a, rtt)) => (a, Some(rtt)),
                    Err(e) => return Err(VerifyError::Broken(e)),
                }
            }
        };
        self.rtt = rtt;
        let v = conn
            .codec
            .decode(answer, round, k, ctx, self.sampling)
            .map_err(VerifyError::Refused)?;
        // (A block the device answered itself, an all-local split round,
        // has no target logprobs.)
        let verdict = block_verdict(block, &v, self.logprobs && rtt.is_some())
            .map_err(VerifyError::Refused)?;
        let exchange_ms = rtt.map(|t| t.as_secs_f64() * 1e3);
        if conn
            .codec
            .accepted(ctx.len(), verdict.accepted, exchange_ms, k)
        {
            // The codec changed its wire form (split `auto` chose another s):
            // the next round opens a new session.
            conn.close_for_reopen();
        }
        Ok(verdict)
    }
}

/// The core's verdict from the verifier's verdict `v` on `block`, with the
/// target's logprobs of what it emits when `logprobs` ([`verdict_logprobs`]).
pub(super) fn block_verdict(
    block: &[u32],
    v: &pb::Verdict,
    logprobs: bool,
) -> Result<BlockVerdict, EdgeError> {
    let logprobs = match logprobs {
        true => Some(verdict_logprobs(block, v)?.1),
        false => None,
    };
    Ok(BlockVerdict {
        accepted: v.accepted as usize,
        next_token: v.next_token,
        logprobs,
    })
}
