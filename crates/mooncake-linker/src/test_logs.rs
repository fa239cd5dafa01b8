//! Tests' view of what the crate logs: the events logged on one thread while a closure runs.

use std::sync::Arc;

use parking_lot::Mutex;

/// One logged event: its level, its message, and its other fields as `name=value` words.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    pub(crate) level: tracing::Level,
    pub(crate) message: String,
    pub(crate) fields: String,
}

/// The events logged on this thread while `f` runs.
pub(crate) fn logged<R>(f: impl FnOnce() -> R) -> (R, Vec<Event>) {
    use tracing_subscriber::layer::{Context, SubscriberExt};

    #[derive(Clone, Default)]
    struct Events(Arc<Mutex<Vec<Event>>>);
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
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Events {
        fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
            let mut w = Words::default();
            event.record(&mut w);
            self.0.lock().push(Event {
                level: *event.metadata().level(),
                message: w.message,
                fields: w.fields,
            });
        }
    }
    let events = Events::default();
    let subscriber = tracing_subscriber::registry().with(events.clone());
    let out = tracing::subscriber::with_default(subscriber, || {
        // A line first met on another thread with no subscriber may have cached itself as
        // never wanted: asked again with this one in place.
        tracing::callsite::rebuild_interest_cache();
        f()
    });
    let seen = events.0.lock().clone();
    (out, seen)
}
