//! A store decorator that logs read sessions and ranged reads, for the tests of pins taken at
//! lookup.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use kvlink::mooncake_linker::store::{KvStore, RangedGet, ReadSession, StoreError};

/// Counts the read sessions started and ended through it, how many sessions hold each key,
/// the order of starts and ends, and the keys of ranged reads.
pub struct Sessions {
    inner: Arc<dyn KvStore>,
    state: Mutex<SessionLog>,
}

#[derive(Default)]
struct SessionLog {
    started: u32,
    ended: u32,
    open: HashMap<String, i64>,
    /// `s` per start, `e` per end, in order.
    order: String,
    /// Keys whose last session an end let go of.
    let_go: HashSet<String>,
    read: HashSet<String>,
}

impl Sessions {
    pub fn over(inner: Arc<dyn KvStore>) -> Arc<Self> {
        Arc::new(Sessions {
            inner,
            state: Mutex::new(SessionLog::default()),
        })
    }

    /// Sessions started (successfully) and ended so far.
    pub fn counts(&self) -> (u32, u32) {
        let s = self.state.lock().unwrap();
        (s.started, s.ended)
    }

    /// The keys some session holds now, sorted.
    pub fn pinned(&self) -> Vec<String> {
        let s = self.state.lock().unwrap();
        let mut keys: Vec<String> = s
            .open
            .iter()
            .filter(|(_, &n)| n != 0)
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort();
        keys
    }

    /// Starts (`s`) and ends (`e`) in the order they came.
    pub fn order(&self) -> String {
        self.state.lock().unwrap().order.clone()
    }

    /// True if an end let go of the last session of any of `keys`.
    pub fn let_go_of_any(&self, keys: &[String]) -> bool {
        let s = self.state.lock().unwrap();
        keys.iter().any(|k| s.let_go.contains(k))
    }

    /// The keys ranged reads have read so far, sorted.
    pub fn read(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.state.lock().unwrap().read.iter().cloned().collect();
        keys.sort();
        keys
    }
}

// SAFETY: a test decorator: the calls it forwards (`forward_store_calls!`) and those it
// writes reach the inner store, whose results it returns as they are or fails before it
// (touching nothing); it starts no thread that touches caller memory.
unsafe impl KvStore for Sessions {
    kvlink::mooncake_linker::forward_store_calls!(inner => exists, object_size, get_into, put, remove,
        discard, register, unregister, health);

    fn name(&self) -> &str {
        "sessions"
    }

    unsafe fn get_ranges(&self, gets: &[RangedGet<'_>]) -> Vec<Result<u64, StoreError>> {
        self.state
            .lock()
            .unwrap()
            .read
            .extend(gets.iter().map(|g| g.key.to_owned()));
        // SAFETY: the caller's promise, for the same call.
        unsafe { self.inner.get_ranges(gets) }
    }

    fn start_session(&self, keys: &[&str]) -> Result<ReadSession, StoreError> {
        let session = self.inner.start_session(keys)?;
        let mut s = self.state.lock().unwrap();
        s.started += 1;
        s.order.push('s');
        for k in keys {
            *s.open.entry((*k).to_owned()).or_default() += 1;
        }
        Ok(session)
    }

    fn end_session(&self, session: &ReadSession) -> Result<(), StoreError> {
        let mut s = self.state.lock().unwrap();
        s.ended += 1;
        s.order.push('e');
        for k in &session.keys {
            let n = s.open.entry(k.clone()).or_default();
            *n -= 1;
            if *n == 0 {
                s.let_go.insert(k.clone());
            }
        }
        drop(s);
        self.inner.end_session(session)
    }
}
