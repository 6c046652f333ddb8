//! A heap buffer aligned to [`DMA_ALIGN`] bytes, as O_DIRECT requires of memory.
#![allow(unsafe_code)]

use std::alloc::{Layout, alloc, alloc_zeroed, dealloc};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment of every [`DmaBuf`]: a page, which satisfies any logical block size.
pub const DMA_ALIGN: usize = 4096;

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
        let layout = Self::layout(capacity);
        // SAFETY: the layout has a non-zero size (capacity >= DMA_ALIGN).
        let raw = unsafe { alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
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
        // SAFETY: ptr was allocated with exactly this layout and is freed once.
        unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.capacity)) }
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
