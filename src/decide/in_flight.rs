//! The store calls of rules with an [in-flight limit](crate::InFlightLimit): the limits
//! and the cap in one call ([`Store::check_in_flight`](crate::store::Store::check_in_flight)),
//! and the shadow limits, if any, in a call of their own beside it; after a wait in
//! line, the limits and the cap again (or the reservation's answer with its permit).

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use crate::{
    Decision, StoreError,
    store::{Admitted, Check},
};

/// The answers about a request with an in-flight limit.
pub(crate) struct Answers {
    pub(crate) admitted: Result<Admitted, StoreError>,
    /// The shadow limits' answer; `None` without shadow limits.
    pub(crate) shadow: Option<Result<Decision, StoreError>>,
}

/// The calls of [`Answers`], waited for together.
pub(crate) struct Calls {
    admit: Option<Check<Admitted>>,
    shadow: Option<Check>,
    admitted: Option<Result<Admitted, StoreError>>,
    shadowed: Option<Result<Decision, StoreError>>,
}

impl Calls {
    pub(crate) fn new(
        admit: Result<Result<Admitted, StoreError>, Check<Admitted>>,
        shadow: Option<Result<Result<Decision, StoreError>, Check>>,
    ) -> Result<Answers, Box<Self>> {
        let (admit, admitted) = match admit {
            Ok(result) => (None, Some(result)),
            Err(check) => (Some(check), None),
        };
        let (shadow, shadowed) = match shadow {
            None => (None, None),
            Some(Ok(result)) => (None, Some(result)),
            Some(Err(check)) => (Some(check), None),
        };
        if admit.is_none() && shadow.is_none() {
            return Ok(Answers {
                admitted: admitted.expect("answered"),
                shadow: shadowed,
            });
        }
        Err(Box::new(Self {
            admit,
            shadow,
            admitted,
            shadowed,
        }))
    }

    /// The call of a request that waited its turn: the limits and the cap alone.
    pub(crate) fn waited(admit: Check<Admitted>) -> Self {
        Self {
            admit: Some(admit),
            shadow: None,
            admitted: None,
            shadowed: None,
        }
    }

    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Answers> {
        if let Some(check) = &mut self.admit
            && let Poll::Ready(result) = Pin::new(check).poll(cx)
        {
            self.admit = None;
            self.admitted = Some(result);
        }
        if let Some(check) = &mut self.shadow
            && let Poll::Ready(result) = Pin::new(check).poll(cx)
        {
            self.shadow = None;
            self.shadowed = Some(result);
        }
        if self.admit.is_some() || self.shadow.is_some() {
            return Poll::Pending;
        }
        Poll::Ready(Answers {
            admitted: self
                .admitted
                .take()
                .unwrap_or_else(|| Err(StoreError::circuit_open())),
            shadow: self.shadowed.take(),
        })
    }
}
