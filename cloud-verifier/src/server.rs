//! Starting the verifier: model load, gRPC (TLS or loopback plain text), health,
//! reflection, the admin HTTP port, and graceful shutdown.

use crate::admin::{self, AdminState, Phase};
use crate::admission::{Admission, AdmissionLimits};
use crate::auth::Auth;
use crate::config::VerifierConfig;
use crate::connections;
use crate::metrics::Metrics;
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::service::VerifierService;
use crate::state::{ServiceLimits, VerifierState};
use crate::store::{SessionStore, StoreLimits};
use crate::watch_auth::WatchAuth;
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tandem_model::kv_pages::KvPool;
use tandem_model::tokenizer::Tokenizer;
use tandem_model::transformer::{LoadOptions, Model};
use tandem_proto::v1::verifier_server::VerifierServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::service::interceptor::InterceptedService;
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
    #[error("starting the scheduler thread: {0}")]
    Scheduler(std::io::Error),
}

/// The tokenizer fingerprint of a model: its GGUF tokenizer's, or (tiny test
/// models without tokenizer metadata) `shape:` + sha256 of the model's shape.
pub fn model_fingerprint(model: &Model) -> String {
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
    admin: AdminState,
    admin_stop: watch::Sender<bool>,
    drain_timeout: Duration,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), ServeError>>,
}

impl RunningVerifier {
    /// Starts a graceful shutdown (a drain): `/readyz` turns 503 "draining",
    /// the listener stops accepting, open streams get SHUTTING_DOWN after
    /// their in-flight round (the devices re-open elsewhere with their
    /// context); then waits for the server to stop, at most
    /// `limits.drain_timeout_secs` (then the remaining connections are closed).
    pub async fn shutdown(self) -> Result<(), ServeError> {
        self.admin.set_phase(Phase::Draining);
        let _ = self.shutdown.send(true);
        let mut task = self.task;
        let r = match tokio::time::timeout(self.drain_timeout, &mut task).await {
            Ok(r) => r.map_err(|e| ServeError::Join(e.to_string())),
            Err(_) => {
                tracing::warn!(
                    secs = self.drain_timeout.as_secs(),
                    "drain deadline passed (limits.drain_timeout_secs); closing the rest"
                );
                task.abort();
                Ok(Ok(()))
            }
        };
        let _ = self.admin_stop.send(true);
        r?
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
    let devices = cfg.device_credentials()?;
    let metrics_token = cfg.metrics_token()?;
    let handshake_timeout = Duration::from_secs(cfg.limits.handshake_timeout_secs);
    let tls = match &cfg.tls {
        Some(t) => {
            let mut tc = ServerTlsConfig::new()
                .identity(Identity::from_pem(read(&t.cert_pem)?, read(&t.key_pem)?))
                .timeout(handshake_timeout);
            if let Some(ca) = &t.client_ca_pem {
                tc = tc.client_ca_root(Certificate::from_pem(read(ca)?));
            }
            Some(tc)
        }
        None => None,
    };
    let (stop_tx, stop_rx) = watch::channel(false);

    // Admin first, so /readyz can say "loading".
    let admin_listener = TcpListener::bind(cfg.admin_listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: cfg.admin_listen,
            source,
        })?;
    let admin_addr = admin_listener.local_addr().map_err(ServeError::Admin)?;
    let admin_state = AdminState::with_metrics_token(metrics_token.as_deref());
    let admin = admin::router(admin_state.clone());
    // The admin port outlives the gRPC server's drain (so /readyz says
    // "draining" meanwhile); it stops when the drain is over.
    let (admin_stop_tx, mut admin_stop) = watch::channel(false);
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
        Model::load(&p, LoadOptions::with_max_seq_len(max_seq_len))
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
        max_sessions_per_identity: l.max_sessions_per_identity,
        max_bytes_per_identity: l.max_bytes_per_identity,
    });
    let mc = model.config();
    let pool = KvPool::new(
        mc.n_layer,
        mc.n_kv_head,
        mc.head_dim,
        l.session_budget_bytes,
    );
    let model = Arc::new(model);
    let metrics = Arc::new(Metrics::default());
    let b = &cfg.batching;
    let scheduler = Scheduler::start(
        model.clone(),
        SchedulerConfig {
            enabled: b.enabled,
            max_batch_rows: b.max_batch_rows,
            prefill_chunk: b.prefill_chunk,
            gather_window: Duration::from_micros(b.gather_window_us),
        },
        metrics.clone(),
    )
    .map_err(ServeError::Scheduler)?;
    let admission = Admission::new(AdmissionLimits {
        rate_per_sec: l.rate_per_sec,
        rate_burst: l.rate_burst,
        prefill_tokens_per_sec: l.prefill_tokens_per_sec,
        prefill_burst_tokens: l.prefill_burst_tokens,
        max_inflight_prefill_tokens: l.max_inflight_prefill_tokens,
        max_inflight_prefill_tokens_per_identity: l.max_inflight_prefill_tokens_per_identity,
        prefill_wait: Duration::from_secs(l.prefill_wait_secs),
    });
    let state = Arc::new(VerifierState {
        model,
        model_id: cfg.model_id.clone(),
        fingerprint,
        limits: ServiceLimits {
            max_prompt_tokens: l.max_prompt_tokens,
            max_block: l.max_block,
            stream_idle: Duration::from_secs(l.stream_idle_secs),
            max_streams_per_identity: l.max_streams_per_identity,
            max_inflight_opens_per_identity: l.max_inflight_opens_per_identity,
        },
        store: Mutex::new(store),
        pool,
        scheduler,
        admission,
        metrics: metrics.clone(),
        max_seq_len: cfg.max_seq_len,
        shutdown: stop_rx.clone(),
        in_flight: Mutex::default(),
        open_gate: Mutex::new(()),
        grammar_vocab: tokio::sync::OnceCell::new(),
    });
    admin_state.set_verifier(state.clone());

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
    let reflection = if cfg.reflection {
        Some(
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(tandem_proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                .build_v1()
                .map_err(|e| ServeError::Reflection(e.to_string()))?,
        )
    } else {
        None
    };
    let svc = VerifierServer::new(VerifierService {
        state: state.clone(),
    })
    .max_decoding_message_size(l.max_message_bytes)
    .max_encoding_message_size(l.max_message_bytes);
    let bind_client_identity = cfg.tls.as_ref().is_some_and(|t| t.bind_client_identity);
    let auth = Auth::new(&devices, bind_client_identity, metrics.clone());
    let svc = InterceptedService::new(svc, auth.clone());
    // Reflection and the health stream answer only devices (Health/Check
    // stays open for load balancers and probes).
    let reflection = reflection.map(|r| InterceptedService::new(r, auth.clone()));
    let health_svc = WatchAuth::new(health_svc, auth);
    let mut builder = Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(l.keepalive_interval_secs)))
        .http2_keepalive_timeout(Some(Duration::from_secs(l.keepalive_timeout_secs)))
        .max_connection_age(Duration::from_secs(l.max_connection_age_secs))
        .max_connection_age_grace(Duration::from_secs(l.max_connection_age_grace_secs))
        .max_concurrent_streams(Some(l.max_streams_per_connection));
    if let Some(tc) = tls {
        builder = builder.tls_config(tc)?;
    }
    let router = builder
        .add_service(health_svc)
        .add_optional_service(reflection)
        .add_service(svc);
    let mut grpc_stop = stop_rx.clone();
    let h2 = health.clone();
    let incoming = connections::capped(
        listener,
        connections::ConnLimits {
            max: l.max_connections,
            per_peer: l.max_connections_per_peer,
            first_byte: handshake_timeout,
        },
        metrics,
    );
    let task = tokio::spawn(async move {
        router
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = grpc_stop.wait_for(|s| *s).await;
                h2.set_service_status(
                    tandem_proto::VERIFIER_SERVICE_NAME,
                    tonic_health::ServingStatus::NotServing,
                )
                .await;
            })
            .await
            .map_err(ServeError::from)
    });
    admin_state.set_phase(Phase::Ready);
    tracing::info!(%grpc_addr, %admin_addr, "verifier serving");
    Ok(RunningVerifier {
        grpc_addr,
        admin_addr,
        state,
        admin: admin_state,
        admin_stop: admin_stop_tx,
        drain_timeout: Duration::from_secs(cfg.limits.drain_timeout_secs),
        shutdown: stop_tx,
        task,
    })
}
