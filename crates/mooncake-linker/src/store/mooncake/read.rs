//! The ranged read path of [`MooncakeStore`]: keys split into concurrent streams, each key's
//! ranges shaped (merged, and staged through scratch where they continue in the object only),
//! then the wheel's ranged call, then the copies out of scratch.

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::ScopedJoinHandle;

use std::time::Duration;

use mooncake_sys::{CKeys, Client, KeyResult as WheelResult, MooncakeError, Range};
use parking_lot::Mutex;

use super::gate::{gate_held, TransferGate};
use super::parts::run_parts;
use super::ranges::{partition, scratch_calls, shape, Shaped, Target};
use super::store::{not_read, store_error, wheel_read, MooncakeStore, WAITS_FOR_EVERY_TRANSFER};
use crate::log_every::LogEvery;
use crate::store::{RangeChecksums, RangedGet, StoreError};

/// Below this many bytes per stream a ranged read is not split (thread start-up and the
/// wheel's per-call work would cost more than the overlap gains).
const MIN_STREAM_BYTES: u64 = 4 << 20;

/// Most scratch one wheel call stages through; a part needing more is read in several
/// sequential calls, and a single key needing more is read without staging.
const SCRATCH_BYTES: u64 = 32 << 20;

/// Scratch areas kept for reuse (one per concurrent stream is what a store needs at most).
const KEPT_SCRATCH: usize = super::MAX_READ_STREAMS;

type KeyResult = Result<u64, StoreError>;

/// One key's read: its result, and the checksums of its ranges taken as they were copied out
/// of scratch (one entry per range when asked for and the key was read; else empty).
type KeyRead = (KeyResult, RangeChecksums);

/// A wheel call that returned: its results, and the scratch its keys' copies come out of.
struct ReadCall<'g> {
    results: Vec<KeyResult>,
    scratch: Vec<u8>,
    /// Each key's offset in `scratch`.
    key_scratch: Vec<u64>,
    shaped: &'g [Shaped],
    /// Each key's number of ranges, when their checksums are to be taken in the copies out.
    ranges_to_hash: Option<Vec<usize>>,
    /// The keys, in call order.
    keys: Vec<&'g str>,
    /// The client gave up on some transfer of the call that may still run: the scratch is
    /// kept for good, not reused.
    abandoned: bool,
    /// Why the stream's later calls are not tried (see [`gives_up`]), if they are not.
    given_up: Option<String>,
}

// SAFETY: the copy targets inside `shaped` are caller memory that `get_ranges`'s contract
// makes ours to write, from any thread, until it returns; the copy-out thread is scoped
// inside that call and joined before it returns.
unsafe impl Send for ReadCall<'_> {}

impl<'g> ReadCall<'g> {
    /// A call not made: every key of `keys` failed with `error(key)`, no scratch taken; the
    /// stream's later calls given up for `given_up`, if any.
    fn not_made(
        keys: Vec<&'g str>,
        shaped: &'g [Shaped],
        error: impl Fn(&str) -> StoreError,
        given_up: Option<String>,
    ) -> Self {
        ReadCall {
            results: keys.iter().map(|k| Err(error(k))).collect(),
            scratch: Vec::new(),
            // One entry per key, as `copy_out` pairs them (every key failed).
            key_scratch: vec![0; keys.len()],
            shaped,
            ranges_to_hash: None,
            keys,
            abandoned: false,
            given_up,
        }
    }
}

impl ReadCall<'_> {
    /// True when no key of the call has anything to copy out of scratch.
    fn copies_nothing(&self) -> bool {
        self.shaped.iter().all(|s| s.copies.is_empty())
    }
}

/// Every key of `part` failed because a helper thread panicked; a key an earlier call of the
/// part left abandoned (marked in `abandoned`, indexed as `gets`) stays `Abandoned`, so that
/// its memory is kept.
fn panicked(gets: &[RangedGet<'_>], part: &[usize], abandoned: &[AtomicBool]) -> Vec<KeyRead> {
    part.iter()
        .map(|&i| {
            let key = gets[i].key.to_owned();
            let e = if abandoned.get(i).is_some_and(|a| a.load(Ordering::Acquire)) {
                StoreError::Abandoned {
                    key,
                    call: "get_ranges",
                    detail: "a transfer the client gave up on may still run (a later call of \
                             the same read stream panicked)"
                        .into(),
                }
            } else {
                StoreError::Panicked {
                    key,
                    call: "get_ranges",
                }
            };
            (Err(e), RangeChecksums::new())
        })
        .collect()
}

/// A call's scratch area as raw bytes. A transfer the client gave up on may still write some
/// keys' shares of it, so no reference covers the whole area: only a key's own share, once
/// its read returned, is borrowed ([`share`](Self::share)).
#[derive(Debug, Clone, Copy)]
struct ScratchArea {
    base: *const u8,
    len: usize,
}

impl ScratchArea {
    /// The area of `scratch`'s buffer (no reference to its bytes is made: `Vec::as_ptr`, not
    /// a slice's, which a `&[u8]` argument would be).
    #[allow(clippy::ptr_arg)]
    fn of(scratch: &Vec<u8>) -> Self {
        ScratchArea {
            base: scratch.as_ptr(),
            len: scratch.len(),
        }
    }

    /// Bytes `at..at + len` of the area; `None` when they do not lie in it.
    ///
    /// # Safety
    /// The area is allocated, and those bytes are written by no one while the slice lives.
    unsafe fn share<'a>(&self, at: u64, len: u64) -> Option<&'a [u8]> {
        let at = usize::try_from(at).ok()?;
        let len = usize::try_from(len).ok()?;
        if at.checked_add(len)? > self.len {
            return None;
        }
        // SAFETY: `at + len <= self.len`, inside the allocated area; nobody writes those
        // bytes meanwhile (the caller's promise).
        Some(unsafe { std::slice::from_raw_parts(self.base.add(at), len) })
    }
}

/// The copies out of `scratch` of one key shaped as `s` (its share starting at `start`), and
/// with `ranges` (its number of ranges), the checksum of each staged range, taken of the bytes
/// at its destination right after its copy wrote them (still in cache): exactly what landed.
/// `scratch[start..start + s.scratch]` is what the call read for the key (its share); `None`
/// when a copy's source does not lie in that share (not what `shape` makes): the key must then
/// fail, its rows not all written.
///
/// # Safety
/// Every copy's destination is caller memory valid for writes of its length, written by no
/// one else until the `get_ranges` call this runs in returns (KvStore's buffer contract; the
/// copy runs before it returns), host memory (a staged read only happens over TCP). The key's
/// share of `scratch` is allocated and written by no one while this runs (its read returned).
unsafe fn copy_key(
    scratch: ScratchArea,
    start: u64,
    s: &Shaped,
    ranges: Option<usize>,
) -> Option<RangeChecksums> {
    let mut taken = RangeChecksums::new();
    if let Some(n) = ranges {
        taken.resize(n, None);
    }
    // The key's own share of the scratch: a copy reaching past it would read another key's
    // bytes (or stale ones).
    // SAFETY: this function's own contract for the key's share.
    let share = unsafe { scratch.share(start, s.scratch) }?;
    let mut staged = s.staged.iter().peekable();
    for (i, c) in s.copies.iter().enumerate() {
        let from = usize::try_from(c.from).ok();
        let Some(src) = from
            .and_then(|f| share.get(f..))
            .and_then(|b| b.get(..c.len))
        else {
            // Not what `shape` makes: nothing is copied from outside the scratch, and the key
            // fails rather than leave a row unwritten.
            return None;
        };
        // SAFETY: `src` is `c.len` bytes of the store's scratch; the destination is part of a
        // caller range (valid for writes, untouched by others: the function's contract), and
        // the two cannot overlap (scratch is the store's).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), c.to, c.len) };
        if ranges.is_none() {
            continue;
        }
        // The staged ranges this copy moved (listed in copy order by `shape`).
        while let Some(st) = staged.next_if(|st| st.copy == i) {
            // A range not inside its copy (not what `shape` makes) gets no checksum: the
            // check hashes its row itself.
            let Some(off) = st
                .offset_in(c)
                .filter(|off| off.checked_add(st.len).is_some_and(|end| end <= c.len))
            else {
                continue;
            };
            // SAFETY: the range lies inside this copy's destination (checked just above),
            // which the copy has just written and which no one else touches until the call
            // returns (the function's contract): reading it back is sound.
            let landed = unsafe { std::slice::from_raw_parts(c.to.add(off), st.len) };
            if let Some(slot) = taken.get_mut(st.index) {
                *slot = Some(kv_geometry::layer_checksum(landed));
            }
        }
    }
    Some(taken)
}

/// The wheel's ranged call, as the read path makes it: the client's, or a test's fake.
pub(super) trait RangedCall: Sync {
    /// One `batch_get_into_multi_buffer_ranges`: `counts[k]` ranges of `ranges` per key of
    /// `keys`, in order; per key, the bytes read or the wheel's code.
    ///
    /// # Safety
    /// As [`Client::batch_get_ranges_raw`]: every `ranges[j].dst` is valid for writes of its
    /// size, not accessed by anything else during the call, and registered where needed.
    unsafe fn ranged(
        &self,
        keys: &CKeys,
        counts: &[usize],
        ranges: &[Range],
    ) -> Result<Vec<WheelResult<u64>>, MooncakeError>;
}

impl RangedCall for Client {
    unsafe fn ranged(
        &self,
        keys: &CKeys,
        counts: &[usize],
        ranges: &[Range],
    ) -> Result<Vec<WheelResult<u64>>, MooncakeError> {
        // SAFETY: the caller's promise, for the same call.
        unsafe { self.batch_get_ranges_raw(keys, counts, ranges) }
    }
}

/// What one ranged read runs with: the wheel's call, the store's transfer gate and scratch
/// areas, and its settings.
pub(super) struct ReadPath<'s, W: ?Sized> {
    pub(super) wheel: &'s W,
    pub(super) transfers: &'s TransferGate,
    pub(super) scratch: &'s Mutex<Vec<Vec<u8>>>,
    /// Concurrent wheel calls at most (`MooncakeConfig::read_streams`).
    pub(super) streams: usize,
    /// Ranges that continue in the object only are staged through scratch.
    pub(super) stage: bool,
    /// A failed transfer of a call that took this long may still run (the client gave up on
    /// it): [`WAITS_FOR_EVERY_TRANSFER`] for the wheel (its ranged reads wait for each
    /// transfer, however long).
    pub(super) gives_up_after: Duration,
    /// The store's limiter of lines about calls that failed whole.
    pub(super) failures: &'s LogEvery,
    /// Tests only: every copy-out panics (a fault outside the wheel's call).
    #[cfg(test)]
    pub(super) copy_out_panics: bool,
}

impl MooncakeStore {
    /// The read path over this store's client, gate and scratch.
    fn read_path(&self) -> ReadPath<'_, Client> {
        ReadPath {
            wheel: &self.client,
            transfers: &self.transfers,
            scratch: &self.scratch,
            streams: self.config.read_streams_count(),
            stage: self.config.staged_merge_enabled(),
            gives_up_after: WAITS_FOR_EVERY_TRANSFER,
            failures: &self.call_failures,
            #[cfg(test)]
            copy_out_panics: false,
        }
    }

    /// See [`ReadPath::read_streamed`].
    pub(super) fn read_streamed(
        &self,
        gets: &[RangedGet<'_>],
        readable: &[usize],
        out: &mut [KeyResult],
        sums: &mut [RangeChecksums],
    ) {
        self.read_path().read_streamed(gets, readable, out, sums);
    }
}

impl<W: RangedCall + ?Sized> ReadPath<'_, W> {
    /// Reads `gets[i]` for every `i` in `readable` (keys in a session, valid arguments) into
    /// `out[i]`, split into up to `read_streams` concurrent calls by bytes; with `sums` shaped
    /// as `gets`, sets the checksums of the ranges staged through scratch there (see
    /// [`KvStore::get_ranges_checksummed`](crate::store::KvStore::get_ranges_checksummed)).
    pub(super) fn read_streamed(
        &self,
        gets: &[RangedGet<'_>],
        readable: &[usize],
        out: &mut [KeyResult],
        sums: &mut [RangeChecksums],
    ) {
        let hash = sums.len() == gets.len();
        // Keys a call left abandoned, marked as soon as it returns: a later panic of the same
        // stream must not report them as merely failed.
        let abandoned: Vec<AtomicBool> = gets.iter().map(|_| AtomicBool::new(false)).collect();
        let abandoned = &abandoned[..];
        let bytes: Vec<u64> = readable.iter().map(|&i| gets[i].expected()).collect();
        let parts: Vec<&[usize]> = partition(&bytes, self.streams, MIN_STREAM_BYTES)
            .into_iter()
            .map(|p| &readable[p])
            .collect();
        let results = run_parts(
            "read-stream",
            &parts,
            |part| self.read_part(gets, part, hash, abandoned),
            |part| panicked(gets, part, abandoned),
        );
        for (&i, (r, taken)) in readable.iter().zip(results.into_iter().flatten()) {
            out[i] = r;
            if let Some(dst) = sums.get_mut(i).filter(|d| d.len() == taken.len()) {
                for (d, t) in dst.iter_mut().zip(taken) {
                    if t.is_some() {
                        *d = t;
                    }
                }
            }
        }
    }

    /// The gets of one stream, in calls of at most [`SCRATCH_BYTES`] of staging each. The
    /// copies out of one call's scratch (and with `hash`, the checksums taken in the same
    /// pass) run on a helper thread while the next call is on the wire, so a large staged
    /// read pays them only once, at the end. Once a call fails whole, or every transfer of it
    /// fails, the later calls are not made (their keys fail unread, see [`gives_up`]); the
    /// keys a call left abandoned are marked in `abandoned`.
    fn read_part(
        &self,
        gets: &[RangedGet<'_>],
        part: &[usize],
        hash: bool,
        abandoned: &[AtomicBool],
    ) -> Vec<KeyRead> {
        let stage = self.stage;
        let shaped: Vec<Shaped> = part
            .iter()
            .map(|&i| {
                let s = shape(&gets[i].ranges, stage);
                if s.scratch > SCRATCH_BYTES {
                    shape(&gets[i].ranges, false)
                } else {
                    s
                }
            })
            .collect();
        let needs: Vec<u64> = shaped.iter().map(|s| s.scratch).collect();
        let calls = scratch_calls(&needs, SCRATCH_BYTES);
        let mut out = Vec::with_capacity(part.len());
        std::thread::scope(|s| {
            // The copy-out of the previous call, on its helper thread, with its keys.
            let mut copying: Option<(ScopedJoinHandle<'_, Vec<KeyRead>>, &[usize])> = None;
            let mut given_up: Option<String> = None;
            for (range, need) in calls {
                let keys = &part[range.clone()];
                if let Some(why) = &given_up {
                    // In call order: the previous call's copies first.
                    if let Some((h, prev)) = copying.take() {
                        out.extend(h.join().unwrap_or_else(|_| panicked(gets, prev, abandoned)));
                    }
                    out.extend(
                        keys.iter()
                            .map(|&i| (Err(not_read(gets[i].key, why)), RangeChecksums::new())),
                    );
                    continue;
                }
                let call = self.read_call(gets, keys, (&shaped[range], need), hash);
                for (&i, r) in keys.iter().zip(&call.results) {
                    if r.as_ref().is_err_and(StoreError::may_still_transfer) {
                        abandoned[i].store(true, Ordering::Release);
                    }
                }
                if let Some(why) = &call.given_up {
                    tracing::warn!(
                        keys = keys.len(),
                        why,
                        "a read stream's later calls given up"
                    );
                    given_up = Some(why.clone());
                }
                if let Some((h, prev)) = copying.take() {
                    out.extend(h.join().unwrap_or_else(|_| panicked(gets, prev, abandoned)));
                }
                if call.copies_nothing() {
                    out.extend(self.copy_out(call));
                    continue;
                }
                let slot = Arc::new(Mutex::new(Some(call)));
                let spawned = std::thread::Builder::new().spawn_scoped(s, {
                    let slot = slot.clone();
                    move || {
                        slot.lock()
                            .take()
                            .map(|c| self.copy_out(c))
                            .unwrap_or_default()
                    }
                });
                match spawned {
                    Ok(h) => copying = Some((h, keys)),
                    // No thread to be had: the copies run here.
                    Err(_) => {
                        if let Some(c) = slot.lock().take() {
                            out.extend(self.copy_out(c));
                        }
                    }
                }
            }
            if let Some((h, prev)) = copying.take() {
                out.extend(h.join().unwrap_or_else(|_| panicked(gets, prev, abandoned)));
            }
        });
        out
    }

    /// One ranged call of the wheel for `gets[i]`, `i` in `part`, shaped as `shaped`, with
    /// `need` bytes of scratch; per entry of `part`, the bytes read or the error (a short read
    /// is an error). The copies out of scratch (with `hash`, and the staged ranges' checksums)
    /// are left to [`copy_out`](Self::copy_out).
    fn read_call<'g>(
        &self,
        gets: &'g [RangedGet<'g>],
        part: &'g [usize],
        (shaped, need): (&'g [Shaped], u64),
        hash: bool,
    ) -> ReadCall<'g> {
        let ranges_to_hash = hash.then(|| part.iter().map(|&i| gets[i].ranges.len()).collect());
        let names: Vec<&str> = part.iter().map(|&i| gets[i].key).collect();
        let ckeys = match CKeys::new(&names) {
            Ok(k) => k,
            Err(e) => return ReadCall::not_made(names, shaped, |k| store_error(k, &e), None),
        };
        // Held shared for the call: `unregister` waits for it. Not had in time: an unregister's
        // wheel call hangs; this call and the stream's later ones fail rather than wait.
        let Some(transfer) = self.transfers.transfer() else {
            let why = gate_held(names.first().copied().unwrap_or("<no key>")).to_string();
            return ReadCall::not_made(names, shaped, gate_held, Some(why));
        };
        let mut scratch = self.take_scratch(need as usize);
        let base = scratch.as_mut_ptr();
        let mut key_scratch = Vec::with_capacity(part.len());
        let mut counts = Vec::with_capacity(part.len());
        let mut ranges: Vec<Range> = Vec::with_capacity(part.len());
        let mut at = 0u64;
        for s in shaped {
            key_scratch.push(at);
            counts.push(s.spans.len());
            for span in &s.spans {
                let dst = match span.target {
                    Target::Caller(p) => p,
                    // SAFETY: `at + off + size <= need <= scratch.len()`: the key's scratch
                    // spans lie inside its share of the area (`shape` sizes them).
                    Target::Scratch(off) => unsafe { base.add((at + off) as usize) },
                };
                ranges.push(Range {
                    dst: dst.cast(),
                    size: span.size,
                    offset: span.offset,
                });
            }
            at += s.scratch;
        }
        // SAFETY: every caller destination comes from a range whose
        // `dst` the caller of `get_ranges` (an `unsafe fn`) promised, by KvStore's buffer
        // contract, valid for writes of its length, untouched by anyone else during the call
        // and registered where the transport needs it (merging joins only ranges adjacent in
        // memory); every scratch destination lies in `scratch`, owned here for the whole call.
        // Concurrent calls get disjoint gets and their own scratch. The call is synchronous,
        // except for a transfer the client gives up on, after which everything it may touch
        // is kept for good (`abandoned` below). Staging is used over TCP only, whose reader
        // side needs no registration.
        let call = || unsafe { self.wheel.ranged(&ckeys, &counts, &ranges) };
        let read = wheel_read(
            "batch_get_ranges",
            "ranged read",
            &names,
            self.gives_up_after,
            self.failures,
            call,
        );
        let (mut out, given_up, abandoned) = (read.results, read.given_up, read.abandoned);
        if abandoned {
            // Transfers may still write the caller's memory: `unregister` must not let it go.
            self.transfers.abandon(transfer);
        } else {
            drop(transfer);
        }
        for (r, &i) in out.iter_mut().zip(part) {
            let expected = gets[i].expected();
            if let Ok(got) = *r {
                if got != expected {
                    *r = Err(StoreError::ShortRead {
                        key: gets[i].key.to_owned(),
                        expected,
                        got,
                    });
                }
            }
        }
        ReadCall {
            results: out,
            scratch,
            key_scratch,
            shaped,
            ranges_to_hash,
            keys: names,
            abandoned,
            given_up,
        }
    }

    /// The copies out of a returned call's scratch, for every key it read whole; the results,
    /// with the checksums of the staged ranges when the call asks for them.
    fn copy_out(&self, call: ReadCall<'_>) -> Vec<KeyRead> {
        #[cfg(test)]
        if self.copy_out_panics {
            // Leaks the call's scratch with it (`ManuallyDrop` is not reached): a test fault.
            std::mem::forget(call);
            panic!("test: a copy-out panics");
        }
        let ReadCall {
            results,
            scratch,
            key_scratch,
            shaped,
            ranges_to_hash,
            keys,
            abandoned,
            given_up: _,
        } = call;
        // Never freed by an unwind either while a transfer may still write it.
        let scratch = ManuallyDrop::new(scratch);
        let each = results.into_iter().zip(shaped).zip(&key_scratch);
        let out = each
            .enumerate()
            .map(|(k, ((r, s), &start))| {
                if r.is_err() {
                    return (r, RangeChecksums::new());
                }
                let ranges = ranges_to_hash.as_ref().and_then(|h| h.get(k).copied());
                // SAFETY: `start` is this key's share of `scratch`, which the call filled for
                // the key (its result is Ok: its transfer ended, and no other key's transfer,
                // even one given up on, writes this share), and the copies are the key's own.
                match unsafe { copy_key(ScratchArea::of(&scratch), start, s, ranges) } {
                    Some(sums) => (r, sums),
                    None => {
                        let key = keys.get(k).copied().unwrap_or_default().to_owned();
                        tracing::error!(
                            key,
                            "a staged copy lies outside its scratch: the key fails"
                        );
                        // Not a transfer that may go through next time: an internal fault.
                        (
                            Err(StoreError::Other { key, code: -1 }),
                            RangeChecksums::new(),
                        )
                    }
                }
            })
            .collect();
        if !abandoned {
            self.return_scratch(ManuallyDrop::into_inner(scratch));
        } else {
            // A transfer the client gave up on may still write it: kept for good.
            crate::store::keep_for_good(scratch.len() as u64, "a ranged read's scratch");
        }
        out
    }

    /// A scratch area of at least `len` bytes (empty for 0), reused when one is kept.
    fn take_scratch(&self, len: usize) -> Vec<u8> {
        if len == 0 {
            return Vec::new();
        }
        let kept = {
            let mut pool = self.scratch.lock();
            match pool.iter().position(|b| b.len() >= len) {
                Some(i) => Some(pool.swap_remove(i)),
                None => pool.pop(),
            }
        };
        let mut buf = kept.unwrap_or_default();
        if buf.len() < len {
            buf.resize(len, 0);
        }
        buf
    }

    fn return_scratch(&self, buf: Vec<u8>) {
        if buf.is_empty() {
            return;
        }
        let mut pool = self.scratch.lock();
        if pool.len() < KEPT_SCRATCH {
            pool.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::ranges::shape;
    use super::*;
    use crate::store::mooncake::store::failed_placeholder;
    use crate::store::ReadRange;

    #[test]
    fn a_keys_copies_land_its_staged_ranges_and_take_each_ones_checksum_where_it_landed() {
        // Four layers of one page into a layer-major pool (stride 1000), the third continuing
        // the second in memory too (merged), then a gap in the object: three staged ranges in
        // two copies, and one range read straight into the pool (no checksum taken).
        let mut pool = vec![0u8; 8000];
        let base = pool.as_mut_ptr();
        let at = |off: usize| base.wrapping_add(off);
        let ranges = [
            ReadRange {
                dst: at(0),
                len: 100,
                offset: 0,
            },
            ReadRange {
                dst: at(1000),
                len: 100,
                offset: 100,
            },
            ReadRange {
                dst: at(1100),
                len: 50,
                offset: 200,
            },
            ReadRange {
                dst: at(3000),
                len: 100,
                offset: 400,
            },
        ];
        let s = shape(&ranges, true);
        assert_eq!((s.copies.len(), s.staged.len(), s.scratch), (2, 3, 250));
        // The key's share of scratch starts at 64 in a larger area, as with several keys.
        let scratch: Vec<u8> = (0..400u32).map(|i| (i * 7 + 3) as u8).collect();
        // SAFETY: `scratch[64..314]` stands for what a call read; every destination lies in
        // `pool`, which nothing else touches during the call.
        let sums =
            unsafe { copy_key(ScratchArea::of(&scratch), 64, &s, Some(ranges.len())) }.unwrap();
        let object = &scratch[64..];
        assert_eq!(pool[..100], object[..100]);
        assert_eq!(pool[1000..1150], object[100..250]);
        let landed =
            |off: usize, len: usize| Some(kv_geometry::layer_checksum(&pool[off..off + len]));
        assert_eq!(
            sums.as_slice(),
            &[landed(0, 100), landed(1000, 100), landed(1100, 50), None]
        );
        // Without checksums asked for: the same copies, none taken.
        pool.fill(0);
        // SAFETY: as above.
        let none = unsafe { copy_key(ScratchArea::of(&scratch), 64, &s, None) }.unwrap();
        assert!(none.is_empty());
        assert_eq!(pool[1000..1150], object[100..250]);
        // A scratch that does not hold the key's share (not what a call gives), or a share
        // past its end: no copy reads outside the share, and the key fails instead of
        // leaving rows unwritten.
        let short = scratch[..200].to_vec();
        // SAFETY: the destinations are in `pool`, as above; the areas are the test's own.
        let got = unsafe { copy_key(ScratchArea::of(&short), 64, &s, None) };
        assert_eq!(got, None);
        // SAFETY: as just above.
        let got = unsafe { copy_key(ScratchArea::of(&scratch), u64::MAX - 8, &s, None) };
        assert_eq!(got, None);
        // A copy reaching past the key's own share (into the next key's bytes) is refused
        // too, though the scratch is long enough.
        let mut past = s.clone();
        past.copies[1].from += 1;
        // SAFETY: as just above.
        let got = unsafe { copy_key(ScratchArea::of(&scratch), 64, &past, None) };
        assert_eq!(got, None);
    }

    /// A wheel whose calls follow a script: per call, each key's transfer succeeds (writing
    /// byte `(offset + j) % 251` of the object) or fails, or the call panics.
    enum Scripted {
        Keys(Vec<bool>),
        Panic,
    }

    #[derive(Default)]
    struct FakeWheel {
        script: Mutex<std::collections::VecDeque<Scripted>>,
        calls: std::sync::atomic::AtomicUsize,
    }

    impl RangedCall for FakeWheel {
        unsafe fn ranged(
            &self,
            _keys: &CKeys,
            counts: &[usize],
            ranges: &[Range],
        ) -> Result<Vec<WheelResult<u64>>, MooncakeError> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            let next = self.script.lock().pop_front();
            let Some(Scripted::Keys(ok)) = next else {
                panic!("a scripted panic (or a call the script did not plan)");
            };
            let mut at = 0;
            let mut out = Vec::new();
            for (k, &n) in counts.iter().enumerate() {
                let mine = &ranges[at..at + n];
                at += n;
                if !ok[k] {
                    out.push(Err(mooncake_sys::ErrorCode::TRANSFER_FAIL));
                    continue;
                }
                let mut total = 0;
                for r in mine {
                    let len = r.size as usize;
                    // SAFETY: the read path hands this call destinations valid for writes of
                    // each range's size (its own scratch, or the test's pool).
                    let dst = unsafe { std::slice::from_raw_parts_mut(r.dst.cast::<u8>(), len) };
                    for (j, b) in dst.iter_mut().enumerate() {
                        *b = ((r.offset as usize + j) % 251) as u8;
                    }
                    total += r.size;
                }
                out.push(Ok(total));
            }
            Ok(out)
        }
    }

    /// Four keys of 10 MiB, each read as two ranges that continue in the object but not in
    /// the pool (staged through scratch): with one stream, the calls are keys 0-2 (30 MiB of
    /// scratch) and key 3.
    const KEY_BYTES: usize = 10 << 20;

    fn four_keys(pool: &mut [u8]) -> Vec<RangedGet<'static>> {
        const KEYS: [&str; 4] = ["k0", "k1", "k2", "k3"];
        let half = KEY_BYTES / 2;
        let base = pool.as_mut_ptr();
        KEYS.iter()
            .enumerate()
            .map(|(k, key)| {
                // The second half lands before the first in the pool: not one range in memory.
                let first = base.wrapping_add(k * KEY_BYTES + half);
                let second = base.wrapping_add(k * KEY_BYTES);
                RangedGet {
                    key,
                    ranges: smallvec::smallvec![
                        ReadRange {
                            dst: first,
                            len: half,
                            offset: 0
                        },
                        ReadRange {
                            dst: second,
                            len: half,
                            offset: half as u64
                        },
                    ],
                }
            })
            .collect()
    }

    fn read_with(
        wheel: &FakeWheel,
        gives_up_after: Duration,
    ) -> (Vec<KeyResult>, TransferGate, Vec<u8>) {
        let gate = TransferGate::default();
        let scratch = Mutex::new(Vec::new());
        let mut pool = vec![0u8; 4 * KEY_BYTES];
        let gets = four_keys(&mut pool);
        let path = ReadPath {
            wheel,
            transfers: &gate,
            scratch: &scratch,
            streams: 1,
            stage: true,
            gives_up_after,
            failures: &LogEvery::new(),
            copy_out_panics: false,
        };
        let mut out: Vec<KeyResult> = gets.iter().map(|g| failed_placeholder(g.key)).collect();
        let readable: Vec<usize> = (0..gets.len()).collect();
        path.read_streamed(&gets, &readable, &mut out, &mut []);
        (out, gate, pool)
    }

    fn landed(pool: &[u8], k: usize) -> bool {
        let half = KEY_BYTES / 2;
        let key = &pool[k * KEY_BYTES..(k + 1) * KEY_BYTES];
        let want = |off: usize, j: usize| ((off + j) % 251) as u8;
        key[half..]
            .iter()
            .enumerate()
            .all(|(j, &b)| b == want(0, j))
            && key[..half]
                .iter()
                .enumerate()
                .all(|(j, &b)| b == want(half, j))
    }

    #[test]
    fn a_stream_whose_call_failed_every_transfer_makes_no_later_call() {
        let wheel = FakeWheel::default();
        wheel
            .script
            .lock()
            .push_back(Scripted::Keys(vec![false; 3]));
        let (out, gate, _) = read_with(&wheel, Duration::from_secs(3600));
        // One call, not two: a stalled node would make each later call wait out 60 s.
        assert_eq!(wheel.calls.load(Ordering::Relaxed), 1);
        for r in &out[..3] {
            assert!(matches!(r, Err(StoreError::TransferFailed { .. })), "{r:?}");
        }
        assert!(
            matches!(&out[3], Err(StoreError::Unavailable { detail }) if detail.to_string().contains("not read")),
            "{:?}",
            out[3]
        );
        assert!(gate.quiet(Duration::ZERO).is_some(), "nothing abandoned");
    }

    /// A call whose transfers the client gave up on (its timeout: a storage node that
    /// stalls) stops the read's later calls: each would wait out the same timeout while the
    /// caller has given up. Before, the next call went out (and here panicked).
    #[test]
    fn a_call_the_client_gave_up_on_stops_the_reads_later_calls() {
        // The client gives up at once (limit 0): key 1's failed transfer may still run. The
        // stream's next call would panic.
        let wheel = FakeWheel::default();
        wheel
            .script
            .lock()
            .extend([Scripted::Keys(vec![true, false, true]), Scripted::Panic]);
        let (out, gate, pool) = read_with(&wheel, Duration::ZERO);
        assert_eq!(wheel.calls.load(Ordering::Relaxed), 1);
        assert!(matches!(out[0], Ok(n) if n == KEY_BYTES as u64) && landed(&pool, 0));
        assert!(matches!(out[2], Ok(n) if n == KEY_BYTES as u64) && landed(&pool, 2));
        assert!(
            out[1].as_ref().is_err_and(StoreError::may_still_transfer),
            "{:?}",
            out[1]
        );
        // Not sent: not read, and nothing of it may still transfer.
        assert!(
            matches!(&out[3], Err(StoreError::Unavailable { detail }) if detail.to_string().contains("transfer timeout")),
            "{:?}",
            out[3]
        );
        assert!(
            gate.quiet(Duration::ZERO).is_none(),
            "the gate lets the memory go"
        );
    }

    #[test]
    fn a_call_that_panics_fails_its_own_keys_only() {
        let wheel = FakeWheel::default();
        wheel
            .script
            .lock()
            .extend([Scripted::Keys(vec![true; 3]), Scripted::Panic]);
        let (out, gate, pool) = read_with(&wheel, Duration::from_secs(3600));
        for (k, r) in out[..3].iter().enumerate() {
            assert!(
                matches!(r, Ok(n) if *n == KEY_BYTES as u64) && landed(&pool, k),
                "key {k}"
            );
        }
        assert!(
            matches!(out[3], Err(StoreError::Panicked { .. })),
            "{:?}",
            out[3]
        );
        assert!(gate.quiet(Duration::ZERO).is_some());
    }

    /// A part that panics outside the wheel's call (here its copy-out, run on the part's own
    /// thread since the call staged nothing) fails its keys as `Panicked`, except a key its
    /// call left abandoned: that one stays `Abandoned`, so its memory is kept.
    #[test]
    fn a_key_abandoned_before_a_part_panics_stays_abandoned() {
        let wheel = FakeWheel::default();
        wheel
            .script
            .lock()
            .push_back(Scripted::Keys(vec![true, false, true]));
        let gate = TransferGate::default();
        let scratch = Mutex::new(Vec::new());
        // One range per key straight into the pool: nothing staged, the copy-out runs inline.
        let mut pool = vec![0u8; 3 * 4096];
        let base = pool.as_mut_ptr();
        let gets: Vec<RangedGet<'_>> = ["a", "b", "c"]
            .iter()
            .enumerate()
            .map(|(k, key)| RangedGet {
                key,
                ranges: smallvec::smallvec![ReadRange {
                    dst: base.wrapping_add(k * 4096),
                    len: 4096,
                    offset: 0,
                }],
            })
            .collect();
        let path = ReadPath {
            wheel: &wheel,
            transfers: &gate,
            scratch: &scratch,
            streams: 1,
            stage: true,
            gives_up_after: Duration::ZERO,
            failures: &LogEvery::new(),
            copy_out_panics: true,
        };
        let mut out: Vec<KeyResult> = gets.iter().map(|g| failed_placeholder(g.key)).collect();
        path.read_streamed(&gets, &[0, 1, 2], &mut out, &mut []);
        assert!(
            out[1].as_ref().is_err_and(StoreError::may_still_transfer),
            "{:?}",
            out[1]
        );
        for k in [0, 2] {
            assert!(
                matches!(out[k], Err(StoreError::Panicked { .. })),
                "{:?}",
                out[k]
            );
        }
        assert!(
            gate.quiet(Duration::ZERO).is_none(),
            "the gate lets the memory go"
        );
    }
}
