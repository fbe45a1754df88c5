//! [`InFlightLayer`]: at most N requests in flight per key.
//!
//! A rate limit counts requests when they start, so a client may hold any number of long
//! requests open (streams, uploads, slow responses) and stay within it. This layer counts
//! the requests *running* per key instead: a request takes a permit when it starts and
//! gives it back when its response body ends (or is dropped), when its response future
//! is dropped, or when the inner service fails. A request that finds all `max` permits of
//! its key held is answered 429 with `Retry-After` (gRPC: `RESOURCE_EXHAUSTED`) by the
//! same [`OnRejection`] hook as [`RateLimitLayer`](crate::RateLimitLayer)'s.
//!
//! It is a layer of its own, so that `RateLimitLayer`'s response type and cost stay as
//! they are; stack the two to have both:
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, routing::get};
//! use tollgate::{InFlightLayer, Limit, RateLimitLayer, key::HeaderKey};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let app: Router = Router::new()
//!     .route("/", get(|| async { "hello" }))
//!     // At most 4 requests at once per API key ...
//!     .layer(InFlightLayer::new(4)?.key(HeaderKey::new("x-api-key")?))
//!     // ... and 100 a minute.
//!     .layer(RateLimitLayer::new(Limit::per_minute(100)?).key(HeaderKey::new("x-api-key")?));
//! # Ok(()) }
//! ```
//!
//! # Stores
//!
//! - In memory (the default): permits are counted in the process; a key with no request
//!   in flight takes no memory.
//! - Redis, one node or a cluster (feature `redis`, [`InFlightLayer::store`]): permits are
//!   leases in a sorted set `<prefix>:{<key>}:inflight:<max>` (one hash tag, so one
//!   cluster slot), renewed every third of the [lease](InFlightLayer::lease) while the
//!   request runs and removed when it ends. **A node that dies holds its permits at most
//!   one lease longer** ([`DEFAULT_LEASE`], 10 s). When Redis fails or does not answer
//!   within the [timeout](InFlightLayer::timeout), the layer's [`FailurePolicy`] applies:
//!   allow (default), deny (503), or count the permits in the process until Redis answers
//!   again.
//! - If Redis loses the permits (a restart without persistence, a failover to a replica
//!   that had not seen them), requests that get in before the running ones renew may
//!   exceed `max` for up to a third of the lease (plus the time Redis takes to answer
//!   again): the next renewal of each running request adds its permit back (logged at
//!   `warn`), even beyond `max`, because the request still runs. New requests are then
//!   refused until enough running ones end.
//! - A permit whose removal fails (Redis out of reach when its request ends) is removed
//!   once Redis answers again (tried again after 100 ms, doubling up to a third of the
//!   lease); at the latest its lease ends it, one lease after its last renewal.

use std::{
    collections::HashMap,
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};

use bytes::Buf;
use http::{HeaderValue, Request, Response, header::RETRY_AFTER};
use parking_lot::Mutex;
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use crate::{
    ConfigError, Decision, FailurePolicy, LimitDecision, MissingKey,
    headers::ceil_secs,
    key::{Key, KeyExtractor, PeerIp},
    rejection::{DefaultRejection, OnRejection},
    store::Store,
};

/// Permits shared between replicas, as a [`Store`] keeps them: what
/// [`Store::in_flight_permits`] returns for [`InFlightLayer::shared_store`].
#[derive(Debug, Clone)]
pub struct SharedPermits(Backend);

#[derive(Debug, Clone)]
enum Backend {
    #[cfg(feature = "redis")]
    Redis(crate::store::RedisStore),
}

#[cfg(feature = "redis")]
impl SharedPermits {
    pub(crate) fn redis(store: crate::store::RedisStore) -> Self {
        Self(Backend::Redis(store))
    }
}

/// The `Retry-After` a request denied by an [`InFlightLayer`] gets by default: 1 s. No
/// one knows when a request in flight will end; a second is a short wait for a client and
/// a long one for a server that is busy.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// How long a permit in Redis lives without renewal by default: 10 s. It bounds how long
/// the permits of a node that died stay taken.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

/// Allows at most `max` requests in flight per key. See the [module docs](crate::in_flight).
///
/// Clones of the layer, and every service it makes, share the permits.
pub struct InFlightLayer<K = PeerIp, R = DefaultRejection> {
    key: Arc<K>,
    rejection: Arc<R>,
    shared: Arc<Shared>,
}

/// Everything that does not change the layer's type.
#[derive(Debug)]
struct Shared {
    max: u32,
    /// The permits counted in this process: the store, or the fallback of
    /// [`FailurePolicy::Local`].
    local: LocalPermits,
    /// Where the permits are shared between replicas; `None`: in `local`.
    permits: Option<SharedPermits>,
    lease: Duration,
    timeout: Option<Duration>,
    on_store_error: FailurePolicy,
    on_missing_key: MissingKey,
    retry_after: Duration,
}

impl Clone for Shared {
    fn clone(&self) -> Self {
        Self {
            max: self.max,
            // A builder call makes a new layer, with permits of its own.
            local: LocalPermits::default(),
            permits: self.permits.clone(),
            lease: self.lease,
            timeout: self.timeout,
            on_store_error: self.on_store_error.clone(),
            on_missing_key: self.on_missing_key,
            retry_after: self.retry_after,
        }
    }
}

// By hand: neither the key extractor nor the rejection need be `Clone`.
impl<K, R> Clone for InFlightLayer<K, R> {
    fn clone(&self) -> Self {
        Self {
            key: self.key.clone(),
            rejection: self.rejection.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<K: fmt::Debug, R: fmt::Debug> fmt::Debug for InFlightLayer<K, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlightLayer")
            .field("key", &self.key)
            .field("rejection", &self.rejection)
            .field("shared", &self.shared)
            .finish()
    }
}

impl InFlightLayer {
    /// At most `max` requests in flight per peer IP, counted in memory.
    ///
    /// # Errors
    ///
    /// When `max` is 0 (field `max_in_flight`): no request could ever pass.
    pub fn new(max: u32) -> Result<Self, ConfigError> {
        if max == 0 {
            return Err(ConfigError::new(
                "max_in_flight",
                "must be at least 1 (0 would deny every request)",
            ));
        }
        Ok(Self {
            key: Arc::new(PeerIp::new()),
            rejection: Arc::new(DefaultRejection::new()),
            shared: Arc::new(Shared {
                max,
                local: LocalPermits::default(),
                permits: None,
                lease: DEFAULT_LEASE,
                timeout: Some(crate::DEFAULT_TIMEOUT),
                on_store_error: FailurePolicy::Allow,
                on_missing_key: MissingKey::Reject,
                retry_after: DEFAULT_RETRY_AFTER,
            }),
        })
    }
}

impl<K, R> InFlightLayer<K, R> {
    /// The most requests in flight per key.
    pub fn max(&self) -> u32 {
        self.shared.max
    }

    /// A builder call: a layer already shared gets a new one, with permits of its own.
    fn change(&mut self) -> &mut Shared {
        Arc::make_mut(&mut self.shared)
    }

    /// Counts requests by `key` instead. See [`key`](crate::key) for the extractors.
    pub fn key<K2>(self, key: K2) -> InFlightLayer<K2, R> {
        InFlightLayer {
            key: Arc::new(key),
            rejection: self.rejection,
            shared: self.shared,
        }
    }

    /// Answers denied requests, requests without a key and store failures with
    /// `rejection` (see [`OnRejection`]). A denied request's [`Decision`] has one limit of
    /// `max` with nothing remaining and the [`retry_after`](Self::retry_after) wait.
    pub fn on_rejection<R2>(self, rejection: R2) -> InFlightLayer<K, R2> {
        InFlightLayer {
            key: self.key,
            rejection: Arc::new(rejection),
            shared: self.shared,
        }
    }

    /// Keeps the permits in Redis (one node or a cluster), shared by every replica, as
    /// leases (see the [module docs](crate::in_flight#stores)).
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub fn store(mut self, store: crate::store::RedisStore) -> Self {
        self.change().permits = Some(SharedPermits::redis(store));
        self
    }

    /// Keeps the permits where `store` shares them ([`Store::in_flight_permits`]): in
    /// Redis for a `RedisStore`, in the process for the memory store. For apps that hold
    /// their store as an `Arc<dyn Store>`.
    pub fn shared_store(mut self, store: &Arc<dyn Store>) -> Self {
        self.change().permits = store.in_flight_permits();
        self
    }

    /// How long a permit in Redis lives unless renewed ([`DEFAULT_LEASE`] by default, at
    /// least 3 ms): the longest a dead node's permits stay taken, and a permit whose
    /// removal failed. A request in flight renews its permit every third of it, which is
    /// also how long running requests may go uncounted after Redis lost their permits.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.change().lease = lease.max(Duration::from_millis(3));
        self
    }

    /// How long taking a permit from Redis may take before the failure policy applies
    /// ([`DEFAULT_TIMEOUT`](crate::DEFAULT_TIMEOUT) by default; `None`: as long as it
    /// takes). A permit taken after the timeout is given back at once.
    pub fn timeout(mut self, timeout: Option<Duration>) -> Self {
        self.change().timeout = timeout;
        self
    }

    /// What requests get when Redis fails or times out ([`FailurePolicy::Allow`] by
    /// default). [`FailurePolicy::Local`] counts permits in this process meanwhile (its
    /// memory store is not used).
    pub fn on_store_error(mut self, policy: FailurePolicy) -> Self {
        self.change().on_store_error = policy;
        self
    }

    /// What requests without a key get ([`MissingKey::Reject`] by default).
    pub fn on_missing_key(mut self, policy: MissingKey) -> Self {
        self.change().on_missing_key = policy;
        self
    }

    /// The `Retry-After` of a denied request ([`DEFAULT_RETRY_AFTER`] by default; rounded
    /// up to whole seconds, at least 1).
    pub fn retry_after(mut self, retry_after: Duration) -> Self {
        self.change().retry_after = retry_after;
        self
    }
}

impl<S, K, R> Layer<S> for InFlightLayer<K, R> {
    type Service = InFlight<S, K, R>;

    fn layer(&self, inner: S) -> Self::Service {
        InFlight {
            inner,
            key: self.key.clone(),
            rejection: self.rejection.clone(),
            shared: self.shared.clone(),
        }
    }
}

/// Allows at most N requests in flight per key to `S`. Made by [`InFlightLayer`].
pub struct InFlight<S, K, R> {
    inner: S,
    key: Arc<K>,
    rejection: Arc<R>,
    shared: Arc<Shared>,
}

impl<S: Clone, K, R> Clone for InFlight<S, K, R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            key: self.key.clone(),
            rejection: self.rejection.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, K: fmt::Debug, R> fmt::Debug for InFlight<S, K, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlight")
            .field("inner", &self.inner)
            .field("key", &self.key)
            .field("max", &self.shared.max)
            .finish_non_exhaustive()
    }
}

impl<S, K, R> InFlight<S, K, R> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, K, R, ReqB, ResB> Service<Request<ReqB>> for InFlight<S, K, R>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    K: KeyExtractor<ReqB>,
    R: OnRejection<ReqB, ResB>,
{
    type Response = Response<InFlightBody<ResB>>;
    type Error = S::Error;
    type Future = InFlightFuture<S, ReqB, R>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let key = match self.key.extract(&request) {
            Ok(key) => key,
            Err(error) => {
                return match self.shared.on_missing_key {
                    MissingKey::Allow => InFlightFuture::calling(self.inner.call(request), None),
                    MissingKey::Reject => {
                        InFlightFuture::ready(self.rejection.key_missing(&request, &error))
                    }
                };
            }
        };
        #[cfg(feature = "redis")]
        if let Some(SharedPermits(Backend::Redis(store))) = &self.shared.permits {
            let acquire = store.acquire_permit(&key, self.shared.max, self.shared.lease);
            let timeout = self.shared.timeout;
            let acquire: BoxAcquire = Box::pin(async move {
                let permit = match timeout {
                    Some(timeout) => match tokio::time::timeout(timeout, acquire).await {
                        Ok(result) => result,
                        Err(_) => Err(crate::StoreError::timeout()),
                    },
                    None => acquire.await,
                };
                permit.map(|permit| permit.map(Permit::Redis))
            });
            let clone = self.inner.clone();
            let service = std::mem::replace(&mut self.inner, clone);
            return InFlightFuture {
                state: State::Acquiring {
                    acquire,
                    waiting: Some(Waiting {
                        service,
                        request,
                        key,
                        shared: self.shared.clone(),
                        rejection: self.rejection.clone(),
                    }),
                },
            };
        }
        match self.shared.local.try_acquire(&self.shared, key) {
            Some(permit) => InFlightFuture::calling(self.inner.call(request), Some(permit)),
            None => InFlightFuture::ready(denied(&*self.rejection, &self.shared, &request)),
        }
    }
}

/// The answer to a request that found every permit of its key held.
fn denied<R, ReqB, ResB>(rejection: &R, shared: &Shared, request: &Request<ReqB>) -> Response<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    let retry_ms = u64::try_from(shared.retry_after.as_millis()).unwrap_or(u64::MAX);
    let decision = Decision::new(vec![LimitDecision::deny(shared.max, 0, retry_ms, retry_ms)]);
    let mut response = rejection.rate_limited(request, &decision);
    let secs = ceil_secs(retry_ms).max(1);
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(secs));
    response
}

/// The permits counted in this process: in flight per key, a key removed when its last
/// permit is given back.
#[derive(Debug, Default)]
struct LocalPermits {
    held: Arc<Mutex<HashMap<Key, u32>>>,
}

impl LocalPermits {
    fn try_acquire(&self, shared: &Shared, key: Key) -> Option<Permit> {
        let mut held = self.held.lock();
        let count = held.entry(key.clone()).or_insert(0);
        if *count >= shared.max {
            return None;
        }
        *count += 1;
        drop(held);
        Some(Permit::Local(LocalPermit {
            held: self.held.clone(),
            key,
        }))
    }
}

/// A permit counted in this process, given back when dropped.
#[derive(Debug)]
struct LocalPermit {
    held: Arc<Mutex<HashMap<Key, u32>>>,
    key: Key,
}

impl Drop for LocalPermit {
    fn drop(&mut self) {
        let mut held = self.held.lock();
        if let Some(count) = held.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.key);
            }
        }
    }
}

/// A request's permit: given back when dropped.
#[derive(Debug)]
enum Permit {
    Local(#[allow(dead_code)] LocalPermit),
    #[cfg(feature = "redis")]
    Redis(#[allow(dead_code)] crate::store::redis::HeldPermit),
}

#[cfg(feature = "redis")]
type BoxAcquire =
    Pin<Box<dyn Future<Output = Result<Option<Permit>, crate::StoreError>> + Send + 'static>>;

/// A request waiting for its permit from Redis.
#[cfg(feature = "redis")]
struct Waiting<S, ReqB, R> {
    service: S,
    request: Request<ReqB>,
    key: Key,
    shared: Arc<Shared>,
    rejection: Arc<R>,
}

pin_project! {
    /// The response future of [`InFlight`]: takes the permit, calls the inner service and
    /// hands the permit to the response body.
    pub struct InFlightFuture<S, ReqB, R>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, ReqB, R>,
    }
}

#[cfg(feature = "redis")]
type Acquire = BoxAcquire;
#[cfg(not(feature = "redis"))]
type Acquire = std::future::Pending<()>;
#[cfg(feature = "redis")]
type WaitingFor<S, ReqB, R> = Waiting<S, ReqB, R>;
#[cfg(not(feature = "redis"))]
type WaitingFor<S, ReqB, R> = std::marker::PhantomData<(S, ReqB, R)>;

pin_project! {
    #[project = StateProj]
    enum State<S, ReqB, R>
    where
        S: Service<Request<ReqB>>,
    {
        Acquiring {
            acquire: Acquire,
            waiting: Option<WaitingFor<S, ReqB, R>>,
        },
        Calling {
            #[pin]
            future: S::Future,
            permit: Option<Permit>,
        },
        Ready {
            response: Option<S::Response>,
        },
    }
}

impl<S, ReqB, R> InFlightFuture<S, ReqB, R>
where
    S: Service<Request<ReqB>>,
{
    fn calling(future: S::Future, permit: Option<Permit>) -> Self {
        Self {
            state: State::Calling { future, permit },
        }
    }

    fn ready(response: S::Response) -> Self {
        Self {
            state: State::Ready {
                response: Some(response),
            },
        }
    }
}

impl<S, ReqB, R> fmt::Debug for InFlightFuture<S, ReqB, R>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlightFuture").finish_non_exhaustive()
    }
}

impl<S, ReqB, R, ResB> Future for InFlightFuture<S, ReqB, R>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    R: OnRejection<ReqB, ResB>,
{
    type Output = Result<Response<InFlightBody<ResB>>, S::Error>;

    // Without Redis nothing waits for a permit, and the loop never loops.
    #[cfg_attr(not(feature = "redis"), allow(clippy::never_loop))]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                #[cfg(feature = "redis")]
                StateProj::Acquiring { acquire, waiting } => {
                    let result = ready!(acquire.as_mut().poll(cx));
                    let Some(waiting) = waiting.take() else {
                        panic!("InFlightFuture polled after completion");
                    };
                    let Waiting {
                        mut service,
                        request,
                        key,
                        shared,
                        rejection,
                    } = waiting;
                    let permit = match result {
                        Ok(Some(permit)) => Some(permit),
                        Ok(None) => {
                            let response = denied(&*rejection, &shared, &request);
                            this.state.set(State::Ready {
                                response: Some(response),
                            });
                            continue;
                        }
                        Err(error) => {
                            let policy = shared.on_store_error.as_str();
                            tracing::warn!(
                                error = %error.chain(),
                                policy,
                                "in-flight store failed; applying the failure policy",
                            );
                            match shared.on_store_error {
                                FailurePolicy::Deny => {
                                    let response = rejection.store_failed(&request, &error);
                                    this.state.set(State::Ready {
                                        response: Some(response),
                                    });
                                    continue;
                                }
                                FailurePolicy::Local(_) => {
                                    match shared.local.try_acquire(&shared, key) {
                                        Some(permit) => Some(permit),
                                        None => {
                                            let response = denied(&*rejection, &shared, &request);
                                            this.state.set(State::Ready {
                                                response: Some(response),
                                            });
                                            continue;
                                        }
                                    }
                                }
                                _ => None,
                            }
                        }
                    };
                    let future = service.call(request);
                    this.state.set(State::Calling { future, permit });
                }
                #[cfg(not(feature = "redis"))]
                StateProj::Acquiring { .. } => unreachable!("no store to wait for"),
                StateProj::Calling { future, permit } => {
                    // On error the permit is dropped with the future.
                    let response = ready!(future.poll(cx))?;
                    let permit = permit.take();
                    return Poll::Ready(Ok(response.map(|body| InFlightBody::new(body, permit))));
                }
                StateProj::Ready { response } => {
                    let response = response
                        .take()
                        .expect("InFlightFuture polled after completion");
                    return Poll::Ready(Ok(response.map(|body| InFlightBody::new(body, None))));
                }
            }
        }
    }
}

pin_project! {
    /// A response body that holds its request's permit until it ends or is dropped.
    pub struct InFlightBody<B> {
        #[pin]
        inner: B,
        permit: Option<Permit>,
    }
}

impl<B> InFlightBody<B> {
    fn new(inner: B, permit: Option<Permit>) -> Self {
        Self { inner, permit }
    }

    /// Whether the body still holds a permit (its request still counts as in flight).
    pub fn holds_permit(&self) -> bool {
        self.permit.is_some()
    }
}

impl<B: fmt::Debug> fmt::Debug for InFlightBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlightBody")
            .field("inner", &self.inner)
            .field("holds_permit", &self.permit.is_some())
            .finish()
    }
}

impl<B: Default> Default for InFlightBody<B> {
    fn default() -> Self {
        Self::new(B::default(), None)
    }
}

impl<B> http_body::Body for InFlightBody<B>
where
    B: http_body::Body,
    B::Data: Buf,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        let frame = ready!(this.inner.as_mut().poll_frame(cx));
        // The end, or an error (the body is over): the request is no longer in flight.
        if !matches!(frame, Some(Ok(_))) || this.inner.is_end_stream() {
            this.permit.take();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
