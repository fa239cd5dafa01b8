//! One batch's load on one rank, layer by layer.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kv_device::{DirectLanding, LayerLanding};
use kv_loader::{BatchPlan, KvLoadError, LoadStats, LoadTicket, ShareMode};
use tracing::{debug, debug_span, info_span};

use super::reader::{store_failure, ComponentKeys, LayerReader};
use super::session::PinnedKeys;
use super::Shared;

/// A batch handed to the load thread.
pub(crate) struct BatchJob {
    pub(crate) plan: BatchPlan,
    pub(crate) ticket: LoadTicket,
    pub(crate) epoch: u64,
    pub(crate) started: Instant,
}

impl Shared {
    /// The keys of every planned component, in plan page order.
    pub(crate) fn component_keys(
        &self,
        plan: &BatchPlan,
    ) -> Result<Vec<ComponentKeys>, KvLoadError> {
        let mut out = Vec::with_capacity(plan.logical.components.len());
        for id in &plan.logical.components {
            let layout = self.geometry.component(*id)?.clone();
            let keys = plan
                .logical
                .pages()
                .map(|p| self.keys.object_key(p, &layout))
                .collect();
            out.push(ComponentKeys { layout, keys });
        }
        Ok(out)
    }

    fn cancelled(&self, job: &BatchJob) -> bool {
        self.epoch.load(Ordering::Acquire) != job.epoch
    }

    /// Loads every layer of `job` into the pool, marking each ready as it lands.
    pub(crate) fn run_batch(&self, job: &BatchJob) -> Result<LoadStats, KvLoadError> {
        let batch = job.plan.logical.batch;
        let pages = job.plan.logical.num_pages();
        let span = info_span!("load_batch", %batch, pages);
        let _enter = span.enter();
        let components = self.component_keys(&job.plan)?;
        let reader = LayerReader {
            store: self.store.as_ref(),
            batch,
            components: &components,
        };
        let all_keys: Vec<&str> = components
            .iter()
            .flat_map(|c| c.keys.iter().map(String::as_str))
            .collect();
        let mut pins = PinnedKeys::start(self.store.as_ref(), &all_keys, self.config.lease_renewal)
            .map_err(|e| store_failure(batch, None, Vec::new(), &e))?;
        if self.config.verify_object_sizes {
            reader.verify_sizes()?;
        }
        let mut landing = DirectLanding::new(self.pool.clone(), job.plan.slots.clone().into());
        let mut bytes_read = 0;
        let mut first_layer = Duration::ZERO;
        for layer in 0..self.geometry.num_layers() {
            if self.cancelled(job) {
                return Err(KvLoadError::Cancelled { batch });
            }
            pins.renew_if_due()
                .map_err(|e| store_failure(batch, Some(layer), Vec::new(), &e))?;
            let _layer_span = debug_span!("layer", layer).entered();
            let t0 = Instant::now();
            bytes_read += reader.read_layer(&mut landing, layer, 0..pages)?;
            let took = t0.elapsed();
            self.metrics.layer_read(took);
            if took > self.config.layer_read_timeout {
                return Err(KvLoadError::Store {
                    batch: Some(batch),
                    layer: Some(layer),
                    pages: (0..pages as u32).collect::<Vec<_>>().into(),
                    kind: kv_loader::StoreFailure::RpcTimeout,
                    detail: format!(
                        "layer read took {took:?}, over the limit of {:?}",
                        self.config.layer_read_timeout
                    ),
                });
            }
            let ready = landing.land(layer).map_err(KvLoadError::from)?;
            self.publish(job, layer, ready);
            if layer == 0 {
                first_layer = job.started.elapsed();
            }
            debug!(layer, ?took, "layer ready");
        }
        self.metrics.read(bytes_read);
        Ok(LoadStats {
            pages: pages as u32,
            layers: self.geometry.num_layers(),
            bytes_read,
            bytes_landed: bytes_read,
            mode: ShareMode::AllRanks,
            first_layer,
            last_layer: job.started.elapsed(),
        })
    }
}
