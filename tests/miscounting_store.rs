//! A store that answers a batched call with more or fewer results than keys (a broken store
//! or decorator): lookup, save and load turn it into a typed error for the keys asked about,
//! never a panic, and the linker stays usable (the next batch loads).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use kvlink::kv_device::HostKvPool;
use kvlink::kv_geometry::KvGeometry;
use kvlink::kv_loader::{KvLoadError, KvLoader, LookupRequest, StoreFailure};
use kvlink::mooncake_linker::store::{
    EmbeddedStore, KvStore, ObjectPut, PutOutcome, RangedGet, StoreError,
};
use kvlink::mooncake_linker::{Linker, LinkerConfig};
use std::sync::Mutex;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Exists,
    Size,
    Read,
    Put,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Skew {
    /// One result more than keys, a plausible-looking one.
    Extra,
    /// The last result left out.
    Missing,
    /// Extra and Missing by turns, call after call: calls made at once (a layer's reads
    /// split over threads) that together answer as many results as keys.
    Offsetting,
}

/// Passes every call through, and skews the result count of one kind of call when armed.
struct Miscounting {
    inner: Arc<dyn KvStore>,
    armed: Mutex<Option<(Op, Skew)>>,
    /// Calls skewed so far (Offsetting alternates on it).
    calls: std::sync::atomic::AtomicUsize,
}

impl Miscounting {
    fn skew<T>(
        &self,
        op: Op,
        mut v: Vec<Result<T, StoreError>>,
        extra: T,
    ) -> Vec<Result<T, StoreError>> {
        let skew = match *self.armed.lock().unwrap() {
            Some((o, skew)) if o == op => skew,
            _ => return v,
        };
        let turn = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        match skew {
            Skew::Extra => v.push(Ok(extra)),
            Skew::Offsetting if turn.is_multiple_of(2) => v.push(Ok(extra)),
            Skew::Missing | Skew::Offsetting => {
                v.pop();
            }
        }
        v
    }
}

// SAFETY: a test decorator: every call runs the inner store's within the call (no thread of
// its own); the results it alters are its test's point, over an embedded store whose calls
// end before they return, so none of them is an `Abandoned` it could hide.
unsafe impl KvStore for Miscounting {
    kvlink::mooncake_linker::forward_store_calls!(inner => get_into, remove, discard, register, unregister,
        start_session, end_session, health);

    fn name(&self) -> &str {
        "miscounting"
    }
    fn exists(&self, keys: &[&str]) -> Vec<Result<bool, StoreError>> {
        self.skew(Op::Exists, self.inner.exists(keys), false)
    }
    fn object_size(&self, keys: &[&str]) -> Vec<Result<u64, StoreError>> {
        self.skew(Op::Size, self.inner.object_size(keys), 0)
    }
    unsafe fn get_ranges(&self, gets: &[RangedGet<'_>]) -> Vec<Result<u64, StoreError>> {
        // SAFETY: forwarded with the caller's promise.
        let r = unsafe { self.inner.get_ranges(gets) };
        self.skew(Op::Read, r, 0)
    }
    unsafe fn put(&self, puts: &[ObjectPut<'_>]) -> Vec<Result<PutOutcome, StoreError>> {
        // SAFETY: forwarded with the caller's promise.
        let r = unsafe { self.inner.put(puts) };
        self.skew(Op::Put, r, PutOutcome::Written)
    }
}

fn config() -> LinkerConfig {
    LinkerConfig {
        namespace: "miscount".into(),
        wait_deadline: Duration::from_secs(5),
        ..LinkerConfig::default()
    }
}

fn is_result_count(e: &KvLoadError) -> bool {
    matches!(e, KvLoadError::Store { kind: StoreFailure::Other, detail, .. }
        if detail.contains("results for"))
}

struct Fixture {
    store: Arc<Miscounting>,
    linker: Linker,
    tokens: Vec<u32>,
    g: KvGeometry,
}

fn fixture(saved: bool) -> Fixture {
    fixture_with(saved, config())
}

fn fixture_with(saved: bool, config: LinkerConfig) -> Fixture {
    let spec = small_spec();
    let inner: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 24));
    let tokens = prompt(9, 3, spec.page_size);
    if saved {
        save_prefix(&spec, inner.clone(), &tokens, &config);
    }
    let store = Arc::new(Miscounting {
        inner,
        armed: Mutex::new(None),
        calls: Default::default(),
    });
    let g = KvGeometry::new(spec, 1, 0).unwrap();
    let pool = Arc::new(HostKvPool::new(g.clone(), 8).unwrap());
    let linker = Linker::new(g.clone(), store.clone(), pool, config).unwrap();
    Fixture {
        store,
        linker,
        tokens,
        g,
    }
}

#[test]
fn lookup_with_a_wrong_result_count_is_a_typed_error() {
    for skew in [Skew::Extra, Skew::Missing] {
        let f = fixture(true);
        *f.store.armed.lock().unwrap() = Some((Op::Exists, skew));
        let r = f.linker.lookup(&LookupRequest {
            tokens: &f.tokens,
            skip_pages: 0,
        });
        assert!(
            matches!(&r, Err(e) if is_result_count(e)),
            "{skew:?}: {r:?}"
        );
        *f.store.armed.lock().unwrap() = None;
        let hit = f
            .linker
            .lookup(&LookupRequest {
                tokens: &f.tokens,
                skip_pages: 0,
            })
            .unwrap();
        assert_eq!(hit.pages.len(), 3);
    }
}

#[test]
fn save_with_a_wrong_result_count_is_a_typed_error() {
    for op in [Op::Exists, Op::Put] {
        for skew in [Skew::Extra, Skew::Missing] {
            let f = fixture(false);
            let pages = kvlink::kv_geometry::page_hashes(&f.tokens, f.g.page_size(), None);
            let plan = load_plan(&f.g, 1, &pages, vec![0, 1, 2]);
            *f.store.armed.lock().unwrap() = Some((op, skew));
            let r = f.linker.save(&plan);
            assert!(
                matches!(&r, Err(e) if is_result_count(e)),
                "{op:?} {skew:?}: {r:?}"
            );
            *f.store.armed.lock().unwrap() = None;
            let report = f.linker.save(&plan).unwrap();
            assert_eq!(
                report.objects_written + report.objects_present,
                3 * f.g.components().len() as u32
            );
        }
    }
}

#[test]
fn load_with_a_wrong_result_count_fails_the_batch_and_the_next_loads() {
    for op in [Op::Size, Op::Read] {
        for skew in [Skew::Extra, Skew::Missing] {
            let f = fixture(true);
            let pages = kvlink::kv_geometry::page_hashes(&f.tokens, f.g.page_size(), None);
            *f.store.armed.lock().unwrap() = Some((op, skew));
            let t = f
                .linker
                .start_load(load_plan(&f.g, 1, &pages, vec![5, 3, 1]))
                .unwrap();
            let outcome = f
                .linker
                .wait_batch(&t)
                .expect("an outcome, not a dead load thread");
            assert!(
                matches!(&outcome.result, Err(e) if is_result_count(e)),
                "{op:?} {skew:?}: {:?}",
                outcome.result
            );
            *f.store.armed.lock().unwrap() = None;
            let t = f
                .linker
                .start_load(load_plan(&f.g, 2, &pages, vec![5, 3, 1]))
                .expect("the linker is still open");
            wait_all(&f.linker, &t).unwrap();
            assert!(f.linker.wait_batch(&t).unwrap().result.is_ok());
        }
    }
}

#[test]
fn split_reads_are_checked_call_by_call() {
    // A layer's reads split over two store calls at once; the calls miscount in opposite
    // directions, so together they answer as many results as keys. Each call is checked on
    // its own: a typed result-count error, not results matched to the wrong keys.
    let f = fixture_with(
        true,
        LinkerConfig {
            read_parallelism: 2,
            ..config()
        },
    );
    let pages = kvlink::kv_geometry::page_hashes(&f.tokens, f.g.page_size(), None);
    *f.store.armed.lock().unwrap() = Some((Op::Read, Skew::Offsetting));
    let t = f
        .linker
        .start_load(load_plan(&f.g, 1, &pages, vec![5, 3, 1]))
        .unwrap();
    let outcome = f.linker.wait_batch(&t).expect("an outcome");
    assert!(
        matches!(&outcome.result, Err(e) if is_result_count(e)),
        "{:?}",
        outcome.result
    );
    *f.store.armed.lock().unwrap() = None;
    let t = f
        .linker
        .start_load(load_plan(&f.g, 2, &pages, vec![5, 3, 1]))
        .unwrap();
    wait_all(&f.linker, &t).unwrap();
    assert!(f.linker.wait_batch(&t).unwrap().result.is_ok());
}
