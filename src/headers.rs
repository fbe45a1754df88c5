//! The rate-limit fields of a response and the denied answer, written in one place.
//!
//! | | allowed | denied |
//! |---|---|---|
//! | status | the service's | `429 Too Many Requests` |
//! | `Retry-After` | — | seconds, rounded up, never 0 |
//! | `RateLimit-Policy` | `"<name>";q=<limit>;w=<window s>` per limit | same |
//! | `RateLimit` | `"<name>";r=<remaining>;t=<s until reset>` per limit | same, `t` never later than `Retry-After` |
//!
//! - The fields follow draft-ietf-httpapi-ratelimit-headers-11, one item per limit. Each
//!   layer *appends* its own field lines, so stacked layers each show their own items.
//! - No `pk` (partition key) is sent: it would hand every client a stable identifier.
//! - The policy name is the limit's [`named(..)`](crate::Limit::with_name) name or
//!   `<limit>-per-<window>` (under a [plan](crate::plan): `<plan>.<name>`).
//! - On denied responses, `Retry-After: <seconds>`, rounded up and never 0, and never
//!   earlier than any `t` of the same response.
//! - [`.with_headers(HeaderStyle::default().with_legacy(true))`](crate::RateLimitLayer::with_headers)
//!   adds the legacy `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset`
//!   (seconds) of the most restrictive limit; [`HeaderStyle::NONE`] removes the fields.
//! - gRPC calls get the same values as metadata in a trailers-only answer, never HTTP 429:
//!   see [the gRPC guide](crate::guide::grpc).
//! - Customise the denied answer with
//!   [`.with_on_rejection(|req: &Request<Body>, decision: &Decision| ..)`](crate::OnRejection);
//!   the layer still adds `Retry-After` and the rate-limit fields.
//!   [`DefaultRejection`](crate::DefaultRejection) lists every answer the layer gives.
use bytes::BytesMut;
use http::{HeaderMap, HeaderName, HeaderValue, header::RETRY_AFTER};

use crate::{Decision, Limit};

/// `RateLimit-Policy`.
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`.
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// `X-RateLimit-Limit`.
pub static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`.
pub static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`.
pub static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// Which rate-limit fields responses carry.
///
/// ```
/// use tollgate::headers::HeaderStyle;
///
/// // The IETF fields and the legacy `X-RateLimit-*` ones.
/// let both = HeaderStyle::default().with_legacy(true);
/// assert!(both.ietf && both.legacy);
/// // Only the legacy ones.
/// let legacy = HeaderStyle::NONE.with_legacy(true);
/// assert!(!legacy.ietf && legacy.legacy);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeaderStyle {
    /// The IETF `RateLimit-Policy` and `RateLimit` fields (on by default).
    pub ietf: bool,
    /// The legacy `X-RateLimit-*` fields (off by default).
    pub legacy: bool,
}

impl Default for HeaderStyle {
    fn default() -> Self {
        Self {
            ietf: true,
            legacy: false,
        }
    }
}

impl HeaderStyle {
    /// No rate-limit fields at all (denied responses still get `Retry-After`).
    pub const NONE: Self = Self {
        ietf: false,
        legacy: false,
    };

    /// The same, with or without the IETF `RateLimit-Policy` and `RateLimit` fields.
    pub const fn with_ietf(mut self, on: bool) -> Self {
        self.ietf = on;
        self
    }

    /// The same, with or without the legacy `X-RateLimit-*` fields.
    pub const fn with_legacy(mut self, on: bool) -> Self {
        self.legacy = on;
        self
    }
}

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// The policy name of a limit: its name, or `<limit>-per-<window>`.
pub(crate) fn policy_name(limit: &Limit) -> String {
    match limit.name() {
        Some(name) => name.to_owned(),
        None => format!(
            "{}-per-{}",
            limit.limit(),
            humantime::format_duration(limit.window())
        )
        .replace(' ', ""),
    }
}

/// The layer's `RateLimit-Policy` value, which never changes: built once, with the
/// policies called `names`.
fn policy_value(limits: &[Limit], names: &[String]) -> Option<HeaderValue> {
    let mut value = String::new();
    for (limit, name) in limits.iter().zip(names) {
        if !value.is_empty() {
            value.push_str(", ");
        }
        value.push('"');
        value.push_str(name);
        value.push_str("\";q=");
        value.push_str(itoa::Buffer::new().format(limit.limit()));
        value.push_str(";w=");
        value.push_str(itoa::Buffer::new().format(ceil_secs(limit.window_ms()).max(1)));
    }
    HeaderValue::from_str(&value).ok()
}

/// What a layer writes, prepared once.
#[derive(Debug, Clone)]
pub(crate) struct HeaderWriter {
    style: HeaderStyle,
    /// `"<name>";r=` for each limit: the constant start of its `RateLimit` item.
    items: Vec<String>,
    /// Enough bytes for the whole `RateLimit` value, so it is allocated once.
    rendered_len: usize,
    policy: Option<HeaderValue>,
}

impl HeaderWriter {
    pub(crate) fn new(style: HeaderStyle, limits: &[Limit]) -> Self {
        let names: Vec<String> = limits.iter().map(policy_name).collect();
        Self::named(style, limits, &names)
    }

    /// The writer of a [plan](crate::plan::Plan)'s limits: each policy is called
    /// `<plan>.<policy>` (`"free.hourly"`, `"paid.100-per-1m"`), so clients and logs see
    /// which plan answered.
    pub(crate) fn for_plan(style: HeaderStyle, limits: &[Limit], plan: &str) -> Self {
        let names: Vec<String> = limits
            .iter()
            .map(|limit| format!("{plan}.{}", policy_name(limit)))
            .collect();
        Self::named(style, limits, &names)
    }

    fn named(style: HeaderStyle, limits: &[Limit], names: &[String]) -> Self {
        let items: Vec<String> = names.iter().map(|name| format!("\"{name}\";r=")).collect();
        // Each item: its start, up to 20 digits twice, `;t=` and `, `.
        let rendered_len = items.iter().map(|item| item.len() + 45).sum();
        Self {
            style,
            items,
            rendered_len,
            policy: policy_value(limits, names),
        }
    }

    /// Writes the fields for `decision` into `headers`.
    /// Whether [`write`](Self::write) adds anything to an allowed request's response: not
    /// with [`HeaderStyle::NONE`], whose allowed requests answered at once (a layer
    /// without shadow limits) then skip carrying their decision and rules to the response.
    pub(crate) fn writes_when_allowed(&self) -> bool {
        self.style.ietf || self.style.legacy
    }

    pub(crate) fn write(&self, headers: &mut HeaderMap, decision: &Decision) {
        let retry_after = if decision.is_allowed() {
            // An inner layer may have denied the request already: keep every `t` of this
            // response no later than its Retry-After.
            headers
                .get(RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
        } else {
            let secs = ceil_secs(decision.retry_after_ms()).max(1);
            headers.insert(RETRY_AFTER, HeaderValue::from(secs));
            Some(secs)
        };
        if decision.limits().is_empty() {
            return;
        }
        if self.style.ietf {
            if let Some(policy) = &self.policy {
                headers.append(RATELIMIT_POLICY.clone(), policy.clone());
            }
            // Rendered into one buffer that becomes the header value without a copy.
            let mut value = BytesMut::with_capacity(self.rendered_len);
            for (item, limit) in self.items.iter().zip(decision.limits()) {
                if !value.is_empty() {
                    value.extend_from_slice(b", ");
                }
                let mut reset = ceil_secs(limit.reset_after_ms);
                if let Some(retry_after) = retry_after {
                    reset = reset.min(retry_after);
                }
                value.extend_from_slice(item.as_bytes());
                value.extend_from_slice(itoa::Buffer::new().format(limit.remaining).as_bytes());
                value.extend_from_slice(b";t=");
                value.extend_from_slice(itoa::Buffer::new().format(reset).as_bytes());
            }
            if let Ok(value) = HeaderValue::from_maybe_shared(value.freeze()) {
                headers.append(RATELIMIT.clone(), value);
            }
        }
        if self.style.legacy
            && !headers.contains_key(&X_RATELIMIT_LIMIT)
            && let Some(tightest) = decision.tightest()
        {
            headers.insert(X_RATELIMIT_LIMIT.clone(), HeaderValue::from(tightest.limit));
            headers.insert(
                X_RATELIMIT_REMAINING.clone(),
                HeaderValue::from(tightest.remaining),
            );
            headers.insert(
                X_RATELIMIT_RESET.clone(),
                HeaderValue::from(ceil_secs(tightest.reset_after_ms)),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::LimitDecision;

    fn decision(allowed: bool, remaining: u64, reset: u64, retry: u64) -> Decision {
        Decision::new(vec![LimitDecision {
            allowed,
            limit: 10,
            remaining,
            reset_after_ms: reset,
            retry_after_ms: retry,
        }])
    }

    #[test]
    fn writes_ietf_fields_and_rounds_retry_after_up() {
        let limits = [Limit::fixed_window(10, Duration::from_secs(60)).unwrap()];
        let writer = HeaderWriter::new(HeaderStyle::default(), &limits);
        let mut headers = HeaderMap::new();
        writer.write(&mut headers, &decision(false, 0, 1, 1));
        assert_eq!(headers["retry-after"], "1");
        assert_eq!(headers["ratelimit-policy"], r#""10-per-1m";q=10;w=60"#);
        assert_eq!(headers["ratelimit"], r#""10-per-1m";r=0;t=1"#);

        let mut headers = HeaderMap::new();
        writer.write(&mut headers, &decision(false, 0, 59_001, 1_001));
        assert_eq!(headers["retry-after"], "2");
        assert_eq!(headers["ratelimit"], r#""10-per-1m";r=0;t=2"#);
    }

    #[test]
    fn appends_rather_than_overwrites() {
        let inner = [Limit::fixed_window(10, Duration::from_secs(1))
            .unwrap()
            .with_name("inner")
            .unwrap()];
        let outer = [Limit::fixed_window(10, Duration::from_millis(500)).unwrap()];
        let mut headers = HeaderMap::new();
        HeaderWriter::new(HeaderStyle::default(), &inner)
            .write(&mut headers, &decision(true, 9, 1000, 0));
        HeaderWriter::new(HeaderStyle::default(), &outer)
            .write(&mut headers, &decision(true, 3, 200, 0));
        let policies: Vec<_> = headers.get_all("ratelimit-policy").iter().collect();
        assert_eq!(
            policies,
            [r#""inner";q=10;w=1"#, r#""10-per-500ms";q=10;w=1"#]
        );
        assert!(!headers.contains_key("retry-after"));
    }

    #[test]
    fn legacy_fields_on_request() {
        let limits = [Limit::fixed_window(10, Duration::from_secs(60)).unwrap()];
        let style = HeaderStyle::NONE.with_legacy(true);
        let mut headers = HeaderMap::new();
        HeaderWriter::new(style, &limits).write(&mut headers, &decision(true, 4, 30_500, 0));
        assert_eq!(headers["x-ratelimit-limit"], "10");
        assert_eq!(headers["x-ratelimit-remaining"], "4");
        assert_eq!(headers["x-ratelimit-reset"], "31");
        assert!(!headers.contains_key("ratelimit"));
    }
}
