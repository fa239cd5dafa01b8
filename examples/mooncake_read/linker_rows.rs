//! The `Linker` itself as a reader: one rank (TP 1) loading every layer of the bench's objects
//! into a host pool with its default read granularity (adaptive layer groups) and its
//! `MooncakeStore` defaults (staged merge, read streams), while an engine thread waits for
//! each layer and then computes it (SIMULATED: the thread sleeps). The objects are the
//! bench's, read under their own namespace, so the Python baseline reads the same bytes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvlink::kv_device::{HostKvPool, KvPool};
use kvlink::kv_geometry::{page_hashes, KvGeometry, ModelKvSpec, PageHash};
use kvlink::kv_loader::{BatchId, BatchPlan, KvLoader, RequestPages};
use kvlink::mooncake_linker::store::mooncake::{MooncakeConfig, MooncakeStore};
use kvlink::mooncake_linker::{Linker, LinkerConfig, ShareMode};

use crate::args::{Args, Companions, OnOff};
use crate::objects::Objects;

/// What one load took (seconds from `start_load`).
pub struct LinkerTiming {
    pub first: f64,
    pub last: f64,
    /// The engine's last layer computed.
    pub forward_done: f64,
    /// Layers per store call.
    pub groups: Vec<u32>,
}

/// What one Linker row varies.
#[derive(Debug, Clone, Copy)]
pub struct RowSpec {
    /// The engine's compute per layer (SIMULATED by a sleep).
    pub compute: Duration,
    /// `MC_TCP_LANES_PER_PEER` of its client (0: the wheel's default).
    pub lanes: usize,
    /// `read_streams` of its store (0: the store's default).
    pub streams: usize,
    /// `LinkerConfig::verify_threads` (0: the library's default).
    pub verify_threads: usize,
    /// `LinkerConfig::checksums_as_landed`.
    pub as_landed: bool,
    /// How it gets its checksum companions.
    pub companions: Companions,
    /// With `Companions::AtLookup*`: the engine's time between lookup and load (SIMULATED).
    pub lookup_gap: Duration,
}

impl RowSpec {
    /// Every row the flags ask for: each companions setting × checksums as landed × verify
    /// threads × read streams × TCP lanes × compute.
    pub fn every(a: &Args) -> Vec<RowSpec> {
        let or_default = |v: &[usize]| if v.is_empty() { vec![0] } else { v.to_vec() };
        let (verify, streams, lanes) = (
            or_default(&a.linker_verify_threads),
            or_default(&a.linker_streams),
            or_default(&a.linker_lanes),
        );
        let mut specs = Vec::new();
        for &companions in &a.linker_companions {
            for &landed in &a.linker_as_landed {
                for &verify_threads in &verify {
                    for &streams in &streams {
                        for &lanes in &lanes {
                            specs.extend(a.linker_compute_us.iter().map(|&us| RowSpec {
                                compute: Duration::from_micros(us),
                                lanes,
                                streams,
                                verify_threads,
                                as_landed: landed == OnOff::On,
                                companions,
                                lookup_gap: Duration::from_micros(a.linker_lookup_gap_us),
                            }));
                        }
                    }
                }
            }
        }
        specs
    }

    /// The table's columns for what this row varies: TCP lanes, read streams (`default_streams`
    /// where 0), verify threads, checksums as landed, checksum companions (`none_written`: the
    /// bench wrote none).
    pub fn columns(&self, default_streams: usize, none_written: bool) -> [String; 5] {
        let or_default = |v: usize, default: String| {
            if v == 0 {
                format!("{default} (default)")
            } else {
                v.to_string()
            }
        };
        [
            or_default(self.lanes, "4".into()),
            or_default(self.streams, default_streams.to_string()),
            or_default(
                self.verify_threads,
                LinkerConfig::default().verify_threads.to_string(),
            ),
            if self.as_landed {
                "as landed (default)".into()
            } else {
                "hashed by the check".into()
            },
            match self.companions {
                _ if none_written => "none written (length checks after a size query)".into(),
                Companions::EveryLoad => "read by every load".into(),
                Companions::Kept => "kept from round 1 (rounds 2+ read none)".into(),
                c => {
                    let before = if c.read_at_lookup() {
                        "read at lookup,"
                    } else {
                        "kept from round 1; looked up"
                    };
                    let pinned = if c.pins_at_lookup() {
                        "at lookup (default)"
                    } else {
                        "by the load"
                    };
                    format!(
                        "{before} {:.0} ms (SIMULATED) before start_load; objects pinned {pinned}",
                        self.lookup_gap.as_secs_f64() * 1e3
                    )
                }
            },
        ]
    }
}

/// A linker over its own Mooncake client, loading into a pool shared with the other linker
/// readers (they run one at a time).
pub struct LinkerReader {
    pub spec: RowSpec,
    linker: Linker,
    pool: Arc<HostKvPool>,
    hashes: Vec<PageHash>,
    slots: Vec<u32>,
    batch: u64,
}

/// The pool every linker reader lands in: one slot per page.
pub fn pool(objects: &Objects) -> Result<Arc<HostKvPool>> {
    let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0)?;
    Ok(Arc::new(HostKvPool::new(g, objects.pages as u32)?))
}

impl LinkerReader {
    /// A linker with the library's defaults but for what `spec` sets, reading the bench's
    /// objects (`namespace`), over a new client of `config` (no segment of its own).
    pub fn new(
        config: &MooncakeConfig,
        namespace: &str,
        tokens: u32,
        pool: Arc<HostKvPool>,
        spec: RowSpec,
    ) -> Result<Self> {
        let RowSpec {
            lanes,
            streams,
            verify_threads,
            as_landed,
            companions,
            ..
        } = spec;
        let config = if streams > 0 {
            config.clone().read_streams(streams)
        } else {
            config.clone()
        };
        // The wheel reads MC_TCP_LANES_PER_PEER when a client's transport is created; it is
        // set around this connect only, while no client has a transfer in flight.
        if lanes > 0 {
            std::env::set_var("MC_TCP_LANES_PER_PEER", lanes.to_string());
        }
        let store = MooncakeStore::connect(config.clone());
        if lanes > 0 {
            std::env::remove_var("MC_TCP_LANES_PER_PEER");
        }
        let store = store.with_context(|| format!("connecting to {}", config.master_addr()))?;
        let g = pool.geometry().clone();
        let token_ids: Vec<u32> = (0..tokens).collect();
        let hashes = page_hashes(&token_ids, g.page_size(), None);
        let n = hashes.len() as u32;
        // Scattered slots, as an engine's allocator hands them out.
        let slots: Vec<u32> = (0..n).map(|i| (i * 389 + 17) % n.max(1)).collect();
        if n.is_multiple_of(389) {
            bail!("slot permutation degenerate for {n} pages");
        }
        let linker = Linker::new(
            g,
            Arc::new(store),
            pool.clone(),
            LinkerConfig {
                namespace: namespace.into(),
                wait_deadline: Duration::from_secs(120),
                checksum_cache_entries: match companions {
                    Companions::EveryLoad => 0,
                    _ => LinkerConfig::default().checksum_cache_entries,
                },
                pin_at_lookup: companions.pins_at_lookup(),
                checksums_as_landed: as_landed,
                verify_threads: if verify_threads > 0 {
                    verify_threads
                } else {
                    LinkerConfig::default().verify_threads
                },
                ..LinkerConfig::default()
            },
        )?;
        Ok(Self {
            spec,
            linker,
            pool,
            hashes,
            slots,
            batch: 0,
        })
    }

    /// One load of every page; on `check`, the pool is compared with the objects afterwards.
    pub fn run(&mut self, objects: &Objects, check: bool) -> Result<LinkerTiming> {
        self.batch += 1;
        let plan = BatchPlan::all_components(
            self.linker.geometry(),
            BatchId(self.batch),
            vec![RequestPages {
                request: "bench".into(),
                pages: self.hashes.clone(),
            }],
            self.slots.clone(),
        );
        let first_load = self.spec.companions.read_at_lookup();
        if first_load || self.spec.companions.kept_at_lookup() {
            // A load as an engine makes it: lookup, its scheduling and allocation (SIMULATED:
            // a sleep), then the load; a first load of the prefix forgets what was kept.
            if first_load {
                self.linker.forget_kept_checksums();
            }
            let hit = self.linker.lookup_pages(&self.hashes, 0)?;
            if hit.pages.len() != self.hashes.len() {
                bail!(
                    "lookup found {} of {} pages",
                    hit.pages.len(),
                    self.hashes.len()
                );
            }
            std::thread::sleep(self.spec.lookup_gap);
        }
        if check {
            // The readers share one pool and land the same pages in the same slots: without
            // zeroing, a reader that landed nothing would pass on the previous reader's bytes.
            // SAFETY: the readers run one at a time and each takes its batch's outcome before
            // returning, so no load or save of the pool is in flight, and nothing else
            // touches it.
            unsafe { self.pool.clear() };
        }
        let start = Instant::now();
        let ticket = self.linker.start_load(plan)?;
        let layers = self.linker.num_layers();
        // When each layer is ready: a watcher waits for every layer as it comes, apart from
        // the engine thread, which reaches layer l only after computing the layers before it
        // (its own arrival would floor "last layer ready" at the modelled compute).
        let (ready, engine) = std::thread::scope(|s| {
            let watcher = s.spawn(|| {
                let mut ready = Vec::with_capacity(layers as usize);
                for l in 0..layers {
                    if let Err(e) = self.linker.wait_layer(&ticket, l) {
                        bail!("layer {l} (the ready-time watcher): {e}");
                    }
                    ready.push(start.elapsed().as_secs_f64());
                }
                Ok(ready)
            });
            let engine = (0..layers).try_for_each(|l| {
                self.linker.wait_layer(&ticket, l)?;
                if !self.spec.compute.is_zero() {
                    std::thread::sleep(self.spec.compute);
                }
                Ok::<_, kvlink::kv_loader::KvLoadError>(())
            });
            let watched = watcher
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("the ready-time watcher panicked")));
            (watched, engine)
        });
        engine?;
        // A layer the watcher did not see ready fails the round: its times would be missing.
        let ready = ready?;
        let forward_done = start.elapsed().as_secs_f64();
        let stats = self.linker.wait_batch(&ticket)?.result?;
        if check {
            self.verify(objects)?;
            crate::check_passed();
        }
        Ok(LinkerTiming {
            first: ready.first().copied().unwrap_or(f64::NAN),
            last: ready.last().copied().unwrap_or(f64::NAN),
            forward_done,
            groups: stats.read_groups,
        })
    }

    /// Every slot holds its object's bytes.
    fn verify(&self, objects: &Objects) -> Result<()> {
        let g = self.pool.geometry().clone();
        for (ci, c) in g.components().iter().enumerate() {
            let lb = c.page_layer_bytes as usize;
            let mut got = vec![0u8; lb];
            let mut want = vec![0u8; c.object_bytes() as usize];
            for (p, &slot) in self.slots.iter().enumerate() {
                objects.expected_object(ci, p, &mut want);
                for (pos, &l) in c.layers.iter().enumerate() {
                    // SAFETY: the batch's outcome was taken: nothing writes the pool now.
                    unsafe { self.pool.read_slot(c.id, l, slot, &mut got) }?;
                    if got[..] != want[pos * lb..(pos + 1) * lb] {
                        bail!("linker: {} page {p} layer {l}: bytes differ", c.name);
                    }
                }
            }
        }
        Ok(())
    }

    /// The linker's measured compute per layer and call cost, for the table.
    pub fn measured(&self) -> String {
        // One rank: every batch reads as `AllRanks`.
        let cost = self.linker.read_cost(ShareMode::AllRanks);
        let m = self.linker.metrics();
        format!(
            "compute measured {}, call cost {:.1} ms + {:.2} GB/s; ranges checked by checksum {} ({} of them hashed by the store as they landed), by length only {}; loads that took their lookup's pins {} of {}",
            self.linker
                .compute_per_layer()
                .map_or("—".into(), |c| format!("{:.1} ms", c.as_secs_f64() * 1e3)),
            cost.per_call.as_secs_f64() * 1e3,
            1e-9 / cost.seconds_per_byte,
            m.ranges_checksummed,
            m.ranges_checksummed_as_landed,
            m.ranges_length_only,
            m.pins_ahead_taken,
            m.batches_loaded,
        )
    }
}
