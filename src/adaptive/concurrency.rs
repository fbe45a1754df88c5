//! [`Concurrency`]: the running adaptive limit of a process (or of a key).

use std::{
    fmt,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use super::{AdaptiveLimit, Estimate, Outcome, Priority, window::Window};

/// An adaptive in-flight limit as it runs: admits requests under the current limit by
/// priority, and moves the limit from the finished ones. Clones share one state.
///
/// ```
/// use std::time::Duration;
/// use tollgate::adaptive::{AdaptiveLimit, Aimd, Concurrency, Outcome, Priority};
///
/// let limit = AdaptiveLimit::new(Aimd::new()).with_bounds(1, 2, 10)?;
/// let concurrency = Concurrency::new(limit);
/// let start = Duration::ZERO;
/// let a = concurrency.try_acquire(Priority::Default, start).unwrap();
/// let b = concurrency.try_acquire(Priority::Critical, start).unwrap();
/// // The limit is 2: a third request is shed.
/// assert!(concurrency.try_acquire(Priority::Critical, start).is_err());
/// a.finish(start + Duration::from_millis(5), Outcome::Success);
/// drop(b); // a dropped permit is given back, without a sample
/// assert_eq!(concurrency.snapshot().in_flight, 0);
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct Concurrency {
    inner: Arc<Inner>,
}

struct Inner {
    settings: AdaptiveLimit,
    state: Mutex<State>,
}

struct State {
    /// The limit, unrounded: the algorithms move it by fractions.
    limit: f64,
    in_flight: u32,
    /// Requests in flight by priority (indexed by `Priority as usize`).
    in_flight_by: [u32; 3],
    window: Window,
    /// The last closed window's busiest moments by priority: with the current window's,
    /// what [`Shares`](super::Shares) keeps for each priority follows.
    last_busiest_by: [u32; 3],
    estimate: Estimate,
    samples: u64,
    /// Shed requests, by priority (sheddable, default, critical).
    shed: [u64; 3],
}

/// What a [`Concurrency`] looks like now, for metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Snapshot {
    /// The current limit.
    pub limit: u32,
    /// Requests in flight.
    pub in_flight: u32,
    /// Completed requests whose latency was a sample, since the start.
    pub samples: u64,
    /// The baseline latency ([`Gradient`](super::Gradient) only).
    pub baseline: Option<Duration>,
    /// Requests shed since the start, by priority: sheddable, default, critical.
    pub shed: [u64; 3],
}

/// A request turned away by a [`Concurrency`]: its priority may not use more of the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shed {
    /// The request's priority.
    pub priority: Priority,
    /// The limit when it was shed.
    pub limit: u32,
    /// Requests in flight when it was shed.
    pub in_flight: u32,
}

impl fmt::Display for Shed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} request shed: {} in flight, limit {}",
            self.priority.as_str(),
            self.in_flight,
            self.limit
        )
    }
}

impl std::error::Error for Shed {}

impl fmt::Debug for Concurrency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Concurrency")
            .field("settings", &self.inner.settings)
            .field("now", &self.snapshot())
            .finish()
    }
}

impl Concurrency {
    /// A limit at `settings.initial()`, nothing in flight.
    pub fn new(settings: AdaptiveLimit) -> Self {
        let state = State {
            limit: f64::from(settings.initial()),
            in_flight: 0,
            in_flight_by: [0; 3],
            window: Window::new(Duration::ZERO, 0, [0; 3]),
            last_busiest_by: [0; 3],
            estimate: Estimate::new(settings.algorithm()),
            samples: 0,
            shed: [0; 3],
        };
        Self {
            inner: Arc::new(Inner {
                settings,
                state: Mutex::new(state),
            }),
        }
    }

    /// Admits a request of `priority` at `now` (a monotonic time since any fixed start,
    /// the same for every call) if its priority may use one more of the limit: a
    /// [`Permit`] to [`finish`](Permit::finish) when it ends, or [`Shed`].
    pub fn try_acquire(&self, priority: Priority, now: Duration) -> Result<Permit, Shed> {
        let mut state = self.inner.lock();
        let limit = state.limit as u32;
        let peaks: [u32; 3] =
            std::array::from_fn(|p| state.window.busiest_by[p].max(state.last_busiest_by[p]));
        let allowed = self.inner.settings.shares().allowed(limit, priority, peaks);
        let at_or_below: u32 = state.in_flight_by[..=priority as usize].iter().sum();
        if state.in_flight >= limit || at_or_below >= allowed {
            state.shed[priority as usize] += 1;
            state.window.shed += 1;
            return Err(Shed {
                priority,
                limit,
                in_flight: state.in_flight,
            });
        }
        state.in_flight += 1;
        let p = priority as usize;
        state.in_flight_by[p] += 1;
        state.window.busiest = state.window.busiest.max(state.in_flight);
        state.window.busiest_by[p] = state.window.busiest_by[p].max(state.in_flight_by[p]);
        Ok(Permit {
            inner: self.inner.clone(),
            started: now,
            priority,
            done: false,
        })
    }

    /// The limit, in-flight count, samples, baseline and shed counts now.
    pub fn snapshot(&self) -> Snapshot {
        let state = self.inner.lock();
        Snapshot {
            limit: state.limit as u32,
            in_flight: state.in_flight,
            samples: state.samples,
            baseline: state.estimate.baseline(),
            shed: state.shed,
        }
    }

    /// The settings.
    pub fn settings(&self) -> &AdaptiveLimit {
        &self.inner.settings
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic under the lock leaves counts that are still counts.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn release(&self, priority: Priority, started: Duration, now: Duration, outcome: Outcome) {
        let settings = &self.settings;
        let mut state = self.lock();
        state.in_flight -= 1;
        state.in_flight_by[priority as usize] -= 1;
        let latency = now.saturating_sub(started);
        match outcome {
            Outcome::Success => {
                if state.estimate.slow().is_some_and(|slow| latency > slow) {
                    state.window.slow += 1;
                }
                state.samples += 1;
                state.window.samples += 1;
                state.window.latency_us = state
                    .window
                    .latency_us
                    .saturating_add(u64::try_from(latency.as_micros()).unwrap_or(u64::MAX));
            }
            Outcome::Dropped => state.window.dropped += 1,
            Outcome::Ignore => return,
        }
        if state
            .window
            .is_over(now, settings.window(), settings.min_samples())
        {
            let State {
                limit,
                window,
                estimate,
                in_flight,
                in_flight_by,
                last_busiest_by,
                ..
            } = &mut *state;
            let next = estimate.next(*limit, window, settings.initial());
            *limit = next.clamp(f64::from(settings.min()), f64::from(settings.max()));
            *last_busiest_by = window.busiest_by;
            *window = Window::new(now, *in_flight, *in_flight_by);
        }
    }
}

/// A request admitted by a [`Concurrency`]: it counts as in flight until it is
/// [finished](Self::finish) or dropped (a dropped permit gives no sample: a client that
/// hung up says nothing about the service).
#[must_use = "a permit counts as in flight until it is finished or dropped"]
pub struct Permit {
    inner: Arc<Inner>,
    started: Duration,
    priority: Priority,
    done: bool,
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("started", &self.started)
            .field("priority", &self.priority)
            .finish_non_exhaustive()
    }
}

impl Permit {
    /// The request ended at `now` with `outcome`: it stops counting as in flight, and its
    /// latency (`now` less the time it was admitted) is a sample.
    pub fn finish(mut self, now: Duration, outcome: Outcome) {
        self.done = true;
        self.inner
            .release(self.priority, self.started, now, outcome);
    }

    /// Counts the request's latency from `now` instead of its admission: it starts being
    /// served now (after a store call, or a wait in line, that says nothing about the
    /// service). It stays in flight all along.
    pub fn restart(&mut self, now: Duration) {
        self.started = now;
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.done {
            self.inner
                .release(self.priority, self.started, self.started, Outcome::Ignore);
        }
    }
}
