//! The health service on the gRPC port with its never-ending method behind
//! authentication: `grpc.health.v1.Health/Check` (unary) stays open for load
//! balancers and the devices' breaker probe, while `Health/Watch` (a stream
//! that lasts as long as the peer likes) needs a device token like the
//! verifier's own service. Without this, token-less Watch streams could hold
//! connections and stream slots forever.

use crate::auth::Auth;
use std::convert::Infallible;
use tonic::body::Body;
use tonic::codegen::{http, BoxFuture, Context, Poll, Service};
use tonic::server::NamedService;
use tonic::service::Interceptor;

/// The gRPC path of the health service's streaming method.
pub const HEALTH_WATCH: &str = "/grpc.health.v1.Health/Watch";

/// `inner` (a health service) with [`HEALTH_WATCH`] authenticated by `auth`.
#[derive(Clone)]
pub struct WatchAuth<S> {
    inner: S,
    auth: Auth,
}

impl<S> WatchAuth<S> {
    pub fn new(inner: S, auth: Auth) -> Self {
        Self { inner, auth }
    }
}

impl<S: NamedService> NamedService for WatchAuth<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for WatchAuth<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        if req.uri().path() != HEALTH_WATCH {
            return Box::pin(self.inner.call(req));
        }
        let (parts, body) = req.into_parts();
        let probe = tonic::Request::from_http(http::Request::from_parts(parts.clone(), ()));
        match self.auth.call(probe) {
            Ok(_) => Box::pin(self.inner.call(http::Request::from_parts(parts, body))),
            Err(status) => Box::pin(async move { Ok(status.into_http()) }),
        }
    }
}
