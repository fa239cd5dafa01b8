//! Failure symmetry at TP 3, on both paths (host pools with host rows; device pools on CPU
//! devices): a failure on rank 0, the middle rank or the last rank, at the first, a middle or
//! the last layer, gives every rank the same verdict without waiting for a deadline, and the
//! next batch loads; a device error in a rank's share step is reported in the next status
//! word (or the verdict after the last layer).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::tp::{
    config, fail_v_read, mixed_spec, paths, rank_matches, run, run_ok, run_timed, same_verdict,
    tp_ranks, tp_ranks_built, Path, RankBuild, TpRank,
};
use kvlink::dedup_broadcast::{CollectiveError, GroupFormation, GroupHandles};
use kvlink::kv_device::cpu::CpuOp;
use kvlink::kv_device::ScatterStrategy;
use kvlink::kv_geometry::PageHash;
use kvlink::kv_loader::{KvLoadError, KvLoader, ShareMode};
use kvlink::mooncake_linker::store::{EmbeddedStore, Fault, FaultCall, FaultRule, KvStore, Stall};
use kvlink::mooncake_linker::{LinkerConfig, TpGroup};

/// A formation whose re-formation ends 100 ms past the caller's deadline (as an NCCL group's
/// start-up or a rendezvous's connect may: their own bounds may end past it).
struct LateFormation(Arc<dyn GroupFormation>);

impl GroupFormation for LateFormation {
    fn reform(
        &self,
        rank: u32,
        epoch: u64,
        deadline: Instant,
    ) -> Result<GroupHandles, CollectiveError> {
        let formed = self.0.reform(rank, epoch, deadline);
        let late = deadline + Duration::from_millis(100);
        std::thread::sleep(late.saturating_duration_since(Instant::now()));
        formed
    }
}

/// A lookup whose re-formation ended past the lookup's deadline still agrees on the hit: its
/// exchange has a bound of its own. Before, the gather timed out at once and aborted the group
/// every rank had just formed (and again at the next re-formation).
#[test]
fn a_lookup_after_a_late_re_formation_still_agrees() {
    let spec = mixed_spec();
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let cfg = LinkerConfig {
        collective_timeout: Duration::from_millis(600),
        ..config(ShareMode::AllRanks)
    };
    let controls = std::sync::Mutex::new(Vec::new());
    let wrap = |_rank: u32, g: TpGroup| {
        controls.lock().unwrap().push(g.control.clone());
        TpGroup {
            formation: g
                .formation
                .clone()
                .map(|f| Arc::new(LateFormation(f)) as Arc<dyn GroupFormation>),
            ..g
        }
    };
    let (rs, hashes) = common::tp::tp_ranks_built(
        &spec,
        2,
        store,
        4,
        &cfg,
        Path::Host,
        &common::tp::RankBuild::wrapped(&wrap),
    );
    for c in controls.lock().unwrap().iter() {
        c.abort("test: a lookup's collective failed");
    }
    let pages = &hashes;
    let hits: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = rs
            .iter()
            .map(|r| s.spawn(move || r.linker.lookup_pages(pages, 0)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, hit) in hits.iter().enumerate() {
        let hit = hit.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(hit.pages.len(), 4, "rank {rank}");
    }
    // The group formed is left whole: the next batch loads on it.
    run_ok(&rs, 1, &hashes, "after the late re-formation");
}

const MODES: [ShareMode; 3] = [
    ShareMode::AllRanks,
    ShareMode::Rank0Broadcast,
    ShareMode::SplitAllGather,
];

#[test]
fn a_read_failure_on_any_rank_at_any_layer_fails_every_rank_alike_on_both_paths() {
    let spec = mixed_spec();
    for path in paths() {
        for mode in MODES {
            let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
            let (rs, hashes) = tp_ranks(&spec, 3, store, 6, &config(mode), path);
            let mut batch = 1;
            let mut own_seen = [0u64; 3];
            for fail_rank in [0u32, 1, 2] {
                for layer in [0u32, 2, 4] {
                    let what = format!("{path:?} {mode:?} rank {fail_rank} layer {layer}");
                    // The failing rank's read of its own shard at `layer`: in every mode.
                    let r = &rs[fail_rank as usize];
                    let key = format!("tp{fail_rank}_cp0_pp0_v");
                    fail_v_read(&r.faults, r.linker.geometry(), key, layer);
                    let t0 = Instant::now();
                    let outcomes = run(&rs, batch, &hashes);
                    assert!(
                        t0.elapsed() < Duration::from_secs(4),
                        "{what}: no deadline waited"
                    );
                    same_verdict(&outcomes, fail_rank, layer, &what);
                    // Only the failing rank counts the failure as its own, by its kind (every
                    // rank's outcome is `peer_failed`). Before, no rank counted it at all.
                    own_seen[fail_rank as usize] += 1;
                    for (rank, r) in rs.iter().enumerate() {
                        let m = r.linker.metrics();
                        let own = m.own_failures.get("store_transfer").copied().unwrap_or(0);
                        assert_eq!(own, own_seen[rank], "{what}: rank {rank}");
                        assert_eq!(m.own_failures.len(), usize::from(own > 0), "{what}");
                    }
                    for (rank, (r, o)) in rs.iter().zip(run(&rs, batch + 1, &hashes)).enumerate() {
                        o.result
                            .unwrap_or_else(|e| panic!("{what}: next batch, rank {rank}: {e}"));
                        rank_matches(r, &hashes, rank as u32).unwrap();
                    }
                    batch += 2;
                }
            }
        }
    }
}

/// Row-copy launches one rank's device runs per layer with the kernel strategy (one per row
/// block scattered from device staging, one for its own `v` rows), before layer `layer`.
fn launches_before(mode: ShareMode, layer: u32) -> u32 {
    (0..layer)
        .map(|l| {
            let shared = 1 + u32::from(l == 1 || l == 4);
            let blocks = match mode {
                ShareMode::SplitAllGather => 3 * shared,
                _ => shared,
            };
            blocks + 1
        })
        .sum()
}

#[test]
fn a_device_error_in_a_share_step_is_reported_next_and_the_next_batch_loads() {
    let spec = mixed_spec();
    let path = Path::device_per_rank(ScatterStrategy::Kernel);
    for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
        let (rs, hashes) = tp_ranks(&spec, 3, store, 6, &config(mode), path);
        let mut batch = 1;
        for (layer, reported) in [(2u32, 3u32), (4, 5)] {
            let what = format!("{mode:?} scatter on rank 1 at layer {layer}");
            // The middle rank's scatter of `layer` fails to enqueue, after it entered the
            // layer's collective: every rank learns it at the next exchange (the verdict for
            // the last layer).
            rs[1]
                .device
                .as_ref()
                .unwrap()
                .fail_enqueue(CpuOp::Rows, launches_before(mode, layer));
            let outcomes = run(&rs, batch, &hashes);
            same_verdict(&outcomes, 1, reported, &what);
            for (rank, (r, o)) in rs.iter().zip(run(&rs, batch + 1, &hashes)).enumerate() {
                o.result
                    .unwrap_or_else(|e| panic!("{what}: next batch, rank {rank}: {e}"));
                rank_matches(r, &hashes, rank as u32).unwrap();
            }
            batch += 2;
        }
    }
}

/// A store object whose bytes no longer match the checksums written with it: the rank that
/// reads it finds it before it shares or lands the layer, reports it in that layer's status
/// word, and every rank fails alike; the object is discarded, so the next save writes it again
/// and the batch after loads.
#[test]
fn a_corrupt_object_fails_every_rank_alike_at_its_layer_and_is_replaced() {
    for path in paths() {
        for mode in MODES {
            let group = Group::saved(path, mode);
            let (store, rs, hashes) = (&group.store, &group.ranks, &group.hashes);
            let mut batch = 1;
            for (fail_rank, layer) in [(0u32, 0u32), (1, 2), (2, 4)] {
                let what = format!("{path:?} {mode:?} rank {fail_rank} layer {layer}");
                // The failing rank's own shard of `v`, page 3: read by that rank alone.
                let key = corrupt(store, &rs[fail_rank as usize], hashes, ("v", 3, layer));
                let outcomes = run(rs, batch, hashes);
                same_verdict(&outcomes, fail_rank, layer, &what);
                assert!(
                    outcomes[0]
                        .result
                        .as_ref()
                        .unwrap_err()
                        .to_string()
                        .contains("bad_object"),
                    "{what}: {:?}",
                    outcomes[0].result
                );
                group.replaced_and_loaded(&key, batch + 1, &what);
                batch += 2;
            }
        }
    }
}

/// A corrupt object of a replicated component, read by one rank for the group (rank 0 in
/// `Rank0Broadcast`, the page's owner in `SplitAllGather`), its checksums taken by the store
/// as the rows landed: that rank finds it at its layer before it shares the layer, every rank
/// fails alike, and once saved again the next batch loads with every range the reading ranks
/// checked compared against the store's checksums.
#[test]
fn a_corrupt_replicated_object_is_found_by_the_rank_that_reads_it_for_the_group() {
    for path in paths() {
        for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
            let group = Group::saved(path, mode);
            let (store, rs, hashes) = (&group.store, &group.ranks, &group.hashes);
            let shares = kvlink::dedup_broadcast::page_shares(6, 3);
            let mut batch = 1;
            for (page, layer) in [(1usize, 0u32), (3, 2), (5, 4)] {
                let reader = match mode {
                    ShareMode::SplitAllGather => {
                        shares.iter().position(|s| s.contains(&page)).unwrap() as u32
                    }
                    _ => 0,
                };
                let what = format!("{path:?} {mode:?} page {page} (rank {reader}) layer {layer}");
                let key = corrupt(store, &rs[0], hashes, ("k", page, layer));
                let outcomes = run(rs, batch, hashes);
                same_verdict(&outcomes, reader, layer, &what);
                group.replaced_and_loaded(&key, batch + 1, &what);
                batch += 2;
            }
            for (rank, r) in rs.iter().enumerate() {
                let m = r.linker.metrics();
                assert!(
                    m.ranges_checksummed > 0,
                    "{path:?} {mode:?} rank {rank}: {m:?}"
                );
                assert_eq!(
                    m.ranges_checksummed_as_landed, m.ranges_checksummed,
                    "{path:?} {mode:?} rank {rank}"
                );
            }
        }
    }
}

/// A TP 3 group of ranks over one embedded store, with the prefix it saved (6 pages of
/// [`mixed_spec`]).
struct Group {
    store: Arc<dyn KvStore>,
    ranks: Vec<TpRank>,
    hashes: Vec<PageHash>,
    config: LinkerConfig,
}

impl Group {
    /// The group on `path`, loading in `mode`, its prefix saved.
    fn saved(path: Path, mode: ShareMode) -> Self {
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
        let config = config(mode);
        let (ranks, hashes) = tp_ranks(&mixed_spec(), 3, store.clone(), 6, &config, path);
        Group {
            store,
            ranks,
            hashes,
            config,
        }
    }

    /// After a batch that found object `key` bad: it was discarded; the engine recomputes
    /// and saves (the object is written again), and batch `next` loads on every rank.
    fn replaced_and_loaded(&self, key: &str, next: u64, what: &str) {
        assert_eq!(
            self.store.exists(&[key]),
            vec![Ok(false)],
            "{what}: discarded"
        );
        common::tp::save(&mixed_spec(), 3, self.store.clone(), 6, &self.config);
        let outcomes = run(&self.ranks, next, &self.hashes);
        for (rank, (r, o)) in self.ranks.iter().zip(outcomes).enumerate() {
            o.result
                .unwrap_or_else(|e| panic!("{what}: next batch, rank {rank}: {e}"));
            rank_matches(r, &self.hashes, rank as u32).unwrap();
        }
    }
}

/// Flips one byte of layer `layer` in the object of component `comp` at plan page `page` (`at`)
/// as rank `r` keys it (its companion kept: the object no longer matches its checksums); its
/// key.
fn corrupt(
    store: &Arc<dyn KvStore>,
    r: &TpRank,
    hashes: &[PageHash],
    at: (&str, usize, u32),
) -> String {
    let (comp, page, layer) = at;
    let g = r.linker.geometry().clone();
    let plan = common::load_plan(&g, 0, hashes, r.slots.clone());
    let c = g.component_by_name(comp).unwrap();
    let key = r.linker.object_keys(&plan).unwrap()[c.id.0 as usize][page].clone();
    let mut bytes = vec![0u8; c.object_bytes() as usize];
    let get = kvlink::mooncake_linker::store::ObjectGet {
        key: &key,
        dst: bytes.as_mut_ptr(),
        len: bytes.len(),
    };
    // SAFETY: `bytes` is ours and untouched during the call.
    assert!(unsafe { store.get_into(&[get]) }[0].is_ok());
    bytes[c.layer_range(layer).unwrap().start as usize + 5] ^= 0xff;
    assert_eq!(store.remove(&[&key]), vec![Ok(())]);
    let put = kvlink::mooncake_linker::store::ObjectPut {
        key: &key,
        parts: [(bytes.as_ptr(), bytes.len())].into_iter().collect(),
    };
    // SAFETY: `bytes` is live and unchanged during the call.
    assert!(unsafe { store.put(&[put]) }[0].is_ok());
    key
}

/// A rank whose read fails while its size check hangs on the store hands the failed layer
/// over before its peers stop waiting for it: every rank gets the same verdict from the status
/// word (a peer that timed out would fail with a collective error instead, and the group would
/// be aborted) and the peers' batches end well within two collective timeouts; the failing
/// rank's own batch ends once its hung size query is given up (`store_call_timeout`); once the
/// store answers again the next batch loads. A middle rank of three, at a middle layer and at
/// the last (whose hand-over needs the sizes' verdict), in both sharing modes.
#[test]
fn a_failed_read_does_not_wait_past_the_peers_for_a_hung_size_check() {
    let spec = mixed_spec();
    let collective = Duration::from_secs(2);
    let last = spec.num_layers - 1;
    for (mode, layer) in [
        (ShareMode::Rank0Broadcast, 2),
        (ShareMode::SplitAllGather, 2),
        (ShareMode::SplitAllGather, last),
    ] {
        let cfg = LinkerConfig {
            collective_timeout: collective,
            layer_read_timeout: Duration::from_secs(1),
            // How long the hung size query is waited for (before the mend, by the failed
            // read's hand-over too, so the peers timed out).
            store_call_timeout: Duration::from_millis(2500),
            verify_object_sizes: true,
            ..config(mode)
        };
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
        let (rs, hashes) = tp_ranks(&spec, 3, store, 6, &cfg, Path::Host);
        let what = format!("{mode:?} layer {layer}");
        let stall = Stall::new();
        let r = &rs[1];
        fail_v_read(
            &r.faults,
            r.linker.geometry(),
            "tp1_cp0_pp0_v".into(),
            layer,
        );
        r.faults.inject_on(
            FaultCall::Size,
            FaultRule::default(),
            Fault::Stall(stall.clone()),
        );
        let t0 = Instant::now();
        let (outcomes, ended) = run_timed(&rs, 1, &hashes);
        stall.release();
        assert!(stall.hits() > 0, "{what}: the size check was held");
        same_verdict(&outcomes, 1, layer, &what);
        peers_ended_by(&ended, t0, collective * 2, &what);
        r.faults.clear();
        run_ok(&rs, 2, &hashes, &what);
    }
}

/// `SplitAllGather` with a 2 s collective timeout and a store call's deadline past it (2.5 s):
/// a rank's slow companions outlast what its peers wait for layer 0. The config and the
/// collective timeout.
fn companions_config() -> (LinkerConfig, Duration) {
    let collective = Duration::from_secs(2);
    let cfg = LinkerConfig {
        collective_timeout: collective,
        layer_read_timeout: Duration::from_secs(1),
        store_call_timeout: Duration::from_millis(2500),
        ..config(ShareMode::SplitAllGather)
    };
    (cfg, collective)
}

/// A rank whose checksum companions hang on the store (their whole-object read) fails its
/// first layer before its peers stop waiting for it: every rank gets that rank's failure at
/// layer 0 from the status word, the peers' batches end in time, and the next batch loads once
/// the store answers. A middle rank of three.
#[test]
fn hung_checksum_companions_fail_layer_0_before_the_peers_stop_waiting() {
    let spec = mixed_spec();
    let (cfg, collective) = companions_config();
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let (rs, hashes) = tp_ranks(&spec, 3, store, 6, &cfg, Path::Host);
    let stall = Stall::new();
    let sizes = Stall::new();
    let r = &rs[1];
    r.faults.inject_on(
        FaultCall::ReadWhole,
        FaultRule::default(),
        Fault::Stall(stall.clone()),
    );
    // Its size queries would hang too: once the companions failed the batch they are not
    // asked at all.
    r.faults.inject_on(
        FaultCall::Size,
        FaultRule::default(),
        Fault::Stall(sizes.clone()),
    );
    let t0 = Instant::now();
    let (outcomes, ended) = run_timed(&rs, 1, &hashes);
    stall.release();
    sizes.release();
    assert!(stall.hits() > 0, "the companions' read was held");
    assert_eq!(
        sizes.hits(),
        0,
        "no size query after the companions failed the batch"
    );
    same_verdict(&outcomes, 1, 0, "companions");
    peers_ended_by(&ended, t0, collective * 2, "companions");
    r.faults.clear();
    run_ok(&rs, 2, &hashes, "after the companions hung");
}

/// A rank whose pin finds an object gone (evicted since the lookup) while its checksum
/// companions are still being read, past the bound its peers allow: every rank fails layer 0
/// with the pin's `NotFound`, the companions' verdict taken only if it came in by then.
/// Before, the companions' verdict was required by that bound as if nothing had failed, and
/// their lateness replaced the pin's error: the batch failed as an RPC timeout, pointing
/// operators at a slow store instead of an evicted object. A middle rank of three.
#[test]
fn an_object_gone_at_the_pin_is_reported_over_slow_companions() {
    let spec = mixed_spec();
    let (cfg, collective) = companions_config();
    let cfg = LinkerConfig {
        pin_at_lookup: false,
        ..cfg
    };
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let (rs, hashes) = tp_ranks(&spec, 3, store.clone(), 6, &cfg, Path::Host);
    let r = &rs[1];
    // Rank 1's own shard of `v` for page 0: gone from the store.
    let plan = common::load_plan(r.linker.geometry(), 1, &hashes, r.slots.clone());
    let v = r.linker.geometry().component_by_name("v").unwrap().id.0 as usize;
    let gone = r.linker.object_keys(&plan).unwrap()[v][0].clone();
    assert_eq!(store.remove(&[gone.as_str()]), vec![Ok(())]);
    // Its companions' read takes longer than the peers wait for layer 0 (four fifths of the
    // collective timeout), within its own store call's deadline.
    r.faults.inject_on(
        FaultCall::ReadWhole,
        FaultRule::default(),
        Fault::Delay(Duration::from_millis(1900)),
    );
    let t0 = Instant::now();
    let (outcomes, ended) = run_timed(&rs, 1, &hashes);
    same_verdict(&outcomes, 1, 0, "pin");
    let e = outcomes[0].result.as_ref().unwrap_err().to_string();
    assert!(
        e.contains("not_found"),
        "the pin's error, not the companions' lateness: {e}"
    );
    peers_ended_by(&ended, t0, collective * 2, "pin");
}

/// A rank whose pin and first read each stay within their own deadlines, but together run past
/// the time its peers wait for layer 0's status word, reports a timeout in that word before
/// they stop waiting: every rank gets its failure at layer 0 (a peer that timed out would fail
/// with a collective error instead and abort the group), the peers' batches end within two
/// collective timeouts, and the next batch loads. A middle rank of three, in both sharing
/// modes that wait for it.
#[test]
fn a_slow_pin_and_first_read_fail_layer_0_before_the_peers_stop_waiting() {
    let spec = mixed_spec();
    // The rank gives up on layer 0 at 9 s (nine tenths), a second before its peers would:
    // room for a loaded CI machine.
    let collective = Duration::from_secs(10);
    for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
        let cfg = LinkerConfig {
            collective_timeout: collective,
            layer_read_timeout: Duration::from_millis(7000),
            store_call_timeout: Duration::from_millis(7000),
            pin_at_lookup: false,
            ..config(mode)
        };
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
        let (rs, hashes) = tp_ranks(&spec, 3, store, 6, &cfg, Path::Host);
        let what = format!("{mode:?}");
        let r = &rs[1];
        let once = || FaultRule {
            times: Some(1),
            ..FaultRule::default()
        };
        // 5.4 s + 5.4 s: each call within its 7 s, together past the peers' 10 s.
        r.faults.inject_on(
            FaultCall::Session,
            once(),
            Fault::Delay(Duration::from_millis(5400)),
        );
        r.faults.inject_on(
            FaultCall::Read,
            FaultRule {
                offset: Some(0),
                ..once()
            },
            Fault::Delay(Duration::from_millis(5400)),
        );
        let t0 = Instant::now();
        let (outcomes, ended) = run_timed(&rs, 1, &hashes);
        same_verdict(&outcomes, 1, 0, &what);
        peers_ended_by(&ended, t0, collective * 2, &what);
        r.faults.clear();
        run_ok(&rs, 2, &hashes, &what);
    }
}

/// The same at a later layer: a rank whose session renewal and read of layer 1 each stay
/// within their own deadlines, but together run past the time its peers wait for layer 1's
/// status word, reports a timeout in that word before they stop waiting. Its pin (the same
/// session call) is slow too, within what layer 0 allows. A middle rank of three.
#[test]
fn a_slow_renewal_and_read_fail_a_later_layer_before_the_peers_stop_waiting() {
    let spec = mixed_spec();
    // As above: 9 s for the rank, 10 s for its peers.
    let collective = Duration::from_secs(10);
    let cfg = LinkerConfig {
        collective_timeout: collective,
        layer_read_timeout: Duration::from_millis(7000),
        store_call_timeout: Duration::from_millis(7000),
        // The renewal falls due between layer 0's read and layer 1's: the period counts from
        // the pin's start (5.4 s before it returned), layer 0's read ends a second later.
        lease_renewal: Duration::from_secs(6),
        pin_at_lookup: false,
        ..config(ShareMode::SplitAllGather)
    };
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let (rs, hashes) = tp_ranks(&spec, 3, store, 6, &cfg, Path::Host);
    let r = &rs[1];
    let v = r.linker.geometry().component_by_name("v").unwrap().clone();
    // One key of rank 1's sessions: its pin, then its first renewal (before layer 1's read),
    // each take 5.4 s; then layer 1's read takes 5.4 s.
    let one_key = format!("{}_tp1_cp0_pp0_v", hashes[0].to_hex());
    r.faults.inject_on(
        FaultCall::Session,
        FaultRule {
            key_contains: Some(one_key),
            times: Some(2),
            ..FaultRule::default()
        },
        Fault::Delay(Duration::from_millis(5400)),
    );
    // Layer 0's read takes 1 s, so the renewal is due before layer 1's (6.4 s after the pin
    // began), not before layer 0's (5.4 s).
    for (layer, ms) in [(0, 1000), (1, 5400)] {
        r.faults.inject(
            FaultRule {
                key_contains: Some("tp1_cp0_pp0_v".into()),
                offset: Some(v.layer_range(layer).unwrap().start),
                times: Some(1),
                ..FaultRule::default()
            },
            Fault::Delay(Duration::from_millis(ms)),
        );
    }
    let t0 = Instant::now();
    let (outcomes, ended) = run_timed(&rs, 1, &hashes);
    same_verdict(&outcomes, 1, 1, "renewal");
    peers_ended_by(&ended, t0, collective * 3, "renewal");
    r.faults.clear();
    run_ok(&rs, 2, &hashes, "after the slow renewal");
}

/// A panic on a rank's load thread (here in a collective the engine supplied, at a middle
/// layer's status exchange) fails that rank's batch with `Internal` instead of taking the load
/// thread down: the batch's outcome is delivered, its peers fail within two collective
/// timeouts, and the next batch loads on every rank (the group re-formed). A middle rank of
/// three.
#[test]
fn a_panic_on_a_load_thread_fails_its_batch_and_the_next_batch_loads() {
    // The device path's ring of two stages leaves the reader waiting for a free stage while
    // the exchange loop unwinds: it must learn at once that the loop left.
    let panics = common::coll::Misbehave::PanicAtLayer { layer: 2 };
    middle_rank_misbehaves(panics, |what, outcomes, took| {
        match &outcomes[1].result {
            Err(e @ KvLoadError::Internal { .. }) => {
                assert!(e.to_string().contains("panicked"), "{what}: {e}")
            }
            other => panic!("{what}: rank 1: {other:?}"),
        }
        assert!(
            took[1] < COLLECTIVE * 2,
            "{what}: rank 1 ended after {:?}",
            took[1]
        );
        for peer in [0, 2] {
            assert!(outcomes[peer].result.is_err(), "{what}: rank {peer} loaded");
        }
    });
}

/// The `collective_timeout` of [`middle_rank_misbehaves`].
const COLLECTIVE: Duration = Duration::from_secs(2);

/// Rank 1 of three (`SplitAllGather`, [`COLLECTIVE`]) misbehaves `how` in batch 1, on each
/// pool path: `judge` checks the ranks' outcomes and how long each took; the peers end within
/// two collective timeouts, batch 2 loads on every rank, and every rank re-formed the group
/// exactly once.
fn middle_rank_misbehaves(
    how: common::coll::Misbehave,
    judge: impl Fn(&str, &[kvlink::kv_loader::BatchOutcome], &[Duration]),
) {
    let spec = mixed_spec();
    let cfg = LinkerConfig {
        collective_timeout: COLLECTIVE,
        ..config(ShareMode::SplitAllGather)
    };
    for path in paths() {
        let what = format!("{path:?}");
        let (rs, hashes, m) = ranks_misbehaving_on_rank_1(&spec, &cfg, path, how);
        m.arm();
        let t0 = Instant::now();
        let (outcomes, ended) = run_timed(&rs, 1, &hashes);
        assert!(m.done(), "{what}: rank 1 misbehaved");
        let took: Vec<Duration> = ended.iter().map(|e| *e - t0).collect();
        judge(&what, &outcomes, &took);
        peers_ended_by(&ended, t0, COLLECTIVE * 2, &what);
        run_ok(&rs, 2, &hashes, &what);
        for (rank, r) in rs.iter().enumerate() {
            let reforms = r.linker.metrics().group_reforms;
            assert_eq!(reforms, 1, "{what}: rank {rank} re-formed the group once");
        }
    }
}

/// A panic in a batch's run on the device path while that rank's read of a later layer hangs
/// past its deadline (its loan keeps the landing alive): the landing is still finished as the
/// run unwinds, so the next batch lands in the same slots at once, with the read still hung.
#[test]
fn a_panic_beside_a_hung_read_leaves_the_slots_to_the_next_batch() {
    let spec = mixed_spec();
    let cfg = LinkerConfig {
        collective_timeout: Duration::from_secs(2),
        layer_read_timeout: Duration::from_millis(800),
        store_call_timeout: Duration::from_millis(800),
        ..config(ShareMode::SplitAllGather)
    };
    let path = Path::device_per_rank(ScatterStrategy::Auto);
    let (rs, hashes, m) = ranks_panicking_at_layer_2(&spec, &cfg, path);
    let r = &rs[1];
    let v = r.linker.geometry().component_by_name("v").unwrap().clone();
    let stall = Stall::new();
    r.faults.inject(
        FaultRule {
            key_contains: Some("tp1_cp0_pp0_v".into()),
            offset: Some(v.layer_range(3).unwrap().start),
            times: Some(1),
            ..FaultRule::default()
        },
        Fault::Stall(stall.clone()),
    );
    m.arm();
    let outcomes = run(&rs, 1, &hashes);
    assert!(m.done(), "the collective panicked");
    assert!(outcomes.iter().all(|o| o.result.is_err()), "{outcomes:?}");
    assert_eq!(stall.hits(), 1, "layer 3's read hung");
    run_ok(&rs, 2, &hashes, "beside the hung read");
    stall.release();
}

/// Three ranks on `path` whose rank 1's data collective panics at layer 2's status exchange
/// once armed; that collective.
fn ranks_panicking_at_layer_2(
    spec: &kvlink::kv_geometry::ModelKvSpec,
    cfg: &LinkerConfig,
    path: Path,
) -> (Vec<TpRank>, Vec<PageHash>, Arc<common::coll::Misbehaving>) {
    let panics = common::coll::Misbehave::PanicAtLayer { layer: 2 };
    ranks_misbehaving_on_rank_1(spec, cfg, path, panics)
}

/// Three ranks of `spec` on `path`, rank 1's data handle misbehaving `how` once armed.
fn ranks_misbehaving_on_rank_1(
    spec: &kvlink::kv_geometry::ModelKvSpec,
    cfg: &LinkerConfig,
    path: Path,
    how: common::coll::Misbehave,
) -> (Vec<TpRank>, Vec<PageHash>, Arc<common::coll::Misbehaving>) {
    use common::coll::Misbehaving;
    use common::tp::{tp_ranks_built, RankBuild};
    use kvlink::mooncake_linker::TpGroup;
    use std::sync::Mutex;

    let armed = Mutex::new(None);
    let wrap = |rank: u32, g: TpGroup| {
        if rank != 1 {
            return g;
        }
        let m = Misbehaving::new(g.data.clone(), how);
        *armed.lock().unwrap() = Some(m.clone());
        let data: Arc<dyn kvlink::dedup_broadcast::Collective> = m;
        TpGroup { data, ..g }
    };
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let (rs, hashes) = tp_ranks_built(spec, 3, store, 6, cfg, path, &RankBuild::wrapped(&wrap));
    let m = armed.lock().unwrap().clone().unwrap();
    (rs, hashes, m)
}

/// A middle rank of three hung, not dead, at layer 2's status exchange (past its peers'
/// `collective_timeout`): every rank fails the batch, the peers within two collective
/// timeouts, and the next batch loads on every rank once the group re-formed. Before, only
/// the device path and ranks as processes were tested for a peer that hangs.
#[test]
fn a_middle_rank_that_hangs_in_a_collective_fails_the_batch_and_the_group_re_forms() {
    let stall = common::coll::Misbehave::StallAtLayer {
        layer: 2,
        stall: COLLECTIVE + COLLECTIVE / 2,
    };
    middle_rank_misbehaves(stall, |what, outcomes, _| {
        for (rank, o) in outcomes.iter().enumerate() {
            assert!(o.result.is_err(), "{what}: rank {rank} loaded");
        }
    });
}

/// Ranks 0 and 2 (the peers of a failing middle rank of three) ended their batch, started at
/// `t0`, within `bound`.
fn peers_ended_by(ended: &[Instant], t0: Instant, bound: Duration, what: &str) {
    for peer in [0, 2] {
        let took = ended[peer] - t0;
        assert!(took < bound, "{what}: rank {peer} ended after {took:?}");
    }
}

/// `close` waits for all it waits for within one `wait_deadline`, as `reset`. Before, the cancel
/// had its own bound and every step after it a fresh one: here rank 0's batch in flight ends
/// 2.5 s into the cancel, and a refused batch then waits at the gate for a peer that never
/// comes, so close took the cancel's 2.5 s and a whole second `wait_deadline` (5.5 s).
#[test]
fn close_waits_one_wait_deadline_in_all() {
    let cfg = LinkerConfig {
        wait_deadline: Duration::from_secs(3),
        collective_timeout: Duration::from_secs(20),
        layer_read_timeout: Duration::from_secs(10),
        ..config(ShareMode::AllRanks)
    };
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let (rs, hashes) = tp_ranks(&mixed_spec(), 2, store, 4, &cfg, Path::Host);
    // Rank 0's read of layer 1 takes 2.5 s.
    let v = rs[0]
        .linker
        .geometry()
        .component_by_name("v")
        .unwrap()
        .clone();
    rs[0].faults.inject(
        FaultRule {
            key_contains: Some("tp0_cp0_pp0_v".into()),
            offset: Some(v.layer_range(1).unwrap().start),
            times: Some(1),
            ..FaultRule::default()
        },
        Fault::Delay(Duration::from_millis(2500)),
    );
    let plan = |r: &TpRank, batch: u64, slots: Vec<u32>| {
        common::load_plan(r.linker.geometry(), batch, &hashes, slots)
    };
    std::thread::scope(|s| {
        let one = s.spawn(|| {
            let t = rs[1]
                .linker
                .start_load(plan(&rs[1], 1, rs[1].slots.clone()))
                .unwrap();
            let _ = common::wait_all(&rs[1].linker, &t);
            rs[1].linker.wait_batch(&t).unwrap()
        });
        let zero = &rs[0].linker;
        let _t = zero
            .start_load(plan(&rs[0], 1, rs[0].slots.clone()))
            .unwrap();
        // Batch 2 refused here (a slot twice): the load thread takes it to the gate after
        // batch 1, and rank 1 never comes to batch 2.
        let mut twice = rs[0].slots.clone();
        twice[1] = twice[0];
        assert!(zero.start_load(plan(&rs[0], 2, twice)).is_err());
        std::thread::sleep(Duration::from_millis(200));
        let t0 = Instant::now();
        let _ = zero.close();
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(2000) && took < Duration::from_millis(4500),
            "close took {took:?}: one wait_deadline (3 s) in all"
        );
        let _ = one.join().unwrap();
    });
}

/// A rank whose linker closed has left the group (ranks as threads): its peers' batches fail
/// at once with every later formation too, not each at its collective timeout. Before, a
/// re-formation built a handle for the closed rank that nobody took, so each later gate
/// waited the whole timeout for it (and each lookup with it).
#[test]
fn after_a_rank_closes_its_peers_fail_at_once_batch_after_batch() {
    let timeout = Duration::from_secs(5);
    for path in paths() {
        for mode in [ShareMode::AllRanks, ShareMode::Rank0Broadcast] {
            let cfg = LinkerConfig {
                collective_timeout: timeout,
                ..config(mode)
            };
            let what = format!("{path:?} {mode:?}");
            let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
            let (rs, hashes) = tp_ranks(&mixed_spec(), 3, store, 4, &cfg, path);
            run_ok(&rs, 1, &hashes, &what);
            rs[1].linker.close().unwrap();
            let left = [&rs[0], &rs[2]];
            for batch in 2..5 {
                let t0 = Instant::now();
                let hashes = &hashes;
                let outcomes = std::thread::scope(|s| {
                    let hs: Vec<_> = left
                        .iter()
                        .map(|&r| s.spawn(move || run(std::slice::from_ref(r), batch, hashes)))
                        .collect();
                    hs.into_iter()
                        .map(|h| h.join().unwrap())
                        .collect::<Vec<_>>()
                });
                let took = t0.elapsed();
                for o in outcomes.iter().flatten() {
                    match &o.result {
                        // The group aborted by the rank's leaving (the batch after it).
                        Err(_) if batch == 2 => {}
                        // Each later one: the group does not form without the rank.
                        Err(KvLoadError::GroupDown { missing, .. }) => {
                            assert_eq!(missing, &[1], "{what}: batch {batch}")
                        }
                        other => panic!("{what}: batch {batch}: {other:?}"),
                    }
                }
                assert!(
                    took < timeout / 2,
                    "{what}: batch {batch} took {took:?}: a rank waited for the closed one"
                );
            }
        }
    }
}

/// Sets of linkers built one after another on the same groups (as a benchmark builds one set
/// per share mode): each set closes, leaving the group, and the next one forms it again and
/// loads. Before, the third set never formed: it asked for the epoch the second had taken
/// and dropped, and was told it had taken it already, batch after batch.
#[test]
fn linkers_built_again_and_again_on_one_group_form_it_each_time() {
    // Host pools: the kept groups move host rows (a device group is tied to its devices).
    for path in [Path::Host] {
        let cfg = LinkerConfig {
            collective_timeout: Duration::from_secs(5),
            ..config(ShareMode::SplitAllGather)
        };
        let groups = std::sync::Mutex::new(None::<Vec<TpGroup>>);
        let keep = |rank: u32, fresh: TpGroup| {
            let mut g = groups.lock().unwrap();
            // The first set's groups, kept for every later set (the fresh ones go).
            let kept = g.get_or_insert_with(Vec::new);
            if kept.len() <= rank as usize {
                kept.push(fresh);
            }
            kept[rank as usize].clone()
        };
        for set in 0..4 {
            let what = format!("{path:?} set {set}");
            let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
            let build = RankBuild {
                wrap: &keep,
                ..RankBuild::default()
            };
            let (rs, hashes) = tp_ranks_built(&mixed_spec(), 3, store, 4, &cfg, path, &build);
            for batch in 1..3 {
                assert_eq!(
                    run_ok(&rs, batch, &hashes, &what),
                    ShareMode::SplitAllGather,
                    "{what}"
                );
            }
            for r in &rs {
                r.linker.close().unwrap();
            }
        }
    }
}
