//! Waiting instead of answering 429 ([`RateLimitLayer::max_wait`](crate::RateLimitLayer::max_wait)):
//! a denied request whose `retry_after` is within the layer's `max_wait` takes a place in
//! line, sleeps until then and asks the store again.
//!
//! Nothing is reserved: the store's answer after the sleep is a fresh decision, so a
//! request that arrives meanwhile (on this process or another replica) may take the units
//! first. A waiter that finds itself overtaken waits again for the new `retry_after` while
//! the total stays within `max_wait` (counted from the first denial), and is answered 429
//! otherwise. Of the algorithms, only GCRA's state (one arrival time, which may lie in the
//! future) could hold a reservation as it is; the token bucket, the windows and the log
//! would need state for units spent in the future, which no store keeps yet.
//!
//! The line is bounded per layer and per key: beyond either bound a request is answered
//! 429 at once. A place is held by the request's response future, so a client that hangs
//! up (the future is dropped) gives its place back at once.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use hashbrown::HashMap;
use parking_lot::Mutex;

use crate::{
    Decision, Limit,
    key::Key,
    rules::Active,
    store::{Check, Guarded},
};

/// The default bound on waiting requests per layer.
pub const DEFAULT_MAX_WAITERS: usize = 1024;
/// The default bound on waiting requests per key.
pub const DEFAULT_MAX_WAITERS_PER_KEY: usize = 16;

/// A layer's line of waiting requests: its bounds and who is in it. Shared by the
/// layer's clones and every service it makes.
pub(crate) struct Waiting {
    max_wait_ms: u64,
    max_waiters: usize,
    max_per_key: usize,
    waiters: AtomicUsize,
    /// Waiters per key; touched only by requests that wait.
    per_key: Mutex<HashMap<Key, usize>>,
}

impl fmt::Debug for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waiting")
            .field("max_wait", &Duration::from_millis(self.max_wait_ms))
            .field("max_waiters", &self.max_waiters)
            .field("max_waiters_per_key", &self.max_per_key)
            .field("waiting", &self.waiters.load(Ordering::Relaxed))
            .finish()
    }
}

impl Waiting {
    pub(crate) fn new(max_wait: Duration, max_waiters: usize, max_per_key: usize) -> Self {
        Self {
            max_wait_ms: u64::try_from(max_wait.as_millis()).unwrap_or(u64::MAX),
            max_waiters,
            max_per_key,
            waiters: AtomicUsize::new(0),
            per_key: Mutex::default(),
        }
    }

    /// How many requests wait now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.waiters.load(Ordering::Relaxed)
    }

    /// A place in line for a request of `key` and `cost` that `decision` denied under
    /// `limits`, when it may wait: its `retry_after` is within `max_wait`, it can fit at
    /// all, and neither bound is reached.
    pub(crate) fn admit(
        self: &Arc<Self>,
        key: &Key,
        limits: &[Limit],
        cost: u32,
        decision: &Decision,
    ) -> Option<Ticket> {
        let retry_ms = decision.retry_after_ms();
        if retry_ms == 0 || retry_ms > self.max_wait_ms {
            return None;
        }
        // A request dearer than a limit's capacity never fits: no wait helps.
        if limits.iter().any(|l| cost > l.capacity()) {
            return None;
        }
        if self.waiters.fetch_add(1, Ordering::AcqRel) >= self.max_waiters {
            self.waiters.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        {
            let mut per_key = self.per_key.lock();
            match per_key.get_mut(key) {
                Some(count) if *count >= self.max_per_key => {
                    drop(per_key);
                    self.waiters.fetch_sub(1, Ordering::AcqRel);
                    return None;
                }
                Some(count) => *count += 1,
                None => {
                    per_key.insert(key.clone(), 1);
                }
            }
        }
        Some(Ticket {
            place: Place {
                waiting: self.clone(),
                key: key.clone(),
            },
            retry_ms,
        })
    }
}

/// A place in line: given back when dropped (the request was answered, or its client
/// hung up).
struct Place {
    waiting: Arc<Waiting>,
    key: Key,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut per_key = self.waiting.per_key.lock();
        if let Some(count) = per_key.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                per_key.remove(&self.key);
            }
        }
        drop(per_key);
        self.waiting.waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A denied request's place in line and how long it waits first.
pub(crate) struct Ticket {
    place: Place,
    retry_ms: u64,
}

impl Ticket {
    /// The wait, then the store's fresh answer, as a [`Check`]: sleeps `retry_after`, asks
    /// the store again under the same `rules` and, while it is denied and the new
    /// `retry_after` still ends within `max_wait` of the first denial, sleeps again. The
    /// place is given back when the check ends or is dropped.
    pub(crate) fn wait(self, store: Guarded, rules: Arc<Active>, key: Key, cost: u32) -> Check {
        let Self { place, retry_ms } = self;
        let max_wait = Duration::from_millis(place.waiting.max_wait_ms);
        Check::pending(async move {
            let _place = place;
            let start = tokio::time::Instant::now();
            let deadline = start.checked_add(max_wait);
            let mut sleep = Duration::from_millis(retry_ms);
            loop {
                tokio::time::sleep(sleep).await;
                let result = match store.check_now(&key, rules.limits(), cost) {
                    Ok(result) => result,
                    Err(check) => check.await,
                };
                if let Ok(decision) = &result
                    && !decision.is_allowed()
                {
                    let retry = decision.retry_after();
                    let again = tokio::time::Instant::now().checked_add(retry);
                    if matches!((again, deadline), (Some(again), Some(deadline)) if again <= deadline)
                        && !retry.is_zero()
                    {
                        sleep = retry;
                        continue;
                    }
                }
                return result;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LimitDecision;

    fn denied(retry_after_ms: u64) -> Decision {
        Decision::new(vec![LimitDecision::deny(5, 0, 1_000, retry_after_ms)])
    }

    #[test]
    fn places_are_bounded_and_given_back() {
        let waiting = Arc::new(Waiting::new(Duration::from_secs(1), 3, 2));
        let limits = [Limit::fixed_window(5, Duration::from_secs(1)).unwrap()];
        let (a, b) = (Key::new("a"), Key::new("b"));
        let admit = |key: &Key, retry| waiting.admit(key, &limits, 1, &denied(retry));
        // Only a wait within max_wait, and never for a request that cannot fit.
        assert!(admit(&a, 1_001).is_none());
        assert!(waiting.admit(&a, &limits, 6, &denied(10)).is_none());
        let a1 = admit(&a, 1_000).unwrap();
        let a2 = admit(&a, 10).unwrap();
        assert!(admit(&a, 10).is_none(), "two per key");
        let b1 = admit(&b, 10).unwrap();
        assert!(admit(&b, 10).is_none(), "three per layer");
        assert_eq!(waiting.len(), 3);
        drop(a1);
        assert_eq!(waiting.len(), 2);
        let b2 = admit(&b, 10).unwrap();
        drop((a2, b1, b2));
        assert_eq!(waiting.len(), 0);
        assert!(waiting.per_key.lock().is_empty());
    }
}
