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
}

impl Adjustment {
    /// The units it moves.
    pub fn units(&self) -> u32 {
        match *self {
            Self::Refund { units, .. } | Self::TopUp { units } => units,
        }
    }
}
