//! The answers the layer gives instead of calling the inner service.

use http::{HeaderValue, Request, Response, StatusCode, header::CONTENT_TYPE};

use crate::{Decision, StoreError, key::KeyError};

/// Builds the responses for requests the inner service never sees: rate-limited ones,
/// ones without a key, and ones the store could not decide under the deny policy.
///
/// The layer adds `Retry-After` and the rate-limit fields to the rate-limited response
/// after this hook returns it, so a custom hook only chooses status, headers and body.
/// Every closure `Fn(&Request<ReqB>, &Decision) -> Response<ResB>` customises the
/// rate-limited answer and keeps the defaults for the other two.
pub trait OnRejection<ReqB, ResB>: Send + Sync + 'static {
    /// The answer to a request that a limit denied.
    fn rate_limited(&self, request: &Request<ReqB>, decision: &Decision) -> Response<ResB>;
    /// The answer to a request without a key (when missing keys are rejected).
    fn key_missing(&self, request: &Request<ReqB>, error: &KeyError) -> Response<ResB>;
    /// The answer when the store failed and the failure policy is to deny.
    fn store_failed(&self, request: &Request<ReqB>, error: &StoreError) -> Response<ResB>;
}

/// The default answers, in HTTP or gRPC depending on the request's `content-type`:
///
/// | case | HTTP | gRPC (HTTP 200, trailers-only) |
/// |---|---|---|
/// | rate limited | 429 Too Many Requests | `grpc-status: 8` RESOURCE_EXHAUSTED |
/// | no key | 400 Bad Request | `grpc-status: 3` INVALID_ARGUMENT |
/// | store failed, policy deny | 503 Service Unavailable, `Retry-After: 1` | `grpc-status: 14` UNAVAILABLE |
///
/// gRPC requests never get an HTTP 429: gRPC clients would turn it into UNAVAILABLE and
/// retry at once. The bodies are empty (`ResB::default()`).
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultRejection;

/// Whether `request` is a gRPC call (`content-type: application/grpc*`).
pub fn is_grpc<B>(request: &Request<B>) -> bool {
    request
        .headers()
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

fn grpc_answer<B: Default>(code: u8, message: &'static str) -> Response<B> {
    let mut response = Response::new(B::default());
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert("grpc-status", HeaderValue::from(u16::from(code)));
    headers.insert("grpc-message", HeaderValue::from_static(message));
    response
}

fn http_answer<B: Default>(status: StatusCode) -> Response<B> {
    let mut response = Response::new(B::default());
    *response.status_mut() = status;
    response
}

impl<ReqB, ResB: Default> OnRejection<ReqB, ResB> for DefaultRejection {
    fn rate_limited(&self, request: &Request<ReqB>, _decision: &Decision) -> Response<ResB> {
        if is_grpc(request) {
            grpc_answer(8, "rate limit exceeded")
        } else {
            http_answer(StatusCode::TOO_MANY_REQUESTS)
        }
    }

    fn key_missing(&self, request: &Request<ReqB>, _error: &KeyError) -> Response<ResB> {
        if is_grpc(request) {
            grpc_answer(3, "missing rate limit key")
        } else {
            http_answer(StatusCode::BAD_REQUEST)
        }
    }

    fn store_failed(&self, request: &Request<ReqB>, _error: &StoreError) -> Response<ResB> {
        let mut response = if is_grpc(request) {
            grpc_answer(14, "rate limiter unavailable")
        } else {
            http_answer(StatusCode::SERVICE_UNAVAILABLE)
        };
        response
            .headers_mut()
            .insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
        response
    }
}

impl<F, ReqB, ResB> OnRejection<ReqB, ResB> for F
where
    F: Fn(&Request<ReqB>, &Decision) -> Response<ResB> + Send + Sync + 'static,
    ResB: Default,
{
    fn rate_limited(&self, request: &Request<ReqB>, decision: &Decision) -> Response<ResB> {
        self(request, decision)
    }

    fn key_missing(&self, request: &Request<ReqB>, error: &KeyError) -> Response<ResB> {
        DefaultRejection.key_missing(request, error)
    }

    fn store_failed(&self, request: &Request<ReqB>, error: &StoreError) -> Response<ResB> {
        DefaultRejection.store_failed(request, error)
    }
}
