//! [`Adjustment`]: units given back or charged after a request was decided.

/// A change to a key's counted units after its request was decided, applied by
/// [`Store::adjust`](crate::store::Store::adjust).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adjustment {
    /// Gives back `units` charged by a decision made at `charged_at_ms`
    /// ([`Decision::decided_at_ms`](crate::Decision::decided_at_ms)), to the state they
    /// were charged to; nothing once that state is gone (the window is over). Never more
    /// than was charged.
    Refund {
        /// Units to give back.
        units: u32,
        /// When the charge was decided, on the store's clock.
        charged_at_ms: u64,
    },
    /// Charges `units` that were already spent (the request ran): counted even over the
    /// limit, so that later requests wait until the debt is paid off.
    TopUp {
        /// Units to charge.
        units: u32,
    },
    /// Settles a request's up-front charge of `charged` units, decided at
    /// `charged_at_ms`: `kept` of them stay spent (fewer: the difference is given back as
    /// a [`Refund`](Self::Refund); more: it is charged as a [`TopUp`](Self::TopUp)), and
    /// none is *pending* any more. A lockout whose limit counts charges as pending
    /// ([`Limit::pending_until_settled`](crate::Limit::pending_until_settled), set by a
    /// layer that counts after the response) blocks a key only for units kept, so every
    /// charge it allowed is settled with this once its response is there, even one that
    /// keeps exactly what it charged. On other limits it is the refund or top-up alone.
    Settle {
        /// Units charged up front (at least 1).
        charged: u32,
        /// Units the request costs in the end.
        kept: u32,
        /// When the charge was decided, on the store's clock.
        charged_at_ms: u64,
    },
}

impl Adjustment {
    /// The units it moves.
    pub fn units(&self) -> u32 {
        match *self {
            Self::Refund { units, .. } | Self::TopUp { units } => units,
            Self::Settle { charged, kept, .. } => charged.abs_diff(kept),
        }
    }

    /// The refund or top-up it makes to the limits' states (`None`: none), without the
    /// pending units a [`Settle`](Self::Settle) ends.
    pub(crate) fn to_states(self) -> Option<Self> {
        match self {
            Self::Settle {
                charged,
                kept,
                charged_at_ms,
            } => {
                if kept < charged {
                    Some(Self::Refund {
                        units: charged - kept,
                        charged_at_ms,
                    })
                } else if kept > charged {
                    Some(Self::TopUp {
                        units: kept - charged,
                    })
                } else {
                    None
                }
            }
            other => Some(other),
        }
    }

    /// The pending units it ends and when they were charged: a [`Settle`](Self::Settle)'s.
    pub(crate) fn settled(self) -> Option<(u32, u64)> {
        match self {
            Self::Settle {
                charged,
                charged_at_ms,
                ..
            } => Some((charged, charged_at_ms)),
            _ => None,
        }
    }
}
