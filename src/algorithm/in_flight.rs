//! In-flight permits as leases: the specification the Redis store's in-flight scripts
//! follow (see [`InFlightLayer`](crate::InFlightLayer)). The memory store needs no leases:
//! a permit there ends when its holder drops it.

use std::collections::BTreeMap;

/// The permits of one key: each permit id with the time (ms) its lease ends. A lease
/// that ends at or before `now` no longer counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Leases {
    ends: BTreeMap<String, u64>,
}

impl Leases {
    /// Takes permit `id` for `lease_ms` if fewer than `max` leases are running at `now`
    /// (ended ones are dropped first). Returns whether it was taken and how many are held
    /// after.
    pub fn acquire(&mut self, now: u64, lease_ms: u64, max: u32, id: &str) -> (bool, u64) {
        self.ends.retain(|_, end| *end > now);
        let held = self.ends.len() as u64;
        if held >= u64::from(max) {
            return (false, held);
        }
        self.ends.insert(id.to_owned(), now + lease_ms);
        (true, held + 1)
    }

    /// Renews permit `id` to end `lease_ms` after `now`. Returns whether it was still
    /// held (a lease that ended but that no acquire has dropped yet is still held).
    ///
    /// A permit that is gone (the store lost it, or its lease ended while its holder could
    /// not renew it) is added back, even when that makes more than `max` held: its request
    /// still runs, and counting it is the honest count. New requests are then refused
    /// until enough running ones end.
    pub fn renew(&mut self, now: u64, lease_ms: u64, id: &str) -> bool {
        self.ends.insert(id.to_owned(), now + lease_ms).is_some()
    }

    /// Gives permit `id` back.
    pub fn release(&mut self, id: &str) {
        self.ends.remove(id);
    }

    /// Each held permit id with the end of its lease.
    pub fn ends(&self) -> impl Iterator<Item = (&str, u64)> {
        self.ends.iter().map(|(id, end)| (id.as_str(), *end))
    }

    /// How long the state lives after a write at `now`: until its last lease ends (at
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
    fn ended_leases_free_their_place_and_renewal_keeps_it() {
        let mut leases = Leases::default();
        assert_eq!(leases.acquire(0, 100, 1, "a"), (true, 1));
        assert_eq!(leases.acquire(99, 100, 1, "b"), (false, 1));
        assert!(leases.renew(99, 100, "a"));
        assert_eq!(leases.acquire(150, 100, 1, "b"), (false, 1));
        // Ends at 199: at 199 it no longer counts.
        assert_eq!(leases.acquire(199, 100, 1, "b"), (true, 1));
        // "a" ended and "b" took its place; "a" still runs, so it counts again: two
        // held with a maximum of one, and no new permit until one ends.
        assert!(!leases.renew(200, 100, "a"));
        assert_eq!(leases.acquire(200, 100, 1, "c"), (false, 2));
        leases.release("a");
        leases.release("b");
        assert_eq!(leases.ttl_ms(200), None);
    }
}
