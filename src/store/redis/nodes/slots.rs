//! Which master owns which slot, as `CLUSTER SLOTS` says.

use std::sync::Arc;

use redis::Value;

/// A master's address: host and port, as `CLUSTER SLOTS` gives them.
pub(crate) type Address = Arc<(String, u16)>;

#[derive(Default)]
pub(super) struct SlotMap {
    /// For each slot, its master's index in `masters`; `u16::MAX`: not known.
    pub(super) owner: Vec<u16>,
    pub(super) masters: Vec<Address>,
}

impl SlotMap {
    /// From `CLUSTER SLOTS`: `[[start, end, [host, port, id, ...], replicas...], ...]`.
    /// Slots whose master has no host (`""` or `"?"`) stay unknown.
    pub(super) fn parse(reply: Value) -> Option<Self> {
        let Value::Array(ranges) = reply else {
            return None;
        };
        let mut map = Self {
            owner: vec![u16::MAX; 16384],
            masters: Vec::new(),
        };
        for range in ranges {
            let Value::Array(range) = range else {
                return None;
            };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
                (range.first(), range.get(1), range.get(2))
            else {
                return None;
            };
            let host = match master.first() {
                Some(Value::BulkString(host)) => String::from_utf8(host.clone()).ok()?,
                Some(Value::SimpleString(host)) => host.clone(),
                _ => return None,
            };
            let Some(Value::Int(port)) = master.get(1) else {
                return None;
            };
            if host.is_empty() || host == "?" {
                continue;
            }
            let address = Arc::new((host, u16::try_from(*port).ok()?));
            let index = match map.masters.iter().position(|a| *a == address) {
                Some(index) => index,
                None => {
                    map.masters.push(address);
                    map.masters.len() - 1
                }
            };
            let index = u16::try_from(index).ok()?;
            let (start, end) = (usize::try_from(*start).ok()?, usize::try_from(*end).ok()?);
            for slot in map.owner.get_mut(start..=end)? {
                *slot = index;
            }
        }
        Some(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::BulkString(host.as_bytes().to_vec()),
            Value::Int(port),
            Value::BulkString(b"id".to_vec()),
        ])
    }

    #[test]
    fn parses_cluster_slots() {
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("127.0.0.1", 7000),
                node("127.0.0.1", 7003),
            ]),
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(16383),
                node("10.0.0.2", 7001),
            ]),
            Value::Array(vec![Value::Int(100), Value::Int(100), node("?", 7001)]),
        ]);
        let map = SlotMap::parse(reply).unwrap();
        assert_eq!(map.masters.len(), 2);
        assert_eq!(*map.masters[0], ("127.0.0.1".to_owned(), 7000));
        assert_eq!(map.owner[0], 0);
        assert_eq!(map.owner[5460], 0);
        assert_eq!(map.owner[5461], 1);
        assert_eq!(map.owner[16383], 1);
        assert!(SlotMap::parse(Value::Int(1)).is_none());
    }
}
