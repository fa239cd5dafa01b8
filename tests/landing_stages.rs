//! A landing an engine supplies must lend at least two stages (the reader holds one for a
//! group of layers while the exchange loop lands the layer before): one that lends fewer fails
//! the batch at once, with a typed error naming why, not at layer 1 as an internal failure;
//! one that panics fails the batch with an error naming the panic.

mod common;

use std::sync::Arc;
use std::time::Instant;

use common::*;
use kvlink::kv_device::{
    BatchShape, DeviceError, DirectLanding, HostKvPool, LandingFactory, LayerLanding, LayerStage,
    ReadTarget, SaveGather, SharePath, ShareSide, StageLoan, StoreRegion,
};
use kvlink::kv_geometry::{
    checksum_key, ComponentId, ComponentSpec, ElementType, KeyScheme, KvGeometry, ModelKvSpec,
    RowUnit,
};
use kvlink::kv_loader::{KvLoadError, KvLoader, LayerReady, TransferBytes};
use kvlink::mooncake_linker::store::{EmbeddedStore, KvStore};
use kvlink::mooncake_linker::{Linker, LinkerConfig};

/// A host landing's defects (as in one an engine supplied): it lends only the first
/// `stages` of its stages, panics opening layer `panic_at`, and gives plan page `short_page`'s
/// slices one byte short.
#[derive(Clone, Copy)]
struct Defects {
    stages: usize,
    panic_at: Option<u32>,
    short_page: Option<usize>,
}

/// A host landing with [`Defects`].
struct OneStage(DirectLanding, Defects);

impl LayerLanding for OneStage {
    fn take_stages(&mut self) -> Vec<LayerStage> {
        self.0
            .take_stages()
            .into_iter()
            .take(self.1.stages)
            .collect()
    }
    fn open(&self, stage: &mut LayerStage, layer: u32, by: Instant) -> Result<(), DeviceError> {
        assert_ne!(
            Some(layer),
            self.1.panic_at,
            "injected: the landing panics opening layer {layer}"
        );
        self.0.open(stage, layer, by)
    }
    fn lend(&self, stage: &mut LayerStage) -> Result<StageLoan, DeviceError> {
        self.0.lend(stage)
    }
    fn target(
        &self,
        loan: &StageLoan,
        component: ComponentId,
        plan_page: usize,
    ) -> Result<ReadTarget, DeviceError> {
        self.0.target(loan, component, plan_page)
    }
    fn target_bytes<'s>(
        &'s self,
        stage: &'s LayerStage,
        component: ComponentId,
        plan_page: usize,
    ) -> Result<&'s [u8], DeviceError> {
        let bytes = self.0.target_bytes(stage, component, plan_page)?;
        Ok(match self.1.short_page {
            Some(p) if p == plan_page => &bytes[..bytes.len().saturating_sub(1)],
            _ => bytes,
        })
    }
    fn land(&self, stage: &mut LayerStage) -> Result<LayerReady, DeviceError> {
        self.0.land(stage)
    }
    fn poison(&self, stage: &mut LayerStage) {
        self.0.poison(stage)
    }
    fn transfers(&self) -> Vec<TransferBytes> {
        self.0.transfers()
    }
    fn share(&self) -> ShareSide<'_> {
        self.0.share()
    }
}

struct OneStageLandings(Arc<HostKvPool>, Defects);

impl LandingFactory for OneStageLandings {
    fn begin(
        &self,
        slots: Arc<[u32]>,
        shape: BatchShape,
    ) -> Result<Box<dyn LayerLanding>, DeviceError> {
        let direct = DirectLanding::new(self.0.clone(), slots, shape)?;
        Ok(Box::new(OneStage(direct, self.1)))
    }
    fn store_regions(&self) -> Vec<StoreRegion> {
        Vec::new()
    }
    fn share_path(&self) -> SharePath {
        SharePath::Host
    }
    fn begin_save(&self, _slots: Arc<[u32]>) -> Result<Box<dyn SaveGather>, DeviceError> {
        Err(DeviceError::Unavailable("no saves in this test".into()))
    }
}

/// A linker over a one-stage landing, and batch 1 of a 3-page prefix of `spec` saved for it,
/// started into slots `slots`: the linker, the ticket, the pool and the prefix's pages.
fn one_stage_load(spec: ModelKvSpec, slots: Vec<u32>) -> OneStageLoad {
    let defects = Defects {
        stages: 1,
        panic_at: None,
        short_page: None,
    };
    landing_load(spec, slots, defects)
}

/// [`one_stage_load`] over a landing with `defects`.
fn landing_load(spec: ModelKvSpec, slots: Vec<u32>, defects: Defects) -> OneStageLoad {
    landing_load_with(spec, slots, defects, true)
}

/// [`landing_load`], the objects' checksum companions removed first unless `companions`
/// (objects as another writer saves them).
fn landing_load_with(
    spec: ModelKvSpec,
    slots: Vec<u32>,
    defects: Defects,
    companions: bool,
) -> OneStageLoad {
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 24));
    let cfg = LinkerConfig::default();
    let tokens = prompt(31, 3, spec.page_size);
    let pages = save_prefix(&spec, store.clone(), &tokens, &cfg);
    let g = KvGeometry::new(spec, 1, 0).unwrap();
    if !companions {
        let scheme = KeyScheme::new(&cfg.namespace.resolve(&g), 0, 0, 0);
        for page in &pages {
            for c in g.components() {
                let key = checksum_key(&scheme.object_key(page, c));
                assert_eq!(store.remove(&[key.as_str()]), vec![Ok(())], "{key}");
            }
        }
    }
    let pool = Arc::new(HostKvPool::new(g.clone(), 3).unwrap());
    let linker = Linker::with_landings(
        g.clone(),
        store.clone(),
        pool.clone(),
        Arc::new(OneStageLandings(pool.clone(), defects)),
        cfg,
        None,
    )
    .unwrap();
    let t = linker.start_load(load_plan(&g, 1, &pages, slots)).unwrap();
    OneStageLoad {
        linker,
        t,
        pool,
        pages,
        store,
    }
}

struct OneStageLoad {
    store: Arc<dyn KvStore>,
    linker: Linker,
    t: kvlink::kv_loader::LoadTicket,
    pool: Arc<HostKvPool>,
    pages: Vec<kvlink::kv_geometry::PageHash>,
}

/// A landing that panics opening layer 1 fails the batch with an error naming the panic.
/// Before, the reader's panic was dropped at its join and the batch failed with "the reader
/// stopped before layer 1" alone.
#[test]
fn a_landing_that_panics_fails_the_batch_naming_the_panic() {
    let spec = small_spec();
    assert!(spec.num_layers >= 3);
    let defects = Defects {
        stages: 4,
        panic_at: Some(1),
        short_page: None,
    };
    let OneStageLoad { linker, t, .. } = landing_load(spec, vec![0, 1, 2], defects);
    let outcome = linker.wait_batch(&t).unwrap().result;
    assert!(
        matches!(&outcome, Err(e @ KvLoadError::Internal { .. })
            if e.to_string().contains("the landing panics opening layer 1")),
        "{outcome:?}"
    );
}

#[test]
fn a_landing_that_lends_one_stage_fails_the_batch_at_once_with_why() {
    let spec = small_spec();
    assert!(spec.num_layers >= 2);
    let OneStageLoad { linker, t, .. } = one_stage_load(spec, vec![0, 1, 2]);
    assert!(linker.wait_layer(&t, 0).is_err(), "layer 0 published");
    let outcome = linker.wait_batch(&t).unwrap().result;
    assert!(
        matches!(&outcome, Err(e @ KvLoadError::Device(_)) if e.to_string().contains("fewer than two stages")),
        "{outcome:?}"
    );
}

/// A model of one layer needs one stage: a landing that lends one loads it.
#[test]
fn a_one_layer_model_loads_through_one_stage() {
    let k = ComponentSpec::new("k", RowUnit::Token, ElementType::Bytes, 16);
    let spec = ModelKvSpec::new("one-layer", 1, 4, vec![k]).unwrap();
    let OneStageLoad {
        linker,
        t,
        pool,
        pages,
        ..
    } = one_stage_load(spec, vec![2, 0, 1]);
    linker.wait_layer(&t, 0).unwrap();
    linker.wait_batch(&t).unwrap().result.unwrap();
    pool_matches(&pool, &pages, &[2, 0, 1], 1).unwrap();
}

/// A landed slice that does not fit its layout (one byte short) is the landing's defect, not
/// the object's: the store read returned every byte. The batch fails as internal and the
/// objects stay. Before, the check took it for a bad object and discarded it from the store
/// (at once without a companion; after reading the companion again with one).
#[test]
fn a_landing_slice_that_does_not_fit_fails_the_batch_and_keeps_the_object() {
    for companions in [true, false] {
        let defects = Defects {
            stages: 4,
            panic_at: None,
            short_page: Some(0),
        };
        let OneStageLoad {
            linker,
            t,
            pages,
            store,
            ..
        } = landing_load_with(small_spec(), vec![0, 1, 2], defects, companions);
        let g = linker.geometry().clone();
        let scheme = KeyScheme::new(&LinkerConfig::default().namespace.resolve(&g), 0, 0, 0);
        let outcome = linker.wait_batch(&t).unwrap().result;
        assert!(
            matches!(&outcome, Err(e @ KvLoadError::Internal { .. })
                if e.to_string().contains("does not fit its layout")),
            "companions {companions}: {outcome:?}"
        );
        for c in g.components() {
            let key = scheme.object_key(&pages[0], c);
            assert_eq!(
                store.exists(&[key.as_str()]),
                vec![Ok(true)],
                "companions {companions}: `{key}` kept"
            );
        }
    }
}
