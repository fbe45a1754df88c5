//! A circuit breaker in front of the store: a store that keeps failing is not asked again
//! for a moment, so that a dead Redis costs no timeout per request.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
    time::Duration,
};

use crate::clock::{Clock, MonotonicClock};

/// When to stop asking a failing store, and for how long.
///
/// ```
/// use std::time::Duration;
/// use tollgate::CircuitBreaker;
///
/// let breaker = CircuitBreaker::new(3, Duration::from_secs(1));
/// assert_eq!(breaker, CircuitBreaker::default().with_failures(3).with_cooldown(Duration::from_secs(1)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct CircuitBreaker {
    /// Consecutive failures (errors or timeouts) that open the circuit.
    pub failures: u32,
    /// How long the circuit stays open before one request probes the store again. A probe
    /// that has not answered within another cooldown (its client hung up, or the store
    /// never answers) no longer holds the others back: the next request probes.
    pub cooldown: Duration,
}

impl Default for CircuitBreaker {
    /// Opens after 5 consecutive failures, probes every 500 ms: a store that comes back is
    /// used again within about half a second.
    fn default() -> Self {
        Self::new(5, Duration::from_millis(500))
    }
}

impl CircuitBreaker {
    /// Opens after `failures` consecutive failures, probes every `cooldown`.
    pub const fn new(failures: u32, cooldown: Duration) -> Self {
        Self { failures, cooldown }
    }

    /// The same, opening after `failures` consecutive failures.
    pub const fn with_failures(mut self, failures: u32) -> Self {
        self.failures = failures;
        self
    }

    /// The same, probing every `cooldown`.
    pub const fn with_cooldown(mut self, cooldown: Duration) -> Self {
        self.cooldown = cooldown;
        self
    }
}

/// What a request may do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Ask the store.
    Ask,
    /// Ask the store: this request is the probe of an open circuit. The number is when its
    /// probe slot expires, which also tells this probe from a later one.
    Probe(u64),
    /// Do not ask: the failure policy answers.
    Skip,
}

/// The breaker's state, shared by every service of one layer.
#[derive(Debug)]
pub(crate) struct Breaker {
    config: CircuitBreaker,
    clock: Arc<dyn Clock>,
    failures: AtomicU32,
    /// Milliseconds until which the circuit is open; 0 when closed.
    open_until: AtomicU64,
    /// Milliseconds until which the probe out holds the others back; 0 when none is out.
    probe_until: AtomicU64,
}

impl Breaker {
    pub(crate) fn new(config: CircuitBreaker) -> Self {
        Self::with_clock(config, Arc::new(MonotonicClock))
    }

    /// A breaker timed by `clock` (the clock is read only while the circuit is open).
    pub(crate) fn with_clock(config: CircuitBreaker, clock: Arc<dyn Clock>) -> Self {
        // Read once here: a clock's first read may calibrate it (`MonotonicClock`), which
        // belongs in setup, not in the request that finds the circuit open.
        clock.now_ms();
        Self {
            config,
            clock,
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            probe_until: AtomicU64::new(0),
        }
    }

    /// Never 0, which means "closed" and "no probe".
    fn now_ms(&self) -> u64 {
        self.clock.now_ms().max(1)
    }

    /// At least a millisecond, so that a zero cooldown still lets one probe out at a time.
    fn cooldown_ms(&self) -> u64 {
        (self.config.cooldown.as_millis() as u64).max(1)
    }

    #[inline]
    pub(crate) fn admit(&self) -> Admission {
        let open_until = self.open_until.load(Ordering::Acquire);
        if open_until == 0 {
            return Admission::Ask;
        }
        let now = self.now_ms();
        if now < open_until {
            return Admission::Skip;
        }
        // Cooled down: one request probes, the others keep skipping until it answers, is
        // dropped, or its slot expires after a cooldown.
        let probe = self.probe_until.load(Ordering::Acquire);
        if probe != 0 && now < probe {
            return Admission::Skip;
        }
        let until = now + self.cooldown_ms();
        match self
            .probe_until
            .compare_exchange(probe, until, Ordering::AcqRel, Ordering::Relaxed)
        {
            Ok(_) => Admission::Probe(until),
            Err(_) => Admission::Skip,
        }
    }

    /// Feeds the outcome of a call the breaker admitted (never of a skipped one).
    #[inline]
    pub(crate) fn record(&self, admission: Admission, ok: bool) {
        match (admission, ok) {
            (Admission::Skip, _) => {}
            (_, true) => self.succeeded(),
            (_, false) => self.failed(admission),
        }
    }

    #[inline]
    fn succeeded(&self) {
        if self.failures.load(Ordering::Relaxed) != 0
            || self.open_until.load(Ordering::Relaxed) != 0
        {
            self.failures.store(0, Ordering::Relaxed);
            self.open_until.store(0, Ordering::Release);
            self.probe_until.store(0, Ordering::Release);
        }
    }

    fn failed(&self, admission: Admission) {
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        let probed = matches!(admission, Admission::Probe(_));
        if probed || failures >= self.config.failures.max(1) {
            let until = self.now_ms() + self.config.cooldown.as_millis() as u64;
            self.open_until.store(until, Ordering::Release);
        }
        if let Admission::Probe(slot) = admission {
            self.release(slot);
        }
    }

    /// Frees the probe slot `slot`, unless a later probe holds it already.
    pub(crate) fn release(&self, slot: u64) {
        let _ = self
            .probe_until
            .compare_exchange(slot, 0, Ordering::AcqRel, Ordering::Relaxed);
    }
}

/// Reports a call's outcome to the breaker once; dropped unreported (its request was
/// abandoned), it frees the probe slot it holds, so that an abandoned probe never keeps
/// the circuit from closing.
#[derive(Debug)]
pub(crate) struct Feedback {
    /// None once reported.
    breaker: Option<Arc<Breaker>>,
    admission: Admission,
}

impl Feedback {
    pub(crate) fn new(breaker: Arc<Breaker>, admission: Admission) -> Self {
        Self {
            breaker: Some(breaker),
            admission,
        }
    }

    pub(crate) fn report(mut self, ok: bool) {
        if let Some(breaker) = self.breaker.take() {
            breaker.record(self.admission, ok);
        }
    }
}

impl Drop for Feedback {
    fn drop(&mut self) {
        if let (Some(breaker), Admission::Probe(slot)) = (self.breaker.take(), self.admission) {
            breaker.release(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn breaker(failures: u32, cooldown_ms: u64) -> (Arc<Breaker>, ManualClock) {
        let clock = ManualClock::new(1_000_000);
        let config = CircuitBreaker::new(failures, Duration::from_millis(cooldown_ms));
        let breaker = Breaker::with_clock(config, Arc::new(clock.clone()));
        (Arc::new(breaker), clock)
    }

    fn open(breaker: &Breaker, failures: u32) {
        for _ in 0..failures {
            breaker.record(Admission::Ask, false);
        }
    }

    #[test]
    fn opens_after_consecutive_failures_and_probes_after_the_cooldown() {
        let (breaker, clock) = breaker(3, 100);
        for _ in 0..2 {
            assert_eq!(breaker.admit(), Admission::Ask);
            breaker.record(Admission::Ask, false);
        }
        breaker.record(Admission::Ask, true);
        open(&breaker, 3);
        assert_eq!(breaker.admit(), Admission::Skip);
        clock.advance(Duration::from_millis(100));
        // Cooled down: the next request probes, and only one does.
        let probe = breaker.admit();
        assert!(matches!(probe, Admission::Probe(_)), "{probe:?}");
        assert_eq!(breaker.admit(), Admission::Skip);
        // A failed probe opens the circuit for another cooldown.
        breaker.record(probe, false);
        assert_eq!(breaker.admit(), Admission::Skip);
        clock.advance(Duration::from_millis(100));
        let probe = breaker.admit();
        assert!(matches!(probe, Admission::Probe(_)), "{probe:?}");
        breaker.record(probe, true);
        assert_eq!(breaker.admit(), Admission::Ask);
    }

    #[test]
    fn stays_open_during_the_cooldown() {
        let (breaker, clock) = breaker(1, 3_600_000);
        open(&breaker, 1);
        assert_eq!(breaker.admit(), Admission::Skip);
        clock.advance(Duration::from_secs(3599));
        assert_eq!(breaker.admit(), Admission::Skip);
    }

    #[test]
    fn a_dropped_probe_lets_the_next_request_probe() {
        let (breaker, clock) = breaker(1, 100);
        open(&breaker, 1);
        clock.advance(Duration::from_millis(100));
        let probe = breaker.admit();
        let feedback = Feedback::new(breaker.clone(), probe);
        assert_eq!(breaker.admit(), Admission::Skip);
        // Its client hung up: the probe never reports.
        drop(feedback);
        let next = breaker.admit();
        assert!(matches!(next, Admission::Probe(_)), "{next:?}");
        Feedback::new(breaker.clone(), next).report(true);
        assert_eq!(breaker.admit(), Admission::Ask);
    }

    #[test]
    fn an_unanswered_probe_holds_the_others_back_for_one_cooldown_at_most() {
        let (breaker, clock) = breaker(1, 100);
        open(&breaker, 1);
        clock.advance(Duration::from_millis(100));
        // A probe whose store call never ends (no timeout) and is never dropped.
        let stuck = Feedback::new(breaker.clone(), breaker.admit());
        clock.advance(Duration::from_millis(99));
        assert_eq!(breaker.admit(), Admission::Skip);
        clock.advance(Duration::from_millis(1));
        let next = breaker.admit();
        assert!(matches!(next, Admission::Probe(_)), "{next:?}");
        // The stuck probe, dropped late, does not free the new probe's slot.
        drop(stuck);
        assert_eq!(breaker.admit(), Admission::Skip);
        breaker.record(next, true);
        assert_eq!(breaker.admit(), Admission::Ask);
    }

    #[test]
    fn a_reported_probe_is_not_released_again() {
        let (breaker, clock) = breaker(1, 100);
        open(&breaker, 1);
        clock.advance(Duration::from_millis(100));
        let probe = breaker.admit();
        Feedback::new(breaker.clone(), probe).report(false);
        // Failed: open again, and no probe until the cooldown passes.
        assert_eq!(breaker.admit(), Admission::Skip);
        clock.advance(Duration::from_millis(100));
        assert!(matches!(breaker.admit(), Admission::Probe(_)));
    }
}
