//! Clocks: where a store reads "now" from.
//!
//! Time is whole milliseconds since the Unix epoch, the unit every algorithm counts in.
//! The Redis store reads Redis `TIME` inside its script by default, so that every replica
//! shares one clock; a [`Clock`] is used by the in-memory store and by the Redis store's
//! local-clock mode. Tests inject a [`ManualClock`] instead of sleeping.

use std::{
    fmt,
    sync::{
        Arc, LazyLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// A source of the current time in milliseconds since the Unix epoch.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// Now, in milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[inline]
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }
}

/// The wall clock read once, then advanced by a monotonic counter: what in-process state
/// is timed with ([`MemoryStore`](crate::store::MemoryStore)'s default, the Redis store's block
/// cache).
///
/// The counter is the CPU's time-stamp counter where it is invariant (through
/// [quanta](https://docs.rs/quanta), calibrated against the OS clock), which is read in
/// a few nanoseconds where the system clock takes about 30 on a VM: a third of a
/// memory-store decision. It never goes backwards and does not follow later steps of the
/// wall clock, which suits a single process; replicas that must agree on the time use
/// Redis `TIME` or [`SystemClock`]. The first read (made when a store is built) calibrates
/// the counter, which can take up to 200 ms.
#[derive(Debug, Clone, Copy, Default)]
pub struct MonotonicClock;

/// Where every [`MonotonicClock`] counts from.
struct Start {
    wall_ms: u64,
    /// A clock of our own: `quanta::Instant::now` would look for a test override in
    /// thread-local storage on every read.
    counter: quanta::Clock,
    raw: u64,
}

static START: LazyLock<Start> = LazyLock::new(|| {
    let counter = quanta::Clock::new();
    Start {
        wall_ms: SystemClock.now_ms(),
        raw: counter.raw(),
        counter,
    }
});

impl Clock for MonotonicClock {
    #[inline]
    fn now_ms(&self) -> u64 {
        let start = &*START;
        let elapsed_ns = start.counter.delta_as_nanos(start.raw, start.counter.raw());
        start.wall_ms + elapsed_ns / 1_000_000
    }
}

/// A clock that moves only when told to. Clones share the same time.
///
/// ```
/// use std::time::Duration;
/// use tollgate::clock::{Clock, ManualClock};
///
/// let clock = ManualClock::new(1_000);
/// clock.advance(Duration::from_millis(500));
/// assert_eq!(clock.now_ms(), 1_500);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now_ms: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock standing at `now_ms`.
    pub fn new(now_ms: u64) -> Self {
        Self {
            now_ms: Arc::new(AtomicU64::new(now_ms)),
        }
    }

    /// Moves the clock forward by `by` (whole milliseconds).
    pub fn advance(&self, by: Duration) {
        self.now_ms
            .fetch_add(by.as_millis() as u64, Ordering::SeqCst);
    }

    /// Sets the clock to `now_ms`; it may go backwards, as wall clocks do.
    pub fn set(&self, now_ms: u64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now_ms(&self) -> u64 {
        (**self).now_ms()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_clock_starts_at_the_wall_clock_and_never_goes_back() {
        let mut last = MonotonicClock.now_ms();
        // Generous: only an NTP step during the test could make them differ by a second.
        assert!(last.abs_diff(SystemClock.now_ms()) < 1_000);
        for _ in 0..10_000 {
            let now = MonotonicClock.now_ms();
            assert!(now >= last, "{now} < {last}");
            last = now;
        }
    }
}
