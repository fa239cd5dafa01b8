//! Tests' view of what the crate logs: the events logged on one thread while a closure runs.
//!
//! One subscriber is set as the test binary's global default, once, and hands each event to
//! the capture of the thread that logs it, if that thread is capturing. A subscriber set per
//! test (`with_default`) lost events: a call site first met on another thread while no
//! subscriber wanted it could cache itself as never wanted, racing the test's rebuild of that
//! cache, and a test then missed its own line.

use std::cell::RefCell;
use std::sync::Arc;

use parking_lot::Mutex;

/// One logged event: its level, its message, and its other fields as `name=value` words.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    pub(crate) level: tracing::Level,
    pub(crate) message: String,
    pub(crate) fields: String,
}

type Capture = Arc<Mutex<Vec<Event>>>;

thread_local! {
    /// The capture of this thread, while a `logged` runs on it.
    static CAPTURE: RefCell<Option<Capture>> = const { RefCell::new(None) };
}

#[derive(Default)]
struct Words {
    message: String,
    fields: String,
}

impl tracing::field::Visit for Words {
    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
        if f.name() == "message" {
            self.message = format!("{v:?}");
        } else {
            self.fields.push_str(&format!(" {}={v:?}", f.name()));
        }
    }
}

/// Hands each event to its thread's capture.
struct ToCapture;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for ToCapture {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let Some(capture) = CAPTURE.with(|c| c.borrow().clone()) else {
            return;
        };
        let mut w = Words::default();
        event.record(&mut w);
        capture.lock().push(Event {
            level: *event.metadata().level(),
            message: w.message,
            fields: w.fields,
        });
    }
}

/// The events logged on this thread while `f` runs.
pub(crate) fn logged<R>(f: impl FnOnce() -> R) -> (R, Vec<Event>) {
    static GLOBAL: std::sync::Once = std::sync::Once::new();
    GLOBAL.call_once(|| {
        use tracing_subscriber::layer::SubscriberExt;
        let subscriber = tracing_subscriber::registry().with(ToCapture);
        // Another global default already set (none in this crate's tests): its events do not
        // reach the captures, and the assertions on them fail, saying so.
        let _ = tracing::subscriber::set_global_default(subscriber);
    });
    let capture = Capture::default();
    CAPTURE.with(|c| *c.borrow_mut() = Some(capture.clone()));
    // Cleared when `f` unwinds too.
    struct Clear;
    impl Drop for Clear {
        fn drop(&mut self) {
            CAPTURE.with(|c| *c.borrow_mut() = None);
        }
    }
    let clear = Clear;
    let out = f();
    drop(clear);
    let seen = capture.lock().clone();
    (out, seen)
}
