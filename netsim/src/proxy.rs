//! The TCP proxy: accepts connections, opens one to the upstream for each,
//! and pumps bytes both ways through a [`LinkSchedule`] per direction.
//!
//! Per direction, a reader timestamps each chunk as it arrives and queues it;
//! a writer plans it (bandwidth, latency, jitter, loss stall), sleeps until
//! its delivery time and writes it. The queue is bounded, so a sender that
//! outruns the simulated link is eventually slowed down by TCP flow control,
//! as on a real link. Conditions are read from a `watch` channel at every
//! chunk, so profile switches apply to open connections too.
//!
//! At most [`DEFAULT_MAX_CONNECTIONS`] (or [`ProxyHandle::set_max_connections`])
//! connections are open at once: each costs two sockets, two tasks and up to
//! `2 × QUEUE_CHUNKS` queued chunks, so an unbounded number would let one
//! client exhaust file descriptors and memory. A connection over the cap is
//! accepted and reset at once (counted in [`ProxyStats::refused`]), which a
//! client sees as a clear error rather than a hang in the listen backlog.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use crate::config::{Direction, LinkConfig, NetConfig};
use crate::error::NetsimError;
use crate::schedule::{link_seed, LinkSchedule};
use crate::timeline::{Step, Timeline};

/// Largest chunk read at once.
const MAX_CHUNK: usize = 16 * 1024;
/// Smallest chunk on a slow link (one TCP segment).
const MIN_CHUNK: usize = 1460;
/// Chunks queued per direction before the reader stops reading.
const QUEUE_CHUNKS: usize = 256;
/// Connections open at once unless [`ProxyHandle::set_max_connections`] says
/// otherwise.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// Entry point: `Proxy::start(listen, upstream, config)`.
pub struct Proxy;

impl Proxy {
    /// Binds `listen` (port 0 picks a free port) and starts forwarding to
    /// `upstream` under `config`, with seed 0. Must be called inside a tokio
    /// runtime; the proxy runs on it until [`ProxyHandle::shutdown`] or drop.
    pub async fn start(
        listen: SocketAddr,
        upstream: SocketAddr,
        config: NetConfig,
    ) -> Result<ProxyHandle, NetsimError> {
        Proxy::start_seeded(listen, upstream, config, 0).await
    }

    /// As [`Proxy::start`], with the seed of the jitter/loss/reset draws.
    /// Connection `i`'s directions use [`link_seed`]`(seed, i, dir)`.
    pub async fn start_seeded(
        listen: SocketAddr,
        upstream: SocketAddr,
        config: NetConfig,
        seed: u64,
    ) -> Result<ProxyHandle, NetsimError> {
        config.validate()?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| NetsimError::NoRuntime)?;
        let listener = TcpListener::bind(listen)
            .await
            .map_err(|source| NetsimError::Bind {
                addr: listen,
                source,
            })?;
        let local_addr = listener.local_addr().map_err(|source| NetsimError::Bind {
            addr: listen,
            source,
        })?;
        let (config_tx, _) = watch::channel(config);
        let (reset_tx, _) = watch::channel(0u64);
        let shared = Arc::new(Shared {
            config: config_tx,
            reset: reset_tx,
            stats: Stats::default(),
            upstream,
            seed,
            max_connections: AtomicUsize::new(DEFAULT_MAX_CONNECTIONS),
        });
        let accept = runtime.spawn(accept_loop(listener, shared.clone()));
        tracing::info!(%local_addr, %upstream, seed, "netsim proxy started");
        Ok(ProxyHandle {
            local_addr,
            shared,
            runtime,
            accept: Some(accept),
            timeline: Mutex::new(None),
        })
    }
}

/// Counters since the proxy started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProxyStats {
    /// Connections accepted.
    pub connections: u64,
    /// Connections open now.
    pub open: u64,
    /// Bytes delivered client → upstream.
    pub bytes_up: u64,
    /// Bytes delivered upstream → client.
    pub bytes_down: u64,
    /// Chunks stalled by simulated loss.
    pub stalls: u64,
    /// Connections ended by a reset (simulated, commanded, or an error).
    pub resets: u64,
    /// Connections reset on arrival because the cap was reached (not in
    /// `connections` or `resets`).
    pub refused: u64,
}

#[derive(Default)]
struct Stats {
    connections: AtomicU64,
    open: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
    stalls: AtomicU64,
    resets: AtomicU64,
    refused: AtomicU64,
}

struct Shared {
    config: watch::Sender<NetConfig>,
    /// Bumped to reset every open connection.
    reset: watch::Sender<u64>,
    stats: Stats,
    upstream: SocketAddr,
    seed: u64,
    max_connections: AtomicUsize,
}

/// A running proxy. Dropping it stops the proxy (like [`shutdown`](Self::shutdown),
/// without waiting).
pub struct ProxyHandle {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    runtime: tokio::runtime::Handle,
    accept: Option<JoinHandle<()>>,
    timeline: Mutex<Option<JoinHandle<()>>>,
}

impl ProxyHandle {
    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The conditions in force now.
    pub fn config(&self) -> NetConfig {
        self.shared.config.borrow().clone()
    }

    /// Switches to `config` now (open connections included) and stops any
    /// running timeline.
    pub fn set_profile(&self, config: NetConfig) -> Result<(), NetsimError> {
        config.validate()?;
        self.stop_timeline();
        tracing::info!(profile = %config.name, "netsim conditions changed");
        self.shared.config.send_replace(config);
        Ok(())
    }

    /// Runs `timeline` from now, replacing any running one.
    pub fn set_timeline(&self, timeline: Timeline) {
        let task = self
            .runtime
            .spawn(drive_timeline(timeline, self.shared.clone()));
        let old = self
            .timeline
            .lock()
            .map(|mut slot| slot.replace(task))
            .unwrap_or_else(|poisoned| poisoned.into_inner().take());
        if let Some(old) = old {
            old.abort();
        }
    }

    /// Allows at most `max` (at least 1) connections open at once from now
    /// on; open ones above it are not closed.
    pub fn set_max_connections(&self, max: usize) {
        self.shared
            .max_connections
            .store(max.max(1), Ordering::Relaxed);
    }

    /// Resets (RST) every open connection now.
    pub fn reset_connections(&self) {
        self.shared.reset.send_modify(|g| *g += 1);
    }

    /// Counters since start.
    pub fn stats(&self) -> ProxyStats {
        let s = &self.shared.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ProxyStats {
            connections: get(&s.connections),
            open: get(&s.open),
            bytes_up: get(&s.bytes_up),
            bytes_down: get(&s.bytes_down),
            stalls: get(&s.stalls),
            resets: get(&s.resets),
            refused: get(&s.refused),
        }
    }

    /// Stops accepting and closes every connection (FIN, not RST).
    pub async fn shutdown(mut self) {
        self.stop_timeline();
        if let Some(accept) = self.accept.take() {
            accept.abort();
            let _ = accept.await;
        }
    }

    fn stop_timeline(&self) {
        let old = match self.timeline.lock() {
            Ok(mut slot) => slot.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        if let Some(old) = old {
            old.abort();
        }
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        self.stop_timeline();
        if let Some(accept) = self.accept.take() {
            accept.abort();
        }
    }
}

async fn drive_timeline(timeline: Timeline, shared: Arc<Shared>) {
    for segment in timeline.segments() {
        match &segment.step {
            Step::Conditions(c) => {
                tracing::info!(profile = %c.name, duration = ?segment.duration, "netsim timeline segment");
                shared.config.send_replace(c.clone());
            }
            Step::Reset => {
                tracing::info!("netsim timeline: resetting all connections");
                shared.reset.send_modify(|g| *g += 1);
            }
        }
        if let Some(d) = segment.duration {
            tokio::time::sleep(d).await;
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    // Dropping the set (when this task is aborted) aborts every connection.
    let mut connections = JoinSet::new();
    let mut index = 0u64;
    loop {
        while connections.try_join_next().is_some() {}
        match listener.accept().await {
            Ok((client, peer)) => {
                // After this the set holds exactly the live connections,
                // unlike `open`, which a just-spawned task has not
                // incremented yet.
                while connections.try_join_next().is_some() {}
                if connections.len() >= shared.max_connections.load(Ordering::Relaxed) {
                    shared.stats.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%peer, open = connections.len(), "netsim connection cap reached; resetting the new connection");
                    let _ = client.set_zero_linger();
                    continue;
                }
                shared.stats.connections.fetch_add(1, Ordering::Relaxed);
                connections.spawn(connection(client, peer, index, shared.clone()));
                index += 1;
            }
            Err(e) => {
                // E.g. out of file descriptors: back off instead of spinning.
                tracing::warn!(error = %e, "netsim accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// How a connection ended.
#[derive(Debug)]
enum End {
    /// Both directions closed normally.
    Closed,
    /// Reset both sides.
    Reset(&'static str),
}

struct OpenGuard<'a>(&'a Stats);
impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn connection(mut client: TcpStream, peer: SocketAddr, index: u64, shared: Arc<Shared>) {
    shared.stats.open.fetch_add(1, Ordering::Relaxed);
    let _open = OpenGuard(&shared.stats);
    let mut reset_rx = shared.reset.subscribe();
    let _ = client.set_nodelay(true);
    let mut upstream = match TcpStream::connect(shared.upstream).await {
        Ok(s) => s,
        Err(e) => {
            // Upstream down: the client sees a refused connection as an RST.
            tracing::debug!(%peer, error = %e, "netsim upstream connect failed");
            shared.stats.resets.fetch_add(1, Ordering::Relaxed);
            let _ = client.set_zero_linger();
            return;
        }
    };
    let _ = upstream.set_nodelay(true);
    tracing::debug!(%peer, index, "netsim connection open");
    let end = {
        let (cr, cw) = client.split();
        let (ur, uw) = upstream.split();
        let start = Instant::now();
        let up = pipe(cr, uw, Direction::Up, index, start, &shared);
        let down = pipe(ur, cw, Direction::Down, index, start, &shared);
        tokio::select! {
            r = async { tokio::try_join!(up, down) } => match r {
                Ok(((), ())) => End::Closed,
                Err(why) => End::Reset(why),
            },
            _ = reset_rx.changed() => End::Reset("commanded"),
        }
    };
    match end {
        End::Closed => tracing::debug!(%peer, index, "netsim connection closed"),
        End::Reset(why) => {
            tracing::debug!(%peer, index, why, "netsim connection reset");
            shared.stats.resets.fetch_add(1, Ordering::Relaxed);
            // SO_LINGER 0: close() sends RST instead of FIN.
            let _ = client.set_zero_linger();
            let _ = upstream.set_zero_linger();
        }
    }
}

enum Item {
    Data(Instant, Vec<u8>),
    Eof(Instant),
}

/// Read size for the current conditions: ~10 ms of the link's bandwidth,
/// so a slow link's delivery is smooth rather than 16 KiB at a time.
fn chunk_size(link: &LinkConfig) -> usize {
    match link.bytes_per_sec() {
        Some(rate) => ((rate * 0.010) as usize).clamp(MIN_CHUNK, MAX_CHUNK),
        None => MAX_CHUNK,
    }
}

/// One direction. Returns `Err(reason)` when the connection must be reset.
async fn pipe<R, W>(
    mut src: R,
    mut dst: W,
    dir: Direction,
    index: u64,
    start: Instant,
    shared: &Shared,
) -> Result<(), &'static str>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (tx, mut rx) = mpsc::channel::<Item>(QUEUE_CHUNKS);
    let config_rx = shared.config.subscribe();
    let reader = async {
        let mut buf = vec![0u8; MAX_CHUNK];
        loop {
            let size = chunk_size(config_rx.borrow().link(dir));
            let n = src.read(&mut buf[..size]).await.map_err(|_| "read error")?;
            let now = Instant::now();
            let item = if n == 0 {
                Item::Eof(now)
            } else {
                Item::Data(now, buf[..n].to_vec())
            };
            tx.send(item).await.map_err(|_| "writer gone")?;
            if n == 0 {
                return Ok::<(), &'static str>(());
            }
        }
    };
    let writer = async {
        let mut config_rx = shared.config.subscribe();
        let mut schedule = LinkSchedule::new(link_seed(shared.seed, index, dir));
        let counter = match dir {
            Direction::Up => &shared.stats.bytes_up,
            Direction::Down => &shared.stats.bytes_down,
        };
        while let Some(item) = rx.recv().await {
            let (arrival, data) = match item {
                Item::Data(t, d) => (t, Some(d)),
                Item::Eof(t) => (t, None),
            };
            let len = data.as_ref().map_or(0, Vec::len);
            let mut link = *config_rx.borrow_and_update().link(dir);
            let mut arrival = arrival;
            if link.blackhole {
                // Arrived during an outage: held until the link is back,
                // then sent as if it arrived then.
                link = wait_online(&mut config_rx, dir).await?;
                arrival = Instant::now();
            }
            let plan = schedule.plan(&link, arrival - start, len);
            if plan.stalled {
                shared.stats.stalls.fetch_add(1, Ordering::Relaxed);
            }
            let mut deliver_at = start + plan.deliver_at;
            loop {
                sleep_precise(deliver_at).await;
                let now_link = *config_rx.borrow_and_update().link(dir);
                if !now_link.blackhole {
                    break;
                }
                // An outage began while the chunk was in flight: it is
                // retransmitted once the link is back.
                let back = wait_online(&mut config_rx, dir).await?;
                deliver_at = Instant::now() + back.latency;
                schedule.delivered_late(deliver_at - start);
            }
            if plan.reset {
                return Err("simulated reset");
            }
            match data {
                Some(d) => {
                    dst.write_all(&d).await.map_err(|_| "write error")?;
                    counter.fetch_add(d.len() as u64, Ordering::Relaxed);
                }
                None => {
                    if !link.close_delay.is_zero() {
                        tokio::time::sleep(link.close_delay).await;
                    }
                    dst.shutdown().await.map_err(|_| "shutdown error")?;
                    return Ok(());
                }
            }
        }
        Ok(())
    };
    tokio::try_join!(reader, writer).map(|_| ())
}

/// Below this, a wait is finished on the OS timer instead of tokio's.
const FINE_WAIT: Duration = Duration::from_millis(2);

/// Sleeps until `deadline` with sub-millisecond precision. tokio's timer has
/// 1 ms granularity (a sleep ends on the first tick after its deadline), which
/// added ~1 ms to every crossing: a raw TCP echo through `lan` (0.5 ms RTT)
/// measured 2.8–3.0 ms (0.15 ms direct; 0.93–0.99 ms with this function,
/// docs/shard-planner.md). So only the wait up to
/// `FINE_WAIT` before the deadline uses tokio; the rest is a `thread::sleep`
/// (high-resolution timer, ~0.1 ms slack) on the blocking pool.
async fn sleep_precise(deadline: Instant) {
    let now = Instant::now();
    if deadline <= now {
        return;
    }
    if deadline - now > FINE_WAIT {
        tokio::time::sleep_until(deadline - FINE_WAIT).await;
    }
    let rest = deadline.saturating_duration_since(Instant::now());
    if !rest.is_zero() {
        // A JoinError (runtime shutting down) just ends the wait early.
        let _ = tokio::task::spawn_blocking(move || std::thread::sleep(rest)).await;
    }
}

/// Waits until `dir` is not blackholed; returns its conditions then.
async fn wait_online(
    config_rx: &mut watch::Receiver<NetConfig>,
    dir: Direction,
) -> Result<LinkConfig, &'static str> {
    config_rx
        .wait_for(|c| !c.link(dir).blackhole)
        .await
        .map(|c| *c.link(dir))
        .map_err(|_| "proxy stopped")
}
