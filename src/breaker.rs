//! A circuit breaker in front of the store: a store that keeps failing is not asked again
//! for a moment, so that a dead Redis costs no timeout per request.

use std::{
    sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    time::{Duration, Instant},
};

/// When to stop asking a failing store, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CircuitBreaker {
    /// Consecutive failures (errors or timeouts) that open the circuit.
    pub failures: u32,
    /// How long the circuit stays open before one request probes the store again.
    pub cooldown: Duration,
}

impl Default for CircuitBreaker {
    /// Opens after 5 consecutive failures, probes every 500 ms: a store that comes back is
    /// used again within about half a second.
    fn default() -> Self {
        Self {
            failures: 5,
            cooldown: Duration::from_millis(500),
        }
    }
}

/// What a request may do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Ask the store.
    Ask,
    /// Ask the store: this request is the probe of an open circuit.
    Probe,
    /// Do not ask: the failure policy answers.
    Skip,
}

/// The breaker's state, shared by every service of one layer.
#[derive(Debug)]
pub(crate) struct Breaker {
    config: CircuitBreaker,
    origin: Instant,
    failures: AtomicU32,
    /// Milliseconds since `origin` until which the circuit is open; 0 when closed.
    open_until: AtomicU64,
    probing: AtomicBool,
}

impl Breaker {
    pub(crate) fn new(config: CircuitBreaker) -> Self {
        Self {
            config,
            origin: Instant::now(),
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            probing: AtomicBool::new(false),
        }
    }

    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64 + 1
    }

    pub(crate) fn admit(&self) -> Admission {
        let open_until = self.open_until.load(Ordering::Relaxed);
        if open_until == 0 {
            return Admission::Ask;
        }
        if self.now_ms() < open_until {
            return Admission::Skip;
        }
        // Cooled down: one request probes, the others keep skipping until it answers.
        if self
            .probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            Admission::Probe
        } else {
            Admission::Skip
        }
    }

    pub(crate) fn succeeded(&self) {
        if self.failures.load(Ordering::Relaxed) != 0
            || self.open_until.load(Ordering::Relaxed) != 0
        {
            self.failures.store(0, Ordering::Relaxed);
            self.open_until.store(0, Ordering::Relaxed);
            self.probing.store(false, Ordering::Release);
        }
    }

    pub(crate) fn failed(&self, admission: Admission) {
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if admission == Admission::Probe || failures >= self.config.failures.max(1) {
            let until = self.now_ms() + self.config.cooldown.as_millis() as u64;
            self.open_until.store(until, Ordering::Relaxed);
            self.probing.store(false, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_and_probes_after_the_cooldown() {
        let breaker = Breaker::new(CircuitBreaker {
            failures: 3,
            cooldown: Duration::ZERO,
        });
        for _ in 0..2 {
            assert_eq!(breaker.admit(), Admission::Ask);
            breaker.failed(Admission::Ask);
        }
        breaker.succeeded();
        for _ in 0..3 {
            breaker.failed(Admission::Ask);
        }
        // Zero cooldown: the next request probes at once, and only one does.
        assert_eq!(breaker.admit(), Admission::Probe);
        assert_eq!(breaker.admit(), Admission::Skip);
        breaker.failed(Admission::Probe);
        assert_eq!(breaker.admit(), Admission::Probe);
        breaker.succeeded();
        assert_eq!(breaker.admit(), Admission::Ask);
    }

    #[test]
    fn stays_open_during_the_cooldown() {
        let breaker = Breaker::new(CircuitBreaker {
            failures: 1,
            cooldown: Duration::from_secs(3600),
        });
        breaker.failed(Admission::Ask);
        assert_eq!(breaker.admit(), Admission::Skip);
    }
}
