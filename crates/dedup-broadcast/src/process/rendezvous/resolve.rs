//! An address (`host:port`: rank 0's rendezvous, a served store) to socket addresses, within
//! a bound.
//!
//! A numeric address is parsed at once. A name is looked up on a thread of its own, waited
//! for at most the caller's bound: the system's resolver has no deadline a caller can set, and
//! a resolver that does not answer must not hold a rank past its join deadline. A lookup
//! still running then ends by itself (the resolver's own timeouts) and its answer is dropped.
//!
//! Syntax is told apart from lookups: an address with no port, or a bad one, is a
//! configuration error that no retry mends, while a name that does not resolve yet (a DNS
//! record published only once rank 0's host is up, a resolver briefly down) may resolve on the
//! next attempt.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Most lookup threads running at once in this process. Each [`AddressLookups`] starts a
/// fresh lookup beside one still running after `FRESH_AFTER`, and every joiner attempt or
/// client makes its own: a resolver that never answers (a name service stuck on a dead
/// server) would otherwise leak a thread every few seconds until the process has none. At
/// the cap a caller waits on the lookup it has running, or fails (it may pass later).
const MAX_RUNNING_LOOKUPS: usize = 16;

/// Lookup threads running now in this process.
static RUNNING_LOOKUPS: AtomicUsize = AtomicUsize::new(0);

/// Why an address gave no socket address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolveFailure {
    /// Not a `host:port` address (no port, a bad port, no host): never retried.
    Invalid(String),
    /// The lookup failed, found nothing or did not answer within the bound: it may pass
    /// later.
    Lookup(String),
}

impl std::fmt::Display for ResolveFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ResolveFailure::Invalid(s) | ResolveFailure::Lookup(s) => f.write_str(s),
        }
    }
}

impl std::error::Error for ResolveFailure {}

/// The socket addresses rendezvous address `addr` names, looked up for at most `wait`.
pub(crate) fn resolve_within(
    addr: &str,
    wait: Duration,
) -> Result<Vec<SocketAddr>, ResolveFailure> {
    AddressLookups::new(addr, RENDEZVOUS).resolve(wait)
}

/// What a rendezvous calls its address in its errors.
pub(crate) const RENDEZVOUS: &str = "rendezvous address";

/// The answer of one lookup thread.
type Answer = std::io::Result<Vec<SocketAddr>>;

/// Repeated lookups of one address (a joiner's attempts, a client's connections): at most one
/// runs at a time. A lookup still running when its wait ended is waited for again by the
/// next attempt, rather than a new thread started beside it, so a resolver that does not
/// answer costs one thread, not one per attempt. A name's answer is kept for 30 s
/// (`KEEP_ANSWER`; each new connection of a pool would otherwise ask the resolver again)
/// unless the caller [forgets](AddressLookups::forget_tried) it, as it should when none of its
/// addresses accepted a connection (the name may point elsewhere now).
///
/// ```
/// use std::time::Duration;
/// use dedup_broadcast::{AddressLookups, ResolveFailure};
/// let mut store = AddressLookups::new("127.0.0.1:7000", "store address");
/// assert_eq!(store.resolve(Duration::ZERO).unwrap()[0].port(), 7000);
/// let mut bad = AddressLookups::new("rank0", "store address");
/// assert!(matches!(bad.resolve(Duration::ZERO), Err(ResolveFailure::Invalid(_))));
/// ```
#[derive(Debug)]
pub struct AddressLookups {
    addr: String,
    /// What the address is, for errors ("rendezvous address").
    what: &'static str,
    /// The lookup under way, and when it began.
    running: Option<(mpsc::Receiver<Answer>, Instant)>,
    /// The last lookup's answer, and when it came.
    answer: Option<(Vec<SocketAddr>, Instant)>,
    /// Lookups started (threads spawned), for the tests.
    started: u32,
}

/// How long a name's answer is used before it is looked up again.
const KEEP_ANSWER: Duration = Duration::from_secs(30);

/// How long a lookup that does not answer holds back a new one: past it, the next attempt
/// starts a fresh lookup (the name may resolve now) and leaves the old one to end by itself.
const FRESH_AFTER: Duration = Duration::from_secs(5);

impl AddressLookups {
    /// Lookups of `addr` (`host:port`), which errors call `what` ("store address").
    pub fn new(addr: &str, what: &'static str) -> Self {
        AddressLookups {
            addr: addr.to_owned(),
            what,
            running: None,
            answer: None,
            started: 0,
        }
    }

    /// Drops the kept answer: the next [`resolve`](Self::resolve) looks the name up again.
    pub fn forget(&mut self) {
        self.answer = None;
    }

    /// Drops the kept answer if it is still `tried`, the addresses none of which accepted a
    /// connection: the name may point elsewhere now. A newer answer (another caller sharing
    /// these lookups looked the name up again meanwhile) is kept: `tried` says nothing about it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use dedup_broadcast::AddressLookups;
    /// let mut store = AddressLookups::new("localhost:7000", "store address");
    /// let tried = store.resolve(Duration::from_secs(5)).unwrap();
    /// store.forget_tried(&[]); // not the answer kept: nothing dropped
    /// store.forget_tried(&tried); // the answer kept: looked up again next time
    /// ```
    pub fn forget_tried(&mut self, tried: &[SocketAddr]) {
        if self.answer.as_ref().is_some_and(|(kept, _)| kept == tried) {
            self.answer = None;
        }
    }

    /// The socket addresses, looked up (or the lookup under way waited for) for at most
    /// `wait`. A numeric address is parsed at once; an address that is not `host:port` is
    /// [`ResolveFailure::Invalid`]; a name that did not resolve within `wait` is
    /// [`ResolveFailure::Lookup`] (it may resolve on a later call).
    pub fn resolve(&mut self, wait: Duration) -> Result<Vec<SocketAddr>, ResolveFailure> {
        let (addr, what) = (self.addr.as_str(), self.what);
        if let Ok(a) = addr.parse::<SocketAddr>() {
            return Ok(vec![a]);
        }
        check_syntax(addr, what)?;
        if let Some((kept, at)) = &self.answer {
            if at.elapsed() < KEEP_ANSWER {
                return Ok(kept.clone());
            }
        }
        let (rx, began) = match self.running.take() {
            Some((rx, began)) if began.elapsed() < FRESH_AFTER => (rx, began),
            // A fresh lookup beside the old one; at the process's cap, the old one again.
            Some((old, began)) => match spawn_lookup(addr, what) {
                Ok(rx) => {
                    self.started = self.started.saturating_add(1);
                    (rx, Instant::now())
                }
                Err(_) => (old, began),
            },
            None => {
                self.started = self.started.saturating_add(1);
                (spawn_lookup(addr, what)?, Instant::now())
            }
        };
        let found = match rx.recv_timeout(wait) {
            Ok(found) => found,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                self.running = Some((rx, began));
                return Err(ResolveFailure::Lookup(format!(
                    "looking up {what} {addr:?}: no answer within {wait:?}"
                )));
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(ResolveFailure::Lookup(format!(
                    "looking up {what} {addr:?}: the lookup ended without an answer"
                )))
            }
        };
        match found {
            Ok(v) if !v.is_empty() => {
                self.answer = Some((v.clone(), Instant::now()));
                Ok(v)
            }
            Ok(_) => Err(ResolveFailure::Lookup(format!(
                "{what} {addr:?} resolves to nothing"
            ))),
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                Err(ResolveFailure::Invalid(format!("{what} {addr:?}: {e}")))
            }
            Err(e) => Err(ResolveFailure::Lookup(format!(
                "looking up {what} {addr:?}: {e}"
            ))),
        }
    }
}

/// Starts looking `addr` up on a thread of its own; its answer comes on the receiver.
fn spawn_lookup(addr: &str, what: &str) -> Result<mpsc::Receiver<Answer>, ResolveFailure> {
    let owned = addr.to_owned();
    spawn_counted(&RUNNING_LOOKUPS, (addr, what), move || {
        owned.to_socket_addrs().map(Iterator::collect::<Vec<_>>)
    })
}

/// Runs `lookup` (of `addr`, called `what`) on a thread of its own, counted in `running`
/// (the process's [`RUNNING_LOOKUPS`]) while it runs; refused at [`MAX_RUNNING_LOOKUPS`].
fn spawn_counted(
    running: &'static AtomicUsize,
    (addr, what): (&str, &str),
    lookup: impl FnOnce() -> Answer + Send + 'static,
) -> Result<mpsc::Receiver<Answer>, ResolveFailure> {
    let claimed = running.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
        (n < MAX_RUNNING_LOOKUPS).then_some(n + 1)
    });
    if claimed.is_err() {
        // The caller's error says it (logged where it is handled).
        tracing::debug!(
            addr,
            what,
            "name lookups are not answering: not starting another"
        );
        return Err(ResolveFailure::Lookup(format!(
            "looking up {what} {addr:?}: {MAX_RUNNING_LOOKUPS} lookups of names are still \
             running in this process (the system resolver does not answer): none started"
        )));
    }
    /// Counts the lookup's thread out when it ends, however.
    struct Running(&'static AtomicUsize);
    impl Drop for Running {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::AcqRel);
        }
    }
    let (tx, rx) = mpsc::sync_channel(1);
    let counted = Running(running);
    let run = move || {
        let found = lookup();
        drop(counted);
        // The caller may have stopped waiting: its receiver is then gone.
        let _ = tx.send(found);
    };
    std::thread::Builder::new()
        .name("kvlink-resolve".into())
        .spawn(run)
        .map(|_| rx)
        .map_err(|e| {
            // The closure, and the count with it, was dropped with the failed spawn.
            ResolveFailure::Lookup(format!(
                "looking up {what} {addr:?}: no thread to look it up on: {e}"
            ))
        })
}

/// `addr` is `host:port`, with a host and a port number (the lookup needs no more).
fn check_syntax(addr: &str, what: &str) -> Result<(), ResolveFailure> {
    let invalid = |why: &str| Err(ResolveFailure::Invalid(format!("{what} {addr:?}: {why}")));
    let Some((host, port)) = addr.rsplit_once(':') else {
        return invalid("no port (expected host:port)");
    };
    if host.is_empty() {
        return invalid("no host (expected host:port)");
    }
    if port.parse::<u16>().is_err() {
        return invalid("the port is not a number from 0 to 65535");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resolver that never answers costs at most the cap in threads, however many
    /// lookups are asked for; the count falls as lookups end.
    #[test]
    fn lookups_that_never_answer_are_capped_process_wide() {
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let hold = std::sync::Arc::new(std::sync::Mutex::new(hold));
        let stuck = || {
            let hold = hold.clone();
            move || {
                let _ = hold.lock().unwrap().recv_timeout(Duration::from_secs(30));
                Ok(Vec::new())
            }
        };
        // A count of its own: the process's is left to the other tests of this binary.
        static RUNNING: AtomicUsize = AtomicUsize::new(0);
        let mut started = Vec::new();
        let mut refused = 0;
        for _ in 0..MAX_RUNNING_LOOKUPS + 8 {
            match spawn_counted(&RUNNING, ("stuck.invalid:1", "test address"), stuck()) {
                Ok(rx) => started.push(rx),
                Err(ResolveFailure::Lookup(m)) => {
                    assert!(m.contains("still running"), "{m}");
                    refused += 1;
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!((started.len(), refused), (MAX_RUNNING_LOOKUPS, 8));
        drop(release);
        for rx in started {
            assert!(rx.recv_timeout(Duration::from_secs(10)).is_ok());
        }
        // Counted out as they end (the count falls just before each answer is sent).
        assert_eq!(RUNNING.load(Ordering::Acquire), 0);
        assert!(
            spawn_counted(&RUNNING, ("a.invalid:1", "test address"), || Ok(Vec::new())).is_ok()
        );
    }

    #[test]
    fn numeric_addresses_parse_without_a_lookup() {
        let v = resolve_within("127.0.0.1:29500", Duration::ZERO).unwrap();
        assert_eq!(v, ["127.0.0.1:29500".parse::<SocketAddr>().unwrap()]);
        let v = resolve_within("[::1]:7", Duration::ZERO).unwrap();
        assert_eq!(v, ["[::1]:7".parse::<SocketAddr>().unwrap()]);
    }

    #[test]
    fn an_address_without_a_usable_port_or_host_is_invalid() {
        for bad in ["rank0", "rank0:", "rank0:http", "rank0:70000", ":29500", ""] {
            match resolve_within(bad, Duration::from_secs(1)) {
                Err(ResolveFailure::Invalid(why)) => assert!(why.contains("rendezvous"), "{why}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_name_that_does_not_resolve_is_a_lookup_failure_within_the_bound() {
        // `.invalid` never resolves (RFC 6761); with no resolver the lookup fails or takes
        // its own time, and the bound ends the wait.
        let wait = Duration::from_millis(1500);
        let t0 = std::time::Instant::now();
        match resolve_within("rank0.kvlink.invalid:29500", wait) {
            Err(ResolveFailure::Lookup(why)) => {
                assert!(why.contains("rank0.kvlink.invalid"), "{why}")
            }
            other => panic!("{other:?}"),
        }
        assert!(
            t0.elapsed() < wait + Duration::from_millis(500),
            "{:?}",
            t0.elapsed()
        );
    }

    #[test]
    fn a_lookup_still_running_is_waited_for_again_not_started_twice() {
        let mut l = AddressLookups::new("localhost:29500", RENDEZVOUS);
        // No wait at all: the first lookup is most likely still running when it ends.
        if l.resolve(Duration::ZERO).is_err() {
            assert!(l.running.is_some(), "the lookup under way is kept");
        }
        let v = l.resolve(Duration::from_secs(5)).unwrap();
        assert!(v.iter().all(|a| a.ip().is_loopback()), "{v:?}");
        assert!(l.running.is_none());
    }

    /// Before, every new connection of a served-store client looked its name up again.
    #[test]
    fn a_names_answer_is_kept_until_forgotten() {
        let mut l = AddressLookups::new("localhost:29500", RENDEZVOUS);
        let first = l.resolve(Duration::from_secs(5)).unwrap();
        assert_eq!(
            l.resolve(Duration::ZERO).unwrap(),
            first,
            "kept: no wait needed"
        );
        assert_eq!(l.started, 1, "one lookup for both");
        l.forget();
        assert_eq!(l.resolve(Duration::from_secs(5)).unwrap(), first);
        assert_eq!(l.started, 2, "looked up again once forgotten");
        // A failure of other addresses than those kept (an older answer's) keeps the answer.
        let other: Vec<SocketAddr> = vec!["192.0.2.1:29500".parse().unwrap()];
        l.forget_tried(&other);
        assert!(
            l.answer.is_some(),
            "an older answer's failure keeps the newer one"
        );
        l.forget_tried(&first);
        assert!(l.answer.is_none(), "the kept answer's own failure drops it");
        assert_eq!(l.resolve(Duration::from_secs(5)).unwrap(), first);
        assert_eq!(l.started, 3);
        // A kept answer past its time is looked up again too.
        let at = &mut l.answer.as_mut().unwrap().1;
        if let Some(old) = at.checked_sub(KEEP_ANSWER) {
            *at = old;
            l.resolve(Duration::from_secs(5)).unwrap();
            assert_eq!(l.started, 4);
        }
    }

    #[test]
    fn localhost_resolves_by_name() {
        let v = resolve_within("localhost:29500", Duration::from_secs(5)).unwrap();
        assert!(
            v.iter().all(|a| a.ip().is_loopback() && a.port() == 29500),
            "{v:?}"
        );
    }
}
