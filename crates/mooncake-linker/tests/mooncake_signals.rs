//! The host process's signals after a Mooncake client connects, in a test binary of its own:
//! the wheel's `ResourceTracker` is a process singleton, so in a binary whose other tests
//! connect clients of their own it may have run before this one looked.
//!
//! Per the wheel's source (`mooncake-store/src/real_client.cpp`, `ResourceTracker`, at the
//! pinned wheel's commit 3b5a594), when `dlsym(RTLD_DEFAULT, "Py_IsInitialized")` finds no
//! Python it blocks SIGINT, SIGTERM and SIGHUP in the thread that creates the first client
//! (threads spawned from it inherit the mask) and takes them on a thread of its own, which
//! tears the clients down and ends the process: an engine's own graceful shutdown on SIGTERM
//! would never run. The shim makes Python visible to it (`csrc/shim.cpp`); a wheel or shim
//! change that brings the tracker's signal thread back fails here.
//!
//! Run: `scripts/with-mooncake.sh cargo test -p mooncake-linker --test mooncake_signals`.

mod common;

use common::{available, PrivateMaster};
use mooncake_linker::store::mooncake::MooncakeStore;

/// For SIGINT, SIGTERM and SIGHUP: whether this thread blocks it, and whether its handler is
/// the default one.
fn signal_state() -> Vec<(i32, bool, bool)> {
    [libc::SIGINT, libc::SIGTERM, libc::SIGHUP]
        .into_iter()
        .map(|sig| {
            // SAFETY: plain queries: `sigset_t` and `sigaction` are plain data the calls fill;
            // a null new-set / new-action changes nothing.
            unsafe {
                let mut mask: libc::sigset_t = std::mem::zeroed();
                assert_eq!(
                    libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut mask),
                    0
                );
                let mut action: libc::sigaction = std::mem::zeroed();
                assert_eq!(libc::sigaction(sig, std::ptr::null(), &mut action), 0);
                (
                    sig,
                    libc::sigismember(&mask, sig) == 1,
                    action.sa_sigaction == libc::SIG_DFL,
                )
            }
        })
        .collect()
}

/// Neither blocked nor handled: what a process that never loaded Mooncake has.
fn untouched() -> Vec<(i32, bool, bool)> {
    [libc::SIGINT, libc::SIGTERM, libc::SIGHUP]
        .into_iter()
        .map(|sig| (sig, false, true))
        .collect()
}

#[test]
fn connecting_a_client_leaves_the_processs_signals_alone() {
    if !available(
        "connecting_a_client_leaves_the_processs_signals_alone",
        &["MOONCAKE_MASTER_BIN"],
    ) {
        return;
    }
    let master = PrivateMaster::start(&[]);
    let before = signal_state();
    assert_eq!(before, untouched(), "the test harness changed them already");
    let store = MooncakeStore::connect(master.config(16 << 20)).expect("connect");
    assert_eq!(
        signal_state(),
        untouched(),
        "the connecting thread's signals changed"
    );
    let spawned = std::thread::spawn(signal_state).join().unwrap();
    assert_eq!(spawned, untouched(), "a thread spawned after the connect");
    drop(store);
}
