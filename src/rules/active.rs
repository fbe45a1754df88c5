//! [`Active`]: the rules as requests use them, compiled once per version (the plans'
//! table included), and [`Cell`], where a layer keeps the set in force.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::{Arc, atomic::AtomicU64, atomic::Ordering},
    task::{Context, Poll},
};

use arc_swap::ArcSwap;
use futures_util::{FutureExt, future::BoxFuture};
use http::Request;

use super::set::Rules;
use parking_lot::Mutex;

use crate::{
    CircuitBreaker, FailurePolicy, Limit,
    breaker::Breaker,
    decide::wait::{Queue, Waiting},
    headers::HeaderWriter,
    key::Key,
    plan::{PlanRequest, Plans, Resolver},
    store::{Guarded, Store},
};

/// Rules as requests use them: with what is derived from them prepared once.
#[derive(Debug)]
pub(crate) struct Active {
    pub(crate) rules: Rules,
    pub(crate) headers: HeaderWriter,
    pub(crate) version: u64,
    /// The limits that reject: none when the layer is in shadow.
    enforced: Arc<[Limit]>,
    /// The limits decided in a store call of their own and never enforced; `None` (the
    /// common case, which costs a request nothing more) when there are none.
    shadow: Option<Arc<[Limit]>>,
    /// The enforced and the shadow limits that counting after the response adjusts: all
    /// but those [counted up front](Limit::counted_up_front) (the same lists when none is).
    recounted: [Arc<[Limit]>; 2],
    /// The plans, each with its rules prepared; `None` (the common case) without plans.
    plans: Option<Box<PlanTable>>,
    /// The name of the plan these rules are of, for the metrics; `None` for a layer's.
    pub(crate) plan: Option<Arc<str>>,
    /// The failure policy's local store ([`FailurePolicy::Local`]), asked as the layer's
    /// store is (no timeout, no breaker: it answers at once).
    pub(crate) local: Option<Guarded>,
    /// The layer's store under these rules' timeout and circuit breaker.
    pub(crate) store: Guarded,
    /// The line denied requests wait in, under these rules' bounds; `None` without
    /// `max_wait`.
    pub(crate) waiting: Option<Arc<Waiting>>,
    /// Whether the store can reserve, and give back a reservation
    /// ([`Capability::Reserve`](crate::store::Capability::Reserve) and `Adjust`): else a
    /// request that may wait is checked, and waits its turn to ask again.
    pub(crate) reserves: bool,
}

impl Active {
    pub(crate) fn new(rules: Rules, version: u64, lasting: &Lasting) -> Self {
        let limits: Arc<[Limit]> = rules.limits().into();
        let (enforced, shadow) = if rules.is_shadow() {
            (Arc::from([]), Some(rules.all_limits()))
        } else if rules.shadow_limits().is_empty() {
            (limits, None)
        } else {
            (limits, Some(rules.shadow_limits().into()))
        };
        let (enforced, shadow) = if lasting.counts_after {
            (pending(enforced), shadow.map(pending))
        } else {
            (enforced, shadow)
        };
        let plans = rules
            .plans()
            .map(|plans| Box::new(PlanTable::new(plans, &rules, version, lasting)));
        let local = match rules.on_store_error() {
            FailurePolicy::Local(store) => Some(Guarded::new(Arc::new(store.clone()), None, None)),
            _ => None,
        };
        let store = Guarded::new(
            lasting.store.clone(),
            rules.timeout(),
            lasting.breaker(rules.circuit_breaker()),
        );
        let waiting = rules.max_wait().map(|max_wait| {
            let (total, per_key) = rules.max_waiters();
            Arc::new(Waiting::new(
                lasting.queue.clone(),
                max_wait,
                total,
                per_key,
            ))
        });
        let recounted = [
            recounted(&enforced),
            shadow.as_ref().map_or_else(|| Arc::from([]), recounted),
        ];
        let capabilities = lasting.store.capabilities();
        let reserves = capabilities.contains(crate::store::Capability::Reserve)
            && capabilities.contains(crate::store::Capability::Adjust);
        Self {
            recounted,
            headers: HeaderWriter::new(rules.headers(), &enforced),
            store,
            waiting,
            reserves,
            rules,
            version,
            enforced,
            shadow,
            plans,
            plan: None,
            local,
        }
    }

    /// The rules of the plan `plan`: `rules` holds its limits; its fields name it.
    pub(crate) fn for_plan(rules: Rules, version: u64, plan: &Arc<str>, lasting: &Lasting) -> Self {
        let mut active = Self::new(rules, version, lasting);
        active.headers = HeaderWriter::for_plan(active.rules.headers(), &active.enforced, plan);
        active.plan = Some(plan.clone());
        active
    }

    /// Whether requests are decided under plans.
    #[inline]
    pub(crate) fn has_plans(&self) -> bool {
        self.plans.is_some()
    }

    /// The plan of `request` with `key` (the layer's own limits without plans).
    pub(crate) fn choose<B>(
        &self,
        request: &http::Request<B>,
        key: &crate::key::Key,
    ) -> Result<Chosen<'_>, Resolving> {
        match &self.plans {
            Some(plans) => plans.choose(request, key),
            None => Ok(Chosen::Layer),
        }
    }

    /// The plan called `name` once a lookup answered.
    pub(crate) fn named(&self, name: Option<&str>) -> Chosen<'_> {
        match &self.plans {
            Some(plans) => plans.named(name),
            None => Chosen::Layer,
        }
    }

    /// The enforced limits, in the order they are reported.
    pub(crate) fn limits(&self) -> &Arc<[Limit]> {
        &self.enforced
    }

    /// The store that decides under these rules: the failure policy's local one when
    /// `local` (answering for the layer's, which failed) and there is one, else the
    /// layer's.
    #[inline]
    pub(crate) fn store_for(&self, local: bool) -> &Guarded {
        match (&self.local, local) {
            (Some(store), true) => store,
            _ => &self.store,
        }
    }

    /// The shadow limits, if any.
    #[inline]
    pub(crate) fn shadow(&self) -> Option<&Arc<[Limit]>> {
        self.shadow.as_ref()
    }

    /// The limits counting after the response adjusts: the enforced ones and the shadow
    /// ones (none, or empty lists, when every limit is counted up front).
    pub(crate) fn recounted(&self) -> &[Arc<[Limit]>; 2] {
        &self.recounted
    }
}

/// `limits` less those counted up front: `limits` itself when none is.
fn recounted(limits: &Arc<[Limit]>) -> Arc<[Limit]> {
    if limits.iter().any(Limit::is_counted_up_front) {
        limits
            .iter()
            .filter(|l| !l.is_counted_up_front())
            .cloned()
            .collect()
    } else {
        limits.clone()
    }
}

/// The rules of one layer (and all its clones and services), shared with its handles.
pub(crate) struct Cell {
    pub(crate) active: ArcSwap<Active>,
    /// The version of `active`, published after it: a service compares it with the
    /// version of the rules it holds (one relaxed-cost load per request, where loading
    /// `active` itself would cost arc-swap's debt protocol) and reloads only when it grew.
    pub(crate) current: AtomicU64,
    /// What outlives a change of the rules.
    pub(crate) lasting: Lasting,
    /// Orders concurrent [`RulesHandle::set`](crate::rules::RulesHandle::set) calls: versions
    /// only grow.
    pub(crate) next_version: AtomicU64,
}

/// What a layer keeps across changes of its rules: its store, its line of waiting
/// requests, and its circuit breaker (while its settings stay the same).
pub(crate) struct Lasting {
    /// The layer's store, told about new limits (see [`Store::limits_changed`]).
    pub(crate) store: Arc<dyn Store>,
    /// Whether the layer counts after the response: its lockouts then count the units
    /// of requests in flight as pending ([`Limit::pending_until_settled`]).
    pub(crate) counts_after: bool,
    queue: Arc<Queue>,
    breaker: Mutex<Option<(CircuitBreaker, Arc<Breaker>)>>,
}

/// `limits`, their lockouts counting the units of requests in flight as pending (the
/// limits of a layer that counts after the response): only kept units start a block. A
/// limit [counted up front](Limit::counted_up_front) keeps every charge at once.
fn pending(limits: Arc<[Limit]>) -> Arc<[Limit]> {
    if !limits
        .iter()
        .any(|l| l.lockout().is_some() && !l.is_counted_up_front())
    {
        return limits;
    }
    limits
        .iter()
        .map(|l| match l.is_counted_up_front() {
            true => l.clone(),
            false => l.clone().pending_until_settled(),
        })
        .collect()
}

impl Lasting {
    /// The breaker for `config`: the one in use when its settings are the same, else a
    /// new, closed one.
    fn breaker(&self, config: Option<CircuitBreaker>) -> Option<Arc<Breaker>> {
        let config = config?;
        let mut held = self.breaker.lock();
        match &*held {
            Some((same, breaker)) if *same == config => Some(breaker.clone()),
            _ => {
                let breaker = Arc::new(Breaker::new(config));
                *held = Some((config, breaker.clone()));
                Some(breaker)
            }
        }
    }
}

impl Cell {
    pub(crate) fn new(rules: Rules, store: Arc<dyn Store>, counts_after: bool) -> Arc<Self> {
        let lasting = Lasting {
            store,
            counts_after,
            queue: Arc::default(),
            breaker: Mutex::default(),
        };
        Arc::new(Self {
            active: ArcSwap::from_pointee(Active::new(rules, 1, &lasting)),
            current: AtomicU64::new(1),
            lasting,
            next_version: AtomicU64::new(2),
        })
    }

    /// Replaces `held` by the rules in force if they are newer.
    #[inline]
    pub(crate) fn refresh(&self, held: &mut Arc<Active>) {
        if held.version < self.current.load(Ordering::Acquire) {
            *held = self.active.load_full();
        }
    }
}

impl fmt::Debug for Cell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cell")
            .field("active", &self.active.load())
            .finish_non_exhaustive()
    }
}

/// A layer's plans as requests use them: each with its rules prepared once.
#[derive(Debug)]
pub(crate) struct PlanTable {
    entries: Vec<(Arc<str>, Entry)>,
    /// The index of the default plan in `entries`; `None`: the layer's own limits.
    default: Option<usize>,
    resolver: Resolver,
}

#[derive(Debug)]
enum Entry {
    Limited(Arc<Active>),
    Unlimited,
}

/// The plan a request is decided under.
pub(crate) enum Chosen<'a> {
    /// The layer's own limits (no plan, and no default plan).
    Layer,
    /// A plan with limits: its rules.
    Plan(&'a Arc<Active>),
    /// An unlimited plan (its name): no store call.
    Unlimited(&'a Arc<str>),
}

impl PlanTable {
    /// The table of `plans` for a layer under `rules`, with version `version`: each plan's
    /// rules are the layer's with the plan's limits (and its fields' writer).
    pub(crate) fn new(plans: &Plans, rules: &Rules, version: u64, lasting: &Lasting) -> Self {
        let entries = plans
            .plans
            .iter()
            .map(|plan| {
                let entry = match plan.stored_limits() {
                    Some(limits) => {
                        let rules = rules.for_plan(limits, plan.stored_shadow_limits());
                        Entry::Limited(Arc::new(Active::for_plan(
                            rules, version, &plan.name, lasting,
                        )))
                    }
                    None => Entry::Unlimited,
                };
                (plan.name.clone(), entry)
            })
            .collect::<Vec<_>>();
        let default = plans
            .default
            .as_ref()
            .and_then(|name| entries.iter().position(|(n, _)| n == name));
        Self {
            entries,
            default,
            resolver: plans.resolver.clone(),
        }
    }

    /// The plan of `request`, counted against `key`, or the lookup to wait for.
    pub(crate) fn choose<B>(
        &self,
        request: &Request<B>,
        key: &Key,
    ) -> Result<Chosen<'_>, Resolving> {
        Ok(match &self.resolver {
            Resolver::None => self.named(None),
            Resolver::Header(name) => {
                self.named(request.headers().get(name).and_then(|v| v.to_str().ok()))
            }
            Resolver::Sync(resolve) => self.named(resolve(&PlanRequest::new(request, key))),
            Resolver::Lookup(lookup) => match lookup.cached(key) {
                Some(plan) => self.named(plan.as_deref()),
                None => return Err(Resolving(lookup.resolve(key.clone()))),
            },
        })
    }

    /// The plan called `name`; the default one for `None` or an unknown name.
    pub(crate) fn named(&self, name: Option<&str>) -> Chosen<'_> {
        let found = name.and_then(|name| self.entries.iter().position(|(n, _)| &**n == name));
        if found.is_none()
            && let Some(name) = name
        {
            tracing::debug!(
                plan = name,
                "rate limit plan unknown; using the default plan"
            );
        }
        match found.or(self.default) {
            None => Chosen::Layer,
            Some(index) => match &self.entries[index].1 {
                Entry::Limited(rules) => Chosen::Plan(rules),
                Entry::Unlimited => Chosen::Unlimited(&self.entries[index].0),
            },
        }
    }
}

/// An async plan lookup in flight: its answer is the plan's name, `None` for the
/// default plan.
pub(crate) struct Resolving(BoxFuture<'static, Option<Arc<str>>>);

impl Future for Resolving {
    type Output = Option<Arc<str>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.0.poll_unpin(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_breaker_outlives_rules_that_keep_its_settings() {
        let lasting = Lasting {
            store: Arc::new(crate::store::MemoryStore::new()),
            counts_after: false,
            queue: Arc::default(),
            breaker: Mutex::default(),
        };
        let config = CircuitBreaker::default();
        let first = lasting.breaker(Some(config)).unwrap();
        let same = lasting.breaker(Some(config)).unwrap();
        assert!(Arc::ptr_eq(&first, &same));
        let other = lasting
            .breaker(Some(config.with_cooldown(Duration::from_secs(9))))
            .unwrap();
        assert!(!Arc::ptr_eq(&first, &other));
        assert!(lasting.breaker(None).is_none());
    }
}
