//! Loom models of the linker's reader/loader hand-off (`src/linker/handoff.rs`, built here
//! with loom's mutex and condition variable): the reader takes free stages and hands read
//! layers over, the exchange loop takes layers and gives stages back, either side may leave
//! early. Checked in every interleaving (preemption bound 3): no lost wake-up (loom reports a
//! deadlock), no stage lost, layers in order, a side that leaves never strands the other.
//! Run with `RUSTFLAGS="--cfg kvlink_loom" cargo test -p mooncake-linker --test loom_handoff --release`.
//!
//! Loom has no clock: the deadlines are far away and waits end only on a notification.
#![cfg(kvlink_loom)]

#[path = "../src/linker/handoff.rs"]
#[allow(dead_code)]
mod handoff;

use std::time::{Duration, Instant};

use handoff::{Handoff, Wait};
use loom::sync::Arc;
use loom::thread;

fn far() -> Instant {
    Instant::now() + Duration::from_secs(3600)
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(f);
}

/// The reader as the pipeline runs it: for each group, a free stage for each of its layers,
/// "read", then every layer of the group handed over (the hand-off holds a whole group since
/// it is as deep as the ring; groups of one layer are how every load read before groups); it
/// stops when the other side leaves. Returns the layers handed over.
fn reader(h: &Handoff<u8, (u8, u32)>, groups: &[u32]) -> Vec<u32> {
    let mut sent = Vec::new();
    let mut next = 0u32;
    'groups: for &len in groups {
        let mut stages = Vec::new();
        for _ in 0..len {
            let Wait::Got(stage) = h.free_stage(far()) else {
                break 'groups;
            };
            stages.push(stage);
        }
        for stage in stages {
            if h.hand_over((stage, next), far()).is_err() {
                break 'groups;
            }
            sent.push(next);
            next += 1;
        }
    }
    h.reader_done();
    sent
}

/// `groups` through the (sorted) `stages` and a hand-off `depth` deep, the exchange loop
/// taking every layer and giving its stage back: every layer arrives once and in order, and
/// every stage is back in the hand-off at the end.
fn every_layer_arrives(stages: &'static [u8], depth: usize, groups: &'static [u32]) {
    model(move || {
        let h = Arc::new(Handoff::<u8, (u8, u32)>::new(stages.iter().copied(), depth));
        let r = {
            let h = h.clone();
            thread::spawn(move || reader(&h, groups))
        };
        let all: Vec<u32> = (0..groups.iter().sum()).collect();
        let mut got = Vec::new();
        for _ in &all {
            match h.next_layer(far()) {
                Wait::Got((stage, layer)) => {
                    got.push(layer);
                    h.give_back(stage);
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(h.next_layer(far()), Wait::Closed);
        let (mut back, layers) = h.exchange_done();
        back.sort();
        assert_eq!((back, layers), (stages.to_vec(), vec![]));
        assert_eq!(r.join().unwrap(), all);
        assert_eq!(got, all);
    });
}

/// The same, and the exchange loop stops after the first layer (a failed status) while the
/// reader reads on: the reader's waits end, it leaves having handed over at most `max_sent`
/// layers, and every stage is accounted for at most once (with the exchange loop, back in the
/// hand-off, or in a layer it handed over; one the reader took and could not hand over went
/// with the reader).
fn a_loop_that_leaves_strands_no_one(
    stages: &'static [u8],
    depth: usize,
    groups: &'static [u32],
    max_sent: usize,
) {
    model(move || {
        let h = Arc::new(Handoff::<u8, (u8, u32)>::new(stages.iter().copied(), depth));
        let r = {
            let h = h.clone();
            thread::spawn(move || reader(&h, groups))
        };
        let first = match h.next_layer(far()) {
            Wait::Got(m) => m,
            other => panic!("{other:?}"),
        };
        assert_eq!(first.1, 0);
        let (free, queued) = h.exchange_done();
        let sent = r.join().unwrap();
        assert!(sent.len() <= max_sent, "{sent:?}");
        let mut seen: Vec<u8> = free
            .into_iter()
            .chain(queued.iter().map(|m| m.0))
            .chain([first.0])
            .collect();
        seen.sort();
        assert!(seen.len() <= stages.len() && seen.windows(2).all(|w| w[0] != w[1]));
        assert!(queued.iter().all(|m| m.1 > 0));
    });
}

/// Three layers of one each through two stages, a hand-off one layer deep.
#[test]
fn every_layer_arrives_in_order_and_no_stage_is_lost() {
    every_layer_arrives(&[0, 1], 1, &[1, 1, 1]);
}

/// Three stages, a hand-off as deep as the ring, groups of two layers (the pipeline now).
#[test]
fn whole_groups_arrive_in_order_through_a_ring_deep_hand_off() {
    every_layer_arrives(&[0, 1, 2], 3, &[2, 2]);
}

/// Four layers of one each through two stages: the exchange loop leaves after the first.
#[test]
fn an_exchange_loop_that_leaves_early_never_strands_the_reader() {
    a_loop_that_leaves_strands_no_one(&[0, 1], 1, &[1, 1, 1, 1], 3);
}

/// Groups of two through three stages and a ring-deep hand-off: the exchange loop leaves
/// after the first layer, in the middle of the reader's first group.
#[test]
fn an_exchange_loop_that_leaves_mid_group_never_strands_the_group_reader() {
    a_loop_that_leaves_strands_no_one(&[0, 1, 2], 3, &[2, 2], 4);
}

/// The reader fails and leaves while the exchange loop waits for a layer: the wait ends.
#[test]
fn a_reader_that_leaves_ends_the_exchange_loops_wait() {
    model(|| {
        let h = Arc::new(Handoff::<u8, (u8, u32)>::new([0u8, 1], 1));
        let r = {
            let h = h.clone();
            thread::spawn(move || {
                if let Wait::Got(stage) = h.free_stage(far()) {
                    h.hand_over((stage, 0), far()).unwrap();
                }
                h.reader_done();
            })
        };
        assert!(matches!(h.next_layer(far()), Wait::Got((_, 0))));
        assert_eq!(h.next_layer(far()), Wait::Closed);
        r.join().unwrap();
        drop(h.exchange_done());
    });
}

/// One stage for two layers: the reader must wait for the stage to come back before it reads
/// the second layer, and the exchange loop's give-back is what wakes it.
#[test]
fn a_stage_given_back_wakes_the_reader_waiting_for_it() {
    model(|| {
        let h = Arc::new(Handoff::<u8, (u8, u32)>::new([7u8], 1));
        let r = {
            let h = h.clone();
            thread::spawn(move || reader(&h, &[1, 1]))
        };
        for want in 0..2 {
            match h.next_layer(far()) {
                Wait::Got((stage, layer)) => {
                    assert_eq!((stage, layer), (7, want));
                    h.give_back(stage);
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(r.join().unwrap(), vec![0, 1]);
        assert_eq!(h.exchange_done(), (vec![7], vec![]));
    });
}
