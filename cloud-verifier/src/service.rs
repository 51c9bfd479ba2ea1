//! The gRPC `Session` service: one task per stream reads client messages,
//! applies the per-message checks (rate, idle time, size) and hands each
//! message to its handler ([`crate::handlers`]). Authentication happened
//! before, in the [`crate::auth::Auth`] interceptor.

use crate::auth::Identity;
use crate::error::Refusal;
use crate::handlers::{self, Bound};
use crate::state::VerifierState;
use std::pin::Pin;
use std::sync::Arc;
use tandem_proto::v1::verifier_server::Verifier;
use tandem_proto::v1::{client_message, server_message, ClientMessage, Reason, ServerMessage};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

/// The tonic service.
#[derive(Clone)]
pub struct VerifierService {
    pub state: Arc<VerifierState>,
}

type Out = mpsc::Sender<Result<ServerMessage, Status>>;

fn msg(m: server_message::Msg) -> ServerMessage {
    ServerMessage { msg: Some(m) }
}

/// A transport error on the inbound stream as the refusal to send back, if
/// the device should hear one (an oversized message; tonic reports it as
/// OUT_OF_RANGE and would otherwise end the stream with no status).
fn inbound_refusal(st: &Status) -> Option<Refusal> {
    (st.code() == tonic::Code::OutOfRange && st.message().contains("too large")).then(|| {
        Refusal::new(
            Reason::MessageTooLarge,
            format!("{} (limits.max_message_bytes)", st.message()),
        )
    })
}

/// An Open of a fresh session (no resume, no continuation): dropping its
/// handler loses nothing the device could come back to.
fn abandonable(m: &ClientMessage) -> bool {
    matches!(&m.msg, Some(client_message::Msg::Open(o))
        if o.resume_session_id.is_none() && o.continuation.is_none())
}

impl VerifierService {
    /// One client message of a stream bound to `bound`, as the stream loop
    /// hands it on after its transport checks (idle time, message size):
    /// admission, then the message's handler. A refusal ends the stream.
    /// Public for in-process drivers (the `verifier_messages` fuzz target).
    pub async fn handle(
        &self,
        who: &Arc<str>,
        bound: &mut Option<Bound>,
        m: ClientMessage,
    ) -> Result<ServerMessage, Refusal> {
        let s = &self.state;
        s.admission.message(who)?;
        match (m.msg, bound.as_ref()) {
            (Some(client_message::Msg::Open(o)), None) => {
                let _slot = s.open_slot(who)?;
                let (b, opened) = handlers::open::open(s, who, o).await?;
                *bound = Some(b);
                Ok(msg(server_message::Msg::Opened(opened)))
            }
            (Some(client_message::Msg::Open(_)), Some(_)) => Err(Refusal::new(
                Reason::BadRequest,
                "Open may only be the first message",
            )),
            (_, None) => Err(Refusal::new(
                Reason::BadRequest,
                "the first message must be Open",
            )),
            (Some(client_message::Msg::Draft(d)), Some(b)) => {
                handlers::draft::draft(s, who, b, d).await
            }
            (Some(client_message::Msg::Resume(r)), Some(b)) => {
                handlers::resume::resume(s, who, b, r).await
            }
            (Some(client_message::Msg::Close(c)), Some(b)) => {
                Ok(handlers::close::close(s, who, b, &c))
            }
            (None, Some(_)) => Err(Refusal::new(Reason::BadRequest, "empty client message")),
        }
    }

    async fn refuse(&self, tx: &Out, bound: &Option<Bound>, r: Refusal) {
        self.state.metrics.error(r.reason.as_str_name());
        let sid = bound.as_ref().map(|b| &*b.id).unwrap_or("-");
        tracing::info!(session = %sid, reason = r.reason.as_str_name(), "request refused");
        let _ = tx.send(Err(r.to_status())).await;
    }

    async fn run_stream(self, who: Arc<str>, mut inbound: Streaming<ClientMessage>, tx: Out) {
        let mut bound: Option<Bound> = None;
        let mut shutdown = self.state.shutdown.clone();
        let idle = self.state.limits.stream_idle;
        loop {
            if *shutdown.borrow() {
                let r = Refusal::new(
                    Reason::ShuttingDown,
                    "the verifier is shutting down; resume elsewhere or later",
                );
                return self.refuse(&tx, &bound, r).await;
            }
            let next = tokio::select! {
                _ = shutdown.changed() => continue,
                m = tokio::time::timeout(idle, inbound.message()) => m,
            };
            let m = match next {
                Ok(Ok(Some(m))) => m,
                Ok(Ok(None)) => return, // device half-closed; the session stays for resume
                Ok(Err(st)) => {
                    if let Some(r) = inbound_refusal(&st) {
                        self.refuse(&tx, &bound, r).await;
                    }
                    return; // other transport errors: the peer is gone
                }
                Err(_) => {
                    let r = Refusal::new(
                        Reason::StreamIdle,
                        format!(
                            "no message for {} s (limits.stream_idle_secs); the session is \
                             kept: open a new stream with resume_session_id",
                            idle.as_secs()
                        ),
                    );
                    return self.refuse(&tx, &bound, r).await;
                }
            };
            let is_close = matches!(m.msg, Some(client_message::Msg::Close(_)));
            let answer = if abandonable(&m) {
                // Nothing exists yet that the device could come back to, so
                // when it goes away (its stream dropped) the prefill stops:
                // the handler is dropped, the scheduler drops the queued job
                // (`Worker::drop_abandoned`) and its pages and prefill budget
                // go back. A device that gives up on an Open under load
                // otherwise leaves a whole-context prefill in everyone's way.
                tokio::select! {
                    a = self.handle(&who, &mut bound, m) => a,
                    () = tx.closed() => {
                        tracing::debug!("the device left before its session was opened");
                        return;
                    }
                }
            } else {
                // Rounds, resumes and continuations run to the end even if the
                // device left: the session they hold is checked back in, so
                // that the device's resume reuses it.
                self.handle(&who, &mut bound, m).await
            };
            match answer {
                Ok(out) => {
                    if tx.send(Ok(out)).await.is_err() || is_close {
                        return;
                    }
                }
                Err(r) => return self.refuse(&tx, &bound, r).await,
            }
        }
    }
}

#[tonic::async_trait]
impl Verifier for VerifierService {
    type SessionStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<ServerMessage, Status>> + Send + 'static>>;

    async fn session(
        &self,
        req: Request<Streaming<ClientMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        // Set by the Auth interceptor; a service mounted without it refuses.
        let Some(Identity(who)) = req.extensions().get::<Identity>().cloned() else {
            return Err(
                Refusal::new(Reason::Unauthenticated, "no authenticated identity").to_status(),
            );
        };
        let slot = match self.state.stream_slot(&who) {
            Ok(slot) => slot,
            Err(r) => {
                self.state.metrics.error(r.reason.as_str_name());
                return Err(r.to_status());
            }
        };
        let inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let span = tracing::info_span!("stream", device = %who);
        let svc = self.clone();
        tokio::spawn(
            async move {
                // The identity's stream slot lives as long as the stream.
                let _slot = slot;
                svc.run_stream(who, inbound, tx).await;
            }
            .instrument(span),
        );
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
