//! A heap buffer aligned to [`DMA_ALIGN`] bytes, as O_DIRECT requires of memory.
#![allow(unsafe_code)]

use std::alloc::{Layout, alloc, alloc_zeroed, dealloc};
use std::cell::RefCell;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment of every [`DmaBuf`]: a page, which satisfies any logical block size.
pub const DMA_ALIGN: usize = 4096;

/// Capacities up to this many pages are kept for reuse when freed.
const CACHED_PAGES_MAX: usize = 32;
/// Bytes of freed buffers of one capacity that a thread keeps (at least one buffer): 64
/// buffers of 4 KiB, at most 8 MiB over all capacities.
const CACHED_BYTES_PER_CAPACITY: usize = 256 << 10;

/// Freed buffers of each capacity up to [`CACHED_PAGES_MAX`] pages (index: pages - 1),
/// kept by the thread that freed them for its next buffers of that capacity: a page-aligned
/// allocation and free cost the allocator more than the 4 KiB copy they carry (about 9% of
/// the NVMe/TCP target's CPU samples at QD32 writes went to malloc and free).
struct Cache {
    free: [Vec<NonNull<u8>>; CACHED_PAGES_MAX],
}

impl Cache {
    /// The index of `capacity` in [`Cache::free`], if buffers of it are kept.
    fn class_of(capacity: usize) -> Option<usize> {
        (capacity / DMA_ALIGN)
            .checked_sub(1)
            .filter(|&index| index < CACHED_PAGES_MAX)
    }

    /// A kept allocation of `capacity` bytes, if any.
    fn take(capacity: usize) -> Option<NonNull<u8>> {
        let index = Self::class_of(capacity)?;
        CACHE
            .try_with(|cache| cache.borrow_mut().free[index].pop())
            .ok()
            .flatten()
    }

    /// Keeps `ptr` (an allocation of `capacity` bytes) for reuse, or gives it back when
    /// this thread keeps enough of that capacity (or is exiting).
    fn keep(ptr: NonNull<u8>, capacity: usize) -> Result<(), NonNull<u8>> {
        let Some(index) = Self::class_of(capacity) else {
            return Err(ptr);
        };
        let limit = (CACHED_BYTES_PER_CAPACITY / capacity).max(1);
        CACHE
            .try_with(|cache| {
                let free = &mut cache.borrow_mut().free[index];
                if free.len() < limit {
                    free.push(ptr);
                    Ok(())
                } else {
                    Err(ptr)
                }
            })
            .unwrap_or(Err(ptr))
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        for (index, free) in self.free.iter_mut().enumerate() {
            let layout = DmaBuf::layout((index + 1) * DMA_ALIGN);
            for ptr in free.drain(..) {
                // SAFETY: every kept pointer was allocated with the layout of its capacity
                // class and is owned by the cache alone.
                unsafe { dealloc(ptr.as_ptr(), layout) }
            }
        }
    }
}

thread_local! {
    static CACHE: RefCell<Cache> = RefCell::new(Cache {
        free: std::array::from_fn(|_| Vec::new()),
    });
}

/// An owned, zero-initialised byte buffer whose start is aligned to [`DMA_ALIGN`].
pub struct DmaBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
}

// SAFETY: DmaBuf owns its allocation uniquely, like a Vec<u8>; nothing else aliases it.
unsafe impl Send for DmaBuf {}
// SAFETY: shared references only give out &[u8], which is Sync for u8.
unsafe impl Sync for DmaBuf {}

impl DmaBuf {
    /// A zeroed buffer of `len` bytes.
    pub fn zeroed(len: usize) -> Self {
        let capacity = len.max(1).next_multiple_of(DMA_ALIGN);
        if let Some(ptr) = Cache::take(capacity) {
            // SAFETY: a kept allocation holds `capacity` bytes owned by nobody else.
            unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, capacity) };
            return Self { ptr, len, capacity };
        }
        let layout = Self::layout(capacity);
        // SAFETY: the layout has a non-zero size (capacity >= DMA_ALIGN).
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self { ptr, len, capacity }
    }

    /// A buffer holding a copy of `data` (its bytes are written once: no zeroing first).
    pub fn from_slice(data: &[u8]) -> Self {
        let capacity = data.len().max(1).next_multiple_of(DMA_ALIGN);
        let ptr = Cache::take(capacity).unwrap_or_else(|| {
            let layout = Self::layout(capacity);
            // SAFETY: the layout has a non-zero size (capacity >= DMA_ALIGN).
            let raw = unsafe { alloc(layout) };
            NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout))
        });
        // SAFETY: the allocation holds capacity >= data.len() bytes and cannot overlap data;
        // the bytes past data.len() up to capacity are zeroed so that every byte is
        // initialised, as the zeroed constructor guarantees.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), ptr.as_ptr(), data.len());
            std::ptr::write_bytes(ptr.as_ptr().add(data.len()), 0, capacity - data.len());
        }
        Self {
            ptr,
            len: data.len(),
            capacity,
        }
    }

    /// Shortens the buffer to `len` bytes; the allocation is kept.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    fn layout(capacity: usize) -> Layout {
        Layout::from_size_align(capacity, DMA_ALIGN).expect("capacity is a multiple of a page")
    }
}

impl Deref for DmaBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for capacity >= len initialised (zeroed) bytes, owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for DmaBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self guarantees unique access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        if let Err(ptr) = Cache::keep(self.ptr, self.capacity) {
            // SAFETY: ptr was allocated with exactly this layout and is freed once.
            unsafe { dealloc(ptr.as_ptr(), Self::layout(self.capacity)) }
        }
    }
}

impl std::fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaBuf").field("len", &self.len).finish()
    }
}

impl Clone for DmaBuf {
    fn clone(&self) -> Self {
        Self::from_slice(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_zeroed() {
        for len in [0, 1, 511, 4096, 4097, 1 << 20] {
            let buf = DmaBuf::zeroed(len);
            assert_eq!(buf.as_ptr() as usize % DMA_ALIGN, 0, "len {len}");
            assert_eq!(buf.len(), len);
            assert!(buf.iter().all(|b| *b == 0));
        }
    }

    /// A freed buffer is reused for the next of its capacity on the same thread, and comes
    /// back zeroed or holding exactly the copied bytes; other capacities are not mixed up.
    #[test]
    fn freed_buffers_are_reused_clean() {
        let mut first = DmaBuf::zeroed(4096);
        first.fill(0xa5);
        let address = first.as_ptr() as usize;
        drop(first);
        let again = DmaBuf::zeroed(4000);
        assert_eq!(
            again.as_ptr() as usize,
            address,
            "the freed page is taken again"
        );
        assert!(again.iter().all(|b| *b == 0));
        assert_eq!(again.len(), 4000);
        drop(again);
        let mut copied = DmaBuf::from_slice(&[7u8; 100]);
        assert_eq!(copied.as_ptr() as usize, address);
        assert_eq!(&copied[..], &[7u8; 100][..]);
        copied.fill(0x5a);
        drop(copied);
        // A freed page is not handed out for another capacity.
        let mut larger = DmaBuf::zeroed(8192);
        assert_ne!(larger.as_ptr() as usize, address);
        assert!(larger.iter().all(|b| *b == 0));
        larger.fill(0x3c);
        drop(larger);
        let again = DmaBuf::zeroed(8192);
        assert!(
            again.iter().all(|b| *b == 0),
            "a reused 8 KiB buffer is zeroed"
        );
        // Beyond the cached sizes, and buffers freed on another thread than their own
        // (kept there, up to the limit), still work.
        let huge = DmaBuf::zeroed((CACHED_PAGES_MAX + 1) * DMA_ALIGN);
        let mut page = DmaBuf::zeroed(4096);
        page.fill(9);
        let moved = std::thread::spawn(move || {
            drop(huge);
            let address = page.as_ptr() as usize;
            drop(page);
            let reused = DmaBuf::zeroed(4096);
            let same = reused.as_ptr() as usize == address;
            let mut kept: Vec<DmaBuf> = (0..300).map(|_| DmaBuf::zeroed(4096)).collect();
            kept.iter_mut().for_each(|buf| buf.fill(1));
            drop(kept);
            same && reused.iter().all(|b| *b == 0) && DmaBuf::zeroed(4096).iter().all(|b| *b == 0)
        });
        assert!(moved.join().expect("thread"));
    }

    #[test]
    fn copies_and_truncates() {
        let mut buf = DmaBuf::from_slice(b"hello world");
        assert_eq!(&buf[..], b"hello world");
        buf.truncate(5);
        assert_eq!(&buf.clone()[..], b"hello");
        buf[0] = b'j';
        assert_eq!(&buf[..], b"jello");
    }
}
