//! The adaptive limit as a stage of `RateLimitLayer`'s pipeline (`with_adaptive`), on the
//! memory store: shedding by priority before the store call, the shed answers (503, 429,
//! gRPC UNAVAILABLE), shadow mode, what a response teaches the limit, the permit given
//! back on every way a request ends, per-key limits, and the stage beside `count_when`,
//! `max_wait`, an in-flight limit, plans and a rules swap. Time is Tokio's, paused where
//! latency matters: no sleeps.

use std::{convert::Infallible, time::Duration};

use axum::body::Body;
use http::{HeaderName, Request, Response, StatusCode, header::RETRY_AFTER};
use http_body_util::BodyExt;
use tollgate::{
    InFlightLimit, Limit, RateLimitLayer,
    adaptive::{Adaptive, AdaptiveHandle, AdaptiveLimit, Aimd, Outcome, Priority},
    count_after::RateLimitBody,
    key::{GlobalKey, HeaderKey},
    plan::{Plan, Plans},
    rules::Rules,
};
use tower::{Layer, Service, ServiceExt, service_fn, util::BoxCloneSyncService};

type Handler = BoxCloneSyncService<Request<Body>, Response<Body>, String>;

/// The handler: 200 "ok" at once; `x-status: N` answers N; `x-grpc-status: N` answers a
/// trailers-only gRPC status; `x-fail` fails; `x-empty` answers an empty body; `x-slow:
/// ms` answers after that long (Tokio's time).
fn handler() -> Handler {
    BoxCloneSyncService::new(service_fn(|req: Request<Body>| async move {
        let headers = req.headers().clone();
        drop(req);
        let header = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_owned());
        if header("x-fail").is_some() {
            return Err("failed".to_owned());
        }
        if let Some(ms) = header("x-slow") {
            tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
        }
        let body = if header("x-empty").is_some() {
            Body::empty()
        } else {
            Body::from("ok")
        };
        let mut response = Response::new(body);
        if let Some(status) = header("x-status") {
            *response.status_mut() = StatusCode::from_u16(status.parse().unwrap()).unwrap();
        }
        if let Some(status) = header("x-grpc-status") {
            response
                .headers_mut()
                .insert("grpc-status", status.parse().unwrap());
        }
        Ok(response)
    }))
}

/// A limit that stays at `n`.
fn fixed(n: u32) -> AdaptiveLimit {
    AdaptiveLimit::new(Aimd::new())
        .with_bounds(n, n, n)
        .unwrap()
}

fn request(headers: &[(&str, &str)]) -> Request<Body> {
    let mut builder = Request::get("/");
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder.body(Body::empty()).unwrap()
}

fn priority(name: &str) -> Request<Body> {
    request(&[("x-priority", name)])
}

fn adaptive(limit: AdaptiveLimit) -> Adaptive {
    Adaptive::new(limit).with_priority_header(HeaderName::from_static("x-priority"))
}

fn layer(adaptive: Adaptive) -> RateLimitLayer<GlobalKey> {
    RateLimitLayer::new(Limit::per_hour(1000).unwrap())
        .with_key(GlobalKey)
        .with_adaptive(adaptive)
}

fn handle<K, C, R, M, E>(layer: &RateLimitLayer<K, C, R, M, E>) -> AdaptiveHandle {
    layer.adaptive_handle().unwrap()
}

/// Calls `service` with `request`: admission happens in `call`, so the future returned
/// holds the permit until it is polled to its end or dropped.
async fn call<S>(service: &mut S, request: Request<Body>) -> S::Future
where
    S: Service<Request<Body>>,
    S::Error: std::fmt::Debug,
{
    service.ready().await.unwrap();
    service.call(request)
}

fn in_flight(handle: &AdaptiveHandle) -> u32 {
    handle.snapshot().in_flight
}

#[tokio::test]
async fn a_flood_of_sheddable_requests_is_shed_503_with_retry_after_while_critical_ones_pass() {
    let layer = layer(adaptive(fixed(10)));
    let handle = handle(&layer);
    let limiter = layer.limiter();
    let mut service = layer.layer(handler());
    // Sheddable requests may use 8 of 10 (20% is kept for default and critical ones).
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(call(&mut service, priority("sheddable")).await);
    }
    let mut shed = 0;
    for _ in 0..20 {
        let response = call(&mut service, priority("sheddable"))
            .await
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[RETRY_AFTER], "1");
        shed += 1;
    }
    // Default ones get one more; critical ones the last.
    held.push(call(&mut service, priority("default")).await);
    let answer = call(&mut service, priority("default")).await.await.unwrap();
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    held.push(call(&mut service, priority("critical")).await);
    assert_eq!(in_flight(&handle), 10);
    let answer = call(&mut service, priority("critical"))
        .await
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    // Every admitted request is served.
    for future in held {
        assert_eq!(future.await.unwrap().status(), StatusCode::OK);
    }
    assert_eq!(handle.snapshot().shed, [20, 1, 1]);
    // Shed requests never reached the store: 10 units spent of 1000, not 32.
    let key = limiter.key_for("").unwrap();
    let decision = limiter.peek(&key, 0).await.unwrap();
    assert_eq!(decision.remaining(), Some(990));
    assert_eq!(shed, 20);
}

#[tokio::test]
async fn the_header_the_extension_and_the_closure_set_the_priority_in_that_order() {
    let layer = layer(adaptive(fixed(10)));
    let mut service = layer.layer(handler());
    let mut held = Vec::new();
    for _ in 0..9 {
        held.push(call(&mut service, priority("critical")).await);
    }
    // 9 in flight: only critical requests pass.
    let shed = |r: &Response<RateLimitBody<Body>>| r.status() == StatusCode::SERVICE_UNAVAILABLE;
    let answer = call(&mut service, priority("nonsense"))
        .await
        .await
        .unwrap();
    assert!(shed(&answer), "an unknown name is the default priority");
    let mut by_extension = priority("critical");
    by_extension.extensions_mut().insert(Priority::Sheddable);
    let answer = call(&mut service, by_extension).await.await.unwrap();
    assert!(shed(&answer), "the extension comes before the header");

    let closure = adaptive(fixed(10)).with_priority(|headers, _| {
        if headers.contains_key("x-vip") {
            Priority::Critical
        } else {
            Priority::Sheddable
        }
    });
    let mut service = self::layer(closure).layer(handler());
    let mut held = Vec::new();
    for _ in 0..9 {
        held.push(call(&mut service, request(&[("x-vip", "1")])).await);
    }
    let mut critical_extension = priority("critical");
    critical_extension
        .extensions_mut()
        .insert(Priority::Critical);
    let answer = call(&mut service, critical_extension).await.await.unwrap();
    assert!(shed(&answer), "the closure comes first");
    let answer = call(&mut service, request(&[("x-vip", "1")]))
        .await
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
}

#[tokio::test]
async fn shed_answers_can_be_429_and_are_unavailable_for_grpc() {
    let stage = adaptive(fixed(1))
        .with_shed_status(StatusCode::TOO_MANY_REQUESTS)
        .unwrap()
        .with_retry_after(Duration::from_millis(2500))
        .unwrap();
    let mut service = layer(stage).layer(handler());
    let _held = call(&mut service, priority("critical")).await;
    let answer = call(&mut service, request(&[])).await.await.unwrap();
    assert_eq!(answer.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(answer.headers()[RETRY_AFTER], "3");

    let grpc = request(&[("content-type", "application/grpc")]);
    let answer = call(&mut service, grpc).await.await.unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
    assert_eq!(answer.headers()["grpc-status"], "14");
    assert_eq!(answer.headers()[RETRY_AFTER], "3");
    assert_eq!(
        answer.headers()["grpc-message"],
        "overloaded: default request shed; retry in 3s"
    );

    let refused = Adaptive::new(fixed(1)).with_shed_status(StatusCode::BAD_GATEWAY);
    assert_eq!(refused.unwrap_err().field(), "adaptive.shed_status");
    let refused = Adaptive::new(fixed(1)).with_retry_after(Duration::ZERO);
    assert_eq!(refused.unwrap_err().field(), "adaptive.retry_after");
    let refused = Adaptive::new(fixed(1)).with_per_key(0);
    assert_eq!(refused.unwrap_err().field(), "adaptive.per_key");
}

#[tokio::test]
async fn a_closure_rejection_hook_keeps_compiling_and_sheds_with_the_defaults() {
    let layer =
        layer(adaptive(fixed(1))).with_on_rejection(|_: &Request<Body>, _: &tollgate::Decision| {
            Response::new(Body::from("limited"))
        });
    let mut service = layer.layer(handler());
    let _held = call(&mut service, request(&[])).await;
    let answer = call(&mut service, request(&[])).await.await.unwrap();
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.headers()[RETRY_AFTER], "1");
}

#[tokio::test]
async fn shadow_mode_admits_everything_and_counts_what_it_would_shed() {
    let layer = layer(adaptive(fixed(2)).with_shadow(true));
    let handle = handle(&layer);
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let mut service = layer.layer(handler());
    let mut held = Vec::new();
    for _ in 0..5 {
        let future =
            metrics::with_local_recorder(&recorder, || service.call(priority("sheddable")));
        held.push(future);
    }
    // The two admitted hold permits (the limit learns from them); three would be shed.
    assert_eq!(handle.snapshot().in_flight, 2);
    assert_eq!(handle.snapshot().shed, [3, 0, 0]);
    for future in held {
        assert_eq!(future.await.unwrap().status(), StatusCode::OK);
    }
    let page = recorder.handle().render();
    let line = page
        .lines()
        .find(|l| {
            l.starts_with("tollgate_adaptive_shed_total{")
                && l.contains(r#"priority="sheddable""#)
                && l.contains(r#"shadow="true""#)
        })
        .unwrap_or_else(|| panic!("{page}"));
    assert!(line.ends_with(" 3"), "{line}");
}

/// Sends one request and reads its body to the end.
async fn served<S>(service: &mut S, request: Request<Body>) -> Result<StatusCode, String>
where
    S: Service<Request<Body>, Response = Response<RateLimitBody<Body>>, Error = String>,
{
    let response = call(service, request).await.await?;
    let status = response.status();
    response.into_body().collect().await.unwrap();
    Ok(status)
}

#[tokio::test(start_paused = true)]
async fn server_errors_lower_an_aimd_limit_and_successes_do_not() {
    let limit = AdaptiveLimit::new(Aimd::new())
        .with_bounds(1, 10, 20)
        .unwrap()
        .with_window(Duration::from_millis(10), 1)
        .unwrap();
    for (headers, expected) in [
        (&[("x-status", "500")][..], 9),
        (&[("x-grpc-status", "14")][..], 9),
        (&[("x-grpc-status", "4")][..], 9),
        (&[("x-fail", "1")][..], 9),
        (&[("x-status", "404")][..], 10),
        (&[("x-grpc-status", "5")][..], 10),
    ] {
        let layer = layer(Adaptive::new(limit));
        let handle = handle(&layer);
        let mut service = layer.layer(handler());
        for _ in 0..2 {
            let _ = served(&mut service, request(headers)).await;
            tokio::time::advance(Duration::from_millis(20)).await;
        }
        let now = handle.snapshot();
        assert_eq!((now.limit, now.in_flight), (expected, 0), "{headers:?}");
    }
    // A classifier of one's own.
    let layer = layer(Adaptive::new(limit).with_outcome(|parts| {
        if parts.status == StatusCode::TOO_MANY_REQUESTS {
            Outcome::Dropped
        } else {
            Outcome::Success
        }
    }));
    let handle = handle(&layer);
    let mut service = layer.layer(handler());
    for headers in [&[("x-status", "500")][..], &[("x-status", "429")][..]] {
        let _ = served(&mut service, request(headers)).await;
        tokio::time::advance(Duration::from_millis(20)).await;
    }
    assert_eq!(handle.snapshot().limit, 9);
}

#[tokio::test]
async fn the_permit_comes_back_on_every_way_a_request_ends_and_limiting_comes_back() {
    let layer = layer(adaptive(fixed(1)));
    let handle = handle(&layer);
    let mut service = layer.layer(handler());
    let shed = |status: StatusCode| status == StatusCode::SERVICE_UNAVAILABLE;

    // The body's end.
    let response = call(&mut service, request(&[])).await.await.unwrap();
    assert_eq!(in_flight(&handle), 1, "held until the body ends");
    assert!(shed(
        call(&mut service, request(&[]))
            .await
            .await
            .unwrap()
            .status()
    ));
    response.into_body().collect().await.unwrap();
    assert_eq!((in_flight(&handle), handle.snapshot().samples), (0, 1));

    // A response future dropped (the client hung up): no sample.
    let future = call(&mut service, request(&[])).await;
    assert_eq!(in_flight(&handle), 1);
    drop(future);
    assert_eq!((in_flight(&handle), handle.snapshot().samples), (0, 1));

    // A body dropped before its end: no sample.
    let response = call(&mut service, request(&[])).await.await.unwrap();
    drop(response);
    assert_eq!((in_flight(&handle), handle.snapshot().samples), (0, 1));

    // An empty body a server drops unread once it says it is over: its end.
    let response = call(&mut service, request(&[("x-empty", "1")]))
        .await
        .await
        .unwrap();
    assert!(http_body::Body::is_end_stream(response.body()));
    drop(response);
    assert_eq!((in_flight(&handle), handle.snapshot().samples), (0, 2));

    // The inner service failing.
    let error = call(&mut service, request(&[("x-fail", "1")])).await.await;
    assert!(error.is_err());
    assert_eq!(in_flight(&handle), 0);

    // Limiting comes back: one in flight again, the next one shed.
    let _held = call(&mut service, request(&[])).await;
    assert!(shed(
        call(&mut service, request(&[]))
            .await
            .await
            .unwrap()
            .status()
    ));
}

#[tokio::test]
async fn a_request_the_limits_deny_gives_its_permit_back_without_a_sample() {
    let layer = RateLimitLayer::new(Limit::per_hour(1).unwrap())
        .with_key(GlobalKey)
        .with_adaptive(adaptive(fixed(5)));
    let handle = handle(&layer);
    let mut service = layer.layer(handler());
    assert_eq!(served(&mut service, request(&[])).await, Ok(StatusCode::OK));
    let denied = call(&mut service, request(&[])).await.await.unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    let now = handle.snapshot();
    assert_eq!((now.in_flight, now.samples, now.shed), (0, 1, [0, 0, 0]));
}

#[tokio::test]
async fn each_key_has_its_own_limit_and_an_evicted_key_gives_its_permits_back() {
    let stage = adaptive(fixed(1)).with_per_key(2).unwrap();
    let layer = RateLimitLayer::new(Limit::per_hour(1000).unwrap())
        .with_key(HeaderKey::new("x-key").unwrap())
        .with_adaptive(stage);
    let handle = handle(&layer);
    let mut service = layer.layer(handler());
    let key = |k: &str| request(&[("x-key", k)]);
    let a = call(&mut service, key("a")).await;
    let shed = call(&mut service, key("a")).await.await.unwrap();
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    // Another key is not held back by the first one's.
    let b = call(&mut service, key("b")).await;
    assert_eq!(handle.snapshot().in_flight, 2);
    assert_eq!(handle.keys(), 2);
    // More keys than kept: some are evicted, their requests in flight still end well.
    let mut more = Vec::new();
    for k in ["c", "d", "e", "f"] {
        more.push(call(&mut service, key(k)).await);
    }
    assert!(handle.keys() <= 2, "{}", handle.keys());
    for future in [a, b].into_iter().chain(more) {
        let response = future.await.unwrap();
        response.into_body().collect().await.unwrap();
    }
    assert_eq!(handle.snapshot().in_flight, 0);
}

#[tokio::test]
async fn exempt_requests_skip_the_stage() {
    let layer = layer(adaptive(fixed(1)))
        .with_exempt(|r: &Request<Body>| r.headers().contains_key("x-health"));
    let handle = handle(&layer);
    let mut service = layer.layer(handler());
    let _held = call(&mut service, request(&[])).await;
    for _ in 0..3 {
        let answer = call(&mut service, request(&[("x-health", "1")]))
            .await
            .await;
        assert_eq!(answer.unwrap().status(), StatusCode::OK);
    }
    assert_eq!(handle.snapshot().shed, [0, 0, 0]);
}

// Composition with the layer's other options.

#[tokio::test]
async fn with_count_when_the_permit_and_the_count_both_settle_at_the_end() {
    let layer = RateLimitLayer::new(Limit::per_hour(2).unwrap())
        .with_key(GlobalKey)
        .with_adaptive(adaptive(fixed(1)))
        .with_count_when(|r: &Response<Body>| r.status().is_server_error());
    let handle = handle(&layer);
    let mut service = layer.layer(handler());
    // Successes do not count: many pass the limit of 2, one at a time.
    for _ in 0..5 {
        let response = call(&mut service, request(&[])).await.await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(in_flight(&handle), 1);
        let shed = call(&mut service, request(&[])).await.await.unwrap();
        assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
        response.into_body().collect().await.unwrap();
        assert_eq!(in_flight(&handle), 0);
    }
    for _ in 0..2 {
        assert_eq!(
            served(&mut service, request(&[("x-status", "500")])).await,
            Ok(StatusCode::INTERNAL_SERVER_ERROR)
        );
    }
    let denied = call(&mut service, request(&[])).await.await.unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(handle.snapshot().samples, 5);
}

#[tokio::test(start_paused = true)]
async fn a_request_that_waits_does_not_count_its_wait_as_latency() {
    // Anything slower than 500 ms is a drop: a wait of 1 s counted would lower the limit.
    // Latency speaks only in a window that pressed against the limit (3/4 of it in
    // flight at once): 8 requests of a limit of 10 at once.
    let aimd = Aimd::new().with_slow(Some(Duration::from_millis(500)));
    let limit = AdaptiveLimit::new(aimd)
        .with_bounds(1, 10, 20)
        .unwrap()
        .with_window(Duration::from_millis(1), 1)
        .unwrap();
    let layer = RateLimitLayer::new(Limit::gcra(1, Duration::from_secs(1)).unwrap())
        .with_key(GlobalKey)
        .with_max_wait(Some(Duration::from_secs(10)))
        .with_adaptive(adaptive(limit));
    let handle = handle(&layer);
    let mut service = layer.layer(handler());
    let first = served(&mut service, request(&[])).await;
    assert_eq!(first, Ok(StatusCode::OK));
    let started = tokio::time::Instant::now();
    // Each waits 1 s more than the one before for its turn, holding its permit.
    let waiting: Vec<_> = (0..8)
        .map(|_| {
            let mut service = service.clone();
            tokio::spawn(async move { served(&mut service, request(&[])).await })
        })
        .collect();
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    assert_eq!(in_flight(&handle), 8, "waiting requests hold their permits");
    // The first one's turn: a pressed window with one fast sample grows the limit by 1
    // (its second of waiting counted would be slow: 10 x 0.9 = 9).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // (The first request was a sample too.)
    assert_eq!(handle.snapshot().samples, 2, "{:?}", handle.snapshot());
    assert_eq!(
        handle.snapshot().limit,
        11,
        "no drop: the wait is not latency"
    );
    for task in waiting {
        assert_eq!(task.await.unwrap(), Ok(StatusCode::OK));
    }
    assert!(started.elapsed() >= Duration::from_secs(8));

    // A slow service is: 600 ms, without a wait, 8 at once.
    let layer = self::layer(adaptive(limit));
    let handle = self::handle(&layer);
    let service = layer.layer(handler());
    let slow: Vec<_> = (0..8)
        .map(|_| {
            let mut service = service.clone();
            tokio::spawn(async move { served(&mut service, request(&[("x-slow", "600")])).await })
        })
        .collect();
    for task in slow {
        assert_eq!(task.await.unwrap(), Ok(StatusCode::OK));
    }
    assert!(handle.snapshot().limit < 10, "{:?}", handle.snapshot());
}

#[tokio::test]
async fn with_an_in_flight_limit_both_permits_come_back() {
    let layer = RateLimitLayer::new(Limit::per_hour(1000).unwrap())
        .with_key(GlobalKey)
        .with_in_flight(InFlightLimit::new(2).unwrap())
        .with_adaptive(adaptive(fixed(3)));
    let handle = handle(&layer);
    let mut service = layer.layer(handler());
    let a = call(&mut service, request(&[])).await;
    let b = call(&mut service, request(&[])).await;
    // The in-flight cap (2) denies the third; the adaptive one (3) would let it in.
    let denied = call(&mut service, request(&[])).await.await.unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(in_flight(&handle), 2);
    for future in [a, b] {
        let response = future.await.unwrap();
        assert!(response.body().holds_permit());
        response.into_body().collect().await.unwrap();
    }
    assert_eq!(in_flight(&handle), 0);
    assert_eq!(served(&mut service, request(&[])).await, Ok(StatusCode::OK));
}

#[tokio::test]
async fn under_plans_and_a_rules_swap_the_stage_keeps_shedding_and_its_state() {
    let plans = Plans::new([
        Plan::new("free", [Limit::per_hour(1000).unwrap()]).unwrap(),
        Plan::unlimited("internal").unwrap(),
    ])
    .unwrap()
    .with_header(HeaderName::from_static("x-plan"));
    let layer = layer(adaptive(fixed(2))).with_plans(plans);
    let handle = handle(&layer);
    let rules = layer.rules_handle();
    let mut service = layer.layer(handler());
    let a = call(&mut service, request(&[("x-plan", "free")])).await;
    let b = call(&mut service, request(&[("x-plan", "internal")])).await;
    for plan in ["free", "internal"] {
        let answer = call(&mut service, request(&[("x-plan", plan)])).await.await;
        assert_eq!(
            answer.unwrap().status(),
            StatusCode::SERVICE_UNAVAILABLE,
            "{plan}"
        );
    }
    rules.set(Rules::new([Limit::per_hour(5).unwrap()]).unwrap());
    assert_eq!(in_flight(&handle), 2, "a swap keeps the state");
    let answer = call(&mut service, request(&[])).await.await.unwrap();
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    for future in [a, b] {
        future.await.unwrap().into_body().collect().await.unwrap();
    }
    assert_eq!(served(&mut service, request(&[])).await, Ok(StatusCode::OK));
    assert_eq!(handle.snapshot().shed, [0, 3, 0]);
}

#[tokio::test]
async fn clones_of_the_layer_and_their_services_share_one_limit() {
    let layer = layer(adaptive(fixed(1)));
    let mut one = layer.layer(handler());
    let mut two = layer.clone().layer(handler());
    let _held = call(&mut one, request(&[])).await;
    let answer = call(&mut two, request(&[])).await.await.unwrap();
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test(start_paused = true)]
async fn a_grpc_status_in_the_trailers_at_the_body_end_is_a_drop() {
    use http_body_util::StreamBody;
    let limit = AdaptiveLimit::new(Aimd::new())
        .with_bounds(1, 10, 20)
        .unwrap()
        .with_window(Duration::from_millis(10), 1)
        .unwrap();
    for (status, expected) in [("14", 9), ("0", 10)] {
        let layer = layer(Adaptive::new(limit));
        let handle = handle(&layer);
        let streaming = BoxCloneSyncService::new(service_fn(move |_: Request<Body>| async move {
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", status.parse().unwrap());
            let frames = [
                Ok::<_, Infallible>(http_body::Frame::data(bytes::Bytes::from("m"))),
                Ok(http_body::Frame::trailers(trailers)),
            ];
            let body = Body::new(StreamBody::new(futures_util::stream::iter(frames)));
            Ok::<_, String>(Response::new(body))
        }));
        let mut service = layer.layer(streaming);
        for _ in 0..2 {
            let response = call(&mut service, request(&[])).await.await.unwrap();
            assert_eq!(in_flight(&handle), 1, "held until the trailers");
            response.into_body().collect().await.unwrap();
            tokio::time::advance(Duration::from_millis(20)).await;
        }
        let now = handle.snapshot();
        assert_eq!(
            (now.limit, now.in_flight),
            (expected, 0),
            "grpc-status {status}"
        );
    }
}
