//! A request as the script's arguments, and the script's reply as decisions: the script
//! results contract of shared/DESIGN.md and lua/main.lua, on the Rust side, in one file.
//! Each distinct list of limits is sent once per call and requests name theirs by index;
//! leased quota rides on requests as a [`Rider`].

use std::{fmt, sync::Arc};

use redis::Cmd;
use smallvec::SmallVec;

use super::{
    keys::{Keys, slot_of},
    wire::function::{
        Adjust, FixedWindowRequest, InFlightEntry, Mode, fixed_window_call, fixed_windows_call,
        in_flight_call,
    },
};
use crate::{
    Algorithm, Decision, Limit, LimitDecision, StoreError, StoreErrorKind,
    decision::LimitDecisions, key::Key,
};

/// What rides on a request for leased quota (`lease::Attach`): an ask, units going back,
/// and what to do with the reply. A trait, so that the encoding needs nothing of the
/// leases but what the script's arguments say.
pub(crate) trait Rider: fmt::Debug + Send + Sync {
    /// Units asked for beside the request's own (0: none).
    fn ask(&self) -> u64;
    /// The lease this request takes back to Redis.
    fn back(&self) -> Option<&Return>;
    /// Takes the request's decision, and its ask's share of the script's reply when it
    /// asked ([`Encoded::grant_len`] values).
    fn settle(
        &self,
        encoded: &Encoded,
        result: Result<Decision, StoreError>,
        grant: Option<&[i64]>,
    ) -> Result<Decision, StoreError>;
}

/// What a limit's lockout field adds when its lockout counts pending units (lua/lockout.lua).
const PENDING: u64 = 1 << 50;

/// The numbers the script's ARGV has per limit.
pub(crate) const LIMIT_FIELDS: usize = 5;

/// One request, ready to join a script call.
#[derive(Debug, Clone)]
pub(crate) struct Encoded {
    pub(crate) keys: Keys,
    pub(crate) cost: u32,
    /// An adjustment of `cost` units rather than a request: the script's `at` argument.
    pub(crate) at: Option<i64>,
    /// A settle ([`Adjustment::Settle`](crate::Adjustment::Settle)): the units the request
    /// keeps, the script's `kept` argument after `at`.
    pub(crate) kept: Option<u32>,
    /// Its limits, as the script's ARGV has them: code, limit, window ms, capacity,
    /// lockout ms each.
    pub(crate) group: SmallVec<[u64; LIMIT_FIELDS]>,
    pub(crate) quotas: SmallVec<[u32; 2]>,
    /// Decided without committing: sent with its group index negated.
    pub(crate) peek: bool,
    /// Reserves up to this many ms ahead ([`Store::reserve`](crate::store::Store::reserve)); 0: a plain check.
    pub(crate) reserve_ms: u64,
    /// The hash slot of the keys (0 outside a cluster).
    pub(crate) slot: u16,
    /// What rides on it for leased quota (an ask, units going back).
    pub(crate) lease: Option<Arc<dyn Rider>>,
    /// The id of the in-flight permit it takes (a request) or gives back (an
    /// adjustment): its group ends with the in-flight limit.
    pub(crate) permit: Option<String>,
}

/// The script's code of an in-flight limit (lua/in_flight.lua).
const IN_FLIGHT_CODE: u64 = 6;

/// The capacity an in-flight limit is sent with: above any cost, so a request of any
/// cost takes one permit.
const IN_FLIGHT_CAPACITY: u64 = 1 << 32;

impl Encoded {
    /// A request for `key` under `limits` of `cost` (`at` = None), or an adjustment of
    /// `cost` units (`at`: the refund's decision time, or -1 for a top-up); `cluster`:
    /// whether its hash slot matters.
    pub(crate) fn new(
        prefix: &str,
        key: &Key,
        limits: &[Limit],
        cost: u32,
        at: Option<i64>,
        cluster: bool,
    ) -> Self {
        let keys = Keys::new(prefix, key, limits);
        let slot = if cluster {
            slot_of(keys.iter().next().unwrap_or_default())
        } else {
            0
        };
        let mut group = SmallVec::new();
        for limit in limits {
            group.push(u64::from(limit.algorithm().code()));
            group.push(u64::from(limit.limit()));
            group.push(limit.window_ms());
            group.push(u64::from(limit.capacity()));
            group.push(limit.lockout_ms() + if limit.pending() { PENDING } else { 0 });
        }
        Encoded {
            keys,
            cost,
            at,
            kept: None,
            group,
            quotas: limits.iter().map(Limit::limit).collect(),
            peek: false,
            reserve_ms: 0,
            slot,
            lease: None,
            permit: None,
        }
    }

    /// [`new`](Self::new) with an in-flight limit of `max` permits of `ttl_ms` last in
    /// the group (`limits` may be empty): a request that takes permit `id` when allowed,
    /// or (`at`) an adjustment that gives it back.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn in_flight(
        prefix: &str,
        key: &Key,
        limits: &[Limit],
        cost: u32,
        at: Option<i64>,
        cluster: bool,
        (max, ttl_ms): (u32, u64),
        id: String,
    ) -> Self {
        let mut encoded = Self::new(prefix, key, limits, cost, at, cluster);
        encoded.keys = Keys::with_in_flight(prefix, key, limits, true);
        if cluster {
            encoded.slot = slot_of(encoded.keys.iter().next().unwrap_or_default());
        }
        encoded.group.extend([
            IN_FLIGHT_CODE,
            u64::from(max),
            ttl_ms,
            IN_FLIGHT_CAPACITY,
            0,
        ]);
        encoded.quotas.push(max);
        encoded.permit = Some(id);
        encoded
    }

    /// How many values of the script's reply are this request's ask's result (after
    /// every request's own): units, ms left, one window start per limit; none without
    /// an ask.
    pub(crate) fn grant_len(&self) -> usize {
        match &self.lease {
            Some(rider) if rider.ask() > 0 => 2 + self.quotas.len(),
            _ => 0,
        }
    }

    /// The limit and window of a request that the library's function for one fixed
    /// window decides (lua/one.lua): one fixed-window limit without a lockout, a cost of
    /// 1 to the limit, and nothing riding on it (no peek, adjustment, reservation or
    /// lease).
    pub(crate) fn one_fixed_window(&self) -> Option<(u64, u64)> {
        let fixed_window = u64::from(Algorithm::FixedWindow.code());
        match self.group[..] {
            [code, limit, window_ms, _, 0]
                if code == fixed_window
                    && (1..=limit).contains(&u64::from(self.cost))
                    && self.keys.len() == 1
                    && self.at.is_none()
                    && !self.peek
                    && self.reserve_ms == 0
                    && self.lease.is_none()
                    && self.permit.is_none() =>
            {
                Some((limit, window_ms))
            }
            _ => None,
        }
    }

    /// This request as the library's function for in-flight batches takes it
    /// (lua/one_in_flight.lua), when it is one of that function's shapes: a decision on
    /// one fixed window (no lockout, capacity = limit, a cost of 1 to the limit) and an
    /// in-flight permit; or a permit's release, bare or with an adjustment of such a
    /// window (a refund or a top-up of at least 1 unit; a settle never rides on one).
    /// Never a peek, a reservation or a lease.
    pub(crate) fn as_in_flight(&self) -> Option<InFlightEntry<'_>> {
        let id = self.permit.as_deref()?;
        if self.peek || self.reserve_ms > 0 || self.lease.is_some() || self.kept.is_some() {
            return None;
        }
        let fixed_window = u64::from(Algorithm::FixedWindow.code());
        let mut keys = self.keys.iter();
        match (&self.group[..], self.at) {
            (
                &[
                    code,
                    limit,
                    window_ms,
                    capacity,
                    0,
                    IN_FLIGHT_CODE,
                    max,
                    ttl_ms,
                    IN_FLIGHT_CAPACITY,
                    0,
                ],
                at,
            ) if code == fixed_window && capacity == limit && self.keys.len() == 2 => {
                let (window, permits) = (keys.next()?, keys.next()?);
                match at {
                    None if (1..=limit).contains(&u64::from(self.cost)) => {
                        Some(InFlightEntry::Decide {
                            window,
                            permits,
                            cost: self.cost,
                            limit,
                            window_ms,
                            max,
                            ttl_ms,
                            id,
                        })
                    }
                    Some(at) if at >= -1 && self.cost >= 1 && ttl_ms == 1 => {
                        Some(InFlightEntry::Release {
                            adjust: Some(Adjust {
                                window,
                                limit,
                                window_ms,
                                units: self.cost,
                                at,
                            }),
                            permits,
                            max,
                            id,
                        })
                    }
                    _ => None,
                }
            }
            (&[IN_FLIGHT_CODE, max, 1, IN_FLIGHT_CAPACITY, 0], Some(0))
                if self.cost == 1 && self.keys.len() == 1 =>
            {
                Some(InFlightEntry::Release {
                    adjust: None,
                    permits: keys.next()?,
                    max,
                    id,
                })
            }
            _ => None,
        }
    }

    /// This request as the function for many fixed windows takes it (key, limit, window
    /// ms, cost), when it is one against one fixed window ([`Self::one_fixed_window`]).
    pub(crate) fn as_fixed_window(&self) -> Option<FixedWindowRequest<'_>> {
        let (limit, window_ms) = self.one_fixed_window()?;
        Some((self.keys.iter().next()?, limit, window_ms, self.cost))
    }
}

/// The script call (`FCALL`, or `EVALSHA` where Redis has no functions: see
/// [`Mode::run`]) deciding `requests` in order, at `now` (None: Redis `TIME`).
///
/// Built straight into one [`Cmd`] buffer; each distinct list of limits is sent once
/// and requests name theirs by index, so a batch of requests under the same limits costs
/// two arguments per request besides its keys.
pub(crate) fn script_call(mode: &Mode, now: Option<u64>, requests: &[&Encoded]) -> Cmd {
    if mode.functions()
        && requests.first().is_some_and(|r| r.permit.is_some())
        && let Some(entries) = requests
            .iter()
            .map(|r| r.as_in_flight())
            .collect::<Option<SmallVec<[InFlightEntry<'_>; 16]>>>()
    {
        return in_flight_call(now, &entries);
    }
    if let [request] = requests
        && mode.functions()
        && let Some((key, limit, window_ms, cost)) = request.as_fixed_window()
    {
        return fixed_window_call(now, key, limit, window_ms, cost);
    }
    let mut groups: SmallVec<[&[u64]; 4]> = SmallVec::new();
    let mut group_of: SmallVec<[usize; 32]> = SmallVec::with_capacity(requests.len());
    for request in requests {
        let index = match groups.iter().position(|&g| g == &request.group[..]) {
            Some(index) => index,
            None => {
                groups.push(&request.group);
                groups.len() - 1
            }
        };
        group_of.push(index + 1);
    }
    let keys: usize = requests.iter().map(|r| r.keys.len()).sum();
    let group_args: usize = groups.iter().map(|g| 1 + g.len()).sum();
    let adjustments = requests.iter().filter(|r| r.at.is_some()).count()
        + requests.iter().filter(|r| r.kept.is_some()).count();
    let args = 3 + keys + 2 + group_args + 1 + 2 * requests.len() + adjustments;
    let key_bytes: usize = requests.iter().map(|r| r.keys.bytes()).sum();
    let mut cmd = Cmd::with_capacity(args, 64 + key_bytes + 12 * (args - keys));
    mode.head(&mut cmd, keys);
    for request in requests {
        for key in request.keys.iter() {
            cmd.arg(key);
        }
    }
    match now {
        Some(now) => cmd.arg(now),
        None => cmd.arg(""),
    };
    cmd.arg(groups.len());
    for group in &groups {
        cmd.arg(group.len() / LIMIT_FIELDS);
        for &value in *group {
            cmd.arg(value);
        }
    }
    cmd.arg(requests.len());
    for (request, &group) in requests.iter().zip(&group_of) {
        match request.at {
            None if request.peek => cmd.arg(request.cost).arg(-(group as i64)),
            None => cmd.arg(request.cost).arg(group),
            // A negative cost, then `at` (see lua/main.lua).
            Some(at) => match request.kept {
                None => cmd.arg(-i64::from(request.cost)).arg(group).arg(at),
                // A settle: `at` as -2 - at, then `kept`.
                Some(kept) => cmd
                    .arg(-i64::from(request.cost))
                    .arg(group)
                    .arg(-2 - at)
                    .arg(kept),
            },
        };
    }
    let reserving = requests.iter().filter(|r| r.reserve_ms > 0).count();
    let permits = requests.iter().filter(|r| r.permit.is_some()).count();
    if requests.iter().any(|r| r.lease.is_some()) {
        sections(&mut cmd, requests, &group_of);
    } else if reserving > 0 || permits > 0 {
        // No asks, no returns: the reservations follow (see lua/main.lua).
        cmd.arg(0).arg(0);
    }
    if reserving > 0 || permits > 0 {
        cmd.arg(reserving);
        for (index, request) in requests.iter().enumerate() {
            if request.reserve_ms > 0 {
                cmd.arg(index + 1).arg(request.reserve_ms);
            }
        }
    }
    if permits > 0 {
        // Then the permits (see lua/main.lua).
        cmd.arg(permits);
        for (index, request) in requests.iter().enumerate() {
            if let Some(id) = &request.permit {
                cmd.arg(index + 1).arg(id.as_str());
            }
        }
    }
    cmd
}

/// The call for a coalesced batch on one Redis (not a cluster): two or more requests
/// against one fixed window each, on distinct keys, go in one call of the library's
/// function for many (`<library>_fwn`, lua/one.lua), which skips the general function's
/// groups; every other batch is [`script_call`]'s. (A key repeated in the batch, a hot
/// key, is cheaper on the general path, which reads and writes it once.)
pub(crate) fn standalone_call(mode: &Mode, now: Option<u64>, requests: &[&Encoded]) -> Cmd {
    if requests.len() >= 2
        && mode.functions()
        && let Some(lean) = fixed_windows(requests)
    {
        return fixed_windows_call(now, false, &lean);
    }
    script_call(mode, now, requests)
}

/// Each request's key, limit, window ms and cost, when every one of `requests` is one
/// against one fixed window ([`Encoded::one_fixed_window`]) and no key repeats.
fn fixed_windows<'a>(requests: &[&'a Encoded]) -> Option<Vec<FixedWindowRequest<'a>>> {
    let mut lean: Vec<FixedWindowRequest<'a>> = Vec::with_capacity(requests.len());
    // Linear in the batch (up to `max_batch` requests), where comparing pairs is not.
    let mut seen = std::collections::HashSet::with_capacity(requests.len());
    for request in requests {
        let one = request.as_fixed_window()?;
        if !seen.insert(one.0) {
            return None;
        }
        lean.push(one);
    }
    Some(lean)
}

/// One request's share of the script's reply: four integers per limit; `now` is the time
/// the script decided at (the reply's last value).
pub(crate) fn parse(
    reply: &[i64],
    quotas: &[u32],
    now: Option<i64>,
) -> Result<Decision, StoreError> {
    if reply.len() != quotas.len() * 4 {
        return Err(StoreError::new(
            StoreErrorKind::Response,
            format!(
                "script returned {} values for {} limits",
                reply.len(),
                quotas.len()
            ),
        ));
    }
    let to_u64 = |v: i64| u64::try_from(v).unwrap_or(0);
    // A limit whose lockout blocks the request sends `remaining` as minus the time left
    // on the block (lua/lockout.lua): remaining 0, and the block for the block cache.
    let mut blocked_ms = 0;
    let mut decisions: LimitDecisions = reply
        .chunks_exact(4)
        .zip(quotas)
        .map(|(v, &limit)| {
            if v[1] < 0 {
                let left = v[1].unsigned_abs();
                blocked_ms = if blocked_ms == 0 {
                    left
                } else {
                    blocked_ms.min(left)
                };
            }
            LimitDecision {
                allowed: v[0] == 1,
                limit,
                remaining: to_u64(v[1]),
                reset_after_ms: to_u64(v[2]),
                retry_after_ms: to_u64(v[3]),
            }
        })
        .collect();
    // A reservation: every limit allowed, with the wait as its retry_after (lua/main.lua).
    let mut wait = 0;
    if decisions.iter().all(|d| d.allowed) {
        for limit in &mut decisions {
            wait = wait.max(limit.retry_after_ms);
            limit.retry_after_ms = 0;
        }
    }
    let decision = Decision::from_limits(decisions)
        .blocked_for(blocked_ms)
        .with_wait(wait);
    Ok(match now.and_then(|now| u64::try_from(now).ok()) {
        Some(now) => decision.decided_at(now),
        None => decision,
    })
}

/// A reply's values and the `now` the script appended last (see lua/main.lua): `values`
/// counts the requests' results and their asks' results, which come before it.
pub(crate) fn split_now(reply: &[i64], values: usize) -> (&[i64], Option<i64>) {
    match reply.len().checked_sub(values) {
        Some(1) => (&reply[..values], reply.last().copied()),
        _ => (reply, None),
    }
}

/// A lease's keys and limits, as a request encodes them.
pub(crate) struct Target {
    pub(crate) keys: Keys,
    pub(crate) group: SmallVec<[u64; LIMIT_FIELDS]>,
    pub(crate) slot: u16,
}

/// Units going back, named by their windows.
pub(crate) struct Return {
    pub(crate) target: Arc<Target>,
    pub(crate) units: u64,
    pub(crate) starts: SmallVec<[u64; 2]>,
}

/// The script call that only returns units (no request).
pub(crate) fn return_call(mode: &Mode, now: Option<u64>, returns: &[Return]) -> Cmd {
    let keys: usize = returns.iter().map(|r| r.target.keys.len()).sum();
    let mut cmd = Cmd::new();
    mode.head(&mut cmd, keys);
    for r in returns {
        for key in r.target.keys.iter() {
            cmd.arg(key);
        }
    }
    match now {
        Some(now) => cmd.arg(now),
        None => cmd.arg(""),
    };
    cmd.arg(returns.len());
    for r in returns {
        cmd.arg(r.target.group.len() / LIMIT_FIELDS);
        for &value in &r.target.group {
            cmd.arg(value);
        }
    }
    // No requests, no asks; then the returns, each with a group of its own.
    cmd.arg(0).arg(0).arg(returns.len());
    let mut first_key = 1;
    for (index, r) in returns.iter().enumerate() {
        cmd.arg(index + 1).arg(first_key).arg(r.units);
        for &start in &r.starts {
            cmd.arg(start);
        }
        first_key += r.target.keys.len();
    }
    cmd
}

/// Appends the lease sections of a script call for `requests` (see `lua/main.lua`): the
/// asks, then the returns riding on requests, each naming its request's group and keys.
fn sections(cmd: &mut Cmd, requests: &[&Encoded], group_of: &[usize]) {
    let asks = requests
        .iter()
        .filter(|r| r.lease.as_ref().is_some_and(|a| a.ask() > 0))
        .count();
    cmd.arg(asks);
    for (index, request) in requests.iter().enumerate() {
        if let Some(attach) = &request.lease
            && attach.ask() > 0
        {
            cmd.arg(index + 1).arg(attach.ask());
        }
    }
    let returns = requests
        .iter()
        .filter(|r| r.lease.as_ref().is_some_and(|a| a.back().is_some()))
        .count();
    cmd.arg(returns);
    let mut first_key = 1;
    for (request, &group) in requests.iter().zip(group_of) {
        if let Some(back) = request.lease.as_ref().and_then(|a| a.back()) {
            cmd.arg(group).arg(first_key).arg(back.units);
            for &start in &back.starts {
                cmd.arg(start);
            }
        }
        first_key += request.keys.len();
    }
}
