//! The whole-object read path of [`MooncakeStore`]: keys split into concurrent streams
//! ([`MooncakeConfig::whole_read_streams`](super::MooncakeConfig::whole_read_streams)), each stream's keys read in calls of at most
//! [`MAX_WHOLE_READS_PER_CALL`] keys, one after the other.
//!
//! Over TCP the pinned wheel reads the objects of one call one after the other, a round trip
//! each, so a call of many small objects (a batch's checksum companions: one of 652 B per
//! object read) costs per key, not per byte; concurrent calls overlap those round trips.

use std::ops::Range;

use mooncake_sys::{CKeys, ErrorCode};

use super::ranges::partition;
use super::store::{per_key, store_error, MooncakeStore};
use crate::store::{ObjectGet, StoreError};

/// Most keys one whole-object read call (`batch_get_into`) carries; a stream with more reads
/// them in calls made one after the other. The wheel's TCP transfer stalled until its 60 s
/// timeout with 4,096 small objects in one call (a 128K-token prefix's checksum companions);
/// 1,024 per call (a 32K prefix's companions) ran on every GPU-host run.
pub const MAX_WHOLE_READS_PER_CALL: usize = 1024;

/// Fewest keys a whole-object read stream carries: a read of fewer keys than twice this stays
/// one stream (a thread and a call cost more than the round trips they overlap).
pub const MIN_WHOLE_KEYS_PER_STREAM: usize = 64;

type KeyResult = Result<u64, StoreError>;

/// The streams a whole read of `gets[i]` for `i` in `valid` is split into: at most `streams`,
/// each of at least [`MIN_WHOLE_KEYS_PER_STREAM`] keys, balanced by bytes; ranges of `valid`.
pub(super) fn whole_streams(
    gets: &[ObjectGet<'_>],
    valid: &[usize],
    streams: usize,
) -> Vec<Range<usize>> {
    let by_keys = (valid.len() / MIN_WHOLE_KEYS_PER_STREAM).max(1);
    let bytes: Vec<u64> = valid.iter().map(|&i| gets[i].len as u64).collect();
    partition(&bytes, streams.min(by_keys), 1)
}

impl MooncakeStore {
    /// Reads `gets[i]` for every `i` in `valid` into `out[i]`: split into concurrent streams
    /// ([`whole_streams`]), each in calls of at most [`MAX_WHOLE_READS_PER_CALL`] keys.
    ///
    /// # Safety
    /// As [`KvStore::get_into`](crate::store::KvStore::get_into): each `dst` of `gets` is valid
    /// for writes of `len` bytes and accessed by no one else until this returns.
    pub(super) unsafe fn read_whole_streamed(
        &self,
        gets: &[ObjectGet<'_>],
        keys: &[&str],
        valid: &[usize],
        out: &mut [KeyResult],
    ) {
        let parts = whole_streams(gets, valid, self.config().whole_read_streams_count());
        if parts.len() <= 1 {
            // SAFETY: forwarded from this function's contract.
            let got = unsafe { self.read_whole_part(gets, keys, valid) };
            place(valid, got, out);
            return;
        }
        let results: Vec<Vec<KeyResult>> = std::thread::scope(|s| {
            let handles: Vec<_> = parts[1..]
                .iter()
                .map(|p| {
                    let part = &valid[p.clone()];
                    // SAFETY: forwarded from this function's contract; the parts are disjoint,
                    // so no destination is written by two threads, and the scope joins every
                    // thread before this function returns.
                    s.spawn(move || unsafe { self.read_whole_part(gets, keys, part) })
                })
                .collect();
            // SAFETY: as above, for the first part, on this thread.
            let mut all =
                vec![unsafe { self.read_whole_part(gets, keys, &valid[parts[0].clone()]) }];
            for (h, p) in handles.into_iter().zip(&parts[1..]) {
                all.push(h.join().unwrap_or_else(|_| {
                    valid[p.clone()]
                        .iter()
                        .map(|&i| {
                            Err(StoreError::Other {
                                key: keys[i].to_owned(),
                                code: -1,
                            })
                        })
                        .collect()
                }));
            }
            all
        });
        place(valid, results.into_iter().flatten().collect(), out);
    }

    /// One stream: `part`'s keys in calls of at most [`MAX_WHOLE_READS_PER_CALL`], one after
    /// the other; each key's result, in `part`'s order. Once a call fails whole (or every key
    /// of it fails its transfer), the later calls are not made: each would wait out the same
    /// transfer timeout while the caller has given up.
    ///
    /// # Safety
    /// As [`read_whole_streamed`](Self::read_whole_streamed), for the keys of `part`.
    unsafe fn read_whole_part(
        &self,
        gets: &[ObjectGet<'_>],
        keys: &[&str],
        part: &[usize],
    ) -> Vec<KeyResult> {
        let mut out: Vec<KeyResult> = Vec::with_capacity(part.len());
        let mut given_up: Option<String> = None;
        for call in part.chunks(MAX_WHOLE_READS_PER_CALL) {
            if let Some(why) = &given_up {
                out.extend(call.iter().map(|&i| {
                    Err(StoreError::Unavailable {
                        detail: format!("`{}` not read: {why}", keys[i]).into(),
                    })
                }));
                continue;
            }
            let names: Vec<&str> = call.iter().map(|&i| keys[i]).collect();
            let ckeys = match CKeys::new(&names) {
                Ok(k) => k,
                Err(e) => {
                    out.extend(call.iter().map(|&i| Err(store_error(keys[i], &e))));
                    continue;
                }
            };
            let ptrs: Vec<*mut u8> = call.iter().map(|&i| gets[i].dst).collect();
            let sizes: Vec<usize> = call.iter().map(|&i| gets[i].len).collect();
            // SAFETY: the caller promised (KvStore's buffer contract, forwarded) that each `dst`
            // is valid for writes of `len` bytes, not accessed by anyone else during the call,
            // and registered where the transport needs it; the call is synchronous.
            let results = unsafe { self.client().batch_get_into_raw(&ckeys, &ptrs, &sizes) };
            given_up = match &results {
                Err(e) => Some(format!("an earlier whole-object read call failed ({e})")),
                Ok(r) if r.iter().all(|k| k == &Err(ErrorCode::TRANSFER_FAIL)) => {
                    Some("every transfer of an earlier whole-object read call failed".into())
                }
                Ok(_) => None,
            };
            if let Some(why) = &given_up {
                tracing::warn!(keys = call.len(), why, "whole-object reads given up");
            }
            let mut got: Vec<KeyResult> = vec![Ok(0); call.len()];
            let local: Vec<usize> = (0..call.len()).collect();
            per_key(&names, results, &local, &mut got);
            out.extend(got);
        }
        out
    }
}

/// Puts each key's result (`got`, in `valid`'s order) at its place in `out`.
fn place(valid: &[usize], got: Vec<KeyResult>, out: &mut [KeyResult]) {
    for (&i, r) in valid.iter().zip(got) {
        out[i] = r;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gets(lens: &[usize]) -> Vec<ObjectGet<'static>> {
        lens.iter()
            .map(|&len| ObjectGet {
                key: "k",
                dst: std::ptr::null_mut(),
                len,
            })
            .collect()
    }

    #[test]
    fn few_keys_stay_one_stream_and_many_split_by_keys_then_streams() {
        let small = gets(&vec![652; 100]);
        let valid: Vec<usize> = (0..100).collect();
        assert_eq!(whole_streams(&small, &valid, 8), vec![0..100]);
        let many = gets(&vec![652; 1024]);
        let valid: Vec<usize> = (0..1024).collect();
        let parts = whole_streams(&many, &valid, 8);
        assert_eq!(parts.len(), 8);
        assert!(parts.iter().all(|p| p.len() >= MIN_WHOLE_KEYS_PER_STREAM));
        assert_eq!(whole_streams(&many, &valid, 1), vec![0..1024]);
        // 300 keys: at most 4 streams of 64 or more.
        let some: Vec<usize> = (0..300).collect();
        assert_eq!(whole_streams(&many, &some, 16).len(), 4);
        assert!(whole_streams(&many, &[], 8).is_empty());
    }
}
