//! The extension's allocator: the system's, with every large block marked for transparent huge
//! pages (`madvise(MADV_HUGEPAGE)` on its 2 MiB-aligned interior, Linux only).
//!
//! A long simulation's prefix pools hold about a million entries in a slab and a hash index
//! (some 80 MB, beyond the last-level cache), and their LRU order is a random walk over that
//! memory once evictions have reused slots for a while. Each eviction and insertion is then a
//! chain of dependent loads, most of them missing the TLB as well as the cache with 4 KiB pages.
//! With 2 MiB pages the whole working set fits the TLB and each miss costs one memory access,
//! not a page walk and then one. Kernels set to `madvise` (Debian's default) give huge pages
//! only where asked; where THP is off or unavailable the hint is refused and nothing changes.
//! Only the page size changes: every block is the system allocator's own.

use std::alloc::{GlobalAlloc, Layout, System};

/// Blocks from this size on are marked (a smaller one holds at most one huge page's worth of
/// interior, and the hint costs a system call).
const MARK_FROM: usize = 4 << 20;
#[cfg(target_os = "linux")]
const HUGE_PAGE: usize = 2 << 20;

pub struct HugePages;

#[cfg(target_os = "linux")]
fn mark(ptr: *mut u8, size: usize) {
    if ptr.is_null() || size < MARK_FROM {
        return;
    }
    let start = (ptr as usize).next_multiple_of(HUGE_PAGE);
    let end = (ptr as usize + size) & !(HUGE_PAGE - 1);
    if end > start {
        // A hint: an error (THP disabled, an old kernel) leaves the block as it was.
        // SAFETY: [start, end) lies inside the block just allocated, which this process owns.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn mark(_ptr: *mut u8, _size: usize) {}

// SAFETY: every call is the system allocator's, with the same arguments; `mark` only advises the
// kernel on pages of the block returned.
unsafe impl GlobalAlloc for HugePages {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        mark(p, layout.size());
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        mark(p, layout.size());
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        mark(p, new_size);
        p
    }
}
