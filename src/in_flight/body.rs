//! [`InFlightBody`]: the response body that holds its request's permit.

use std::{
    fmt,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::Buf;
use pin_project_lite::pin_project;

use super::shared::Held;

pin_project! {
    /// A response body that holds its request's permit until it ends or is dropped.
    pub struct InFlightBody<B> {
        #[pin]
        inner: B,
        permit: Option<Held>,
    }
}

impl<B> InFlightBody<B> {
    pub(super) fn new(inner: B, permit: Option<Held>) -> Self {
        Self { inner, permit }
    }

    /// Whether the body still holds a permit (its request still counts as in flight).
    pub fn holds_permit(&self) -> bool {
        self.permit.is_some()
    }
}

impl<B: fmt::Debug> fmt::Debug for InFlightBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlightBody")
            .field("inner", &self.inner)
            .field("holds_permit", &self.permit.is_some())
            .finish()
    }
}

impl<B: Default> Default for InFlightBody<B> {
    fn default() -> Self {
        Self::new(B::default(), None)
    }
}

impl<B> http_body::Body for InFlightBody<B>
where
    B: http_body::Body,
    B::Data: Buf,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        let frame = ready!(this.inner.as_mut().poll_frame(cx));
        // The end, or an error (the body is over): the request is no longer in flight.
        if !matches!(frame, Some(Ok(_))) || this.inner.is_end_stream() {
            this.permit.take();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
