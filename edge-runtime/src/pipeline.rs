//! The speculation loop of [`crate::adaptive::SpeculationConfig`]: rounds with a
//! fixed or adaptive k, **pipelined drafting**, and **target-only streaming**.
//! A child module of `runtime` (it works on the same `Run`/`Net` state); the
//! runtime calls [`Net::round_trip_spec`] instead of its plain round when the
//! config asks for any of this.
//!
//! Pipelined drafting (greedy only): once block `d1..dk` is sent, the device keeps
//! drafting while the verify is in flight, assuming full acceptance: `g` (its
//! guess of the verifier's bonus token), then `e1, e2, ...`. If the verdict
//! accepts all k and its token equals `g`, `e1..` are already in the draft cache
//! and start the next block, so the next round trip leaves at once. Otherwise
//! they are discarded (the draft cache is truncated to the accepted prefix), as
//! in a plain round. Output is unaffected: every emitted token still comes
//! through a verdict. Sampled mode drafts without pipelining (the pre-drafted
//! tokens would need their draft distributions kept; not done).
//!
//! Target-only streaming: `Draft`s with k = 0 ask the verifier for its next
//! token; `stream_window` of them are kept in flight so that the target decodes
//! back to back and the tokens stream to the device (the "cloud generates and
//! streams" baseline of `tandem lab`). The draft model only catches up (runs over
//! the streamed tokens) if the verifier becomes unreachable and the device has to
//! continue alone.

// `..Default::default()` on wire messages: the proto grows fields (split mode).
#![allow(clippy::needless_update)]

use super::*;
use crate::adaptive::{RoundRecord, SpecState};

impl EdgeRuntime {
    /// The rounds of the last generation (k, accepted, RTT, drafting time), when
    /// the speculation config is active (`record_rounds`, adaptive k,
    /// pipelining or target streaming).
    pub fn last_rounds(&self) -> &[RoundRecord] {
        &self.spec.rounds
    }

    /// The speculation state (chooser estimates carry over between generations).
    pub fn speculation(&self) -> &SpecState {
        &self.spec
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl Net<'_> {
    /// One round under the speculation config (see the module docs).
    pub(super) fn round_trip_spec(&mut self, run: &mut Run<'_, '_>) -> Result<(), EdgeError> {
        if self.spec.cfg.target_stream {
            return self.target_stream(run);
        }
        let room_out = run.gen.max_tokens.saturating_sub(run.out_len());
        let limit = self
            .max_block
            .min(run.capacity.saturating_sub(run.ctx.len()))
            .min(room_out.max(1));
        if limit == 0 {
            run.stop = Some(StopReason::ContextFull);
            return Ok(());
        }
        let greedy = run.gen.sampling.is_greedy();
        let pipeline = self.spec.cfg.pipeline && greedy;
        // Drafts made ahead are valid only for the context they were made at.
        let mut held = std::mem::take(&mut self.spec.ahead);
        if !held.is_empty() && self.spec.ahead_at != run.ctx.len() {
            run.rollback_unverified();
            held.clear();
        }
        let k = if self.spec.cfg.adaptive_k {
            self.spec.chooser.choose(limit, run.gen.k)
        } else {
            run.gen.k.min(limit)
        };
        let ctx_before = run.ctx.len();
        let reused = held.len().min(k);
        let mut hist = run.ctx.clone();
        hist.extend_from_slice(&held);
        let mut dists = Vec::new();
        let t0 = Instant::now();
        // Draft times for the chooser: the block's first forward (it also runs
        // the verifier's token) apart from the later ones, without forwards that
        // also (pre)filled more than a couple of pending tokens (the prompt's
        // prefill in the first round, a catch-up after target streaming).
        let (mut first, mut timed, mut timed_ms) = (None, 0usize, 0.0f64);
        while held.len() < k {
            let catch_up = run.pending.len() > 2;
            let is_first = held.is_empty();
            let t = Instant::now();
            let (d, q) = run.draft_next(&hist)?;
            let took = ms(t.elapsed());
            if !catch_up {
                if is_first {
                    first = Some(took);
                } else {
                    timed += 1;
                    timed_ms += took;
                }
            }
            hist.push(d);
            held.push(d);
            if let Some(q) = q {
                let (tokens, probs) = q.entries().iter().copied().unzip();
                dists.push(pb::TokenDistribution { tokens, probs });
            }
        }
        let draft_ms = ms(t0.elapsed());
        self.spec
            .chooser
            .observe_draft_forwards(first, timed, timed_ms);
        let block = held[..k].to_vec();
        let msg = Cm::Draft(pb::Draft {
            round: self.round,
            tokens: block.clone(),
            draft_dists: dists,
            ..Default::default()
        });
        let answer = if pipeline {
            // Longest next block worth preparing, and room in the output/cache.
            let next_k = if self.spec.cfg.adaptive_k {
                self.spec.cfg.k_max
            } else {
                run.gen.k
            };
            let room_after = room_out.saturating_sub(k + 1);
            let cap = k + 1 + next_k.min(room_after).min(self.max_block);
            self.pipelined_exchange(run, msg, &mut held, &mut hist, cap, ctx_before)?
        } else {
            self.exchange(msg, draft_positions(k))
        };
        let (answer, rtt) = match answer {
            Ok(a) => a,
            Err(e) => {
                run.rollback_unverified();
                self.fail(run, e)?;
                return Ok(());
            }
        };
        let v = self.verdict(answer, k, ctx_before)?;
        self.record_rtt(rtt, draft_positions(k));
        self.success();
        self.round += 1;
        run.stats.rounds += 1;
        run.stats.drafted += k as u64;
        run.stats.accepted += v.accepted as u64;
        run.stats.verifier_passes += 1;
        let n = v.accepted as usize;
        let t = v.next_token;
        self.spec.chooser.observe_round(k, n, ms(rtt));
        self.spec.rounds.push(RoundRecord {
            k,
            accepted: n,
            rtt_ms: ms(rtt),
            draft_ms,
            reused,
        });
        if n == k && held.len() > k && held[k] == t {
            // Full acceptance and the bonus token guessed: the draft cache (+
            // pending) already holds ctx + block + t + the rest of `held`.
            for &x in &block {
                if !run.emit(x, TokenStatus::Verified) {
                    return Ok(());
                }
            }
            if run.emit(t, TokenStatus::Verified) {
                self.spec.ahead = held[k + 1..].to_vec();
                self.spec.ahead_at = run.ctx.len();
            }
            return Ok(());
        }
        // The draft holds ctx_before + a prefix of `held` (+ pending).
        run.accept(ctx_before, &held, n, t);
        Ok(())
    }

    /// Sends `msg` from the I/O thread and keeps drafting (appending to `held`,
    /// at most `cap` tokens) until the answer is there.
    #[allow(clippy::too_many_arguments)]
    fn pipelined_exchange(
        &mut self,
        run: &mut Run<'_, '_>,
        msg: Cm,
        held: &mut Vec<u32>,
        hist: &mut Vec<u32>,
        cap: usize,
        ctx_before: usize,
    ) -> Result<Result<(Sm, Duration), NetError>, EdgeError> {
        let k = match &msg {
            Cm::Draft(d) => d.tokens.len(),
            _ => 0,
        };
        let deadline = self.deadline(draft_positions(k));
        let Some(mut stream) = self.stream.take() else {
            return Ok(Err(NetError::Unavailable("no session".into())));
        };
        let task = self.rt.spawn(async move {
            let mut c = Counters::default();
            let r = stream.exchange(msg, deadline, &mut c).await;
            (stream, c, r)
        });
        // Keep one slot of the cache free for the verdict's token.
        while !task.is_finished() && held.len() < cap && ctx_before + held.len() + 2 < run.capacity
        {
            let (d, _) = run.draft_next(hist)?;
            hist.push(d);
            held.push(d);
        }
        Ok(match self.rt.block_on(task) {
            Ok((stream, c, r)) => {
                self.counters.sent += c.sent;
                self.counters.received += c.received;
                if r.is_ok() {
                    self.stream = Some(stream);
                }
                r
            }
            Err(e) => Err(NetError::Unavailable(format!("verify task failed: {e}"))),
        })
    }

    /// Target-only streaming: k = 0 requests, `stream_window` in flight, until the
    /// generation stops or the stream fails.
    fn target_stream(&mut self, run: &mut Run<'_, '_>) -> Result<(), EdgeError> {
        let window = self.spec.cfg.stream_window.max(1);
        let mut sent: std::collections::VecDeque<Instant> = std::collections::VecDeque::new();
        loop {
            let room = run
                .gen
                .max_tokens
                .saturating_sub(run.out_len())
                .min(run.capacity.saturating_sub(run.ctx.len()));
            while sent.len() < window && sent.len() < room {
                let draft = pb::Draft {
                    round: self.round + sent.len() as u64,
                    ..Default::default()
                };
                let Some(s) = self.stream.as_mut() else {
                    return Ok(());
                };
                let r = self
                    .rt
                    .block_on(s.send(Cm::Draft(draft), &mut self.counters));
                if let Err(e) = r {
                    self.fail(run, e)?;
                    return Ok(());
                }
                sent.push_back(Instant::now());
            }
            let Some(at) = sent.pop_front() else {
                run.stop
                    .get_or_insert(if run.out_len() >= run.gen.max_tokens {
                        StopReason::MaxTokens
                    } else {
                        StopReason::ContextFull
                    });
                return Ok(());
            };
            let deadline = self.deadline(draft_positions(0));
            let Some(s) = self.stream.as_mut() else {
                return Ok(());
            };
            let r = self
                .rt
                .block_on(s.next_answer(deadline, &mut self.counters));
            let answer = match r {
                Ok(a) => a,
                Err(e) => {
                    self.fail(run, e)?;
                    return Ok(());
                }
            };
            let rtt = at.elapsed();
            let v = self.verdict(answer, 0, run.ctx.len())?;
            self.record_rtt(rtt, draft_positions(0));
            self.success();
            self.round += 1;
            run.stats.rounds += 1;
            run.stats.verifier_passes += 1;
            self.spec.rounds.push(RoundRecord {
                k: 0,
                accepted: 0,
                rtt_ms: ms(rtt),
                draft_ms: 0.0,
                reused: 0,
            });
            // The draft has not seen it; it runs over `pending` only if it must
            // continue alone.
            run.pending.push(v.next_token);
            if !run.emit(v.next_token, TokenStatus::Verified) {
                return Ok(());
            }
        }
    }
}
