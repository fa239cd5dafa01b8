//! The plan gate: digest of the canonical encoding; the same verdict on every rank. The batch
//! gate's word: its encoding, and every rank's previous batch time from an in-step gate.

use std::thread;
use std::time::Duration;

use dedup_broadcast::{
    check_batch, check_plan, judge_gate, plan_digest, AloneLoads, GateStep, GateVerdict, GateWord,
    InProcessGroup, RanksAhead,
};
use kv_geometry::{ComponentId, PageHash};
use kv_loader::{BatchId, LogicalPlan, RequestPages};
use proptest::prelude::*;

fn page(i: u32) -> PageHash {
    let mut h = [0u8; 32];
    h[..4].copy_from_slice(&i.to_le_bytes());
    PageHash(h)
}

fn plan(batch: u64, requests: &[(&str, &[u32])], components: &[u16]) -> LogicalPlan {
    LogicalPlan {
        batch: BatchId(batch),
        requests: requests
            .iter()
            .map(|(id, pages)| RequestPages {
                request: (*id).into(),
                pages: pages.iter().map(|&p| page(p)).collect(),
            })
            .collect(),
        components: components.iter().map(|&c| ComponentId(c)).collect(),
    }
}

#[test]
fn digest_sees_every_part_of_the_plan() {
    let base = plan(1, &[("a", &[1, 2]), ("b", &[3])], &[0, 1]);
    let variants = [
        plan(2, &[("a", &[1, 2]), ("b", &[3])], &[0, 1]), // batch
        plan(1, &[("a", &[1, 2]), ("c", &[3])], &[0, 1]), // request id
        plan(1, &[("a", &[1, 4]), ("b", &[3])], &[0, 1]), // a page
        plan(1, &[("a", &[2, 1]), ("b", &[3])], &[0, 1]), // page order
        plan(1, &[("b", &[3]), ("a", &[1, 2])], &[0, 1]), // request order
        plan(1, &[("a", &[1]), ("b", &[2, 3])], &[0, 1]), // where pages split
        plan(1, &[("a", &[1, 2]), ("b", &[3])], &[0]),    // components
        plan(1, &[("a", &[1, 2]), ("b", &[3]), ("c", &[])], &[0, 1]), // an empty request
        plan(1, &[], &[0, 1]),                            // empty
    ];
    let d = plan_digest(&base);
    assert_eq!(d, plan_digest(&base.clone()));
    for (i, v) in variants.iter().enumerate() {
        assert_ne!(plan_digest(v), d, "variant {i}");
    }
}

#[test]
fn digest_of_a_512k_token_plan_in_several_requests() {
    // 8192 pages of 32 B in 4 requests: the digest is stable and the whole encoding counts.
    let reqs: Vec<RequestPages> = (0..4u32)
        .map(|r| RequestPages {
            request: kv_loader::RequestId(format!("req-{r}")),
            pages: (0..2048).map(|i| page(r * 2048 + i)).collect(),
        })
        .collect();
    let mut p = LogicalPlan {
        batch: BatchId(9),
        requests: reqs,
        components: vec![ComponentId(0), ComponentId(1)],
    };
    let d = plan_digest(&p);
    assert_eq!(d, plan_digest(&p.clone()));
    p.requests[3].pages[2047].0[31] ^= 1; // last byte of the encoding
    assert_ne!(plan_digest(&p), d);
}

fn gate_on_group(plans: Vec<LogicalPlan>) -> Vec<GateVerdict> {
    let ranks = InProcessGroup::new(plans.len() as u32);
    let deadline = kv_loader::deadline_after(Duration::from_secs(30));
    thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .zip(&plans)
            .map(|(c, p)| s.spawn(move || check_plan(c, p, deadline).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn every_rank_gets_the_same_verdict() {
    let a = plan(5, &[("a", &[1, 2, 3])], &[0]);
    let b = plan(5, &[("a", &[1, 2])], &[0]);
    let agreed = gate_on_group(vec![a.clone(); 4]);
    assert!(agreed.iter().all(|v| *v == GateVerdict::Agreed));

    let mixed = gate_on_group(vec![a.clone(), b.clone(), a.clone(), b.clone()]);
    assert!(mixed.iter().all(|v| *v
        == GateVerdict::Mismatch {
            differing: vec![1, 3]
        }));

    let rank0_odd = gate_on_group(vec![b.clone(), a.clone(), a.clone()]);
    assert!(rank0_odd.iter().all(|v| *v
        == GateVerdict::Mismatch {
            differing: vec![1, 2]
        }));
}

#[test]
fn empty_plans_pass_the_gate_and_an_empty_rank_does_not() {
    let empty = plan(6, &[], &[0]);
    assert!(gate_on_group(vec![empty.clone(); 3])
        .iter()
        .all(GateVerdict::agreed));
    let full = plan(6, &[("a", &[1])], &[0]);
    let v = gate_on_group(vec![full.clone(), empty, full]);
    assert!(v
        .iter()
        .all(|v| *v == GateVerdict::Mismatch { differing: vec![1] }));
}

fn arb_plan() -> impl Strategy<Value = LogicalPlan> {
    (
        0u64..4,
        prop::collection::vec(("[a-c]{0,2}", prop::collection::vec(0u32..6, 0..4)), 0..4),
        prop::collection::btree_set(0u16..3, 0..3),
    )
        .prop_map(|(batch, reqs, comps)| LogicalPlan {
            batch: BatchId(batch),
            requests: reqs
                .into_iter()
                .map(|(id, pages)| RequestPages {
                    request: id.as_str().into(),
                    pages: pages.into_iter().map(page).collect(),
                })
                .collect(),
            components: comps.into_iter().map(ComponentId).collect(),
        })
}

proptest! {
    #[test]
    fn digests_are_equal_exactly_when_plans_are(a in arb_plan(), b in arb_plan()) {
        prop_assert_eq!(plan_digest(&a) == plan_digest(&b), a == b);
    }
}

#[test]
fn digest_is_xxh3_128_of_the_canonical_bytes_whatever_the_piece_sizes() {
    // Pieces that straddle, exactly fill and exceed the internal 4 KiB block.
    for id_len in [0usize, 1, 4059, 4060, 4061, 4096, 10_000] {
        let mut p = plan(3, &[("a", &[1, 2, 3])], &[0, 2]);
        p.requests.push(RequestPages {
            request: kv_loader::RequestId("x".repeat(id_len)),
            pages: (0..200).map(page).collect(),
        });
        // The key space, length-prefixed, then the plan's canonical bytes.
        let digest_of = |space: &[u8]| {
            let mut bytes = (space.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(space);
            bytes.extend_from_slice(&p.canonical_bytes());
            xxhash_rust::xxh3::xxh3_128_with_seed(&bytes, dedup_broadcast::PLAN_DIGEST_SEED)
                .to_le_bytes()
        };
        assert_eq!(plan_digest(&p), digest_of(b""), "id of {id_len} bytes");
        assert_eq!(
            dedup_broadcast::plan_digest_in(&p, b"glm-5.2/tag"),
            digest_of(b"glm-5.2/tag"),
            "id of {id_len} bytes, in a key space"
        );
    }
}

fn gate_word(batch: u64, count: u64, last_batch_us: u32) -> GateWord {
    GateWord {
        digest: [9; 16],
        batch,
        count,
        proposal: 2,
        last_batch_us,
        alone: AloneLoads::default(),
    }
}

proptest! {
    #[test]
    fn gate_words_round_trip(
        digest in prop::array::uniform16(any::<u8>()),
        batch in any::<u64>(),
        count in any::<u64>(),
        proposal in any::<u64>(),
        last_batch_us in any::<u32>(),
        settles in prop::collection::vec((any::<u64>(), any::<bool>()), 0..12),
    ) {
        let mut alone = AloneLoads::default();
        settles.iter().for_each(|&(b, a)| alone.settled(b, a));
        let w = GateWord { digest, batch, count, proposal, last_batch_us, alone };
        prop_assert_eq!(GateWord::decode(&w.encode()), Some(w));
    }
}

#[test]
fn the_previous_batch_time_sits_in_bytes_4_to_8() {
    let w = gate_word(5, 1, 0x0102_0304).encode();
    assert_eq!(&w[..4], b"KVG3");
    assert_eq!(w.len(), 344);
    assert_eq!(&w[4..8], &[4, 3, 2, 1], "little-endian µs");
    // No sample: those bytes are zero, as the reserved bytes of a word without the field were.
    let none = gate_word(5, 1, 0).encode();
    assert_eq!(&none[4..8], &[0; 4]);
    assert_eq!(GateWord::decode(&none).unwrap().last_batch_us, 0);
    // Everything else is where it was: only bytes 4..8 differ between the two.
    let differ: Vec<usize> = (0..w.len()).filter(|&i| w[i] != none[i]).collect();
    assert_eq!(differ, vec![4, 5, 6, 7]);
}

#[test]
fn an_in_step_gate_gives_every_ranks_previous_batch_time() {
    let words = [
        gate_word(7, 3, 1_000),
        gate_word(7, 3, 0),
        gate_word(7, 3, 2_500),
    ];
    let all: Vec<Vec<u8>> = words.iter().map(|w| w.encode().to_vec()).collect();
    for mine in &words {
        let gate = judge_gate(mine, &all);
        assert_eq!(gate.step, GateStep::InStep);
        assert_eq!(gate.last_batch_us, vec![1_000, 0, 2_500]);
        assert_eq!(gate.proposals, vec![2, 2, 2]);
    }
    // Out of step (rank 1 at a later batch): no rank's time is given.
    let behind = [
        gate_word(7, 3, 1_000),
        gate_word(8, 3, 900),
        gate_word(7, 3, 2_500),
    ];
    let all: Vec<Vec<u8>> = behind.iter().map(|w| w.encode().to_vec()).collect();
    let gate = judge_gate(&behind[0], &all);
    assert_eq!(
        gate.step,
        GateStep::Behind {
            latest: 8,
            settled_alone: false
        }
    );
    assert!(gate.last_batch_us.is_empty());
}

/// A rank the group went past loads its batch alone only when every rank ahead loaded that
/// batch alone: a rank ahead that failed it (or loaded it with others) leaves it failed.
#[test]
fn a_rank_behind_learns_whether_every_rank_ahead_loaded_its_batch_alone() {
    // A rank's record after settling `batches` (id, loaded alone).
    let loads = |batches: &[(u64, bool)]| {
        let mut a = AloneLoads::default();
        batches.iter().for_each(|&(b, alone)| a.settled(b, alone));
        a
    };
    let with = |batch, alone| GateWord {
        alone,
        ..gate_word(batch, 0, 0)
    };
    let behind = |words: &[GateWord]| {
        let all: Vec<Vec<u8>> = words.iter().map(|w| w.encode().to_vec()).collect();
        judge_gate(&words[0], &all).step
    };
    let step = |settled_alone| GateStep::Behind {
        latest: 9,
        settled_alone,
    };
    let alone_5_to_8 = loads(&[(5, true), (6, true), (7, true), (8, true)]);
    // Rank 1 loaded 5..=8 alone; rank 2 loaded 7 alone, then failed 8 (a refusal, a store
    // error): batch 7 was loaded alone by both.
    let ahead = [
        with(7, AloneLoads::default()),
        with(9, alone_5_to_8),
        with(9, loads(&[(7, true), (8, false)])),
    ];
    assert_eq!(behind(&ahead), step(true));
    // Rank 2 failed 7, then loaded 8 alone.
    let one_failed = [
        with(7, AloneLoads::default()),
        with(9, alone_5_to_8),
        with(9, loads(&[(7, false), (8, true)])),
    ];
    assert_eq!(behind(&one_failed), step(false));
    // No record, or 7 loaded with the group: not alone.
    let none = [
        with(7, AloneLoads::default()),
        with(9, AloneLoads::default()),
        with(7, AloneLoads::default()),
    ];
    assert_eq!(behind(&none), step(false));
    let with_group = [
        with(7, AloneLoads::default()),
        with(9, loads(&[(7, false)])),
        with(7, AloneLoads::default()),
    ];
    assert_eq!(behind(&with_group), step(false));
    // A rank at the same batch as this one does not count (it is behind too).
    let peer_behind = [
        with(7, AloneLoads::default()),
        with(9, alone_5_to_8),
        with(7, AloneLoads::default()),
    ];
    assert_eq!(behind(&peer_behind), step(true));
    // Far apart ids (an engine that numbers batches by scheduler step): the record still
    // tells. Before, it kept the last 64 ids only, so rank 1 said it had not loaded 7 alone.
    let far = [
        with(7, AloneLoads::default()),
        with(900, loads(&[(7, true), (171, true)])),
        with(7, AloneLoads::default()),
    ];
    assert_eq!(
        behind(&far),
        GateStep::Behind {
            latest: 900,
            settled_alone: true
        }
    );
    // A rank ahead whose record does not reach back to 7 (it started again at 50) does not
    // count: rank 1 loaded 7 alone, so rank 0 loads it alone too.
    let restarted = [
        with(7, AloneLoads::default()),
        with(9, alone_5_to_8),
        with(60, loads(&[(50, false)])),
    ];
    assert_eq!(
        behind(&restarted),
        GateStep::Behind {
            latest: 60,
            settled_alone: true
        }
    );
}

/// The gate hands a rank behind what the ranks ahead said (each one's batch and record), so
/// that it can settle its next batches as they did should the group break before it catches
/// up; a rank in step or ahead gets none.
#[test]
fn a_rank_behind_keeps_the_words_of_the_ranks_ahead() {
    let mut one = AloneLoads::default();
    [(5, true), (6, false), (7, true)]
        .iter()
        .for_each(|&(b, alone)| one.settled(b, alone));
    let words = [
        gate_word(5, 0, 0),
        GateWord {
            alone: one,
            ..gate_word(8, 0, 0)
        },
        gate_word(5, 0, 0),
    ];
    let all: Vec<Vec<u8>> = words.iter().map(|w| w.encode().to_vec()).collect();
    let gate = judge_gate(&words[0], &all);
    assert_eq!(gate.ahead.ranks, vec![(8, one)]);
    // Batch 5 (this one), then 6 and 7, which it will meet next: as rank 1 settled them.
    let settled: Vec<_> = (5..=8).map(|b| gate.ahead.settled_alone(b)).collect();
    assert_eq!(settled, [Some(true), Some(false), Some(true), None]);
    assert_eq!(
        gate.step,
        GateStep::Behind {
            latest: 8,
            settled_alone: true
        }
    );
    // Rank 1, ahead: nobody is past it.
    let ahead = judge_gate(&words[1], &all);
    assert_eq!(ahead.step, GateStep::Ahead { earliest: 5 });
    assert!(ahead.ahead.ranks.is_empty());
    let in_step = [gate_word(5, 0, 0), gate_word(5, 0, 0)];
    let all: Vec<Vec<u8>> = in_step.iter().map(|w| w.encode().to_vec()).collect();
    assert_eq!(judge_gate(&in_step[0], &all).ahead, RanksAhead::default());
}

#[test]
fn check_batch_carries_the_times_over_a_group() {
    let ranks = InProcessGroup::new(3);
    let deadline = kv_loader::deadline_after(Duration::from_secs(30));
    let gates: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .enumerate()
            .map(|(r, c)| {
                s.spawn(move || {
                    check_batch(c, &gate_word(4, 0, 10 * r as u32 + 1), deadline).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for g in gates {
        assert_eq!(g.step, GateStep::InStep);
        assert_eq!(g.last_batch_us, vec![1, 11, 21]);
    }
}
