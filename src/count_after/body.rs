//! The response bodies of a counting layer: [`RateLimitBody`], which holds the request's
//! charge and permit until the body ends, and [`CountedBody`], which reads the cost from
//! the trailers.

use std::{
    fmt,
    pin::Pin,
    task::{Context, Poll, ready},
};

use http::{HeaderMap, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::charged::Charged;

pin_project! {
    /// The response body of a [`RateLimit`](crate::RateLimit) service (with
    /// [`UpFront`], [`CountWhen`] or [`LateCost`] counting): the inner body, and for a
    /// request of an [in-flight limit](crate::InFlightLimit) its permit (and its
    /// adjustment), given back in one store call when the body ends, fails or is
    /// dropped. Without an in-flight limit it holds nothing and only passes the body on.
    pub struct RateLimitBody<B> {
        #[pin]
        inner: B,
        // Boxed: a body without one (the plain path) grows by a pointer only.
        held: Holding,
    }
}

/// What a [`RateLimitBody`] holds: its drop, inlined, only tests for a charge; the
/// charge's own drop (its store call) is out of line. (Dropped as a plain `Option`, the
/// body's drop stayed a call of its own: ~10 instructions a response,
/// benches/instructions.rs.)
#[derive(Debug, Default)]
struct Holding(Option<Box<Charged>>);

impl Drop for Holding {
    #[inline(always)]
    fn drop(&mut self) {
        if let Some(charged) = self.0.take() {
            let_go(charged);
        }
    }
}

impl std::ops::Deref for Holding {
    type Target = Option<Box<Charged>>;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Holding {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

/// Drops a body's charge: settles it, gives its permit back.
#[inline(never)]
fn let_go(charged: Box<Charged>) {
    drop(charged);
}

impl<B> RateLimitBody<B> {
    /// `inner`, holding nothing.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            held: Holding(None),
        }
    }

    #[inline(always)]
    pub(super) fn wrap(response: Response<B>, held: Option<Charged>) -> Response<Self> {
        let held = Holding(held.map(Box::new));
        response.map(|inner| Self { inner, held })
    }

    /// Whether the body still holds its request's in-flight permit.
    pub fn holds_permit(&self) -> bool {
        self.held.as_ref().is_some_and(|held| held.holds_permit())
    }

    /// The body it wraps.
    pub fn into_inner(self) -> B {
        self.inner
    }
}

impl<B: Default> Default for RateLimitBody<B> {
    fn default() -> Self {
        Self::new(B::default())
    }
}

impl<B: fmt::Debug> fmt::Debug for RateLimitBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitBody")
            .field("inner", &self.inner)
            .field("held", &self.held.0)
            .finish()
    }
}

impl<B: Body> Body for RateLimitBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    #[inline]
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        let frame = ready!(this.inner.as_mut().poll_frame(cx));
        // The end, or an error (the body is over): the request is no longer in flight,
        // and its charge settles (dropped, with the units decided at the response).
        if let Some(held) = this.held.as_mut() {
            match &frame {
                Some(Ok(frame)) => {
                    if let Some(trailers) = frame.trailers_ref() {
                        held.trailers(trailers);
                    }
                    if this.inner.is_end_stream() {
                        held.ended();
                        this.held.take();
                    }
                }
                Some(Err(_)) => {
                    held.failed();
                    this.held.take();
                }
                None => {
                    held.ended();
                    this.held.take();
                }
            }
        }
        Poll::Ready(frame)
    }

    #[inline]
    fn is_end_stream(&self) -> bool {
        let end = self.inner.is_end_stream();
        // A server drops a body that says it is over without reading it: its end.
        if end && let Some(held) = self.held.as_ref() {
            held.saw_end();
        }
        end
    }

    #[inline]
    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project! {
    /// A response body that settles its request's charge from its trailers when it ends.
    /// A body dropped before its end keeps the charge.
    pub struct CountedBody<B, F> {
        #[pin]
        inner: B,
        pending: Option<(Charged, F)>,
    }
}

impl<B, F> CountedBody<B, F> {
    pub(super) fn counting(inner: B, pending: Option<(Charged, F)>) -> Self {
        Self { inner, pending }
    }

    /// The body it wraps, for a response that needs no counting.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            pending: None,
        }
    }
}

impl<B: fmt::Debug, F> fmt::Debug for CountedBody<B, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountedBody")
            .field("inner", &self.inner)
            .field("pending", &self.pending.as_ref().map(|(c, _)| c))
            .finish()
    }
}

impl<B, F> Body for CountedBody<B, F>
where
    B: Body,
    F: Fn(Option<&HeaderMap>) -> Option<u32>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = ready!(this.inner.poll_frame(cx));
        match &frame {
            Some(Ok(frame)) => {
                if let Some(trailers) = frame.trailers_ref()
                    && let Some((mut charged, read)) = this.pending.take()
                {
                    charged.trailers(trailers);
                    charged.ended();
                    let cost = charged.cost;
                    charged.settle(read(Some(trailers)).unwrap_or(cost));
                }
            }
            None => {
                if let Some((mut charged, read)) = this.pending.take() {
                    charged.ended();
                    let cost = charged.cost;
                    charged.settle(read(None).unwrap_or(cost));
                }
            }
            // A body that failed keeps the charge.
            Some(Err(_)) => {
                if let Some((mut charged, _)) = this.pending.take() {
                    charged.failed();
                }
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        // Not before the charge is settled: the last poll, which sees the end, settles it.
        self.pending.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
