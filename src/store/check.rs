//! [`Check`]: a store's answer, ready now or later.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use futures_util::{FutureExt, future::BoxFuture};

use crate::{Decision, StoreError};

/// What [`Store::check`](super::Store::check) returns: a future of the decision that is
/// either already decided (the in-memory store, a block-cache hit: no allocation, no
/// timer) or waiting for I/O.
#[must_use = "a check does nothing unless awaited"]
pub struct Check(State);

enum State {
    Ready(Option<Result<Decision, StoreError>>),
    Pending(BoxFuture<'static, Result<Decision, StoreError>>),
}

impl Check {
    /// A check decided already.
    pub fn ready(result: Result<Decision, StoreError>) -> Self {
        Self(State::Ready(Some(result)))
    }

    /// A check that waits for `future`.
    pub fn pending(
        future: impl Future<Output = Result<Decision, StoreError>> + Send + 'static,
    ) -> Self {
        Self(State::Pending(future.boxed()))
    }

    /// Whether the decision is already there.
    pub fn is_ready(&self) -> bool {
        matches!(self.0, State::Ready(_))
    }

    /// The decision if it is already there, else the check itself.
    #[inline]
    pub(crate) fn into_ready(self) -> Result<Result<Decision, StoreError>, Self> {
        match self.0 {
            State::Ready(Some(result)) => Ok(result),
            state => Err(Self(state)),
        }
    }
}

impl Future for Check {
    type Output = Result<Decision, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.0 {
            State::Ready(result) => {
                Poll::Ready(result.take().expect("Check polled after completion"))
            }
            State::Pending(future) => future.poll_unpin(cx),
        }
    }
}

impl fmt::Debug for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            State::Ready(result) => f.debug_tuple("Check::Ready").field(result).finish(),
            State::Pending(_) => f.write_str("Check::Pending"),
        }
    }
}
