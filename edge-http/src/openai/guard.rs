//! Who may call the local OpenAI server: checks that run as axum middleware
//! before any handler, because the server listens on a port every web page
//! the user opens can reach.
//!
//! * [`host_and_origin`] (every route): the `Host` header must name this
//!   machine's loopback interface (`127.0.0.1`, `localhost`, `[::1]`, any
//!   port; [`tandem_edge::loopback`]) or a name the operator allowed
//!   ([`ServeConfig::allowed_hosts`]); otherwise 403 `host_not_allowed`. This
//!   defeats DNS rebinding: a page on `evil.example` whose name is re-pointed
//!   at 127.0.0.1 sends `Host: evil.example`. A browser `Origin` header must
//!   be a loopback origin or one the operator allowed
//!   ([`ServeConfig::allowed_origins`]); otherwise 403 `origin_not_allowed`
//!   (a cross-site page). Requests without `Origin` (curl, SDKs) pass. Allowed
//!   origins get CORS headers and an answer to their preflight.
//! * [`v1_request`] (the `/v1` routes): the API key, when one is configured
//!   (`Authorization: Bearer <key>`, as OpenAI clients send it; 401
//!   `invalid_api_key`), and `Content-Type: application/json` on POSTs (415).
//!   Without that a page could POST `text/plain`, which browsers send
//!   cross-site without a CORS preflight.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::{ApiError, ServeError};
use super::ServeConfig;
use crate::bearer;
use tandem_edge::loopback;

/// The checked, normalised access settings of a [`ServeConfig`].
#[derive(Debug)]
pub(crate) struct Access {
    /// Extra `Host` names, lower case, no port.
    hosts: Vec<String>,
    /// Extra origins, `scheme://host[:port]`, lower case.
    origins: Vec<String>,
    api_key: Option<String>,
}

/// `scheme://host[:port]` of an `Origin` value or an operator's entry, lower
/// case; `None` unless it is an http(s) origin without a path.
fn normalised_origin(origin: &str) -> Option<String> {
    let uri: Uri = origin.parse().ok()?;
    let scheme = uri.scheme_str()?.to_ascii_lowercase();
    let authority = uri.authority()?;
    let path_ok = matches!(uri.path(), "" | "/") && uri.query().is_none();
    ((scheme == "http" || scheme == "https") && path_ok)
        .then(|| format!("{scheme}://{authority}").to_ascii_lowercase())
}

impl Access {
    /// Checks `cfg.allowed_hosts`, `allowed_origins` and `api_key`; the error
    /// names the setting.
    pub(crate) fn new(cfg: &ServeConfig) -> Result<Self, ServeError> {
        let bad = |m: String| Err(ServeError::Config(m));
        let mut hosts = Vec::new();
        for h in &cfg.allowed_hosts {
            match loopback::authority_host(h) {
                Some(host) if !host.is_empty() => hosts.push(host.to_ascii_lowercase()),
                _ => return bad(format!("allowed_hosts: {h:?} is not a host name")),
            }
        }
        let mut origins = Vec::new();
        for o in &cfg.allowed_origins {
            match normalised_origin(o) {
                Some(n) => origins.push(n),
                None => {
                    return bad(format!(
                        "allowed_origins: {o:?} is not an origin (scheme://host[:port], http or https, no path)"
                    ))
                }
            }
        }
        if let Some(k) = &cfg.api_key {
            if k.chars().count() < 16 {
                return bad("api_key must be at least 16 characters".into());
            }
        }
        Ok(Self {
            hosts,
            origins,
            api_key: cfg.api_key.clone(),
        })
    }

    fn host_allowed(&self, authority: &str) -> bool {
        match loopback::authority_host(authority) {
            Some(h) => {
                loopback::is_loopback_host(&h) || self.hosts.contains(&h.to_ascii_lowercase())
            }
            None => false,
        }
    }

    fn origin_allowed(&self, origin: &str) -> bool {
        match normalised_origin(origin) {
            Some(n) => {
                loopback::url_host(&n).is_some_and(|h| loopback::is_loopback_host(&h))
                    || self.origins.contains(&n)
            }
            // `Origin: null` (sandboxed frames, file:// pages) and garbage.
            None => false,
        }
    }
}

/// The `Host` a request names: the header (HTTP/1.1), else the URI's
/// authority (HTTP/2's `:authority`).
fn requested_host(req: &Request<Body>) -> Option<String> {
    match req.headers().get(header::HOST) {
        Some(v) => v.to_str().ok().map(str::to_string),
        None => req.uri().authority().map(|a| a.to_string()),
    }
}

/// Middleware on every route: `Host` allow-list, `Origin` check, CORS.
pub(crate) async fn host_and_origin(
    State(access): State<Arc<Access>>,
    req: Request<Body>,
    next: Next,
) -> Response {
    let host = requested_host(&req);
    if !host.as_deref().is_some_and(|h| access.host_allowed(h)) {
        let shown = host.as_deref().unwrap_or("none");
        return ApiError::forbidden(
            format!(
                "Host {shown:?} is not served here: use 127.0.0.1, localhost or [::1], or start the \
                 server with this name allowed (--allow-host)"
            ),
            "host_not_allowed",
        )
        .into_response();
    }
    let origin = match req.headers().get(header::ORIGIN) {
        None => return next.run(req).await,
        Some(v) => v.clone(),
    };
    let text = origin.to_str().unwrap_or("");
    if !access.origin_allowed(text) {
        return ApiError::forbidden(
            format!(
                "Origin {text:?} may not call this server: only loopback origins and those \
                 started with --allow-origin may"
            ),
            "origin_not_allowed",
        )
        .into_response();
    }
    let preflight = req.method() == Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut r = if preflight {
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type"),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        r
    } else {
        next.run(req).await
    };
    let h = r.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(header::VARY, HeaderValue::from_static("Origin"));
    r
}

/// True when `content_type` is `application/json` (parameters such as
/// `charset` allowed).
fn is_json(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
}

/// The anonymous scope of a request (`super::peer`), set by [`v1_request`].
#[derive(Clone, Debug, Default)]
pub(crate) struct AnonymousScope(pub Option<String>);

/// Middleware on the `/v1` routes: API key, then `Content-Type` of POSTs;
/// then the request's [`AnonymousScope`] for the generation handlers.
pub(crate) async fn v1_request(
    State(access): State<Arc<Access>>,
    mut req: Request<Body>,
    next: Next,
) -> Response {
    if let Some(key) = &access.api_key {
        if !bearer::presented(req.headers()).is_some_and(|p| bearer::matches(p, key)) {
            return ApiError::invalid_api_key().into_response();
        }
    }
    if req.method() == Method::POST {
        let ct = req
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap_or("(not text)"));
        if !ct.is_some_and(is_json) {
            return ApiError::unsupported_media_type(ct).into_response();
        }
    }
    let addrs = req
        .extensions()
        .get::<axum::extract::ConnectInfo<super::peer::ClientAddrs>>()
        .map(|c| c.0);
    let scope = super::peer::anonymous_scope(access.api_key.is_some(), addrs);
    req.extensions_mut().insert(AnonymousScope(scope));
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(hosts: &[&str], origins: &[&str]) -> Access {
        Access::new(&ServeConfig {
            allowed_hosts: hosts.iter().map(|s| s.to_string()).collect(),
            allowed_origins: origins.iter().map(|s| s.to_string()).collect(),
            ..ServeConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn hosts_loopback_or_configured() {
        let a = access(&["Tandem.LAN"], &[]);
        for h in [
            "127.0.0.1:8080",
            "localhost",
            "LOCALHOST:1",
            "[::1]:8080",
            "tandem.lan:8080",
            "tandem.lan",
        ] {
            assert!(a.host_allowed(h), "{h}");
        }
        for h in [
            "evil.example",
            "evil.example:8080",
            "10.0.0.1:8080",
            "",
            "a b",
        ] {
            assert!(!a.host_allowed(h), "{h}");
        }
    }

    #[test]
    fn origins_loopback_or_configured() {
        let a = access(&[], &["https://App.example"]);
        for o in [
            "http://localhost:3000",
            "http://127.0.0.1:8080",
            "http://[::1]:5",
            "https://app.example",
        ] {
            assert!(a.origin_allowed(o), "{o}");
        }
        for o in [
            "http://evil.example",
            "null",
            "https://app.example.evil",
            "http://app.example",
            "file://",
            "",
        ] {
            assert!(!a.origin_allowed(o), "{o}");
        }
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        let cfg = |f: fn(&mut ServeConfig)| {
            let mut c = ServeConfig::default();
            f(&mut c);
            Access::new(&c).unwrap_err().to_string()
        };
        assert!(cfg(|c| c.allowed_origins = vec!["app.example".into()]).contains("allowed_origins"));
        assert!(
            cfg(|c| c.allowed_origins = vec!["https://a.example/x".into()])
                .contains("allowed_origins")
        );
        assert!(cfg(|c| c.allowed_hosts = vec!["a b".into()]).contains("allowed_hosts"));
        assert!(cfg(|c| c.api_key = Some("short".into())).contains("api_key"));
    }

    #[test]
    fn json_content_types() {
        assert!(is_json("application/json"));
        assert!(is_json("Application/JSON; charset=utf-8"));
        assert!(!is_json("text/plain"));
        assert!(!is_json("application/jsonx"));
        assert!(!is_json("application/x-www-form-urlencoded"));
    }
}
