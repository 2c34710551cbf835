//! The few things a user must see, once each, whatever the log filter.

use std::collections::BTreeSet;
use std::sync::{Mutex, PoisonError};

static NOTICES: Mutex<BTreeSet<&'static str>> = Mutex::new(BTreeSet::new());

/// Prints `text` to stderr once per `key` per process, whatever the log filter: for the few
/// things a user must see (no CUDA found, an IPC handle refused).
pub fn notice_once(key: &'static str, text: &str) {
    let first = NOTICES
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(key);
    if first {
        eprintln!("{text}");
    }
    tracing::warn!("{text}");
}
