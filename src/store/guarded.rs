//! [`Guarded`]: the store-call policy, in one place. A decorator that bounds every call to
//! a store (a [`Store`], or the [`Permits`] of an in-flight limit) by the layer's timeout
//! and keeps a failing store from being asked (the circuit breaker), feeding the breaker
//! with each call's outcome.
//!
//! A call the store decides at once (the memory store, a block-cache hit, an open
//! circuit) stays ready: no timer, no allocation. Only a call that waits gets the timeout,
//! and the breaker's [`Feedback`] travels inside it, so that a call dropped before it
//! answers (its client hung up) still frees the breaker's probe slot.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use super::{Acquired, Admitted, Check, Permits, Reset, Store};
use crate::{
    Adjustment, Decision, InFlightLimit, Limit, StoreError,
    breaker::{Admission, Breaker, Feedback},
    key::Key,
};

/// `store`, called under a timeout and a circuit breaker.
pub(crate) struct Guarded<S: ?Sized = dyn Store> {
    store: Arc<S>,
    timeout: Option<Duration>,
    breaker: Option<Arc<Breaker>>,
}

// By hand: derived, they would ask `S: Clone` (and `S: Sized`).
impl<S: ?Sized> Clone for Guarded<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            timeout: self.timeout,
            breaker: self.breaker.clone(),
        }
    }
}

impl<S: fmt::Debug + ?Sized> fmt::Debug for Guarded<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guarded")
            .field("store", &self.store)
            .field("timeout", &self.timeout)
            .field("breaker", &self.breaker)
            .finish()
    }
}

impl Guarded {
    pub(crate) fn new(
        store: Arc<dyn Store>,
        timeout: Option<Duration>,
        breaker: Option<Arc<Breaker>>,
    ) -> Self {
        Self::over(store, timeout, breaker)
    }
}

impl Guarded<dyn Permits> {
    /// The permits of an in-flight limit, guarded as a [`Store`] is.
    pub(crate) fn permits(
        store: Arc<dyn Permits>,
        timeout: Option<Duration>,
        breaker: Option<Arc<Breaker>>,
    ) -> Self {
        Self::over(store, timeout, breaker)
    }
}

impl<S: ?Sized> Guarded<S> {
    fn over(store: Arc<S>, timeout: Option<Duration>, breaker: Option<Arc<Breaker>>) -> Self {
        Self {
            store,
            timeout,
            breaker,
        }
    }

    /// The store, for the calls that go around the guard (a permit's release).
    pub(crate) fn store(&self) -> &Arc<S> {
        &self.store
    }

    /// One store call under the breaker: `open`'s answer while the circuit is open, else
    /// `call`'s, recorded by the breaker when ready, or put under the timeout.
    #[inline(always)]
    fn call<T: Send + 'static>(
        &self,
        open: impl FnOnce() -> Result<T, StoreError>,
        call: impl FnOnce(&S) -> Check<T>,
    ) -> Result<Result<T, StoreError>, Check<T>> {
        let admission = self.breaker.as_ref().map_or(Admission::Ask, |b| b.admit());
        if admission == Admission::Skip {
            return Ok(open());
        }
        match call(&*self.store).into_ready() {
            Ok(result) => {
                if let Some(breaker) = &self.breaker {
                    breaker.record(admission, result.is_ok());
                }
                Ok(result)
            }
            Err(check) => Err(self.wait(check, admission)),
        }
    }

    /// `check` under the timeout, reporting to the breaker. Kept out of line: the ready
    /// path above is the hot one.
    #[inline(never)]
    fn wait<T: Send + 'static>(&self, check: Check<T>, admission: Admission) -> Check<T> {
        if self.timeout.is_none() && self.breaker.is_none() {
            return check;
        }
        let feedback = self
            .breaker
            .as_ref()
            .map(|breaker| Feedback::new(breaker.clone(), admission));
        Check::pending(guard(check, self.timeout, feedback))
    }
}

impl Guarded {
    /// The decision if it was made at once, else the check to wait for: what
    /// [`check`](Store::check) returns, without wrapping a ready answer into a [`Check`]
    /// only for the caller to unwrap it again.
    #[inline(always)]
    pub(crate) fn check_now(
        &self,
        key: &Key,
        limits: &[Limit],
        cost: u32,
    ) -> Result<Result<Decision, StoreError>, Check> {
        // Quota the store holds already (leases) is spent while the circuit is open.
        self.call(
            || self.held(key, limits, cost),
            |store| store.check(key, limits, cost),
        )
    }

    /// [`check_now`](Self::check_now) for [`Store::reserve`]: a layer with
    /// [`max_wait`](crate::RateLimitLayer::with_max_wait) asks this. With the circuit open, as
    /// a check (quota held already, or the failure policy): nothing is reserved then.
    pub(crate) fn reserve_now(
        &self,
        key: &Key,
        limits: &[Limit],
        cost: u32,
        max_wait_ms: u64,
    ) -> Result<Result<Decision, StoreError>, Check> {
        self.call(
            || self.held(key, limits, cost),
            |store| store.reserve(key, limits, cost, max_wait_ms),
        )
    }

    /// [`Store::adjust`] under the same timeout and breaker as a check: a refund or top-up
    /// after a response. Ready, or the call to wait for.
    pub(crate) fn adjust_now(
        &self,
        key: &Key,
        limits: &[Limit],
        adjustment: Adjustment,
    ) -> Result<Result<Decision, StoreError>, Check> {
        self.call(
            || Err(StoreError::circuit_open()),
            |store| store.adjust(key, limits, adjustment),
        )
    }

    /// [`Store::check_in_flight`] under the timeout and breaker (reserving within
    /// `max_wait_ms` when above 0). With the circuit open: the failure policy (quota
    /// held already cannot take a permit). A call dropped after the store took its
    /// permit (a timeout) gives the permit back (the store's future does so when
    /// dropped).
    // The ready answer stays unboxed, as `check_now`'s: the memory store's path.
    #[allow(clippy::result_large_err)]
    pub(crate) fn check_in_flight_now(
        &self,
        key: &Key,
        limits: &[Limit],
        cost: u32,
        in_flight: &InFlightLimit,
        max_wait_ms: u64,
    ) -> Result<Result<Admitted, StoreError>, Check<Admitted>> {
        self.call(
            || Err(StoreError::circuit_open()),
            |store| store.check_in_flight(key, limits, cost, in_flight, max_wait_ms),
        )
    }

    /// The answer with the circuit open: from quota the store holds already, if any.
    fn held(&self, key: &Key, limits: &[Limit], cost: u32) -> Result<Decision, StoreError> {
        self.store
            .check_held(key, limits, cost)
            .ok_or_else(StoreError::circuit_open)
    }
}

impl Guarded<dyn Permits> {
    /// [`Permits::acquire`] under the timeout and breaker: the answer if it came at once,
    /// else the call to wait for. A permit taken after the timeout is given back by the
    /// store when the call is dropped.
    #[inline]
    pub(crate) fn acquire_now(
        &self,
        key: &Key,
        max: u32,
        ttl: Duration,
    ) -> Result<Result<Acquired, StoreError>, Check<Acquired>> {
        self.call(
            || Err(StoreError::circuit_open()),
            |store| store.acquire(key, max, ttl),
        )
    }
}

impl Guarded {
    /// [`Store::peek`] under the timeout. The breaker is neither asked nor told: an
    /// operator's question reaches the store even while requests skip it, and its
    /// outcome says nothing about the request path.
    pub(crate) fn peek(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        let check = self.store.peek(key, limits, cost);
        match self.timeout {
            Some(timeout) if !check.is_ready() => Check::pending(guard(check, Some(timeout), None)),
            _ => check,
        }
    }

    /// [`Store::reset`] under the timeout (the breaker as for [`peek`](Self::peek)).
    pub(crate) fn reset(&self, key: &Key, limits: &[Limit]) -> Reset {
        let reset = self.store.reset(key, limits);
        match self.timeout {
            Some(timeout) => Box::pin(async move {
                tokio::time::timeout(timeout, reset)
                    .await
                    .unwrap_or_else(|_| Err(StoreError::timeout()))
            }),
            None => reset,
        }
    }
}

// The layer calls `check_now`; the tests here ask it as any store.
#[cfg(test)]
impl Store for Guarded<dyn Store> {
    fn capabilities(&self) -> super::Capabilities {
        self.store.capabilities()
    }

    fn check(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        match self.check_now(key, limits, cost) {
            Ok(result) => Check::ready(result),
            Err(check) => check,
        }
    }

    fn adjust(&self, key: &Key, limits: &[Limit], adjustment: Adjustment) -> Check {
        match self.adjust_now(key, limits, adjustment) {
            Ok(result) => Check::ready(result),
            Err(check) => check,
        }
    }
}

/// Waits for `check` at most `timeout`, then reports to the breaker. Dropped before that,
/// `feedback` frees the probe slot it may hold.
async fn guard<T>(
    check: impl Future<Output = Result<T, StoreError>>,
    timeout: Option<Duration>,
    feedback: Option<Feedback>,
) -> Result<T, StoreError> {
    let result = match timeout {
        // A call that timed out is not retried: it may have counted.
        Some(timeout) => tokio::time::timeout(timeout, check)
            .await
            .unwrap_or_else(|_| Err(StoreError::timeout())),
        None => check.await,
    };
    if let Some(feedback) = feedback {
        feedback.report(result.is_ok());
    }
    result
}

#[cfg(test)]
mod tests {
    use std::{
        future::Future,
        pin::Pin,
        sync::atomic::{AtomicBool, Ordering},
        task::{Context, Poll},
    };

    use super::*;
    use crate::{StoreErrorKind, breaker::CircuitBreaker, clock::ManualClock, store::MemoryStore};

    /// A store that decides with a memory store while `up`, and otherwise never answers
    /// (a stalled Redis).
    #[derive(Debug, Default)]
    struct Stalling {
        stalled: AtomicBool,
        memory: MemoryStore,
    }

    impl Store for Arc<Stalling> {
        fn capabilities(&self) -> crate::store::Capabilities {
            use crate::store::{Capabilities, Capability};
            Capabilities::NONE
                .with(Capability::Peek)
                .with(Capability::Reset)
        }

        fn check(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
            if self.stalled.load(Ordering::SeqCst) {
                Check::pending(std::future::pending())
            } else {
                // Pending like a network store, decided on the first poll.
                let decision = self.memory.decide(key, limits, cost);
                Check::pending(async move { Ok(decision) })
            }
        }

        fn peek(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
            if self.stalled.load(Ordering::SeqCst) {
                Check::pending(std::future::pending())
            } else {
                self.memory.peek(key, limits, cost)
            }
        }

        fn reset(&self, key: &Key, limits: &[Limit]) -> Reset {
            if self.stalled.load(Ordering::SeqCst) {
                Box::pin(std::future::pending())
            } else {
                self.memory.reset(key, limits)
            }
        }
    }

    fn poll_once(check: &mut Check) -> Poll<Result<Decision, StoreError>> {
        let waker = futures_util::task::noop_waker();
        Pin::new(check).poll(&mut Context::from_waker(&waker))
    }

    /// The circuit opens on timeouts, the probe after the cooldown is abandoned (its
    /// future dropped) while the store still stalls, then the store recovers: the very
    /// next request after one more cooldown is decided by the store again.
    #[tokio::test(start_paused = true)]
    async fn an_abandoned_probe_does_not_keep_the_circuit_open() {
        let cooldown = Duration::from_millis(500);
        let clock = ManualClock::new(1_000_000);
        let breaker =
            Breaker::with_clock(CircuitBreaker::new(2, cooldown), Arc::new(clock.clone()));
        let store = Arc::new(Stalling::default());
        let guarded = Guarded::new(
            Arc::new(store.clone()),
            Some(Duration::from_millis(100)),
            Some(Arc::new(breaker)),
        );
        let key = Key::new("k");
        let limits = [Limit::fixed_window(3, Duration::from_secs(3600)).unwrap()];
        store.stalled.store(true, Ordering::SeqCst);
        for _ in 0..2 {
            let error = guarded.check(&key, &limits, 1).await.unwrap_err();
            assert_eq!(error.kind(), StoreErrorKind::Timeout);
        }
        // Open: answered at once, without asking the store.
        let skipped = guarded.check(&key, &limits, 1);
        assert!(skipped.is_ready());
        assert!(skipped.await.unwrap_err().is_circuit_open());
        clock.advance(cooldown);
        // The probe: its client hangs up while the store still stalls.
        let mut probe = guarded.check(&key, &limits, 1);
        assert!(poll_once(&mut probe).is_pending());
        drop(probe);
        store.stalled.store(false, Ordering::SeqCst);
        clock.advance(cooldown);
        // Within one cooldown plus one request, the store decides again, and limits.
        let mut decisions = Vec::new();
        for _ in 0..5 {
            let decision = guarded.check(&key, &limits, 1).await;
            decisions.push(decision.expect("decided by the store").is_allowed());
        }
        assert_eq!(decisions, [true, true, true, false, false]);
    }

    /// Peek and reset wait at most the timeout, and reach the store while the circuit is
    /// open: an operator's reset is never skipped.
    #[tokio::test(start_paused = true)]
    async fn peek_and_reset_time_out_and_ignore_the_breaker() {
        let clock = ManualClock::new(1_000_000);
        let breaker = Breaker::with_clock(
            CircuitBreaker::new(1, Duration::from_secs(60)),
            Arc::new(clock.clone()),
        );
        let store = Arc::new(Stalling::default());
        let guarded = Guarded::new(
            Arc::new(store.clone()),
            Some(Duration::from_millis(100)),
            Some(Arc::new(breaker)),
        );
        let key = Key::new("k");
        let limits = [Limit::fixed_window(3, Duration::from_secs(3600)).unwrap()];
        store.stalled.store(true, Ordering::SeqCst);
        // Bounded here too, so that a missing timeout fails rather than hangs.
        let bound = Duration::from_secs(10);
        let peeked = tokio::time::timeout(bound, guarded.peek(&key, &limits, 1)).await;
        let error = peeked.expect("peek is bounded by the timeout").unwrap_err();
        assert_eq!(error.kind(), StoreErrorKind::Timeout);
        let reset = tokio::time::timeout(bound, guarded.reset(&key, &limits)).await;
        let error = reset.expect("reset is bounded by the timeout").unwrap_err();
        assert_eq!(error.kind(), StoreErrorKind::Timeout);
        // Open the circuit with a failed request.
        assert!(guarded.check(&key, &limits, 1).await.is_err());
        assert!(
            guarded
                .check(&key, &limits, 1)
                .await
                .unwrap_err()
                .is_circuit_open()
        );
        store.stalled.store(false, Ordering::SeqCst);
        store.memory.decide(&key, &limits, 3);
        assert!(!guarded.peek(&key, &limits, 1).await.unwrap().is_allowed());
        guarded.reset(&key, &limits).await.unwrap();
        assert!(guarded.peek(&key, &limits, 1).await.unwrap().is_allowed());
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_call_times_out_and_a_ready_one_stays_ready() {
        let store = Arc::new(Stalling::default());
        store.stalled.store(true, Ordering::SeqCst);
        let guarded = Guarded::new(Arc::new(store), Some(Duration::from_millis(100)), None);
        let limits = [Limit::fixed_window(3, Duration::from_secs(3600)).unwrap()];
        let error = guarded.check(&Key::new("k"), &limits, 1).await.unwrap_err();
        assert_eq!(error.kind(), StoreErrorKind::Timeout);
        let memory = Guarded::new(
            Arc::new(MemoryStore::new()),
            Some(Duration::from_millis(100)),
            None,
        );
        assert!(memory.check(&Key::new("k"), &limits, 1).is_ready());
    }
}
