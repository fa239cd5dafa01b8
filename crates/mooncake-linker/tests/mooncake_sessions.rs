//! Read sessions against a real Mooncake master: a load that outlasts several renewal periods
//! keeps its session (the master answers no more replica queries than sessions started,
//! plus one), and two linkers on one store keep each other's sessions.
//!
//! Each test runs its own `mooncake_master` (`MOONCAKE_MASTER_BIN`) and reads its Prometheus
//! counters. Run: `scripts/with-mooncake.sh cargo test -p mooncake-linker --test
//! mooncake_sessions`; without Mooncake the tests skip (CI: `KVLINK_REQUIRE_MOONCAKE=1` fails).

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{available, unique, PrivateMaster};
use kv_device::HostKvPool;
use kv_geometry::{page_hashes, ComponentSpec, ElementType, KvGeometry, ModelKvSpec, RowUnit};
use kv_loader::{BatchId, BatchPlan, KvLoader, RequestPages};
use mooncake_linker::store::mooncake::MooncakeStore;
use mooncake_linker::store::{Fault, FaultRule, FaultyStore, KvStore, ReadSession, StoreError};
use mooncake_linker::{Linker, LinkerConfig};

const LAYERS: u32 = 8;
const PAGES: usize = 4;

/// Counts the read sessions started through it; passes everything through.
struct SessionCount {
    inner: Arc<dyn KvStore>,
    starts: AtomicU64,
}

impl SessionCount {
    fn new(inner: Arc<dyn KvStore>) -> Arc<Self> {
        Arc::new(SessionCount {
            inner,
            starts: AtomicU64::new(0),
        })
    }

    fn starts(&self) -> u64 {
        self.starts.load(Ordering::Acquire)
    }
}

// SAFETY: a test decorator: the calls it forwards (`forward_store_calls!`) and those it
// writes reach the inner store, whose results it returns as they are or fails before it
// (touching nothing); it starts no thread that touches caller memory.
unsafe impl KvStore for SessionCount {
    mooncake_linker::forward_store_calls!(inner => exists, object_size, get_into, get_ranges,
        put, remove, discard, register, unregister, end_session, health);

    fn name(&self) -> &str {
        self.inner.name()
    }
    fn start_session(&self, keys: &[&str]) -> Result<ReadSession, StoreError> {
        self.starts.fetch_add(1, Ordering::AcqRel);
        self.inner.start_session(keys)
    }
}

fn geometry() -> KvGeometry {
    let spec = ModelKvSpec::new(
        "sessions",
        LAYERS,
        4,
        vec![ComponentSpec::new(
            "k",
            RowUnit::Token,
            ElementType::Bytes,
            64,
        )],
    )
    .unwrap();
    KvGeometry::new(spec, 1, 0).unwrap()
}

fn config(namespace: &str, renewal: Duration) -> LinkerConfig {
    LinkerConfig {
        namespace: namespace.into(),
        lease_renewal: renewal,
        // `object_size` asks the master for replicas too; these tests count session reads.
        verify_object_sizes: false,
        // One store call per layer: the slow store delays each call, so the load outlasts
        // several renewals.
        read_granularity: mooncake_linker::ReadGranularity::Fixed { layers_per_call: 1 },
        wait_deadline: Duration::from_secs(30),
        ..LinkerConfig::default()
    }
}

fn plan(g: &KvGeometry, batch: u64, tokens: &[u32]) -> BatchPlan {
    BatchPlan::all_components(
        g,
        BatchId(batch),
        vec![RequestPages {
            request: "r".into(),
            pages: page_hashes(tokens, g.page_size(), None),
        }],
        (0..PAGES as u32).collect(),
    )
}

/// Saves `PAGES` pages of a prompt through `store`; returns the prompt.
fn save(store: Arc<dyn KvStore>, namespace: &str) -> Vec<u32> {
    let g = geometry();
    let tokens: Vec<u32> = (0..PAGES as u32 * g.page_size())
        .map(|t| t * 7 + 1)
        .collect();
    let pool = Arc::new(HostKvPool::new(g.clone(), PAGES as u32).unwrap());
    for c in g.components() {
        for &l in &c.layers {
            for s in 0..PAGES as u32 {
                let row = vec![(l * 16 + s) as u8; c.page_layer_bytes as usize];
                // SAFETY: the pool is filled here, before the linker that saves it exists.
                unsafe { pool.write_slot(c.id, l, s, &row) }.unwrap();
            }
        }
    }
    let linker = Linker::new(g.clone(), store, pool, config(namespace, Duration::MAX)).unwrap();
    let report = linker.save(&plan(&g, 0, &tokens)).unwrap();
    assert_eq!(report.objects_written as usize, PAGES);
    linker.close().unwrap();
    tokens
}

/// A slow store: every layer read sleeps `delay` first.
fn slow(inner: Arc<dyn KvStore>, delay: Duration) -> Arc<dyn KvStore> {
    let faulty = FaultyStore::new(inner);
    faulty.inject(FaultRule::default(), Fault::Delay(delay));
    Arc::new(faulty)
}

fn loader(
    store: Arc<dyn KvStore>,
    namespace: &str,
    renewal: Duration,
) -> (Linker, Arc<HostKvPool>) {
    let g = geometry();
    let pool = Arc::new(HostKvPool::new(g.clone(), PAGES as u32).unwrap());
    let linker = Linker::new(g, store, pool.clone(), config(namespace, renewal)).unwrap();
    (linker, pool)
}

fn check_bytes(pool: &HostKvPool) {
    let g = geometry();
    for c in g.components() {
        for &l in &c.layers {
            for s in 0..PAGES as u32 {
                let mut got = vec![0u8; c.page_layer_bytes as usize];
                // SAFETY: read after the batch's outcome: no load writes the pool.
                unsafe { pool.read_slot(c.id, l, s, &mut got) }.unwrap();
                assert!(
                    got.iter().all(|&b| b == (l * 16 + s) as u8),
                    "layer {l} slot {s}"
                );
            }
        }
    }
}

#[test]
fn a_load_that_outlasts_several_renewals_keeps_its_session() {
    if !available(
        "a_load_that_outlasts_several_renewals_keeps_its_session",
        &["MOONCAKE_MASTER_BIN"],
    ) {
        return;
    }
    let master = PrivateMaster::start(&[]);
    let store: Arc<dyn KvStore> =
        Arc::new(MooncakeStore::connect(master.config(64 << 20)).expect("connect"));
    let ns = unique("renew");
    let tokens = save(store.clone(), &ns);

    // 8 layers of 60 ms each, renewed every 100 ms: about 4 renewals during the load.
    let counted = SessionCount::new(slow(store.clone(), Duration::from_millis(60)));
    let (linker, pool) = loader(counted.clone(), &ns, Duration::from_millis(100));
    let before = master.replica_queries();
    let t = linker
        .start_load(plan(linker.geometry(), 1, &tokens))
        .unwrap();
    for l in 0..LAYERS {
        linker.wait_layer(&t, l).unwrap();
    }
    assert!(linker.wait_batch(&t).unwrap().result.is_ok());
    linker.close().unwrap();
    let queries = master.replica_queries() - before;
    let starts = counted.starts();
    check_bytes(&pool);
    assert!(
        starts >= 3,
        "the load must outlast renewals: {starts} session starts"
    );
    assert!(
        queries <= starts + 1,
        "{queries} replica queries for {starts} session starts and {LAYERS} layer reads"
    );
}

#[test]
fn two_linkers_on_one_store_keep_each_others_sessions() {
    if !available(
        "two_linkers_on_one_store_keep_each_others_sessions",
        &["MOONCAKE_MASTER_BIN"],
    ) {
        return;
    }
    let master = PrivateMaster::start(&[]);
    let store: Arc<dyn KvStore> =
        Arc::new(MooncakeStore::connect(master.config(64 << 20)).expect("connect"));
    let ns = unique("shared");
    let tokens = save(store.clone(), &ns);

    // A reads slowly; B, on the same store, loads the same pages at full speed and ends its
    // session while A is mid-load. No renewals: each load starts exactly one session.
    let a_store = SessionCount::new(slow(store.clone(), Duration::from_millis(50)));
    let b_store = SessionCount::new(store.clone());
    let (a, a_pool) = loader(a_store.clone(), &ns, Duration::MAX);
    let (b, b_pool) = loader(b_store.clone(), &ns, Duration::MAX);
    let before = master.replica_queries();
    let ta = a.start_load(plan(a.geometry(), 1, &tokens)).unwrap();
    a.wait_layer(&ta, 1).unwrap();
    let tb = b.start_load(plan(b.geometry(), 1, &tokens)).unwrap();
    assert!(b.wait_batch(&tb).unwrap().result.is_ok());
    b.close().unwrap();
    for l in 0..LAYERS {
        a.wait_layer(&ta, l).unwrap();
    }
    assert!(a.wait_batch(&ta).unwrap().result.is_ok());
    a.close().unwrap();
    let queries = master.replica_queries() - before;
    let starts = a_store.starts() + b_store.starts();
    check_bytes(&a_pool);
    check_bytes(&b_pool);
    assert_eq!(starts, 2);
    // Each load also reads its checksum companions once, in a session of that call's own
    // (one query each); a session of A's ended by B would cost A a query per layer read after.
    let companion_reads = 2;
    assert!(
        queries <= starts + companion_reads + 1,
        "{queries} replica queries for {starts} session starts and {companion_reads} \
         companion reads: B's end ended A's session"
    );
}
