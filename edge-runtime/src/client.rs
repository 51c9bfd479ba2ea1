//! The verifier client: channel setup (TLS, bearer token), one session stream with
//! deadlines and byte counting, the health probe, and classification of failures.

use crate::config::EdgeConfig;
use crate::error::EdgeError;
use crate::mtls_probe::MtlsProbe;
use crate::open_load::{OpenLoad, PrefillHold};
use prost::Message;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tandem_proto::v1::verifier_client::VerifierClient;
use tandem_proto::v1::{client_message, server_message, ClientMessage, Reason, ServerMessage};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// How the runtime should react to a failed exchange.
#[derive(Debug)]
pub enum NetError {
    /// No answer within the deadline.
    Timeout,
    /// Connection refused/reset, stream ended, server unavailable: an outage.
    Unavailable(String),
    /// The verifier answered but cannot serve now (SHUTTING_DOWN, RATE_LIMITED,
    /// TOO_MANY_SESSIONS, INTERNAL_ERROR): a failure, but the link works.
    Busy(String),
    /// The verifier lost the session (SESSION_UNKNOWN / SESSION_EVICTED): resend
    /// the context at once; not a failure of the verifier.
    Resend(String),
    /// The context no longer fits (CONTEXT_FULL): end the generation.
    ContextFull,
    /// Retrying cannot help.
    Fatal(EdgeError),
}

impl std::fmt::Display for NetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Timeout => write!(f, "deadline exceeded"),
            Self::Unavailable(m) => write!(f, "unavailable: {m}"),
            Self::Busy(m) => write!(f, "verifier busy: {m}"),
            Self::Resend(r) => write!(f, "session lost ({r})"),
            Self::ContextFull => write!(f, "context full"),
            Self::Fatal(e) => write!(f, "{e}"),
        }
    }
}

/// Everything in an error's source chain, for classification.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = format!("{e} {e:?}");
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(&format!(" | {c} {c:?}"));
        cur = c.source();
    }
    s
}

fn looks_like_tls(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    t.contains("certificate") || t.contains("unknownissuer") || t.contains("handshake")
}

fn transport_error(e: &tonic::transport::Error) -> NetError {
    let text = chain(e);
    if looks_like_tls(&text) {
        NetError::Fatal(EdgeError::Tls(text))
    } else {
        NetError::Unavailable(e.to_string())
    }
}

/// Maps a gRPC status to what the device does about it (by `tandem-reason`).
pub fn classify_status(s: &tonic::Status) -> NetError {
    let reason = s
        .metadata()
        .get(tandem_proto::REASON_METADATA_KEY)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| s.message().split(':').next().map(str::to_owned))
        .and_then(|n| Reason::from_str_name(n.trim()));
    match reason {
        Some(
            Reason::SessionUnknown
            | Reason::SessionEvicted
            | Reason::StreamIdle
            | Reason::ContextNotHeld,
        ) => NetError::Resend(s.message().to_owned()),
        Some(Reason::ContextFull) => NetError::ContextFull,
        Some(
            Reason::ShuttingDown
            | Reason::RateLimited
            | Reason::TooManySessions
            | Reason::QuotaExceeded
            | Reason::InternalError,
        ) => NetError::Busy(s.message().to_owned()),
        Some(r) => NetError::Fatal(EdgeError::Refused {
            reason: r.as_str_name().to_owned(),
            message: s.message().to_owned(),
        }),
        None => {
            let text = match std::error::Error::source(s) {
                Some(src) => format!("{} {}", s.message(), chain(src)),
                None => s.message().to_owned(),
            };
            if looks_like_tls(&text) {
                return NetError::Fatal(EdgeError::Tls(text));
            }
            match s.code() {
                tonic::Code::Unauthenticated
                | tonic::Code::PermissionDenied
                | tonic::Code::InvalidArgument
                | tonic::Code::FailedPrecondition
                | tonic::Code::Unimplemented => NetError::Fatal(EdgeError::Refused {
                    reason: format!("{:?}", s.code()),
                    message: s.message().to_owned(),
                }),
                _ => NetError::Unavailable(format!("{:?}: {}", s.code(), s.message())),
            }
        }
    }
}

/// Builds the endpoint (TLS from files) once per runtime.
#[derive(Clone, Debug)]
pub struct Connector {
    endpoint: Endpoint,
    token: Option<String>,
    /// Set when TLS is on without a client identity (see [`MtlsProbe`]).
    mtls_probe: Option<MtlsProbe>,
    connect_timeout: Duration,
}

impl Connector {
    pub fn new(cfg: &EdgeConfig, url: &str) -> Result<Self, EdgeError> {
        let read = |p: &std::path::PathBuf| {
            std::fs::read(p).map_err(|source| EdgeError::Read {
                path: p.clone(),
                source,
            })
        };
        let mut endpoint = Endpoint::from_shared(url.to_owned())
            .map_err(|e| EdgeError::Config(format!("verifier_url {url:?}: {e}")))?
            .connect_timeout(cfg.connect_timeout())
            .tcp_nodelay(true);
        let mut mtls_probe = None;
        if let Some(ca) = &cfg.ca_cert_pem {
            let ca_pem = read(ca)?;
            let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&ca_pem));
            if let (Some(c), Some(k)) = (&cfg.client_cert_pem, &cfg.client_key_pem) {
                tls = tls.identity(Identity::from_pem(read(c)?, read(k)?));
            } else {
                mtls_probe = MtlsProbe::new(url, &ca_pem, cfg.tls_domain.as_deref());
            }
            if let Some(d) = &cfg.tls_domain {
                tls = tls.domain_name(d.clone());
            }
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| EdgeError::Tls(chain(&e)))?;
        }
        Ok(Self {
            endpoint,
            token: cfg.bearer_token()?,
            mtls_probe,
            connect_timeout: cfg.connect_timeout(),
        })
    }

    pub async fn channel(&self) -> Result<Channel, NetError> {
        self.endpoint
            .connect()
            .await
            .map_err(|e| transport_error(&e))
    }

    /// One `grpc.health.v1` check of the verifier service; true when SERVING.
    pub async fn probe(&self, timeout: Duration) -> bool {
        use tonic_health::pb::health_check_response::ServingStatus;
        use tonic_health::pb::health_client::HealthClient;
        use tonic_health::pb::HealthCheckRequest;
        let fut = async {
            let ch = self.channel().await.ok()?;
            let mut c = HealthClient::new(ch);
            let r = c
                .check(HealthCheckRequest {
                    service: tandem_proto::VERIFIER_SERVICE_NAME.into(),
                })
                .await
                .ok()?;
            Some(r.into_inner().status == ServingStatus::Serving as i32)
        };
        matches!(tokio::time::timeout(timeout, fut).await, Ok(Some(true)))
    }

    /// Opens a session stream and sends `first` (an Open); returns the stream,
    /// the server's first message and how long that message took after the
    /// response headers (the verifier's prefill, as the device sees it).
    ///
    /// Two deadlines (see [`OpenDeadlines`]): the verifier answers the response
    /// headers before it prefills, so a silent link is detected after
    /// `d.headers` whatever the context length; `d.opened` bounds the prefill.
    ///
    /// `session_key` goes out as the [`tandem_proto::SESSION_AFFINITY_HEADER`]
    /// metadata (the generation's affinity key for a load balancer; see
    /// [`new_session_key`]).
    ///
    /// `load`: the opens this device has waiting (shared by sibling runtimes).
    /// The open waits there with its deadline, and when `d.opened` passes
    /// while others still wait, it waits for them too
    /// ([`crate::open_load`]).
    pub async fn open(
        &self,
        first: ClientMessage,
        session_key: &str,
        d: OpenDeadlines,
        load: Option<&Arc<OpenLoad>>,
        hold: Option<&PrefillHold>,
        counters: &mut Counters,
    ) -> Result<(Stream, ServerMessage, Duration), NetError> {
        let key = tonic::metadata::MetadataValue::try_from(session_key).map_err(|_| {
            NetError::Fatal(EdgeError::Config(
                "session affinity key is not valid header text".into(),
            ))
        })?;
        // Waiting from now: the headers, then the prefill (`d.total` bounds
        // an extended wait too).
        let ticket = load.map(|l| l.begin(Instant::now() + d.headers + d.opened));
        let fut = async {
            let headers = async {
                let ch = self.channel().await?;
                let mut client = VerifierClient::new(ch);
                let (tx, rx) = mpsc::channel::<ClientMessage>(8);
                counters.sent += first.encoded_len() as u64;
                tx.send(first)
                    .await
                    .map_err(|_| NetError::Unavailable("stream closed".into()))?;
                let mut req = tonic::Request::new(ReceiverStream::new(rx));
                if let Some(t) = &self.token {
                    let v = format!("Bearer {t}").parse().map_err(|_| {
                        NetError::Fatal(EdgeError::Config("token is not valid header text".into()))
                    })?;
                    req.metadata_mut().insert("authorization", v);
                }
                req.metadata_mut()
                    .insert(tandem_proto::SESSION_AFFINITY_HEADER, key);
                let resp = client.session(req).await.map_err(|s| classify_status(&s))?;
                Ok::<_, NetError>(Stream {
                    tx,
                    rx: resp.into_inner(),
                })
            };
            let mut stream = match tokio::time::timeout(d.headers, headers).await {
                Ok(r) => r?,
                Err(_) => return Err(NetError::Timeout),
            };
            let t = Instant::now();
            let mut until = t + d.opened;
            if let Some(ticket) = &ticket {
                ticket.set_deadline(until);
            }
            let first = {
                let recv = stream.recv(counters);
                tokio::pin!(recv);
                loop {
                    match tokio::time::timeout_at(until.into(), &mut recv).await {
                        Ok(r) => break r?,
                        Err(_) => {
                            // The device prefilled its draft meanwhile (it
                            // was not waiting), or its other opens still
                            // wait (the verifier may be prefilling them
                            // first): a later deadline.
                            let later =
                                hold.and_then(|h| h.extended(until, d.opened)).or_else(|| {
                                    ticket.as_ref().and_then(|k| k.extended(until, d.opened))
                                });
                            match later {
                                Some(later) => until = later,
                                None => return Err(NetError::Timeout),
                            }
                        }
                    }
                }
            };
            Ok((stream, first, t.elapsed()))
        };
        // `open_timeout_ms` bounds the whole wait; with a hold, the wait
        // from the device's release.
        let r = {
            tokio::pin!(fut);
            let mut until = Instant::now() + d.total;
            loop {
                match tokio::time::timeout_at(until.into(), &mut fut).await {
                    Ok(r) => break r,
                    Err(_) => match hold.and_then(|h| h.extended(until, d.total)) {
                        Some(later) => until = later,
                        None => break Err(NetError::Timeout),
                    },
                }
            }
        };
        // Answered or failed: no longer waiting for the verifier's prefill.
        drop(ticket);
        if let (Err(NetError::Unavailable(_)), Some(probe)) = (&r, &self.mtls_probe) {
            if probe
                .server_requires_client_cert(self.connect_timeout)
                .await
            {
                return Err(NetError::Fatal(EdgeError::Tls(
                    "the verifier requires a client certificate (mutual TLS) and none is \
                     configured: set client_cert_pem and client_key_pem in the edge config \
                     (tandem generate: --client-cert/--client-key)"
                        .into(),
                )));
            }
        }
        r
    }
}

/// A fresh session-affinity key: 128 random bits as 32 lowercase hex digits.
/// Drawn once per generation and sent on every stream of it (the first open and
/// every re-open), so a consistent-hash load balancer keeps the generation on one
/// verifier replica. Random, never derived from the prompt or the device.
pub fn new_session_key() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Deadlines of one session open ([`Connector::open`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenDeadlines {
    /// Connect (TCP, TLS) + the response headers, which the verifier sends
    /// before it prefills: about one round trip on a live link.
    pub headers: Duration,
    /// From the headers to `Opened` (the verifier prefills the context).
    pub opened: Duration,
    /// The whole open (`open_timeout_ms`).
    pub total: Duration,
}

/// Bytes on the wire (encoded protobuf message sizes).
#[derive(Clone, Copy, Debug, Default)]
pub struct Counters {
    pub sent: u64,
    pub received: u64,
}

impl Counters {
    /// Adds the bytes counted elsewhere (a background task).
    pub fn add(&mut self, other: Counters) {
        self.sent += other.sent;
        self.received += other.received;
    }
}

/// One live session stream.
pub struct Stream {
    tx: mpsc::Sender<ClientMessage>,
    rx: tonic::Streaming<ServerMessage>,
}

impl Stream {
    /// A send found the stream closed: the verifier ended it, and its status
    /// says why (e.g. `SHUTTING_DOWN` between two rounds, which a device must
    /// read as "busy, move", not as a broken link). Reads that status.
    async fn closed(&mut self, counters: &mut Counters) -> NetError {
        let closed = || NetError::Unavailable("stream closed".into());
        match tokio::time::timeout(Duration::from_secs(1), self.recv(counters)).await {
            Ok(Err(e)) => e,
            Ok(Ok(_)) | Err(_) => closed(),
        }
    }

    async fn recv(&mut self, counters: &mut Counters) -> Result<ServerMessage, NetError> {
        match self.rx.message().await {
            Ok(Some(m)) => {
                counters.received += m.encoded_len() as u64;
                Ok(m)
            }
            Ok(None) => Err(NetError::Unavailable(
                "the verifier ended the stream".into(),
            )),
            Err(s) => Err(classify_status(&s)),
        }
    }

    /// Sends one message without waiting for its answer (requests in flight; the
    /// answers come in order, see [`Stream::next_answer`]).
    pub async fn send(
        &mut self,
        msg: client_message::Msg,
        counters: &mut Counters,
    ) -> Result<(), NetError> {
        let m = ClientMessage { msg: Some(msg) };
        counters.sent += m.encoded_len() as u64;
        if self.tx.send(m).await.is_err() {
            return Err(self.closed(counters).await);
        }
        Ok(())
    }

    /// The next answer within `deadline`.
    pub async fn next_answer(
        &mut self,
        deadline: Duration,
        counters: &mut Counters,
    ) -> Result<server_message::Msg, NetError> {
        match tokio::time::timeout(deadline, self.recv(counters)).await {
            Ok(r) => r?
                .msg
                .ok_or_else(|| NetError::Fatal(EdgeError::Protocol("empty server message".into()))),
            Err(_) => Err(NetError::Timeout),
        }
    }

    /// Sends one message and waits for the answer within `deadline`; returns the
    /// answer and the round-trip time.
    pub async fn exchange(
        &mut self,
        msg: client_message::Msg,
        deadline: Duration,
        counters: &mut Counters,
    ) -> Result<(server_message::Msg, Duration), NetError> {
        let m = ClientMessage { msg: Some(msg) };
        let start = Instant::now();
        counters.sent += m.encoded_len() as u64;
        let fut = async {
            if self.tx.send(m).await.is_err() {
                return Err(self.closed(counters).await);
            }
            self.recv(counters).await
        };
        let answer = match tokio::time::timeout(deadline, fut).await {
            Ok(r) => r?,
            Err(_) => return Err(NetError::Timeout),
        };
        let rtt = start.elapsed();
        match answer.msg {
            Some(a) => Ok((a, rtt)),
            None => Err(NetError::Fatal(EdgeError::Protocol(
                "empty server message".into(),
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: tonic::Code, reason: &str) -> tonic::Status {
        let mut s = tonic::Status::new(code, format!("{reason}: details"));
        s.metadata_mut()
            .insert(tandem_proto::REASON_METADATA_KEY, reason.parse().unwrap());
        s
    }

    #[test]
    fn reasons_map_to_actions() {
        assert!(matches!(
            classify_status(&status(tonic::Code::NotFound, "SESSION_EVICTED")),
            NetError::Resend(_)
        ));
        assert!(matches!(
            classify_status(&status(tonic::Code::NotFound, "SESSION_UNKNOWN")),
            NetError::Resend(_)
        ));
        assert!(matches!(
            classify_status(&status(tonic::Code::Unavailable, "SHUTTING_DOWN")),
            NetError::Busy(_)
        ));
        match classify_status(&status(
            tonic::Code::FailedPrecondition,
            "FINGERPRINT_MISMATCH",
        )) {
            NetError::Fatal(EdgeError::Refused { reason, .. }) => {
                assert_eq!(reason, "FINGERPRINT_MISMATCH")
            }
            other => panic!("{other}"),
        }
        // Without metadata, the message prefix is read.
        let s = tonic::Status::new(tonic::Code::NotFound, "SESSION_UNKNOWN: gone");
        assert!(matches!(classify_status(&s), NetError::Resend(_)));
        let s = tonic::Status::new(tonic::Code::Unavailable, "connection reset");
        assert!(matches!(classify_status(&s), NetError::Unavailable(_)));
    }
}
