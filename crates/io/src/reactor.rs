//! Reactors: a fixed set of threads, each running its own single-threaded tokio runtime and
//! owning the connections handed to it.
//!
//! A connection served by one reactor stays on one thread: a request that arrives wakes
//! exactly that thread, and nothing is stolen by or handed to another worker. On a small
//! machine this is what keeps a queue-depth-1 round trip to one wake-up. New connections
//! go to the reactors in turn (round robin).

use std::future::Future;
use std::io;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// The most reactor threads a process may start.
pub const REACTOR_COUNT_MAX: usize = 256;

/// A set of reactor threads.
pub struct Reactors {
    handles: Vec<Handle>,
    next: AtomicUsize,
    threads: Mutex<Vec<(oneshot::Sender<()>, JoinHandle<()>)>>,
}

impl Reactors {
    /// Starts `count` reactors (1 to [`REACTOR_COUNT_MAX`]) named `name-N`.
    pub fn start(count: usize, name: &str) -> io::Result<Self> {
        if count == 0 || count > REACTOR_COUNT_MAX {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("reactor count {count} is not in 1..={REACTOR_COUNT_MAX}"),
            ));
        }
        let mut handles = Vec::with_capacity(count);
        let mut threads = Vec::with_capacity(count);
        for index in 0..count {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            handles.push(runtime.handle().clone());
            let (stop, stopped) = oneshot::channel::<()>();
            let thread = std::thread::Builder::new()
                .name(format!("{name}-{index}"))
                .spawn(move || {
                    // Tasks spawned through the handle run while this thread drives the runtime.
                    runtime.block_on(async move {
                        let _ = stopped.await;
                    });
                })?;
            threads.push((stop, thread));
        }
        Ok(Self {
            handles,
            next: AtomicUsize::new(0),
            threads: Mutex::new(threads),
        })
    }

    /// Number of reactors.
    pub fn count(&self) -> usize {
        self.handles.len()
    }

    /// Runs `task` on the next reactor in turn.
    pub fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let index = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        self.handles[index].spawn(task);
    }
}

impl Drop for Reactors {
    fn drop(&mut self) {
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for (stop, thread) in threads {
            let _ = stop.send(());
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::sync::Arc;

    #[test]
    fn tasks_go_round_robin_to_named_threads() {
        let reactors = Reactors::start(2, "test-reactor").expect("start");
        let (names, seen) = std::sync::mpsc::channel();
        for _ in 0..4 {
            let names = names.clone();
            reactors.spawn(async move {
                let name = std::thread::current()
                    .name()
                    .unwrap_or_default()
                    .to_string();
                names.send(name).expect("send");
            });
        }
        let seen: BTreeSet<String> = (0..4).map(|_| seen.recv().expect("recv")).collect();
        let expected: BTreeSet<String> = ["test-reactor-0", "test-reactor-1"]
            .map(String::from)
            .into();
        assert_eq!(seen, expected);
    }

    #[test]
    fn reactor_count_is_checked() {
        assert!(Reactors::start(0, "r").is_err());
        assert!(Reactors::start(REACTOR_COUNT_MAX + 1, "r").is_err());
    }

    #[test]
    fn drop_stops_the_threads() {
        let reactors = Arc::new(Reactors::start(1, "r").expect("start"));
        drop(reactors);
    }
}
