//! One scenario for every store: keys of different kinds never share state.
//!
//! Separately built layers with the same unnamed limit share one store. Each asks for one
//! request per hour, keyed by a different extractor, for identities an attacker can spell
//! in a header: a client's IP, `global`, another header's value. Each kind must keep its
//! own budget (the first request of each is allowed), and each budget must still hold
//! (its second request is limited). Included by `tests/hostile.rs` (memory),
//! `tests/redis.rs` and `tests/cluster.rs`.

#![allow(dead_code, unreachable_pub)]

use std::{
    convert::Infallible,
    fmt,
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use http::{Request, Response, StatusCode};
use tollgate::{
    Limit, RateLimitLayer,
    key::{ClientIp, ExtensionKey, GlobalKey, HeaderKey, KeyExtractor, PeerIp},
    store::Store,
};
use tower::{Layer, ServiceExt, service_fn};

/// The victim's address.
const VICTIM: &str = "203.0.113.9";

/// An authenticated user whose id an auth layer put in the extensions.
#[derive(Clone)]
struct UserId(&'static str);

impl fmt::Display for UserId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

/// A request from `peer`, with `headers` and an optional [`UserId`].
fn request(peer: &str, headers: &[(&str, &str)], user: Option<&'static str>) -> Request<()> {
    let mut request = Request::get("/");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let mut request = request.body(()).unwrap();
    let peer: IpAddr = peer.parse().unwrap();
    request
        .extensions_mut()
        .insert(SocketAddr::new(peer, 40_000));
    if let Some(user) = user {
        request.extensions_mut().insert(UserId(user));
    }
    request
}

/// What a new layer (1 per hour, no name) keyed by `key` on `store` answers `request`.
async fn status<K: KeyExtractor<()>>(
    store: &Arc<dyn Store>,
    key: K,
    request: Request<()>,
) -> StatusCode {
    let limit = Limit::fixed_window(1, Duration::from_secs(3600)).unwrap();
    let layer = RateLimitLayer::new(limit)
        .with_store(store.clone())
        .with_key(key);
    let service = layer.layer(service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let response = tokio::time::timeout(Duration::from_secs(5), service.oneshot(request))
        .await
        .expect("an answer within 5 s")
        .unwrap();
    response.status()
}

/// The first request of each kind on a store nobody has used yet is allowed; the second
/// is limited. `store` must use a clock that does not cross an hour boundary meanwhile.
pub async fn kinds_never_share_state(store: Arc<dyn Store>) {
    const OK: StatusCode = StatusCode::OK;
    const LIMITED: StatusCode = StatusCode::TOO_MANY_REQUESTS;
    let api_key = || HeaderKey::new("x-api-key").unwrap();
    let user_header = || HeaderKey::new("x-user").unwrap();
    let attacker = "198.51.100.66";
    // A closure that reads a header the way users write them.
    let closure = |request: &Request<()>| {
        request
            .headers()
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };

    // Each kind's first request, most of them spelling the victim's address.
    let firsts: Vec<(&str, StatusCode)> = vec![
        (
            "peer ip",
            status(&store, PeerIp::new(), request(VICTIM, &[], None)).await,
        ),
        (
            "global",
            status(&store, GlobalKey, request(VICTIM, &[], None)).await,
        ),
        (
            "x-api-key = the victim's ip",
            status(
                &store,
                api_key(),
                request(attacker, &[("x-api-key", VICTIM)], None),
            )
            .await,
        ),
        (
            "x-api-key = global",
            status(
                &store,
                api_key(),
                request(attacker, &[("x-api-key", "global")], None),
            )
            .await,
        ),
        (
            "x-user = x-api-key's value",
            status(
                &store,
                user_header(),
                request(attacker, &[("x-user", VICTIM)], None),
            )
            .await,
        ),
        (
            "closure = the victim's ip",
            status(
                &store,
                closure,
                request(attacker, &[("x-tenant", VICTIM)], None),
            )
            .await,
        ),
        (
            "closure = global",
            status(
                &store,
                closure,
                request(attacker, &[("x-tenant", "global")], None),
            )
            .await,
        ),
        (
            "extension = the victim's ip",
            status(
                &store,
                ExtensionKey::<UserId>::new(),
                request(attacker, &[], Some(VICTIM)),
            )
            .await,
        ),
        (
            "x-api-key = an IPv6 network",
            status(
                &store,
                api_key(),
                request(attacker, &[("x-api-key", "2001:db8::/64")], None),
            )
            .await,
        ),
        (
            "peer ip in that network",
            status(&store, PeerIp::new(), request("2001:db8::1", &[], None)).await,
        ),
    ];
    let shared: Vec<&str> = firsts
        .iter()
        .filter(|(_, got)| *got != OK)
        .map(|(kind, _)| *kind)
        .collect();
    assert!(
        shared.is_empty(),
        "these kinds found their budget spent by another kind: {shared:?}"
    );

    // Every budget holds: the second request of each kind is limited.
    let seconds = [
        status(&store, PeerIp::new(), request(VICTIM, &[], None)).await,
        status(&store, GlobalKey, request(attacker, &[], None)).await,
        status(
            &store,
            api_key(),
            request(VICTIM, &[("x-api-key", VICTIM)], None),
        )
        .await,
        status(
            &store,
            user_header(),
            request(VICTIM, &[("x-user", VICTIM)], None),
        )
        .await,
        status(
            &store,
            closure,
            request(VICTIM, &[("x-tenant", "global")], None),
        )
        .await,
        status(
            &store,
            ExtensionKey::<UserId>::new(),
            request(VICTIM, &[], Some(VICTIM)),
        )
        .await,
    ];
    assert_eq!(seconds, [LIMITED; 6]);

    // PeerIp and ClientIp name the same thing, a client address: one budget.
    let client_ip = status(&store, ClientIp::new([]), request(VICTIM, &[], None)).await;
    assert_eq!(
        client_ip, LIMITED,
        "ClientIp and PeerIp share the ip namespace"
    );
}
