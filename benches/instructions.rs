//! Instructions per request on the layer's ready path, for callgrind: memory store,
//! `GlobalKey`, one fixed window, an inner `service_fn` answering at once, `now_or_never`.
//!
//! `valgrind --tool=callgrind --toggle-collect=instructions::measure target/release/deps/instructions-* CASE N`
//! then divide the instructions by N. CASE: allow, allow_no_fields, deny.

use std::{convert::Infallible, hint::black_box, time::Duration};

use futures_util::FutureExt;
use http::{Request, Response};
use tollgate::{Limit, RateLimitLayer, headers::HeaderStyle, key::GlobalKey};
use tower::{Layer, Service, service_fn};

#[inline(never)]
fn measure<S, B>(service: &mut S, n: u32)
where
    S: Service<Request<()>, Response = Response<B>, Error = Infallible>,
{
    for _ in 0..n {
        let response = service
            .call(black_box(Request::new(())))
            .now_or_never()
            .unwrap()
            .unwrap();
        black_box(response);
    }
}

/// The sizes of `service`'s response future and response (`SIZES=1`: printed before
/// measuring).
fn sizes<S: Service<Request<()>>>(_: &S) -> (usize, usize) {
    (size_of::<S::Future>(), size_of::<S::Response>())
}

fn main() {
    let mut args = std::env::args().skip(1);
    let case = args.next().unwrap_or_else(|| "allow".into());
    let n: u32 = args.next().map_or(10_000, |n| n.parse().unwrap());
    let limit = match case.as_str() {
        "deny" => Limit::fixed_window(1, Duration::from_secs(3600)).unwrap(),
        _ => Limit::fixed_window(100_000_000, Duration::from_secs(3600)).unwrap(),
    };
    let mut layer = RateLimitLayer::new(limit).with_key(GlobalKey);
    if case == "allow_no_fields" {
        layer = layer.with_headers(HeaderStyle::NONE);
    }
    let inner = service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) });
    let mut service = layer.layer(inner);
    if std::env::var_os("SIZES").is_some() {
        let (future, response) = sizes(&service);
        eprintln!("future {future} bytes, response {response} bytes");
    }
    // Warm, outside the measured function: the clock calibrated, the key made, a deny
    // case over its limit.
    for _ in 0..10 {
        black_box(service.call(Request::new(())).now_or_never());
    }
    measure(&mut service, n);
}
