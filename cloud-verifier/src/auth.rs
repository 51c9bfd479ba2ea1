//! Authentication as a tonic interceptor: the bearer token names a device
//! identity, which goes into the request's extensions for the handlers
//! ([`Identity`]). Tokens are kept as SHA-256 digests and compared in
//! constant time against every configured one (no early exit).

use crate::error::Refusal;
use crate::metrics::Metrics;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use subtle::ConstantTimeEq;
use tandem_proto::v1::Reason;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// The authenticated device identity of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity(pub Arc<str>);

/// The interceptor: configured `(identity, sha256(token))` pairs.
#[derive(Clone)]
pub struct Auth {
    devices: Arc<Vec<(Arc<str>, [u8; 32])>>,
    metrics: Arc<Metrics>,
}

impl Auth {
    pub fn new(devices: &[(String, String)], metrics: Arc<Metrics>) -> Self {
        Self {
            devices: Arc::new(
                devices
                    .iter()
                    .map(|(id, tok)| {
                        (
                            Arc::from(id.as_str()),
                            Sha256::digest(tok.as_bytes()).into(),
                        )
                    })
                    .collect(),
            ),
            metrics,
        }
    }

    /// The identity whose token `meta` carries.
    pub fn identify(&self, meta: &tonic::metadata::MetadataMap) -> Result<Identity, Refusal> {
        let tok = meta
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| Refusal::new(Reason::Unauthenticated, "missing bearer token"))?;
        let h: [u8; 32] = Sha256::digest(tok.trim().as_bytes()).into();
        let mut found = None;
        for (id, want) in self.devices.iter() {
            if bool::from(h.ct_eq(want)) {
                found = Some(id.clone());
            }
        }
        found
            .map(Identity)
            .ok_or_else(|| Refusal::new(Reason::Unauthenticated, "unknown bearer token"))
    }
}

impl Interceptor for Auth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        match self.identify(req.metadata()) {
            Ok(id) => {
                req.extensions_mut().insert(id);
                Ok(req)
            }
            Err(r) => {
                self.metrics.error(r.reason.as_str_name());
                Err(r.to_status())
            }
        }
    }
}
