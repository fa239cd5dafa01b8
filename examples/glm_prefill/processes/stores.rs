//! The store a rank process uses, with no setup: the launcher's (`--store-at`), rank 0's
//! embedded store served through the rendezvous, or its own Mooncake client.

use std::sync::Arc;

use anyhow::{Context, Result};
use kvlink::dedup_broadcast::Rendezvous;
use kvlink::mooncake_linker::store::mooncake::{MooncakeConfig, MooncakeStore};
use kvlink::mooncake_linker::store::{
    served_location, EmbeddedStore, KvStore, ServeAt, SocketStore, StoreServer,
};
use kvlink::mooncake_linker::{serve_group_store, FormedTpGroup};

use super::super::Unavailable;
use crate::args::{Args, StoreKind};

/// The rendezvous attribute that carries rank 0's key namespace (a fresh one per run with
/// Mooncake, whose objects outlive the run).
pub(super) const NAMESPACE_ATTRIBUTE: &str = "glm_prefill.namespace";

/// A rank's store before the group forms.
pub(super) enum Opened {
    /// Ready (the launcher's, or a Mooncake client).
    Ready(Arc<dyn KvStore>),
    /// Rank 0 keeps the embedded store and serves it (the server lives as long as this).
    Serving {
        store: Arc<EmbeddedStore>,
        _server: StoreServer,
    },
    /// Another rank: rank 0 announces the store in the rendezvous.
    FromRankZero,
}

/// What the report says about the store (short: every table row carries it).
pub(super) fn label(args: &Args) -> String {
    match (args.store, &args.procs.store_at) {
        (StoreKind::Embedded, Some(_)) => "embedded, served by the launcher (Unix socket)".into(),
        (StoreKind::Embedded, None) => "embedded, served by rank 0 (Unix socket)".into(),
        (StoreKind::Mooncake, _) => match MooncakeConfig::from_env() {
            Ok(c) => format!(
                "mooncake ({}, master {}; one client per rank process)",
                c.protocol_name(),
                c.master_addr()
            ),
            Err(_) => "mooncake".into(),
        },
    }
}

/// Where the store is, in words, for the header.
pub(super) fn whereabouts(args: &Args, formed: &FormedTpGroup) -> String {
    match (args.store, &args.procs.store_at) {
        (StoreKind::Embedded, Some(at)) => format!(
            "the launcher keeps the embedded store and serves it to every rank process at {}",
            served_location(at)
        ),
        (StoreKind::Embedded, None) => format!(
            "rank 0 keeps the embedded store and serves it to the other rank processes at {} \
             (the address travelled in the rendezvous)",
            formed
                .attributes
                .get(kvlink::mooncake_linker::store::STORE_ATTRIBUTE)
                .map_or("?", |a| served_location(a))
        ),
        (StoreKind::Mooncake, _) => {
            "each rank process has its own Mooncake client (MOONCAKE_* environment)".into()
        }
    }
}

/// Opens this rank's store before the group forms (rank 0 of the embedded store starts
/// serving it and announces it in `rendezvous`).
pub(super) fn open(
    args: &Args,
    rank: u32,
    capacity: u64,
    rendezvous: &mut Rendezvous,
) -> Result<Opened> {
    if let Some(at) = &args.procs.store_at {
        let s = SocketStore::connect(at).with_context(|| {
            format!(
                "rank {rank}: the launcher's store at {}",
                served_location(at)
            )
        })?;
        return Ok(Opened::Ready(Arc::new(s)));
    }
    match args.store {
        StoreKind::Embedded if rank == 0 => {
            let store = Arc::new(EmbeddedStore::new(capacity));
            let server = serve_group_store(rendezvous, store.clone(), ServeAt::Unix)
                .context("rank 0: serving the embedded store")?;
            Ok(Opened::Serving {
                store,
                _server: server,
            })
        }
        StoreKind::Embedded => Ok(Opened::FromRankZero),
        StoreKind::Mooncake => {
            let how = "run every rank process under scripts/with-mooncake.sh (after \
                       scripts/mooncake-build-shim.sh), or with the MOONCAKE_* variables set";
            let config = MooncakeConfig::from_env()
                .map_err(|e| Unavailable(format!("--store mooncake: {e}; {how}")))?;
            let store = MooncakeStore::connect(config.clone()).map_err(|e| {
                Unavailable(format!(
                    "--store mooncake: rank {rank}: connecting to the Mooncake master at {}: {e}",
                    config.master_addr()
                ))
            })?;
            store
                .health()
                .map_err(|e| Unavailable(format!("--store mooncake: rank {rank}: {e}")))?;
            Ok(Opened::Ready(Arc::new(store)))
        }
    }
}

impl Opened {
    /// The store once the group formed (the others' client of rank 0's store).
    pub(super) fn resolve(&self, formed: &FormedTpGroup, rank: u32) -> Result<Arc<dyn KvStore>> {
        match self {
            Opened::Ready(s) => Ok(s.clone()),
            Opened::Serving { store, .. } => Ok(store.clone() as Arc<dyn KvStore>),
            Opened::FromRankZero => formed
                .store(None)
                .with_context(|| format!("rank {rank}: rank 0's store"))?
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "rank {rank}: rank 0 announced no store (started with --store-at?)"
                    )
                }),
        }
    }

    /// The embedded store held by this process, if any.
    pub(super) fn embedded(&self) -> Option<&Arc<EmbeddedStore>> {
        match self {
            Opened::Serving { store, .. } => Some(store),
            _ => None,
        }
    }
}
