//! What `tracing` wrote during a test, captured on the test's thread.

#![allow(dead_code, unreachable_pub)]

use std::{
    io,
    sync::{Arc, Mutex},
};

use tracing_subscriber::{fmt::MakeWriter, util::SubscriberInitExt};

/// The lines logged (at debug and above) on this thread while the guard lives.
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    /// Captures this thread's events until the guard is dropped. A `current_thread`
    /// runtime (plain `#[tokio::test]`) polls every future on this thread.
    pub fn capture() -> (Self, tracing::subscriber::DefaultGuard) {
        let logs = Self::default();
        let guard = tracing_subscriber::fmt()
            .with_writer(logs.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .finish()
            .set_default();
        // A callsite first hit by another test while no subscriber wanted it (or while
        // this one was being set) may have cached "never": its next event would be lost
        // here. Ask every callsite again, now that this subscriber is in place.
        tracing::callsite::rebuild_interest_cache();
        (logs, guard)
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
