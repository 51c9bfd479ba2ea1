//! Uncertainty-gated verification (`[gate]`, [`crate::config::GateConfig`];
//! greedy only). A child module of `runtime`, like `pipeline`.
//!
//! Each round drafts a block as usual and notes the draft's top-1 probability of
//! every token. When all of them reach `gate.confidence` (and the gated span
//! stays within `gate.max_span` and within one verify block with the next
//! block), the block is shown at once as **provisional** and nothing is sent.
//! The next block that is not gated goes out together with the waiting span, as
//! one `Draft` from the start of the span: the verifier (whose context still
//! ends where the span starts) checks span and block in one forward pass.
//!
//! - Verdict accepts the whole span: a `ProvisionalChecked` event with no
//!   mismatches, then the block's accepted drafts and the verifier's token as
//!   verified, exactly as in a plain round.
//! - Verdict stops inside the span: the shown token there differs from the
//!   target's. It stays shown (streamed text is final) and is reported as a
//!   mismatch; the block is dropped, the verifier's session is moved to the
//!   shown context (`Resume`), and the rest of the span is checked as after an
//!   outage. What follows is the target's greedy output given the shown text.
//!
//! A span still waiting when the generation ends is verified in one last pass.
//! The trade-off (round trips saved against shown tokens that turn out wrong)
//! is measured in docs/lab.md, "Uncertainty-gated verification".

use super::*;
use crate::adaptive::RoundRecord;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl Net<'_> {
    /// One round with gating (see the module docs).
    pub(super) fn gated_round(&mut self, run: &mut Run<'_, '_>) -> Result<(), EdgeError> {
        if run.check.is_none() {
            run.gated = false;
        } else if !run.gated {
            // A provisional span from an outage: checked on its own first.
            self.check_provisional(run)?;
            return Ok(());
        }
        let room_out = run.gen.max_tokens.saturating_sub(run.out_len());
        // The gated span waiting for verification is out[p..].
        let p = match &run.check {
            Some(c) => c.next,
            None => run.out_len(),
        };
        let g = run.out_len() - p;
        let limit = self
            .max_block
            .saturating_sub(g)
            .min(run.capacity.saturating_sub(run.ctx.len()))
            .min(room_out.max(1));
        if limit == 0 {
            if g > 0 {
                self.check_provisional(run)?;
            } else {
                run.stop = Some(StopReason::ContextFull);
            }
            return Ok(());
        }
        // Fixed k (adaptive k is not combined with gating: refused by the config).
        let k = run.gen.k.min(limit);
        let ctx_before = run.ctx.len();
        let mut hist = run.ctx.clone();
        let mut block = Vec::with_capacity(k);
        let mut conf = 1.0f32;
        let t0 = Instant::now();
        for _ in 0..k {
            let (d, _) = run.draft_next(&hist)?;
            conf = conf.min(run.conf);
            hist.push(d);
            block.push(d);
        }
        let draft_ms = ms(t0.elapsed());
        let gate = &self.cfg.gate;
        let gated = f64::from(conf) >= gate.confidence
            && g + k <= gate.max_span
            && g + 2 * k <= self.max_block
            && room_out > k;
        if gated {
            if run.check.is_none() {
                let n = run.out_len();
                run.check = Some(Check {
                    start: n,
                    next: n,
                    mismatches: Vec::new(),
                });
                run.gated = true;
            }
            run.stats.gated_rounds += 1;
            run.stats.gated_tokens += k as u64;
            // The draft holds ctx + block[..k-1] with pending = [block[k-1]]:
            // after these, ctx = its cache + pending again.
            for &x in &block {
                if !run.emit(x, TokenStatus::Provisional) {
                    return Ok(());
                }
            }
            return Ok(());
        }
        let mut tokens = run.out()[p..].to_vec();
        tokens.extend_from_slice(&block);
        let total = tokens.len();
        let msg = Cm::Draft(pb::Draft {
            round: self.round,
            tokens,
            ..pb::Draft::default()
        });
        let (answer, rtt) = match self.exchange(msg, draft_positions(total)) {
            Ok(a) => a,
            Err(e) => {
                run.rollback_unverified();
                self.fail(run, e)?;
                return Ok(());
            }
        };
        let v = self.verdict(answer, total, run.prompt_len + p)?;
        self.record_rtt(rtt, draft_positions(total));
        self.success();
        self.round += 1;
        run.stats.rounds += 1;
        run.stats.drafted += k as u64;
        run.stats.verifier_passes += 1;
        let n = v.accepted as usize;
        let t = v.next_token;
        if n < g {
            // The shown token out[p + n] is not the target's: report it, drop
            // the block, follow the shown text, check the rest of the span.
            run.rollback_unverified();
            if let Some(c) = run.check.as_mut() {
                c.mismatches.push(p + n);
                c.next = p + n + 1;
            }
            if let Step::Lost = self.resume_shown(run, run.prompt_len + p + n + 1)? {
                return Ok(());
            }
            self.check_provisional(run)?;
            return Ok(());
        }
        if let Some(c) = run.check.take() {
            run.complete_check(c, true);
        }
        run.gated = false;
        let a = n - g;
        run.stats.accepted += a as u64;
        self.spec.rounds.push(RoundRecord {
            k,
            accepted: a,
            rtt_ms: ms(rtt),
            draft_ms,
            reused: 0,
        });
        // The draft holds ctx_before + block[..k-1], pending = [block[k-1]].
        run.accept(ctx_before, &block, a, t);
        Ok(())
    }
}
