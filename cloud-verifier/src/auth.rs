//! Authentication as a tonic interceptor: the bearer token names a device
//! identity, which goes into the request's extensions for the handlers
//! ([`Identity`]). Tokens are kept as SHA-256 digests and compared in
//! constant time against every configured one, with no early exit
//! ([`tandem_proto::bearer`]: independent of the presented token's length).
//!
//! With `[tls] bind_client_identity = true` the interceptor also requires the
//! mutual-TLS client certificate to be valid for the device the token names
//! (its `cert_name`, default its id, as a DNS subject name), so a stolen token
//! is useless without that device's key, and one device's certificate cannot
//! carry another device's token.

use crate::error::Refusal;
use crate::metrics::Metrics;
use std::sync::Arc;
use tandem_proto::bearer::TokenDigest;
use tandem_proto::v1::Reason;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// The authenticated device identity of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity(pub Arc<str>);

/// One device's credentials, as the config resolves them.
#[derive(Debug, Clone)]
pub struct DeviceCredential {
    /// The identity name.
    pub id: String,
    /// Its bearer token.
    pub token: String,
    /// The DNS name its client certificate must be valid for when client
    /// identities are bound (default: `id`).
    pub cert_name: String,
}

struct Device {
    id: Arc<str>,
    token: TokenDigest,
    cert_name: String,
}

/// The interceptor: the configured devices, and whether a request's client
/// certificate must match the device its token names.
#[derive(Clone)]
pub struct Auth {
    devices: Arc<Vec<Device>>,
    bind_client_identity: bool,
    metrics: Arc<Metrics>,
}

impl Auth {
    pub fn new(
        devices: &[DeviceCredential],
        bind_client_identity: bool,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            devices: Arc::new(
                devices
                    .iter()
                    .map(|d| Device {
                        id: Arc::from(d.id.as_str()),
                        token: TokenDigest::of(&d.token),
                        cert_name: d.cert_name.clone(),
                    })
                    .collect(),
            ),
            bind_client_identity,
            metrics,
        }
    }

    /// The identity whose token `meta` carries; with bound client
    /// identities, only if `peer_certs` (the TLS client chain, leaf first) is
    /// valid for that device's name.
    pub fn identify(
        &self,
        meta: &tonic::metadata::MetadataMap,
        peer_certs: Option<&[rustls_pki_types::CertificateDer<'static>]>,
    ) -> Result<Identity, Refusal> {
        let tok = meta
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(tandem_proto::bearer::token)
            .ok_or_else(|| Refusal::new(Reason::Unauthenticated, "missing bearer token"))?;
        let mut found = None;
        for d in self.devices.iter() {
            if d.token.matches(tok) {
                found = Some(d);
            }
        }
        let d =
            found.ok_or_else(|| Refusal::new(Reason::Unauthenticated, "unknown bearer token"))?;
        if self.bind_client_identity {
            check_client_certificate(peer_certs, &d.id, &d.cert_name)?;
        }
        Ok(Identity(d.id.clone()))
    }
}

/// Whether the client's leaf certificate is valid for `cert_name` (a DNS
/// subject alternative name). The chain itself was verified against
/// `client_ca_pem` during the handshake.
fn check_client_certificate(
    peer_certs: Option<&[rustls_pki_types::CertificateDer<'static>]>,
    device: &str,
    cert_name: &str,
) -> Result<(), Refusal> {
    let refuse = |why: String| Refusal::new(Reason::Unauthenticated, why);
    let leaf = peer_certs.and_then(|c| c.first()).ok_or_else(|| {
        refuse(format!(
            "device {device:?}: no client certificate (bind_client_identity requires one)"
        ))
    })?;
    let cert = webpki::EndEntityCert::try_from(leaf).map_err(|e| {
        refuse(format!(
            "device {device:?}: unreadable client certificate: {e}"
        ))
    })?;
    let name = rustls_pki_types::ServerName::try_from(cert_name)
        .map_err(|e| refuse(format!("device {device:?}: cert_name {cert_name:?}: {e}")))?;
    cert.verify_is_valid_for_subject_name(&name).map_err(|_| {
        refuse(format!(
            "device {device:?}: the client certificate is not issued to {cert_name:?}"
        ))
    })
}

impl Interceptor for Auth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let certs = req.peer_certs();
        match self.identify(req.metadata(), certs.as_deref().map(Vec::as_slice)) {
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
