//! The default meeting point: rank 0 listens on a TCP address, every other rank connects and
//! says hello; rank 0 answers each with the group, a refusal, or "not forming now".
//!
//! Rank 0's listener lives as long as its [`Rendezvous`](super::Rendezvous), so a rank
//! that restarts can connect at any time: a thread accepts, reads the hello, and hands it to
//! the formation in progress, or answers at once that none is (naming the live group's
//! epoch, or why the last formation failed); the joiner then tries again until its deadline.

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::decide::{decide, missing, IdSource, Rank0Address};
use super::message::{fits_a_frame, Hello, Reply, Welcome};
use super::resolve::{resolve_within, AddressLookups, ResolveFailure, RENDEZVOUS};
use super::RendezvousError;
use crate::process::mesh::MeshListener;
use crate::process::wire::{read_frame, write_frame};

/// How long rank 0 waits for a connected rank's hello, and gives a reply to go out.
const MESSAGE_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest rank 0 spends, all together, answering hellos that came in as a formation closed
/// (each is told no formation runs; one that is not told in time sees its connection end).
const LATE_ANSWERS: Duration = Duration::from_secs(1);
/// How long past its deadline a joiner waits for the answer of a formation it is in.
const REPLY_GRACE: Duration = Duration::from_millis(500);
/// Pause between a joiner's attempts.
const RETRY: Duration = Duration::from_millis(50);
/// Longest pause between a joiner's attempts while rank 0 answers that its group is live
/// (a restarted rank waiting for the others to re-form): the pause doubles from [`RETRY`] up
/// to this, each attempt costing rank 0 a connection and a thread.
const IDLE_RETRY: Duration = Duration::from_millis(500);
/// Pause between a joiner's attempts while rank 0's name does not resolve: each attempt asks
/// the resolver, so not every `RETRY`.
const LOOKUP_RETRY: Duration = Duration::from_millis(500);
/// How long rank 0 waits for its own listening address to be looked up.
const OWN_LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the accepting thread rests after a failed accept (out of descriptors).
const ACCEPT_RETRY: Duration = Duration::from_millis(20);
/// Most hellos read at once (each on a thread, for up to `MESSAGE_TIMEOUT`): past it, a new
/// connection is closed unread (its rank retries), so a burst of connections that send
/// nothing cannot take every thread and descriptor of rank 0's process.
const MAX_HELLOS_IN_FLIGHT: usize = 128;
/// Most hellos of another group size kept for the decision (which they refuse for every rank,
/// naming the first): past it, one is refused alone at once, so that processes of another size
/// that connect and stay cannot hold rank 0's descriptors without bound.
const MAX_OTHER_SIZES: usize = 4;

/// What joiners hear when rank 0's formation ended without deciding (it unwound).
const ENDED_ABNORMALLY: &str = "rank 0's formation ended abnormally";

/// Rank 0's formation slot while a formation is open: closed on drop unless the formation
/// closed it (so a formation that unwinds does not leave hellos going to no one).
struct OpenSlot<'a>(Option<&'a Mutex<LeaderState>>);

impl Drop for OpenSlot<'_> {
    fn drop(&mut self) {
        if let Some(state) = self.0 {
            state.lock().ended_abnormally();
        }
    }
}

/// A hello that reached rank 0's listener.
struct Arrival {
    stream: TcpStream,
    hello: Result<Hello, RendezvousError>,
}

#[derive(Default)]
struct LeaderState {
    forming: Option<mpsc::Sender<Arrival>>,
    live_epoch: Option<u64>,
    last_failure: Option<String>,
    /// Tests: how many of the accepting thread's next polls fail (as out of memory).
    #[cfg(test)]
    failing_polls: u32,
    /// Tests: hellos answered idle (no formation in progress).
    #[cfg(test)]
    idle_answers: u32,
}

impl LeaderState {
    /// The formation in progress ended without deciding (it unwound): its slot closes, no
    /// group is live, and joiners hear why.
    fn ended_abnormally(&mut self) {
        self.forming = None;
        self.live_epoch = None;
        self.last_failure = Some(ENDED_ABNORMALLY.into());
    }

    /// The formation in progress decided: the group it formed is live, or no group is and
    /// joiners hear why.
    fn ended(&mut self, decision: &Result<Welcome, RendezvousError>) {
        match decision {
            Ok(w) => {
                self.live_epoch = Some(w.epoch);
                self.last_failure = None;
            }
            Err(e) => {
                self.live_epoch = None;
                self.last_failure = Some(e.to_string());
            }
        }
    }

    /// The answer to a hello while no formation is in progress: the live group's epoch, or
    /// why the last formation failed.
    fn idle(&self) -> Reply {
        Reply::Idle {
            live_epoch: self.live_epoch,
            last_failure: self.last_failure.clone(),
        }
    }
}

/// The ranks that joined the formation in progress, each waiting on its connection for the
/// answer.
#[derive(Default)]
struct Joiners {
    /// Ranks whose hello was taken.
    joined: Vec<(TcpStream, Hello)>,
    /// Ranks that run another version (the rank, and its refusal).
    foreign: Vec<(TcpStream, u32, RendezvousError)>,
}

impl Joiners {
    /// Lets go of the ranks that hung up (they gave up waiting), joined or of another
    /// version: a foreign process that has gone must not fail the formation.
    fn drop_hung_up(&mut self) {
        self.joined.retain(|(s, h)| {
            let gone = hung_up(s);
            if gone {
                tracing::info!(rank = h.rank, "a joining rank gave up; waiting for another");
            }
            !gone
        });
        self.foreign.retain(|(s, rank, _)| {
            let gone = hung_up(s);
            if gone {
                tracing::info!(rank, "a rank of another version hung up; no longer counted");
            }
            !gone
        });
    }

    /// The joined ranks' hellos.
    fn hellos(&self) -> Vec<Hello> {
        self.joined.iter().map(|(_, h)| h.clone()).collect()
    }

    /// The ranks of `world` that have neither joined (per `hellos`) nor been heard from
    /// with another version.
    fn absent(&self, world: u32, hellos: &[Hello]) -> Vec<u32> {
        let mut absent = missing(world, hellos);
        absent.retain(|r| !self.foreign.iter().any(|(_, fr, _)| fr == r));
        absent
    }

    /// Takes one arrival: a hello joins, a rank of `world` of another version waits for the
    /// decision, and so does a hello of another group size (up to [`MAX_OTHER_SIZES`] of them);
    /// any other bad hello is refused at once, and so is a hello that can be no member (rank 0,
    /// or a rank past a group of its own size `world`: a broken or foreign client must not fail
    /// the formation of the others). A member's hello (this version, this size) for a rank
    /// already claimed replaces the earlier claim, which is refused with `DuplicateRank`: a
    /// process whose host went away without a hang-up (a crash, a cut link) leaves a claim that
    /// never reads as gone, and its restart must still join. A hello of another version or
    /// size replaces only such a claim of its rank, never a member's: a stray process must not
    /// knock a live rank out (both stay, and the decision refuses every rank, naming it).
    fn take(&mut self, world: u32, Arrival { stream, hello }: Arrival) {
        let outside = |rank: u32| rank == 0 || rank >= world;
        let refused = match hello {
            Ok(h) if h.world == world && outside(h.rank) => RendezvousError::SettingsMismatch {
                rank: h.rank,
                what: "the rank".into(),
                expected: format!("1 to {} (rank 0 leads)", world.saturating_sub(1)),
                got: h.rank.to_string(),
            },
            Ok(h) if h.world != world => {
                self.supersede(h.rank, |j| j.world != world, false);
                if self.other_sizes(world) < MAX_OTHER_SIZES {
                    self.joined.push((stream, h));
                    return;
                }
                RendezvousError::WorldSizeMismatch {
                    rank: h.rank,
                    expected: world,
                    got: h.world,
                }
            }
            Ok(h) => {
                self.supersede(h.rank, |_| true, true);
                self.joined.push((stream, h));
                return;
            }
            Err(e @ RendezvousError::VersionMismatch { rank, .. }) if !outside(rank) => {
                self.supersede(rank, |_| false, true);
                self.foreign.push((stream, rank, e));
                return;
            }
            Err(e) => e,
        };
        let mut s = stream;
        let _ = reply(&mut s, &Reply::Refused(refused));
    }

    /// How many joined hellos are of a group size other than `world`.
    fn other_sizes(&self, world: u32) -> usize {
        self.joined.iter().filter(|(_, j)| j.world != world).count()
    }

    /// Refuses and lets go of the earlier claim of `rank` that a newer hello replaces, if any:
    /// a joined one that `joined` accepts, or (when `foreign`) one of another version.
    fn supersede(&mut self, rank: u32, joined: impl Fn(&Hello) -> bool, foreign: bool) {
        let earlier = if let Some(i) = self
            .joined
            .iter()
            .position(|(_, j)| j.rank == rank && joined(j))
        {
            self.joined.swap_remove(i).0
        } else if let Some(i) = self
            .foreign
            .iter()
            .position(|(_, r, _)| foreign && *r == rank)
        {
            self.foreign.swap_remove(i).0
        } else {
            return;
        };
        tracing::warn!(
            rank,
            "a second hello for a rank: the newer claim replaces the earlier one, which is \
             refused (a restart after a crash, or two processes run as this rank)"
        );
        let mut earlier = earlier;
        let _ = reply(
            &mut earlier,
            &Reply::Refused(RendezvousError::DuplicateRank { rank }),
        );
    }

    /// Answers every joiner with `decision`; a rank of another version hears its own refusal
    /// unless the formation failed. Returns the joined ranks the answer could not be written
    /// to, with why (a rank that hung up just then, a welcome past the frame limit).
    fn answer(self, decision: &Result<Welcome, RendezvousError>) -> Vec<(u32, std::io::Error)> {
        let answer = match decision {
            Ok(w) => Reply::Welcome(Box::new(w.clone())),
            Err(e) => Reply::Refused(e.clone()),
        };
        let mut undelivered = Vec::new();
        for (mut s, h) in self.joined {
            if let Err(e) = reply(&mut s, &answer) {
                undelivered.push((h.rank, e));
            }
        }
        for (mut s, _, e) in self.foreign {
            let r = match decision {
                Err(d) => Reply::Refused(d.clone()),
                Ok(_) => Reply::Refused(e),
            };
            let _ = reply(&mut s, &r);
        }
        undelivered
    }
}

/// Rank 0's side: the listener and its accepting thread.
pub(crate) struct TcpLeader {
    addr: SocketAddr,
    state: Arc<Mutex<LeaderState>>,
    wake: UnixStream,
    thread: Option<JoinHandle<()>>,
}

/// Writes `r` to a joiner (bounded); an error says the joiner did not get it.
fn reply(stream: &mut TcpStream, r: &Reply) -> std::io::Result<()> {
    reply_by(stream, r, kv_loader::deadline_after(MESSAGE_TIMEOUT))
}

/// [`reply`] by `by` (callers give one no later than `MESSAGE_TIMEOUT` from now).
fn reply_by(stream: &mut TcpStream, r: &Reply, by: Instant) -> std::io::Result<()> {
    write_frame(stream, &r.encode(), by)
}

/// A formation decided `decision` but its welcome did not reach the joined ranks of
/// `undelivered`: no group formed (they will never connect), so rank 0 records no live group
/// and fails the formation, naming them.
fn delivered(
    decision: Result<Welcome, RendezvousError>,
    mut undelivered: Vec<(u32, std::io::Error)>,
) -> Result<Welcome, RendezvousError> {
    undelivered.sort_by_key(|(rank, _)| *rank);
    match decision {
        Ok(_) if !undelivered.is_empty() => {
            let why: Vec<String> = undelivered
                .iter()
                .map(|(rank, e)| format!("rank {rank}: {e}"))
                .collect();
            tracing::error!(why = %why.join("; "), "rank 0's welcome was not delivered");
            Err(RendezvousError::Timeout {
                missing: undelivered.iter().map(|(rank, _)| *rank).collect(),
                detail: format!(
                    "rank 0's welcome could not be delivered ({})",
                    why.join("; ")
                ),
            })
        }
        decision => decision,
    }
}

/// True when the peer of `stream` has hung up (it gave up waiting).
fn hung_up(stream: &TcpStream) -> bool {
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one live pollfd; a zero timeout never blocks.
    let r = unsafe { libc::poll(&mut pfd, 1, 0) };
    r > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// Rank 0's handle on a group it formed: should its connect fail, the group is not live.
pub(crate) struct LiveGroup {
    state: Arc<Mutex<LeaderState>>,
    epoch: u64,
}

impl LiveGroup {
    /// The group's connect failed on rank 0: unless a later formation made another, no group
    /// is live, and joiners hear why (they heard the group's epoch, and ended `Occupied` at
    /// their deadline, until rank 0's next formation).
    pub(crate) fn connect_failed(&self, why: &RendezvousError) {
        let mut st = self.state.lock();
        if st.live_epoch == Some(self.epoch) {
            st.live_epoch = None;
            st.last_failure = Some(format!(
                "connecting the group of epoch {} failed: {why}",
                self.epoch
            ));
        }
    }
}

impl TcpLeader {
    /// The handle on the group of `epoch` this leader formed.
    pub(crate) fn live_group(&self, epoch: u64) -> LiveGroup {
        LiveGroup {
            state: self.state.clone(),
            epoch,
        }
    }

    /// Listens at `addr` (rank 0's rendezvous address) for the life of the rendezvous.
    pub(crate) fn bind(addr: &str, version: String) -> Result<Self, RendezvousError> {
        // Rank 0's own address: bad syntax is its configuration's fault and never passes; a
        // name that did not resolve (the resolver down, a record not yet published) may
        // resolve when the engine tries again, so it is not a refusal.
        let addrs = resolve_within(addr, OWN_LOOKUP_TIMEOUT).map_err(|e| match e {
            ResolveFailure::Invalid(e) => RendezvousError::Config(e),
            ResolveFailure::Lookup(e) => RendezvousError::Unresolved(e),
        })?;
        let listener = TcpListener::bind(&addrs[..])
            .map_err(|e| RendezvousError::io(format!("rank 0 listening at {addr}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| RendezvousError::io("rank 0's listening address", e))?;
        // Non-blocking: a connection that went away between `poll` and `accept` must not
        // block the accept thread (and the leader's drop, which joins it) until the next one.
        listener
            .set_nonblocking(true)
            .map_err(|e| RendezvousError::io("rank 0's listener, made non-blocking", e))?;
        let (wake, wake_rx) =
            UnixStream::pair().map_err(|e| RendezvousError::io("rank 0's wake-up pipe", e))?;
        let state = Arc::new(Mutex::new(LeaderState::default()));
        let shared = state.clone();
        let thread = std::thread::Builder::new()
            .name("kvlink-rendezvous".into())
            .spawn(move || accept_loop(listener, wake_rx, shared, version))
            .map_err(|e| RendezvousError::io("starting rank 0's rendezvous thread", e))?;
        Ok(TcpLeader {
            addr: local,
            state,
            wake,
            thread: Some(thread),
        })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// One formation: collects hellos until every rank of `leader.world` is there (or the
    /// deadline), decides, and answers every rank that joined.
    pub(crate) fn form(
        &self,
        leader: &Hello,
        ids: Option<&IdSource>,
        deadline: Instant,
    ) -> Result<Welcome, RendezvousError> {
        let (tx, rx) = mpsc::channel();
        self.state.lock().forming = Some(tx);
        let mut slot = OpenSlot(Some(&self.state));
        let (decision, joiners) = gather(leader, ids, &rx, deadline);
        let decision = decision.and_then(fits_a_frame);
        self.state.lock().forming = None;
        // Hellos that raced in as the formation closed.
        let late: Vec<Arrival> = rx.try_iter().collect();
        let undelivered = joiners.answer(&decision);
        let decision = delivered(decision, undelivered);
        let mut st = self.state.lock();
        // The formation's own end is written below: the guard has nothing left to do.
        slot.0 = None;
        st.ended(&decision);
        let idle = st.idle();
        drop(st);
        // Bounded together: a flood that queued many must not hold the formation's end.
        let by = kv_loader::deadline_after(LATE_ANSWERS);
        for mut a in late {
            let _ = reply_by(&mut a.stream, &idle, by);
        }
        decision
    }
}

/// Collects the hellos that `arrivals` brings until every rank of `leader.world` has joined
/// or been heard from with another version (then decides), or `deadline`; the decision, and
/// the ranks waiting for it.
fn gather(
    leader: &Hello,
    ids: Option<&IdSource>,
    arrivals: &mpsc::Receiver<Arrival>,
    deadline: Instant,
) -> (Result<Welcome, RendezvousError>, Joiners) {
    let mut joiners = Joiners::default();
    let world = leader.world;
    let decision = loop {
        joiners.drop_hung_up();
        let hellos = joiners.hellos();
        let absent = joiners.absent(world, &hellos);
        if absent.is_empty() {
            break match joiners.foreign.first() {
                Some((_, _, e)) => Err(e.clone()),
                None => decide(leader, &hellos, ids, Rank0Address::Rewritten),
            };
        }
        let left = deadline.saturating_duration_since(Instant::now());
        // Checked before receiving: arrivals queued faster than they are handled (a flood of
        // refused hellos on the open port) would otherwise keep the formation past its bound.
        if left.is_zero() {
            break Err(RendezvousError::Timeout {
                missing: absent,
                detail: format!("rank 0 waited for every rank of {world} to join"),
            });
        }
        match arrivals.recv_timeout(left.min(Duration::from_millis(200))) {
            Ok(arrival) => joiners.take(world, arrival),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            // No arrival can come any more (the accepting side let go of its sender): wait
            // for the deadline without spinning, so the formation still ends by it.
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                std::thread::sleep(left.min(Duration::from_millis(200)));
            }
        }
    };
    (decision, joiners)
}

impl Drop for TcpLeader {
    fn drop(&mut self) {
        use std::io::Write;
        let _ = (&self.wake).write_all(&[1]);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Accepts connections until woken; hands each hello to the formation in progress, or
/// answers that none is. The threads still reading a hello when it is woken are ended (their
/// connections shut) and joined: none outlives the leader.
fn accept_loop(
    listener: TcpListener,
    wake: UnixStream,
    state: Arc<Mutex<LeaderState>>,
    version: String,
) {
    let mut reads = HelloReads::default();
    accept_until_woken(&listener, &wake, &state, &version, &mut reads);
    reads.end();
}

/// Waits, up to `PRUNE_EVERY_MS`, for a connection or the wake-up; how many of the two are
/// ready.
fn poll_listener(
    fds: &mut [libc::pollfd; 2],
    _state: &Mutex<LeaderState>,
) -> std::io::Result<libc::c_int> {
    #[cfg(test)]
    {
        let mut state = _state.lock();
        if state.failing_polls > 0 {
            state.failing_polls -= 1;
            return Err(std::io::Error::from_raw_os_error(libc::ENOMEM));
        }
    }
    // SAFETY: `fds` is two live pollfds for the call.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, PRUNE_EVERY_MS) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r)
}

/// Whether the leader asked its accepting thread to end (a byte on `wake`, or its end gone),
/// without waiting.
fn woken(wake: &UnixStream) -> bool {
    let mut byte = 0u8;
    // SAFETY: `byte` is one writable byte for the call; the descriptor is `wake`'s, open for
    // the call's length. MSG_PEEK leaves the byte for the poll that may follow.
    let r = unsafe {
        libc::recv(
            wake.as_raw_fd(),
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_DONTWAIT | libc::MSG_PEEK,
        )
    };
    r >= 0
}

/// How often, at most, rank 0's accepting thread lets go of answered hellos' connections.
const PRUNE_EVERY_MS: libc::c_int = 1000;

/// The threads reading hellos: each one's handle and a second descriptor of its connection.
#[derive(Default)]
struct HelloReads(Vec<(std::thread::JoinHandle<()>, std::net::TcpStream)>);

impl HelloReads {
    /// Forgets the threads that ended; how many still run.
    fn running(&mut self) -> usize {
        self.0.retain(|(t, _)| !t.is_finished());
        self.0.len()
    }

    /// Shuts the connection of every thread still running (its read or write fails at once)
    /// and joins them all. Only when the leader ends: no formation runs then (one borrows the
    /// leader), and the connections a formation took were answered and closed when it
    /// returned.
    fn end(self) {
        for (t, conn) in self.0 {
            if !t.is_finished() {
                let _ = conn.shutdown(std::net::Shutdown::Both);
            }
            let _ = t.join();
        }
    }
}

/// The accept loop proper, until woken (the leader ends).
fn accept_until_woken(
    listener: &TcpListener,
    wake: &UnixStream,
    state: &Arc<Mutex<LeaderState>>,
    version: &str,
    reads: &mut HelloReads,
) {
    let mut failed_accepts = 0u32;
    let mut failed_polls = 0u32;
    loop {
        let mut fds = [
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // Woken at least every `PRUNE_EVERY` to let go of the connections of hellos already
        // answered (their second descriptor, kept to shut them when the leader ends): they
        // would stay open, in CLOSE_WAIT, until the next connection came (hours, maybe).
        let r = match poll_listener(&mut fds, state) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // Out of memory, say: rest and try again (stopping would leave rank 0 accepting
            // no rank until the engine built a new rendezvous), still ending when woken.
            Err(e) => {
                if failed_polls == 0 {
                    tracing::error!(error = %e, "rank 0's rendezvous poll failed; trying again");
                }
                failed_polls = failed_polls.saturating_add(1);
                if woken(wake) {
                    return;
                }
                std::thread::sleep(ACCEPT_RETRY);
                continue;
            }
        };
        if failed_polls > 0 {
            tracing::info!(failed_polls, "rank 0's rendezvous polls again");
            failed_polls = 0;
        }
        if r == 0 {
            reads.running();
            continue;
        }
        if fds[1].revents != 0 {
            return;
        }
        let (stream, peer) = match listener.accept() {
            Ok(c) => {
                failed_accepts = 0;
                c
            }
            // The connection poll saw went away before it was accepted: nothing to take.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                // Out of descriptors (EMFILE) leaves the connection queued and `poll` ready at
                // once: rest instead of spinning, and log once per run of failures.
                if failed_accepts == 0 {
                    tracing::warn!(error = %e, "rank 0's rendezvous could not accept");
                }
                failed_accepts = failed_accepts.saturating_add(1);
                // Short of descriptors, poll never times out (the connection stays queued):
                // answered hellos' descriptors are let go here too.
                reads.running();
                std::thread::sleep(ACCEPT_RETRY);
                continue;
            }
        };
        // The hello's reads are bounded by timeouts on a blocking socket (an accepted socket
        // does not take the listener's non-blocking mode on Linux; said here all the same).
        if let Err(e) = stream.set_nonblocking(false) {
            tracing::warn!(error = %e, %peer, "a rendezvous connection stayed non-blocking; dropped");
            continue;
        }
        // Each hello is read on a thread of its own: a connection that sends nothing would
        // otherwise hold every other rank's hello for its whole read timeout.
        if reads.running() >= MAX_HELLOS_IN_FLIGHT {
            tracing::debug!(%peer, "too many rendezvous hellos in flight: connection closed");
            continue;
        }
        let conn = match stream.try_clone() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, %peer, "no descriptor for a rendezvous hello; dropped");
                continue;
            }
        };
        let (st, v) = (state.clone(), version.to_owned());
        let spawned = std::thread::Builder::new()
            .name("kvlink-rdv-hello".into())
            .spawn(move || admit(stream, peer, &st, &v));
        match spawned {
            Ok(t) => reads.0.push((t, conn)),
            Err(e) => {
                tracing::warn!(error = %e, %peer, "no thread for a rendezvous hello; dropped")
            }
        }
    }
}

/// Reads one connection's hello and hands it to the formation under way, or answers that
/// none is.
fn admit(
    mut stream: std::net::TcpStream,
    peer: std::net::SocketAddr,
    state: &Mutex<LeaderState>,
    version: &str,
) {
    let hello = match read_frame(&mut stream, kv_loader::deadline_after(MESSAGE_TIMEOUT)) {
        Ok(body) => Hello::decode(&body, version),
        Err(e) => {
            tracing::debug!(%peer, error = %e, "a connection sent no hello");
            return;
        }
    };
    let mut st = state.lock();
    let mut arrival = Arrival { stream, hello };
    if let Some(tx) = &st.forming {
        match tx.send(arrival) {
            Ok(()) => return,
            // The formation ended without closing its slot (it unwound): close it, and
            // answer that none is under way; the next formation opens a new one.
            Err(mpsc::SendError(back)) => {
                tracing::warn!("rank 0's formation ended without closing; answering idle");
                st.ended_abnormally();
                arrival = back;
            }
        }
    }
    let idle = st.idle();
    #[cfg(test)]
    {
        st.idle_answers += 1;
    }
    drop(st);
    let _ = reply(&mut arrival.stream, &idle);
}

/// What a joiner last heard, for the error at its deadline.
enum Heard {
    Nothing(String),
    Idle {
        live_epoch: Option<u64>,
        last_failure: Option<String>,
    },
}

impl Heard {
    /// The error rank `rank` ends with at its deadline after hearing this: the group that
    /// is live holds its place, or rank 0 is missing (with what it said, if anything).
    fn into_error(self, rank: u32) -> RendezvousError {
        match self {
            Heard::Idle {
                live_epoch: Some(epoch),
                ..
            } => RendezvousError::Occupied { rank, epoch },
            Heard::Idle { last_failure, .. } => RendezvousError::Timeout {
                missing: vec![0],
                detail: format!(
                    "rank 0 is not forming a group{}",
                    last_failure
                        .map(|f| format!("; its last formation failed: {f}"))
                        .unwrap_or_default()
                ),
            },
            Heard::Nothing(detail) => RendezvousError::Timeout {
                missing: vec![0],
                detail,
            },
        }
    }
}

/// This rank's hello and mesh listener, with the local IP that reaches rank 0 they were made
/// for.
type HelloAt = (IpAddr, Hello, MeshListener);

/// A joiner's side: connects to rank 0 at `addr` until it answers with the group or a
/// refusal, or `deadline`. `hello` builds this rank's hello for the local IP that reaches
/// rank 0 (binding the mesh listener there). Returns the welcome, the listener, and the IP
/// rank 0 was reached at.
pub(crate) fn join(
    addr: &str,
    rank: u32,
    mut hello: impl FnMut(IpAddr) -> Result<(Hello, MeshListener), RendezvousError>,
    deadline: Instant,
) -> Result<(Welcome, MeshListener, IpAddr), RendezvousError> {
    let mut heard = Heard::Nothing(format!("rank 0 did not answer at {addr}"));
    let mut lookups = AddressLookups::new(addr, RENDEZVOUS);
    let mut timed_out: Option<RendezvousError> = None;
    let mut listener: Option<HelloAt> = None;
    let mut pace = RETRY;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            // Rank 0's formation that timed out names the ranks that were missing: it says
            // more than what rank 0 answered since.
            return Err(timed_out.unwrap_or(heard.into_error(rank)));
        }
        match attempt(
            &mut lookups,
            left,
            deadline,
            &mut hello,
            &mut listener,
            &mut heard,
        )? {
            Some((Reply::Welcome(w), server)) => return welcomed(*w, listener, rank, server),
            // Rank 0's formation timed out (a rank missing): not a refusal of this rank,
            // which keeps trying until its own deadline (rank 0 may open the next one).
            Some((Reply::Refused(e @ RendezvousError::Timeout { .. }), _)) => timed_out = Some(e),
            Some((Reply::Refused(e), _)) => return Err(e),
            Some((
                Reply::Idle {
                    live_epoch,
                    last_failure,
                },
                _,
            )) => {
                pace = if live_epoch.is_some() {
                    (pace * 2).min(IDLE_RETRY)
                } else {
                    RETRY
                };
                heard = Heard::Idle {
                    live_epoch,
                    last_failure,
                };
                std::thread::sleep(pace.min(deadline.saturating_duration_since(Instant::now())));
                continue;
            }
            None => {}
        }
        pace = RETRY;
        std::thread::sleep(RETRY.min(deadline.saturating_duration_since(Instant::now())));
    }
}

/// One attempt to reach rank 0 at the address `lookups` looks up (connecting for at most
/// `left`): says this rank's hello, made anew by `hello` when the local IP that reaches rank 0
/// is not the one `listener` was made for, and reads the answer. Returns rank 0's reply and
/// its IP, or `None` when there was none (`heard` then says why, where there is something to
/// say).
fn attempt(
    lookups: &mut AddressLookups,
    left: Duration,
    deadline: Instant,
    hello: &mut impl FnMut(IpAddr) -> Result<(Hello, MeshListener), RendezvousError>,
    listener: &mut Option<HelloAt>,
    heard: &mut Heard,
) -> Result<Option<(Reply, IpAddr)>, RendezvousError> {
    // A name that does not resolve yet (rank 0's DNS record published once its host is up)
    // is tried again, as a rank 0 that does not answer is; bad syntax never resolves.
    let addrs = match lookups.resolve(left.min(MESSAGE_TIMEOUT)) {
        Ok(a) => a,
        Err(ResolveFailure::Invalid(e)) => return Err(RendezvousError::Config(e)),
        Err(ResolveFailure::Lookup(e)) => {
            *heard = Heard::Nothing(e);
            std::thread::sleep(
                LOOKUP_RETRY.min(deadline.saturating_duration_since(Instant::now())),
            );
            return Ok(None);
        }
    };
    let Some(mut stream) = connect_to_rank_0(&addrs, deadline, heard) else {
        // The name may point elsewhere by the next attempt (rank 0 restarted on another host).
        lookups.forget_tried(&addrs);
        return Ok(None);
    };
    let io = |e| RendezvousError::io("talking to rank 0", e);
    let local = stream.local_addr().map_err(io)?.ip();
    let server = stream.peer_addr().map_err(io)?.ip();
    if listener.as_ref().is_none_or(|(ip, _, _)| *ip != local) {
        // The old one first: its Unix listener's name (pid and nonce) is the one the new
        // listener binds, and two cannot (EADDRINUSE ended the join when the address that
        // reaches rank 0 changed, as when it restarted on another host).
        *listener = None;
        let (h, l) = hello(local)?;
        *listener = Some((local, h, l));
    }
    let Some((_, h, _)) = listener.as_ref() else {
        return Ok(None);
    };
    Ok(say_hello(&mut stream, h, deadline, heard)?.map(|r| (r, server)))
}

/// Connects to rank 0 at the first of `addrs` that answers by `deadline` (at most
/// [`MESSAGE_TIMEOUT`] each: the lookup and the addresses before it share the time, so the
/// last one tried ends by the deadline too); the stream, or `None` with the last failure in
/// `heard`.
fn connect_to_rank_0(
    addrs: &[SocketAddr],
    deadline: Instant,
    heard: &mut Heard,
) -> Option<TcpStream> {
    for a in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match TcpStream::connect_timeout(a, left.min(MESSAGE_TIMEOUT)) {
            Ok(s) => return Some(s),
            Err(e) => *heard = Heard::Nothing(format!("connecting to rank 0 at {a}: {e}")),
        }
    }
    None
}

/// Sends hello `h` on `stream` and reads rank 0's reply; `None` when the hello could not
/// be sent, or when no reply came (`heard` then says why).
fn say_hello(
    stream: &mut TcpStream,
    h: &Hello,
    deadline: Instant,
    heard: &mut Heard,
) -> Result<Option<Reply>, RendezvousError> {
    if write_frame(stream, &h.encode(), deadline).is_err() {
        return Ok(None);
    }
    // Rank 0 answers a formation it holds this hello in when it decides, at the
    // latest at its own deadline: wait a little past this rank's deadline for that
    // answer, so that both end the same way (a welcome is taken even then).
    let answer_by = deadline
        .max(Instant::now())
        .checked_add(REPLY_GRACE)
        .unwrap_or(deadline);
    match read_frame(stream, answer_by) {
        Ok(body) => Ok(Some(Reply::decode_for(&body, h)?)),
        Err(e) => {
            *heard = Heard::Nothing(format!("rank 0 hung up or went silent: {e}"));
            Ok(None)
        }
    }
}

/// Takes welcome `w`, which rank 0 sent at `server`, if it names this rank's hello (in
/// `listener`) at rank `rank`: the welcome, the mesh listener, and rank 0's IP.
fn welcomed(
    w: Welcome,
    listener: Option<HelloAt>,
    rank: u32,
    server: IpAddr,
) -> Result<(Welcome, MeshListener, IpAddr), RendezvousError> {
    let Some((_, h, l)) = listener else {
        return Err(RendezvousError::Protocol("a welcome before a hello".into()));
    };
    if w.nonces.get(rank as usize) != Some(&h.nonce) {
        return Err(RendezvousError::DuplicateRank { rank });
    }
    Ok((w, l, server))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::rendezvous::message::tests::hello;
    use crate::process::wire::MAX_FRAME;

    /// The version of the tests' hellos.
    const VERSION: &str = "0.1.0";

    /// Before, the deadline was looked at only when no arrival came: hellos queued faster
    /// than rank 0 answered them (a flood of refused hellos on the open port) kept the
    /// formation past its bound for as long as they lasted. Here six are queued whose answers
    /// each take rank 0 its whole reply bound (2 s: a refusal larger than the socket's buffers,
    /// to a reader that never reads): the formation ends after one of them (before, after all
    /// six, 12 s).
    #[test]
    fn queued_hellos_do_not_keep_the_formation_past_its_deadline() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let near = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_far, _) = listener.accept().unwrap();
        socket2::SockRef::from(&near)
            .set_send_buffer_size(4096)
            .unwrap();
        let (tx, rx) = mpsc::channel::<Arrival>();
        for _ in 0..6 {
            let big = RendezvousError::Protocol("x".repeat(256 << 10));
            tx.send(Arrival {
                stream: near.try_clone().unwrap(),
                hello: Err(big),
            })
            .unwrap();
        }
        let t0 = Instant::now();
        let deadline = kv_loader::deadline_after(Duration::from_millis(200));
        let (decision, _) = gather(&hello(0), None, &rx, deadline);
        let took = t0.elapsed();
        assert!(
            matches!(decision, Err(RendezvousError::Timeout { .. })),
            "{:?}",
            decision.map(|w| w.epoch)
        );
        assert!(took < Duration::from_secs(5), "{took:?}");
    }

    /// Before, an answered hello's connection stayed open on rank 0 (a second descriptor kept
    /// by the accepting thread) until the next connection came: the joiner saw no end of it.
    #[test]
    fn an_answered_hellos_connection_is_closed_without_waiting_for_another() {
        let leader = TcpLeader::bind("127.0.0.1:0", VERSION.into()).unwrap();
        let mut s = send(leader.local_addr(), &hello(1));
        assert!(matches!(answer(&mut s), Reply::Idle { .. }));
        s.set_read_timeout(Some(Duration::from_secs(4))).unwrap();
        let mut more = [0u8; 16];
        assert!(
            matches!(std::io::Read::read(&mut s, &mut more), Ok(0)),
            "rank 0 closed the connection after answering"
        );
    }

    /// Sends rank `rank`'s hello to rank 0 at `addr`; its reply.
    fn ask(addr: SocketAddr, rank: u32) -> Reply {
        let mut s = TcpStream::connect(addr).unwrap();
        let by = kv_loader::deadline_after(Duration::from_secs(5));
        write_frame(&mut s, &hello(rank).encode(), by).unwrap();
        Reply::decode(&read_frame(&mut s, by).unwrap()).unwrap()
    }

    /// Sends hello `h` to rank 0 at `addr`; the connection, for its reply.
    fn send(addr: SocketAddr, h: &Hello) -> TcpStream {
        let mut s = TcpStream::connect(addr).unwrap();
        write_frame(
            &mut s,
            &h.encode(),
            kv_loader::deadline_after(Duration::from_secs(5)),
        )
        .unwrap();
        s
    }

    /// Rank 0's reply on `s`.
    fn answer(s: &mut TcpStream) -> Reply {
        let by = kv_loader::deadline_after(Duration::from_secs(10));
        Reply::decode(&read_frame(s, by).unwrap()).unwrap()
    }

    /// Each of `streams` got the group.
    fn all_welcomed<const N: usize>(streams: [&mut TcpStream; N]) {
        for s in streams {
            let got = answer(s);
            assert!(matches!(got, Reply::Welcome(_)), "{got:?}");
        }
    }

    /// Rank `rank`'s hello from a build of another rendezvous protocol.
    fn foreign(rank: u32) -> Hello {
        Hello {
            protocol: super::super::message::PROTOCOL + 1,
            version: "9.9.9".into(),
            ..hello(rank)
        }
    }

    /// Rank 0 of the tests' group (of 3) forming while `joiners` runs; its decision.
    fn form_while(joiners: impl FnOnce(SocketAddr) + Send) -> Result<Welcome, RendezvousError> {
        let leader = TcpLeader::bind("127.0.0.1:0", VERSION.into()).unwrap();
        let addr = leader.local_addr();
        std::thread::scope(|s| {
            let forming =
                s.spawn(|| leader.form(&hello(0), None, Instant::now() + Duration::from_secs(10)));
            while leader.state.lock().forming.is_none() {
                std::thread::sleep(Duration::from_millis(5));
            }
            joiners(addr);
            forming.join().unwrap()
        })
    }

    /// A welcome larger than a message may be (rank 0's attributes) forms no group: every
    /// rank is refused with `Config` (the same each time), and a later hello hears no live
    /// group. Before, rank 0 reported the group formed and answered later hellos with its
    /// epoch (`Occupied` for a rank that never got in), while the joiners heard nothing.
    #[test]
    fn a_welcome_past_the_message_limit_is_refused_to_every_rank() {
        let leader = TcpLeader::bind("127.0.0.1:0", VERSION.into()).unwrap();
        let addr = leader.local_addr();
        let huge = Hello {
            attributes: vec![("big".into(), "x".repeat(MAX_FRAME))],
            ..hello(0)
        };
        let (decision, replies) = std::thread::scope(|s| {
            let forming =
                s.spawn(|| leader.form(&huge, None, Instant::now() + Duration::from_secs(10)));
            while leader.state.lock().forming.is_none() {
                std::thread::sleep(Duration::from_millis(5));
            }
            let mut one = send(addr, &hello(1));
            let mut two = send(addr, &hello(2));
            let decision = forming.join().unwrap();
            (decision, [answer(&mut one), answer(&mut two)])
        });
        // The epoch only: a welcome would hold a megabyte of attributes.
        match decision.map(|w| w.epoch) {
            Err(RendezvousError::Config(why)) => assert!(why.contains("too large"), "{why}"),
            other => panic!("{other:?}"),
        }
        for r in replies {
            assert!(
                matches!(r, Reply::Refused(RendezvousError::Config(_))),
                "{:?}",
                matches!(r, Reply::Welcome(_))
            );
        }
        assert!(
            matches!(
                ask(addr, 1),
                Reply::Idle {
                    live_epoch: None,
                    ..
                }
            ),
            "no live group"
        );
    }

    /// A welcome that did not reach a joined rank (it hung up just then) forms no group: the
    /// formation fails naming the ranks not reached.
    #[test]
    fn a_welcome_not_delivered_fails_the_formation_naming_the_ranks() {
        let w = decide(
            &hello(0),
            &[hello(1), hello(2)],
            None,
            Rank0Address::Rewritten,
        )
        .unwrap();
        let gone = || std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        match delivered(Ok(w.clone()), vec![(2, gone()), (1, gone())]) {
            Err(RendezvousError::Timeout { missing, detail }) => {
                assert_eq!(missing, vec![1, 2], "{detail}");
                assert!(detail.contains("could not be delivered"), "{detail}");
            }
            other => panic!("{:?}", other.map(|w| w.epoch)),
        }
        let epoch = w.epoch;
        assert_eq!(
            delivered(Ok(w), Vec::new()).map(|w| w.epoch).ok(),
            Some(epoch)
        );
    }

    /// Lets rank 0 take what was sent (each hello is read on a thread of its own; half a
    /// second leaves room on a loaded machine).
    fn settle() {
        std::thread::sleep(Duration::from_millis(500));
    }

    /// A rank whose host went away without a hang-up leaves a claim rank 0 cannot see as
    /// gone; its restart claims the rank again. Before, the two claims refused the group
    /// (`DuplicateRank` to every rank); now the newer claim joins, the earlier is refused.
    #[test]
    fn a_newer_claim_of_a_rank_replaces_the_earlier_one() {
        let decision = form_while(|addr| {
            let mut stale = send(addr, &hello(1));
            settle();
            let restarted = Hello {
                nonce: 1234,
                ..hello(1)
            };
            let mut fresh = send(addr, &restarted);
            settle();
            let mut two = send(addr, &hello(2));
            let refused = answer(&mut stale);
            assert!(
                matches!(
                    refused,
                    Reply::Refused(RendezvousError::DuplicateRank { rank: 1 })
                ),
                "{refused:?}"
            );
            all_welcomed([&mut fresh, &mut two]);
        });
        assert_eq!(decision.unwrap().nonces[1], 1234);
    }

    /// A process of another version that connected and went away no longer counts. Before,
    /// its hello stayed until the decision, which it made a `VersionMismatch` refusal for
    /// every rank as soon as the others had joined.
    #[test]
    fn a_rank_of_another_version_that_hung_up_does_not_fail_the_formation() {
        let decision = form_while(|addr| {
            let gone = send(addr, &foreign(2));
            settle();
            drop(gone);
            let mut one = send(addr, &hello(1));
            settle();
            let mut two = send(addr, &hello(2));
            all_welcomed([&mut one, &mut two]);
        });
        assert!(decision.is_ok(), "{decision:?}");
    }

    /// A hello that can be no member (a rank past the group, of this build or another) is
    /// refused alone. Before, either kind failed the formation of every rank.
    #[test]
    fn a_hello_for_a_rank_outside_the_group_is_refused_alone() {
        let decision = form_while(|addr| {
            let mut other = send(addr, &foreign(7));
            let got = answer(&mut other);
            assert!(
                matches!(
                    got,
                    Reply::Refused(RendezvousError::VersionMismatch { rank: 7, .. })
                ),
                "{got:?}"
            );
            let mut past = send(addr, &hello(3));
            let got = answer(&mut past);
            assert!(
                matches!(
                    got,
                    Reply::Refused(RendezvousError::SettingsMismatch { rank: 3, .. })
                ),
                "{got:?}"
            );
            let mut one = send(addr, &hello(1));
            let mut two = send(addr, &hello(2));
            all_welcomed([&mut one, &mut two]);
        });
        assert!(decision.is_ok(), "{decision:?}");
    }

    /// Rank `rank`'s hello from a process configured for a group of `world`.
    fn sized(rank: u32, world: u32) -> Hello {
        Hello {
            world,
            ..hello(rank)
        }
    }

    /// A hello of another group size for a rank a member claimed does not evict the member:
    /// both stay and the decision refuses every rank for the size. Before, the stray hello
    /// replaced the claim (the member was refused as a duplicate, at once).
    #[test]
    fn a_hello_of_another_size_does_not_evict_a_members_claim() {
        let decision = form_while(|addr| {
            let mut one = send(addr, &hello(1));
            settle();
            let mut stray = send(addr, &sized(1, 8));
            settle();
            let mut two = send(addr, &hello(2));
            for s in [&mut one, &mut stray, &mut two] {
                let got = answer(s);
                assert!(
                    matches!(
                        got,
                        Reply::Refused(RendezvousError::WorldSizeMismatch {
                            rank: 1,
                            expected: 3,
                            got: 8
                        })
                    ),
                    "{got:?}"
                );
            }
        });
        assert!(
            matches!(decision, Err(RendezvousError::WorldSizeMismatch { .. })),
            "{decision:?}"
        );
    }

    /// Hellos of other sizes kept for the decision are bounded: past `MAX_OTHER_SIZES`, one is
    /// refused at once. Before, each was kept (with its descriptor) until the decision.
    #[test]
    fn hellos_of_other_sizes_past_the_bound_are_refused_at_once() {
        let decision = form_while(|addr| {
            let kept: Vec<TcpStream> = (0..MAX_OTHER_SIZES as u32)
                .map(|i| send(addr, &sized(10 + i, 20)))
                .collect();
            settle();
            let mut past = send(addr, &sized(30, 40));
            let by = kv_loader::deadline_after(Duration::from_secs(3));
            let got = Reply::decode(&read_frame(&mut past, by).unwrap()).unwrap();
            assert!(
                matches!(
                    got,
                    Reply::Refused(RendezvousError::WorldSizeMismatch {
                        rank: 30,
                        expected: 3,
                        got: 40
                    })
                ),
                "{got:?}"
            );
            let members = [send(addr, &hello(1)), send(addr, &hello(2))];
            for mut s in kept.into_iter().chain(members) {
                let got = answer(&mut s);
                assert!(
                    matches!(
                        got,
                        Reply::Refused(RendezvousError::WorldSizeMismatch { rank: 10, .. })
                    ),
                    "{got:?}"
                );
            }
        });
        assert!(decision.is_err(), "{decision:?}");
    }

    /// A failed poll in the accepting thread (out of memory) is tried again. Before, the thread
    /// stopped accepting for good: every later rank's hello went unread and the formation
    /// timed out missing it. Here three polls fail after the first rank's arrival.
    #[test]
    fn a_failed_poll_does_not_stop_rank_0_accepting() {
        let leader = TcpLeader::bind("127.0.0.1:0", VERSION.into()).unwrap();
        let addr = leader.local_addr();
        let decision = std::thread::scope(|s| {
            let forming =
                s.spawn(|| leader.form(&hello(0), None, Instant::now() + Duration::from_secs(5)));
            while leader.state.lock().forming.is_none() {
                std::thread::sleep(Duration::from_millis(5));
            }
            leader.state.lock().failing_polls = 3;
            let mut one = send(addr, &hello(1));
            settle();
            let mut two = send(addr, &hello(2));
            all_welcomed([&mut one, &mut two]);
            forming.join().unwrap()
        });
        assert!(decision.is_ok(), "{decision:?}");
        assert_eq!(leader.state.lock().failing_polls, 0, "the polls failed");
        let t = Instant::now();
        drop(leader);
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }

    /// Before, a connection that sent no hello kept its thread and socket for the whole read
    /// timeout after the leader was dropped.
    #[test]
    fn dropping_the_leader_ends_the_hello_reads_at_once() {
        use std::io::Read;
        let leader = TcpLeader::bind("127.0.0.1:0", VERSION.into()).unwrap();
        let mut silent = TcpStream::connect(leader.local_addr()).unwrap();
        // Let the accept loop take it and start its read.
        std::thread::sleep(Duration::from_millis(500));
        let started = Instant::now();
        drop(leader);
        silent.set_read_timeout(Some(MESSAGE_TIMEOUT * 2)).unwrap();
        let mut byte = [0u8; 1];
        let got = silent.read(&mut byte);
        // An end of stream: the read thread took the connection and its shutdown closed it.
        // (A connection never accepted is reset when the listener goes: an error, which
        // would not show the reads ending.)
        assert!(matches!(got, Ok(0)), "{got:?}");
        let took = started.elapsed();
        assert!(took < MESSAGE_TIMEOUT / 2, "{took:?}");
    }

    /// A listener that completes no more connections: its accept queue (backlog 0) is full,
    /// so later connects hang until their own timeout, as to a host that drops packets.
    fn blackhole() -> (socket2::Socket, SocketAddr, Vec<TcpStream>) {
        use socket2::{Domain, Socket, Type};
        let l = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        l.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        l.listen(0).unwrap();
        let addr = l.local_addr().unwrap().as_socket().unwrap();
        let fill = (0..4)
            .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_millis(100)).ok())
            .collect();
        (l, addr, fill)
    }

    /// Before, every address got the time left when the attempt began: three that drop the
    /// connect took three times that, past the joiner's deadline.
    #[test]
    fn connecting_to_several_addresses_ends_by_the_deadline() {
        let (_l, addr, _fill) = blackhole();
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            // This kernel completes connects past the backlog: nothing hangs to bound.
            return;
        }
        let mut heard = Heard::Nothing(String::new());
        let started = Instant::now();
        // 1 s each: three addresses that each took the whole time left would take 3 s.
        let deadline = started + Duration::from_secs(1);
        assert!(connect_to_rank_0(&[addr, addr, addr], deadline, &mut heard).is_none());
        let took = started.elapsed();
        assert!(took < Duration::from_millis(2500), "{took:?}");
        assert!(matches!(&heard, Heard::Nothing(w) if w.contains("connecting to rank 0")));
    }

    #[test]
    fn a_hello_to_a_formation_that_is_gone_is_answered_and_rank_0_keeps_accepting() {
        let leader = TcpLeader::bind("127.0.0.1:0", VERSION.into()).unwrap();
        // A formation slot whose formation is gone without closing it (it unwound).
        let (tx, rx) = mpsc::channel();
        drop(rx);
        leader.state.lock().forming = Some(tx);
        // Before, the accept loop returned here and rank 0 never answered again.
        for rank in [1, 1] {
            let reply = ask(leader.local_addr(), rank);
            assert!(
                matches!(&reply, Reply::Idle { last_failure: Some(f), .. } if f == ENDED_ABNORMALLY),
                "not idle after an abnormal end"
            );
        }
        assert!(leader.state.lock().forming.is_none());
    }

    #[test]
    fn a_formation_that_unwinds_closes_its_slot() {
        let leader = TcpLeader::bind("127.0.0.1:0", VERSION.into()).unwrap();
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let (tx, _rx) = mpsc::channel();
            leader.state.lock().forming = Some(tx);
            let _slot = OpenSlot(Some(&leader.state));
            panic!("the formation fails inside");
        }));
        assert!(unwound.is_err());
        let st = leader.state.lock();
        assert!(st.forming.is_none());
        assert_eq!(st.last_failure.as_deref(), Some(ENDED_ABNORMALLY));
    }

    /// A joiner whose address toward rank 0 changed (its listener was for another IP) makes a
    /// new listener under the same name (pid and nonce): the old one goes first. Before, the
    /// new bind met the old one's Unix name (EADDRINUSE) and the join ended with `Io`.
    #[test]
    fn a_joiner_whose_address_to_rank_0_changed_binds_its_listener_again() {
        let leader = TcpLeader::bind("127.0.0.1:0", VERSION.into()).unwrap();
        let nonce = 0x5eed_0001 ^ u64::from(std::process::id());
        let old_ip: IpAddr = "127.0.0.2".parse().unwrap();
        let mut listener = Some((
            old_ip,
            hello(1),
            MeshListener::bind("127.0.0.1".parse().unwrap(), true, nonce).unwrap(),
        ));
        let mut lookups = AddressLookups::new(&leader.local_addr().to_string(), "rank 0");
        let mut heard = Heard::Nothing(String::new());
        let mut bind = |ip: IpAddr| {
            let l = MeshListener::bind(ip, true, nonce)
                .map_err(|e| RendezvousError::io("binding the mesh listener", e))?;
            Ok((hello(1), l))
        };
        let deadline = kv_loader::deadline_after(Duration::from_secs(5));
        let r = attempt(
            &mut lookups,
            Duration::from_secs(5),
            deadline,
            &mut bind,
            &mut listener,
            &mut heard,
        );
        assert!(r.is_ok(), "{:?}", r.err());
        let ip = listener.as_ref().map(|(ip, _, _)| *ip);
        assert_eq!(
            ip,
            Some("127.0.0.1".parse().unwrap()),
            "a listener for the new address"
        );
    }

    /// A restarted rank asks a rank 0 whose group is live: its attempts slow down (each is a
    /// connection and a thread on rank 0). Before, one every 50 ms until its deadline.
    #[test]
    fn a_joiner_answered_that_the_group_is_live_backs_off() {
        let leader = TcpLeader::bind("127.0.0.1:0", VERSION.into()).unwrap();
        leader.state.lock().live_epoch = Some(3);
        let nonce = 0x5eed_0002 ^ u64::from(std::process::id());
        let deadline = kv_loader::deadline_after(Duration::from_secs(3));
        let r = join(
            &leader.local_addr().to_string(),
            1,
            |ip| {
                let l = MeshListener::bind(ip, false, nonce)
                    .map_err(|e| RendezvousError::io("binding the mesh listener", e))?;
                Ok((hello(1), l))
            },
            deadline,
        );
        assert!(
            matches!(r, Err(RendezvousError::Occupied { rank: 1, epoch: 3 })),
            "{:?}",
            r.map(drop)
        );
        let asked = leader.state.lock().idle_answers;
        assert!((2..=12).contains(&asked), "{asked} attempts in 3 s");
    }

    #[test]
    fn a_joiner_keeps_trying_a_name_that_does_not_resolve_until_its_deadline() {
        // Before, the first failed lookup ended the join at once as a configuration error.
        let mut hellos = 0;
        let t0 = Instant::now();
        let r = join(
            "rank0.kvlink.invalid:29500",
            1,
            |_| {
                hellos += 1;
                Err(RendezvousError::Config("never reached".into()))
            },
            kv_loader::deadline_after(Duration::from_millis(800)),
        );
        let took = t0.elapsed();
        match r {
            Err(RendezvousError::Timeout { missing, detail }) => {
                assert_eq!(missing, [0]);
                assert!(detail.contains("rank0.kvlink.invalid"), "{detail}");
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("joined a group at an address that does not resolve"),
        }
        assert_eq!(hellos, 0);
        assert!(took >= Duration::from_millis(700), "gave up after {took:?}");
        assert!(took < Duration::from_secs(4), "ended after {took:?}");
    }

    #[test]
    fn rank_0_whose_own_name_does_not_resolve_may_try_again() {
        // Before, a lookup that failed was a `Config` error, a refusal: an engine that gives up
        // on refusals gave up on a resolver that was only down for a moment.
        let e = TcpLeader::bind("rank0.kvlink.invalid:29500", VERSION.into())
            .err()
            .expect("bound an address that does not resolve");
        assert!(matches!(e, RendezvousError::Unresolved(_)), "{e:?}");
        assert!(!e.is_refusal(), "{e}");
        assert!(e.to_string().contains("rank0.kvlink.invalid"), "{e}");
        let e = TcpLeader::bind("rank0", VERSION.into())
            .err()
            .expect("bound an address without a port");
        assert!(matches!(e, RendezvousError::Config(_)), "{e:?}");
        assert!(e.is_refusal(), "{e}");
    }

    #[test]
    fn a_joiner_given_an_address_without_a_port_fails_at_once() {
        let t0 = Instant::now();
        let r = join(
            "rank0",
            1,
            |_| Err(RendezvousError::Config("never reached".into())),
            kv_loader::deadline_after(Duration::from_secs(30)),
        );
        assert!(
            matches!(r, Err(RendezvousError::Config(_))),
            "{:?}",
            r.err()
        );
        assert!(t0.elapsed() < Duration::from_secs(1));
    }
}
