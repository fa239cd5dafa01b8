//! The handle's own bounds, with comm threads that never answer (no GPU, no NCCL: a stand-in
//! thread holds the channels a real comm thread would).

use super::*;

/// A stand-in comm thread: holds the channels a real one would, answers nothing, and ends
/// when the test drops the returned sender.
struct Silent {
    pending: Pending,
    /// Requests sent to the thread (kept, so that sends succeed).
    _requests: mpsc::Receiver<Request>,
    release: mpsc::Sender<()>,
}

fn silent(rank: u32, size: u32, grace: Duration, deadline: Instant) -> Silent {
    let (tx, rx) = mpsc::channel::<Request>();
    let (ready_tx, ready_rx) = mpsc::sync_channel(1);
    let (done_tx, done_rx) = mpsc::sync_channel::<()>(1);
    let (release, released) = mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        let _keep = (ready_tx, done_tx);
        let _ = released.recv();
    });
    Silent {
        pending: Pending {
            handle: handle(rank, size, grace, tx, thread, done_rx),
            ready: ready_rx,
            deadline,
        },
        _requests: rx,
        release,
    }
}

/// A handle over a stand-in comm thread.
fn handle(
    rank: u32,
    size: u32,
    grace: Duration,
    tx: mpsc::Sender<Request>,
    thread: std::thread::JoinHandle<()>,
    done: mpsc::Receiver<()>,
) -> NcclCollective {
    NcclCollective {
        rank,
        size,
        ordinal: 0,
        grace,
        abort_tx: Mutex::new(Some(tx.clone())),
        tx: Mutex::new(Some(tx)),
        interrupt: Arc::new(AbortRequest::default()),
        seq: AtomicU64::new(0),
        last_ms: AtomicU64::new(f64::NAN.to_bits()),
        unusable: Arc::new(AtomicBool::new(false)),
        ending: AtomicBool::new(false),
        aborted: Arc::new(Mutex::new(None)),
        group: Arc::new(Mutex::new(None)),
        quiet: Arc::new(AtomicBool::new(false)),
        peers_in_process: false,
        thread: Mutex::new(Some(thread)),
        done: Mutex::new(Some(done)),
        leaked: AtomicU64::new(0),
    }
}

/// A comm thread that panics under an operation (run as the real one is, through
/// `run_comm_thread`): the call fails at once with "ended during", its host buffer is leaked
/// (the operation's end is unknown), the handle is broken, and closing it joins the thread.
/// Before, the panic skipped the thread's end report and the close left the thread behind.
#[test]
fn a_comm_thread_that_panics_fails_its_call_and_is_joined() {
    let (tx, rx) = mpsc::channel::<Request>();
    let (done_tx, done_rx) = mpsc::sync_channel::<()>(1);
    let thread = std::thread::spawn(move || {
        run_comm_thread(1, done_tx, move || {
            let request = rx.recv();
            // Its call sees the thread go (the reply's sender dropped) well before the thread
            // has ended: on a loaded machine that window let `close`, which did not wait for
            // an unusable handle's thread, leave this one behind.
            drop(request);
            std::thread::sleep(Duration::from_millis(300));
            panic!("test: injected defect under an operation");
        })
    });
    let h = handle(1, 2, Duration::from_secs(5), tx, thread, done_rx);
    let t0 = Instant::now();
    let r = h.all_gather_bytes(
        &[7u8; 64],
        kv_loader::deadline_after(Duration::from_secs(20)),
    );
    assert!(
        matches!(&r, Err(CollectiveError::Backend(m)) if m.contains("ended during")),
        "{r:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(h.leaked_host_bytes() >= 128, "{}", h.leaked_host_bytes());
    assert!(h.broken().is_some());
    assert!(h.close(kv_loader::deadline_after(Duration::from_secs(5))));
    assert!(!h.close(Instant::now()), "a second close does nothing");
}

/// A failed operation may leave work on the device until the comm thread's abort has drained
/// the comm stream, which the real thread tells (`quiet`) before its reply: then
/// `may_leave_work` answers `false`, so the stage a failed share used is reused. Before, it
/// answered `true` whenever the handle was broken, and every failed share over NCCL lost its
/// staging buffer for good (a rank whose buffers were all lost failed every batch).
#[test]
fn a_failure_whose_abort_drained_leaves_no_work_behind() {
    for drained in [false, true] {
        let (tx, rx) = mpsc::channel::<Request>();
        let (done_tx, done_rx) = mpsc::sync_channel::<()>(1);
        let aborted = Arc::new(Mutex::new(None));
        let quiet = Arc::new(AtomicBool::new(false));
        let (a, q) = (aborted.clone(), quiet.clone());
        let thread = std::thread::spawn(move || {
            run_comm_thread(0, done_tx, move || {
                while let Ok(req) = rx.recv() {
                    // As `Worker::serve` on a timeout: abort (drained or not), then reply.
                    *a.lock() = Some("test: the operation timed out".into());
                    q.store(drained, Ordering::Release);
                    let _ = req.reply.send(Err(CollectiveError::Timeout {
                        op: req.op.name(),
                        seq: req.seq,
                        missing: Vec::new(),
                    }));
                }
            })
        });
        let mut h = handle(0, 1, Duration::from_secs(5), tx, thread, done_rx);
        h.aborted = aborted;
        h.quiet = quiet;
        let e = h
            .all_gather_bytes(&[1u8; 8], kv_loader::deadline_after(Duration::from_secs(5)))
            .unwrap_err();
        assert!(h.broken().is_some(), "{e}");
        assert_eq!(h.may_leave_work(&e), !drained, "drained: {drained}, {e}");
        // With peers in this process, a peer's kernel may still write the region.
        h.peers_in_process = true;
        assert!(h.may_leave_work(&e), "peers in process, drained: {drained}");
        assert!(h.close(kv_loader::deadline_after(Duration::from_secs(5))));
    }
}

/// A failed start of an in-process group gives up on the ranks still starting together: one
/// bound for all of them, and their threads' ends waited for together. Before, each silent
/// rank took its own bound, then its drop another (8 ranks: 16 graces).
#[test]
fn a_failed_start_gives_up_on_every_silent_rank_within_one_bound() {
    let grace = Duration::from_millis(150);
    let deadline = kv_loader::deadline_after(Duration::from_millis(50));
    // Rank 0 fails at once; ranks 1..8 never answer.
    let mut ranks: Vec<Silent> = (0..8).map(|r| silent(r, 8, grace, deadline)).collect();
    let (fail_tx, fail_rx) = mpsc::sync_channel(1);
    fail_tx
        .send(Err(CollectiveError::Backend("rank 0: no GPU".into())))
        .unwrap();
    ranks[0].pending.ready = fail_rx;
    let (pending, releases): (Vec<_>, Vec<_>) = ranks
        .into_iter()
        .map(|s| (s.pending, (s.release, s._requests)))
        .unzip();
    let t0 = Instant::now();
    let r = start_all(pending);
    let took = t0.elapsed();
    assert!(
        matches!(&r, Err(CollectiveError::Backend(m)) if m.contains("no GPU")),
        "{r:?}"
    );
    // One grace pair for the give-up (the silent threads are then left at once).
    assert!(took < grace * 2 + Duration::from_millis(600), "{took:?}");
    drop(releases);
}

/// A start of an in-process group that times out names the ranks whose start never answered
/// (an operator drains their GPUs). Before, `missing` was empty.
#[test]
fn a_timed_out_start_names_the_ranks_that_never_answered() {
    let grace = Duration::from_millis(50);
    let deadline = kv_loader::deadline_after(Duration::from_millis(50));
    // Rank 0 and 2 start; rank 1 and 3 never answer.
    let mut ranks: Vec<Silent> = (0..4).map(|r| silent(r, 4, grace, deadline)).collect();
    for r in [0, 2] {
        let (ok_tx, ok_rx) = mpsc::sync_channel(1);
        ok_tx.send(Ok(())).unwrap();
        ranks[r].pending.ready = ok_rx;
    }
    let (pending, releases): (Vec<_>, Vec<_>) = ranks
        .into_iter()
        .map(|s| (s.pending, (s.release, s._requests)))
        .unzip();
    let r = start_all(pending);
    assert!(
        matches!(&r, Err(CollectiveError::Timeout { op: "init", missing, .. }) if missing == &[1, 3]),
        "{:?}",
        r.err()
    );
    drop(releases);
}

/// A comm thread that ends before it says whether it started (a panic in its start, say) is
/// reported as that, at once: before, the join answered `Timeout` as if a peer were late.
#[test]
fn a_comm_thread_that_ends_while_starting_is_no_timeout() {
    let (tx, _requests) = mpsc::channel::<Request>();
    let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<(), CollectiveError>>(1);
    let (done_tx, done_rx) = mpsc::sync_channel::<()>(1);
    let thread = std::thread::spawn(move || drop((ready_tx, done_tx)));
    let pending = Pending {
        handle: handle(0, 2, Duration::from_millis(50), tx, thread, done_rx),
        ready: ready_rx,
        deadline: Instant::now() + Duration::from_secs(5),
    };
    let t0 = Instant::now();
    let Err(err) = pending.ready() else {
        panic!("a handle from a comm thread that ended");
    };
    assert!(
        matches!(&err, CollectiveError::Backend(m) if m.contains("ended while starting")),
        "{err:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
}

/// An abort takes no sequence number: the rank's next operation reports the number its peers
/// give theirs. Before, each abort moved this rank's numbers one ahead.
#[test]
fn an_abort_takes_no_sequence_number() {
    let s = silent(0, 2, Duration::from_millis(20), Instant::now());
    let h = &s.pending.handle;
    h.abort("test: a peer failed");
    let r = h.all_gather_bytes(
        &[1u8; 8],
        kv_loader::deadline_after(Duration::from_millis(30)),
    );
    assert!(
        matches!(r, Err(CollectiveError::Aborted { seq: 0, .. })),
        "{r:?}"
    );
    drop(s.release);
}

/// A handle whose comm thread is known silent is dropped at once, not after its grace.
#[test]
fn a_handle_whose_comm_thread_is_silent_drops_at_once() {
    let grace = Duration::from_secs(2);
    let s = silent(0, 2, grace, Instant::now());
    s.pending.handle.unusable.store(true, Ordering::Release);
    let t0 = Instant::now();
    drop(s.pending);
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "{:?}",
        t0.elapsed()
    );
    drop(s.release);
}

/// A host call whose request never went out (the handle already unusable) frees its buffer;
/// one whose request went out and got no reply leaks it, counted.
#[test]
fn only_a_host_buffer_the_comm_thread_may_still_use_is_leaked() {
    let grace = Duration::from_millis(20);
    let s = silent(1, 2, grace, Instant::now());
    let h = &s.pending.handle;
    let soon = || kv_loader::deadline_after(Duration::from_millis(30));
    // Sent, never answered: the comm thread may still write the buffer.
    let r = h.all_gather_bytes(&[1u8; 1000], soon());
    assert!(matches!(r, Err(CollectiveError::Timeout { .. })), "{r:?}");
    assert!(h.leaked_host_bytes() >= 2000, "{}", h.leaked_host_bytes());
    let after_first = h.leaked_host_bytes();
    // Never sent (the handle is unusable now): nothing more is leaked.
    let r = h.all_gather_bytes(&[1u8; 1000], soon());
    assert!(matches!(r, Err(CollectiveError::Aborted { .. })), "{r:?}");
    assert_eq!(h.leaked_host_bytes(), after_first);
    drop(s.release);
}

/// A formed group that will not be used (its control group failed to start) gives up as a
/// whole: every handle is asked to abort rather than finalize, and the comm threads' ends are
/// waited for against one bound, not one after another.
#[test]
fn a_group_given_up_asks_every_rank_to_abort_and_waits_once() {
    let grace = Duration::from_millis(300);
    let ranks: Vec<Silent> = (0..6)
        .map(|r| silent(r, 6, grace, Instant::now()))
        .collect();
    let t0 = Instant::now();
    give_up(
        ranks.iter().map(|s| &s.pending.handle),
        "test: control failed",
    );
    let took = t0.elapsed();
    for s in &ranks {
        assert_eq!(
            s.pending.handle.interrupt.asked().as_deref(),
            Some("test: control failed")
        );
    }
    // One bound of three times the grace for all six (one after another: six times that,
    // 5.4 s), with room for a loaded machine.
    assert!(took < grace * 3 + Duration::from_millis(1200), "{took:?}");
    // Closed: dropping them now waits no more.
    let t1 = Instant::now();
    drop(ranks);
    assert!(t1.elapsed() < grace, "{:?}", t1.elapsed());
}

/// Settings no group can run with are refused before any NCCL call (no library needed).
#[test]
fn a_zero_init_timeout_or_abort_grace_is_refused() {
    assert!(NcclConfig::default().check().is_ok());
    for config in [
        NcclConfig {
            init_timeout: Duration::ZERO,
            ..NcclConfig::default()
        },
        NcclConfig {
            abort_grace: Duration::ZERO,
            ..NcclConfig::default()
        },
    ] {
        let far = kv_loader::deadline_after(Duration::from_secs(5));
        for r in [
            NcclCollective::join_by(([0; 128], 0, 2), 0, config, far).map(drop),
            NcclGroup::new_in_process_with(&[0, 1], config).map(drop),
        ] {
            match r {
                Err(CollectiveError::Backend(m)) => assert!(m.contains("is zero"), "{m}"),
                other => panic!("{other:?}"),
            }
        }
    }
}
