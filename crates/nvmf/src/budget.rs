//! The data bytes that the I/O commands under way on all of a target's NVMe/TCP
//! connections may hold at once: `num_shared_buffers` × `io_unit_size`, after SPDK's
//! transport-wide buffer pool, counted in bytes (a 4 KiB command takes 4 KiB, not a whole
//! buffer). Each I/O command with data takes its length before it starts (the buffer its
//! write data is gathered in, or its read's data until the connection copies it into its
//! output, which is bounded per connection) and gives it back when it ends. A connection
//! whose next command does not fit parks it, with the commands after it, until the bytes
//! come: many hosts with deep queues of large writes cannot together hold more memory
//! than this. Waiters are served in order (a fair semaphore): a large command is not
//! starved by small ones, and a release wakes only the waiter it serves.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes taken from a [`DataBudget`], given back when dropped.
pub type DataPermit = OwnedSemaphorePermit;

/// A wait for bytes of a [`DataBudget`], in its turn.
pub type DataWait = Pin<Box<dyn Future<Output = DataPermit> + Send>>;

/// The shared budget.
pub struct DataBudget {
    limit: u32,
    bytes: Arc<Semaphore>,
    /// Commands parked on every connection ([`Parked`]).
    parked: AtomicU64,
}

impl DataBudget {
    /// A budget of `limit` bytes (at most 4 GiB - 1).
    pub fn new(limit: u64) -> Arc<Self> {
        let limit = u32::try_from(limit).unwrap_or(u32::MAX);
        Arc::new(Self {
            limit,
            bytes: Arc::new(Semaphore::new(limit as usize)),
            parked: AtomicU64::new(0),
        })
    }

    /// Commands that every connection holds parked until bytes come back.
    pub fn parked(&self) -> u64 {
        self.parked.load(Ordering::Relaxed)
    }

    /// Its size in bytes.
    pub fn limit(&self) -> u64 {
        u64::from(self.limit)
    }

    /// Bytes taken now.
    pub fn in_use(&self) -> u64 {
        u64::from(self.limit) - self.bytes.available_permits() as u64
    }

    /// `bytes` of the budget now, if that many are free and nobody waits before (a
    /// request larger than the whole budget takes all of it).
    pub fn try_take(&self, bytes: u32) -> Option<DataPermit> {
        self.bytes
            .clone()
            .try_acquire_many_owned(bytes.min(self.limit))
            .ok()
    }

    /// `bytes` of the budget, once they are free and the waits before this one are
    /// served.
    pub fn take(&self, bytes: u32) -> DataWait {
        let bytes_wanted = bytes.min(self.limit);
        let semaphore = self.bytes.clone();
        Box::pin(async move {
            semaphore
                .acquire_many_owned(bytes_wanted)
                .await
                .expect("the budget's semaphore is never closed")
        })
    }
}

/// The commands one connection parked while the first of them waits for bytes of the
/// budget, in order; counted in the budget's [`DataBudget::parked`] until they start or
/// the queue goes.
pub struct Parked<T> {
    queue: VecDeque<T>,
    budget: Arc<DataBudget>,
}

impl<T> Parked<T> {
    /// An empty queue counted in `budget`.
    pub fn new(budget: Arc<DataBudget>) -> Self {
        Self {
            queue: VecDeque::new(),
            budget,
        }
    }

    /// Parks `command` last.
    pub fn push_back(&mut self, command: T) {
        self.budget.parked.fetch_add(1, Ordering::Relaxed);
        self.queue.push_back(command);
    }

    /// The first parked command, taken off to start.
    pub fn pop_front(&mut self) -> Option<T> {
        let command = self.queue.pop_front();
        if command.is_some() {
            self.budget.parked.fetch_sub(1, Ordering::Relaxed);
        }
        command
    }

    /// The first parked command.
    pub fn front(&self) -> Option<&T> {
        self.queue.front()
    }

    /// How many are parked.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether none is parked.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Gives up every parked command.
    pub fn clear(&mut self) {
        let count = self.queue.len() as u64;
        self.budget.parked.fetch_sub(count, Ordering::Relaxed);
        self.queue.clear();
    }
}

impl<T> Drop for Parked<T> {
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_take_and_give_back_bytes() {
        let budget = DataBudget::new(100);
        let a = budget.try_take(60).expect("room");
        assert!(budget.try_take(50).is_none(), "past the limit");
        let b = budget.try_take(40).expect("room");
        assert_eq!(budget.in_use(), 100);
        drop(a);
        assert_eq!(budget.in_use(), 40);
        assert!(
            budget.try_take(1000).is_none(),
            "the whole budget, once free"
        );
        drop(b);
        let all = budget.try_take(1000).expect("the whole budget");
        assert_eq!(budget.in_use(), 100);
        drop(all);
        assert_eq!(budget.in_use(), 0);
    }

    #[test]
    fn parked_commands_are_counted_until_they_start_or_their_queue_goes() {
        let budget = DataBudget::new(100);
        let mut first = Parked::new(budget.clone());
        let mut second = Parked::new(budget.clone());
        first.push_back(1);
        first.push_back(2);
        second.push_back(3);
        assert_eq!(budget.parked(), 3);
        assert_eq!(first.pop_front(), Some(1));
        assert_eq!(budget.parked(), 2);
        second.clear();
        assert_eq!(budget.parked(), 1);
        drop(first);
        assert_eq!(budget.parked(), 0);
        assert_eq!(second.pop_front(), None);
        assert_eq!(budget.parked(), 0);
    }

    /// A waiter is served before later takers: bytes given back go to it first, even
    /// when a smaller request would fit.
    #[tokio::test]
    async fn waiters_are_served_in_order() {
        let budget = DataBudget::new(10);
        let held = budget.try_take(8).expect("room");
        let mut large = budget.take(6);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(large.as_mut().poll(&mut cx).is_pending(), "6 of 2 free");
        assert!(budget.try_take(2).is_none(), "the waiter comes first");
        drop(held);
        let permit = tokio::time::timeout(std::time::Duration::from_secs(1), large)
            .await
            .expect("served once the bytes are back");
        assert_eq!(permit.num_permits(), 6);
        assert!(budget.try_take(4).is_some());
    }
}
