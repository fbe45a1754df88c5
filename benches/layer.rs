//! What the layer adds to one request, on the memory store: an inner service that answers
//! at once, alone and behind `RateLimitLayer` (allowing, with and without rate-limit
//! fields, and denying; with the `metrics` feature, also reporting to a Prometheus
//! recorder). The futures are ready at the first poll, so no runtime is timed.

use std::{convert::Infallible, hint::black_box, time::Duration};

use criterion::{BenchmarkId, Criterion};
use futures_util::FutureExt;
use http::{HeaderValue, Request, Response, header::CONTENT_TYPE};
use tollgate::{Limit, RateLimitLayer, headers::HeaderStyle, key::GlobalKey};
use tower::{Layer, Service, ServiceExt, service_fn};

/// What a hello-world handler answers: a body and a content type.
async fn hello(_request: Request<()>) -> Result<Response<&'static str>, Infallible> {
    let mut response = Response::new("Hello, World!");
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    Ok(response)
}

fn run<S, B>(service: &mut S) -> Response<B>
where
    S: Service<Request<()>, Response = Response<B>, Error = Infallible>,
{
    let ready = service
        .ready()
        .now_or_never()
        .expect("ready")
        .expect("infallible");
    ready
        .call(Request::new(()))
        .now_or_never()
        .expect("decided at the first poll")
        .expect("infallible")
}

pub(crate) fn bench_all(c: &mut Criterion) {
    let window = Duration::from_secs(1);
    let allow = Limit::fixed_window(1_000_000_000, window).unwrap();
    let allow_limit = allow.clone();
    let deny = Limit::fixed_window(1, Duration::from_secs(3600)).unwrap();
    let mut group = c.benchmark_group("layer");
    group.bench_function(BenchmarkId::from_parameter("inner_alone"), |b| {
        let mut service = service_fn(hello);
        b.iter(|| black_box(run(&mut service)));
    });
    let cases = [
        ("memory_allow", allow.clone(), HeaderStyle::default()),
        ("memory_allow_no_fields", allow, HeaderStyle::NONE),
        ("memory_deny", deny, HeaderStyle::default()),
    ];
    for (name, limit, style) in cases {
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            let mut service = RateLimitLayer::new(limit.clone())
                .with_key(GlobalKey)
                .with_headers(style)
                .layer(service_fn(hello));
            b.iter(|| black_box(run(&mut service)));
        });
    }
    // The same inside axum: a Router whose route the layer wraps, as `Router::layer` does
    // in an application (the inner service is then axum's boxed route, cloned by the layer
    // for each request).
    let axum_cases = [
        ("axum_alone", None),
        (
            "axum_memory_allow",
            Some(RateLimitLayer::new(allow_limit.clone()).with_key(GlobalKey)),
        ),
    ];
    for (name, layer) in axum_cases {
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            let router =
                axum::Router::new().route("/", axum::routing::get(|| async { "Hello, World!" }));
            let router = match layer.clone() {
                Some(layer) => router.layer(layer),
                None => router,
            };
            // What `axum::serve` does once: turn the handlers into routes (else axum
            // would build them, with the layer, on every call).
            let mut router = router.with_state(());
            b.iter(|| {
                let request = Request::get("/").body(axum::body::Body::empty()).unwrap();
                let response = router
                    .call(request)
                    .now_or_never()
                    .expect("decided at the first poll")
                    .expect("infallible");
                black_box(response)
            });
        });
    }
    // With the `metrics` feature, the same layer reporting to a Prometheus recorder.
    #[cfg(feature = "metrics")]
    group.bench_function(
        BenchmarkId::from_parameter("memory_allow_prometheus"),
        |b| {
            let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
            let _current = metrics::set_default_local_recorder(&recorder);
            let mut service = RateLimitLayer::new(
                Limit::fixed_window(1_000_000_000, Duration::from_secs(1)).unwrap(),
            )
            .with_key(GlobalKey)
            .layer(service_fn(hello));
            b.iter(|| black_box(run(&mut service)));
        },
    );
    group.finish();
}
