//! [`FileExchange`]: a key-value exchange in a directory, every call bounded by its deadline.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::exchange::{ExchangeError, KeyValueExchange};
use crate::process::wire::MAX_FRAME;

/// The most of a value read from the directory: a hello or reply frame's limit. A larger
/// file at a key reads as its first `MAX_VALUE + 1` bytes, a value past the limit that the
/// rendezvous takes as no value of its own (rank 0 reads every claim a few times a second: a
/// huge file there would be read into memory whole each time).
const MAX_VALUE: usize = MAX_FRAME;

/// The file at `path`, at most its first `MAX_VALUE + 1` bytes.
fn read_capped(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut v = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_VALUE as u64 + 1)
        .read_to_end(&mut v)?;
    Ok(v)
}

/// How long a call is waited for at least, its deadline spent or not: a local file call takes
/// microseconds, and a poll made at its deadline (`wait`'s last) should still be answered.
const GRACE: Duration = Duration::from_millis(100);

/// The longest key named by its bytes in hex (twice as long, within a file name's 255 bytes);
/// longer keys are named by their hash.
const HEX_KEY_MAX: usize = 120;

/// A [`KeyValueExchange`] in a directory (like torch's `FileStore`): one file per key, set
/// by writing a temporary file and renaming it over the key (atomic), created by hard-linking
/// a temporary file to the key's name (fails when the key exists: atomic too). Every rank of
/// one host, or of hosts sharing a POSIX file system, can meet through it. A file is named
/// by its key's bytes in hex, or by the key's 128-bit hash for keys of more than 120 bytes.
/// Rank 0 removes the files of the epochs more than one formation back as it closes each; a
/// few may stay (a joiner of another group size, a removal that failed): remove the directory
/// between deployments.
///
/// Each call runs its file calls on a thread of its own and waits for them until its
/// deadline (and at least 100 ms): a file system that hangs (an NFS server gone) fails the
/// call then rather than holding the rendezvous. Its file calls finish on their own, and until
/// they have, every call of the exchange started after it was given up fails at once: a late
/// write must not land after a newer one (a hello over its withdrawal), nor a file system that
/// does not answer gather a thread per poll. (Calls running at once on several threads are
/// not ordered among themselves; the rendezvous makes its calls one at a time.)
///
/// ```
/// use std::time::Duration;
/// use dedup_broadcast::{FileExchange, KeyValueExchange};
/// let dir = std::env::temp_dir().join(format!("kvlink-doc-fx-{}", std::process::id()));
/// let x = FileExchange::new(&dir).unwrap();
/// let soon = kv_loader::deadline_after(Duration::from_secs(5));
/// assert!(x.create("g/1/open", b"rank 0", soon).unwrap());
/// assert!(!x.create("g/1/open", b"another", soon).unwrap());
/// assert_eq!(x.get("g/1/open", soon).unwrap().as_deref(), Some(&b"rank 0"[..]));
/// std::fs::remove_dir_all(&dir).unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct FileExchange {
    dir: PathBuf,
    /// File calls running past their caller's deadline now.
    stuck: Arc<AtomicUsize>,
}

impl FileExchange {
    /// Keys live in `dir` (created if missing; this one call is not bounded).
    pub fn new(dir: impl AsRef<Path>) -> Result<Self, ExchangeError> {
        let dir = dir.as_ref().to_path_buf();
        std::fs::create_dir_all(&dir)
            .map_err(|e| ExchangeError::new(format!("creating {}: {e}", dir.display())))?;
        Ok(FileExchange {
            dir,
            stuck: Arc::default(),
        })
    }

    /// The file of `key`: its bytes in hex, or for a key of more than [`HEX_KEY_MAX`] bytes
    /// (its hex name would pass the 255-byte limit of a file name) `h` and its 128-bit hash in
    /// hex (no hex name starts with `h`).
    fn path(dir: &Path, key: &str) -> PathBuf {
        let name: String = if key.len() <= HEX_KEY_MAX {
            key.bytes().map(|b| format!("{b:02x}")).collect()
        } else {
            format!("h{:032x}", xxhash_rust::xxh3::xxh3_128(key.as_bytes()))
        };
        dir.join(name)
    }

    /// Writes `value` to a fresh temporary file in `dir` (removed again when the write
    /// fails).
    fn temp(dir: &Path, value: &[u8]) -> Result<PathBuf, ExchangeError> {
        let p = dir.join(format!(
            ".tmp-{}-{:016x}",
            std::process::id(),
            super::fresh_nonce()
        ));
        let written = std::fs::File::create(&p).and_then(|mut f| f.write_all(value));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&p);
            return Err(ExchangeError::new(format!("writing {}: {e}", p.display())));
        }
        Ok(p)
    }

    /// Runs `call` (file calls in `dir`) on a thread of its own, waiting for it until
    /// `deadline`.
    fn bounded<T: Send + 'static>(
        &self,
        what: String,
        deadline: Instant,
        call: impl FnOnce(&Path) -> Result<T, ExchangeError> + Send + 'static,
    ) -> Result<T, ExchangeError> {
        if self.stuck.load(Ordering::Acquire) > 0 {
            return Err(ExchangeError::new(format!(
                "{what}: an earlier file call in {} has not returned (a file system that \
                 does not answer)",
                self.dir.display()
            )));
        }
        let answer: Arc<Answer<T>> = Arc::new(Answer {
            state: Mutex::new(CallState::Running),
            done: Condvar::new(),
        });
        let theirs = answer.clone();
        let dir = self.dir.clone();
        let stuck = self.stuck.clone();
        let spawned = std::thread::Builder::new()
            .name("kvlink-file-exchange".into())
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| call(&dir)))
                    .unwrap_or_else(|p| {
                        Err(ExchangeError::new(format!(
                            "a file call panicked: {}",
                            kv_loader::Cause::from_panic(p.as_ref())
                        )))
                    });
                let mut state = theirs.state.lock();
                if matches!(*state, CallState::GaveUp) {
                    // Its caller counted it stuck, which it no longer is.
                    stuck.fetch_sub(1, Ordering::AcqRel);
                    return;
                }
                *state = CallState::Done(r);
                theirs.done.notify_all();
            });
        if let Err(e) = spawned {
            return Err(ExchangeError::new(format!(
                "{what}: no thread to run it: {e}"
            )));
        }
        let deadline = deadline.max(kv_loader::deadline_after(GRACE));
        let mut state = answer.state.lock();
        while matches!(*state, CallState::Running) {
            if answer.done.wait_until(&mut state, deadline).timed_out() {
                break;
            }
        }
        match std::mem::replace(&mut *state, CallState::GaveUp) {
            CallState::Done(r) => r,
            _ => {
                // Counted under the lock: the call's thread, finding `GaveUp`, uncounts it.
                self.stuck.fetch_add(1, Ordering::AcqRel);
                drop(state);
                tracing::warn!(call = what, dir = %self.dir.display(), "a file exchange call did not return by its deadline");
                Err(ExchangeError::new(format!(
                    "{what}: the file system did not answer by the deadline"
                )))
            }
        }
    }
}

/// Where a bounded call's thread leaves its answer.
struct Answer<T> {
    state: Mutex<CallState<T>>,
    done: Condvar,
}

enum CallState<T> {
    Running,
    Done(Result<T, ExchangeError>),
    /// Its caller's deadline passed first.
    GaveUp,
}

impl KeyValueExchange for FileExchange {
    fn set(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), ExchangeError> {
        let (key, value) = (key.to_owned(), value.to_vec());
        self.bounded(format!("setting {key}"), deadline, move |dir| {
            let tmp = Self::temp(dir, &value)?;
            std::fs::rename(&tmp, Self::path(dir, &key)).map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                ExchangeError::new(format!("setting {key}: {e}"))
            })
        })
    }

    fn get(&self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>, ExchangeError> {
        let key = key.to_owned();
        self.bounded(
            format!("reading {key}"),
            deadline,
            move |dir| match read_capped(&Self::path(dir, &key)) {
                Ok(v) => Ok(Some(v)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(ExchangeError::new(format!("reading {key}: {e}"))),
            },
        )
    }

    fn create(&self, key: &str, value: &[u8], deadline: Instant) -> Result<bool, ExchangeError> {
        let (key, value) = (key.to_owned(), value.to_vec());
        self.bounded(format!("creating {key}"), deadline, move |dir| {
            let tmp = Self::temp(dir, &value)?;
            let r = std::fs::hard_link(&tmp, Self::path(dir, &key));
            let _ = std::fs::remove_file(&tmp);
            match r {
                Ok(()) => Ok(true),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
                Err(e) => Err(ExchangeError::new(format!("creating {key}: {e}"))),
            }
        })
    }

    /// One bounded call removes every file of `keys`, in order; each is tried, and the first
    /// failure is the answer.
    fn remove(&self, keys: &[&str], deadline: Instant) -> Result<(), ExchangeError> {
        let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        self.bounded(
            format!("removing {} keys", keys.len()),
            deadline,
            move |dir| {
                let mut first = None;
                for key in &keys {
                    match std::fs::remove_file(Self::path(dir, key)) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => {
                            first.get_or_insert_with(|| {
                                ExchangeError::new(format!("removing {key}: {e}"))
                            });
                        }
                    }
                }
                first.map_or(Ok(()), Err)
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys past 127 bytes made hex names past a file name's 255 bytes: every call on them
    /// failed (`ENAMETOOLONG`), so a group prefix of about 110 bytes could never meet. Long
    /// keys now take hashed names; two that differ only in their last byte stay apart.
    #[test]
    fn long_keys_are_set_created_and_read() {
        let dir =
            std::env::temp_dir().join(format!("kvlink-fx-long-{}", super::super::fresh_nonce()));
        let x = FileExchange::new(&dir).unwrap();
        let soon = kv_loader::deadline_after(Duration::from_secs(5));
        let prefix = "a-deployment/".repeat(12);
        let (a, b) = (format!("{prefix}1/open"), format!("{prefix}2/open"));
        assert!(a.len() > 127);
        assert!(x.create(&a, b"first", soon).unwrap());
        assert!(!x.create(&a, b"again", soon).unwrap());
        x.set(&b, b"second", soon).unwrap();
        assert_eq!(x.get(&a, soon).unwrap().as_deref(), Some(&b"first"[..]));
        assert_eq!(x.get(&b, soon).unwrap().as_deref(), Some(&b"second"[..]));
        let short = "g/1/open";
        x.set(short, b"short", soon).unwrap();
        assert_eq!(x.get(short, soon).unwrap().as_deref(), Some(&b"short"[..]));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Before, a file of any size at a key was read whole (rank 0 reads every claim a few
    /// times a second): now one past a frame's limit reads as one byte past it, and at the
    /// limit it reads whole.
    #[test]
    fn a_value_past_a_frames_limit_is_read_only_past_it() {
        let dir =
            std::env::temp_dir().join(format!("kvlink-fx-big-{}", super::super::fresh_nonce()));
        let x = FileExchange::new(&dir).unwrap();
        let soon = kv_loader::deadline_after(Duration::from_secs(5));
        x.set("big", &vec![1; MAX_VALUE + 1], soon).unwrap();
        x.set("huge", &vec![1; 8 * MAX_VALUE], soon).unwrap();
        for key in ["big", "huge"] {
            let got = x.get(key, soon).unwrap().map(|v| v.len());
            assert_eq!(got, Some(MAX_VALUE + 1), "{key}");
        }
        x.set("full", &vec![1; MAX_VALUE], soon).unwrap();
        assert_eq!(
            x.get("full", soon).unwrap().map(|v| v.len()),
            Some(MAX_VALUE)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A read of a key that hangs in the file system (a FIFO nobody writes: its open blocks)
    /// fails at the call's deadline; the file call finishes once the FIFO opens, and is no
    /// longer counted stuck.
    #[test]
    fn a_call_the_file_system_does_not_answer_fails_at_its_deadline() {
        let dir =
            std::env::temp_dir().join(format!("kvlink-fx-hang-{}", super::super::fresh_nonce()));
        let x = FileExchange::new(&dir).unwrap();
        let fifo = FileExchange::path(&dir, "g/hangs");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
        let t0 = Instant::now();
        let got = x.get(
            "g/hangs",
            kv_loader::deadline_after(Duration::from_millis(200)),
        );
        assert!(got.is_err(), "{got:?}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        assert_eq!(x.stuck.load(Ordering::Acquire), 1);
        // Until it returns, later calls fail at once (a late write must not land after them).
        let t1 = Instant::now();
        let later = x.set(
            "g/later",
            b"1",
            kv_loader::deadline_after(Duration::from_secs(5)),
        );
        assert!(
            later.is_err() && t1.elapsed() < Duration::from_secs(1),
            "{later:?}"
        );
        // Opening the FIFO for writing lets the stuck read open it (and read nothing).
        let w = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
        drop(w);
        let until = Instant::now() + Duration::from_secs(5);
        while x.stuck.load(Ordering::Acquire) != 0 {
            assert!(Instant::now() < until, "the stuck call never finished");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            x.get("g/other", kv_loader::deadline_after(Duration::from_secs(5)))
                .unwrap(),
            None
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
