//! What `tracing` wrote during a test, captured on the test's thread.
//!
//! One global subscriber, installed by the first capture, writes each event to the
//! capture of the thread it happens on (and drops it on threads that capture nothing).
//! A subscriber of its own per test (`set_default`) lost events: a callsite first hit by
//! a parallel test, while no subscriber wanted it, could cache "never" after this test's
//! subscriber was set and its cache rebuilt (seen in CI: 0 of 2 `store failed` lines).
//! With one global subscriber whose filter asks per event (a dynamic filter: "sometimes"
//! for every callsite, where a plain `filter_fn` caches "always" or "never"), no callsite is
//! ever "never".

#![allow(dead_code, unreachable_pub)]

use std::{
    cell::RefCell,
    io,
    sync::{Arc, Mutex, OnceLock},
};

use tracing::{Level, Metadata};
use tracing_subscriber::{
    Layer, filter, fmt::MakeWriter, layer::SubscriberExt, util::SubscriberInitExt,
};

thread_local! {
    /// The capture of this thread, if any.
    static SINK: RefCell<Option<Logs>> = const { RefCell::new(None) };
}

/// The lines logged (at debug and above) on this thread while the guard lives.
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

/// Ends a capture when dropped.
pub enum Guard {
    /// The global subscriber writes to this thread's capture until then.
    Global(Option<Logs>),
    /// Another global subscriber was there first: a subscriber of this thread's own.
    Scoped(tracing::subscriber::DefaultGuard),
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Self::Global(previous) = self {
            let previous = previous.take();
            SINK.with(|sink| *sink.borrow_mut() = previous);
        }
    }
}

fn capturing(metadata: &Metadata<'_>) -> bool {
    *metadata.level() <= Level::DEBUG && SINK.with(|sink| sink.borrow().is_some())
}

/// Installs the global subscriber once: whether it is the global one.
fn global() -> bool {
    static INSTALLED: OnceLock<bool> = OnceLock::new();
    *INSTALLED.get_or_init(|| {
        let layer = tracing_subscriber::fmt::layer()
            .with_writer(ThreadSink)
            .with_ansi(false)
            .with_filter(filter::dynamic_filter_fn(|metadata, _| capturing(metadata)));
        let installed = tracing_subscriber::registry()
            .with(layer)
            .try_init()
            .is_ok();
        // Callsites hit before it was there ask again.
        tracing::callsite::rebuild_interest_cache();
        installed
    })
}

impl Logs {
    /// Captures this thread's events until the guard is dropped. A `current_thread`
    /// runtime (plain `#[tokio::test]`) polls every future on this thread.
    pub fn capture() -> (Self, Guard) {
        let logs = Self::default();
        if global() {
            let previous = SINK.with(|sink| sink.borrow_mut().replace(logs.clone()));
            return (logs, Guard::Global(previous));
        }
        let guard = tracing_subscriber::fmt()
            .with_writer(logs.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .finish()
            .set_default();
        tracing::callsite::rebuild_interest_cache();
        (logs, Guard::Scoped(guard))
    }

    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Logs {
    type Writer = Self;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// Writes to the capture of the thread the event happens on.
struct ThreadSink;

impl io::Write for ThreadSink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        SINK.with(|sink| {
            if let Some(logs) = &*sink.borrow() {
                logs.0.lock().unwrap().extend_from_slice(buf);
            }
        });
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for ThreadSink {
    type Writer = Self;

    fn make_writer(&'a self) -> Self::Writer {
        Self
    }
}
