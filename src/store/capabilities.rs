//! [`Capabilities`]: what a [`Store`](super::Store) can do besides deciding, said by the
//! store itself, so that a layer refuses at build a feature its store cannot serve.

use std::fmt;

/// One thing a [`Store`](super::Store) may do besides [`check`](super::Store::check):
/// each is one of its methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Capability {
    /// [`Store::reserve`](super::Store::reserve): counts a request that does not fit now
    /// for the moment it will, so that it waits without asking again. With both this and
    /// [`Adjust`](Self::Adjust) (to give back a reservation whose request went away), a
    /// layer with [`max_wait`](crate::RateLimitLayer::with_max_wait) reserves; without, its
    /// denied requests wait their turn and ask again, as requests under limits that
    /// cannot be reserved (windows, logs, lockouts) do on every store.
    Reserve,
    /// [`Store::adjust`](super::Store::adjust): gives back or charges units after a
    /// decision. Counting after the response
    /// ([`count_when`](crate::RateLimitLayer::with_count_when),
    /// [`late_cost`](crate::RateLimitLayer::with_late_cost),
    /// [`late_cost_from_trailers`](crate::RateLimitLayer::with_late_cost_from_trailers)) needs
    /// it: a layer that counts after the response on a store without it is refused.
    Adjust,
    /// [`Store::peek`](super::Store::peek): reads a key's budget without spending it
    /// ([`Limiter::peek`](crate::Limiter::peek)).
    Peek,
    /// [`Store::reset`](super::Store::reset): clears a key's state
    /// ([`Limiter::reset`](crate::Limiter::reset)).
    Reset,
    /// [`Store::check_in_flight`](super::Store::check_in_flight) and
    /// [`Store::release_in_flight`](super::Store::release_in_flight): an
    /// [in-flight limit](crate::InFlightLimit) decided with the rate limits. A layer with
    /// one on a store without it is refused, and so are such rules at run time.
    InFlight,
}

impl Capability {
    /// Every capability.
    pub const ALL: [Self; 5] = [
        Self::Reserve,
        Self::Adjust,
        Self::Peek,
        Self::Reset,
        Self::InFlight,
    ];

    /// The name of the [`Store`](super::Store) method it is.
    pub const fn method(self) -> &'static str {
        match self {
            Self::Reserve => "reserve",
            Self::Adjust => "adjust",
            Self::Peek => "peek",
            Self::Reset => "reset",
            Self::InFlight => "check_in_flight",
        }
    }

    const fn bit(self) -> u8 {
        match self {
            Self::Reserve => 1,
            Self::Adjust => 2,
            Self::Peek => 4,
            Self::Reset => 8,
            Self::InFlight => 16,
        }
    }
}

/// The [`Capability`]s a store has: what [`Store::capabilities`](super::Store::capabilities)
/// answers. A method whose capability a store does not claim answers
/// [`StoreErrorKind::Unsupported`](crate::StoreErrorKind::Unsupported), and a layer is
/// never built to rely on it.
///
/// ```
/// use tollgate::store::{Capabilities, Capability};
///
/// let caps = Capabilities::NONE.with(Capability::Adjust);
/// assert!(caps.contains(Capability::Adjust));
/// assert!(!caps.contains(Capability::Reserve));
/// assert!(Capabilities::ALL.contains(Capability::Reset));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Capabilities(u8);

impl Capabilities {
    /// Deciding only ([`check`](super::Store::check)).
    pub const NONE: Self = Self(0);
    /// Every [`Capability`]: the memory and Redis stores.
    pub const ALL: Self = Self(0b1_1111);

    /// These and `capability`.
    #[must_use]
    pub const fn with(self, capability: Capability) -> Self {
        Self(self.0 | capability.bit())
    }

    /// Whether `capability` is among these.
    pub const fn contains(self, capability: Capability) -> bool {
        self.0 & capability.bit() != 0
    }
}

impl fmt::Debug for Capabilities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set()
            .entries(
                Capability::ALL
                    .iter()
                    .filter(|c| self.contains(**c))
                    .map(|c| c.method()),
            )
            .finish()
    }
}

/// The name a store's `Debug` starts with (its type's, for derived ones): what error
/// messages call it.
pub(crate) fn store_name(store: &dyn fmt::Debug) -> String {
    let shown = format!("{store:?}");
    let end = shown
        .find(|c: char| !(c.is_alphanumeric() || "_:<>".contains(c)))
        .unwrap_or(shown.len());
    match &shown[..end] {
        "" => shown.chars().take(40).collect(),
        name => name.to_owned(),
    }
}
