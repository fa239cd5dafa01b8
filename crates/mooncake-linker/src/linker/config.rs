//! Linker configuration.

use std::time::Duration;

use kv_geometry::Namespace;
use kv_loader::{Bandwidths, KvLoadError, ModeChoice, ShareMode};

use super::granularity::ReadGranularity;

/// How a linker names keys, bounds its waits and shares replicated components.
///
/// ```
/// use std::time::Duration;
/// use mooncake_linker::{LinkerConfig, Namespace};
/// // Keys prefixed by the model and its KV format (the default)...
/// let cfg = LinkerConfig::default();
/// assert_eq!(cfg.namespace, Namespace::Model);
/// assert_eq!(cfg.wait_deadline, Duration::from_secs(30));
/// // ...by a prefix of your own...
/// let mine = LinkerConfig { namespace: "glm52".into(), ..LinkerConfig::default() };
/// // ...or by SGLang's scheme, to share a cache with SGLang.
/// let shared = LinkerConfig {
///     namespace: Namespace::sglang("prod", "zai-org/GLM-5.2"),
///     ..LinkerConfig::default()
/// };
/// # let _ = (mine, shared);
/// ```
#[derive(Debug, Clone)]
pub struct LinkerConfig {
    /// Key prefix shared by every rank of a deployment. The default,
    /// [`Namespace::Model`], names the model and its KV format (model name, element types,
    /// page size, geometry fingerprint), so two models never read each other's objects;
    /// [`Namespace::sglang`] gives SGLang's keys; `"text".into()` any fixed prefix.
    pub namespace: Namespace,
    /// Context-parallel rank (in the key suffix).
    pub cp_rank: u32,
    /// Pipeline-parallel rank (in the key suffix).
    pub pp_rank: u32,
    /// Longest a `wait_layer` or `wait_batch` blocks, and `reset`, and `close` (one bound for
    /// the cancel, then a read ahead under way and the load thread), and one
    /// `store_call_timeout` more for `close` when the store's unregister hangs: an engine's
    /// shutdown watchdog allows for that.
    pub wait_deadline: Duration,
    /// Longest one store call of a layer's reads may take: a call still running then fails
    /// the batch at once (it is not waited for; the memory it writes is kept until it
    /// returns), and a layer whose reads took longer in all fails it too.
    pub layer_read_timeout: Duration,
    /// Renew read sessions (lease pins) this often during a load, between store calls. Keep
    /// it well under the store's lease (Mooncake's `default_kv_lease_ttl`: 10 s by default;
    /// the embedded store's `EmbeddedStore::DEFAULT_LEASE`: a minute): a call that ends after
    /// the lease its session took fails with `LEASE_EXPIRED` on Mooncake, and on the embedded
    /// store the objects may be evicted, so the renewal period plus one call's time (see
    /// `read_bytes_in_flight`) must stay under the lease. A session whose store says its lease
    /// ([`ReadSession::lease`](crate::store::ReadSession::lease)) is renewed at half that lease
    /// where it is shorter than this (at least every 50 ms). Zero is refused.
    pub lease_renewal: Duration,
    /// Check that each object's size matches the geometry (one store query per object,
    /// beside the first reads). Where every object has a checksum companion (and
    /// `verify_checksums` is on) the verdict is needed only before the last layer is handed
    /// over, since each layer's bytes are checked against their checksums anyway; otherwise it
    /// is needed before the first. Either way a batch with a wrong-sized object fails
    /// ([`PlanError::ObjectSize`](kv_loader::PlanError::ObjectSize)), and the object is
    /// discarded (the next save writes it again) where its key is in the model's namespace
    /// (`Namespace::Model`, which names the geometry) or kvlink wrote it (its checksum
    /// companion is there). One without a companion under another namespace, which other
    /// writers may share, is left in place (logged at `warn`): a writer of another geometry
    /// (SGLang with MTP draft layers) writes other sizes, and its cache is not ours to remove.
    /// Off, an object without a checksum companion (SGLang's) is checked by nothing at all:
    /// its "length-only" check is of the ranges read, which are as long as the geometry asks
    /// whatever the object holds, so a larger object laid out otherwise lands its wrong bytes.
    /// Turn it off only where every object has a companion, or the namespace is kvlink's alone.
    pub verify_object_sizes: bool,
    /// Check each (object, layer) range against the checksums kvlink wrote beside the object
    /// before the layer is reported loaded (objects without them, e.g. written by SGLang, are
    /// checked by length only; `LinkerMetrics` counts both). A range that fails fails the
    /// batch ([`KvLoadError::BadObject`](kv_loader::KvLoadError::BadObject)) and its object is
    /// discarded, so the next save writes it again.
    pub verify_checksums: bool,
    /// Checksum companions kept after a load (by object key, the oldest out first; 0: none),
    /// so that a later load of the same objects checks its layers without reading them again:
    /// a load's first layer waits for its companions (one small read per object, about 20 ms
    /// for a 32K-token GLM-5.2 prefix over TCP). A layer that fails against a kept checksum is
    /// checked again against its companion read afresh before its object is called bad. A
    /// lookup that finds pages reads their companions ahead into it (where this rank's reads
    /// are known then: docs/architecture.md, "Companions read at lookup"); 0 (or `verify_checksums` off) turns that off
    /// too. About
    /// 0.8 KB each for GLM-5.2 with its key (32,768: 25-35 MB, eight 128K-token prefixes per
    /// rank).
    pub checksum_cache_entries: usize,
    /// Start the read session a load reads under when its prefix is looked up, beside the
    /// companions' read ahead, so that the load takes it over instead of starting one before
    /// its first read (a master call: about 4 ms for a 32K-token GLM-5.2 prefix on the GPU
    /// host). Only where this rank's reads are known at the lookup. The pins of the last four
    /// lookups wait for their loads: each is held until the load that takes it ends, a later
    /// lookup's pins cover it, four later lookups have pinned, `reset` or `close`
    /// (docs/architecture.md, "Pins taken at lookup"). Default: on.
    pub pin_at_lookup: bool,
    /// Longest any store call other than a layer's reads may take (lookups, read sessions,
    /// sizes, checksums and their reads ahead of a load, saves, discards): past it the call fails with
    /// [`StoreError::Overdue`](crate::store::StoreError::Overdue) while it runs on (its memory
    /// is kept until it returns).
    pub store_call_timeout: Duration,
    /// Store calls each group's reads are split into, issued at once from scoped threads
    /// (1: one batched call per group of layers; 0 counts as 1). Stores whose batched call is
    /// served by one thread (the embedded store) read faster with more. At most
    /// [`MAX_READ_PARALLELISM`]: every store call runs on one of
    /// [`MAX_WORKERS`](crate::store::MAX_WORKERS) workers, which lookups, sessions and saves
    /// share (a linker refuses more).
    pub read_parallelism: usize,
    /// Threads one layer's checksum verification may use at most (a layer under 8 MiB is
    /// checked on the load thread alone; 0 counts as 1). The check sits on the load thread
    /// between a layer's read and its share step, so one core hashing a fast store's layer
    /// bounds the load: in `Rank0Broadcast` rank 0 checks every byte of every layer (GLM-5.2
    /// at 32K tokens: 22.7 MB per layer, about 4.7 ms on one core of the H200 host). Default:
    /// [`auto_verify_threads`] of this machine's cores (4 from 4 cores up).
    pub verify_threads: usize,
    /// Ask the store for each range's checksum as its bytes land
    /// ([`KvStore::get_ranges_checksummed`](crate::store::KvStore::get_ranges_checksummed)),
    /// so that a layer's check compares it instead of reading the rows again: a store that
    /// stages a read through its own memory (Mooncake's staged merge: several layers of a page
    /// in one range) takes it in the copy out of its staging, on its copy thread, while its
    /// next call is on the wire. Rows the store took none of are hashed by the check as
    /// before. Default: on; off, every row is hashed by the layer's check (the baseline the
    /// one-client bench measures it against).
    pub checksums_as_landed: bool,
    /// How many layers each store call reads: adaptive by default (groups planned per batch
    /// from measured costs and compute, layer 0 alone), or a fixed count.
    pub read_granularity: ReadGranularity,
    /// Bytes the ranks of a group may have in one store call each at once, with adaptive
    /// granularity: each call of a rank reads at most this divided by the ranks that read at
    /// the same time in the batch's mode (every rank in `AllRanks` and `SplitAllGather`, rank
    /// 0 alone in `Rank0Broadcast` unless every rank also reads sharded components of its
    /// own; every rank of the geometry's TP size for a rank loading
    /// without its group: no sharing, or alone while the group is down). A store's read leases (Mooncake's: 10 s by default) must
    /// outlast a call even when every rank reads at once: 2 GiB in flight over one storage
    /// node is about half a second on a 16-core host over TCP loopback.
    pub read_bytes_in_flight: u64,
    /// Objects per store call when saving (0 counts as 1).
    pub save_chunk: usize,
    /// Batches tracked at once (started and not yet taken; `Busy` past it; 0 counts as 1, and
    /// at most 65,536 are). A batch the engine abandoned (`abandon`, a dropped `LoadHandle`,
    /// a `wait_batch` that timed out) stops counting once its load is over (its place taken
    /// back when a start needs it), and a reset frees
    /// the count of the batches it ended; of their outcomes no one takes, this many are kept
    /// (those of abandoned batches go first, then the earliest started; never one a
    /// `SlotsHeld` answer named).
    pub max_in_flight: u32,
    /// How replicated components are shared among TP ranks (with a [`TpGroup`](crate::TpGroup);
    /// a linker without one always reads its own copy): `ModeChoice::Fixed(ShareMode::…)` or
    /// `ModeChoice::Auto` (both re-exported by this crate and the `kvlink` facade).
    ///
    /// ```
    /// use mooncake_linker::{LinkerConfig, ModeChoice, ShareMode};
    /// let split = LinkerConfig {
    ///     mode: ModeChoice::Fixed(ShareMode::SplitAllGather),
    ///     ..LinkerConfig::default()
    /// };
    /// let auto = LinkerConfig { mode: ModeChoice::Auto, ..LinkerConfig::default() };
    /// assert_ne!(split.mode, auto.mode);
    /// ```
    pub mode: ModeChoice,
    /// Store and fabric bandwidths `Auto` decides from when all four are given (GB/s); with
    /// any unknown, `Auto` measures each mode instead (`auto_batches_per_mode`).
    pub bandwidths: Bandwidths,
    /// Batches `Auto` measures each mode for before it keeps one (at least 1; modes that come
    /// out clearly slower after one round are not measured further; up to twice as many in a
    /// close call, where noise around the tie margin would decide the pick).
    pub auto_batches_per_mode: u32,
    /// Longest a rank waits in one collective for its peers (keep it above
    /// `layer_read_timeout`: in `Rank0Broadcast` the others wait for rank 0's read; a lower
    /// value is allowed, with a warning at build, and a slow read then shows on the peers as a
    /// collective timeout). It also
    /// bounds a rank's own preflight in a TP group: the checksum companions (and, where some
    /// object has none, the object sizes) must be in within four fifths of it after the
    /// batch's gate, else the batch fails on that rank with
    /// [`StoreFailure::RpcTimeout`](kv_loader::StoreFailure::RpcTimeout) and every rank reads
    /// that failure in the status word (rather than timing out). Keep `store_call_timeout`
    /// under it for the same reason. In a group, each layer of a rank (its pin or session
    /// renewal and its read together) must also be in within nine tenths of it after the gate
    /// (layer 0) or the previous layer's status exchange, or that rank reports `RpcTimeout`
    /// for the layer on every rank.
    pub collective_timeout: Duration,
    /// What a batch or lookup does while the TP group is down (broken and not re-formed in
    /// time, e.g. a rank process died and is not back yet).
    pub group_fallback: GroupFallback,
}

/// What a linker does while its TP group is down.
///
/// ```
/// use mooncake_linker::{GroupFallback, LinkerConfig};
/// let engine_can_run_alone = LinkerConfig {
///     group_fallback: GroupFallback::ReadAlone,
///     ..LinkerConfig::default()
/// };
/// assert_eq!(LinkerConfig::default().group_fallback, GroupFallback::Fail);
/// # let _ = engine_can_run_alone;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GroupFallback {
    /// Batches and lookups fail while the group is down (the engine recomputes); the
    /// default. The batch whose gate finds a peer gone fails by the collective's timeout
    /// (`KvLoadError::Collective`); later ones fail with `KvLoadError::GroupDown` once the
    /// group cannot be formed again, or by their own gate's timeout where a formation builds
    /// fresh handles at once (ranks as threads).
    #[default]
    Fail,
    /// Each rank loads alone: it reads its own copy of every component, with no collective
    /// (`AllRanks` without the group), and its outcome says so (`LoadStats::alone`); a
    /// lookup returns this rank's own hit, not the group's minimum (the engine must agree on
    /// the prefix itself). Only for engines whose ranks can still run while kvlink's group is
    /// down. "Down" is each rank's own finding, so a rank whose gate (or lookup collective)
    /// then fails because a peer went alone goes alone too, and so does a rank whose gate finds
    /// the group already at a later batch (its peers settled this one alone and met again
    /// after it): every rank ends such a batch loaded, none failed while another loaded it.
    /// A rank behind whose peers gave up waiting for it settles the batches it is still
    /// behind on as their last gate words said: it fails one a rank ahead did not load alone.
    ReadAlone,
}

/// The default [`LinkerConfig::verify_threads`] on a machine with `cores` CPUs: one per core,
/// at most 4.
///
/// Hashing is CPU work: threads beyond the cores only take turns. On the 2-core development
/// machine, loading a 32K-token GLM-5.2 prefix with its checksums, 4 threads per layer were
/// the slowest or tied in two runs (in the second, of 1, 2 and 4: no compute, last layer 1953
/// ms against 1833 / 1757; with 10 ms of compute per layer, forward done 2007 against 2008 /
/// 1851); 4 on the 16-core
/// GPU host, where it was measured to speed up rank 0 of `Rank0Broadcast` (docs/benchmarks.md).
///
/// ```
/// use mooncake_linker::auto_verify_threads;
/// assert_eq!(auto_verify_threads(1), 1);
/// assert_eq!(auto_verify_threads(2), 2);
/// assert_eq!(auto_verify_threads(16), 4);
/// assert_eq!(auto_verify_threads(0), 1);
/// ```
pub fn auto_verify_threads(cores: usize) -> usize {
    cores.clamp(1, 4)
}

/// The most store calls a group's reads may be split into
/// ([`LinkerConfig::read_parallelism`]).
pub const MAX_READ_PARALLELISM: usize = 64;

impl LinkerConfig {
    /// The values no linker can run with, refused at build (and by a
    /// [`PrefixProbe`](crate::PrefixProbe) of its store bound): a zero bound (every store call,
    /// read or collective would fail at once), a zero `lease_renewal` (a session start before
    /// every store call), a `read_parallelism` past [`MAX_READ_PARALLELISM`], and an adaptive
    /// granularity's prior that is not [valid](crate::read_plan::ReadCost::is_valid) (it was
    /// replaced by the default unsaid).
    pub(crate) fn check(&self) -> Result<(), KvLoadError> {
        let bounds = [
            ("layer_read_timeout", self.layer_read_timeout),
            ("store_call_timeout", self.store_call_timeout),
            ("collective_timeout", self.collective_timeout),
            ("wait_deadline", self.wait_deadline),
        ];
        if let Some((name, _)) = bounds.iter().find(|(_, d)| d.is_zero()) {
            return Err(KvLoadError::config(format!(
                "LinkerConfig::{name} is zero: every call it bounds would fail at once"
            )));
        }
        if self.lease_renewal.is_zero() {
            return Err(KvLoadError::config(
                "LinkerConfig::lease_renewal is zero: a read session would be started again \
                 before every store call",
            ));
        }
        if self.read_parallelism > MAX_READ_PARALLELISM {
            return Err(KvLoadError::config(format!(
                "LinkerConfig::read_parallelism is {}, past {MAX_READ_PARALLELISM}: each of a \
                 load's calls takes one of the {} store-call workers the linker's lookups, \
                 sessions and saves share, and the calls past them would fail every batch",
                self.read_parallelism,
                crate::store::MAX_WORKERS
            )));
        }
        if let ReadGranularity::Adaptive { prior, .. } = self.read_granularity {
            if !prior.is_valid() {
                return Err(KvLoadError::config(format!(
                    "the adaptive read granularity's prior {prior:?} is not valid (a cost \
                     per byte that is negative or not finite)"
                )));
            }
        }
        Ok(())
    }
}

impl Default for LinkerConfig {
    fn default() -> Self {
        LinkerConfig {
            namespace: Namespace::Model,
            cp_rank: 0,
            pp_rank: 0,
            wait_deadline: Duration::from_secs(30),
            layer_read_timeout: Duration::from_secs(20),
            lease_renewal: Duration::from_secs(2),
            verify_object_sizes: true,
            verify_checksums: true,
            checksum_cache_entries: 32_768,
            pin_at_lookup: true,
            store_call_timeout: Duration::from_secs(20),
            read_parallelism: 1,
            checksums_as_landed: true,
            verify_threads: auto_verify_threads(
                std::thread::available_parallelism().map_or(1, usize::from),
            ),
            read_granularity: ReadGranularity::ADAPTIVE,
            read_bytes_in_flight: 2 << 30,
            save_chunk: 64,
            max_in_flight: 64,
            mode: ModeChoice::Fixed(ShareMode::AllRanks),
            bandwidths: Bandwidths {
                store_per_rank_gbps: f64::NAN,
                store_aggregate_gbps: f64::NAN,
                fabric_broadcast_gbps: f64::NAN,
                fabric_all_gather_gbps: f64::NAN,
            },
            auto_batches_per_mode: 3,
            collective_timeout: Duration::from_secs(25),
            group_fallback: GroupFallback::Fail,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(c: LinkerConfig) -> String {
        match c.check() {
            Err(e @ KvLoadError::Config(_)) => e.to_string(),
            other => panic!("{other:?}"),
        }
    }

    /// The values no linker can run with are refused as `Config`, saying which; the defaults
    /// and the largest `read_parallelism` are not.
    #[test]
    fn values_no_linker_can_run_with_are_refused() {
        LinkerConfig::default().check().unwrap();
        let most = LinkerConfig {
            read_parallelism: MAX_READ_PARALLELISM,
            ..LinkerConfig::default()
        };
        most.check().unwrap();
        let e = refused(LinkerConfig {
            store_call_timeout: Duration::ZERO,
            ..LinkerConfig::default()
        });
        assert!(e.contains("store_call_timeout"), "{e}");
        let e = refused(LinkerConfig {
            lease_renewal: Duration::ZERO,
            ..LinkerConfig::default()
        });
        assert!(e.contains("lease_renewal"), "{e}");
        let e = refused(LinkerConfig {
            read_parallelism: MAX_READ_PARALLELISM + 1,
            ..LinkerConfig::default()
        });
        assert!(e.contains("read_parallelism"), "{e}");
    }
}
