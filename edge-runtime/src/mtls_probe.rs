//! Tells "the verifier demands a client certificate we do not have" apart from
//! "the verifier is unreachable".
//!
//! With TLS 1.3 the client finishes its side of the handshake before the
//! server checks the client's (empty) certificate, so a verifier that requires
//! mutual TLS rejects the connection *after* tonic considers it established.
//! Whether the client then reads the server's `certificate_required` alert or
//! only a connection reset is a race; a reset looks like an outage, and the
//! runtime would wrongly go provisional instead of failing with a TLS error.
//! When a session fails to open as "unavailable" and no client identity is
//! configured, [`MtlsProbe`] runs one handshake of its own with a certificate
//! resolver that records whether the server asked for a certificate — a fact
//! of the handshake, not of timing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rustls::client::ResolvesClientCert;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, SignatureScheme};

/// Records whether the server requested a client certificate; offers none.
#[derive(Debug, Default)]
struct Recorder(AtomicBool);

impl ResolvesClientCert for Recorder {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        self.0.store(true, Ordering::SeqCst);
        None
    }

    fn has_certs(&self) -> bool {
        // Must be true for rustls to call `resolve` at all.
        true
    }
}

/// One verifier address and the trust roots the edge uses for it.
#[derive(Clone, Debug)]
pub(crate) struct MtlsProbe {
    roots: Arc<RootCertStore>,
    server_name: ServerName<'static>,
    addr: String,
}

impl MtlsProbe {
    /// `None` when the URL has no host or the CA PEM holds no usable
    /// certificate (the normal TLS path reports those).
    pub(crate) fn new(url: &str, ca_pem: &[u8], tls_domain: Option<&str>) -> Option<Self> {
        let uri: tonic::codegen::http::Uri = url.parse().ok()?;
        let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
        let port = uri.port_u16().unwrap_or(443);
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem) {
            roots.add(cert.ok()?).ok()?;
        }
        let name = tls_domain.unwrap_or(host).to_owned();
        Some(Self {
            roots: Arc::new(roots),
            server_name: ServerName::try_from(name).ok()?,
            addr: if host.contains(':') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            },
        })
    }

    /// True when a TLS handshake with the verifier shows that it asks for a
    /// client certificate. False on any failure to find out (unreachable,
    /// untrusted, timeout): the caller keeps its original classification.
    pub(crate) async fn server_requires_client_cert(&self, timeout: Duration) -> bool {
        let recorder = Arc::new(Recorder::default());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let Ok(builder) =
            ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions()
        else {
            return false;
        };
        let mut config = builder
            .with_root_certificates(self.roots.clone())
            .with_client_cert_resolver(recorder.clone());
        config.alpn_protocols = vec![b"h2".to_vec()];
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let attempt = async {
            let tcp = tokio::net::TcpStream::connect(&self.addr).await.ok()?;
            // The outcome does not matter: the resolver has run (or not) by
            // the time the client's half of the handshake is done or failed.
            let _ = connector.connect(self.server_name.clone(), tcp).await;
            Some(())
        };
        let _ = tokio::time::timeout(timeout, attempt).await;
        recorder.0.load(Ordering::SeqCst)
    }
}
