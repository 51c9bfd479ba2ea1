//! Errors of the OpenAI-compatible server: [`ApiError`] is what a client sees
//! (OpenAI's `{"error": {message, type, param, code}}` with an HTTP status);
//! [`ServeError`] is why the server could not start.

use std::net::SocketAddr;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

use crate::admin::AdminError;
use tandem_edge::EdgeError;

/// Why [`super::start`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("serve config: {0}")]
    Config(String),
    /// The reason is the error's source (anyhow's `{:#}` prints it once).
    #[error("binding {addr}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error("starting the generation worker: {0}")]
    Worker(std::io::Error),
}

/// An error answer in OpenAI's shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `requests` (429),
    /// `server_error`.
    pub kind: &'static str,
    /// The request parameter at fault, if any.
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    /// 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// 413 `request_too_large`: the request is over one of the server's
    /// size limits (`message` names it).
    pub fn too_large(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: Some("request_too_large"),
        }
    }

    /// 400 for a parameter this server does not implement.
    pub fn unsupported(param: &str, what: &str) -> Self {
        Self {
            code: Some("unsupported_parameter"),
            ..Self::invalid(
                format!("`{param}`: {what} is not supported by this server"),
                Some(param),
            )
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// 404 `model_not_found` (the `openai` client raises `NotFoundError`).
    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "The model `{model}` does not exist (GET /v1/models lists the served model)"
            ),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// 429: the queue is full.
    pub fn queue_full(depth: usize) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!(
                "the generation queue is full ({depth} waiting requests); retry later"
            ),
            kind: "requests",
            param: None,
            code: Some("rate_limit_exceeded"),
        }
    }

    pub fn server(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// A request axum refused before our handler saw it (body over the size
    /// limit: 413 `request_too_large`; unreadable body or path), in OpenAI's
    /// shape instead of axum's plain text.
    pub fn rejected(status: StatusCode, message: String) -> Self {
        Self {
            status,
            message,
            kind: if status.is_server_error() {
                "server_error"
            } else {
                "invalid_request_error"
            },
            param: None,
            code: (status == StatusCode::PAYLOAD_TOO_LARGE).then_some("request_too_large"),
        }
    }

    /// 401 `invalid_api_key` (the `openai` client raises
    /// `AuthenticationError`), with `WWW-Authenticate: Bearer`.
    pub fn invalid_api_key() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: "missing or incorrect API key: send `Authorization: Bearer <key>` with the \
                      key the server was started with"
                .into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 403: a request from a `Host` or browser `Origin` the server does not
    /// answer to (DNS rebinding, cross-site requests).
    pub fn forbidden(message: String, code: &'static str) -> Self {
        Self {
            status: StatusCode::FORBIDDEN,
            message,
            kind: "invalid_request_error",
            param: None,
            code: Some(code),
        }
    }

    /// 415: a `/v1` POST whose body is not declared `application/json`.
    pub fn unsupported_media_type(got: Option<&str>) -> Self {
        Self {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            message: format!(
                "Content-Type must be application/json, got {}",
                got.map_or("none".to_string(), |g| format!("{g:?}"))
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("unsupported_media_type"),
        }
    }

    pub fn not_found_route(method: &str, path: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("no route {method} {path}"),
            kind: "invalid_request_error",
            param: None,
            code: Some("unknown_url"),
        }
    }

    /// The JSON body (also the payload of an SSE error event).
    pub fn body(&self) -> serde_json::Value {
        serde_json::to_value(Body {
            error: Inner {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        })
        .unwrap_or_default()
    }
}

impl From<EdgeError> for ApiError {
    fn from(e: EdgeError) -> Self {
        use tandem_model::ModelError;
        match &e {
            EdgeError::Model(ModelError::SequenceTooLong { .. }) => {
                Self::invalid(e.to_string(), Some("messages")).with_code("context_length_exceeded")
            }
            EdgeError::Model(ModelError::InvalidArgument(m)) => Self::invalid(m.clone(), None),
            EdgeError::Refused { reason, .. } if reason == "PROMPT_TOO_LONG" => {
                Self::invalid(e.to_string(), Some("messages")).with_code("context_length_exceeded")
            }
            EdgeError::Refused { .. } | EdgeError::Tls(_) | EdgeError::Protocol(_) => Self {
                status: StatusCode::BAD_GATEWAY,
                message: e.to_string(),
                kind: "server_error",
                param: None,
                code: Some("verifier_error"),
            },
            _ => Self::server(e.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}
