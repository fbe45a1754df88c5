//! Leased quota: a hot key's units taken from Redis ahead of time, in batches, and spent
//! in process.
//!
//! The units are pre-paid: a request that goes to Redis anyway asks for a few more units
//! beside its own, and the script counts them into the window in the same call that
//! decides the request (see [`algorithm::lease`](crate::algorithm::lease) for the model,
//! which algorithms are leased and what holds for each). Spending them is a local
//! decision under a short lock, with no await. Whatever happens to a lease afterwards (lost in a timeout,
//! stranded by a node that dies) can only under-admit.
//!
//! - A key asks only once it is hot on this node: at least two requests within one
//!   [`period`](LeaseConfig::with_period). Before that, its requests, Redis calls and decisions
//!   are exactly those with leasing off, and it costs one slot of a fixed table of keys
//!   seen lately (no allocation): its bookkeeping starts at its second request.
//! - The size asked for is the node's smoothed traffic of that key over one period,
//!   bounded by a [fraction](LeaseConfig::with_max_fraction) of the smallest limit; the script
//!   grants at most half of what is left, so leases shrink as the budget runs out.
//! - A lease belongs to the window it was granted in and ends with it (the earliest
//!   window of its limits, a thousandth of the time left early for clock drift; a
//!   bucket's lease lasts one window). A request that does not fit the lease (or finds it
//!   ended) goes to Redis, and takes the lease's units back to Redis in the same call, so
//!   that with one node and a window algorithm Redis decides it exactly as without
//!   leases. An empty lease never rejects: every 429 comes from Redis (or the block
//!   cache) with its exact `retry_after`.
//! - A lease at a quarter of its units is refilled by the next request, which goes to
//!   Redis (one refill in flight per key) and asks only for what tops the lease up to the
//!   fraction; if Redis denies that request or fails, it is spent from the lease instead.
//! - Unused units go back when the key idles, on
//!   [`release_leases`](super::RedisStore::release_leases), and when the store is dropped
//!   inside a Tokio runtime.

use std::{
    fmt,
    sync::{
        Arc, Weak,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use parking_lot::Mutex;
use quick_cache::sync::Cache;
use smallvec::SmallVec;

mod config;
mod entry;

pub use self::config::LeaseConfig;
use self::entry::{Entry, EntryKey, EntryKeyRef, Lease, Seen};
use super::{
    block_cache::{BlockCache, local_now_ms},
    encode::{Encoded, Return, Rider, Target, return_call},
    link::Connection,
};
use crate::{
    Decision, Limit, LimitDecision, StoreError, algorithm::lease::limit_leasable, clock::Clock,
    decision::LimitDecisions, key::Key,
};

/// The leases of one store (shared by its clones).
pub(crate) struct Leases {
    config: LeaseConfig,
    connection: Connection,
    clock: Option<Arc<dyn Clock>>,
    entries: Cache<EntryKey, Arc<Entry>>,
    /// Keys seen once lately, before they get an entry: see [`Seen`].
    seen: Seen,
    /// Entries that hold a lease: what the sweeper and a release walk.
    held: Mutex<Vec<Arc<Entry>>>,
    /// The task that returns idle leases; started again when its runtime shut down.
    sweeper: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl fmt::Debug for Leases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leases")
            .field("config", &self.config)
            .field("held", &self.held.lock().len())
            .finish()
    }
}

/// What the lease part of a check found.
pub(crate) enum Spent {
    /// Decided from the lease.
    Here(Decision),
    /// Ask Redis; the entry, when the key is watched.
    Redis(Option<Arc<Entry>>),
}

/// What rides on a request to Redis: an ask, a return, or both.
pub(crate) struct Attach {
    leases: Arc<Leases>,
    entry: Arc<Entry>,
    cost: u32,
    /// Local ms when the request left: the lease's deadline counts from here, before
    /// Redis read its clock.
    sent_at: u64,
    /// The entry's generation then: a reset since voids the grant.
    generation: u64,
    ask: u64,
    /// The lease this request takes back to Redis (consumed when the call is made).
    back: Option<Return>,
    /// This request refills a lease that still holds its cost.
    refill: bool,
    settled: AtomicBool,
}

impl fmt::Debug for Attach {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Attach")
            .field("ask", &self.ask)
            .field("back", &self.back.as_ref().map(|b| b.units))
            .field("refill", &self.refill)
            .finish()
    }
}

impl Leases {
    pub(crate) fn new(
        config: LeaseConfig,
        connection: Connection,
        clock: Option<Arc<dyn Clock>>,
    ) -> Self {
        Self {
            config,
            connection,
            clock,
            entries: Cache::new(config.keys),
            seen: Seen::new(config.keys),
            held: Mutex::new(Vec::new()),
            sweeper: Mutex::new(None),
        }
    }

    fn now(&self) -> u64 {
        local_now_ms(self.clock.as_ref())
    }

    /// Units one lease of `limits` may hold: 0 when they cannot be leased.
    fn cap(&self, limits: &[Limit]) -> u64 {
        let mut smallest = u32::MAX;
        for limit in limits {
            if !limit_leasable(limit) {
                return 0;
            }
            smallest = smallest.min(limit.limit());
        }
        (f64::from(smallest) * self.config.max_fraction) as u64
    }

    /// Spends `cost` from the lease of `key` under `limits` when it holds enough and
    /// needs no refill; else says to ask Redis.
    pub(crate) fn spend(&self, key: &Key, limits: &[Limit], cost: u32) -> Spent {
        if self.cap(limits) == 0 {
            return Spent::Redis(None);
        }
        let now = self.now();
        let lookup = EntryKeyRef {
            key,
            limits: BlockCache::fingerprint(limits),
        };
        let Some(entry) = self.entries.get(&lookup) else {
            // Not watched yet: sent exactly as without leases. A key gets an entry (an
            // allocation, a place in the cache) only at its second request within a
            // period; until then it costs one slot of `seen`.
            let Some(before) = self.seen.again(&lookup, now, self.config.period_ms) else {
                return Spent::Redis(None);
            };
            let entry = Arc::new(Entry::default());
            {
                let mut state = entry.state.lock();
                state.observe(before, cost, self.config.period_ms);
                state.observe(now, cost, self.config.period_ms);
            }
            let key = EntryKey {
                key: key.clone(),
                limits: lookup.limits,
            };
            self.entries.insert(key, entry.clone());
            // Hot now: this request may ask for a lease.
            return Spent::Redis(Some(entry));
        };
        let mut state = entry.state.lock();
        state.observe(now, cost, self.config.period_ms);
        let asking = state.asking;
        if let Some(lease) = &mut state.lease
            && now < lease.deadline
            && lease.units >= u64::from(cost)
            && (asking || lease.units > lease.granted / 4)
        {
            lease.units -= u64::from(cost);
            return Spent::Here(lease.decision(now));
        }
        drop(state);
        Spent::Redis(Some(entry))
    }

    /// Spends `cost` from the lease of `key` under `limits` if it holds enough, refill
    /// due or not (Redis must not be asked): [`Store::check_held`](crate::store::Store::check_held).
    pub(crate) fn spend_held(&self, key: &Key, limits: &[Limit], cost: u32) -> Option<Decision> {
        let lookup = EntryKeyRef {
            key,
            limits: BlockCache::fingerprint(limits),
        };
        let entry = self.entries.get(&lookup)?;
        let now = self.now();
        let mut state = entry.state.lock();
        let lease = state.lease.as_mut()?;
        if now >= lease.deadline || lease.units < u64::from(cost) {
            return None;
        }
        lease.units -= u64::from(cost);
        Some(lease.decision(now))
    }

    /// What a request going to Redis for `entry` carries: the lease's units back when it
    /// ended or cannot pay the request, and an ask when the key is hot. `None`: nothing,
    /// the request goes exactly as without leases.
    pub(crate) fn attach(
        self: &Arc<Self>,
        entry: Arc<Entry>,
        limits: &[Limit],
        cost: u32,
    ) -> Result<Option<Attach>, Decision> {
        let now = self.now();
        let mut state = entry.state.lock();
        let mut back = None;
        let mut refill = false;
        if let Some(lease) = &mut state.lease {
            if now >= lease.deadline || lease.units < u64::from(cost) {
                let lease = state.lease.take().expect("a lease");
                // Also after the lease ended: the script takes them back only where their
                // window still counts (a previous window, a longer limit, a bucket).
                if lease.units > 0 {
                    back = Some(Return {
                        target: lease.target,
                        units: lease.units,
                        starts: lease.starts,
                    });
                }
            } else {
                refill = true;
            }
        }
        let ask = if !state.asking && state.hot() {
            let wanted = state.rate.max(state.units);
            // A refill tops the lease up to the cap: the grant joins what the node still
            // holds (`settle`), and the two together never pass the cap.
            let holding = match &state.lease {
                Some(lease) if refill => lease.units,
                _ => 0,
            };
            wanted.min(self.cap(limits).saturating_sub(holding))
        } else {
            0
        };
        if refill && ask == 0 {
            // Another request started the refill since: spend here after all.
            let lease = state.lease.as_mut().expect("a lease");
            lease.units -= u64::from(cost);
            return Err(lease.decision(now));
        }
        if ask == 0 && back.is_none() {
            return Ok(None);
        }
        if ask > 0 {
            state.asking = true;
        }
        let generation = state.generation;
        drop(state);
        Ok(Some(Attach {
            leases: self.clone(),
            entry,
            cost,
            sent_at: now,
            generation,
            ask,
            back,
            refill,
            settled: AtomicBool::new(false),
        }))
    }

    /// Registers `entry` as holding a lease, and starts the sweeper if none runs.
    fn register(self: &Arc<Self>, entry: &Arc<Entry>) {
        self.held.lock().push(entry.clone());
        let mut sweeper = self.sweeper.lock();
        if sweeper
            .as_ref()
            .is_none_or(tokio::task::JoinHandle::is_finished)
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            *sweeper = Some(runtime.spawn(sweep(Arc::downgrade(self), self.config.idle_ms)));
        }
    }

    /// Takes the leases that ended or idled (all of them with `all`), for returning.
    fn collect(&self, all: bool) -> Vec<Return> {
        let now = self.now();
        let mut out = Vec::new();
        self.held.lock().retain(|entry| {
            let mut state = entry.state.lock();
            let Some(lease) = &state.lease else {
                state.registered = false;
                return false;
            };
            let ended = now >= lease.deadline;
            let idle = now.saturating_sub(state.last) >= self.config.idle_ms;
            if !(all || ended || idle) {
                return true;
            }
            let lease = state.lease.take().expect("a lease");
            state.registered = false;
            if lease.units > 0 {
                out.push(Return {
                    target: lease.target,
                    units: lease.units,
                    starts: lease.starts,
                });
            }
            false
        });
        out
    }

    /// Sends `returns` back to Redis: one call per hash slot.
    async fn send_back(
        connection: Connection,
        now: Option<u64>,
        mut returns: Vec<Return>,
    ) -> Result<(), StoreError> {
        returns.sort_by_key(|r| r.target.slot);
        let mut result = Ok(());
        for same_slot in returns.chunk_by(|a, b| a.target.slot == b.target.slot) {
            for chunk in same_slot.chunks(64) {
                let call = return_call(&connection.mode, now, chunk);
                if let Err(error) = connection.invoke(&call).await {
                    result = Err(error);
                }
            }
        }
        result
    }

    /// Drops this node's lease of `key` under `limits` without giving it back (a reset:
    /// the state it was counted in is gone, and a return could take units from the new
    /// state), and voids the grants of asks on their way. Leases other nodes hold stay
    /// spendable until they end (their window; a bucket's: one window).
    pub(crate) fn forget(&self, key: &Key, limits: &[Limit]) {
        let lookup = EntryKeyRef {
            key,
            limits: BlockCache::fingerprint(limits),
        };
        if let Some(entry) = self.entries.get(&lookup) {
            let mut state = entry.state.lock();
            state.lease = None;
            state.generation += 1;
        }
    }

    /// Returns every lease held (shutdown).
    pub(crate) async fn release(&self) -> Result<(), StoreError> {
        let returns = self.collect(true);
        if returns.is_empty() {
            return Ok(());
        }
        let now = self.clock.as_ref().map(|c| c.now_ms());
        Self::send_back(self.connection.clone(), now, returns).await
    }
}

impl Drop for Leases {
    /// A dropped store gives its leases back, when a runtime is there to send them.
    fn drop(&mut self) {
        let returns = self.collect(true);
        if returns.is_empty() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let now = self.clock.as_ref().map(|c| c.now_ms());
            let connection = self.connection.clone();
            runtime.spawn(async move {
                if let Err(error) = Self::send_back(connection, now, returns).await {
                    tracing::warn!(%error, "could not return leased units to Redis");
                }
            });
        }
    }
}

/// Returns leases that idled or ended, every half idle period, until the store is gone.
async fn sweep(leases: Weak<Leases>, idle_ms: u64) {
    let mut tick = tokio::time::interval(Duration::from_millis((idle_ms / 2).max(5)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(leases) = leases.upgrade() else {
            return;
        };
        let returns = leases.collect(false);
        if returns.is_empty() {
            continue;
        }
        let now = leases.clock.as_ref().map(|c| c.now_ms());
        let connection = leases.connection.clone();
        drop(leases);
        if let Err(error) = Leases::send_back(connection, now, returns).await {
            tracing::warn!(%error, "could not return idle leased units to Redis");
        }
    }
}

impl Rider for Attach {
    fn ask(&self) -> u64 {
        self.ask
    }

    fn back(&self) -> Option<&Return> {
        self.back.as_ref()
    }

    /// Takes the request's reply (and its ask's share of the script's result, when it
    /// asked): installs the granted lease, and answers a refill that Redis denied or could
    /// not decide from the lease it still holds.
    fn settle(
        &self,
        encoded: &Encoded,
        result: Result<Decision, StoreError>,
        grant: Option<&[i64]>,
    ) -> Result<Decision, StoreError> {
        self.settled.store(true, Ordering::Release);
        let now = self.leases.now();
        let mut state = self.entry.state.lock();
        if self.ask > 0 {
            state.asking = false;
        }
        let mut decision = match result {
            Ok(decision) if decision.is_allowed() => decision,
            other if self.refill => {
                if let Some(lease) = &mut state.lease
                    && now < lease.deadline
                    && lease.units >= u64::from(self.cost)
                {
                    lease.units -= u64::from(self.cost);
                    return Ok(lease.decision(now));
                }
                return other;
            }
            other => return other,
        };
        let m = decision.limits().len();
        // A reset since the ask: the grant was counted in the state it cleared.
        if state.generation != self.generation {
            return Ok(decision);
        }
        let Some(grant) = grant.filter(|g| g.len() >= 2 + m) else {
            return Ok(decision);
        };
        let to_u64 = |v: i64| u64::try_from(v).unwrap_or(0);
        let (units, ms_left) = (to_u64(grant[0]), to_u64(grant[1]));
        let starts: SmallVec<[u64; 2]> = grant[2..2 + m].iter().map(|&v| to_u64(v)).collect();
        // Units this node still holds in the same windows count as remaining too.
        let same = state
            .lease
            .as_ref()
            .filter(|l| l.starts == starts && now < l.deadline);
        let held = same.map_or(0, |l| l.units);
        if held > 0 {
            decision = with_more_remaining(&decision, held);
        }
        if units == 0 {
            // No new units: the lease keeps paying, from what this call showed (other
            // nodes may have taken more since the grant), so `remaining` does not rise.
            if held > 0
                && let Some(lease) = state.lease.as_mut()
            {
                for (limit, shown) in lease.limits.iter_mut().zip(decision.limits()) {
                    limit.1 = limit.1.min(shown.remaining.saturating_sub(lease.units));
                }
            }
            return Ok(decision);
        }
        // A thousandth of the time left earlier: this node's clock may run a little slower
        // than Redis's over a long window, and a unit must never be spent in the next one.
        let deadline = self.sent_at + ms_left - ms_left / 1_000;
        let limits = decision
            .limits()
            .iter()
            .map(|l| {
                (
                    l.limit,
                    l.remaining.saturating_sub(held + units),
                    self.sent_at + l.reset_after_ms,
                )
            })
            .collect();
        let target = match same {
            Some(lease) => lease.target.clone(),
            None => Arc::new(Target {
                keys: encoded.keys.clone(),
                group: encoded.group.clone(),
                slot: encoded.slot,
            }),
        };
        let lease = Lease {
            units: held + units,
            granted: held + units,
            deadline: same.map_or(deadline, |l| l.deadline.min(deadline)),
            starts,
            limits,
            target,
            granted_at: decision.decided_at_ms(),
        };
        state.lease = Some(lease);
        let register = !state.registered;
        state.registered = true;
        drop(state);
        if register {
            self.leases.register(&self.entry);
        }
        Ok(decision)
    }
}

impl Drop for Attach {
    /// Never settled (the call was never made): the entry may ask again. Units it was
    /// taking back are lost to this window: an under-admission, never an overshoot.
    fn drop(&mut self) {
        if self.settled.load(Ordering::Acquire) {
            return;
        }
        if self.ask > 0 {
            self.entry.state.lock().asking = false;
        }
    }
}

fn with_more_remaining(decision: &Decision, more: u64) -> Decision {
    let limits: LimitDecisions = decision
        .limits()
        .iter()
        .map(|l| LimitDecision {
            remaining: l.remaining + more,
            ..*l
        })
        .collect();
    // Still the decision Redis made, at its time (a refund names it).
    match decision.decided_at_ms() {
        Some(at) => Decision::from_limits(limits).decided_at(at),
        None => Decision::from_limits(limits),
    }
}
