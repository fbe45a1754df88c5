//! [`Rules`]: a layer's changeable configuration, as a value.

use std::{sync::Arc, time::Duration};

use crate::{
    CircuitBreaker, ConfigError, FailurePolicy, InFlightLimit, Limit, MissingKey,
    headers::HeaderStyle, plan::Plans,
};

/// The default time a store call may take before the failure policy applies.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);
/// The default bound on waiting requests per layer.
pub const DEFAULT_MAX_WAITERS: usize = 1024;
/// The default bound on waiting requests per key.
pub const DEFAULT_MAX_WAITERS_PER_KEY: usize = 16;

/// A layer's changeable configuration: its limits and policies. Built with
/// [`Rules::new`] and the `with_*` methods, applied with [`RulesHandle::set`](crate::rules::RulesHandle::set).
#[derive(Debug, Clone)]
pub struct Rules {
    limits: Arc<[Limit]>,
    /// Decided and counted, never enforced: see [`with_shadow_limits`](Self::with_shadow_limits).
    shadow_limits: Arc<[Limit]>,
    /// Every limit is a shadow one: see [`with_shadow`](Self::with_shadow).
    shadow: bool,
    on_store_error: FailurePolicy,
    on_missing_key: MissingKey,
    headers: HeaderStyle,
    /// Limits chosen per request: see [`with_plans`](Self::with_plans).
    plans: Option<Plans>,
    timeout: Option<Duration>,
    circuit_breaker: Option<CircuitBreaker>,
    /// `None`: denials are answered at once.
    max_wait: Option<Duration>,
    /// Per layer, per key.
    max_waiters: (usize, usize),
    /// [`RateLimitInfo`](crate::RateLimitInfo) in allowed requests' extensions.
    request_info: bool,
    /// At most this many requests in flight per key: see [`with_in_flight`](Self::with_in_flight).
    in_flight: Option<InFlightLimit>,
}

impl Rules {
    /// `limits` (at least one) with the default policies: fail open, reject requests
    /// without a key, the IETF fields.
    ///
    /// # Errors
    ///
    /// See [`with_limits`](Self::with_limits).
    pub fn new(limits: impl IntoIterator<Item = Limit>) -> Result<Self, ConfigError> {
        Self {
            limits: Arc::from([]),
            shadow_limits: Arc::from([]),
            shadow: false,
            on_store_error: FailurePolicy::default(),
            on_missing_key: MissingKey::default(),
            headers: HeaderStyle::default(),
            plans: None,
            timeout: Some(DEFAULT_TIMEOUT),
            circuit_breaker: Some(CircuitBreaker::default()),
            max_wait: None,
            max_waiters: (DEFAULT_MAX_WAITERS, DEFAULT_MAX_WAITERS_PER_KEY),
            request_info: false,
            in_flight: None,
        }
        .with_limits(limits)
    }

    /// The same rules with these limits instead (all must allow a request, as for
    /// [`RateLimitLayer::with_limit`](crate::RateLimitLayer::with_limit); equal limits count once).
    ///
    /// # Errors
    ///
    /// No limit at all (field `limits`), or two different limits with the same state
    /// (field `name`): two [carried-over](crate::OnChange::CarryOver) limits with one
    /// name, algorithm and window.
    pub fn with_limits(
        mut self,
        limits: impl IntoIterator<Item = Limit>,
    ) -> Result<Self, ConfigError> {
        let limits = unique(limits)?;
        if limits.is_empty() && self.shadow_limits.is_empty() {
            return Err(ConfigError::new("limits", "must hold at least one limit"));
        }
        disjoint(&limits, &self.shadow_limits)?;
        self.limits = limits.into();
        Ok(self)
    }

    /// The same rules with these shadow limits instead (none by default): decided and
    /// counted on every request, never rejecting. See [Shadow mode](crate::guide::shadow)
    /// for what they count and what shows.
    ///
    /// # Errors
    ///
    /// A shadow limit with the state of an enforced one (field `shadow_limits`: they
    /// would count each request twice), or two shadow limits sharing one state (as for
    /// [`with_limits`](Self::with_limits)).
    pub fn with_shadow_limits(
        mut self,
        limits: impl IntoIterator<Item = Limit>,
    ) -> Result<Self, ConfigError> {
        let shadow = unique(limits)?;
        if shadow.is_empty() && self.limits.is_empty() {
            return Err(ConfigError::new("limits", "must hold at least one limit"));
        }
        disjoint(&self.limits, &shadow)?;
        self.shadow_limits = shadow.into();
        Ok(self)
    }

    /// The same rules with every limit in shadow (`true`) or not: no request is
    /// rejected for its rate, and each one a limit would reject is counted as
    /// `would_reject` and logged. All limits are still decided together, in one store
    /// call. See [Shadow mode](crate::guide::shadow).
    pub fn with_shadow(mut self, shadow: bool) -> Self {
        self.shadow = shadow;
        self
    }

    /// The same rules with this failure policy. See [`FailurePolicy`].
    pub fn with_on_store_error(mut self, policy: FailurePolicy) -> Self {
        self.on_store_error = policy;
        self
    }

    /// The same rules with this missing-key policy. See [`MissingKey`].
    pub fn with_on_missing_key(mut self, policy: MissingKey) -> Self {
        self.on_missing_key = policy;
        self
    }

    /// The same rules with these rate-limit fields. See [`HeaderStyle`].
    pub fn with_headers(mut self, style: HeaderStyle) -> Self {
        self.headers = style;
        self
    }

    /// The same rules with these [plans](crate::plan): each request is decided under the
    /// limits of the plan their resolver picks, or under these rules' limits when it
    /// picks none and there is no default plan.
    pub fn with_plans(mut self, plans: Plans) -> Self {
        self.plans = Some(plans);
        self
    }

    /// The same rules without plans: every request is decided under the limits.
    pub fn without_plans(mut self) -> Self {
        self.plans = None;
        self
    }

    /// The same rules with this store timeout: how long a store call may take before the
    /// failure policy applies ([`DEFAULT_TIMEOUT`] by default; `None` waits as long as it
    /// takes). See [`RateLimitLayer::with_timeout`](crate::RateLimitLayer::with_timeout).
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// The same rules with this circuit breaker (`None`: none). A change of its settings
    /// starts it closed; rules that keep them keep its state. See
    /// [`RateLimitLayer::with_circuit_breaker`](crate::RateLimitLayer::with_circuit_breaker).
    pub fn with_circuit_breaker(mut self, breaker: Option<CircuitBreaker>) -> Self {
        self.circuit_breaker = breaker;
        self
    }

    /// The same rules letting a denied request wait up to `max_wait` (`None`: answered
    /// at once). Requests waiting when it changes keep their place. See
    /// [`RateLimitLayer::with_max_wait`](crate::RateLimitLayer::with_max_wait).
    pub fn with_max_wait(mut self, max_wait: Option<Duration>) -> Self {
        self.max_wait = max_wait.filter(|wait| !wait.is_zero());
        self
    }

    /// The same rules with these bounds on waiting requests: `total` per layer, `per_key`
    /// per key. See [`RateLimitLayer::with_max_waiters`](crate::RateLimitLayer::with_max_waiters).
    pub fn with_max_waiters(mut self, total: usize, per_key: usize) -> Self {
        self.max_waiters = (total, per_key);
        self
    }

    /// The same rules putting a [`RateLimitInfo`](crate::RateLimitInfo) (the decision and
    /// the plan) in the extensions of each request the store allowed (`true`), for the
    /// inner service to read; off by default (it costs an allowed request an allocation).
    pub fn with_request_info(mut self, on: bool) -> Self {
        self.request_info = on;
        self
    }

    /// The same rules with this in-flight limit (`None`: none, the default): at most
    /// `max` requests of a key in flight, decided in the same store call as the limits,
    /// all-or-nothing, on the layer's store (and its plans': every plan has the
    /// layer's in-flight limit). A change keeps the permits held: requests in flight
    /// when it comes count against the new `max`. See [`InFlightLimit`] and
    /// [`RateLimitLayer::with_in_flight`](crate::RateLimitLayer::with_in_flight).
    ///
    /// The cap is enforced in [shadow mode](Self::with_shadow) too (shadow limits are
    /// about rates); shadow limits are decided in a call of their own beside it, as
    /// without one.
    ///
    /// With [`max_wait`](Self::with_max_wait): a request the cap has room for that the
    /// limits would allow within `max_wait` takes its permit and reserves its units in
    /// one store call, all-or-nothing, and **holds its permit while it waits**, so the
    /// cap bounds the requests that wait as well as those that run. The permit comes
    /// back when its response ends, or at once when the waiting request is dropped (its
    /// client hung up; its units then go back in the same call when they are the key's
    /// latest reserved ones). **A denial by the cap never waits**: it is answered 429
    /// at once, with nothing reserved. A request that waits its turn and asks again (a
    /// store that cannot reserve, limits that cannot be reserved, a full line) asks with
    /// the cap too, and takes its permit only then.
    pub fn with_in_flight(mut self, in_flight: Option<InFlightLimit>) -> Self {
        self.in_flight = in_flight;
        self
    }

    /// The in-flight limit. See [`with_in_flight`](Self::with_in_flight).
    pub fn in_flight(&self) -> Option<&InFlightLimit> {
        self.in_flight.as_ref()
    }

    /// Whether allowed requests carry a [`RateLimitInfo`](crate::RateLimitInfo). See
    /// [`with_request_info`](Self::with_request_info).
    #[inline]
    pub fn request_info(&self) -> bool {
        self.request_info
    }

    /// The store timeout. See [`with_timeout`](Self::with_timeout).
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// The circuit breaker's settings. See [`with_circuit_breaker`](Self::with_circuit_breaker).
    pub fn circuit_breaker(&self) -> Option<CircuitBreaker> {
        self.circuit_breaker
    }

    /// The longest wait. See [`with_max_wait`](Self::with_max_wait).
    pub fn max_wait(&self) -> Option<Duration> {
        self.max_wait
    }

    /// The bounds on waiting requests, per layer and per key.
    pub fn max_waiters(&self) -> (usize, usize) {
        self.max_waiters
    }

    /// The plans, if any. See [`with_plans`](Self::with_plans).
    pub fn plans(&self) -> Option<&Plans> {
        self.plans.as_ref()
    }

    /// These rules with a plan's (stored) limits in place of their own, its own shadow
    /// limits if it has them, and no plans.
    pub(crate) fn for_plan(&self, limits: Arc<[Limit]>, shadow: Option<Arc<[Limit]>>) -> Self {
        Self {
            limits,
            shadow_limits: shadow.unwrap_or_else(|| self.shadow_limits.clone()),
            plans: None,
            ..self.clone()
        }
    }

    /// The limits, in the order they are reported.
    pub fn limits(&self) -> &[Limit] {
        &self.limits
    }

    /// The shadow limits. See [`with_shadow_limits`](Self::with_shadow_limits).
    pub fn shadow_limits(&self) -> &[Limit] {
        &self.shadow_limits
    }

    /// Whether every limit is in shadow. See [`with_shadow`](Self::with_shadow).
    pub fn is_shadow(&self) -> bool {
        self.shadow
    }

    /// Every limit, enforced then shadow: what the store keeps state for.
    pub(crate) fn all_limits(&self) -> Arc<[Limit]> {
        if self.shadow_limits.is_empty() {
            return self.limits.clone();
        }
        self.limits
            .iter()
            .chain(self.shadow_limits.iter())
            .cloned()
            .collect()
    }

    /// [`all_limits`](Self::all_limits), and every plan's limits as they are stored
    /// (each plan's state apart): every limit that may hold state for a key.
    pub(crate) fn every_stored_limit(&self) -> Arc<[Limit]> {
        let all = self.all_limits();
        let Some(plans) = &self.plans else {
            return all;
        };
        let planned = plans
            .plans()
            .iter()
            .flat_map(|p| [p.stored_limits(), p.stored_shadow_limits()])
            .flatten();
        all.iter()
            .cloned()
            .chain(planned.flat_map(|l| l.to_vec()))
            .collect()
    }

    /// The failure policy.
    pub fn on_store_error(&self) -> &FailurePolicy {
        &self.on_store_error
    }

    /// The missing-key policy.
    pub fn on_missing_key(&self) -> MissingKey {
        self.on_missing_key
    }

    /// The rate-limit fields.
    pub fn headers(&self) -> HeaderStyle {
        self.headers
    }

    /// `limits` with the rest of these rules, for the layer's builder (which cannot fail):
    /// a limit with the same state as one present replaces it.
    pub(crate) fn push_limit(&mut self, limit: Limit) {
        self.shadow_limits = without(&self.shadow_limits, &limit);
        self.limits = pushed(&self.limits, limit);
    }

    /// A shadow limit, for the layer's builder: an enforced limit with the same state
    /// becomes this shadow one (so no state is counted twice).
    pub(crate) fn push_shadow_limit(&mut self, limit: Limit) {
        self.limits = without(&self.limits, &limit);
        self.shadow_limits = pushed(&self.shadow_limits, limit);
    }
}

/// `limits` plus `limit`, which replaces one with the same state.
fn pushed(limits: &[Limit], limit: Limit) -> Arc<[Limit]> {
    let mut limits = limits.to_vec();
    match limits.iter_mut().find(|l| l.id() == limit.id()) {
        Some(same) => *same = limit,
        None => limits.push(limit),
    }
    limits.into()
}

/// `limits` without the one with `limit`'s state.
fn without(limits: &Arc<[Limit]>, limit: &Limit) -> Arc<[Limit]> {
    if limits.iter().all(|l| l.id() != limit.id()) {
        return limits.clone();
    }
    limits
        .iter()
        .filter(|l| l.id() != limit.id())
        .cloned()
        .collect()
}

/// `limits` with equal ones counted once; two different ones with one state refused.
pub(crate) fn unique(limits: impl IntoIterator<Item = Limit>) -> Result<Vec<Limit>, ConfigError> {
    let mut unique: Vec<Limit> = Vec::new();
    for limit in limits {
        match unique.iter().find(|l| l.id() == limit.id()) {
            Some(same) if *same == limit => {}
            Some(same)
                if same.lockout() != limit.lockout()
                    && same.clone().with_lockout_ms(0) == limit.clone().with_lockout_ms(0) =>
            {
                return Err(ConfigError::new(
                    "lockout",
                    format!(
                        "{limit:?} differs from another limit only in its lockout: they would \
                         share one state; keep one"
                    ),
                ));
            }
            Some(_) => {
                return Err(ConfigError::new(
                    "name",
                    format!(
                        "{:?} is carried over by two different limits with the same \
                         algorithm and window: they would share one state",
                        limit.name().unwrap_or_default()
                    ),
                ));
            }
            None => unique.push(limit),
        }
    }
    Ok(unique)
}

/// Refuses a shadow limit with the state of an enforced one.
pub(crate) fn disjoint(enforced: &[Limit], shadow: &[Limit]) -> Result<(), ConfigError> {
    match shadow
        .iter()
        .find(|s| enforced.iter().any(|e| e.id() == s.id()))
    {
        Some(both) => Err(ConfigError::new(
            "shadow_limits",
            format!("{both:?} has the state of an enforced limit: each request would count twice"),
        )),
        None => Ok(()),
    }
}

/// Refuses `rules` that need a capability `store` lacks: an in-flight limit on a store
/// without [`Capability::InFlight`](crate::store::Capability::InFlight).
pub(crate) fn needs(rules: &Rules, store: &dyn crate::store::Store) -> Result<(), ConfigError> {
    let capability = crate::store::Capability::InFlight;
    if rules.in_flight.is_some() && !store.capabilities().contains(capability) {
        return Err(ConfigError::new(
            "in_flight",
            format!(
                "{} cannot count requests in flight with its limits (Store::check_in_flight), \
                 which an in-flight limit needs",
                crate::store::store_name(store)
            ),
        ));
    }
    Ok(())
}
