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

    /// Renews permit `id` to end `lease_ms` after `now`, if it is still held (a lease
    /// that ended but that no acquire has dropped yet is still held: nobody took its
    /// place). Returns whether it was.
    pub fn renew(&mut self, now: u64, lease_ms: u64, id: &str) -> bool {
        match self.ends.get_mut(id) {
            Some(end) => {
                *end = now + lease_ms;
                true
            }
            None => false,
        }
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
        assert!(!leases.renew(200, 100, "a"));
        leases.release("b");
        assert_eq!(leases.ttl_ms(200), None);
    }
}
