//! In-flight permits with a TTL: the specification the Redis store's in-flight scripts
//! follow (see [`InFlightLayer`](crate::in_flight::InFlightLayer)). The memory store needs no TTL:
//! a permit there ends when its holder releases it.

use std::collections::BTreeMap;

/// The permits of one key: each permit id with the time (ms) its TTL ends. A permit
/// whose TTL ends at or before `now` no longer counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Permits {
    ends: BTreeMap<String, u64>,
}

impl Permits {
    /// Takes permit `id` for `ttl_ms` if fewer than `max` permits are held at `now`
    /// (ended ones are dropped first). Returns whether it was taken and how many are held
    /// after.
    pub fn acquire(&mut self, now: u64, ttl_ms: u64, max: u32, id: &str) -> (bool, u64) {
        self.ends.retain(|_, end| *end > now);
        let held = self.ends.len() as u64;
        if held >= u64::from(max) {
            return (false, held);
        }
        self.ends.insert(id.to_owned(), now + ttl_ms);
        (true, held + 1)
    }

    /// Renews permit `id` to end `ttl_ms` after `now`. Returns whether it was still
    /// held (a permit whose TTL ended but that no acquire has dropped yet is still held).
    ///
    /// A permit that is gone (the store lost it, or its TTL ended while its holder could
    /// not renew it) is added back, even when that makes more than `max` held: its request
    /// still runs, and counting it is the honest count. New requests are then refused
    /// until enough running ones end.
    pub fn renew(&mut self, now: u64, ttl_ms: u64, id: &str) -> bool {
        self.ends.insert(id.to_owned(), now + ttl_ms).is_some()
    }

    /// Gives permit `id` back.
    pub fn release(&mut self, id: &str) {
        self.ends.remove(id);
    }

    /// Each held permit id with the end of its TTL.
    pub fn ends(&self) -> impl Iterator<Item = (&str, u64)> {
        self.ends.iter().map(|(id, end)| (id.as_str(), *end))
    }

    /// How long the state lives after a write at `now`: until its last TTL ends (at
    /// least 1 ms); `None` when no permit is held (the state is gone).
    pub fn ttl_ms(&self, now: u64) -> Option<u64> {
        let last = self.ends.values().max()?;
        Some(last.saturating_sub(now).max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ended_permits_free_their_place_and_renewal_keeps_it() {
        let mut permits = Permits::default();
        assert_eq!(permits.acquire(0, 100, 1, "a"), (true, 1));
        assert_eq!(permits.acquire(99, 100, 1, "b"), (false, 1));
        assert!(permits.renew(99, 100, "a"));
        assert_eq!(permits.acquire(150, 100, 1, "b"), (false, 1));
        // Ends at 199: at 199 it no longer counts.
        assert_eq!(permits.acquire(199, 100, 1, "b"), (true, 1));
        // "a" ended and "b" took its place; "a" still runs, so it counts again: two
        // held with a maximum of one, and no new permit until one ends.
        assert!(!permits.renew(200, 100, "a"));
        assert_eq!(permits.acquire(200, 100, 1, "c"), (false, 2));
        permits.release("a");
        permits.release("b");
        assert_eq!(permits.ttl_ms(200), None);
    }
}
