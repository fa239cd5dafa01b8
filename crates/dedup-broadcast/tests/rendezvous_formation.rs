//! `RendezvousFormation` with ranks as threads (the linker's process tests cover separate
//! processes): both handles re-form at a new epoch after one broke; a re-formation while a
//! rank is away fails within its bound naming the rank, and the next one meets it; a joiner
//! whose rank 0 gave up on a formation keeps trying until its own deadline, over TCP and
//! over a key-value exchange.
#![cfg(target_os = "linux")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use dedup_broadcast::{
    CollectiveError, FormedGroup, GroupFormation, GroupHandles, KeyValueExchange, MeetingPoint,
    MemoryExchange, Rendezvous, RendezvousConfig, RendezvousError, RendezvousFormation,
};

const REFORM: Duration = Duration::from_millis(800);

fn tcp(rank: u32, world: u32, at: &str) -> RendezvousConfig {
    RendezvousConfig::new(rank, world, MeetingPoint::Tcp(at.into()))
        .timeout(Duration::from_secs(20))
}

fn soon() -> Instant {
    kv_loader::deadline_after(Duration::from_secs(20))
}

/// Three ranks' formations over TCP (rank 0 listening on a free port).
fn formations(world: u32) -> Vec<RendezvousFormation> {
    let r0 = Rendezvous::new(tcp(0, world, "127.0.0.1:0")).unwrap();
    let at = r0.listen_addr().unwrap().to_string();
    std::iter::once(r0)
        .chain((1..world).map(|r| Rendezvous::new(tcp(r, world, &at)).unwrap()))
        .map(|rv| RendezvousFormation::sockets(rv).reform_timeout(REFORM))
        .collect()
}

/// Every rank of `handles` sums the ranks over the data handle and over the control one.
fn sums(handles: &[GroupHandles]) -> Vec<(u64, u64)> {
    std::thread::scope(|s| {
        let hs: Vec<_> = handles
            .iter()
            .map(|h| {
                s.spawn(move || {
                    let r = u64::from(h.data.rank());
                    let a = h.data.all_gather_u64(r, soon()).unwrap().iter().sum();
                    let b = h.control.all_gather_u64(r, soon()).unwrap().iter().sum();
                    (a, b)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank 1 forms; rank 0's first formation gives up after 500 ms (`first` checks its result)
/// and its second, started at once, meets rank 1 and rank 2, which starts 900 ms in. The
/// epoch of each rank's group (rank order).
fn rank_0_tries_twice(
    r0: &mut Rendezvous,
    r1: &mut Rendezvous,
    r2: &mut Rendezvous,
    first: impl FnOnce(Result<FormedGroup, RendezvousError>) + Send,
) -> Vec<u64> {
    let (a, b, c) = std::thread::scope(|s| {
        let one = s.spawn(|| r1.form());
        let lead = s.spawn(|| {
            first(r0.form_by(kv_loader::deadline_after(Duration::from_millis(500))));
            r0.form()
        });
        std::thread::sleep(Duration::from_millis(900));
        let two = s.spawn(|| r2.form());
        (
            lead.join().unwrap(),
            one.join().unwrap(),
            two.join().unwrap(),
        )
    });
    [a, b, c].into_iter().map(|g| g.unwrap().epoch()).collect()
}

#[test]
fn both_handles_re_form_at_a_new_epoch_after_one_broke() {
    let fs = formations(3);
    let first: Vec<GroupHandles> = std::thread::scope(|s| {
        let hs: Vec<_> = fs
            .iter()
            .map(|f| s.spawn(move || f.form().unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(first.iter().all(|h| h.epoch == 1));
    assert_eq!(sums(&first), vec![(3, 3); 3]);
    // One rank's data handle breaks (a failed collective); the others find out at their next
    // operation, as a batch would.
    first[1].data.abort("a test broke it");
    let failed = std::thread::scope(|s| {
        let hs: Vec<_> = first
            .iter()
            .map(|h| s.spawn(move || h.data.all_gather_u64(1, soon()).is_err()))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .filter(|&f| f)
            .count()
    });
    assert_eq!(
        failed, 3,
        "every rank's operation fails once one rank broke"
    );
    // Every rank re-forms: data and control both new, epoch 2.
    let next: Vec<GroupHandles> = std::thread::scope(|s| {
        let hs: Vec<_> = fs
            .iter()
            .map(|f| s.spawn(move || f.reform(f.rank(), 2, soon()).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(next.iter().all(|h| h.epoch == 2 && h.broken().is_none()));
    assert_eq!(sums(&next), vec![(3, 3); 3]);
    assert!(fs.iter().all(|f| f.last().unwrap().epoch == 2));
}

#[test]
fn a_re_formation_without_a_rank_fails_within_its_bound_and_the_next_meets_it() {
    let fs = formations(3);
    let t = Instant::now();
    // Ranks 0 and 1 re-form; rank 2 is away.
    let errs: Vec<CollectiveError> = std::thread::scope(|s| {
        let hs: Vec<_> = fs[..2]
            .iter()
            .map(|f| s.spawn(move || f.reform(f.rank(), 1, soon()).unwrap_err()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        t.elapsed() < REFORM + Duration::from_secs(2),
        "{:?}",
        t.elapsed()
    );
    for e in &errs {
        match e {
            CollectiveError::Formation { missing, .. } => {
                assert_eq!(missing, &vec![2], "{e}");
                assert!(!e.is_refusal(), "a missing rank may come back: {e}");
            }
            other => panic!("{other}"),
        }
    }
    // Rank 2 comes back (its first formation, bounded by the rendezvous timeout) while the
    // others keep re-forming at each step, each attempt bounded.
    let (formed, tries) = std::thread::scope(|s| {
        let back = s.spawn(|| fs[2].form().unwrap());
        let others: Vec<_> = fs[..2]
            .iter()
            .map(|f| {
                s.spawn(move || {
                    for attempt in 1.. {
                        if let Ok(h) = f.reform(f.rank(), 1, soon()) {
                            return (h, attempt);
                        }
                        assert!(attempt < 30, "never met rank 2");
                    }
                    unreachable!()
                })
            })
            .collect();
        let mut hs: Vec<(GroupHandles, u32)> =
            others.into_iter().map(|h| h.join().unwrap()).collect();
        hs.push((back.join().unwrap(), 1));
        let tries = hs.iter().map(|(_, n)| *n).collect::<Vec<_>>();
        (hs.into_iter().map(|(h, _)| h).collect::<Vec<_>>(), tries)
    });
    assert!(formed.iter().all(|h| h.epoch == 1), "{tries:?}");
    assert_eq!(sums(&formed), vec![(3, 3); 3]);
}

#[test]
fn a_tcp_joiner_that_rank_0_gave_up_on_meets_rank_0s_next_formation() {
    let r0 = Rendezvous::new(tcp(0, 3, "127.0.0.1:0")).unwrap();
    let at = r0.listen_addr().unwrap().to_string();
    let mut r0 = r0;
    let mut r1 = Rendezvous::new(tcp(1, 3, &at)).unwrap();
    let mut r2 = Rendezvous::new(tcp(2, 3, &at)).unwrap();
    // Rank 1 joins for 20 s; rank 0's first formation gives up (rank 2 is not there).
    let epochs = rank_0_tries_twice(&mut r0, &mut r1, &mut r2, |first| {
        assert!(matches!(
            first,
            Err(RendezvousError::Timeout { ref missing, .. }) if missing == &[2]
        ));
    });
    assert_eq!(epochs, vec![1, 1, 1]);
}

#[test]
fn an_exchange_joiner_that_rank_0_gave_up_on_meets_rank_0s_next_formation() {
    let x = Arc::new(MemoryExchange::new());
    let config = |rank: u32| {
        let exchange: Arc<dyn KeyValueExchange> = x.clone();
        RendezvousConfig::new(
            rank,
            3,
            MeetingPoint::Exchange {
                exchange,
                prefix: "g".into(),
            },
        )
        .timeout(Duration::from_secs(20))
    };
    let mut rvs: Vec<Rendezvous> = (0..3)
        .map(|r| Rendezvous::new(config(r)).unwrap())
        .collect();
    let [r0, r1, r2] = &mut rvs[..] else {
        unreachable!()
    };
    let epochs = rank_0_tries_twice(r0, r1, r2, |first| {
        assert!(matches!(first, Err(RendezvousError::Timeout { .. })));
    });
    assert_eq!(epochs[0], epochs[1]);
    assert_eq!(epochs[1], epochs[2]);
    assert!(epochs[0] >= 2, "the first epoch timed out: {epochs:?}");
}

/// A re-formation rank 0 refuses as configured (here a rank that says the group has another
/// size) fails on every rank that came as a refusal, with the rendezvous's typed error as
/// its source: trying again does not cure it.
#[test]
fn a_refused_re_formation_says_so_with_its_typed_error() {
    let r0 = Rendezvous::new(tcp(0, 2, "127.0.0.1:0")).unwrap();
    let at = r0.listen_addr().unwrap().to_string();
    let r1 = Rendezvous::new(tcp(1, 3, &at)).unwrap();
    let fs = [r0, r1].map(|rv| RendezvousFormation::sockets(rv).reform_timeout(REFORM));
    let errs: Vec<CollectiveError> = std::thread::scope(|s| {
        let hs: Vec<_> = fs
            .iter()
            .map(|f| s.spawn(move || f.reform(f.rank(), 1, soon()).unwrap_err()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in &errs {
        assert!(e.is_refusal(), "{e}");
        let CollectiveError::Formation { cause: Some(c), .. } = e else {
            panic!("{e:?}");
        };
        assert!(
            matches!(
                c.error().downcast_ref::<RendezvousError>(),
                Some(RendezvousError::WorldSizeMismatch {
                    rank: 1,
                    expected: 2,
                    got: 3
                })
            ),
            "{e}"
        );
    }
}

/// `reform_timeout` is held between its floor and the rendezvous timeout: a longer one held
/// every batch past what the first formation may take (10 s here for a 1 s rendezvous), and a
/// zero one failed every re-formation at once, so the group never came back.
#[test]
fn the_re_formation_bound_is_held_between_its_floor_and_the_rendezvous_timeout() {
    let short = |rank| {
        RendezvousConfig::new(rank, 2, MeetingPoint::Tcp("127.0.0.1:0".into()))
            .timeout(Duration::from_secs(1))
    };
    let f = RendezvousFormation::sockets(Rendezvous::new(short(0)).unwrap())
        .reform_timeout(Duration::from_secs(10));
    assert_eq!(f.reform_bound(), Duration::from_secs(1));
    // Rank 1 never comes: the re-formation fails within the rendezvous timeout's bound.
    let t = Instant::now();
    let e = f.reform(0, 1, soon()).unwrap_err();
    assert!(matches!(e, CollectiveError::Formation { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    let zero = RendezvousFormation::sockets(Rendezvous::new(short(0)).unwrap())
        .reform_timeout(Duration::ZERO);
    assert_eq!(zero.reform_bound(), dedup_broadcast::MIN_REFORM_TIMEOUT);
}
