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
//!   ([`Adjustment::Settle`], sent for every allowed charge of
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

use std::{
    fmt,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};

use http::{HeaderMap, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::{
    Adjustment, Decision, Limit, StoreError,
    key::Key,
    store::{Check, Guarded, Permit},
};

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
            Some(charged) if response.headers().contains_key("grpc-status") => {
                let cost = charged.cost;
                charged.settle((self.0)(Some(response.headers())).unwrap_or(cost));
                None
            }
            charged => charged,
        };
        response.map(|inner| CountedBody {
            inner,
            pending: charged.map(|charged| (charged, self.0.clone())),
        })
    }
}

pin_project! {
    /// The response body of a [`RateLimit`](crate::RateLimit) service (with
    /// [`UpFront`], [`CountWhen`] or [`LateCost`] counting): the inner body, and for a
    /// request of an [in-flight limit](crate::InFlightLimit) its permit (and its
    /// adjustment), given back in one store call when the body ends, fails or is
    /// dropped. Without an in-flight limit it holds nothing and only passes the body on.
    pub struct RateLimitBody<B> {
        #[pin]
        inner: B,
        // Boxed: a body without one (the plain path) grows by a pointer only.
        held: Option<Box<Charged>>,
    }
}

impl<B> RateLimitBody<B> {
    /// `inner`, holding nothing.
    pub fn new(inner: B) -> Self {
        Self { inner, held: None }
    }

    #[inline(always)]
    fn wrap(response: Response<B>, held: Option<Charged>) -> Response<Self> {
        let held = held.map(Box::new);
        response.map(|inner| Self { inner, held })
    }

    /// Whether the body still holds its request's in-flight permit.
    pub fn holds_permit(&self) -> bool {
        self.held.as_ref().is_some_and(|held| held.holds_permit())
    }

    /// The body it wraps.
    pub fn into_inner(self) -> B {
        self.inner
    }
}

impl<B: Default> Default for RateLimitBody<B> {
    fn default() -> Self {
        Self::new(B::default())
    }
}

impl<B: fmt::Debug> fmt::Debug for RateLimitBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitBody")
            .field("inner", &self.inner)
            .field("held", &self.held)
            .finish()
    }
}

impl<B: Body> Body for RateLimitBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    #[inline]
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        let frame = ready!(this.inner.as_mut().poll_frame(cx));
        // The end, or an error (the body is over): the request is no longer in flight,
        // and its charge settles (dropped, with the units decided at the response).
        if this.held.is_some() && (!matches!(frame, Some(Ok(_))) || this.inner.is_end_stream()) {
            this.held.take();
        }
        Poll::Ready(frame)
    }

    #[inline]
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    #[inline]
    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project! {
    /// A response body that settles its request's charge from its trailers when it ends.
    /// A body dropped before its end keeps the charge.
    pub struct CountedBody<B, F> {
        #[pin]
        inner: B,
        pending: Option<(Charged, F)>,
    }
}

impl<B, F> CountedBody<B, F> {
    /// The body it wraps, for a response that needs no counting.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            pending: None,
        }
    }
}

impl<B: fmt::Debug, F> fmt::Debug for CountedBody<B, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountedBody")
            .field("inner", &self.inner)
            .field("pending", &self.pending.as_ref().map(|(c, _)| c))
            .finish()
    }
}

impl<B, F> Body for CountedBody<B, F>
where
    B: Body,
    F: Fn(Option<&HeaderMap>) -> Option<u32>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = ready!(this.inner.poll_frame(cx));
        match &frame {
            Some(Ok(frame)) => {
                if let Some(trailers) = frame.trailers_ref()
                    && let Some((charged, read)) = this.pending.take()
                {
                    let cost = charged.cost;
                    charged.settle(read(Some(trailers)).unwrap_or(cost));
                }
            }
            None => {
                if let Some((charged, read)) = this.pending.take() {
                    let cost = charged.cost;
                    charged.settle(read(None).unwrap_or(cost));
                }
            }
            // A body that failed keeps the charge.
            Some(Err(_)) => {
                this.pending.take();
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        // Not before the charge is settled: the last poll, which sees the end, settles it.
        self.pending.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// One store's charge of a request: the store, the limits charged, and when.
pub(crate) type Charge = (Guarded, Arc<[Limit]>, u64);

/// A request's up-front charge, until its response settles it: dropped unsettled, the
/// units stay spent.
pub struct Charged {
    /// The layer's name, for the log.
    layer: Arc<str>,
    key: Key,
    cost: u32,
    /// The store and limits charged, and when: the enforced ones and the shadow ones
    /// (each only when its call allowed the request).
    charges: [Option<Charge>; 2],
    /// The in-flight permit of the request, given back with the enforced adjustment.
    permit: Option<Held>,
    /// What the request costs in the end, once known, while its permit is held (until
    /// the body ends): settled when dropped.
    units: Option<u32>,
}

impl Drop for Charged {
    fn drop(&mut self) {
        // Held until the body is over: settle what the response decided. (Without
        // decided units the permit's own drop gives it back; the units stay spent.)
        if let Some(units) = self.units.take() {
            self.finish(units);
        }
    }
}

impl fmt::Debug for Charged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Charged")
            .field("key", &self.key.redacted())
            .field("cost", &self.cost)
            .finish_non_exhaustive()
    }
}

impl Charged {
    pub(crate) fn new(layer: Arc<str>, key: Key, cost: u32, charges: [Option<Charge>; 2]) -> Self {
        Self {
            layer,
            key,
            cost,
            charges,
            permit: None,
            units: None,
        }
    }

    /// The same charge holding the request's in-flight permit.
    pub(crate) fn holding(mut self, permit: Held) -> Self {
        self.permit = Some(permit);
        self
    }

    /// Whether it holds an in-flight permit.
    pub fn holds_permit(&self) -> bool {
        self.permit.is_some()
    }

    /// The same charge, to settle at `units` when dropped.
    fn decided(mut self, units: u32) -> Self {
        self.units = Some(units);
        self
    }

    /// Settles at `units` now, or, holding a permit, returns the charge to settle at
    /// `units` when the body is over (the permit's release and the adjustment go in one
    /// store call).
    fn settle_or_hold(self, units: u32) -> Option<Self> {
        if self.permit.is_some() {
            return Some(self.decided(units));
        }
        self.settle(units);
        None
    }

    /// The units charged up front.
    pub fn cost(&self) -> u32 {
        self.cost
    }

    /// Makes the request cost `units` in the end: gives back or charges the difference
    /// (and gives its in-flight permit back, in the same store call).
    pub fn settle(mut self, units: u32) {
        self.units = None;
        self.finish(units);
    }

    fn finish(&mut self, units: u32) {
        let adjustment = |at: u64| {
            if units < self.cost {
                Some(Adjustment::Refund {
                    units: self.cost - units,
                    charged_at_ms: at,
                })
            } else if units > self.cost {
                Some(Adjustment::TopUp {
                    units: units - self.cost,
                })
            } else {
                None
            }
        };
        let mut permit = self.permit.take();
        for index in 0..self.charges.len() {
            let Some((store, limits, at)) = self.charges[index].take() else {
                continue;
            };
            // A lockout that counts pending units hears of every charge it allowed.
            let adjustment = if self.cost > 0 && limits.iter().any(Limit::pending) {
                Some(Adjustment::Settle {
                    charged: self.cost,
                    kept: units,
                    charged_at_ms: at,
                })
            } else {
                adjustment(at)
            };
            // The enforced limits' adjustment goes with the permit's release.
            if index == 0
                && let Some(held) = permit.take()
            {
                held.release(adjustment.map(|adjustment| (adjustment, limits)));
                continue;
            }
            let Some(adjustment) = adjustment else {
                continue;
            };
            match store.adjust_now(&self.key, &limits, adjustment) {
                Ok(result) => self.report(result),
                Err(check) => self.wait(check),
            }
        }
        if let Some(held) = permit {
            held.release(None);
        }
    }

    /// Lets a pending adjustment finish on its own: it is already queued in order (see
    /// the [module docs](self)); only its outcome is waited for.
    fn wait(&self, check: Check) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                layer = &*self.layer,
                "rate limit adjustment dropped: no runtime"
            );
            return;
        };
        let layer = self.layer.clone();
        let key = self.key.redacted().to_string();
        runtime.spawn(async move {
            if let Err(error) = check.await {
                let error = error.chain();
                tracing::warn!(error = %error, key, layer = &*layer, "rate limit adjustment failed");
            }
        });
    }

    fn report(&self, result: Result<Decision, StoreError>) {
        if let Err(error) = result {
            let error = error.chain();
            let key = self.key.redacted();
            tracing::warn!(error = %error, key = %key, layer = &*self.layer, "rate limit adjustment failed");
        }
    }
}

/// A request's in-flight permit, given back to the store that took it when dropped,
/// or together with the request's adjustment through [`release`](Self::release).
pub(crate) struct Held {
    store: Guarded,
    limits: Arc<[Limit]>,
    permit: Option<Permit>,
    layer: Arc<str>,
}

impl fmt::Debug for Held {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Held")
            .field("permit", &self.permit)
            .finish_non_exhaustive()
    }
}

impl Held {
    pub(crate) fn new(
        store: Guarded,
        limits: Arc<[Limit]>,
        permit: Permit,
        layer: Arc<str>,
    ) -> Self {
        Self {
            store,
            limits,
            permit: Some(permit),
            layer,
        }
    }

    /// The permit, no longer given back when this is dropped: the caller holds it now.
    pub(crate) fn into_permit(mut self) -> Option<Permit> {
        self.permit.take()
    }

    /// Gives the permit back, with `adjustment` of `limits` (those of the permit's that
    /// count after the response) in the same store call. Around the circuit breaker: a
    /// permit is given back even while requests skip the store (if the store fails, its
    /// TTL ends it).
    pub(crate) fn release(mut self, adjustment: Option<(Adjustment, Arc<[Limit]>)>) {
        self.give_back(adjustment);
    }

    fn give_back(&mut self, adjustment: Option<(Adjustment, Arc<[Limit]>)>) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        let key: Key = permit.key().clone();
        let (adjustment, limits) = match adjustment {
            Some((adjustment, limits)) => (Some(adjustment), limits),
            None => (None, self.limits.clone()),
        };
        let check = self
            .store
            .store()
            .release_in_flight(permit, &limits, adjustment);
        match check.into_ready() {
            Ok(result) => report(&self.layer, &key, result),
            Err(check) => {
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    tracing::warn!(
                        layer = &*self.layer,
                        "in-flight permit not given back: no runtime (its TTL ends it)"
                    );
                    return;
                };
                let layer = self.layer.clone();
                runtime.spawn(async move { report(&layer, &key, check.await) });
            }
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.give_back(None);
    }
}

fn report(layer: &str, key: &Key, result: Result<Decision, StoreError>) {
    if let Err(error) = result {
        let error = error.chain();
        let key = key.redacted();
        tracing::warn!(error = %error, key = %key, layer, "in-flight permit release failed");
    }
}
