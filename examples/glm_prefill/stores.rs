//! The store(s) of a run: the embedded store, or one Mooncake client per rank.

use super::*;

/// The store(s) of a run: one handle per rank (the same embedded store for all, or one
/// Mooncake client per rank), and how to name them in every table.
pub(super) struct Stores {
    pub(super) per_rank: Vec<Arc<dyn KvStore>>,
    pub(super) embedded: Option<Arc<EmbeddedStore>>,
    pub(super) label: String,
    pub(super) sharing: String,
}

pub(super) fn open_stores(args: &Args, prefix_bytes: u64) -> Result<Stores> {
    match args.store {
        StoreKind::Embedded => {
            let store = Arc::new(EmbeddedStore::new(
                prefix_bytes + prefix_bytes / 8 + (64 << 20),
            ));
            let per_rank = (0..args.tp)
                .map(|_| store.clone() as Arc<dyn KvStore>)
                .collect();
            Ok(Stores {
                per_rank,
                embedded: Some(store),
                label: args.store.label().to_string(),
                sharing: "its own Linker over one shared EmbeddedStore (a map in this \
                          process's memory: a store read is a memory copy, no network)"
                    .into(),
            })
        }
        StoreKind::Mooncake => {
            let how =
                "run it under scripts/with-mooncake.sh (after scripts/mooncake-build-shim.sh), \
                       which starts a master on loopback and sets MOONCAKE_MASTER and the other \
                       MOONCAKE_* variables";
            let config = MooncakeConfig::from_env()
                .map_err(|e| Unavailable(format!("--store mooncake: {e}; {how}")))?;
            let mut per_rank: Vec<Arc<dyn KvStore>> = Vec::new();
            for rank in 0..args.tp {
                let store = MooncakeStore::connect(config.clone()).map_err(|e| {
                    Unavailable(format!(
                        "--store mooncake: rank {rank}: connecting to the Mooncake master at {}: \
                         {e}; {how}",
                        config.master_addr()
                    ))
                })?;
                store
                    .health()
                    .map_err(|e| Unavailable(format!("--store mooncake: rank {rank}: {e}")))?;
                per_rank.push(Arc::new(store));
            }
            Ok(Stores {
                per_rank,
                embedded: None,
                label: format!(
                    "mooncake ({}, master {})",
                    config.protocol_name(),
                    config.master_addr()
                ),
                sharing: format!(
                    "its own Linker and its own Mooncake client ({}, master {}; each client \
                     lends {} to the store)",
                    config.protocol_name(),
                    config.master_addr(),
                    bytes(config.global_segment_bytes())
                ),
            })
        }
    }
}
