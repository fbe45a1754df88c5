//! The admin endpoints on `admin_listen`: read and reset one (route, key) budget.
//!
//! - `GET /ratelimit/<route>?key=<value>[&kind=<kind>][&cost=<n>]`: what a request of
//!   `cost` (default 1) from that client would get now, per limit, with nothing counted.
//! - `POST` or `DELETE` on the same address: a fresh budget for that client on the route,
//!   on every gateway sharing the store.
//!
//! `<route>` is the route's `path` without its leading `/` (`/ratelimit/api/v1` for
//! `path = "/api/v1"`, `/ratelimit/` for `/`). `kind` picks the route's key (`ip`,
//! `header:<name>`, `global`) when the route has limits under several; `key` is the
//! client's IP address or header value as the client sends it: the gateway makes the
//! store key from it exactly as for a request (hashed header keys included).
//! `admin_token_env` set: every request needs `Authorization: Bearer <token>`. A browser's
//! cross-site request, and a DNS-rebound one on a loopback listener, are refused (403).

use std::{collections::HashMap, fmt::Write as _, net::SocketAddr, sync::Arc};

use axum::{
    Router,
    extract::{Path, Query, Request, State},
    http::{HeaderMap, Method, StatusCode, header},
    response::{IntoResponse, Response},
    routing::any,
};
use tollgate::{
    Decision, Limiter,
    key::{ClientIp, GlobalKey, HeaderKey, Key},
};

use crate::{config::KeySpec, server::Live};

/// One rate-limit layer of a route: its kind of key, whether it is the layer of the
/// route's plans, and its limiter.
#[derive(Clone)]
pub(crate) struct Entry {
    route: String,
    kind: KeySpec,
    plans: bool,
    limiter: AnyLimiter,
}

#[derive(Clone)]
enum AnyLimiter {
    Ip(Limiter<ClientIp>),
    Header(Limiter<HeaderKey>),
    Global(Limiter<GlobalKey>),
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.route, self.kind)
    }
}

impl Entry {
    pub(crate) fn ip(route: &str, plans: bool, limiter: Limiter<ClientIp>) -> Self {
        Self::new(route, KeySpec::Ip, plans, AnyLimiter::Ip(limiter))
    }

    pub(crate) fn header(
        route: &str,
        plans: bool,
        kind: KeySpec,
        limiter: Limiter<HeaderKey>,
    ) -> Self {
        Self::new(route, kind, plans, AnyLimiter::Header(limiter))
    }

    pub(crate) fn global(route: &str, plans: bool, limiter: Limiter<GlobalKey>) -> Self {
        Self::new(route, KeySpec::Global, plans, AnyLimiter::Global(limiter))
    }

    fn new(route: &str, kind: KeySpec, plans: bool, limiter: AnyLimiter) -> Self {
        Self {
            route: route.to_owned(),
            kind,
            plans,
            limiter,
        }
    }

    /// The store key a request from this client would be counted against, made by the
    /// layer's own extractor from a request that carries `value` where a client's would.
    fn key(&self, value: Option<&[u8]>) -> Result<Key, String> {
        let mut request = http::Request::new(());
        let extracted = match (&self.limiter, &self.kind) {
            (AnyLimiter::Ip(limiter), _) => {
                let value = value.ok_or("missing key (the client's IP address)")?;
                let ip: std::net::IpAddr = std::str::from_utf8(value)
                    .ok()
                    .and_then(|value| value.parse().ok())
                    .ok_or_else(|| {
                        format!(
                            "key {:?} is not an IP address",
                            String::from_utf8_lossy(value)
                        )
                    })?;
                request.extensions_mut().insert(SocketAddr::new(ip, 0));
                limiter.key_of(&request)
            }
            (AnyLimiter::Header(limiter), KeySpec::Header(name)) => {
                let value = value.ok_or_else(|| format!("missing key (the {name} value)"))?;
                // A header value may hold any byte but controls (obs-text): the key is its
                // bytes, percent-decoded, never a lossy UTF-8 reading of them.
                let value = http::HeaderValue::from_bytes(value)
                    .map_err(|_| format!("key is not a valid {name} value"))?;
                request.headers_mut().insert(name.clone(), value);
                limiter.key_of(&request)
            }
            (AnyLimiter::Global(limiter), _) => limiter.key_of(&request),
            (AnyLimiter::Header(_), _) => return Err("header limiter without a header".into()),
        };
        extracted.map_err(|e| e.to_string())
    }

    async fn peek(&self, key: &Key, cost: u32) -> Result<(Decision, Decision), String> {
        let (enforced, shadow) = match &self.limiter {
            AnyLimiter::Ip(l) => (l.peek(key, cost).await, l.peek_shadow(key, cost).await),
            AnyLimiter::Header(l) => (l.peek(key, cost).await, l.peek_shadow(key, cost).await),
            AnyLimiter::Global(l) => (l.peek(key, cost).await, l.peek_shadow(key, cost).await),
        };
        let error = |e: tollgate::StoreError| store_error(&e);
        Ok((enforced.map_err(error)?, shadow.map_err(error)?))
    }

    async fn reset(&self, key: &Key) -> Result<(), String> {
        match &self.limiter {
            AnyLimiter::Ip(l) => l.reset(key).await,
            AnyLimiter::Header(l) => l.reset(key).await,
            AnyLimiter::Global(l) => l.reset(key).await,
        }
        .map_err(|e| store_error(&e))
    }

    /// [`peek`](Self::peek) under the plan `plan` (of this plans' layer).
    async fn peek_plan(&self, plan: &str, key: &Key, cost: u32) -> Result<Decision, String> {
        match &self.limiter {
            AnyLimiter::Ip(l) => l.peek_plan(plan, key, cost).await,
            AnyLimiter::Header(l) => l.peek_plan(plan, key, cost).await,
            AnyLimiter::Global(l) => l.peek_plan(plan, key, cost).await,
        }
        .map_err(|e| store_error(&e))
    }

    fn rules(&self) -> tollgate::rules::Rules {
        match &self.limiter {
            AnyLimiter::Ip(l) => l.rules(),
            AnyLimiter::Header(l) => l.rules(),
            AnyLimiter::Global(l) => l.rules(),
        }
    }
}

/// A store error with its causes.
fn store_error(error: &tollgate::StoreError) -> String {
    let mut text = error.to_string();
    let mut cause = std::error::Error::source(error);
    while let Some(e) = cause {
        let _ = write!(text, ": {e}");
        cause = e.source();
    }
    text
}

/// The admin app: `/metrics` (when given) and the rate-limit endpoints.
pub(crate) fn router(live: Arc<Live>) -> Router {
    Router::new()
        .route("/ratelimit/", any(root))
        .route("/ratelimit/{*route}", any(route))
        .with_state(live)
}

async fn root(
    State(live): State<Arc<Live>>,
    Query(query): Query<HashMap<String, String>>,
    request: Request,
) -> Response {
    answer(
        &live,
        "/",
        &query,
        request.uri(),
        request.method(),
        request.headers(),
    )
    .await
}

async fn route(
    State(live): State<Arc<Live>>,
    Path(route): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    request: Request,
) -> Response {
    let route = format!("/{}", route.trim_end_matches('/'));
    answer(
        &live,
        &route,
        &query,
        request.uri(),
        request.method(),
        request.headers(),
    )
    .await
}

async fn answer(
    live: &Live,
    route: &str,
    query: &HashMap<String, String>,
    uri: &http::Uri,
    method: &Method,
    headers: &HeaderMap,
) -> Response {
    if from_a_page_elsewhere(headers, live.admin_on_loopback()) {
        return json(
            StatusCode::FORBIDDEN,
            &error_body(
                "refused: a browser's cross-site request (Origin, Sec-Fetch-Site) or, on a \
                 loopback listener, a Host that is not an address or localhost",
            ),
        );
    }
    if !authorized(live.admin_token().as_deref(), headers) {
        let mut response = json(
            StatusCode::UNAUTHORIZED,
            &error_body("missing or wrong bearer token"),
        );
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, "Bearer".parse().unwrap());
        return response;
    }
    let reset = match *method {
        Method::GET | Method::HEAD => false,
        Method::POST | Method::DELETE => true,
        _ => {
            return json(
                StatusCode::METHOD_NOT_ALLOWED,
                &error_body("GET reads, POST or DELETE resets"),
            );
        }
    };
    let gateway = live.gateway();
    // `plan=` asks the route's plans' layer, its absence the route's own limits.
    let plan = query.get("plan");
    let entries: Vec<&Entry> = gateway
        .admin()
        .filter(|e| e.route == route && e.plans == plan.is_some())
        .collect();
    if entries.is_empty() {
        let message = match plan {
            Some(_) => format!("no route with path {route:?} has plans with limits"),
            None if gateway.admin().any(|e| e.route == route) => {
                format!("route {route:?} has only plans: choose one with plan=")
            }
            None => format!("no route with path {route:?} has limits"),
        };
        return json(StatusCode::NOT_FOUND, &error_body(&message));
    }
    let entry = match query.get("kind") {
        Some(kind) => match entries.iter().find(|e| e.kind.to_string() == *kind) {
            Some(entry) => entry,
            None => {
                return json(
                    StatusCode::BAD_REQUEST,
                    &error_body(&format!(
                        "route {route:?} has no limits keyed by {kind:?} (it has {})",
                        kinds(&entries)
                    )),
                );
            }
        },
        None if entries.len() == 1 => &entries[0],
        None => {
            return json(
                StatusCode::BAD_REQUEST,
                &error_body(&format!(
                    "route {route:?} has limits keyed by {}: choose one with kind=",
                    kinds(&entries)
                )),
            );
        }
    };
    let key = match entry.key(raw_param(uri.query(), "key").as_deref()) {
        Ok(key) => key,
        Err(message) => return json(StatusCode::BAD_REQUEST, &error_body(&message)),
    };
    let rules = entry.rules();
    // The plan asked for, among the route's.
    let plan = match plan {
        None => None,
        Some(name) => match rules
            .plans()
            .and_then(|plans| plans.plans().iter().find(|p| p.name() == name))
        {
            Some(plan) => Some(plan),
            None => {
                let names: Vec<&str> = rules
                    .plans()
                    .map(|plans| plans.plans().iter().map(|p| p.name()).collect())
                    .unwrap_or_default();
                return json(
                    StatusCode::BAD_REQUEST,
                    &error_body(&format!(
                        "route {route:?} has no plan {name:?} (it has {})",
                        names.join(", ")
                    )),
                );
            }
        },
    };
    if reset {
        // A plans' layer resets the key under every plan: their state goes together.
        return match entry.reset(&key).await {
            Ok(()) => {
                tracing::info!(route, kind = %entry.kind, plans = entry.plans, key = %key.redacted(), "rate limit reset");
                let mut body = String::from("{");
                field(&mut body, "route", route);
                body.push(',');
                field(&mut body, "kind", &entry.kind.to_string());
                if let Some(plan) = plan {
                    body.push(',');
                    field(&mut body, "plan", plan.name());
                }
                body.push_str(",\"reset\":true}");
                json(StatusCode::OK, &body)
            }
            Err(message) => json(StatusCode::SERVICE_UNAVAILABLE, &error_body(&message)),
        };
    }
    let cost = match query.get("cost").map(|c| c.parse::<u32>()) {
        None => 1,
        Some(Ok(cost)) => cost,
        Some(Err(_)) => {
            return json(
                StatusCode::BAD_REQUEST,
                &error_body("cost must be a whole number"),
            );
        }
    };
    let peeked = match plan {
        Some(plan) => entry
            .peek_plan(plan.name(), &key, cost)
            .await
            .map(|decision| {
                let limits = plan.limits().unwrap_or_default();
                let shown = Shown {
                    plan: Some(plan.name()),
                    limits,
                    in_shadow: rules.is_shadow(),
                    shadow_limits: &[],
                };
                peek_body(
                    route,
                    &entry.kind,
                    cost,
                    &shown,
                    &decision,
                    &Decision::unlimited(),
                )
            }),
        None => entry.peek(&key, cost).await.map(|(enforced, shadow)| {
            let shown = Shown {
                plan: None,
                limits: rules.limits(),
                in_shadow: rules.is_shadow(),
                shadow_limits: rules.shadow_limits(),
            };
            peek_body(route, &entry.kind, cost, &shown, &enforced, &shadow)
        }),
    };
    match peeked {
        Ok(body) => json(StatusCode::OK, &body),
        Err(message) => json(StatusCode::SERVICE_UNAVAILABLE, &error_body(&message)),
    }
}

/// Whether `headers` carry the bearer `token` (any request when there is none).
fn authorized(token: Option<&[u8]>, headers: &HeaderMap) -> bool {
    let Some(token) = token else {
        return true;
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| bearer_credentials(v.as_bytes()))
        .unwrap_or_default();
    // Compared in time that depends on the lengths only.
    given.len() == token.len() && given.iter().zip(token).fold(0, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// Whether a browser sent `headers` for a page of another site: a form posted across
/// sites carries `Origin` (and `Sec-Fetch-Site`), and DNS rebinding (a name of the
/// attacker's resolving to 127.0.0.1) shows as a `Host` that is a name, which tools on a
/// loopback listener never send. The admin endpoints have no page of their own.
fn from_a_page_elsewhere(headers: &HeaderMap, loopback: bool) -> bool {
    let cross_site = headers
        .get("sec-fetch-site")
        .is_some_and(|site| site != "same-origin" && site != "none");
    let named = loopback
        && headers
            .get(header::HOST)
            .is_some_and(|host| !host.to_str().is_ok_and(is_address_or_localhost));
    headers.contains_key(header::ORIGIN) || cross_site || named
}

/// `host[:port]` where host is an IP address (`[v6]`) or `localhost`.
fn is_address_or_localhost(authority: &str) -> bool {
    let host = match authority.strip_prefix('[') {
        Some(rest) => rest.split_once(']').map_or(rest, |(v6, _)| v6),
        None => authority
            .rsplit_once(':')
            .filter(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
            .map_or(authority, |(host, _)| host),
    };
    host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok()
}

/// The bytes of the first `name` parameter in `query`, form-decoded (`+` is a space, `%XX`
/// a byte): `Query`'s strings would read bytes that are not UTF-8 as U+FFFD, and so reset
/// another key.
fn raw_param(query: Option<&str>, name: &str) -> Option<Vec<u8>> {
    query?.split('&').find_map(|pair| {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        (key == name).then(|| {
            let value = value.replace('+', " ");
            percent_encoding::percent_decode_str(&value).collect()
        })
    })
}

/// The credentials of a `Bearer` authorization: the scheme is case-insensitive and is
/// followed by one or more spaces (RFC 9110 section 11.1, 11.4).
fn bearer_credentials(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") || rest.first() != Some(&b' ') {
        return None;
    }
    Some(rest.trim_ascii_start())
}

fn kinds(entries: &[&Entry]) -> String {
    let kinds: Vec<String> = entries.iter().map(|e| e.kind.to_string()).collect();
    kinds.join(", ")
}

fn json(status: StatusCode, body: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        format!("{body}\n"),
    )
        .into_response()
}

fn error_body(message: &str) -> String {
    let mut body = String::from("{");
    field(&mut body, "error", message);
    body.push('}');
    body
}

/// `"name":"value"`, with the value escaped as a JSON string.
fn field(out: &mut String, name: &str, value: &str) {
    let _ = write!(out, "\"{name}\":\"");
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The limits a peek shows: a plan's (`plan`), or the route's own with its shadow limits.
struct Shown<'a> {
    plan: Option<&'a str>,
    limits: &'a [tollgate::Limit],
    /// Every limit in shadow (the route's `shadow`).
    in_shadow: bool,
    shadow_limits: &'a [tollgate::Limit],
}

/// `{"route":..,"kind":..,["plan":..,]"cost":..,"allowed":..,"limits":[{..},..]}`: every
/// limit, enforced then shadow, with what a request of `cost` would get from it.
fn peek_body(
    route: &str,
    kind: &KeySpec,
    cost: u32,
    shown: &Shown<'_>,
    enforced: &Decision,
    shadow: &Decision,
) -> String {
    let mut body = String::from("{");
    field(&mut body, "route", route);
    body.push(',');
    field(&mut body, "kind", &kind.to_string());
    if let Some(plan) = shown.plan {
        body.push(',');
        field(&mut body, "plan", plan);
    }
    let _ = write!(
        body,
        ",\"cost\":{cost},\"allowed\":{},\"limits\":[",
        enforced.is_allowed() || shown.in_shadow
    );
    let limits = shown
        .limits
        .iter()
        .zip(enforced.limits())
        .map(|l| (l, shown.in_shadow))
        .chain(
            shown
                .shadow_limits
                .iter()
                .zip(shadow.limits())
                .map(|l| (l, true)),
        );
    for (i, ((limit, decision), in_shadow)) in limits.enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push('{');
        field(&mut body, "name", limit.name().unwrap_or(""));
        body.push(',');
        field(&mut body, "algorithm", limit.algorithm().as_str());
        let _ = write!(
            body,
            ",\"limit\":{},\"window_ms\":{},\"shadow\":{in_shadow},\"allowed\":{},\
             \"remaining\":{},\"reset_after_ms\":{},\"retry_after_ms\":{}}}",
            limit.limit(),
            limit.window().as_millis(),
            decision.allowed,
            decision.remaining,
            decision.reset_after_ms,
            decision.retry_after_ms,
        );
    }
    body.push_str("]}");
    body
}
