//! A [`KvStore`] wrapper that injects failures into chosen reads: fault injection for tests
//! of every failure rule (and for engines' own tests).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::{
    KvStore, MemoryRegion, ObjectGet, ObjectPut, PutOutcome, RangedGet, ReadSession, StoreError,
};

/// What an injected fault does to a matching ranged read.
#[derive(Debug, Clone)]
pub enum Fault {
    /// The key's read fails with this error.
    Error(StoreError),
    /// The key's read returns one byte less than asked (a short read).
    Short,
    /// The whole call sleeps this long first (a slow or hung store), then reads normally.
    Delay(Duration),
}

/// Which reads a fault hits: all conditions given must match.
#[derive(Debug, Clone, Default)]
pub struct FaultRule {
    /// Only keys containing this text.
    pub key_contains: Option<String>,
    /// Only ranges starting at this byte offset of the object (picks a layer).
    pub offset: Option<u64>,
    /// How many matching reads to hit before the rule is spent (`None`: forever).
    pub times: Option<u32>,
}

struct Armed {
    rule: FaultRule,
    fault: Fault,
    hits: AtomicU32,
}

impl Armed {
    fn matches(&self, get: &RangedGet<'_>) -> bool {
        if let Some(k) = &self.rule.key_contains {
            if !get.key.contains(k.as_str()) {
                return false;
            }
        }
        if let Some(off) = self.rule.offset {
            if !get.ranges.iter().any(|r| r.offset == off) {
                return false;
            }
        }
        match self.rule.times {
            None => true,
            Some(t) => self
                .hits
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                    (h < t).then_some(h + 1)
                })
                .is_ok(),
        }
    }
}

/// Wraps a store and fails, shortens or delays the ranged reads that match its rules; every
/// other operation passes through untouched.
///
/// ```
/// use std::sync::Arc;
/// use mooncake_linker::store::{EmbeddedStore, Fault, FaultRule, FaultyStore, KvStore, StoreError};
/// let faulty = FaultyStore::new(Arc::new(EmbeddedStore::new(1 << 20)));
/// faulty.inject(
///     FaultRule { key_contains: Some("_k".into()), ..FaultRule::default() },
///     Fault::Error(StoreError::RpcTimeout { key: "injected".into() }),
/// );
/// assert_eq!(faulty.name(), "embedded+faults");
/// faulty.clear();
/// ```
pub struct FaultyStore {
    inner: Arc<dyn KvStore>,
    rules: Mutex<Vec<Arc<Armed>>>,
}

impl FaultyStore {
    /// A pass-through wrapper until rules are injected.
    pub fn new(inner: Arc<dyn KvStore>) -> Self {
        FaultyStore {
            inner,
            rules: Mutex::new(Vec::new()),
        }
    }

    /// Adds a rule.
    pub fn inject(&self, rule: FaultRule, fault: Fault) {
        self.rules.lock().push(Arc::new(Armed {
            rule,
            fault,
            hits: AtomicU32::new(0),
        }));
    }

    /// Removes every rule.
    pub fn clear(&self) {
        self.rules.lock().clear();
    }
}

impl KvStore for FaultyStore {
    forward_to_inner!();

    fn name(&self) -> &str {
        match self.inner.name() {
            "embedded" => "embedded+faults",
            "mooncake" => "mooncake+faults",
            _ => "store+faults",
        }
    }

    unsafe fn get_into(&self, gets: &[ObjectGet<'_>]) -> Vec<Result<u64, StoreError>> {
        // SAFETY: forwarded with the caller's own promise.
        unsafe { self.inner.get_into(gets) }
    }

    unsafe fn get_ranges(&self, gets: &[RangedGet<'_>]) -> Vec<Result<u64, StoreError>> {
        let rules: Vec<Arc<Armed>> = self.rules.lock().clone();
        let mut faults: Vec<Option<Fault>> = vec![None; gets.len()];
        for (i, g) in gets.iter().enumerate() {
            for r in &rules {
                if r.matches(g) {
                    match &r.fault {
                        Fault::Delay(d) => std::thread::sleep(*d),
                        f => faults[i] = Some(f.clone()),
                    }
                }
            }
        }
        // SAFETY: forwarded with the caller's own promise.
        let mut results = unsafe { self.inner.get_ranges(gets) };
        for (r, f) in results.iter_mut().zip(faults) {
            match f {
                Some(Fault::Error(e)) => *r = Err(e),
                Some(Fault::Short) => {
                    if let Ok(n) = r {
                        *n = n.saturating_sub(1);
                    }
                }
                _ => {}
            }
        }
        results
    }
}
