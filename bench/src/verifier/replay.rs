//! The simulated devices: one `Session` stream each, over the ordinary edge
//! client (`tandem_edge::client`), replaying recorded rounds with no drafting
//! time between them (a closed loop: each device sends its next Draft as soon
//! as its Verdict arrives), and checking every verdict against the recording.
//!
//! Timeline of one configuration: every device opens its session (the
//! verifier prefills), then all wait at a barrier; the coordinator takes the
//! "before" snapshot and releases them (window start); each device replays
//! the same number of rounds (the shortest trace's), then holds its session
//! open; the window ends with the last device's last verdict, and the
//! coordinator takes the "after" snapshot (sessions still held) and lets the
//! devices go.

use super::trace::SessionTrace;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tandem_edge::client::{Connector, Counters, OpenDeadlines, Stream};
use tandem_edge::EdgeConfig;
use tandem_proto::v1::{client_message::Msg, server_message, ClientMessage, Draft, Open};
use tokio::sync::{mpsc, watch};

/// One round as the device saw it.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    /// When the verdict arrived.
    pub at: Instant,
    /// Draft sent -> Verdict received.
    pub latency: Duration,
    /// Tokens the verdict emitted (accepted + 1).
    pub tokens: u32,
}

/// What one device did.
#[derive(Debug, Default)]
pub struct DeviceRun {
    /// Open sent -> Opened received (connect included).
    pub open: Option<Duration>,
    pub samples: Vec<Sample>,
    /// Verdicts compared with the recording (all equal unless `mismatch`).
    pub checked: usize,
    /// The first verdict that differs from the recording (the device stops there).
    pub mismatch: Option<String>,
    /// A refusal or transport failure.
    pub error: Option<String>,
}

/// Everything the verifier is asked for, and how to reach it.
pub struct Target {
    pub url: String,
    pub token: String,
    pub model_id: String,
    pub fingerprint: String,
}

/// The outcome of one configuration.
pub struct CellRun<S> {
    pub devices: Vec<DeviceRun>,
    pub start: Instant,
    /// When the last device received its last verdict (window end).
    pub end: Instant,
    pub before: S,
    pub after: S,
}

/// Long enough for 32 queued prefills or verifies on a slow machine; a
/// deadline here only turns a hung verifier into an error.
const DEADLINE: Duration = Duration::from_secs(900);

/// Runs `sessions.len()` devices against the verifier, each replaying the
/// first `rounds` rounds of its trace; `snapshot` is taken right before the
/// window opens and right after it closes (on the blocking pool: it reads
/// /proc and /metrics).
pub async fn run<S, F>(
    target: &Target,
    sessions: Vec<Arc<SessionTrace>>,
    rounds: usize,
    snapshot: F,
) -> anyhow::Result<CellRun<S>>
where
    S: Send + 'static,
    F: Fn() -> S + Send + Sync + Clone + 'static,
{
    let n = sessions.len();
    let cfg = EdgeConfig {
        verifier_url: Some(target.url.clone()),
        token: Some(target.token.clone()),
        ..EdgeConfig::default()
    };
    let connector = Connector::new(&cfg, &target.url)?;
    let (ready_tx, mut ready_rx) = mpsc::unbounded_channel::<()>();
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Instant>();
    let (start_tx, start_rx) = watch::channel(false);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut handles = Vec::with_capacity(n);
    for trace in sessions {
        let open = Open {
            model_id: target.model_id.clone(),
            tokenizer_fingerprint: target.fingerprint.clone(),
            prompt_tokens: trace.prompt.clone(),
            first_round: 0,
            ..Open::default()
        };
        let ctl = Control {
            ready: ready_tx.clone(),
            done: done_tx.clone(),
            start: start_rx.clone(),
            stop: stop_rx.clone(),
        };
        handles.push(tokio::spawn(device(
            connector.clone(),
            open,
            trace,
            rounds,
            ctl,
        )));
    }
    drop((ready_tx, done_tx));
    // Every device has opened (or failed) before the window.
    for _ in 0..n {
        if ready_rx.recv().await.is_none() {
            break;
        }
    }
    let before = tokio::task::spawn_blocking(snapshot.clone()).await?;
    let start = Instant::now();
    let _ = start_tx.send(true);
    let mut end = start;
    while let Some(at) = done_rx.recv().await {
        end = end.max(at);
    }
    let after = tokio::task::spawn_blocking(snapshot).await?;
    let _ = stop_tx.send(true);
    let mut devices = Vec::with_capacity(n);
    for h in handles {
        devices.push(h.await?);
    }
    Ok(CellRun {
        devices,
        start,
        end,
        before,
        after,
    })
}

struct Control {
    /// "Opened (or failed), waiting for the window."
    ready: mpsc::UnboundedSender<()>,
    /// When this device's last verdict came (dropped once it is done).
    done: mpsc::UnboundedSender<Instant>,
    start: watch::Receiver<bool>,
    stop: watch::Receiver<bool>,
}

async fn device(
    connector: Connector,
    open: Open,
    trace: Arc<SessionTrace>,
    rounds: usize,
    mut ctl: Control,
) -> DeviceRun {
    let mut run = DeviceRun::default();
    let mut counters = Counters::default();
    let t = Instant::now();
    let first = ClientMessage {
        msg: Some(Msg::Open(open)),
    };
    let deadlines = OpenDeadlines {
        headers: DEADLINE,
        opened: DEADLINE,
        total: DEADLINE,
    };
    let key = tandem_edge::client::new_session_key();
    let opened = connector
        .open(first, &key, deadlines, None, None, &mut counters)
        .await;
    let mut stream = match opened {
        Ok((stream, answer, _)) => match answer.msg {
            Some(server_message::Msg::Opened(o)) if o.context_len == trace.prompt.len() as u64 => {
                run.open = Some(t.elapsed());
                Some(stream)
            }
            other => {
                run.error = Some(format!("Open answered {other:?}"));
                None
            }
        },
        Err(e) => {
            run.error = Some(format!("Open failed: {e}"));
            None
        }
    };
    let _ = ctl.ready.send(());
    let go = tokio::select! {
        r = ctl.start.wait_for(|s| *s) => r.is_ok(),
        _ = ctl.stop.wait_for(|s| *s) => false,
    };
    if let (true, Some(s)) = (go, stream.as_mut()) {
        replay(s, &trace, rounds, &mut ctl.stop, &mut counters, &mut run).await;
    }
    if let Some(last) = run.samples.last() {
        let _ = ctl.done.send(last.at);
    }
    // The coordinator's window closes once every device has dropped `done`;
    // the session stays open (its KV cache counted) until it says stop.
    drop(ctl.done);
    if stream.is_some() {
        let _ = ctl.stop.wait_for(|s| *s).await;
    }
    run
}

/// Sends the first `rounds` recorded drafts in order (fewer when a verdict
/// differs, the stream fails, or the coordinator says stop).
async fn replay(
    stream: &mut Stream,
    trace: &SessionTrace,
    rounds: usize,
    stop: &mut watch::Receiver<bool>,
    counters: &mut Counters,
    run: &mut DeviceRun,
) {
    let contexts = trace.context_after();
    let planned = trace.rounds.iter().zip(contexts).take(rounds);
    for (i, (want, context_len)) in planned.enumerate() {
        let draft = Draft {
            round: i as u64,
            tokens: want.draft.clone(),
            ..Draft::default()
        };
        let answer = tokio::select! {
            a = stream.exchange(Msg::Draft(draft), DEADLINE, counters) => a,
            _ = stop.wait_for(|s| *s) => return,
        };
        let at = Instant::now();
        let (msg, latency) = match answer {
            Ok(a) => a,
            Err(e) => {
                run.error = Some(format!("round {i}: {e}"));
                return;
            }
        };
        let server_message::Msg::Verdict(v) = msg else {
            run.error = Some(format!("round {i}: answered {msg:?}, not a Verdict"));
            return;
        };
        run.checked += 1;
        if (v.round, v.accepted, v.next_token, v.context_len)
            != (i as u64, want.accepted, want.next_token, context_len)
        {
            run.mismatch = Some(format!(
                "prompt {} round {i} (k = {}): verifier answered accepted {} next {} context {} \
                 (round {}), recorded accepted {} next {} context {context_len}",
                trace.prompt_id,
                want.draft.len(),
                v.accepted,
                v.next_token,
                v.context_len,
                v.round,
                want.accepted,
                want.next_token,
            ));
            return;
        }
        run.samples.push(Sample {
            at,
            latency,
            tokens: v.accepted + 1,
        });
    }
}
