//! The answers the layer gives instead of calling the inner service.

use std::any::Any;

use http::{HeaderName, HeaderValue, Request, Response, StatusCode, header::CONTENT_TYPE};

use crate::{
    Decision, StoreError, StoreErrorKind, adaptive::Shedding, headers::ceil_secs, key::KeyError,
};

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

    /// The answer to a request the [adaptive](crate::adaptive) stage shed. The layer
    /// adds `Retry-After` (the hint, in whole seconds rounded up) after this returns,
    /// unless the answer has one.
    ///
    /// By default, the answer to a store failure ([`store_failed`](Self::store_failed)
    /// with a [`StoreErrorKind::Overloaded`] error): a hook of your own that builds no
    /// other answer says "unavailable, retry later" as it does then.
    /// [`DefaultRejection`] and closures answer with
    /// [`shedding.status`](Shedding::status) (503 or 429), gRPC `UNAVAILABLE`.
    fn shed(&self, request: &Request<ReqB>, shedding: &Shedding) -> Response<ResB> {
        let error = StoreError::new(StoreErrorKind::Overloaded, shedding.shed);
        self.store_failed(request, &error)
    }
}

/// The default answers, in HTTP or gRPC depending on the request's `content-type`:
///
/// | case | HTTP | gRPC (HTTP 200, trailers-only) |
/// |---|---|---|
/// | rate limited | 429 Too Many Requests | `grpc-status: 8` RESOURCE_EXHAUSTED |
/// | no key | 400 Bad Request | `grpc-status: 3` INVALID_ARGUMENT ([configurable](Self::with_grpc_missing_key)) |
/// | no key, server at fault ([`KeyError::is_misconfigured`]: no peer address) | 500 Internal Server Error, the fix in the body | `grpc-status: 13` INTERNAL, the fix in `grpc-message` |
/// | store failed, policy deny | 503 Service Unavailable, `Retry-After: 1` | `grpc-status: 14` UNAVAILABLE, `retry-after: 1` |
///
/// gRPC requests never get an HTTP 429: gRPC clients would turn it into UNAVAILABLE and
/// retry at once. A gRPC answer is a trailers-only response: HTTP 200, `content-type:
/// application/grpc`, `grpc-status`, a readable `grpc-message` (for a rate-limited call
/// `rate limit exceeded; retry in <seconds>s`, the same rounded-up seconds as
/// `retry-after`) and no body. The layer adds `retry-after` and the rate-limit fields to the
/// rate-limited answer, so gRPC clients see them as metadata. The bodies are empty
/// (`ResB::default()`), except the one of a misconfigured server, which names the fix in
/// plain text when the body type is axum's `Body` or `String`.
///
/// gRPC answers can carry more, opt-in:
///
/// - [`grpc_retry_pushback`](Self::with_grpc_retry_pushback): `grpc-retry-pushback-ms`, the
///   header with which gRPC's built-in retry policy (gRFC A6) learns how long to wait.
/// - `grpc_retry_info` (feature `grpc-status-details`): a
///   `google.rpc.RetryInfo` in `grpc-status-details-bin`, the rich error model that
///   `tonic-types` and other gRPC libraries decode.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{DefaultRejection, GrpcMissingKey, Limit, RateLimitLayer, key::HeaderKey};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let layer = RateLimitLayer::new(Limit::fixed_window(100, Duration::from_secs(60))?)
///     .with_key(HeaderKey::new("x-api-key")?)
///     .with_on_rejection(
///         DefaultRejection::new()
///             .with_grpc_retry_pushback(true)
///             .with_grpc_missing_key(GrpcMissingKey::Unauthenticated),
///     );
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DefaultRejection {
    retry_pushback: bool,
    #[cfg(feature = "grpc-status-details")]
    retry_info: bool,
    missing_key: GrpcMissingKey,
}

/// The gRPC status of a request without a key; see [`DefaultRejection::with_grpc_missing_key`].
/// HTTP requests get 400 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum GrpcMissingKey {
    /// `grpc-status: 3` INVALID_ARGUMENT: the call lacks what the key is made of (the
    /// default). Not retried by gRPC clients.
    #[default]
    InvalidArgument,
    /// `grpc-status: 16` UNAUTHENTICATED: for keys that identify the caller, such as an
    /// API key in metadata.
    Unauthenticated,
}

impl GrpcMissingKey {
    fn code(self) -> u8 {
        match self {
            Self::InvalidArgument => 3,
            Self::Unauthenticated => 16,
        }
    }
}

impl Default for DefaultRejection {
    fn default() -> Self {
        Self::new()
    }
}

impl DefaultRejection {
    /// The default answers, without any of the gRPC opt-ins.
    pub const fn new() -> Self {
        Self {
            retry_pushback: false,
            #[cfg(feature = "grpc-status-details")]
            retry_info: false,
            missing_key: GrpcMissingKey::InvalidArgument,
        }
    }

    /// Adds `grpc-retry-pushback-ms` to denied gRPC calls (off by default): the exact time
    /// until the call would be allowed, in milliseconds (at least 1), and `1000` when the
    /// store failed. gRPC clients with a retry policy wait that long before their next
    /// attempt (gRFC A6), instead of their own backoff; clients without one ignore it.
    /// Only calls whose status the retry policy lists (`RESOURCE_EXHAUSTED`, `UNAVAILABLE`)
    /// are retried at all.
    pub const fn with_grpc_retry_pushback(mut self, enabled: bool) -> Self {
        self.retry_pushback = enabled;
        self
    }

    /// Adds the rich error model to rate-limited gRPC calls (off by default):
    /// `grpc-status-details-bin` holds a `google.rpc.Status` with the same code and message
    /// and one detail, a `google.rpc.RetryInfo` whose `retry_delay` is the exact time until
    /// the call would be allowed. Clients decode it with, for example,
    /// `tonic_types::StatusExt::get_details_retry_info`.
    #[cfg(feature = "grpc-status-details")]
    #[cfg_attr(docsrs, doc(cfg(feature = "grpc-status-details")))]
    pub const fn with_grpc_retry_info(mut self, enabled: bool) -> Self {
        self.retry_info = enabled;
        self
    }

    /// The gRPC status of a call without a key (when missing keys are rejected; see
    /// [`MissingKey`](crate::MissingKey)): INVALID_ARGUMENT by default.
    pub const fn with_grpc_missing_key(mut self, status: GrpcMissingKey) -> Self {
        self.missing_key = status;
        self
    }

    fn add_pushback(&self, headers: &mut http::HeaderMap, retry_after_ms: u64) {
        if self.retry_pushback {
            headers.insert(GRPC_RETRY_PUSHBACK_MS, HeaderValue::from(retry_after_ms));
        }
    }
}

/// `grpc-retry-pushback-ms`.
const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// `grpc-status-details-bin`.
#[cfg(feature = "grpc-status-details")]
const GRPC_STATUS_DETAILS_BIN: HeaderName = HeaderName::from_static("grpc-status-details-bin");

/// Whether `request` is a gRPC call (`content-type: application/grpc*`).
pub fn is_grpc<B>(request: &Request<B>) -> bool {
    request
        .headers()
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// A trailers-only gRPC answer: status and message in the response headers, no body.
fn grpc_answer<B: Default>(code: u8, message: &str) -> Response<B> {
    let mut response = Response::new(B::default());
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert("grpc-status", HeaderValue::from(u16::from(code)));
    headers.insert("grpc-message", grpc_message(message));
    response
}

/// `text` as a `grpc-message` value: percent-encoded as the gRPC spec requires, every byte
/// outside `%x20-%x7E`, and `%` itself, as `%XX`. The default messages are plain ASCII and
/// pass unchanged.
fn grpc_message(text: &str) -> HeaderValue {
    let mut encoded = String::with_capacity(text.len());
    for &byte in text.as_bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            encoded.push(char::from(byte));
        } else {
            const HEX: &[u8; 16] = b"0123456789ABCDEF";
            encoded.push('%');
            encoded.push(char::from(HEX[usize::from(byte >> 4)]));
            encoded.push(char::from(HEX[usize::from(byte & 0xf)]));
        }
    }
    // Only visible ASCII and spaces remain, which every header value accepts.
    HeaderValue::try_from(encoded).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// The `google.rpc.Status` of a rate-limited call with a `RetryInfo` detail, protobuf-encoded
/// and then base64-encoded without padding, as gRPC sends `-bin` metadata.
#[cfg(feature = "grpc-status-details")]
fn retry_info_details(code: u8, message: &str, retry_after_ms: u64) -> HeaderValue {
    use base64::Engine as _;
    use prost::Message as _;

    let retry_info = tonic_types::pb::RetryInfo {
        retry_delay: Some(prost_types::Duration {
            seconds: i64::try_from(retry_after_ms / 1000).unwrap_or(i64::MAX),
            // Below 1e9, so it always fits.
            nanos: i32::try_from(retry_after_ms % 1000 * 1_000_000).unwrap_or(0),
        }),
    };
    let status = tonic_types::pb::Status {
        code: i32::from(code),
        message: message.to_owned(),
        details: vec![prost_types::Any {
            type_url: tonic_types::RetryInfo::TYPE_URL.to_owned(),
            value: retry_info.encode_to_vec(),
        }],
    };
    let encoded = base64::engine::general_purpose::STANDARD_NO_PAD.encode(status.encode_to_vec());
    // The base64 alphabet is valid in header values.
    HeaderValue::try_from(encoded).unwrap_or_else(|_| HeaderValue::from_static(""))
}

fn http_answer<B: Default>(status: StatusCode) -> Response<B> {
    let mut response = Response::new(B::default());
    *response.status_mut() = status;
    response
}

/// `text` as a body of type `B`, for the body types that can hold text: the default
/// answers are generic over any `Default` body (tonic's, `Empty`, `()`), so the few that
/// carry a message find out at run time whether the body type can.
fn text_body<B: 'static>(text: String) -> Option<B> {
    let mut text = Some(text);
    let mut body: Option<B> = None;
    let any: &mut dyn Any = &mut body;
    if let Some(slot) = any.downcast_mut::<Option<String>>() {
        *slot = text.take();
    }
    #[cfg(feature = "axum")]
    if let Some(slot) = any.downcast_mut::<Option<axum::body::Body>>() {
        *slot = text.take().map(axum::body::Body::from);
    }
    body
}

impl<ReqB, ResB: Default + 'static> OnRejection<ReqB, ResB> for DefaultRejection {
    fn rate_limited(&self, request: &Request<ReqB>, decision: &Decision) -> Response<ResB> {
        if !is_grpc(request) {
            return http_answer(StatusCode::TOO_MANY_REQUESTS);
        }
        // The exact wait, and the seconds the layer writes as `retry-after`.
        let retry_after_ms = decision.retry_after_ms().max(1);
        let message = format!(
            "rate limit exceeded; retry in {}s",
            ceil_secs(retry_after_ms)
        );
        let mut response = grpc_answer(8, &message);
        self.add_pushback(response.headers_mut(), retry_after_ms);
        #[cfg(feature = "grpc-status-details")]
        if self.retry_info {
            response.headers_mut().insert(
                GRPC_STATUS_DETAILS_BIN,
                retry_info_details(8, &message, retry_after_ms),
            );
        }
        response
    }

    fn key_missing(&self, request: &Request<ReqB>, error: &KeyError) -> Response<ResB> {
        match (is_grpc(request), error.is_misconfigured()) {
            (true, false) => grpc_answer(self.missing_key.code(), "missing rate limit key"),
            (false, false) => http_answer(StatusCode::BAD_REQUEST),
            // The client can do nothing about it: say what the operator must change.
            (true, true) => grpc_answer(13, &error.to_string()),
            (false, true) => {
                let mut response = http_answer(StatusCode::INTERNAL_SERVER_ERROR);
                if let Some(body) = text_body(error.to_string()) {
                    *response.body_mut() = body;
                    response.headers_mut().insert(
                        CONTENT_TYPE,
                        HeaderValue::from_static("text/plain; charset=utf-8"),
                    );
                }
                response
            }
        }
    }

    fn store_failed(&self, request: &Request<ReqB>, _error: &StoreError) -> Response<ResB> {
        let mut response = if is_grpc(request) {
            let mut response = grpc_answer(14, "rate limiter unavailable");
            self.add_pushback(response.headers_mut(), 1000);
            response
        } else {
            http_answer(StatusCode::SERVICE_UNAVAILABLE)
        };
        response
            .headers_mut()
            .insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
        response
    }

    fn shed(&self, request: &Request<ReqB>, shedding: &Shedding) -> Response<ResB> {
        if !is_grpc(request) {
            return http_answer(shedding.status);
        }
        // UNAVAILABLE: retryable, with the hint as `retry-after` (added by the layer).
        let mut response = grpc_answer(14, &crate::adaptive::shed_message(shedding));
        let hint_ms = u64::try_from(shedding.retry_after.as_millis()).unwrap_or(u64::MAX);
        self.add_pushback(response.headers_mut(), hint_ms);
        response
    }
}

impl<F, ReqB, ResB> OnRejection<ReqB, ResB> for F
where
    F: Fn(&Request<ReqB>, &Decision) -> Response<ResB> + Send + Sync + 'static,
    ResB: Default + 'static,
{
    fn rate_limited(&self, request: &Request<ReqB>, decision: &Decision) -> Response<ResB> {
        self(request, decision)
    }

    fn key_missing(&self, request: &Request<ReqB>, error: &KeyError) -> Response<ResB> {
        DefaultRejection::new().key_missing(request, error)
    }

    fn store_failed(&self, request: &Request<ReqB>, error: &StoreError) -> Response<ResB> {
        DefaultRejection::new().store_failed(request, error)
    }

    fn shed(&self, request: &Request<ReqB>, shedding: &Shedding) -> Response<ResB> {
        DefaultRejection::new().shed(request, shedding)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LimitDecision;

    fn grpc_request() -> Request<()> {
        Request::post("/grpc.health.v1.Health/Check")
            .header(CONTENT_TYPE, "application/grpc+proto")
            .body(())
            .unwrap()
    }

    fn denied(retry_after_ms: u64) -> Decision {
        Decision::new(vec![LimitDecision {
            allowed: false,
            limit: 3,
            remaining: 0,
            reset_after_ms: retry_after_ms,
            retry_after_ms,
        }])
    }

    fn header<'a, B>(response: &'a Response<B>, name: &str) -> Option<&'a str> {
        response.headers().get(name).map(|v| v.to_str().unwrap())
    }

    #[test]
    fn grpc_messages_are_percent_encoded_per_the_spec() {
        assert_eq!(
            grpc_message("rate limit exceeded; retry in 3s"),
            "rate limit exceeded; retry in 3s"
        );
        assert_eq!(grpc_message("100% über\n"), "100%25 %C3%BCber%0A");
        assert_eq!(grpc_message("a\r\nb~"), "a%0D%0Ab~");
    }

    #[test]
    fn rate_limited_grpc_calls_get_resource_exhausted_with_the_wait() {
        let response: Response<()> =
            DefaultRejection::new().rate_limited(&grpc_request(), &denied(2_500));
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(header(&response, "content-type"), Some("application/grpc"));
        assert_eq!(header(&response, "grpc-status"), Some("8"));
        assert_eq!(
            header(&response, "grpc-message"),
            Some("rate limit exceeded; retry in 3s")
        );
        assert_eq!(header(&response, "grpc-retry-pushback-ms"), None);
        assert_eq!(header(&response, "grpc-status-details-bin"), None);

        let pushback = DefaultRejection::new().with_grpc_retry_pushback(true);
        let response: Response<()> = pushback.rate_limited(&grpc_request(), &denied(2_500));
        assert_eq!(header(&response, "grpc-retry-pushback-ms"), Some("2500"));
        let response: Response<()> = pushback.store_failed(&grpc_request(), &StoreError::timeout());
        assert_eq!(header(&response, "grpc-status"), Some("14"));
        assert_eq!(header(&response, "grpc-retry-pushback-ms"), Some("1000"));
        assert_eq!(header(&response, "retry-after"), Some("1"));
    }

    #[test]
    fn http_requests_ignore_the_grpc_options() {
        let rejection = DefaultRejection::new()
            .with_grpc_retry_pushback(true)
            .with_grpc_missing_key(GrpcMissingKey::Unauthenticated);
        let request = Request::get("/").body(()).unwrap();
        let response: Response<()> = rejection.rate_limited(&request, &denied(1));
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(response.headers().is_empty());
        let response: Response<()> = rejection.key_missing(&request, &KeyError::new("x"));
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn a_misconfigured_server_is_a_500_that_names_the_fix() {
        let error = KeyError::misconfigured("no client address: serve with X");
        let request = Request::get("/").body(()).unwrap();
        let response: Response<String> = DefaultRejection::new().key_missing(&request, &error);
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(response.body(), "no client address: serve with X");
        assert_eq!(
            header(&response, "content-type"),
            Some("text/plain; charset=utf-8")
        );
        // A body type without text keeps its default body and no content type.
        let response: Response<()> = DefaultRejection::new().key_missing(&request, &error);
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(header(&response, "content-type"), None);
        let response: Response<()> = DefaultRejection::new().key_missing(&grpc_request(), &error);
        assert_eq!(header(&response, "grpc-status"), Some("13"));
        assert_eq!(
            header(&response, "grpc-message"),
            Some("no client address: serve with X")
        );
    }

    #[test]
    fn missing_keys_are_invalid_argument_or_unauthenticated() {
        let error = KeyError::new("missing header x-api-key");
        let response: Response<()> = DefaultRejection::new().key_missing(&grpc_request(), &error);
        assert_eq!(header(&response, "grpc-status"), Some("3"));
        let response: Response<()> = DefaultRejection::new()
            .with_grpc_missing_key(GrpcMissingKey::Unauthenticated)
            .key_missing(&grpc_request(), &error);
        assert_eq!(header(&response, "grpc-status"), Some("16"));
        assert_eq!(response.status(), StatusCode::OK);
    }

    #[cfg(feature = "grpc-status-details")]
    #[test]
    fn retry_info_is_a_google_rpc_status_in_unpadded_base64() {
        use base64::Engine as _;
        use prost::Message as _;

        let rejection = DefaultRejection::new().with_grpc_retry_info(true);
        // 2 ms: the protobuf is then 1 byte short of a multiple of 3, so padding would show.
        for ms in [2, 1_500, 3_600_000] {
            let response: Response<()> = rejection.rate_limited(&grpc_request(), &denied(ms));
            let value = header(&response, "grpc-status-details-bin").unwrap();
            assert!(!value.contains('='), "{value}");
            let bytes = base64::engine::general_purpose::STANDARD_NO_PAD
                .decode(value)
                .unwrap();
            let status = tonic_types::pb::Status::decode(&bytes[..]).unwrap();
            assert_eq!(status.code, 8);
            assert_eq!(status.message, header(&response, "grpc-message").unwrap());
            let [detail] = &status.details[..] else {
                panic!("{status:?}")
            };
            assert_eq!(detail.type_url, "type.googleapis.com/google.rpc.RetryInfo");
            let info = tonic_types::pb::RetryInfo::decode(&detail.value[..]).unwrap();
            let delay = info.retry_delay.unwrap();
            assert_eq!(
                (delay.seconds, delay.nanos),
                (
                    i64::try_from(ms / 1000).unwrap(),
                    i32::try_from(ms % 1000).unwrap() * 1_000_000
                )
            );
        }
    }
}
