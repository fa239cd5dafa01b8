//! A saved pair read back. Mooncake's puts are first-write-wins, and a key another writer
//! puts between a save's `exists` and its put is reported `Written` to both: two saves of one
//! page can each see both halves `Written` while the store keeps one writer's object beside
//! the other's companion. Every load of that object would then fail against checksums of
//! other bytes. So a save reads back the companion of each object it saw `Written`, whether
//! its own companion put said `Written` or found one there (another writer's, put since the
//! save looked: the object kept may be either writer's):
//! - its own bytes: kept as the save's pair. (Where two saves raced, the object may still be
//!   the other's: that one then reads back a companion not its own, finds the object does not
//!   match it, and discards both; where the other writes no companion nor reads back, a load
//!   finds the mix, as before.)
//! - other bytes: another writer's companion won. The object is read too; when it matches the
//!   companion the pair is the other writer's (kept, counted present); when it does not, the
//!   pair is mixed and both halves are discarded (object first) for the next save to write
//!   again;
//! - a read fails (the companion's or the object's): nothing is known, the pair stays as the
//!   store said and no checksums are kept (a load checks it); where the companion is known to
//!   be another writer's the pair is not counted as the save's.

use std::sync::Arc;
use std::time::Instant;

use kv_geometry::{ComponentLayout, ObjectChecksums};
use tracing::warn;

use super::companion::{companion_of, CompanionGot, CompanionRead};
use super::reader::ComponentKeys;
use super::Inner;
use crate::store::{PutOutcome, StoreError};

/// One put's answer.
type PutResult = Result<PutOutcome, StoreError>;

/// What reading back a pair both of whose puts said `Written` found.
#[derive(Debug, PartialEq)]
pub(crate) enum ReadBack {
    /// The companion is the save's own bytes: the pair is the save's.
    Ours,
    /// Another writer's pair won, whole: the store keeps it, with these checksums.
    Theirs(ObjectChecksums),
    /// Not a pair: both halves were discarded (or tried).
    Discarded,
    /// The companion could not be read back: the pair stays as the store reported it.
    Unknown,
    /// The companion is another writer's (not the save's bytes, or found there by the put)
    /// and the pair could not be checked: it stays, not counted as the save's.
    Unchecked,
}

impl Inner {
    /// Reads back the companion of plan page `chunk[i]` for each `i` whose object put
    /// (`objects[i]`) said `Written` and whose companion put (`companions[i]`) said `Written`
    /// or found one there (`sums[i]`: what the save wrote), one bounded call for all, and
    /// settles each as [`ReadBack`] says. Returns one entry per page of `chunk`: `None` where
    /// there was nothing to read back.
    pub(crate) fn read_back_pairs(
        &self,
        comp: &ComponentKeys,
        chunk: &[usize],
        sums: &[ObjectChecksums],
        (objects, companions): (&[PutResult], &[PutResult]),
    ) -> Vec<Option<ReadBack>> {
        let written = |r: Option<&PutResult>| matches!(r, Some(Ok(PutOutcome::Written)));
        let found = |i: usize| matches!(companions.get(i), Some(Ok(PutOutcome::AlreadyPresent)));
        let pairs: Vec<usize> = (0..chunk.len())
            .filter(|&i| written(objects.get(i)) && (written(companions.get(i)) || found(i)))
            .collect();
        let mut verdicts: Vec<Option<ReadBack>> = (0..chunk.len()).map(|_| None).collect();
        if pairs.is_empty() {
            return verdicts;
        }
        let deadline = self.store_deadline();
        let (keys, lens): (Vec<String>, Vec<usize>) = pairs
            .iter()
            .map(|&i| companion_of(&comp.keys[chunk[i]], &comp.layout))
            .unzip();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let read = self.calls.read_whole_owned(&refs, &lens, deadline);
        // Those that are not the save's bytes, judged together.
        let mut others = Vec::new();
        for ((&i, got), (key, &len)) in pairs.iter().zip(read).zip(refs.iter().zip(&lens)) {
            match got {
                Ok(bytes) if bytes == sums[i].encode() => verdicts[i] = Some(ReadBack::Ours),
                got => others.push((
                    (i, *key),
                    CompanionGot {
                        key,
                        len,
                        layout: &comp.layout,
                        got,
                    },
                )),
            }
        }
        let (at, reads): (Vec<(usize, &str)>, Vec<CompanionGot<'_>>) = others.into_iter().unzip();
        let mut discard: Vec<&str> = Vec::new();
        for ((i, key), judged) in at.into_iter().zip(self.judge_companions(reads, deadline)) {
            let object = comp.keys[chunk[i]].as_str();
            let verdict = match judged {
                CompanionRead::Sums(theirs) => {
                    self.object_matches(object, &comp.layout, theirs, deadline)
                }
                CompanionRead::Failed(e) => {
                    warn!(key, error = %e, "a saved checksum companion could not be read back: the pair stays as the store reported it");
                    if found(i) {
                        ReadBack::Unchecked
                    } else {
                        ReadBack::Unknown
                    }
                }
                // A newer writer's: nothing here can check the pair against it.
                CompanionRead::Unsupported(_) => ReadBack::Unchecked,
                CompanionRead::Absent | CompanionRead::Bad(_) => ReadBack::Discarded,
            };
            if verdict == ReadBack::Discarded {
                discard.push(object);
            }
            verdicts[i] = Some(verdict);
        }
        if !discard.is_empty() {
            warn!(
                objects = discard.len(),
                "saved objects found beside another writer's checksum companion: discarded with it"
            );
            super::replace::discard_objects(&self.calls, &discard, deadline);
        }
        verdicts
    }

    /// Reads object `key` whole and checks it against `theirs`, the checksums another
    /// writer's companion holds: [`ReadBack::Theirs`] when every layer matches,
    /// [`ReadBack::Discarded`] (to be discarded by the caller) when it does not, and
    /// [`ReadBack::Unchecked`] when it cannot be read (the pair may be the other writer's
    /// good one: a forced discard would also fail a load reading it now).
    fn object_matches(
        &self,
        key: &str,
        layout: &ComponentLayout,
        theirs: ObjectChecksums,
        deadline: Instant,
    ) -> ReadBack {
        let len = layout.object_bytes() as usize;
        let read = self.calls.read_whole_owned(&[key], &[len], deadline).pop();
        match read.map(|r| r.map(|o| ObjectChecksums::of_object(&o, layout.page_layer_bytes))) {
            Some(Ok(Ok(sums))) if sums == theirs => ReadBack::Theirs(theirs),
            Some(Err(e)) => {
                warn!(key, error = %e, "an object beside another writer's companion could not be read back: the pair stays");
                ReadBack::Unchecked
            }
            // Bytes that do not match, or whose checksums the layout cannot take.
            Some(Ok(_)) => ReadBack::Discarded,
            None => ReadBack::Unchecked,
        }
    }

    /// Keeps `sums` as the checksums of object `key` for later loads.
    pub(crate) fn keep_checksums(&self, key: &str, sums: ObjectChecksums) {
        self.checksums.insert(key, Arc::new(sums));
    }
}
