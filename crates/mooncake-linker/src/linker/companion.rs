//! An object's checksum companion (`{key}_kvsum`, written by kvlink's save): where it is, how
//! long it must be, and what one whole read of it says. The batch's companion read
//! (verify.rs) and the recheck of stale kept checksums (fresh_companion.rs) judge a companion
//! alike through [`Inner::judge_companions`]; the read ahead at lookup (prefetch.rs) finds it
//! with [`companion_of`] and keeps only companions that decode (anything else is left to the
//! load's own read). A newer writer's companion (another version of the format) is neither
//! good nor bad: its object is checked by length only and the pair left alone.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kv_geometry::{checksum_key, ChecksumError, ComponentLayout, ObjectChecksums};
use parking_lot::Mutex;
use tracing::{debug, warn};

use super::Inner;
use crate::log_every::LogEvery;
use crate::store::StoreError;

/// Longest companion read again at its own size to tell a newer writer's from a bad one (a
/// companion of this version is 28 B + 8 B a layer: 652 B for 78 layers).
pub(crate) const MAX_COMPANION_BYTES: u64 = 1 << 20;

/// Most bytes one call reads again of companions of another length (a batch's may be many).
const REREAD_BYTES: usize = 16 << 20;

/// The "newer writer's companion" lines logged at `warn` lately (once a minute).
static UNSUPPORTED_LOG: LogEvery = LogEvery::new();

/// How long a companion of another length found to be a newer writer's is taken as one
/// without asking the store again.
const NEWER_REMEMBERED: Duration = Duration::from_secs(60);

/// Most companions remembered as a newer writer's (past it the memory starts afresh).
const NEWER_KEYS: usize = 1 << 16;

/// Companions of another length than this version's found to be a newer writer's, by key:
/// in a rolling upgrade every object of the newer servers has one, and telling each from a
/// bad one costs two store calls (its size, a read at that size). Remembered for
/// [`NEWER_REMEMBERED`]: a key written again meanwhile by an older writer is checked by
/// length only until then (what its companion would be checked as, the newer one's), and a
/// store's refusal of such a key's read (`InvalidArgument`) reads as the newer companion too.
#[derive(Debug, Default)]
pub(crate) struct NewerCompanions {
    seen: Mutex<HashMap<String, Instant>>,
}

impl NewerCompanions {
    /// Whether `key` was found a newer writer's within [`NEWER_REMEMBERED`].
    fn remembered(&self, key: &str) -> bool {
        self.seen
            .lock()
            .get(key)
            .is_some_and(|at| at.elapsed() < NEWER_REMEMBERED)
    }

    /// Forgets them all (with the kept checksums: the store was emptied, say).
    pub(crate) fn clear(&self) {
        self.seen.lock().clear();
    }

    fn remember(&self, key: &str) {
        let mut seen = self.seen.lock();
        if seen.len() >= NEWER_KEYS {
            seen.retain(|_, at| at.elapsed() < NEWER_REMEMBERED);
            if seen.len() >= NEWER_KEYS {
                seen.clear();
            }
        }
        seen.insert(key.to_owned(), Instant::now());
    }
}

/// The companion of object `object_key` of `layout`: its key and its exact length.
pub(crate) fn companion_of(object_key: &str, layout: &ComponentLayout) -> (String, usize) {
    (
        checksum_key(object_key),
        ObjectChecksums::encoded_len(layout.layers.len()),
    )
}

/// What one whole read of a companion says about its object.
#[derive(Debug)]
pub(crate) enum CompanionRead {
    /// The object's checksums.
    Sums(ObjectChecksums),
    /// The store holds no companion (objects another writer saved): checked by length only.
    Absent,
    /// The companion is a newer kvlink writer's (another version of the format, this text
    /// says which): nothing here can check it, and it does not make the object bad. Its
    /// object is checked by length only, and the pair stays in the store.
    Unsupported(String),
    /// The companion is not one (malformed, for another layout, cut short, too long): its
    /// object is bad.
    Bad(String),
    /// The store failed for another cause: nothing is known about the object.
    Failed(StoreError),
}

/// The whole read of one companion, to judge: its key, the length this version's has, the
/// layout of its object, and what the read returned.
pub(crate) struct CompanionGot<'a> {
    pub(crate) key: &'a str,
    pub(crate) len: usize,
    pub(crate) layout: &'a ComponentLayout,
    pub(crate) got: Result<Vec<u8>, StoreError>,
}

/// A companion on its way to a verdict.
enum Judging {
    Judged(CompanionRead),
    /// Refused as `InvalidArgument` (this error): its size tells a longer one.
    Refused(StoreError),
    /// Of another length than this version's (`size` bytes): read again at its size, it is a
    /// newer writer's or bad for `why`.
    OtherLength {
        size: u64,
        why: String,
    },
}

impl Judging {
    /// The verdict, where no further call is to be made: a refusal stays the store failure it
    /// is, a companion of another length not read again is bad.
    fn verdict(self) -> CompanionRead {
        match self {
            Judging::Judged(judged) => judged,
            Judging::Refused(e) => CompanionRead::Failed(e),
            Judging::OtherLength { why, .. } => CompanionRead::Bad(why),
        }
    }
}

impl Inner {
    /// Judges each of `reads`, whole reads of companions. A store refuses a companion longer
    /// than its buffer as `InvalidArgument`, which it says for other causes too (a bad key,
    /// the call's arguments): only one whose size query shows it too long is bad, unless a
    /// read at its size shows a newer writer's whole companion (`Unsupported`, remembered a
    /// minute: [`NewerCompanions`]); else the refusal is the store failure it is. A companion
    /// shorter than this version's is judged by a read at its size the same way. Those calls
    /// are made for all of `reads` together, each bounded by `deadline`: one size query for
    /// every refused companion, one read for every one of another length (in a rolling
    /// upgrade every object of the newer servers has one: a call per key, serially, would
    /// hold layer 0 for twice as many store calls as objects).
    pub(crate) fn judge_companions(
        &self,
        reads: Vec<CompanionGot<'_>>,
        deadline: std::time::Instant,
    ) -> Vec<CompanionRead> {
        let keys: Vec<(&str, usize)> = reads.iter().map(|r| (r.key, r.len)).collect();
        let judging: Vec<Judging> = reads
            .into_iter()
            .map(|r| self.first_look(r.key, r.layout, r.got))
            .collect();
        let judging = self.size_refused(&keys, judging, deadline);
        let judging = self.read_other_lengths(&keys, judging, deadline);
        judging
            .into_iter()
            .zip(&keys)
            .map(|(j, (key, _))| {
                let judged = j.verdict();
                if let CompanionRead::Unsupported(why) = &judged {
                    self.metrics.companion_unsupported();
                    log_unsupported(key, why);
                }
                judged
            })
            .collect()
    }

    /// What a companion's whole read says without another store call.
    fn first_look(
        &self,
        key: &str,
        layout: &ComponentLayout,
        got: Result<Vec<u8>, StoreError>,
    ) -> Judging {
        let judged = match got {
            Ok(bytes) => match ObjectChecksums::decode_for(&bytes, layout) {
                Ok(sums) => CompanionRead::Sums(sums),
                Err(e @ ChecksumError::Unsupported { .. }) => {
                    CompanionRead::Unsupported(e.to_string())
                }
                Err(e) => CompanionRead::Bad(e.to_string()),
            },
            Err(StoreError::NotFound { .. }) => CompanionRead::Absent,
            Err(StoreError::ShortRead { .. } | StoreError::InvalidArgument { .. })
                if self.newer_companions.remembered(key) =>
            {
                CompanionRead::Unsupported(format!(
                    "a newer writer's companion of another length (found so within {}s)",
                    NEWER_REMEMBERED.as_secs()
                ))
            }
            Err(StoreError::ShortRead { got, expected, .. }) => {
                let why = format!("checksum object of {got} bytes, {expected} expected");
                return Judging::OtherLength { size: got, why };
            }
            Err(e @ StoreError::InvalidArgument { .. }) => return Judging::Refused(e),
            Err(e) => CompanionRead::Failed(e),
        };
        Judging::Judged(judged)
    }

    /// The companions refused as `InvalidArgument`, their sizes asked in one bounded query:
    /// one longer than this version's goes on as of another length, any other keeps its
    /// refusal as the store failure it is (also when the query fails).
    fn size_refused(
        &self,
        keys: &[(&str, usize)],
        judging: Vec<Judging>,
        deadline: std::time::Instant,
    ) -> Vec<Judging> {
        let asked: Vec<&str> = judging
            .iter()
            .zip(keys)
            .filter(|(j, _)| matches!(j, Judging::Refused(_)))
            .map(|(_, &(key, _))| key)
            .collect();
        if asked.is_empty() {
            return judging;
        }
        let mut sizes = self.calls.object_size(&asked, deadline).into_iter();
        let sized = |e: StoreError, len: usize, size: Option<Result<u64, StoreError>>| match size {
            Some(Ok(size)) if size > len as u64 => {
                let why = format!("checksum object of {size} bytes, {len} expected ({e})");
                Judging::OtherLength { size, why }
            }
            _ => Judging::Judged(CompanionRead::Failed(e)),
        };
        judging
            .into_iter()
            .zip(keys)
            .map(|(j, &(_, len))| match j {
                Judging::Refused(e) => sized(e, len, sizes.next()),
                other => other,
            })
            .collect()
    }

    /// The companions of another length, read again whole at their sizes in one bounded
    /// call: [`CompanionRead::Unsupported`] for a newer writer's whole companion, else
    /// [`CompanionRead::Bad`] (also when it is longer than any companion, or its size changed
    /// again). A store that fails the read says nothing of it ([`CompanionRead::Failed`]:
    /// nothing discarded); one gone meanwhile is [`CompanionRead::Absent`].
    fn read_other_lengths(
        &self,
        keys: &[(&str, usize)],
        judging: Vec<Judging>,
        deadline: std::time::Instant,
    ) -> Vec<Judging> {
        let (asked, lens): (Vec<&str>, Vec<usize>) = judging
            .iter()
            .zip(keys)
            .filter_map(|(j, &(key, _))| match j {
                Judging::OtherLength { size, .. } if *size <= MAX_COMPANION_BYTES => {
                    Some((key, *size as usize))
                }
                _ => None,
            })
            .unzip();
        if asked.is_empty() {
            return judging;
        }
        let mut got = self.read_in_parts(&asked, &lens, deadline).into_iter();
        judging
            .into_iter()
            .zip(keys)
            .map(|(j, &(key, _))| match j {
                Judging::OtherLength { size, why } if size <= MAX_COMPANION_BYTES => {
                    Judging::Judged(self.newer_or_bad(key, (size, why), got.next()))
                }
                other => other,
            })
            .collect()
    }

    /// Whole reads of `keys` at `lens`, in calls of at most [`REREAD_BYTES`] each (or of one
    /// key): companions of another length may be as long as [`MAX_COMPANION_BYTES`] each.
    fn read_in_parts(
        &self,
        keys: &[&str],
        lens: &[usize],
        deadline: std::time::Instant,
    ) -> Vec<Result<Vec<u8>, StoreError>> {
        let mut got = Vec::with_capacity(keys.len());
        let mut start = 0;
        while start < keys.len() {
            let mut end = start + 1;
            let mut bytes = lens[start];
            while end < keys.len() && bytes + lens[end] <= REREAD_BYTES {
                bytes += lens[end];
                end += 1;
            }
            got.extend(
                self.calls
                    .read_whole_owned(&keys[start..end], &lens[start..end], deadline),
            );
            start = end;
        }
        got
    }

    /// The verdict on companion `key` of `size` bytes, bad for `why` unless `got`, its read
    /// at that size, is a newer writer's whole companion.
    fn newer_or_bad(
        &self,
        key: &str,
        (size, why): (u64, String),
        got: Option<Result<Vec<u8>, StoreError>>,
    ) -> CompanionRead {
        match got {
            Some(Ok(bytes)) => match ObjectChecksums::decode(&bytes) {
                Err(e @ ChecksumError::Unsupported { .. }) => {
                    self.newer_companions.remember(key);
                    CompanionRead::Unsupported(format!("{e} ({size} bytes)"))
                }
                _ => CompanionRead::Bad(why),
            },
            Some(Err(StoreError::NotFound { .. })) => CompanionRead::Absent,
            Some(Err(StoreError::ShortRead { .. } | StoreError::InvalidArgument { .. })) | None => {
                CompanionRead::Bad(why)
            }
            Some(Err(e)) => CompanionRead::Failed(e),
        }
    }
}

/// Says that companion `key` is a newer writer's: at `warn` once a minute (this server reads
/// an older format than a writer sharing its store: upgrade it), at `debug` in between.
fn log_unsupported(key: &str, why: &str) {
    match UNSUPPORTED_LOG.due_after("unsupported") {
        Some(since) => warn!(
            key,
            why,
            companions_at_debug_since = since,
            "a checksum companion of a newer kvlink writer: its object is checked by length only \
             and left in the store; upgrade this server (logged again every minute while it lasts)"
        ),
        None => debug!(
            key,
            why, "a newer writer's checksum companion: checked by length only"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_geometry::{KvGeometry, ModelKvSpec};

    #[test]
    fn a_companions_key_and_length_follow_its_object_and_layout() {
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let ix = g.component_by_name("indexer").unwrap();
        let (key, len) = companion_of("ns_ab_cp0_pp0_indexer", ix);
        assert_eq!(key, "ns_ab_cp0_pp0_indexer_kvsum");
        let object: Vec<u8> = vec![7; ix.object_bytes() as usize];
        let encoded = ObjectChecksums::of_object(&object, ix.page_layer_bytes)
            .unwrap()
            .encode();
        assert_eq!(encoded.len(), len);
    }
}
