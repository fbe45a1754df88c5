//! [`Charged`]: a request's up-front charge until its response settles it, and
//! [`Held`]: what a response keeps of it (the charge, the permit) until its body ends.

use std::{fmt, sync::Arc};

use http::{HeaderMap, Response};

use crate::{
    Adjustment, Decision, Limit, StoreError,
    adaptive::Tracked,
    key::Key,
    store::{Check, Guarded, Permit},
};

/// One store's charge of a request: the store, the limits charged, and when.
pub(crate) type Charge = (Guarded, Arc<[Limit]>, u64);

/// A request's up-front charge, until its response settles it: dropped unsettled, the
/// units stay spent.
pub struct Charged {
    /// The layer's name, for the log.
    layer: Arc<str>,
    key: Key,
    pub(super) cost: u32,
    /// The store and limits charged, and when: the enforced ones and the shadow ones
    /// (each only when its call allowed the request).
    charges: [Option<Charge>; 2],
    /// The in-flight permit of the request, given back with the enforced adjustment.
    permit: Option<Held>,
    /// What the request costs in the end, once known, while its permit is held (until
    /// the body ends): settled when dropped.
    units: Option<u32>,
    /// The request's adaptive permit, until the response ends.
    adaptive: Option<Box<Tracked>>,
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
            adaptive: None,
        }
    }

    /// The same charge holding the request's adaptive permit too.
    pub(crate) fn tracking(mut self: Box<Self>, tracked: Box<Tracked>) -> Box<Self> {
        self.adaptive = Some(tracked);
        self
    }

    /// The response head is there: the adaptive sample's latency ends, and its outcome
    /// is what the head says.
    #[inline]
    pub(crate) fn head<B>(&mut self, response: Response<B>) -> Response<B> {
        match &mut self.adaptive {
            Some(tracked) => tracked.head(response),
            None => response,
        }
    }

    /// The response's trailers, for the adaptive outcome.
    #[inline]
    pub(crate) fn trailers(&mut self, trailers: &HeaderMap) {
        if let Some(tracked) = &mut self.adaptive {
            tracked.trailers(trailers);
        }
    }

    /// The response is over: the adaptive sample is taken.
    #[inline]
    pub(crate) fn ended(&mut self) {
        if let Some(tracked) = self.adaptive.take() {
            tracked.ended();
        }
    }

    /// The inner service or the body failed: the adaptive limit counts a drop.
    pub(crate) fn failed(&mut self) {
        if let Some(tracked) = self.adaptive.take() {
            tracked.failed();
        }
    }

    /// The body says it is over (it may be dropped without being read to its end).
    #[inline]
    pub(crate) fn saw_end(&self) {
        if let Some(tracked) = &self.adaptive {
            tracked.saw_end();
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
    pub(super) fn decided(mut self, units: u32) -> Self {
        self.units = Some(units);
        self
    }

    /// Settles at `units` now, or, holding a permit, returns the charge to settle at
    /// `units` when the body is over (the permit's release and the adjustment go in one
    /// store call).
    pub(super) fn settle_or_hold(self, units: u32) -> Option<Self> {
        if self.permit.is_some() || self.adaptive.is_some() {
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
