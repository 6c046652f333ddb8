//! The data bytes that the commands under way on all of a target's NVMe/TCP connections
//! may hold at once (`num_shared_buffers` × `io_unit_size`, SPDK's transport-wide buffer
//! pool). Each I/O command with data takes its length from the budget before it starts
//! (the buffer its write data is gathered in, or its read's data) and gives it back when
//! it ends. A connection whose next command does not fit leaves it unread (and what the
//! host sends after it, in the socket) until other commands give bytes back: many hosts
//! with deep queues of large writes cannot together hold more memory than this.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use tokio::sync::watch;

/// The shared budget.
pub struct DataBudget {
    limit: u64,
    in_use: AtomicU64,
    /// Connections waiting for bytes: a permit given back wakes them only then.
    waiting: AtomicUsize,
    /// Bumped when bytes come back while a connection waits.
    freed: watch::Sender<u64>,
}

/// Bytes taken from a [`DataBudget`], given back when dropped.
pub struct DataPermit {
    budget: Arc<DataBudget>,
    bytes: u64,
}

/// A connection's place among those waiting for bytes, left when dropped.
pub struct Waiting {
    budget: Arc<DataBudget>,
    /// Tells of bytes given back since it was made.
    pub freed: watch::Receiver<u64>,
}

impl DataBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(Self {
            limit,
            in_use: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
            freed: watch::Sender::new(0),
        })
    }

    /// Its size in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes taken now.
    pub fn in_use(&self) -> u64 {
        self.in_use.load(Ordering::SeqCst)
    }

    /// `bytes` of the budget, if that many are free (a request larger than the whole
    /// budget takes it all once it is free, so that it is not refused for good).
    pub fn try_take(self: &Arc<Self>, bytes: u64) -> Option<DataPermit> {
        let bytes = bytes.min(self.limit);
        self.in_use
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |in_use| {
                (in_use + bytes <= self.limit).then_some(in_use + bytes)
            })
            .ok()
            .map(|_| DataPermit {
                budget: self.clone(),
                bytes,
            })
    }

    /// Joins the connections waiting for bytes. The caller then tries again before it
    /// waits on [`Waiting::freed`]: bytes given back after this call wake it, and bytes
    /// given back before it are seen by that try (both sides order their two steps).
    pub fn wait(self: &Arc<Self>) -> Waiting {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        Waiting {
            budget: self.clone(),
            freed: self.freed.subscribe(),
        }
    }
}

impl Drop for DataPermit {
    fn drop(&mut self) {
        let budget = &self.budget;
        budget.in_use.fetch_sub(self.bytes, Ordering::SeqCst);
        if budget.waiting.load(Ordering::SeqCst) > 0 {
            budget
                .freed
                .send_modify(|count| *count = count.wrapping_add(1));
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.budget.waiting.fetch_sub(1, Ordering::SeqCst);
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

    #[tokio::test]
    async fn a_waiting_connection_hears_of_bytes_given_back() {
        let budget = DataBudget::new(10);
        let held = budget.try_take(10).expect("room");
        let mut waiting = budget.wait();
        assert!(budget.try_take(5).is_none());
        drop(held);
        tokio::time::timeout(std::time::Duration::from_secs(1), waiting.freed.changed())
            .await
            .expect("woken")
            .expect("the budget lives");
        assert!(budget.try_take(5).is_some());
    }
}
