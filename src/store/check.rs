//! [`Check`]: a store's answer, ready now or later.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use futures_util::{FutureExt, future::BoxFuture};

use crate::{Decision, StoreError};

/// What [`Store::check`](super::Store::check) returns (and, with `T` = [`Acquired`](super::Acquired),
/// [`Permits::acquire`](super::Permits::acquire)): a future of the answer that is either
/// already there (the in-memory store, a block-cache hit: no allocation, no timer) or
/// waiting for I/O.
#[must_use = "a check does nothing unless awaited"]
pub struct Check<T = Decision>(State<T>);

enum State<T> {
    Ready(Option<Result<T, StoreError>>),
    Pending(BoxFuture<'static, Result<T, StoreError>>),
}

impl<T> Check<T> {
    /// A check decided already.
    pub fn ready(result: Result<T, StoreError>) -> Self {
        Self(State::Ready(Some(result)))
    }

    /// A check that waits for `future`.
    pub fn pending(future: impl Future<Output = Result<T, StoreError>> + Send + 'static) -> Self {
        Self(State::Pending(future.boxed()))
    }

    /// Whether the answer is already there.
    pub fn is_ready(&self) -> bool {
        matches!(self.0, State::Ready(_))
    }

    /// The answer if it is already there, else the check itself.
    #[inline]
    pub(crate) fn into_ready(self) -> Result<Result<T, StoreError>, Self> {
        match self.0 {
            State::Ready(Some(result)) => Ok(result),
            state => Err(Self(state)),
        }
    }
}

// Nothing in a check is pinned structurally: the answer is moved out, the boxed future is
// pinned on the heap.
impl<T> Unpin for Check<T> {}

impl<T> Future for Check<T> {
    type Output = Result<T, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.0 {
            State::Ready(result) => {
                Poll::Ready(result.take().expect("Check polled after completion"))
            }
            State::Pending(future) => future.poll_unpin(cx),
        }
    }
}

impl<T: fmt::Debug> fmt::Debug for Check<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            State::Ready(result) => f.debug_tuple("Check::Ready").field(result).finish(),
            State::Pending(_) => f.write_str("Check::Pending"),
        }
    }
}
