//! Running work that may deadlock: a deadline turns a hang into a failure with a message.

use std::sync::mpsc;
use std::time::Duration;

/// Runs `work` on its own thread and returns its result, or fails the test if it has not
/// finished after `limit` (the thread is left behind: a deadlocked thread cannot be stopped,
/// and the test process exits without it). A panic in `work` is the test's panic.
pub fn within<T: Send + 'static>(
    what: &str,
    limit: Duration,
    work: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (done, finished) = mpsc::channel();
    let worker = std::thread::Builder::new()
        .name(what.to_string())
        .spawn(move || {
            let _ = done.send(work());
        })
        .expect("spawn");
    match finished.recv_timeout(limit) {
        Ok(value) => {
            let _ = worker.join();
            value
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => unreachable!("the worker sends before it ends"),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => panic!(
            "{what}: not finished after {limit:?}: a deadlock (or a hang) between the threads"
        ),
    }
}
