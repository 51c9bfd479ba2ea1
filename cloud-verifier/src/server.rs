//! Starting the verifier: model load, gRPC (TLS or loopback plain text), health,
//! reflection, the admin HTTP port, and graceful shutdown.

use crate::config::VerifierConfig;
use crate::service::{ServiceLimits, VerifierService, VerifierState};
use crate::store::{SessionStore, StoreLimits};
use axum::http::StatusCode;
use axum::routing::get;
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tandem_model::qwen2::{LoadOptions, Qwen2Model};
use tandem_model::tokenizer::Tokenizer;
use tandem_proto::v1::verifier_server::VerifierServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::StreamExt;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};

/// Why the verifier could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("target model {path}: {source}")]
    Model {
        path: PathBuf,
        source: tandem_model::ModelError,
    },
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("reflection service: {0}")]
    Reflection(String),
    #[error("admin server: {0}")]
    Admin(std::io::Error),
    #[error("model loading task failed: {0}")]
    Join(String),
}

/// The tokenizer fingerprint of a model: its GGUF tokenizer's, or (tiny test
/// models without tokenizer metadata) `shape:` + sha256 of the model's shape.
pub fn model_fingerprint(model: &Qwen2Model) -> String {
    match Tokenizer::from_gguf(model.gguf()) {
        Ok(t) => t.fingerprint(),
        Err(_) => {
            let h = Sha256::digest(format!("{:?}", model.config()).as_bytes());
            let hex: String = h.iter().map(|b| format!("{b:02x}")).collect();
            format!("shape:{hex}")
        }
    }
}

/// A running verifier (addresses are the bound ones, so port 0 works).
pub struct RunningVerifier {
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub state: Arc<VerifierState>,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), ServeError>>,
}

impl RunningVerifier {
    /// Starts graceful shutdown: no new streams; open streams get SHUTTING_DOWN after
    /// their in-flight verify; then waits for the server to stop.
    pub async fn shutdown(self) -> Result<(), ServeError> {
        let _ = self.shutdown.send(true);
        self.task
            .await
            .map_err(|e| ServeError::Join(e.to_string()))?
    }

    /// Waits for the server to stop (after `trigger` resolves).
    pub async fn run_until(
        self,
        trigger: impl std::future::Future<Output = ()>,
    ) -> Result<(), ServeError> {
        trigger.await;
        tracing::info!("shutting down");
        self.shutdown().await
    }
}

fn read(path: &PathBuf) -> Result<Vec<u8>, ServeError> {
    std::fs::read(path).map_err(|source| ServeError::Read {
        path: path.clone(),
        source,
    })
}

/// Loads the model and starts the gRPC and admin servers.
pub async fn start(cfg: VerifierConfig) -> Result<RunningVerifier, ServeError> {
    cfg.validate()?;
    let devices = cfg.device_tokens()?;
    let tls = match &cfg.tls {
        Some(t) => {
            let mut tc = ServerTlsConfig::new()
                .identity(Identity::from_pem(read(&t.cert_pem)?, read(&t.key_pem)?));
            if let Some(ca) = &t.client_ca_pem {
                tc = tc.client_ca_root(Certificate::from_pem(read(ca)?));
            }
            Some(tc)
        }
        None => None,
    };
    let ready = Arc::new(AtomicBool::new(false));
    let (stop_tx, stop_rx) = watch::channel(false);
    // The admin port outlives the drain: /readyz answers 503 from the start of a
    // shutdown until the gRPC server has stopped (a load balancer's or
    // Kubernetes' readiness check sees the replica leave), then it stops too.
    let (admin_stop_tx, mut admin_stop) = watch::channel(false);

    // Admin first, so /readyz can say "loading".
    let admin_listener = TcpListener::bind(cfg.admin_listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: cfg.admin_listen,
            source,
        })?;
    let admin_addr = admin_listener.local_addr().map_err(ServeError::Admin)?;
    let state_cell: Arc<std::sync::OnceLock<Arc<VerifierState>>> =
        Arc::new(std::sync::OnceLock::new());
    let admin = {
        let ready = ready.clone();
        let draining = stop_rx.clone();
        let cell2 = state_cell.clone();
        axum::Router::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .route(
                "/readyz",
                get(move || {
                    let r = ready.load(Ordering::SeqCst);
                    let d = *draining.borrow();
                    async move {
                        if r && !d {
                            (StatusCode::OK, "ready\n")
                        } else if d {
                            (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
                        } else {
                            (StatusCode::SERVICE_UNAVAILABLE, "loading model\n")
                        }
                    }
                }),
            )
            .route(
                "/metrics",
                get(move || {
                    let body = cell2.get().map(|s| s.render_metrics()).unwrap_or_default();
                    async move { ([("content-type", "text/plain; version=0.0.4")], body) }
                }),
            )
    };
    tokio::spawn(async move {
        let r = axum::serve(admin_listener, admin)
            .with_graceful_shutdown(async move {
                let _ = admin_stop.wait_for(|s| *s).await;
            })
            .await;
        if let Err(e) = r {
            tracing::error!("admin server: {e}");
        }
    });

    let path = cfg
        .model_path
        .clone()
        .unwrap_or_else(|| tandem_fetch::model_path(tandem_fetch::ModelRole::Target));
    let max_seq_len = cfg.max_seq_len;
    let p = path.clone();
    let model = tokio::task::spawn_blocking(move || {
        Qwen2Model::load(&p, LoadOptions::with_max_seq_len(max_seq_len))
    })
    .await
    .map_err(|e| ServeError::Join(e.to_string()))?
    .map_err(|source| ServeError::Model { path, source })?;
    let fingerprint = cfg
        .tokenizer_fingerprint
        .clone()
        .unwrap_or_else(|| model_fingerprint(&model));
    let l = &cfg.limits;
    let store = SessionStore::new(StoreLimits {
        max_sessions: l.max_sessions,
        budget_bytes: l.session_budget_bytes,
        idle_ttl: Duration::from_secs(l.idle_ttl_secs),
    });
    let state = Arc::new(VerifierState::new(
        Arc::new(model),
        cfg.model_id.clone(),
        fingerprint,
        ServiceLimits {
            max_prompt_tokens: l.max_prompt_tokens,
            max_block: l.max_block,
            rate_per_sec: l.rate_per_sec,
            rate_burst: l.rate_burst,
        },
        store,
        &devices,
        stop_rx.clone(),
    ));
    let _ = state_cell.set(state.clone());

    let listener = TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: cfg.listen,
            source,
        })?;
    let grpc_addr = listener.local_addr().map_err(|source| ServeError::Bind {
        addr: cfg.listen,
        source,
    })?;

    let (health, health_svc) = tonic_health::server::health_reporter();
    health
        .set_service_status(
            tandem_proto::VERIFIER_SERVICE_NAME,
            tonic_health::ServingStatus::Serving,
        )
        .await;
    health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tandem_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    let svc = VerifierServer::new(VerifierService {
        state: state.clone(),
    })
    .max_decoding_message_size(l.max_message_bytes)
    .max_encoding_message_size(l.max_message_bytes);
    let mut builder = Server::builder();
    if let Some(tc) = tls {
        builder = builder.tls_config(tc)?;
    }
    let router = builder
        .add_service(health_svc)
        .add_service(reflection)
        .add_service(svc);
    let mut grpc_stop = stop_rx.clone();
    let h2 = health.clone();
    let ready2 = ready.clone();
    // `Server::tcp_nodelay` only applies to listeners tonic binds itself; with
    // our own listener, Nagle stays on unless set here, and a verdict (a small
    // write after the previous one is still unacknowledged) then waits for the
    // peer's delayed ACK — tens of ms per round (docs/verifier.md, pitfalls).
    let incoming = TcpListenerStream::new(listener).map(|conn| {
        if let Ok(stream) = &conn {
            if let Err(e) = stream.set_nodelay(true) {
                tracing::warn!("TCP_NODELAY on an accepted connection: {e}");
            }
        }
        conn
    });
    let task = tokio::spawn(async move {
        let r = router
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = grpc_stop.wait_for(|s| *s).await;
                ready2.store(false, Ordering::SeqCst);
                h2.set_service_status(
                    tandem_proto::VERIFIER_SERVICE_NAME,
                    tonic_health::ServingStatus::NotServing,
                )
                .await;
            })
            .await
            .map_err(ServeError::from);
        let _ = admin_stop_tx.send(true);
        r
    });
    ready.store(true, Ordering::SeqCst);
    tracing::info!(%grpc_addr, %admin_addr, "verifier serving");
    Ok(RunningVerifier {
        grpc_addr,
        admin_addr,
        state,
        shutdown: stop_tx,
        task,
    })
}
