//! Status words round-trip; every rank folds the exchange into the same verdict.

use std::thread;
use std::time::Duration;

use dedup_broadcast::{
    code_name, fail_code, Collective, GroupStatus, InProcessGroup, LayerStatus,
    CODE_LAYER_MISMATCH, CODE_MALFORMED,
};
use kv_loader::{BatchId, KvLoadError, StoreFailure};
use proptest::prelude::*;

proptest! {
    #[test]
    fn words_round_trip(layer in any::<u32>(), code in any::<u16>()) {
        let s = if code == 0 { LayerStatus::Ok } else { LayerStatus::failed(code) };
        prop_assert_eq!(LayerStatus::decode(s.encode(layer)), Some((layer, s)));
        prop_assert_eq!(LayerStatus::decode_for(s.encode(layer), layer), s);
    }

    #[test]
    fn garbage_is_never_ok(word in any::<u64>(), layer in any::<u32>()) {
        let s = LayerStatus::decode_for(word, layer);
        if s.is_ok() {
            prop_assert_eq!(word, LayerStatus::Ok.encode(layer));
        }
    }
}

#[test]
fn malformed_and_misplaced_words_fail() {
    assert_eq!(LayerStatus::decode_for(0, 3).code(), CODE_MALFORMED);
    assert_eq!(
        LayerStatus::decode_for(LayerStatus::Ok.encode(4), 3).code(),
        CODE_LAYER_MISMATCH
    );
    assert_eq!(LayerStatus::failed(0).code(), dedup_broadcast::CODE_OTHER);
}

/// The variant's field is public: a failure built with code 0 was sent as an ok word (code 0
/// on the wire), and every rank, its sender too, took the layer as loaded.
#[test]
fn a_failure_built_with_code_zero_is_never_sent_as_ok() {
    let word = LayerStatus::Failed { code: 0 }.encode(3);
    let (layer, got) = LayerStatus::decode(word).unwrap();
    assert_eq!(layer, 3);
    assert!(!got.is_ok(), "{got:?}");
    assert_eq!(got.code(), dedup_broadcast::CODE_OTHER);
    // Folded in as it is (not through a word): a failure too, of `CODE_OTHER`, not "ok".
    let mut g = GroupStatus::default();
    assert!(!g.record(2, &[LayerStatus::Ok, LayerStatus::Failed { code: 0 }]));
    assert_eq!(
        (g.first_failed, g.code),
        (Some((1, 2)), dedup_broadcast::CODE_OTHER)
    );
}

#[test]
fn codes_name_the_error_kind() {
    let e = KvLoadError::Store {
        batch: None,
        layer: Some(2),
        pages: vec![].into(),
        kind: StoreFailure::ShortRead,
        detail: String::new().into(),
    };
    assert_eq!(code_name(fail_code(&e)), "store_short_read");
    assert_eq!(LayerStatus::from_error(&e).code(), fail_code(&e));
    assert_eq!(code_name(CODE_MALFORMED), "malformed_status");
    assert_eq!(code_name(999), "unknown");
}

#[test]
fn first_failure_is_lowest_layer_then_lowest_rank_whatever_the_order() {
    let mut g = GroupStatus::default();
    assert!(g.is_ok() && g.to_error(BatchId(1)).is_none());
    assert!(g.record(4, &[LayerStatus::Ok; 3]));
    assert!(!g.record(
        5,
        &[
            LayerStatus::Ok,
            LayerStatus::failed(2),
            LayerStatus::failed(3)
        ]
    ));
    assert_eq!(g.first_failed, Some((1, 5)));
    // An earlier layer recorded later still wins.
    assert!(!g.record(
        2,
        &[LayerStatus::Ok, LayerStatus::Ok, LayerStatus::failed(4)]
    ));
    assert_eq!(g.first_failed, Some((2, 2)));
    assert_eq!(g.code, 4);
    g.record(
        2,
        &[LayerStatus::failed(6), LayerStatus::Ok, LayerStatus::Ok],
    );
    assert_eq!(g.first_failed, Some((0, 2)));
    match g.to_error(BatchId(7)) {
        Some(KvLoadError::PeerFailed {
            batch,
            rank: 0,
            layer: 2,
            detail,
        }) => {
            assert_eq!(batch, BatchId(7));
            assert_eq!(detail, code_name(6));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn every_rank_reaches_the_same_verdict() {
    // 4 ranks, 6 layers; rank 2 fails from layer 3 on, rank 1 fails at layer 4 only.
    let ranks = InProcessGroup::new(4);
    let deadline = kv_loader::deadline_after(Duration::from_secs(30));
    let verdicts: Vec<GroupStatus> = thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let mut g = GroupStatus::default();
                    for layer in 0..6 {
                        let mine = match (c.rank(), layer) {
                            (2, 3..) => LayerStatus::failed(11),
                            (1, 4) => LayerStatus::failed(12),
                            _ => LayerStatus::Ok,
                        };
                        let all_ok = g.exchange(c, layer, mine, deadline).unwrap();
                        assert_eq!(all_ok, layer < 3);
                    }
                    g
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for v in &verdicts {
        assert_eq!(v.first_failed, Some((2, 3)));
        assert_eq!(v.code, 11);
    }
    let mut words = GroupStatus::default();
    words.record_words(0, &[LayerStatus::Ok.encode(0), 17]);
    assert_eq!(words.first_failed, Some((1, 0)));
    assert_eq!(words.code, CODE_MALFORMED);
}

/// Every kind of `KvLoadError` has a status code of its own: a kind without one travels as
/// "other", and its peers' verdicts lose what failed (`group_down` had none).
#[test]
fn every_error_kind_has_its_own_code() {
    use kv_loader::{Cause, PlanError};
    use std::sync::Arc;
    let b = BatchId(1);
    let store = |kind| KvLoadError::Store {
        batch: Some(b),
        layer: None,
        pages: Arc::from(Vec::new()),
        kind,
        detail: Cause::new("x"),
    };
    let mut samples = vec![
        KvLoadError::InvalidPlan {
            batch: b,
            reason: PlanError::ZeroPageSize,
        },
        KvLoadError::Timeout {
            batch: b,
            layer: 0,
            waited: Duration::ZERO,
        },
        KvLoadError::Cancelled { batch: b },
        KvLoadError::PeerFailed {
            batch: b,
            rank: 1,
            layer: 0,
            detail: "x".into(),
        },
        KvLoadError::Collective {
            batch: Some(b),
            detail: Cause::new("x"),
        },
        KvLoadError::GroupDown {
            batch: Some(b),
            missing: vec![2],
            refused: false,
            detail: Cause::new("x"),
        },
        KvLoadError::Device(Cause::new("x")),
        KvLoadError::StaleTicket { batch: b },
        KvLoadError::Busy {
            capacity: 4,
            peers_fail: true,
        },
        KvLoadError::Closed,
        KvLoadError::Geometry(kv_geometry::GeometryError::HeadsNotDivisible {
            component: "v".into(),
            heads: 3,
            tp_size: 2,
        }),
        KvLoadError::config("x"),
        KvLoadError::internal(b, "x"),
        KvLoadError::DuplicateBatch { batch: b },
        KvLoadError::BadObject {
            batch: b,
            key: "k".into(),
            layer: None,
            detail: "x".into(),
        },
        KvLoadError::SlotsHeld {
            batches: Arc::from(vec![b]),
        },
    ];
    for kind in [
        StoreFailure::NotFound,
        StoreFailure::NoSpace,
        StoreFailure::TransferFailed,
        StoreFailure::Lease,
        StoreFailure::RpcTimeout,
        StoreFailure::InvalidArgument,
        StoreFailure::Unavailable,
        StoreFailure::ShortRead,
        StoreFailure::Other,
    ] {
        samples.push(store(kind));
    }
    let mut codes: Vec<u16> = samples.iter().map(fail_code).collect();
    for (e, &code) in samples.iter().zip(&codes) {
        assert_eq!(code_name(code), e.kind_name(), "{e}");
    }
    codes.sort_unstable();
    codes.dedup();
    assert_eq!(codes.len(), samples.len(), "one code per kind");
}
