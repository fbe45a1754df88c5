//! Waiting instead of answering 429 ([`RateLimitLayer::with_max_wait`](crate::RateLimitLayer::with_max_wait)).
//!
//! **Reserved** (token bucket and GCRA limits): the layer asks the store to
//! [reserve](crate::store::Store::reserve) within `max_wait`. A request that does not fit now but
//! would within `max_wait` is counted at once, for the moment it may run, and answered
//! "allowed after `wait`": it takes a place in line, sleeps `wait` and then calls the
//! inner service without asking the store again. Its units are its own: no later request
//! can overtake it (a later one queues behind it in the store's state), and it never waits
//! in vain.
//!
//! **Asked again** (fixed and sliding windows, the log, lockouts, or a store that does not
//! reserve): a denied request whose `retry_after` is within `max_wait` takes a place,
//! sleeps until then and asks the store again. Nothing is reserved, so a request that
//! arrives meanwhile (on this process or another replica) may take the units first; a
//! waiter that finds itself overtaken waits again for the new `retry_after` while the total
//! stays within `max_wait` (counted from the first denial), and is answered 429 otherwise.
//! (A window cannot hold units for a later window without counting them in the wrong one.)
//!
//! The line is bounded per layer and per key: beyond either bound a request is answered
//! 429 at once (a layer asks to reserve only while the line has room). A place is held by
//! the request's response future, so a client that hangs up (the future is dropped) gives
//! its place back at once; a reserved one gives its units back too
//! ([`Adjustment::Refund`]) when no reservation of its key in this line was made after it:
//! then its units are the last ones counted, and handing them back lets nobody run earlier
//! than a waiter already in line. A reservation made after it keeps them (they are then
//! not the last, and giving them back would let a newcomer run at the same time as that
//! waiter). The line is the layer's: a reservation made by another replica after it is not
//! seen, and the refund may then let one newcomer run up to those units early, once.

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
use smallvec::SmallVec;

use crate::{
    Adjustment, Decision, InFlightLimit, Limit, LimitDecision, StoreError,
    count_after::Held,
    key::Key,
    store::{Admitted, Check, Guarded},
};

/// A layer's line of waiting requests, under the bounds of one version of its rules.
pub(crate) struct Waiting {
    max_wait_ms: u64,
    max_waiters: usize,
    max_per_key: usize,
    queue: Arc<Queue>,
}

/// Who waits in a layer's line: shared by the layer's clones, every service it makes and
/// every version of its rules, so that a change of the rules keeps the waiters' places.
#[derive(Debug, Default)]
pub(crate) struct Queue {
    waiters: AtomicUsize,
    /// Waiters per key; touched only by requests that wait (and, while anybody waits, by
    /// the look for room before a reservation).
    per_key: Mutex<HashMap<Key, Line>>,
}

/// One key's part of the line.
#[derive(Debug, Default)]
struct Line {
    waiters: usize,
    /// The live reservations' numbers, in the order they were made.
    reserved: SmallVec<[u64; 4]>,
    /// The number of the next reservation.
    next: u64,
}

impl fmt::Debug for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waiting")
            .field("max_wait", &Duration::from_millis(self.max_wait_ms))
            .field("max_waiters", &self.max_waiters)
            .field("max_waiters_per_key", &self.max_per_key)
            .field("waiting", &self.queue.waiters.load(Ordering::Relaxed))
            .finish()
    }
}

impl Waiting {
    pub(crate) fn new(
        queue: Arc<Queue>,
        max_wait: Duration,
        max_waiters: usize,
        max_per_key: usize,
    ) -> Self {
        Self {
            max_wait_ms: u64::try_from(max_wait.as_millis()).unwrap_or(u64::MAX),
            max_waiters,
            max_per_key,
            queue,
        }
    }

    /// The longest wait, in ms: what the layer asks the store to reserve within.
    pub(crate) fn max_wait_ms(&self) -> u64 {
        self.max_wait_ms
    }

    /// Whether a request of `key` would find a place in line now: the layer asks the store
    /// to reserve only then, so that a full line makes no reservations it must give back.
    /// (No lock while nobody waits.)
    #[inline]
    pub(crate) fn has_room(&self, key: &Key) -> bool {
        let waiting = self.queue.waiters.load(Ordering::Acquire);
        waiting == 0
            || (waiting < self.max_waiters
                && self
                    .queue
                    .per_key
                    .lock()
                    .get(key)
                    .is_none_or(|line| line.waiters < self.max_per_key))
    }

    /// How many requests wait now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.queue.waiters.load(Ordering::Relaxed)
    }

    /// A place in line for a request of `key` and `cost` that `decision` denied under
    /// `limits`, when it may wait: its `retry_after` is within `max_wait`, it can fit at
    /// all, and neither bound is reached.
    /// The request asks `store` again after its wait (`local`: the failure policy's
    /// local store, answering for the layer's).
    pub(crate) fn admit(
        self: &Arc<Self>,
        store: &Guarded,
        local: bool,
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
        let place = self.take_place(key, false)?;
        Some(Ticket {
            place,
            kind: Kind::Retry(retry_ms),
            store: store.clone(),
            local,
            held: None,
        })
    }

    /// A place in line for a request of `key` whose units the store reserved (`decision`
    /// allows it after [`Decision::wait`]), when neither bound is reached; the decision
    /// back when one is (the caller gives the units back: see [`release`] and
    /// [`refused`]).
    /// `store` reserved them (`local` as for [`admit`](Self::admit)), and gets them
    /// back if the request is dropped while it waits.
    pub(crate) fn admit_reserved(
        self: &Arc<Self>,
        store: &Guarded,
        local: bool,
        key: &Key,
        decision: Decision,
    ) -> Result<Ticket, Decision> {
        match self.take_place(key, true) {
            Some(place) => Ok(Ticket {
                place,
                kind: Kind::Reserved(decision),
                store: store.clone(),
                local,
                held: None,
            }),
            None => Err(decision),
        }
    }

    /// Takes a place for `key` (numbered as the key's latest reservation when
    /// `reserved`), unless a bound is reached.
    fn take_place(self: &Arc<Self>, key: &Key, reserved: bool) -> Option<Place> {
        if self.queue.waiters.fetch_add(1, Ordering::AcqRel) >= self.max_waiters {
            self.queue.waiters.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        let mut per_key = self.queue.per_key.lock();
        if !per_key.contains_key(key) {
            per_key.insert(key.clone(), Line::default());
        }
        let line = per_key.get_mut(key).expect("inserted above");
        if line.waiters >= self.max_per_key {
            if line.waiters == 0 {
                per_key.remove(key);
            }
            drop(per_key);
            self.queue.waiters.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        line.waiters += 1;
        let seq = reserved.then(|| {
            let seq = line.next;
            line.next += 1;
            line.reserved.push(seq);
            seq
        });
        drop(per_key);
        Some(Place {
            waiting: self.clone(),
            key: key.clone(),
            seq,
        })
    }

    /// Whether `key` has no live reservation in line.
    pub(crate) fn none_reserved(&self, key: &Key) -> bool {
        self.queue
            .per_key
            .lock()
            .get(key)
            .is_none_or(|line| line.reserved.is_empty())
    }
}

/// The denial a reservation that finds no place in line gets instead: each limit denied
/// with the reservation's wait as its `retry_after`.
pub(crate) fn refused(decision: &Decision) -> Decision {
    let wait = decision.wait_ms();
    let limits = decision
        .limits()
        .iter()
        .map(|l| LimitDecision::deny(l.limit, l.remaining, l.reset_after_ms, wait))
        .collect();
    let refused = Decision::new(limits);
    match decision.decided_at_ms() {
        Some(at) => refused.decided_at(at),
        None => refused,
    }
}

/// Gives a reservation's units back: `cost` units charged by `decision`, through
/// [`Store::adjust`](crate::store::Store::adjust) under the layer's timeout and breaker. A call
/// that has to wait for the store is spawned (the request it belonged to is gone);
/// without a Tokio runtime, or when the store does not say when it decided, nothing is
/// given back.
pub(crate) fn release(
    store: &Guarded,
    limits: &[Limit],
    key: &Key,
    cost: u32,
    decision: &Decision,
) {
    let Some(refund) = refund_of(cost, decision) else {
        return;
    };
    if let Err(check) = store.adjust_now(key, limits, refund)
        && let Ok(runtime) = tokio::runtime::Handle::try_current()
    {
        runtime.spawn(check);
    }
}

/// Which round of asking an answer is from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Round {
    /// The request's first: a denial may still wait its turn.
    First,
    /// After waiting its turn: a denial is final.
    Waited,
    /// After waiting its turn in the failure policy's local store (the shared store had
    /// failed): the answer is that store's.
    WaitedLocal,
}

/// A place in line: given back when dropped (the request was answered, or its client
/// hung up).
struct Place {
    waiting: Arc<Waiting>,
    key: Key,
    /// The reservation's number, for a reserved request still in line.
    seq: Option<u64>,
}

impl Place {
    /// Leaves the key's reservations (once): whether it was the latest live one.
    fn leave_reserved(&mut self) -> bool {
        let Some(seq) = self.seq.take() else {
            return false;
        };
        let mut per_key = self.waiting.queue.per_key.lock();
        let Some(line) = per_key.get_mut(&self.key) else {
            return false;
        };
        let last = line.reserved.last() == Some(&seq);
        line.reserved.retain(|s| *s != seq);
        last
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.leave_reserved();
        let mut per_key = self.waiting.queue.per_key.lock();
        if let Some(line) = per_key.get_mut(&self.key) {
            line.waiters -= 1;
            if line.waiters == 0 {
                per_key.remove(&self.key);
            }
        }
        drop(per_key);
        self.waiting.queue.waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A request's place in line and what it waits for.
pub(crate) struct Ticket {
    place: Place,
    kind: Kind,
    /// The store it asks again, or gives its reservation back to.
    store: Guarded,
    /// That store is the failure policy's local one.
    local: bool,
    /// The in-flight permit a reservation took with its units: held while it waits,
    /// given back if it is dropped before its time (with its units, in one call).
    held: Option<Held>,
}

enum Kind {
    /// Denied: sleeps this many ms, then asks again.
    Retry(u64),
    /// Reserved: sleeps its wait, then runs with this decision.
    Reserved(Decision),
}

/// A reserved request's place while it sleeps: dropped before its time (its client hung
/// up), it gives the units back when they are the key's latest reserved ones.
struct Reservation {
    place: Place,
    store: Guarded,
    limits: Arc<[Limit]>,
    key: Key,
    cost: u32,
    decision: Decision,
    /// Still before its time.
    armed: bool,
    /// Its in-flight permit: given back when dropped before its time, with the units
    /// when they go back too (one store call).
    held: Option<Held>,
}

impl Reservation {
    fn new(
        place: Place,
        store: Guarded,
        limits: Arc<[Limit]>,
        key: Key,
        cost: u32,
        decision: Decision,
    ) -> Self {
        Self {
            place,
            store,
            limits,
            key,
            cost,
            decision,
            armed: true,
            held: None,
        }
    }

    /// Sleeps until the reservation's time: then its units (and its permit, if it held
    /// one) are the request's to spend. Its decision, allowed now, and the permit.
    async fn until_due(mut self) -> (Decision, Option<Held>) {
        tokio::time::sleep(self.decision.wait()).await;
        self.armed = false;
        (self.decision.clone().with_wait(0), self.held.take())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let last = self.place.leave_reserved();
        let refund = self.armed && last;
        match self.held.take() {
            Some(held) => {
                let refund = refund
                    .then(|| refund_of(self.cost, &self.decision))
                    .flatten()
                    .map(|adjustment| (adjustment, self.limits.clone()));
                held.release(refund);
            }
            None if refund => release(
                &self.store,
                &self.limits,
                &self.key,
                self.cost,
                &self.decision,
            ),
            None => {}
        }
    }
}

/// The refund of `cost` units that `decision` charged; `None` when there is nothing to
/// give back or the store did not say when it decided.
fn refund_of(cost: u32, decision: &Decision) -> Option<Adjustment> {
    let charged_at_ms = decision.decided_at_ms()?;
    (cost > 0).then_some(Adjustment::Refund {
        units: cost,
        charged_at_ms,
    })
}

impl Ticket {
    /// The round the answer after the wait is settled in.
    pub(crate) fn round(&self) -> Round {
        if self.local {
            Round::WaitedLocal
        } else {
            Round::Waited
        }
    }

    /// The wait, as a [`Check`] under the same `limits`. Reserved: sleeps the reservation's
    /// wait and answers its decision (allowed now) without asking the store; dropped
    /// before then, it gives the units back as the [module docs](self) say. Denied:
    /// sleeps `retry_after`, asks the store again and, while it is denied and the new
    /// `retry_after` still ends within `max_wait` of the first denial, sleeps again. The
    /// place is given back when the check ends or is dropped.
    pub(crate) fn wait(self, limits: Arc<[Limit]>, key: Key, cost: u32) -> Check {
        let Self {
            place, kind, store, ..
        } = self;
        let retry_ms = match kind {
            Kind::Retry(retry_ms) => retry_ms,
            Kind::Reserved(decision) => {
                let reservation = Reservation::new(place, store, limits, key, cost, decision);
                return Check::pending(async move { Ok(reservation.until_due().await.0) });
            }
        };
        let max_wait = Duration::from_millis(place.waiting.max_wait_ms);
        Check::pending(async move {
            let _place = place;
            retry(retry_ms, max_wait, denied, || {
                store.check_now(&key, &limits, cost)
            })
            .await
        })
    }

    /// The same ticket holding `held`, the in-flight permit its reservation took.
    pub(crate) fn holding(mut self, held: Held) -> Self {
        self.held = Some(held);
        self
    }

    /// [`wait`](Self::wait) under an in-flight limit `cap`: a reservation answers its
    /// decision with the permit it [held](Self::holding) while it waited (given back,
    /// with its units when they are the key's latest reserved ones, if it is dropped
    /// before its time); a denied request asks again with the cap, taking a permit
    /// when allowed, and waits again only while the limits deny it (never when the cap
    /// does: the cap's denials are final).
    // The store's ready answer stays unboxed, as `Guarded::check_in_flight_now`'s.
    #[allow(clippy::result_large_err)]
    pub(crate) fn wait_in_flight(
        self,
        limits: Arc<[Limit]>,
        key: Key,
        cost: u32,
        cap: InFlightLimit,
    ) -> Check<Admitted> {
        let Self {
            place,
            kind,
            store,
            held,
            ..
        } = self;
        let retry_ms = match kind {
            Kind::Retry(retry_ms) => retry_ms,
            Kind::Reserved(decision) => {
                let mut reservation = Reservation::new(place, store, limits, key, cost, decision);
                reservation.held = held;
                return Check::pending(async move {
                    let (decision, held) = reservation.until_due().await;
                    Ok(Admitted::new(decision, held.and_then(Held::into_permit)))
                });
            }
        };
        let max_wait = Duration::from_millis(place.waiting.max_wait_ms);
        let count = limits.len();
        Check::pending(async move {
            let _place = place;
            retry(
                retry_ms,
                max_wait,
                // The cap's denial (one limit more than `limits`) is final: no retry.
                |admitted: &Admitted| {
                    let decision = admitted.decision();
                    if decision.limits().len() > count {
                        None
                    } else {
                        denied(decision)
                    }
                },
                || store.check_in_flight_now(&key, &limits, cost, &cap, 0),
            )
            .await
        })
    }
}

/// Sleeps `retry_ms`, asks, and while the answer is a denial that may wait again
/// (`again` reads its `retry_after`; `None`: allowed, or a denial that is final) ending
/// within `max_wait` of the start, sleeps that and asks again.
async fn retry<T>(
    retry_ms: u64,
    max_wait: Duration,
    again: impl Fn(&T) -> Option<Duration>,
    ask: impl Fn() -> Result<Result<T, StoreError>, Check<T>>,
) -> Result<T, StoreError> {
    let start = tokio::time::Instant::now();
    let deadline = start.checked_add(max_wait);
    let mut sleep = Duration::from_millis(retry_ms);
    loop {
        tokio::time::sleep(sleep).await;
        let result = match ask() {
            Ok(result) => result,
            Err(check) => check.await,
        };
        if let Ok(answer) = &result
            && let Some(retry) = again(answer)
        {
            let next = tokio::time::Instant::now().checked_add(retry);
            if matches!((next, deadline), (Some(next), Some(deadline)) if next <= deadline)
                && !retry.is_zero()
            {
                sleep = retry;
                continue;
            }
        }
        return result;
    }
}

/// The `retry_after` of a denial that may wait again (see [`retry`]).
fn denied(decision: &Decision) -> Option<Duration> {
    (!decision.is_allowed()).then(|| decision.retry_after())
}

#[cfg(test)]
mod tests;
