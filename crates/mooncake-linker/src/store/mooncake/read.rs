//! The ranged read path of [`MooncakeStore`]: keys split into concurrent streams, each key's
//! ranges shaped (merged, and staged through scratch where they continue in the object only),
//! then the wheel's ranged call, then the copies out of scratch.

use std::sync::Arc;
use std::thread::ScopedJoinHandle;

use mooncake_sys::{CKeys, Range};
use parking_lot::Mutex;

use super::ranges::{partition, shape, Shaped, Target};
use super::store::{failed_placeholder, per_key, store_error, MooncakeStore};
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
    hash: Option<Vec<usize>>,
}

// SAFETY: the copy targets inside `shaped` are caller memory that `get_ranges`'s contract
// makes ours to write, from any thread, until it returns; the copy-out thread is scoped
// inside that call and joined before it returns.
unsafe impl Send for ReadCall<'_> {}

impl ReadCall<'_> {
    /// True when no key of the call has anything to copy out of scratch.
    fn copies_nothing(&self) -> bool {
        self.shaped.iter().all(|s| s.copies.is_empty())
    }
}

/// Every key of `part` failed because a helper thread panicked.
fn panicked(gets: &[RangedGet<'_>], part: &[usize]) -> Vec<KeyRead> {
    part.iter()
        .map(|&i| {
            let e = StoreError::Other {
                key: gets[i].key.to_owned(),
                code: -1,
            };
            (Err(e), RangeChecksums::new())
        })
        .collect()
}

impl MooncakeStore {
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
        let bytes: Vec<u64> = readable.iter().map(|&i| gets[i].expected()).collect();
        let parts = partition(&bytes, self.config.read_streams_count(), MIN_STREAM_BYTES);
        let results: Vec<Vec<KeyRead>> = if parts.len() <= 1 {
            vec![self.read_part(gets, readable, hash)]
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = parts[1..]
                    .iter()
                    .map(|p| {
                        let part = &readable[p.clone()];
                        s.spawn(move || self.read_part(gets, part, hash))
                    })
                    .collect();
                let mut all = vec![self.read_part(gets, &readable[parts[0].clone()], hash)];
                for (h, p) in handles.into_iter().zip(&parts[1..]) {
                    all.push(
                        h.join()
                            .unwrap_or_else(|_| panicked(gets, &readable[p.clone()])),
                    );
                }
                all
            })
        };
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
    /// read pays them only once, at the end.
    fn read_part(&self, gets: &[RangedGet<'_>], part: &[usize], hash: bool) -> Vec<KeyRead> {
        let stage = self.config.staged_merge_enabled();
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
        let mut calls = Vec::new();
        let mut start = 0;
        while start < part.len() {
            let mut end = start + 1;
            let mut need = shaped[start].scratch;
            while end < part.len() && need + shaped[end].scratch <= SCRATCH_BYTES {
                need += shaped[end].scratch;
                end += 1;
            }
            calls.push((start..end, need));
            start = end;
        }
        let mut out = Vec::with_capacity(part.len());
        std::thread::scope(|s| {
            // The copy-out of the previous call, on its helper thread, with its keys.
            let mut copying: Option<(ScopedJoinHandle<'_, Vec<KeyRead>>, &[usize])> = None;
            for (range, need) in calls {
                let keys = &part[range.clone()];
                let mut call = self.read_call(gets, keys, &shaped[range], need);
                call.hash = hash.then(|| keys.iter().map(|&i| gets[i].ranges.len()).collect());
                if let Some((h, prev)) = copying.take() {
                    out.extend(h.join().unwrap_or_else(|_| panicked(gets, prev)));
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
                out.extend(h.join().unwrap_or_else(|_| panicked(gets, prev)));
            }
        });
        out
    }

    /// One ranged call of the wheel for `gets[i]`, `i` in `part`, shaped as `shaped`, with
    /// `need` bytes of scratch; per entry of `part`, the bytes read or the error (a short read
    /// is an error). The copies out of scratch are left to [`copy_out`](Self::copy_out).
    fn read_call<'g>(
        &self,
        gets: &'g [RangedGet<'g>],
        part: &'g [usize],
        shaped: &'g [Shaped],
        need: u64,
    ) -> ReadCall<'g> {
        let names: Vec<&str> = part.iter().map(|&i| gets[i].key).collect();
        let ckeys = match CKeys::new(&names) {
            Ok(k) => k,
            Err(e) => {
                return ReadCall {
                    results: names.iter().map(|k| Err(store_error(k, &e))).collect(),
                    scratch: Vec::new(),
                    key_scratch: Vec::new(),
                    shaped,
                    hash: None,
                }
            }
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
        // Held shared for the call: `unregister` waits for it.
        let transfer = self.transfers.transfer();
        // SAFETY: every caller destination comes from a range whose `dst` the caller of
        // `get_ranges` (an `unsafe fn`) promised, by KvStore's buffer contract, valid for writes
        // of its length, untouched by anyone else during the call and registered where the
        // transport needs it (merging joins only ranges adjacent in memory); every scratch
        // destination lies in `scratch`, owned here for the whole call. Concurrent calls get
        // disjoint gets and their own scratch. The call is synchronous. Staging is used over
        // TCP only, whose reader side needs no registration.
        let results = unsafe { self.client.batch_get_ranges_raw(&ckeys, &counts, &ranges) };
        drop(transfer);
        let positions: Vec<usize> = (0..part.len()).collect();
        let mut out: Vec<KeyResult> = names.iter().map(|k| failed_placeholder(k)).collect();
        per_key(&names, results, &positions, &mut out);
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
            hash: None,
        }
    }

    /// The copies out of a returned call's scratch, for every key it read whole; the results,
    /// with the checksums of the staged ranges when the call asks for them (each taken of the
    /// scratch bytes just copied, while they are still in cache).
    fn copy_out(&self, call: ReadCall<'_>) -> Vec<KeyRead> {
        let base = call.scratch.as_ptr();
        let mut sums: Vec<RangeChecksums> = Vec::with_capacity(call.results.len());
        let keys = call.results.iter().zip(call.shaped).zip(&call.key_scratch);
        for (k, ((r, s), &start)) in keys.enumerate() {
            let ranges = call.hash.as_ref().and_then(|h| h.get(k).copied());
            let mut taken = RangeChecksums::new();
            if r.is_err() {
                sums.push(taken);
                continue;
            }
            if let Some(n) = ranges {
                taken.resize(n, None);
            }
            let mut staged = s.staged.iter().peekable();
            for c in &s.copies {
                let from = start + c.from;
                // SAFETY: the source lies in this key's scratch share, which the call filled
                // (`from + len <= s.scratch`); the destination is part of a caller range (valid
                // for writes, untouched by others until `get_ranges` returns, per the contract
                // quoted in `read_call`; this copy runs before it returns), and the two cannot
                // overlap (scratch is the store's).
                unsafe {
                    std::ptr::copy_nonoverlapping(base.add(from as usize), c.to, c.len);
                }
                if ranges.is_none() {
                    continue;
                }
                // The staged ranges inside this copy (in scratch order, like the copies).
                let end = c.from + c.len as u64;
                while let Some(st) = staged.next_if(|st| st.from < end) {
                    let at = (start + st.from) as usize;
                    if let (Some(bytes), Some(slot)) =
                        (call.scratch.get(at..at + st.len), taken.get_mut(st.index))
                    {
                        *slot = Some(kv_geometry::layer_checksum(bytes));
                    }
                }
            }
            sums.push(taken);
        }
        self.return_scratch(call.scratch);
        call.results.into_iter().zip(sums).collect()
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
