//! Which driver calls a piece of code made and how long they took, from the debug events
//! stablebuf's driver layer emits for every call (`call` and `micros` fields). Collecting costs a
//! little per call: profile a separate pass, never a timed one.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tracing_subscriber::layer::SubscriberExt;

/// Runs `f` and returns its value with `(call, count, total µs)` for every driver call it made
/// on this thread, in call-name order.
pub fn profile<T>(f: impl FnOnce() -> T) -> (T, Vec<(String, u64, f64)>) {
    let calls = Arc::new(Mutex::new(BTreeMap::<String, (u64, f64)>::new()));
    let subscriber = tracing_subscriber::registry().with(CallTimes(calls.clone()));
    let value = tracing::subscriber::with_default(subscriber, f);
    let calls = calls
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(call, &(count, micros))| (call.clone(), count, micros))
        .collect();
    (value, calls)
}

/// `call xN µs, …` for the calls named in `only` (all when empty).
pub fn summary(calls: &[(String, u64, f64)], only: &[&str]) -> String {
    calls
        .iter()
        .filter(|(call, ..)| only.is_empty() || only.contains(&call.as_str()))
        .map(|(call, count, micros)| format!("{call} x{count} {micros:.0} µs"))
        .collect::<Vec<_>>()
        .join(", ")
}

struct CallTimes(Arc<Mutex<BTreeMap<String, (u64, f64)>>>);

#[derive(Default)]
struct CallFields {
    call: Option<String>,
    micros: Option<f64>,
}

impl tracing::field::Visit for CallFields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "call" {
            self.call = Some(value.to_string());
        }
    }

    fn record_f64(&mut self, field: &tracing::field::Field, value: f64) {
        if field.name() == "micros" {
            self.micros = Some(value);
        }
    }

    fn record_debug(&mut self, _field: &tracing::field::Field, _value: &dyn std::fmt::Debug) {}
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CallTimes {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut fields = CallFields::default();
        event.record(&mut fields);
        if let (Some(call), Some(micros)) = (fields.call, fields.micros) {
            let mut calls = self.0.lock().unwrap_or_else(|p| p.into_inner());
            let entry = calls.entry(call).or_default();
            entry.0 += 1;
            entry.1 += micros;
        }
    }
}
