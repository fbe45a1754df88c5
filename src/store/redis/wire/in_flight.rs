//! The library's function for the in-flight stage's commonest calls (lua/one_in_flight.lua):
//! a coalesced batch of decisions on one fixed window and an in-flight permit each, and of
//! permits' releases (bare, or with an adjustment of such a window), in one `FCALL` that
//! skips the general function's groups and sections. Where functions turn out unavailable,
//! [`as_script`] gives the general script's form of the same call.

use redis::Cmd;

/// One entry of [`call`]: a decision on one fixed window and an in-flight
/// permit, or a permit's release (with an adjustment of one fixed window, or bare).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InFlightEntry<'a> {
    /// `cost` (1 to `limit`) against `limit` per `window_ms` on `window`, and permit `id`
    /// of `max` on `permits`, ending `ttl_ms` after the call's `now`.
    Decide {
        window: &'a [u8],
        permits: &'a [u8],
        cost: u32,
        limit: u64,
        window_ms: u64,
        max: u64,
        ttl_ms: u64,
        id: &'a str,
    },
    /// Permit `id` of `max` on `permits` goes back; with `adjust`, `units` (at least 1)
    /// of the window are refunded (`at` >= 0: the `now` they were charged at) or charged
    /// late (`at` = -1).
    Release {
        adjust: Option<Adjust<'a>>,
        permits: &'a [u8],
        max: u64,
        id: &'a str,
    },
}

/// The adjustment of a [`InFlightEntry::Release`]: the window's key, limit, window ms,
/// units and `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Adjust<'a> {
    pub(crate) window: &'a [u8],
    pub(crate) limit: u64,
    pub(crate) window_ms: u64,
    pub(crate) units: u32,
    pub(crate) at: i64,
}

/// The call of the library's function `name` for a batch of in-flight decisions and
/// releases (lua/one_in_flight.lua's `decide_in_flight`), in order: every key declared. Its reply
/// is the general function's for the same requests: four values per limit (the window's,
/// then the permit's; a bare release's permit only), then the `now` it decided at.
pub(crate) fn call(name: &str, now: Option<u64>, entries: &[InFlightEntry<'_>]) -> Cmd {
    let keys: usize = entries
        .iter()
        .map(|entry| match entry {
            InFlightEntry::Release { adjust: None, .. } => 1,
            _ => 2,
        })
        .sum();
    let mut cmd = Cmd::with_capacity(4 + keys + 6 * entries.len(), 48 + 96 * entries.len());
    cmd.arg("FCALL").arg(name).arg(keys);
    for entry in entries {
        match *entry {
            InFlightEntry::Decide {
                window, permits, ..
            }
            | InFlightEntry::Release {
                adjust: Some(Adjust { window, .. }),
                permits,
                ..
            } => cmd.arg(window).arg(permits),
            InFlightEntry::Release { permits, .. } => cmd.arg(permits),
        };
    }
    match now {
        Some(now) => cmd.arg(now),
        None => cmd.arg(""),
    };
    for entry in entries {
        match *entry {
            InFlightEntry::Decide {
                cost,
                limit,
                window_ms,
                max,
                ttl_ms,
                id,
                ..
            } => cmd
                .arg(cost)
                .arg(limit)
                .arg(window_ms)
                .arg(max)
                .arg(ttl_ms)
                .arg(id),
            InFlightEntry::Release {
                adjust: Some(adjust),
                max,
                id,
                ..
            } => cmd
                .arg(-i64::from(adjust.units))
                .arg(adjust.at)
                .arg(adjust.limit)
                .arg(adjust.window_ms)
                .arg(max)
                .arg(id),
            InFlightEntry::Release {
                adjust: None,
                max,
                id,
                ..
            } => cmd.arg(0).arg(max).arg(id),
        };
    }
    cmd
}

/// Appends to `cmd` (`EVALSHA <sha>`) the general script's arguments for the entries of
/// an [`call`], given as its words after the function's name: the keys, `now`,
/// one group per distinct list of limits in order of first use, each entry as a request
/// (a release as an adjustment: a bare one as a refund of 1 unit at 0), no leases and no
/// reservations, then the permits (lua/main.lua), as `script_call` lays them out.
pub(crate) fn as_script(cmd: &mut Cmd, words: &[&[u8]]) {
    const CAP: &[u8] = b"4294967296";
    let parse = |word: &[u8]| -> i64 {
        std::str::from_utf8(word)
            .ok()
            .and_then(|w| w.parse().ok())
            .unwrap_or(0)
    };
    let keys = usize::try_from(parse(words.first().copied().unwrap_or(b"0"))).unwrap_or(0);
    let Some(rest) = words.get(1 + keys..) else {
        return;
    };
    let (now, mut rest) = rest
        .split_first()
        .map_or((&b""[..], &[][..]), |(n, r)| (*n, r));
    let mut groups: Vec<Vec<&[u8]>> = Vec::new();
    // Each entry: its cost word (negated for a release), its group, its `at`, its id.
    type Request<'a> = (&'a [u8], usize, Option<&'a [u8]>, &'a [u8]);
    let mut requests: Vec<Request<'_>> = Vec::new();
    fn group_index<'a>(group: Vec<&'a [u8]>, groups: &mut Vec<Vec<&'a [u8]>>) -> usize {
        let index = match groups.iter().position(|g| *g == group) {
            Some(index) => index,
            None => {
                groups.push(group);
                groups.len() - 1
            }
        };
        index + 1
    }
    while let Some(&cost) = rest.first() {
        let value = parse(cost);
        if value > 0 && rest.len() >= 6 {
            let [_, limit, window, max, ttl, id] = [0, 1, 2, 3, 4, 5].map(|i| rest[i]);
            let group = vec![b"1", limit, window, limit, b"0", b"6", max, ttl, CAP, b"0"];
            let g = group_index(group, &mut groups);
            requests.push((cost, g, None, id));
            rest = &rest[6..];
        } else if value < 0 && rest.len() >= 6 {
            let [_, at, limit, window, max, id] = [0, 1, 2, 3, 4, 5].map(|i| rest[i]);
            let group = vec![b"1", limit, window, limit, b"0", b"6", max, b"1", CAP, b"0"];
            let g = group_index(group, &mut groups);
            requests.push((cost, g, Some(at), id));
            rest = &rest[6..];
        } else if rest.len() >= 3 {
            let (max, id) = (rest[1], rest[2]);
            let g = group_index(vec![b"6", max, b"1", CAP, b"0"], &mut groups);
            requests.push((b"-1", g, Some(b"0"), id));
            rest = &rest[3..];
        } else {
            break;
        }
    }
    cmd.arg(keys);
    for key in &words[1..1 + keys] {
        cmd.arg(*key);
    }
    cmd.arg(now).arg(groups.len());
    for group in &groups {
        cmd.arg(group.len() / 5);
        for value in group {
            cmd.arg(*value);
        }
    }
    cmd.arg(requests.len());
    for (cost, group, at, _) in &requests {
        cmd.arg(*cost).arg(*group);
        if let Some(at) = at {
            cmd.arg(*at);
        }
    }
    cmd.arg(0).arg(0).arg(0).arg(requests.len());
    for (index, (_, _, _, id)) in requests.iter().enumerate() {
        cmd.arg(index + 1).arg(*id);
    }
}
