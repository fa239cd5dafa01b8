//! The linker's one public constructor: [`Linker::builder`] and its options.

use std::sync::Arc;

use kv_device::{DeviceKvPool, KvPool, LandingFactory, StagedLandingFactory, StagingPool};
use kv_geometry::KvGeometry;
use kv_loader::KvLoadError;

use super::{Linker, LinkerConfig, TpGroup};
use crate::store::KvStore;

/// How to build a [`Linker`]: the geometry, the store and the pool, then options. Without
/// options it is a single rank over a host pool with [`LinkerConfig::default`].
///
/// ```
/// use std::sync::Arc;
/// use kv_device::HostKvPool;
/// use kv_geometry::{page_hashes, ElementType, KvGeometry, ModelKvSpec};
/// use kv_loader::{BatchId, BatchPlan, KvLoader, RequestPages};
/// use mooncake_linker::{store::EmbeddedStore, Linker, LinkerConfig};
///
/// let g = KvGeometry::new(ModelKvSpec::deepseek_v3(ElementType::Fp8E4m3), 1, 0).unwrap();
/// let pool = Arc::new(HostKvPool::new(g.clone(), 8).unwrap());
/// let linker = Linker::builder(g.clone(), Arc::new(EmbeddedStore::new(1 << 30)), pool)
///     .config(LinkerConfig::default())
///     .build()
///     .unwrap();
///
/// // Lookup and save speak page hashes (the hashes of a prefix cache keyed by block hash).
/// let tokens: Vec<u32> = (0..128).collect();
/// let pages = page_hashes(&tokens, g.page_size(), None);
/// assert!(linker.lookup_pages(&pages, 0).unwrap().pages.is_empty());
/// let req = vec![RequestPages { request: "r1".into(), pages: pages.clone() }];
/// linker.save(&BatchPlan::all_components(&g, BatchId(1), req, vec![0, 1])).unwrap();
/// assert_eq!(linker.lookup_pages(&pages, 0).unwrap().pages, pages);
/// linker.close().unwrap();
/// ```
#[must_use = "a builder does nothing until `build`"]
pub struct LinkerBuilder {
    geometry: KvGeometry,
    store: Arc<dyn KvStore>,
    pool: Arc<dyn KvPool>,
    landings: Option<Arc<dyn LandingFactory>>,
    config: LinkerConfig,
    group: Option<TpGroup>,
}

impl std::fmt::Debug for LinkerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkerBuilder").finish_non_exhaustive()
    }
}

impl Linker {
    /// A builder for the linker of rank `geometry.tp_rank` over `store`, landing into
    /// `pool`. A host pool needs nothing more; a device pool lands through its backend
    /// ([`Linker::builder_staged`], or [`LinkerBuilder::landings`]).
    pub fn builder(
        geometry: KvGeometry,
        store: Arc<dyn KvStore>,
        pool: Arc<dyn KvPool>,
    ) -> LinkerBuilder {
        LinkerBuilder {
            geometry,
            store,
            pool,
            landings: None,
            config: LinkerConfig::default(),
            group: None,
        }
    }

    /// A builder for a device pool landing through pinned `staging` on its device (the
    /// pool passed once: the builder makes the [`StagedLandingFactory`]).
    pub fn builder_staged(
        geometry: KvGeometry,
        store: Arc<dyn KvStore>,
        pool: Arc<DeviceKvPool>,
        staging: Arc<StagingPool>,
    ) -> LinkerBuilder {
        let landings: Arc<dyn LandingFactory> =
            Arc::new(StagedLandingFactory::new(pool.clone(), staging));
        Self::builder(geometry, store, pool).landings(landings)
    }
}

impl LinkerBuilder {
    /// The linker's configuration (default: [`LinkerConfig::default`]).
    pub fn config(mut self, config: LinkerConfig) -> Self {
        self.config = config;
        self
    }

    /// Share replicated components with a TP group (default: none, a single rank). Every
    /// rank of the group must then call `lookup` and `start_load` in the same order.
    pub fn group(mut self, group: TpGroup) -> Self {
        self.group = Some(group);
        self
    }

    /// [`group`](Self::group) when `group` is `Some`.
    pub fn maybe_group(mut self, group: Option<TpGroup>) -> Self {
        self.group = group;
        self
    }

    /// Land batches through `landings` (a backend's factory over this builder's pool)
    /// instead of the host pool's direct landings.
    pub fn landings(mut self, landings: Arc<dyn LandingFactory>) -> Self {
        self.landings = Some(landings);
        self
    }

    /// Starts the linker's load thread. `Config` errors: a device pool without landings, a
    /// pool of another geometry, a group that does not match the geometry or the landings.
    pub fn build(self) -> Result<Linker, KvLoadError> {
        let landings = match self.landings {
            Some(l) => l,
            None => Linker::host_landings(&self.pool)?,
        };
        if let Some(g) = &self.group {
            Linker::check_group(&self.geometry, g, landings.as_ref(), self.pool.as_ref())?;
        }
        Linker::build(
            self.geometry,
            self.store,
            self.pool,
            landings,
            self.config,
            self.group,
        )
    }
}
