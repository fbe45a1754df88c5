//! The two store calls of rules with [shadow limits](crate::guide::shadow): the enforced
//! limits' (which may reserve, like any other) and the shadow limits', made together.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use futures_util::future::{Join, join};

use crate::{Decision, StoreError, store::Check};

/// The store's answers about a request's enforced and shadow limits.
pub(crate) struct Answers {
    /// `None` when every limit is in shadow.
    pub(crate) enforced: Option<Result<Decision, StoreError>>,
    pub(crate) shadow: Result<Decision, StoreError>,
}

/// A store call's answer if it was there at once, else the call.
type Asked = Result<Result<Decision, StoreError>, Check>;

/// The two store calls, waited for together.
pub(crate) struct Checks {
    enforced: bool,
    /// Boxed: the answers it holds while the other call waits would make every
    /// [`ResponseFuture`](crate::ResponseFuture) larger.
    both: Box<Join<Check, Check>>,
}

impl Checks {
    /// The answers of the `enforced` call (none if every limit is in shadow) and the
    /// `shadow` one, when both are there; else both calls, to wait for.
    pub(crate) fn start(enforced: Option<Asked>, shadow: Asked) -> Result<Answers, Self> {
        match (enforced, shadow) {
            (None, Ok(shadow)) => Ok(Answers {
                enforced: None,
                shadow,
            }),
            (Some(Ok(enforced)), Ok(shadow)) => Ok(Answers {
                enforced: Some(enforced),
                shadow,
            }),
            (first, second) => {
                let enforced = first.is_some();
                let first =
                    first.map_or_else(|| Check::ready(Ok(Decision::unlimited())), into_check);
                Err(Self {
                    enforced,
                    both: Box::new(join(first, into_check(second))),
                })
            }
        }
    }
}

/// A check for an answer that may be there already.
fn into_check(answer: Asked) -> Check {
    match answer {
        Ok(result) => Check::ready(result),
        Err(check) => check,
    }
}

impl Future for Checks {
    type Output = Answers;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Answers> {
        let (first, shadow) = std::task::ready!(Pin::new(&mut *self.both).poll(cx));
        Poll::Ready(Answers {
            enforced: self.enforced.then_some(first),
            shadow,
        })
    }
}
