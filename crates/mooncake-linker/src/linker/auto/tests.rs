//! `Auto`'s choice, driven batch by batch with modelled times (no store, no group).

use super::measured::{slot, AUTO_MODES};
use super::*;
use proptest::prelude::*;

#[test]
fn a_fixed_mode_keeps_no_samples_and_a_huge_patience_does_not_overflow() {
    let fixed = AutoMode::new(
        ModeChoice::Fixed(ShareMode::AllRanks),
        Bandwidths::UNKNOWN,
        3,
    );
    for _ in 0..10_000 {
        fixed.observe_batch(ShareMode::AllRanks, 64 << 20, Duration::from_millis(100));
    }
    assert!(fixed.seen.lock().samples.iter().all(Vec::is_empty));
    // `auto_batches_per_mode` is not bounded by the config: the give-up limit saturates.
    let patient = AutoMode::new(ModeChoice::Auto, Bandwidths::UNKNOWN, u32::MAX);
    for _ in 0..20 {
        let _ = patient.propose(2, 1 << 20, Some(ShareMode::AllRanks));
    }
    assert!(
        patient.seen.lock().kept.is_none(),
        "not given up after 20 proposals"
    );
    // At the counter's end it gives up rather than wrap (or panic in a debug build).
    patient.seen.lock().proposals = u32::MAX - 1;
    for _ in 0..2 {
        let _ = patient.propose(2, 1 << 20, Some(ShareMode::AllRanks));
    }
    let s = patient.seen.lock();
    assert_eq!(s.proposals, u32::MAX);
    assert!(s.kept.is_some(), "given up at the counter's end");
}

/// Runs the measuring phase with group batch times `time(mode, i)` (`i`: the mode's
/// batches before) as the linker does: each batch's proposal is made while the previous
/// batch's time is on the way, and that time is recorded just after (at the same gate).
/// Returns the modes proposed before the first one proposed as kept, and the mode kept.
fn run(per_mode: u32, time: impl Fn(ShareMode, usize) -> f64) -> (Vec<ShareMode>, ShareMode) {
    let mut m = Measured::default();
    let mut ran = [0usize; ShareMode::COUNT];
    let mut in_flight: Option<(ShareMode, f64)> = None;
    let mut proposed = Vec::new();
    for _ in 1..100 {
        let mode = m.next(in_flight.map(|(f, _)| f), per_mode);
        if m.kept.is_some() {
            return (proposed, mode);
        }
        proposed.push(mode);
        if let Some((f, t)) = in_flight.take() {
            m.record(f, t, per_mode);
        }
        in_flight = Some((mode, time(mode, ran[slot(mode)])));
        ran[slot(mode)] += 1;
    }
    panic!("Auto never decided");
}

/// [`run`] where batch `n` (counting every batch) of mode `m` fails when `fails(m, n)`:
/// its failure is recorded as the batch ends (it sends no time). The modes proposed
/// before the kept one, the mode kept, and the modes dropped.
fn run_failing(per_mode: u32, fails: impl Fn(ShareMode, usize) -> bool) -> Failing {
    run_failing_at(per_mode, base, fails)
}

/// What [`run_failing_at`] saw: the modes proposed before the kept one, the mode kept, the
/// modes dropped as slower, and those that failed on their own account.
struct Failing {
    proposed: Vec<ShareMode>,
    kept: ShareMode,
    slower: Vec<ShareMode>,
    failed_out: Vec<ShareMode>,
}

/// [`run_failing`] with group batch times `time(mode)`.
fn run_failing_at(
    per_mode: u32,
    time: impl Fn(ShareMode) -> f64,
    fails: impl Fn(ShareMode, usize) -> bool,
) -> Failing {
    let mut m = Measured::default();
    let mut in_flight: Option<(ShareMode, f64)> = None;
    let mut proposed = Vec::new();
    for n in 0..200 {
        let mode = m.next(in_flight.map(|(f, _)| f), per_mode);
        if m.kept.is_some() {
            let with = |flags: &[bool; ShareMode::COUNT]| {
                AUTO_MODES.into_iter().filter(|x| flags[slot(*x)]).collect()
            };
            return Failing {
                proposed,
                kept: mode,
                slower: with(&m.dropped),
                failed_out: with(&m.failed_out),
            };
        }
        proposed.push(mode);
        if let Some((f, t)) = in_flight.take() {
            m.record(f, t, per_mode);
        }
        if fails(mode, n) {
            m.record_failure(mode);
        } else {
            in_flight = Some((mode, time(mode)));
        }
    }
    panic!("Auto never decided: proposed {proposed:?}");
}

/// `n` batches as the linker runs them (each proposal made while the previous batch's
/// time is on the way), from `m`'s state; batch `i` of mode `x` fails when `fails(x, i)`.
/// The modes proposed.
fn drive(
    m: &mut Measured,
    n: usize,
    per_mode: u32,
    fails: impl Fn(ShareMode, usize) -> bool,
) -> Vec<ShareMode> {
    let mut in_flight: Option<ShareMode> = None;
    let mut proposed = Vec::new();
    for i in 0..n {
        let mode = m.next(in_flight, per_mode);
        proposed.push(mode);
        if let Some(f) = in_flight.take() {
            m.record(f, base(f), per_mode);
        }
        if fails(mode, i) {
            m.record_failure(mode);
        } else {
            m.record_loaded(mode);
            in_flight = Some(mode);
        }
    }
    proposed
}

/// The kept mode's state moves on batches that load whether or not their time comes
/// (batches under 1 MiB, a peer that sends no time). Before, only a recorded time did:
/// a probe whose time never came was proposed for ever, and after an outage the kept
/// mode's later loads cleared nothing, so one failure, however much later, failed it out.
#[test]
fn the_kept_modes_state_moves_on_loads_without_times() {
    let (mut m, kept) = kept_state(3);
    for _ in 0..AUTO_KEPT_STRIKES {
        assert_eq!(m.next(None, 3), kept);
        m.record_failure(kept);
    }
    let probe = m.next(None, 3);
    assert_ne!(probe, kept);
    m.record_loaded(probe);
    assert_eq!(
        m.next(None, 3),
        kept,
        "the kept mode runs again after the probe"
    );
    m.record_loaded(kept);
    for _ in 0..50 {
        assert_eq!(m.next(None, 3), kept);
        m.record_loaded(kept);
    }
    m.record_failure(kept);
    assert_eq!(
        m.kept,
        Some(kept),
        "one failure after loads fails nothing out"
    );
    assert!(!m.failed_out[slot(kept)]);
}

/// Auto, measured until it keeps a mode with every mode loading (the `base` times).
fn kept_state(per_mode: u32) -> (Measured, ShareMode) {
    let mut m = Measured::default();
    drive(&mut m, 40, per_mode, |_, _| false);
    let kept = m.kept.expect("kept");
    (m, kept)
}

/// A kept mode that then fails every batch is given up: after three failures in a row one
/// batch runs another mode, which loads, and the kept mode's next failure fails it out;
/// Auto keeps another mode, which loads from then on. Before, a kept mode was never
/// revisited: every later batch failed.
#[test]
fn a_kept_mode_that_goes_bad_is_given_up() {
    let (mut m, kept) = kept_state(3);
    let proposed = drive(&mut m, 30, 3, |x, _| x == kept);
    let first_other = proposed.iter().position(|x| *x != kept).expect("a probe");
    assert_eq!(first_other, AUTO_KEPT_STRIKES as usize, "{proposed:?}");
    let now = m.kept.expect("another mode kept");
    assert_ne!(now, kept);
    assert!(m.failed_out[slot(kept)]);
    let last = &proposed[proposed.len() - 10..];
    assert!(last.iter().all(|x| *x == now), "{proposed:?}");
    let failures = proposed.iter().filter(|x| **x == kept).count();
    assert!(failures <= 6, "{failures} failed batches: {proposed:?}");
}

/// A fault that flaps after the pick (three failures of the kept mode, the probe loads, one
/// more failure) fails the kept mode out; after [`AUTO_PAROLE`] loaded batches it is tried
/// again, and, the fastest, kept again. Before, it stayed out for the process's life.
#[test]
fn a_mode_failed_out_by_a_flapping_fault_is_tried_again_and_kept() {
    let (mut m, kept) = kept_state(3);
    let proposed = drive(&mut m, 5, 3, |_, i| i != 3);
    assert!(m.failed_out[slot(kept)], "{proposed:?}");
    let other = m.kept.or_else(|| {
        drive(&mut m, 10, 3, |_, _| false);
        m.kept
    });
    assert!(other.is_some_and(|o| o != kept), "{other:?}");
    let later = drive(&mut m, AUTO_PAROLE as usize + 20, 3, |_, _| false);
    assert!(!m.failed_out[slot(kept)]);
    assert_eq!(
        m.kept,
        Some(kept),
        "{:?}",
        &later[AUTO_PAROLE as usize - 5..]
    );
    assert!(later[later.len() - 5..].iter().all(|x| *x == kept));
}

/// A mode paroled that was also dropped as slower is not measured again: the kept mode stays
/// kept (re-measuring could not pick it).
#[test]
fn a_paroled_mode_dropped_as_slower_leaves_the_kept_mode_kept() {
    let (mut m, kept) = kept_state(3);
    let other = AUTO_MODES.into_iter().find(|x| *x != kept).unwrap();
    m.fail_out(other);
    m.dropped[slot(other)] = true;
    for _ in 0..AUTO_PAROLE {
        m.record_loaded(kept);
    }
    assert!(!m.failed_out[slot(other)], "paroled");
    assert_eq!(
        m.kept,
        Some(kept),
        "still kept: the paroled mode stays dropped"
    );
}

/// A mode that fails whenever it runs is tried again at ever longer intervals: out for
/// [`AUTO_PAROLE`] loaded batches, then twice that, and so on; its failed batches stay few.
#[test]
fn a_mode_that_always_fails_is_tried_again_at_ever_longer_intervals() {
    let (mut m, kept) = kept_state(3);
    let proposed = drive(&mut m, 8 * AUTO_PAROLE as usize, 3, |x, _| x == kept);
    let failed = proposed.iter().filter(|x| **x == kept).count();
    // Out after at most 6 batches, paroled at 256, 768 and 1792 loaded batches after its
    // first fail-out (each parole costing a few more), not again before 2048 loaded.
    assert!(m.fail_outs[slot(kept)] >= 3, "{:?}", m.fail_outs);
    assert!(m.fail_outs[slot(kept)] <= 4, "{:?}", m.fail_outs);
    assert!(failed <= 6 * 4, "{failed} failed batches");
    assert_ne!(m.kept, Some(kept));
}

/// An outage after the pick fails every mode: the probe fails too, so the kept mode stays
/// (one batch in four tries another mode while it lasts), and it is kept after.
#[test]
fn an_outage_after_the_pick_keeps_the_kept_mode() {
    let (mut m, kept) = kept_state(3);
    let proposed = drive(&mut m, 24, 3, |_, _| true);
    assert_eq!(m.kept, Some(kept));
    assert!(!m.failed_out.iter().any(|x| *x));
    let probes = proposed.iter().filter(|x| **x != kept).count();
    assert_eq!(
        probes,
        24 / (AUTO_KEPT_STRIKES as usize + 1),
        "{proposed:?}"
    );
    let after = drive(&mut m, 10, 3, |_, _| false);
    assert!(after[1..].iter().all(|x| *x == kept), "{after:?}");
}

/// A fault that fails the kept mode and the first probe's mode, but not the third mode:
/// the next probe tries that one, and the kept mode is given up for it.
#[test]
fn a_probe_that_fails_is_followed_by_a_probe_of_another_mode() {
    let (mut m, kept) = kept_state(3);
    let first = m.probe_for(kept).expect("another mode");
    let proposed = drive(&mut m, 30, 3, |x, _| x == kept || x == first);
    let now = m.kept.expect("kept");
    assert!(now != kept && now != first, "{proposed:?}");
    assert!(m.failed_out[slot(kept)] && m.failed_out[slot(first)]);
    assert!(proposed[20..].iter().all(|x| *x == now), "{proposed:?}");
}

/// Three failures of the kept mode and then the outage ends: the probe loads, the kept
/// mode loads again and stays kept.
#[test]
fn a_short_outage_of_the_kept_mode_does_not_give_it_up() {
    let (mut m, kept) = kept_state(3);
    let proposed = drive(&mut m, 20, 3, |x, i| x == kept && i < 3);
    assert_eq!(m.kept, Some(kept), "{proposed:?}");
    assert!(!m.failed_out[slot(kept)]);
    assert!(proposed[6..].iter().all(|x| *x == kept), "{proposed:?}");
}

/// A mode whose every batch fails is proposed twice, not for ever: it fails again after
/// another mode's batch loaded, and is not measured again. Before, a failed batch left no
/// trace, so the failing mode kept the fewest batches and every later batch ran it.
#[test]
fn a_mode_that_always_fails_is_dropped_after_failing_twice() {
    use ShareMode::*;
    for bad in [AllRanks, Rank0Broadcast, SplitAllGather] {
        let Failing {
            proposed,
            kept,
            failed_out,
            ..
        } = run_failing(3, |m, _| m == bad);
        let tries = proposed.iter().filter(|m| **m == bad).count();
        assert_eq!(tries, 2, "{bad:?}: {proposed:?}");
        assert_eq!(failed_out, [bad], "{bad:?}: {proposed:?}");
        assert_ne!(kept, bad);
        // The fastest of the others.
        let want = if bad == SplitAllGather {
            Rank0Broadcast
        } else {
            SplitAllGather
        };
        assert_eq!(kept, want, "{bad:?}: {proposed:?}");
    }
}

/// One failure in the last round (a transient one) delays the decision by at most three
/// batches: the failed mode is measured again once another mode's batch was (its time
/// arrives one batch late). Before (a
/// failure counted as one of the mode's batches), the mode leading ran from then on, the
/// failed one never again, and nothing was kept until the give-up limit.
#[test]
fn one_failure_in_the_last_round_still_decides() {
    use ShareMode::*;
    let time = |m: ShareMode| match m {
        AllRanks => 1.3,
        Rank0Broadcast => 1.0,
        SplitAllGather => 1.2,
    };
    let clean = run_failing_at(3, time, |_, _| false);
    for bad in [AllRanks, SplitAllGather] {
        // The mode's third batch fails: the first batch of it at or after index 6.
        let first_late = clean
            .proposed
            .iter()
            .enumerate()
            .position(|(n, m)| n >= 6 && *m == bad);
        let at = first_late.expect("a third batch of the mode");
        let got = run_failing_at(3, time, |m, n| m == bad && n == at);
        let proposed = &got.proposed;
        assert_eq!(got.kept, clean.kept, "{bad:?}: {proposed:?}");
        assert!(
            got.slower.is_empty() && got.failed_out.is_empty(),
            "{bad:?}"
        );
        assert!(
            proposed.len() <= clean.proposed.len() + 3,
            "{bad:?}: {} batches, {} without the failure: {proposed:?}",
            proposed.len(),
            clean.proposed.len()
        );
    }
}

/// Batches that fail whatever their mode (the store down for a while) drop no mode: no
/// mode failed while another loaded. Once they load again, every mode is measured and the
/// pick is the one made without the outage.
#[test]
fn an_outage_that_fails_every_mode_drops_none() {
    let Failing {
        proposed,
        kept,
        slower,
        failed_out,
    } = run_failing(3, |_, n| n < 12);
    assert_eq!(kept, ShareMode::SplitAllGather, "{proposed:?}");
    // Only speed drops modes here (after the first round measured them all).
    assert_eq!(
        slower,
        [ShareMode::AllRanks, ShareMode::Rank0Broadcast],
        "{proposed:?}"
    );
    assert!(failed_out.is_empty(), "{proposed:?}");
    let after: Vec<_> = proposed[12..].to_vec();
    for m in AUTO_MODES {
        assert!(
            after.contains(&m),
            "{m:?} measured after the outage: {after:?}"
        );
    }
}

/// Two short outages a batch apart (a store that flaps) fail a mode again after another
/// mode's batch loaded, and then another mode fails too: an outage, no mode's own
/// failure. Nothing fails out, and the pick is the one made without them.
#[test]
fn a_flapping_store_fails_no_mode_out() {
    for (first, second) in [(0..3, 4..6), (1..4, 5..7), (0..2, 3..5)] {
        let got = run_failing(3, |_, n| first.contains(&n) || second.contains(&n));
        assert!(got.failed_out.is_empty(), "{:?}", got.proposed);
        assert_eq!(got.kept, ShareMode::SplitAllGather, "{:?}", got.proposed);
    }
}

/// The last mode measured (the others dropped as slower) failing on its own account:
/// the modes dropped as slower are tried again, the failing one fails out, and the
/// fastest of the others is kept. Before, the failing mode was proposed for ever.
#[test]
fn when_the_last_live_mode_fails_the_slower_ones_come_back() {
    use ShareMode::*;
    // TP 8 shape: AllRanks and Rank0Broadcast drop after the first round.
    let got = run_failing(3, |m, n| m == SplitAllGather && n >= 3);
    assert_eq!(got.failed_out, [SplitAllGather], "{:?}", got.proposed);
    assert_eq!(got.kept, Rank0Broadcast, "{:?}", got.proposed);
    assert!(got.proposed.len() < 20, "{:?}", got.proposed);
}

/// Patterns of the third review: a mode that goes bad once the others have enough
/// batches, a mode with the best median that then always fails, a broken mode plus a
/// short outage. Each was proposed for ever (the waiting leader, a suspect taken for the
/// best, the fewest batches); each now decides, keeping a mode that did not fail out.
#[test]
fn a_mode_going_bad_late_or_beside_an_outage_still_decides() {
    use ShareMode::*;
    let same = |_: ShareMode| 1.0;
    let ar_best = |m: ShareMode| match m {
        AllRanks => 1.0,
        Rank0Broadcast => 2.5,
        SplitAllGather => 1.2,
    };
    type Times<'a> = &'a dyn Fn(ShareMode) -> f64;
    type Fails<'a> = &'a dyn Fn(ShareMode, usize) -> bool;
    let cases: [(Times, Fails); 3] = [
        (&same, &|m, n| m == SplitAllGather && n >= 4),
        (&ar_best, &|m, n| m == AllRanks && n >= 2),
        (&base, &|m, n| m == AllRanks || (1..3).contains(&n)),
    ];
    for (i, (time, fails)) in cases.into_iter().enumerate() {
        let got = run_failing_at(3, time, fails);
        assert!(
            !got.failed_out.contains(&got.kept),
            "case {i}: {:?}",
            got.proposed
        );
        assert!(got.proposed.len() < 40, "case {i}: {:?}", got.proposed);
    }
}

proptest! {
    /// Whatever batches fail, for however long, Auto decides once they stop failing, and
    /// keeps a mode that did not fail out.
    #[test]
    fn any_failures_then_none_still_decide(pattern in proptest::collection::vec(any::<bool>(), 0..40)) {
        let got = run_failing(3, |_, n| pattern.get(n).copied().unwrap_or(false));
        prop_assert!(!got.failed_out.contains(&got.kept), "{:?}", got.proposed);
    }
}

/// [`run`]: the number of batches before the kept mode runs, and the mode kept.
fn decide(per_mode: u32, time: impl Fn(ShareMode, usize) -> f64) -> (usize, ShareMode) {
    let (proposed, kept) = run(per_mode, time);
    (proposed.len(), kept)
}

fn base(mode: ShareMode) -> f64 {
    match mode {
        ShareMode::AllRanks => 6.0,
        ShareMode::Rank0Broadcast => 2.5,
        ShareMode::SplitAllGather => 1.0,
    }
}

#[test]
fn clearly_slower_modes_drop_out_after_one_round() {
    // TP 8 shape: AllRanks 6×, Rank0Broadcast 2.5× SplitAllGather: both drop.
    // One round, then SplitAllGather twice more, and one batch while its third time is on
    // the way (the leader: SplitAllGather again).
    use ShareMode::*;
    let (proposed, kept) = run(3, |m, _| base(m));
    assert_eq!(kept, SplitAllGather);
    assert_eq!(
        proposed,
        [
            AllRanks,
            Rank0Broadcast,
            SplitAllGather,
            SplitAllGather,
            SplitAllGather,
            SplitAllGather
        ]
    );
    // Close modes are all measured 3 times, then one batch while the last time travels.
    let (batches, kept) = decide(3, |m, _| match m {
        AllRanks => 1.2,
        Rank0Broadcast => 1.3,
        SplitAllGather => 1.0,
    });
    assert_eq!((batches, kept), (10, SplitAllGather));
}

#[test]
fn the_batch_proposed_before_the_first_round_is_known_goes_to_the_unknown_mode() {
    use ShareMode::*;
    // When SplitAllGather's first time arrives it is the slow one: its second batch (run
    // meanwhile) is spent for nothing, and AllRanks and Rank0Broadcast get three each.
    let (proposed, kept) = run(3, |m, _| match m {
        AllRanks => 1.0,
        Rank0Broadcast => 1.3,
        SplitAllGather => 6.0,
    });
    assert_eq!(kept, AllRanks);
    assert_eq!(
        &proposed[..4],
        &[AllRanks, Rank0Broadcast, SplitAllGather, SplitAllGather]
    );
    assert_eq!(proposed.len(), 9);
    assert_eq!(proposed.iter().filter(|m| **m == SplitAllGather).count(), 2);
    // Among modes with as many batches, the fastest so far is measured first.
    assert_eq!(proposed[4], AllRanks);
}

/// A mode slower per byte only because its first batch was much smaller (a small batch's
/// fixed costs weigh more per byte) is measured again, not dropped; one slower on a batch
/// of a like size is dropped.
#[test]
fn a_mode_is_dropped_only_against_batches_of_a_like_size() {
    use ShareMode::*;
    let (mib, gib) = (1u64 << 20, 1u64 << 30);
    let mut m = Measured::default();
    m.record_batch(AllRanks, 1.0, gib, 3);
    m.record_batch(Rank0Broadcast, 3.0, 2 * mib, 3);
    m.record_batch(SplitAllGather, 1.1, gib, 3);
    assert!(!m.dropped[slot(Rank0Broadcast)], "dropped on a 2 MiB batch");
    // Its next batch, like sized and still slow: dropped now.
    m.record_batch(Rank0Broadcast, 2.0, gib, 3);
    assert!(m.dropped[slot(Rank0Broadcast)]);
    // Like sized from the start: dropped after the first round.
    let mut m = Measured::default();
    m.record_batch(AllRanks, 1.0, gib, 3);
    m.record_batch(Rank0Broadcast, 3.0, gib / 2, 3);
    m.record_batch(SplitAllGather, 1.1, gib, 3);
    assert!(m.dropped[slot(Rank0Broadcast)]);
}

#[test]
fn the_last_batch_before_the_decision_runs_the_leader() {
    use ShareMode::*;
    // One batch per mode: the fourth is proposed while SplitAllGather's time is on the way,
    // from the two times known (Rank0Broadcast leads); then SplitAllGather's time arrives
    // and decides.
    let (proposed, kept) = run(1, |m, _| match m {
        AllRanks => 3.0,
        Rank0Broadcast => 2.0,
        SplitAllGather => 1.0,
    });
    assert_eq!(
        proposed,
        [AllRanks, Rank0Broadcast, SplitAllGather, Rank0Broadcast]
    );
    assert_eq!(kept, SplitAllGather);
}

#[test]
fn a_batch_whose_time_never_came_is_measured_again() {
    use ShareMode::*;
    // Rank0Broadcast's batch failed on some rank: no time. It counted while in flight,
    // and is proposed again once the gate dropped its sample.
    let mut m = Measured::default();
    assert_eq!(m.next(None, 3), AllRanks);
    assert_eq!(m.next(Some(AllRanks), 3), Rank0Broadcast);
    m.record(AllRanks, 1.0, 3);
    assert_eq!(m.next(Some(Rank0Broadcast), 3), SplitAllGather);
    // Rank0Broadcast's sample was dropped at that gate.
    assert_eq!(m.next(Some(SplitAllGather), 3), Rank0Broadcast);
}

#[test]
fn one_outlier_batch_does_not_decide() {
    // AllRanks' second batch is a lucky outlier; its median stays slower.
    let (_, kept) = decide(3, |m, i| match (m, i) {
        (ShareMode::AllRanks, 1) => 0.5,
        (ShareMode::AllRanks, _) => 1.3,
        (ShareMode::Rank0Broadcast, _) => 1.2,
        (ShareMode::SplitAllGather, _) => 1.0,
    });
    assert_eq!(kept, ShareMode::SplitAllGather);
}

#[test]
fn auto_stops_measuring_when_no_group_time_comes_in() {
    let auto = AutoMode::new(ModeChoice::Auto, Bandwidths::UNKNOWN, 3);
    // One time in (SplitAllGather fastest), then none: a rank never sends its time.
    auto.observe_batch(
        ShareMode::SplitAllGather,
        64 << 20,
        Duration::from_millis(100),
    );
    // Each proposal is made with this rank's last batch in flight (its own time sent, the
    // group's never back).
    let due = Some(ShareMode::AllRanks);
    let limit = AUTO_GIVE_UP * ShareMode::COUNT as u32 * 3;
    for _ in 0..limit {
        auto.propose(3, 1 << 20, due);
        assert_eq!(auto.kept(), None, "still measuring within the limit");
    }
    let (mode, _) = auto.propose(3, 1 << 20, due);
    assert_eq!(auto.kept(), Some(ShareMode::SplitAllGather));
    assert_eq!(mode, ShareMode::SplitAllGather);
    // Nothing measured at all: AllRanks.
    let none = AutoMode::new(ModeChoice::Auto, Bandwidths::UNKNOWN, 1);
    for _ in 0..=AUTO_GIVE_UP * ShareMode::COUNT as u32 {
        none.propose(2, 1 << 20, due);
    }
    assert_eq!(none.kept(), Some(ShareMode::AllRanks));
}

#[test]
fn batches_too_small_to_measure_do_not_use_up_the_patience() {
    // No batch in flight at any gate (each landed under 1 MiB, so none sent a time):
    // however many, Auto keeps measuring instead of settling on AllRanks unmeasured.
    let auto = AutoMode::new(ModeChoice::Auto, Bandwidths::UNKNOWN, 3);
    for _ in 0..10 * AUTO_GIVE_UP * ShareMode::COUNT as u32 * 3 {
        auto.propose(3, 1 << 20, None);
    }
    assert_eq!(auto.kept(), None);
}

#[test]
fn batches_under_a_mebibyte_are_not_measured() {
    assert!(!AutoMode::measures((1 << 20) - 1));
    assert!(AutoMode::measures(1 << 20));
    let auto = AutoMode::new(ModeChoice::Auto, Bandwidths::UNKNOWN, 1);
    auto.observe_batch(ShareMode::AllRanks, 1000, Duration::from_millis(5));
    assert_eq!(auto.seen.lock().samples[slot(ShareMode::AllRanks)].len(), 0);
}

#[test]
fn equally_fast_modes_go_to_the_one_reading_least() {
    let (_, kept) = decide(3, |m, _| match m {
        ShareMode::AllRanks => 1.0,
        ShareMode::Rank0Broadcast => 1.03,
        ShareMode::SplitAllGather => 1.2,
    });
    assert_eq!(kept, ShareMode::Rank0Broadcast);
}

#[test]
fn a_close_call_is_measured_longer_until_it_is_clear() {
    use ShareMode::*;
    // SplitAllGather's first three batches happen to land just inside the tie margin
    // (1.09× Rank0Broadcast); its true time is 1.25×. Three batches each would keep it;
    // the close call measures more of each until the medians show Rank0Broadcast clearly
    // (a true ratio near the margin itself is still decided by noise, only over more
    // batches: `a_close_call_stops_at_its_cap`).
    let time = |m: ShareMode, i: usize| match (m, i) {
        (AllRanks, _) => 6.0,
        (Rank0Broadcast, _) => 1.0,
        (SplitAllGather, 0..=2) => 1.09,
        (SplitAllGather, _) => 1.25,
    };
    let (proposed, kept) = run(3, time);
    assert_eq!(kept, Rank0Broadcast);
    let of = |m: ShareMode| proposed.iter().filter(|p| **p == m).count();
    // AllRanks drops out after one round; the other two are measured until
    // SplitAllGather's median leaves the band, and one batch runs while the last time
    // travels.
    assert_eq!(
        (of(AllRanks), of(Rank0Broadcast), of(SplitAllGather)),
        (1, 6, 7),
        "{proposed:?}"
    );
    // A clear call is not measured longer: 1.2× is outside the doubt band.
    let (batches, kept) = decide(3, |m, _| match m {
        AllRanks => 6.0,
        Rank0Broadcast => 1.0,
        SplitAllGather => 1.2,
    });
    assert_eq!((batches, kept), (8, Rank0Broadcast));
}

#[test]
fn a_mode_near_the_margin_that_loses_the_tie_anyway_costs_no_batches() {
    use ShareMode::*;
    // Rank0Broadcast at 1.1× SplitAllGather: on either side of the margin SplitAllGather
    // is kept (it reads fewer store bytes), so no batch more than a clear call.
    let (batches, kept) = decide(3, |m, _| match m {
        AllRanks => 6.0,
        Rank0Broadcast => 1.1,
        SplitAllGather => 1.0,
    });
    assert_eq!((batches, kept), (8, SplitAllGather));
    // One batch per mode: a close call measures two of each.
    let (proposed, kept) = run(1, |m, _| match m {
        AllRanks => 6.0,
        Rank0Broadcast => 1.0,
        SplitAllGather => 1.1,
    });
    assert_eq!(kept, SplitAllGather);
    let of = |m: ShareMode| proposed.iter().filter(|p| **p == m).count();
    assert_eq!(
        (of(Rank0Broadcast), of(SplitAllGather)),
        (2, 3),
        "{proposed:?}"
    );
}

#[test]
fn a_close_call_that_shows_with_the_last_time_keeps_measuring() {
    use ShareMode::*;
    let mut m = Measured::default();
    // A first round (AllRanks drops out), then Rank0Broadcast twice more and
    // SplitAllGather once more: SplitAllGather's median 1.22× is a clear call.
    for (mode, t) in [
        (AllRanks, 6.0),
        (Rank0Broadcast, 1.0),
        (SplitAllGather, 1.3),
        (Rank0Broadcast, 1.0),
        (SplitAllGather, 1.14),
        (Rank0Broadcast, 1.0),
    ] {
        m.record(mode, t, 3);
    }
    // SplitAllGather's third batch is in flight: every count is complete, so the leader
    // is proposed.
    assert_eq!(m.next(Some(SplitAllGather), 3), Rank0Broadcast);
    // Its time makes the median 1.14×: a close call now, so nothing is kept, and the
    // batch after the leader's measures SplitAllGather again.
    m.record(SplitAllGather, 1.0, 3);
    assert_eq!(m.kept, None);
    assert_eq!(m.next(Some(Rank0Broadcast), 3), SplitAllGather);
}

#[test]
fn a_close_call_stops_at_its_cap() {
    use ShareMode::*;
    // Exactly on the tie margin for ever: every mode measured twice as long, then the tie
    // rule (SplitAllGather reads least); never more than 19 batches.
    let (proposed, kept) = run(3, |m, _| match m {
        AllRanks => 1.2,
        Rank0Broadcast => 1.0,
        SplitAllGather => 1.1,
    });
    assert_eq!(kept, SplitAllGather);
    let of = |m: ShareMode| proposed.iter().filter(|p| **p == m).count();
    assert_eq!(of(Rank0Broadcast), 6, "{proposed:?}");
    assert!(of(SplitAllGather) >= 6 && of(AllRanks) >= 6, "{proposed:?}");
    assert!(proposed.len() <= 19, "{}", proposed.len());
}

proptest! {
    /// Two runs whose batch times differ by noise keep the same mode whenever the true
    /// best leads the next by more than the noise and the tie margin together, and never
    /// run more than 19 batches before the kept mode (3 per mode, 6 in a close call, and
    /// one while the last time travels).
    #[test]
    fn two_noisy_runs_agree(
        times in prop::array::uniform3(1.0f64..4.0),
        noise_a in prop::collection::vec(-0.02f64..0.02, 24),
        noise_b in prop::collection::vec(-0.02f64..0.02, 24),
    ) {
        let t = |m: ShareMode| times[slot(m)];
        // Up to 7 batches per mode (6 measured in a close call, one run while the last
        // time travels); one spare.
        let noisy = |noise: &[f64], m: ShareMode, i: usize| {
            t(m) * (1.0 + noise.get(slot(m) * 8 + i).copied().unwrap_or(0.0))
        };
        let run = |noise: &[f64]| decide(3, |m, i| noisy(noise, m, i));
        let (na, a) = run(&noise_a);
        let (nb, b) = run(&noise_b);
        prop_assert!(na <= 19 && nb <= 19, "{} {}", na, nb);
        let mut sorted = times;
        sorted.sort_by(f64::total_cmp);
        // Separated: every pair of modes apart by more than the tie margin and the noise.
        let apart = |x: f64, y: f64| x.max(y) / x.min(y) > (1.0 + AUTO_TIE) * 1.05;
        let separated = apart(times[0], times[1]) && apart(times[1], times[2]) && apart(times[0], times[2]);
        if separated {
            prop_assert_eq!(a, b);
            // And the kept mode is within the tie margin (plus noise) of the fastest.
            prop_assert!(t(a) <= sorted[0] * (1.0 + AUTO_TIE) * 1.05);
        }
    }
}

/// Two modes that always fail (a fault of the share step: both shared modes fail, `AllRanks`
/// loads): each failure of one came right after the other's, which read as an outage and
/// cleared the suspicion, so neither failed out and Auto went on proposing them until it gave
/// up (about 74 batches, half failed, by a review's simulation). Now a pair that fails back
/// to back twice, with a third mode loading in between, fails out both.
#[test]
fn two_modes_that_always_fail_fail_out_together() {
    use ShareMode::*;
    for good in [AllRanks, Rank0Broadcast, SplitAllGather] {
        let Failing {
            proposed,
            kept,
            failed_out,
            ..
        } = run_failing(3, |m, _| m != good);
        assert_eq!(kept, good, "{good:?}: {proposed:?}");
        assert_eq!(failed_out.len(), 2, "{good:?}: {proposed:?}");
        let failed = proposed.iter().filter(|m| **m != good).count();
        assert!(
            failed <= 8,
            "{good:?}: {failed} failed batches: {proposed:?}"
        );
    }
}

/// A rank other than 0 that restarted measures again from nothing, and sees only the one mode
/// rank 0 keeps: before, it decided only by giving up (about 37 measured batches, with no
/// read-ahead or pins at lookup meanwhile, and `auto_decision` differing across ranks). It
/// now follows rank 0's kept mode at once, keeps it through a probe, and lets it go when rank
/// 0 measures again.
#[test]
fn a_restarted_rank_follows_rank_0s_kept_mode() {
    use ShareMode::*;
    let auto = AutoMode::new(ModeChoice::Auto, Bandwidths::UNKNOWN, 3);
    auto.follow(SplitAllGather, false);
    assert_eq!(auto.kept(), None, "rank 0 still measures");
    auto.follow(SplitAllGather, true);
    assert_eq!(auto.kept(), Some(SplitAllGather));
    // A probe (rank 0's kept mode failing): one proposal not kept.
    auto.follow(AllRanks, false);
    assert_eq!(auto.kept(), Some(SplitAllGather));
    auto.follow(SplitAllGather, true);
    // Rank 0 measures again.
    for m in [AllRanks, Rank0Broadcast, SplitAllGather] {
        auto.follow(m, false);
    }
    assert_eq!(auto.kept(), None);
    // A fixed mode follows nothing.
    let fixed = AutoMode::new(ModeChoice::Fixed(AllRanks), Bandwidths::UNKNOWN, 3);
    fixed.follow(SplitAllGather, true);
    assert_eq!(fixed.kept(), None);
}
