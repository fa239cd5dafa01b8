//! Zeroed host byte buffers sized by a batch, allocated fallibly.

/// A zeroed buffer of `len` bytes, `None` when the allocator cannot give it.
///
/// Zeroed by the allocator (`calloc`: large areas come from the kernel already zero), as
/// `vec![0; len]` is, but fallible: `vec!` aborts the process when the allocation fails
/// (`try_reserve` then `resize` would write every byte). For buffers a batch sizes (a
/// layer's rows, a save chunk's objects: hundreds of MB for long prompts).
///
/// ```
/// let buf = kv_device::zeroed_bytes(1 << 20).unwrap();
/// assert!(buf.len() == 1 << 20 && buf.iter().all(|&b| b == 0));
/// assert!(kv_device::zeroed_bytes(usize::MAX).is_none());
/// ```
pub fn zeroed_bytes(len: usize) -> Option<Vec<u8>> {
    if len == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len).ok()?;
    // SAFETY: `layout` has a non-zero size (`len > 0`), as `alloc_zeroed` requires.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` comes from the global allocator with `layout` (alignment 1, size `len`),
    // which is the layout of a `Vec<u8>` of capacity `len`; its `len` bytes are initialised
    // (zeroed), and the `Vec` is their only owner from here on.
    Some(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_past_what_can_be_allocated_are_none_not_an_abort() {
        assert_eq!(zeroed_bytes(0), Some(Vec::new()));
        assert_eq!(zeroed_bytes(3), Some(vec![0, 0, 0]));
        assert!(zeroed_bytes(isize::MAX as usize + 1).is_none());
        // A layout that fits `isize` but no machine's memory.
        assert!(zeroed_bytes(isize::MAX as usize).is_none());
    }
}
