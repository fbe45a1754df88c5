//! The key layout (shared/DESIGN.md), written once: every Redis key and channel the store
//! names is built here.
//!
//! - A limit's state: `<prefix>:{<key>}:<limit id>`; its lockout block: the same with
//!   `:lockout` appended; the units its lockout counts as pending (a layer that counts
//!   after the response): the same with `:pending` appended; a key's in-flight permits under a maximum `max`:
//!   `<prefix>:{<key>}:inflight:<max>`. The braces make the key the hash tag: all state of
//!   one key lives in one Redis Cluster slot, and different keys spread over the cluster.
//! - The channel resets are announced on: `<prefix>:reset`.

use smallvec::SmallVec;

use crate::{Limit, key::Key};

/// What [`lockout_key`] appends.
const LOCKOUT_SUFFIX: &str = ":lockout";

/// What a limit's pending key appends (lua/lockout.lua): a last part no limit id has.
const PENDING_SUFFIX: &str = ":pending";

/// The parts every key of `key`'s state starts with, `<prefix>:{<key>}:`: the one place
/// the hash tag is laid out.
fn tagged<'a>(prefix: &'a str, key: &'a Key) -> [&'a str; 4] {
    [prefix, ":{", key.as_str(), "}:"]
}

/// `parts`, joined in one allocation.
fn join(parts: &[&str]) -> String {
    let mut out = String::with_capacity(parts.iter().map(|p| p.len()).sum());
    for part in parts {
        out.push_str(part);
    }
    out
}

/// The Redis key that holds `limit`'s state for `key`.
pub(crate) fn limit_key(prefix: &str, key: &Key, limit: &Limit) -> String {
    let [a, b, c, d] = tagged(prefix, key);
    join(&[a, b, c, d, limit.id()])
}

/// The key that holds a limit's block ([`Limit::with_lockout`]) next to the limit's key:
/// the same hash tag, and a last part no limit id has (ids end in digits).
pub(crate) fn lockout_key(prefix: &str, key: &Key, limit: &Limit) -> String {
    let [a, b, c, d] = tagged(prefix, key);
    join(&[a, b, c, d, limit.id(), LOCKOUT_SUFFIX])
}

/// Every Redis key that holds state of `limit` for `key`: what a reset deletes. A change
/// that gives a limit more state per key adds it here. The lockout key is named whether
/// or not the limit has a lockout now (a block from before the lockout was removed is not
/// read, but it is state of this limit all the same).
pub(crate) fn state_keys(prefix: &str, key: &Key, limit: &Limit) -> [String; 3] {
    let [a, b, c, d] = tagged(prefix, key);
    [
        limit_key(prefix, key, limit),
        lockout_key(prefix, key, limit),
        join(&[a, b, c, d, limit.id(), PENDING_SUFFIX]),
    ]
}

/// The sorted set of `key`'s in-flight permits under a limit of `max`.
pub(crate) fn permits_key(prefix: &str, key: &Key, max: u32) -> String {
    let [a, b, c, d] = tagged(prefix, key);
    join(&[a, b, c, d, "inflight:", itoa::Buffer::new().format(max)])
}

/// The channel resets of keys under `prefix` are announced on.
/// The permits of an [`InFlightLimit`](crate::InFlightLimit) for `key`:
/// `<prefix>:{<key>}:inflight`, one per key whatever its `max`.
pub(crate) fn in_flight_key(prefix: &str, key: &Key) -> String {
    let [a, b, c, d] = tagged(prefix, key);
    join(&[a, b, c, d, IN_FLIGHT_SUFFIX])
}

/// The last part of [`in_flight_key`].
const IN_FLIGHT_SUFFIX: &str = "inflight";

pub(crate) fn reset_channel(prefix: &str) -> String {
    join(&[prefix, ":reset"])
}

/// A request's Redis keys, end to end in one buffer: the keys of a request with one limit
/// (or two short ones) need no allocation of their own, which one `String` each did, and
/// which the batching task then freed on another thread.
#[derive(Debug, Clone, Default)]
pub(crate) struct Keys {
    text: SmallVec<[u8; 96]>,
    ends: SmallVec<[u32; 2]>,
}

impl Keys {
    /// The keys a request for `key` under `limits` touches: each limit's (what
    /// [`limit_key`] makes), then the block key ([`lockout_key`]) of each limit with a
    /// lockout, each followed by its pending key when its lockout counts pending units
    /// ([`Limit::pending_until_settled`]).
    pub(crate) fn new(prefix: &str, key: &Key, limits: &[Limit]) -> Self {
        Self::with_in_flight(prefix, key, limits, false)
    }

    /// [`new`](Self::new), with the key of the in-flight permits after the limits' keys
    /// (before the block keys) when `in_flight`: the in-flight limit is the group's last.
    pub(crate) fn with_in_flight(
        prefix: &str,
        key: &Key,
        limits: &[Limit],
        in_flight: bool,
    ) -> Self {
        let mut keys = Self::default();
        let [a, b, c, d] = tagged(prefix, key);
        for limit in limits {
            keys.push(&[a, b, c, d, limit.id()]);
        }
        if in_flight {
            keys.push(&[a, b, c, d, IN_FLIGHT_SUFFIX]);
        }
        for limit in limits.iter().filter(|l| l.lockout_ms() > 0) {
            keys.push(&[a, b, c, d, limit.id(), LOCKOUT_SUFFIX]);
            if limit.pending() {
                keys.push(&[a, b, c, d, limit.id(), PENDING_SUFFIX]);
            }
        }
        keys
    }

    /// Appends a key made of `parts`.
    pub(crate) fn push(&mut self, parts: &[&str]) {
        // Sized once, then copied into: `extend_from_slice` per part cost twice as much.
        let mut at = self.text.len();
        self.text
            .resize(at + parts.iter().map(|p| p.len()).sum::<usize>(), 0);
        for part in parts {
            self.text[at..at + part.len()].copy_from_slice(part.as_bytes());
            at += part.len();
        }
        self.ends.push(u32::try_from(at).unwrap_or(u32::MAX));
    }

    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }

    /// The bytes of all the keys together.
    pub(crate) fn bytes(&self) -> usize {
        self.text.len()
    }

    /// The keys, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &[u8]> {
        let mut start = 0;
        self.ends.iter().map(move |&end| {
            let key = &self.text[start..end as usize];
            start = end as usize;
            key
        })
    }
}

/// The Redis Cluster hash slot of `key`: CRC16 of its hash tag, modulo 16384.
#[cfg(feature = "cluster")]
pub(crate) fn slot_of(key: &[u8]) -> u16 {
    let tag = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .map(|close| &rest[..close])
        })
        .filter(|tag| !tag.is_empty())
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tag) % 16384
}

#[cfg(not(feature = "cluster"))]
pub(crate) fn slot_of(_key: &[u8]) -> u16 {
    0
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::DEFAULT_PREFIX;

    /// A request's keys, built in one buffer, are the keys `limit_key` and `lockout_key`
    /// name, in the order the script reads them: with and without lockouts, and past
    /// the buffer's inline size.
    #[test]
    fn a_requests_keys_are_its_limits_keys_then_their_block_keys() {
        let minute = Limit::fixed_window(10, Duration::from_secs(60)).unwrap();
        let locked = Limit::per_second(5)
            .unwrap()
            .with_lockout(Duration::from_secs(600))
            .unwrap();
        let long = "k".repeat(200);
        for key in [Key::new("client-1"), Key::new(&long)] {
            for limits in [
                vec![minute.clone()],
                vec![minute.clone(), locked.clone()],
                vec![locked.clone(), minute.clone()],
            ] {
                let limit_key =
                    |limit: &Limit| format!("tollgate:{{{}}}:{}", key.as_str(), limit.id());
                let mut expected: Vec<String> = limits.iter().map(limit_key).collect();
                for limit in limits.iter().filter(|l| l.lockout_ms() > 0) {
                    expected.push(format!("{}:lockout", limit_key(limit)));
                }
                let keys = Keys::new(DEFAULT_PREFIX, &key, &limits);
                let got: Vec<&[u8]> = keys.iter().collect();
                let expected: Vec<&[u8]> = expected.iter().map(|k| k.as_bytes()).collect();
                assert_eq!(got, expected);
                assert_eq!(keys.len(), expected.len());
                for limit in &limits {
                    assert_eq!(
                        state_keys(DEFAULT_PREFIX, &key, limit),
                        [
                            limit_key(limit),
                            format!("{}:lockout", limit_key(limit)),
                            format!("{}:pending", limit_key(limit))
                        ]
                    );
                }
            }
        }
    }

    /// The in-flight permits' set and the reset channel, as DESIGN.md lays them out.
    #[test]
    fn permits_and_reset_channel_names() {
        let key = Key::new("client-1");
        assert_eq!(
            permits_key("app", &key, 40),
            format!("app:{{{}}}:inflight:40", key.as_str())
        );
        assert_eq!(reset_channel("app"), "app:reset");
    }
}
