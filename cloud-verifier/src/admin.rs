//! The admin HTTP port as an axum `Router` with `State`: `/healthz` (the
//! process is up), `/readyz` (200 once the model is loaded and until a drain
//! starts; 503 "loading model" / "draining" otherwise, so a load balancer or
//! Kubernetes stops routing new streams here), `/metrics` (Prometheus text;
//! behind a bearer token when `metrics_token` is configured, since session
//! counts and refusal reasons tell an outsider about the fleet).

use crate::state::VerifierState;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use tandem_proto::bearer::TokenDigest;

/// Where the verifier is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Loading = 0,
    Ready = 1,
    Draining = 2,
}

/// What the admin routes read.
#[derive(Clone, Default)]
pub struct AdminState {
    phase: Arc<AtomicU8>,
    verifier: Arc<OnceLock<Arc<VerifierState>>>,
    metrics_token: Option<TokenDigest>,
}

impl AdminState {
    /// An admin state whose `/metrics` needs `Authorization: Bearer <token>`.
    pub fn with_metrics_token(token: Option<&str>) -> Self {
        Self {
            metrics_token: token.map(TokenDigest::of),
            ..Self::default()
        }
    }

    pub fn set_phase(&self, p: Phase) {
        self.phase.store(p as u8, Ordering::SeqCst);
    }

    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::SeqCst) {
            0 => Phase::Loading,
            1 => Phase::Ready,
            _ => Phase::Draining,
        }
    }

    /// Hands the loaded verifier to `/metrics`.
    pub fn set_verifier(&self, v: Arc<VerifierState>) {
        let _ = self.verifier.set(v);
    }
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(s): State<AdminState>) -> (StatusCode, &'static str) {
    match s.phase() {
        Phase::Ready => (StatusCode::OK, "ready\n"),
        Phase::Loading => (StatusCode::SERVICE_UNAVAILABLE, "loading model\n"),
        Phase::Draining => (StatusCode::SERVICE_UNAVAILABLE, "draining\n"),
    }
}

async fn metrics(State(s): State<AdminState>, headers: HeaderMap) -> Response {
    if let Some(want) = &s.metrics_token {
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(tandem_proto::bearer::token);
        if !presented.is_some_and(|t| want.matches(t)) {
            return (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                "/metrics needs Authorization: Bearer <metrics_token>\n",
            )
                .into_response();
        }
    }
    let body = s
        .verifier
        .get()
        .map(|v| v.render_metrics())
        .unwrap_or_default();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}
