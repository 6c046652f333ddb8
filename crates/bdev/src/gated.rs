//! A bdev whose chosen operations wait for a gate: a device that stalls on command, for
//! tests of what a frontend does while requests do not complete (how many it takes, whether
//! it answers them all once they do). It may also state a discard limit of its own, for
//! tests of what frontends tell their hosts ([`Gated::limit_unmaps`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use basalt_io::DmaBuf;
use tokio::sync::Semaphore;

use crate::bdev::{Bdev, BdevFuture, BdevInfo, Extent};

/// Which operations wait for the gate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// Writes.
    pub writes: bool,
    /// Flushes.
    pub flushes: bool,
    /// Discards.
    pub discards: bool,
}

/// `inner`, with the operations of [`Held`] waiting for a permit of the gate each (closed
/// at first), counted as they start.
pub struct Gated {
    inner: Box<dyn Bdev>,
    held: Held,
    handle: GateHandle,
    /// Its own [`Bdev::unmap_blocks_max`], instead of `inner`'s.
    unmap_blocks_max: Option<Option<u64>>,
}

/// The gate of a [`Gated`] bdev and its count of held operations, for whoever holds the
/// bdev only as a `Box<dyn Bdev>` (a registry's).
#[derive(Clone)]
pub struct GateHandle {
    started: Arc<AtomicU64>,
    gate: Arc<Semaphore>,
}

impl GateHandle {
    /// Held operations started so far (waiting or done).
    pub fn started(&self) -> u64 {
        self.started.load(Ordering::SeqCst)
    }

    /// Lets every held operation through, now and from now on.
    pub fn open(&self) {
        self.gate.add_permits(Semaphore::MAX_PERMITS / 2);
    }
}

impl Gated {
    /// `inner` with `held` waiting behind a closed gate.
    pub fn new(inner: Box<dyn Bdev>, held: Held) -> Self {
        Self {
            inner,
            held,
            handle: GateHandle {
                started: Arc::new(AtomicU64::new(0)),
                gate: Arc::new(Semaphore::new(0)),
            },
            unmap_blocks_max: None,
        }
    }

    /// The same, stating `blocks` as its discard limit whatever `inner`'s.
    pub fn limit_unmaps(self, blocks: Option<u64>) -> Self {
        Self {
            unmap_blocks_max: Some(blocks),
            ..self
        }
    }

    /// Its gate.
    pub fn handle(&self) -> GateHandle {
        self.handle.clone()
    }

    /// Held operations started so far (waiting or done).
    pub fn started(&self) -> u64 {
        self.handle.started()
    }

    /// Lets every held operation through, now and from now on.
    pub fn open(&self) {
        self.handle.open();
    }

    /// `then`'s operation, started (a malloc bdev's takes effect as it is called) once the
    /// gate lets it through if `held`.
    fn hold<'a, T: Send + 'a>(
        &'a self,
        held: bool,
        then: impl FnOnce() -> BdevFuture<'a, T> + Send + 'a,
    ) -> BdevFuture<'a, T> {
        if !held {
            return then();
        }
        self.handle.started.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            // Never closed: a permit always comes once the gate opens.
            let _pass = self.handle.gate.acquire().await;
            then().await
        })
    }
}

impl Bdev for Gated {
    fn info(&self) -> &BdevInfo {
        self.inner.info()
    }

    fn read(&self, extent: Extent) -> BdevFuture<'_, DmaBuf> {
        self.inner.read(extent)
    }

    fn write(&self, extent: Extent, data: DmaBuf, fua: bool) -> BdevFuture<'_, ()> {
        self.hold(self.held.writes, move || {
            self.inner.write(extent, data, fua)
        })
    }

    fn flush(&self) -> BdevFuture<'_, ()> {
        self.hold(self.held.flushes, || self.inner.flush())
    }

    fn volatile_cache(&self) -> bool {
        self.inner.volatile_cache()
    }

    fn unmap_blocks_max(&self) -> Option<u64> {
        self.unmap_blocks_max
            .unwrap_or_else(|| self.inner.unmap_blocks_max())
    }

    fn write_zeroes(&self, extent: Extent, deallocate: bool) -> BdevFuture<'_, ()> {
        self.inner.write_zeroes(extent, deallocate)
    }

    fn discard(&self, extent: Extent) -> BdevFuture<'_, ()> {
        self.hold(self.held.discards, move || self.inner.discard(extent))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::malloc::MallocBdev;

    #[tokio::test]
    async fn held_operations_wait_for_the_gate_and_the_others_do_not() {
        let held = Held {
            writes: true,
            ..Held::default()
        };
        let bdev = Gated::new(Box::new(MallocBdev::new_named("g", 512, 8)), held);
        let extent = bdev.info().data_extent(0, 512).expect("extent");
        let write = bdev.write(extent, DmaBuf::from_slice(&[7; 512]), false);
        assert_eq!(bdev.started(), 1);
        let waited = tokio::time::timeout(std::time::Duration::from_millis(50), write).await;
        assert!(waited.is_err(), "a held write waits for the gate");
        bdev.flush().await.expect("a flush is not held");
        bdev.open();
        bdev.write(extent, DmaBuf::from_slice(&[7; 512]), false)
            .await
            .expect("through once open");
        assert_eq!(&bdev.read(extent).await.expect("read")[..], &[7; 512][..]);
    }
}
