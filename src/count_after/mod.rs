//! Counting after the response: units that stay spent only when the response says so
//! ([`count_when`](crate::RateLimitLayer::with_count_when)), and costs known only once the
//! response (or its trailers) is there ([`late_cost`](crate::RateLimitLayer::with_late_cost),
//! [`late_cost_from_trailers`](crate::RateLimitLayer::with_late_cost_from_trailers)).
//!
//! # How it counts
//!
//! A request is decided before the inner service runs, exactly as without this: a key
//! over its limit is rejected, and an allowed request's cost is **spent up front**. Once
//! the response is there, the units it should not have cost are given back (a
//! [refund](crate::Adjustment::Refund)), and units it cost beyond its up-front cost are
//! charged (a [top-up](crate::Adjustment::TopUp), counted even over the limit, so that
//! later requests wait until it is paid off).
//!
//! Spending first is what keeps the limit: **at any moment, the units kept plus the units
//! of the requests still in flight are at most the limit** (per window, for the windowed
//! algorithms). Concurrent requests cannot slip through between a check and a charge,
//! because there is no such gap; the price is that a request in flight holds its units
//! until its response says whether to keep them. (`tests/count_after.rs` sends 40
//! concurrent slow requests at a limit of 6 against real Redis: exactly 6 get in, every
//! round.)
//!
//! - **Refunds are exact:** the units go back to the state they were charged to (the same
//!   fixed window, the same sliding-window-counter window, the log entry at the decision's
//!   time, the bucket up to its burst, the GCRA arrival time never before now), and to
//!   nothing once that window is over; never more than was charged.
//! - **Top-ups are forced:** counted even over the limit, and later requests wait until
//!   the debt is paid off: a window counts at most its limit (the debt ends with it), a
//!   token bucket or GCRA key goes at most one burst into debt. The reference model
//!   (`algorithm::adjust`, hidden) says it exactly, and property tests hold the Lua to it.
//! - **gRPC:** a call's status is in its trailers (the HTTP status is 200 either way), so
//!   count gRPC calls by status with
//!   [`late_cost_from_trailers`](crate::RateLimitLayer::with_late_cost_from_trailers), reading
//!   `grpc-status` (`"0"`: `Some(0)` gives the unit back); a trailers-only answer (tonic's
//!   errors) is read from its headers.
//!
//! - A response future dropped before the response (the client hung up) and an inner
//!   service error **keep the units spent**: nothing says the request should not count,
//!   and a client must not escape the count by hanging up (a login attempt it abandons
//!   may have been checked).
//! - A denied request, a request without a key let through, and a request the failure
//!   policy let through (the store failed) are not adjusted: nothing was charged to the
//!   store (a local fallback store's charge stays there).
//! - The adjustment is sent when the response (or the body's end, for trailers) is
//!   there, without making the response wait for it. On the memory store it is applied
//!   at once; on Redis it joins the queue of coalesced decisions in order, so a request
//!   sent after the response is decided after it (with coalescing off, it may overtake).
//!   A refund drops the key's denial from this replica's block cache. A failed
//!   adjustment is logged at `warn` and changes nothing.
//! - The response's rate-limit fields are those of the up-front decision.
//! - It composes with every other feature of the layer: a request is decided under its
//!   [plan](crate::plan)'s limits and charged there; its [shadow limits](crate::guide::shadow)
//!   are charged and settled alike; with [`max_wait`](crate::RateLimitLayer::with_max_wait) a
//!   request that waited keeps the charge it waited for (a reserved one, from the moment
//!   it was reserved), so **kept + in flight + reserved units are at most the limit**;
//!   a request the [local fallback](crate::FailurePolicy::Local) decided is settled in
//!   that store.
//! - [Lockouts](crate::Limit::with_lockout) count only what is kept: the units of
//!   requests in flight are *pending* in the store until their response settles them
//!   ([`Adjustment::Settle`](crate::Adjustment::Settle), sent for every allowed charge of
//!   such a layer, kept or not), and a denied request starts a block only when the kept
//!   units alone would deny it. While requests in flight fill the limit, a request is
//!   denied (429, `Retry-After` the algorithm's) without a block. Pending units count for
//!   their window (every algorithm but the fixed window: the next one too); a request in
//!   flight longer than that counts as kept.
//! - The store must implement [`Store::adjust`](crate::store::Store::adjust) (the memory and
//!   Redis stores do: [`Capability::Adjust`](crate::store::Capability::Adjust)), else the
//!   layer is refused when it is built
//!   ([`RateLimitLayer::validate`](crate::RateLimitLayer::validate)), and say when it
//!   decided ([`Decision::decided_at_ms`](crate::Decision::decided_at_ms)); a decision
//!   without that time keeps its units spent.
//! - In the example gateway: `count_when = "failure"` and `cost_header = "<name>"` on a
//!   route (gateway/README.md, "Counting after the response").
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Limit, RateLimitLayer, key::GlobalKey};
//!
//! // Five failed logins a minute; successful ones do not count.
//! let layer = RateLimitLayer::new(Limit::per_minute(5)?)
//!     .with_key(GlobalKey)
//!     .with_count_when(|response: &http::Response<axum::body::Body>| {
//!         response.status().is_client_error()
//!     });
//! # let _ = layer;
//! # Ok::<(), tollgate::ConfigError>(())
//! ```
//!
//! Costs known from the response, from a header or from a gRPC trailer read when the
//! response body ends (an LLM API's tokens):
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Limit, RateLimitLayer, key::HeaderKey};
//!
//! // 10 000 tokens an hour: 1 up front, then what the `x-tokens-used` header says.
//! let tokens = RateLimitLayer::new(Limit::token_bucket(10_000, Duration::from_secs(3600))?)
//!     .with_key(HeaderKey::new("x-api-key")?)
//!     .with_late_cost(|response: &http::Response<axum::body::Body>| {
//!         response.headers().get("x-tokens-used")?.to_str().ok()?.parse().ok()
//!     });
//! // The same from a gRPC trailer.
//! let grpc = RateLimitLayer::new(Limit::token_bucket(10_000, Duration::from_secs(3600))?)
//!     .with_key(HeaderKey::new("x-api-key")?)
//!     .with_late_cost_from_trailers(|trailers: Option<&http::HeaderMap>| {
//!         trailers?.get("x-tokens-used")?.to_str().ok()?.parse().ok()
//!     });
//! # let _ = (tokens, grpc);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;

use http::{HeaderMap, Response};

mod body;
mod charged;

pub use body::{CountedBody, RateLimitBody};
pub use charged::Charged;
pub(crate) use charged::Held;

/// Decides, from the response, what a request finally costs: the last type parameter of
/// [`RateLimitLayer`](crate::RateLimitLayer). [`UpFront`] (the default) keeps the
/// up-front charge; [`CountWhen`], [`LateCost`] and [`TrailerCost`] count after the
/// response, made by the layer's builder methods.
pub trait Recount<B>: Clone + Send + Sync + 'static {
    /// Whether the layer settles charges after the response: `false` only for
    /// [`UpFront`], whose requests then carry no charge at all.
    const AFTER: bool = true;

    /// The body of the responses the service answers with.
    type Body;

    /// Settles `charged` (the request's up-front charge, `None` when nothing was charged)
    /// from `response`, and passes the response on.
    fn finish(&self, response: Response<B>, charged: Option<Charged>) -> Response<Self::Body>;
}

/// Counts a request up front, when it is decided, and never after: the default.
#[derive(Debug, Clone, Copy, Default)]
pub struct UpFront;

impl<B> Recount<B> for UpFront {
    const AFTER: bool = false;

    type Body = RateLimitBody<B>;

    /// Only a request of an [in-flight limit](crate::InFlightLimit) carries a charge
    /// here (its permit, no units to settle): the body holds it until it ends.
    #[inline(always)]
    fn finish(&self, response: Response<B>, charged: Option<Charged>) -> Response<Self::Body> {
        RateLimitBody::wrap(
            response,
            charged.map(|charged| {
                let cost = charged.cost;
                charged.decided(cost)
            }),
        )
    }
}

/// Keeps a request's units only when the predicate holds on its response. Made by
/// [`RateLimitLayer::with_count_when`](crate::RateLimitLayer::with_count_when).
#[derive(Clone, Copy)]
pub struct CountWhen<P>(pub(crate) P);

// By hand: closures are not `Debug`.
impl<F> fmt::Debug for CountWhen<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CountWhen(..)")
    }
}

impl<B, P> Recount<B> for CountWhen<P>
where
    P: Fn(&Response<B>) -> bool + Clone + Send + Sync + 'static,
{
    type Body = RateLimitBody<B>;

    fn finish(&self, response: Response<B>, charged: Option<Charged>) -> Response<Self::Body> {
        let charged = charged.and_then(|charged| {
            let units = if (self.0)(&response) { charged.cost } else { 0 };
            charged.settle_or_hold(units)
        });
        RateLimitBody::wrap(response, charged)
    }
}

/// Charges what the response says the request cost (`None`: its up-front cost). Made by
/// [`RateLimitLayer::with_late_cost`](crate::RateLimitLayer::with_late_cost).
#[derive(Clone, Copy)]
pub struct LateCost<F>(pub(crate) F);

// By hand: closures are not `Debug`.
impl<F> fmt::Debug for LateCost<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LateCost(..)")
    }
}

impl<B, F> Recount<B> for LateCost<F>
where
    F: Fn(&Response<B>) -> Option<u32> + Clone + Send + Sync + 'static,
{
    type Body = RateLimitBody<B>;

    fn finish(&self, response: Response<B>, charged: Option<Charged>) -> Response<Self::Body> {
        let charged = charged.and_then(|charged| {
            let cost = charged.cost;
            charged.settle_or_hold((self.0)(&response).unwrap_or(cost))
        });
        RateLimitBody::wrap(response, charged)
    }
}

/// Charges what the response's trailers say the request cost, once its body ends
/// (`None`, or no trailers: its up-front cost). A trailers-only gRPC response
/// (`grpc-status` in its headers) is read at once, its headers as its trailers. Made by
/// [`RateLimitLayer::with_late_cost_from_trailers`](crate::RateLimitLayer::with_late_cost_from_trailers); responses get a [`CountedBody`].
#[derive(Clone, Copy)]
pub struct TrailerCost<F>(pub(crate) F);

// By hand: closures are not `Debug`.
impl<F> fmt::Debug for TrailerCost<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TrailerCost(..)")
    }
}

impl<B, F> Recount<B> for TrailerCost<F>
where
    F: Fn(Option<&HeaderMap>) -> Option<u32> + Clone + Send + Sync + 'static,
{
    type Body = CountedBody<B, F>;

    fn finish(&self, response: Response<B>, charged: Option<Charged>) -> Response<Self::Body> {
        // A trailers-only gRPC answer (an error status, most often) carries its trailers
        // in its headers: they are read now.
        let charged = match charged {
            Some(mut charged) if response.headers().contains_key("grpc-status") => {
                charged.ended();
                let cost = charged.cost;
                charged.settle((self.0)(Some(response.headers())).unwrap_or(cost));
                None
            }
            charged => charged,
        };
        response.map(|inner| CountedBody::counting(inner, charged.map(|c| (c, self.0.clone()))))
    }
}
