//! The `KvStore` trait: batched, zero-copy object operations with per-key results.

use std::time::Duration;

use smallvec::SmallVec;

use super::StoreError;

/// A caller-owned memory region (host now; device memory for stores that can write it).
///
/// Plain address and length: the store never keeps it past a call except between
/// [`KvStore::register`] and [`KvStore::unregister`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemoryRegion {
    /// First byte.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
}

impl std::fmt::Display for MemoryRegion {
    /// `memory 0x<addr>+<len>`: how registration errors, and fault rules on `register` and
    /// `unregister`, name a region (where store errors name a key).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "memory {:#x}+{}", self.addr, self.len)
    }
}

/// One destination range of a ranged read: `len` bytes at byte `offset` of the object go to
/// `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRange {
    /// Destination address.
    pub dst: *mut u8,
    /// Bytes to read.
    pub len: usize,
    /// Byte offset inside the object.
    pub offset: u64,
}

// SAFETY: a ReadRange is an address and two integers; the store only writes through `dst`
// inside an `unsafe` read call, whose caller promises (see `KvStore::get_ranges`) that the
// memory is valid and not accessed by anyone else for the duration of that call, from
// whichever thread performs it.
unsafe impl Send for ReadRange {}
// SAFETY: shared references to a ReadRange only read its fields.
unsafe impl Sync for ReadRange {}

/// A ranged read of one object: several (destination, length, offset) ranges.
#[derive(Debug, Clone)]
pub struct RangedGet<'k> {
    /// The object's key.
    pub key: &'k str,
    /// Ranges of it to read (one per layer read; usually one).
    pub ranges: SmallVec<[ReadRange; 2]>,
}

impl RangedGet<'_> {
    /// Bytes this read asks for.
    pub fn expected(&self) -> u64 {
        self.ranges
            .iter()
            .fold(0, |a: u64, r| a.saturating_add(r.len as u64))
    }
}

/// The checksums a store took of one ranged read's ranges as it wrote them: one entry per
/// range, in request order, each the [`layer_checksum`](kv_geometry::layer_checksum) of the
/// bytes written to that range's destination, or `None` where the store took none (the
/// caller hashes those itself). See [`KvStore::get_ranges_checksummed`].
pub type RangeChecksums = SmallVec<[Option<u64>; 2]>;

/// A whole-object read into `dst` (capacity `len`).
#[derive(Debug, Clone, Copy)]
pub struct ObjectGet<'k> {
    /// The object's key.
    pub key: &'k str,
    /// Destination.
    pub dst: *mut u8,
    /// Capacity of the destination.
    pub len: usize,
}

// SAFETY: as for ReadRange: plain data, written through only inside an unsafe call whose
// contract covers the memory.
unsafe impl Send for ObjectGet<'_> {}
// SAFETY: shared references only read the fields.
unsafe impl Sync for ObjectGet<'_> {}

/// A write of one object, gathered from several source pieces in order.
#[derive(Debug, Clone)]
pub struct ObjectPut<'k> {
    /// The object's key.
    pub key: &'k str,
    /// Source pieces (address, length); the object is their concatenation.
    pub parts: SmallVec<[(*const u8, usize); 4]>,
}

impl ObjectPut<'_> {
    /// Bytes of the object.
    pub fn len(&self) -> u64 {
        self.parts.iter().map(|p| p.1 as u64).sum()
    }

    /// True for an empty object.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: plain data, read through only inside an unsafe call whose contract covers it.
unsafe impl Send for ObjectPut<'_> {}
// SAFETY: shared references only read the fields.
unsafe impl Sync for ObjectPut<'_> {}

/// What a put did to one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// The object was written.
    Written,
    /// The key existed; the store kept the first write (nothing was written).
    AlreadyPresent,
}

/// A pinned set of objects: the store keeps them (no eviction) until the session ends. Long
/// loads hold one and renew it before the lease runs out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadSession {
    /// Keys pinned.
    pub keys: Vec<String>,
    /// How long the pin lasts without renewal (`None`: until ended).
    pub lease: Option<Duration>,
    /// The store's own mark of this session, for stores that track sessions (0 for those
    /// that do not): its end lets go of what this session pinned and nothing else.
    pub token: u64,
}

/// A KV object store, batched and zero-copy: the linker reads layer slices straight into pool
/// memory through it. Results are per key, in request order: a batch can partly fail.
///
/// # Safety contract for buffers
/// The read and write calls take raw addresses (host or, for stores that support it, device
/// memory). They are `unsafe`: the caller promises that for the whole call every destination
/// range is valid for writes of its length and not read or written by anyone else, every
/// source range is valid for reads of its length and not written by anyone else, and the
/// memory is of a kind the store can access (registered with [`KvStore::register`] where the
/// store needs that). Destinations of one call must not overlap. In turn, a store touches
/// none of that memory once the call has returned **or unwound** (a panic inside a store call
/// leaves no work of it running: its threads are joined, its transfers over), with one
/// exception it must say: when any key of a call fails with [`StoreError::Abandoned`], the
/// store gave up on a transfer that may still run, and the caller keeps all of that call's
/// memory for good (never frees, reuses or hands it on).
///
/// Callers above the store layer never make these calls themselves: they go through
/// [`StoreCalls`](super::StoreCalls), whose [`read_targets`](super::StoreCalls::read_targets)
/// and [`put`](super::StoreCalls::put) take typed regions minted by kv-device
/// ([`StageLoan`](kv_device::StageLoan)/[`ReadTarget`](kv_device::ReadTarget),
/// [`SaveSource`](kv_device::SaveSource)), check them, and uphold this contract for them.
///
/// # Safety
/// Those safe wrappers free, reuse or hand on a call's memory on the store's word, so an
/// implementation promises the store's half above: it touches none of a call's memory once
/// the call has returned or unwound, unless a key of that call failed with
/// [`StoreError::Abandoned`]. (Answering `Abandoned` where nothing runs on only costs the
/// caller that memory; any other answer where a transfer may run on is unsound.) A decorator
/// that forwards calls to another store returns the inner results' `Abandoned` as they are:
/// an error it maps or injects must not replace one.
pub unsafe trait KvStore: Send + Sync {
    /// A short name for logs ("embedded", "mooncake").
    fn name(&self) -> &str;

    /// Whether each key is present.
    fn exists(&self, keys: &[&str]) -> Vec<Result<bool, StoreError>>;

    /// Size in bytes of each object.
    fn object_size(&self, keys: &[&str]) -> Vec<Result<u64, StoreError>>;

    /// Reads whole objects; per key, the bytes read.
    ///
    /// # Safety
    /// See the trait's buffer contract.
    unsafe fn get_into(&self, gets: &[ObjectGet<'_>]) -> Vec<Result<u64, StoreError>>;

    /// Reads byte ranges of objects; per key, the bytes read (the sum of its ranges when
    /// whole; less is a short read and the caller must treat it as a failure).
    ///
    /// # Safety
    /// See the trait's buffer contract.
    unsafe fn get_ranges(&self, gets: &[RangedGet<'_>]) -> Vec<Result<u64, StoreError>>;

    /// [`get_ranges`](KvStore::get_ranges), and the checksums of the ranges whose bytes the
    /// store copies itself on their way to the destination (a read staged through its own
    /// memory): `sums[i][j]`, range `j` of `gets[i]`, is set to the
    /// [`layer_checksum`](kv_geometry::layer_checksum) of exactly the bytes written to that
    /// range's destination, read back from it right after the copy (still in cache), so that
    /// a caller checking them need not read them again. Entries of ranges the store does not
    /// copy itself are left as they are; those of a key that fails mean nothing. With `sums`
    /// not one entry per get, none is set; a get whose entry is not one per range gets none.
    ///
    /// The default sets none. A store that changes the bytes after its inner store wrote them
    /// (a fault injector) must not pass on its inner store's sums of the ranges it changed:
    /// it keeps the default, or clears those sums (as `FaultyStore` does for a corrupted
    /// read), so that the caller hashes what landed.
    ///
    /// # Safety
    /// See the trait's buffer contract.
    unsafe fn get_ranges_checksummed(
        &self,
        gets: &[RangedGet<'_>],
        sums: &mut [RangeChecksums],
    ) -> Vec<Result<u64, StoreError>> {
        let _ = sums;
        // SAFETY: the caller's own promise, for the same call.
        unsafe { self.get_ranges(gets) }
    }

    /// Writes objects, first write wins: an existing key is left as it is.
    ///
    /// # Safety
    /// See the trait's buffer contract.
    unsafe fn put(&self, puts: &[ObjectPut<'_>]) -> Vec<Result<PutOutcome, StoreError>>;

    /// Removes objects (a missing key is `NotFound`).
    fn remove(&self, keys: &[&str]) -> Vec<Result<(), StoreError>>;

    /// Removes objects known to be bad (wrong size, failed checksum), so that the next save
    /// writes them again despite first-write-wins: like [`remove`](KvStore::remove), but a
    /// read lease or pin does not keep the object (Mooncake: a forced remove). A missing key
    /// is `NotFound`. No default: a store whose `remove` already ignores pins writes
    /// `discard` as `remove`, and a decorator forwards it (a `remove` standing in for it would
    /// leave a bad object that a read holds in place).
    fn discard(&self, keys: &[&str]) -> Vec<Result<(), StoreError>>;

    /// Registers memory the store will read into or write from (a no-op for stores that do
    /// not need it). Transports that pin memory (RDMA) keep using the region until it is
    /// unregistered.
    ///
    /// # Safety
    /// The region stays allocated (not freed, not unmapped) until
    /// [`unregister`](KvStore::unregister) of it has returned `Ok`, or the store is dropped.
    ///
    /// ```compile_fail,E0133
    /// use mooncake_linker::store::{EmbeddedStore, KvStore, MemoryRegion};
    /// let buf = vec![0u8; 64];
    /// let store = EmbeddedStore::new(1 << 20);
    /// store.register(MemoryRegion { addr: buf.as_ptr() as usize, len: 64 }); // needs `unsafe`
    /// ```
    unsafe fn register(&self, region: MemoryRegion) -> Result<(), StoreError>;

    /// Undoes [`register`](KvStore::register). Safe: a store whose transport uses the
    /// region waits (bounded) until none of its calls is in flight before it lets go. A
    /// region that is not registered is `Ok` (nothing to undo). On `Err` the region stays
    /// registered: keep its memory allocated (leak it rather than free it).
    fn unregister(&self, region: MemoryRegion) -> Result<(), StoreError>;

    /// Pins objects for a multi-step read (renew by calling again before the lease ends). A
    /// key that is absent fails the call (`NotFound` for it) and nothing is pinned, as
    /// Mooncake's session start does.
    fn start_session(&self, keys: &[&str]) -> Result<ReadSession, StoreError>;

    /// Releases a pin.
    fn end_session(&self, session: &ReadSession) -> Result<(), StoreError>;

    /// Whether the store answers.
    fn health(&self) -> Result<(), StoreError>;
}
