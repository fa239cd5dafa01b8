//! The group's connections: every rank listens (TCP, and an abstract Unix socket when
//! allowed), tells the others where in its hello, and once the group is formed every pair of
//! ranks connects once per handle: the higher rank connects, the lower accepts. A handshake
//! names the epoch, the handle and both ranks, so a connection left over from an earlier
//! epoch, or meant for another handle, is never taken for this one.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use super::link::Link;
use super::rendezvous::message::{Endpoint, Transport};
use super::rendezvous::RendezvousError;
use super::wire::{read_exact_by, remaining};

const MAGIC: u32 = u32::from_le_bytes(*b"KVMH");
const ACK: [u8; 4] = *b"KVOK";
/// The ack and the acceptor's nonce.
const ACK_LEN: usize = 12;
const HANDSHAKE: usize = 32;

/// A rank's listening sockets for one formation.
pub(crate) struct MeshListener {
    tcp: TcpListener,
    unix: Option<UnixListener>,
    pub(crate) endpoint: Endpoint,
}

/// How a rank whose host key could not be read names its host (then its nonce): whether it
/// shares a host with another rank cannot be told (no Unix sockets with it, and no endpoint
/// is refused as unreachable from other hosts).
pub(crate) const UNKNOWN_HOST: &str = "unknown-";

/// The host and network namespace this process runs in: ranks with the same key can reach
/// each other's abstract Unix sockets.
pub(crate) fn host_key() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let net = std::fs::read_link("/proc/self/ns/net").ok()?;
    Some(format!("{}/{}", boot.trim(), net.display()))
}

impl MeshListener {
    /// Listens on TCP at `ip` (any port) and, with `unix`, on a fresh abstract Unix socket
    /// named from `nonce` (a name every process of the host can list: never a secret).
    pub(crate) fn bind(ip: IpAddr, unix: bool, nonce: u64) -> std::io::Result<Self> {
        // Non-blocking: an accept after `poll` said ready may still find nothing (the peer
        // gave up in between), and must not then block past the deadline.
        let tcp = TcpListener::bind(SocketAddr::new(ip, 0))?;
        tcp.set_nonblocking(true)?;
        let host = host_key();
        let (unix, name) = match (&host, unix) {
            (Some(_), true) => {
                let name = format!("kvlink-{}-{nonce:016x}", std::process::id());
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
                let l = UnixListener::bind_addr(&addr)?;
                l.set_nonblocking(true)?;
                (Some(l), Some(name))
            }
            _ => (None, None),
        };
        let endpoint = Endpoint {
            tcp: Some(tcp.local_addr()?),
            unix: name,
            host: host.unwrap_or_else(|| format!("{UNKNOWN_HOST}{nonce:x}")),
        };
        Ok(MeshListener {
            tcp,
            unix,
            endpoint,
        })
    }

    /// Accepts one connection before `deadline` (`None` at the deadline).
    #[cfg(test)]
    fn accept(&self, transport: Transport, deadline: Instant) -> std::io::Result<Option<Link>> {
        Ok(match self.accept_watching(transport, &[], deadline)? {
            Accepted::Link(link) => Some(link),
            Accepted::HungUp(_) | Accepted::Deadline => None,
        })
    }

    /// Accepts one connection before `deadline`, or says which of the `watched` links (a
    /// rank and the link's descriptor) hung up first: a peer whose formation ended after it
    /// connected (it failed to reach another rank) will not be part of the mesh.
    fn accept_watching(
        &self,
        transport: Transport,
        watched: &[(u32, RawFd)],
        deadline: Instant,
    ) -> std::io::Result<Accepted> {
        let fd = match (transport, &self.unix) {
            (Transport::Unix, Some(u)) => u.as_raw_fd(),
            _ => self.tcp.as_raw_fd(),
        };
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(Accepted::Deadline);
            }
            let mut pfds: Vec<libc::pollfd> = std::iter::once((fd, libc::POLLIN))
                .chain(watched.iter().map(|&(_, w)| (w, libc::POLLRDHUP)))
                .map(|(fd, events)| libc::pollfd {
                    fd,
                    events,
                    revents: 0,
                })
                .collect();
            let ms = left.as_millis().saturating_add(1).min(i32::MAX as u128) as libc::c_int;
            // SAFETY: `pfds` is a live array of `pfds.len()` pollfds for the call.
            let r = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if r == 0 {
                continue;
            }
            let gone = libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR;
            if let Some(&(rank, _)) = watched
                .iter()
                .zip(&pfds[1..])
                .find(|(_, p)| p.revents & gone != 0)
                .map(|(w, _)| w)
            {
                return Ok(Accepted::HungUp(rank));
            }
            if pfds[0].revents == 0 {
                continue;
            }
            let accepted = match (transport, &self.unix) {
                (Transport::Unix, Some(u)) => u.accept().and_then(|(s, _)| {
                    s.set_nonblocking(false)?;
                    Ok(Link::Unix(s))
                }),
                _ => self.tcp.accept().and_then(|(s, _)| {
                    s.set_nonblocking(false)?;
                    Ok(Link::Tcp(s))
                }),
            };
            match accepted {
                Ok(link) => return Ok(Accepted::Link(link)),
                Err(e) => match accept_retry(&e) {
                    Some(pause) => {
                        tracing::debug!(error = %e, "accepting a peer failed; polling again");
                        std::thread::sleep(
                            pause.min(deadline.saturating_duration_since(Instant::now())),
                        );
                    }
                    None => return Err(e),
                },
            }
        }
    }
}

/// How long to wait before polling the listener again after an accept failed with `e`, or
/// `None` when the listener itself is broken. Nothing to take (the peer gave up after `poll`),
/// a connection aborted before it was taken, and the network errors Linux passes on from the
/// new connection are polled again at once, as accept(2) says to; out of descriptors or
/// memory, after a pause (the peer's connection waits in the backlog meanwhile).
fn accept_retry(e: &std::io::Error) -> Option<Duration> {
    use std::io::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::WouldBlock | ErrorKind::Interrupted | ErrorKind::ConnectionAborted
    ) {
        return Some(Duration::ZERO);
    }
    match e.raw_os_error()? {
        libc::EPROTO
        | libc::ENETDOWN
        | libc::ENOPROTOOPT
        | libc::EHOSTDOWN
        | libc::ENONET
        | libc::EHOSTUNREACH
        | libc::EOPNOTSUPP
        | libc::ENETUNREACH => Some(Duration::ZERO),
        libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM => {
            Some(Duration::from_millis(20))
        }
        _ => None,
    }
}

/// What a wait at a mesh listener ended with.
enum Accepted {
    /// A connection (not yet greeted).
    Link(Link),
    /// This watched rank's link hung up.
    HungUp(u32),
    /// The deadline passed.
    Deadline,
}

/// A connecting rank's greeting: the group's epoch, the handle, its rank and the peer's, and
/// its own nonce of the welcome (which only the group's members were told: a process that
/// can connect but is no member cannot take a member's place).
fn handshake(epoch: u64, handle: u32, from: u32, to: u32, nonce: u64) -> [u8; HANDSHAKE] {
    let mut b = [0u8; HANDSHAKE];
    b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    b[4..12].copy_from_slice(&epoch.to_le_bytes());
    b[12..16].copy_from_slice(&handle.to_le_bytes());
    b[16..20].copy_from_slice(&from.to_le_bytes());
    b[20..24].copy_from_slice(&to.to_le_bytes());
    b[24..32].copy_from_slice(&nonce.to_le_bytes());
    b
}

/// A greeting's fields.
struct Greeting {
    magic: u32,
    epoch: u64,
    handle: u32,
    from: u32,
    to: u32,
    nonce: u64,
}

fn parse_handshake(b: &[u8; HANDSHAKE]) -> Greeting {
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let u64_at = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[i..i + 8]);
        u64::from_le_bytes(w)
    };
    Greeting {
        magic: u32_at(0),
        epoch: u64_at(4),
        handle: u32_at(12),
        from: u32_at(16),
        to: u32_at(20),
        nonce: u64_at(24),
    }
}

/// An acceptor's answer: the ack and its own nonce of the welcome (the connecting rank
/// checks it reached the member it meant).
fn ack(nonce: u64) -> [u8; ACK_LEN] {
    let mut b = [0u8; ACK_LEN];
    b[..4].copy_from_slice(&ACK);
    b[4..].copy_from_slice(&nonce.to_le_bytes());
    b
}

/// A blocking stream with timeouts, for the handshake.
enum Blocking<'a> {
    Tcp(&'a TcpStream),
    Unix(&'a UnixStream),
}

impl Read for Blocking<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Blocking::Tcp(s) => (*s).read(buf),
            Blocking::Unix(s) => (*s).read(buf),
        }
    }
}

impl Write for Blocking<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Blocking::Tcp(s) => (*s).write(buf),
            Blocking::Unix(s) => (*s).write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl super::wire::TimedStream for Blocking<'_> {
    fn set_timeouts(&self, left: Duration) -> std::io::Result<()> {
        match self {
            Blocking::Tcp(s) => s.set_timeouts(left),
            Blocking::Unix(s) => s.set_timeouts(left),
        }
    }
}

fn blocking(link: &Link) -> Blocking<'_> {
    match link {
        Link::Tcp(s) => Blocking::Tcp(s),
        Link::Unix(s) => Blocking::Unix(s),
    }
}

fn write_all_by(link: &Link, bytes: &[u8], deadline: Instant) -> std::io::Result<()> {
    let s = blocking(link);
    super::wire::TimedStream::set_timeouts(&s, remaining(deadline)?)?;
    link.send_all(bytes)
}

/// Connects to `peer` at its endpoint, retrying refusals until `deadline`.
fn connect(
    transport: Transport,
    peer: &Endpoint,
    rendezvous_ip: Option<IpAddr>,
    deadline: Instant,
) -> std::io::Result<Link> {
    loop {
        let attempt = match transport {
            Transport::Unix => {
                let name = peer.unix.as_deref().unwrap_or_default();
                connect_abstract(name, deadline).map(Link::Unix)
            }
            Transport::Tcp => {
                let mut addr = peer.tcp.ok_or_else(|| {
                    std::io::Error::new(std::io::ErrorKind::InvalidInput, "no TCP address")
                })?;
                if addr.ip().is_unspecified() {
                    if let Some(ip) = rendezvous_ip {
                        addr.set_ip(ip);
                    }
                }
                TcpStream::connect_timeout(&addr, remaining(deadline)?.min(Duration::from_secs(2)))
                    .map(Link::Tcp)
            }
        };
        match attempt {
            Ok(l) => return Ok(l),
            // Every member binds its listener before it says hello, so after the welcome a
            // refused connection means the peer's formation has ended (it hung up, crashed):
            // waiting out the deadline (a minute on a first formation) would not bring it.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Err(e),
            Err(e) if kv_loader::deadline_after(Duration::from_millis(20)) < deadline => {
                tracing::debug!(error = %e, "connecting to a peer, retrying");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Connects to the abstract Unix socket `name` without blocking: std's connect waits for as
/// long as the listener's backlog stays full, with no bound. `WouldBlock` when the backlog is
/// full (the caller tries again until its deadline), `TimedOut` past `deadline`.
fn connect_abstract(name: &str, deadline: Instant) -> std::io::Result<UnixStream> {
    use socket2::{Domain, SockAddr, Socket, Type};
    remaining(deadline)?;
    let path = [&[0u8][..], name.as_bytes()].concat();
    let addr = SockAddr::unix(std::ffi::OsStr::from_bytes(&path))?;
    let socket = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    socket.set_nonblocking(true)?;
    socket.connect(&addr)?;
    socket.set_nonblocking(false)?;
    Ok(UnixStream::from(socket))
}

/// Longest an accepted connection has to greet (and take its ack): a member greets right after
/// its connect returns; each silent connection (a port scan, a stray local process) costs the
/// formation this much, as greetings are read one at a time.
const GREETING_WAIT: Duration = Duration::from_millis(500);

/// What a rank needs to connect its share of the mesh.
pub(crate) struct MeshPlan<'a> {
    pub(crate) rank: u32,
    pub(crate) epoch: u64,
    /// Each member's nonce of the welcome (index = rank), which members greet with.
    pub(crate) nonces: &'a [u64],
    pub(crate) transport: Transport,
    pub(crate) members: &'a [Endpoint],
    /// The IP rank 0 was reached at (for a rank 0 listening on an unspecified address).
    pub(crate) rendezvous_ip: Option<IpAddr>,
}

impl MeshPlan<'_> {
    /// Rank `rank`'s nonce (0 for a rank the welcome names none for: no member greets with
    /// it, as every nonce is drawn at random).
    fn nonce(&self, rank: u32) -> u64 {
        self.nonces.get(rank as usize).copied().unwrap_or(0)
    }
}

/// Connects `handles` full meshes: for each handle, one link per peer (index = peer rank,
/// `None` at this rank), ready for the engine (non-blocking).
pub(crate) fn connect_meshes(
    plan: &MeshPlan<'_>,
    listener: &MeshListener,
    handles: u32,
    deadline: Instant,
) -> Result<Vec<Vec<Option<Link>>>, RendezvousError> {
    let world = plan.members.len() as u32;
    let mut meshes: Vec<Vec<Option<Link>>> = (0..handles)
        .map(|_| (0..world).map(|_| None).collect())
        .collect();
    // Outbound first (never waits on a peer's progress: its listener queues us), then
    // inbound, then the acks of the outbound ones.
    let outbound = connect_to_lower_ranks(plan, handles, deadline)?;
    accept_higher_ranks(plan, listener, handles, &outbound, &mut meshes, deadline)?;
    take_acks(plan, outbound, &mut meshes, deadline)?;
    for link in meshes.iter().flatten().flatten() {
        link.prepare()
            .map_err(|e| RendezvousError::io("preparing a connection", e))?;
    }
    Ok(meshes)
}

/// Connects to every lower rank once per handle and sends each the handshake; the links,
/// each with its handle and peer, still waiting for their acks.
fn connect_to_lower_ranks(
    plan: &MeshPlan<'_>,
    handles: u32,
    deadline: Instant,
) -> Result<Vec<(u32, u32, Link)>, RendezvousError> {
    let me = plan.rank;
    let mut outbound = Vec::new();
    for h in 0..handles {
        for peer in 0..me {
            let link = connect(
                plan.transport,
                &plan.members[peer as usize],
                (peer == 0).then_some(plan.rendezvous_ip).flatten(),
                deadline,
            )
            .map_err(|e| RendezvousError::peer(peer, "connecting", e))?;
            let greeting = handshake(plan.epoch, h, me, peer, plan.nonce(me));
            write_all_by(&link, &greeting, deadline)
                .map_err(|e| RendezvousError::peer(peer, "greeting", e))?;
            outbound.push((h, peer, link));
        }
    }
    Ok(outbound)
}

/// Accepts every higher rank's connection for every handle into `meshes`, dropping those
/// meant for another group; a timeout naming the ranks still missing at `deadline`. A hang-up
/// on a link already accepted or on one of this rank's `outbound` links (to the lower ranks,
/// still waiting for their acks) fails it at once, naming that peer.
fn accept_higher_ranks(
    plan: &MeshPlan<'_>,
    listener: &MeshListener,
    handles: u32,
    outbound: &[(u32, u32, Link)],
    meshes: &mut [Vec<Option<Link>>],
    deadline: Instant,
) -> Result<(), RendezvousError> {
    let world = plan.members.len() as u32;
    let me = plan.rank;
    let mut expected = (world - 1 - me) * handles;
    while expected > 0 {
        // The links already accepted and this rank's own to the lower ranks: one that hangs
        // up is a peer that gave up on this formation (it failed to reach another rank, or
        // timed out waiting for one), which every rank learns at once this way rather than
        // at the deadline (a minute on a first formation).
        let watched: Vec<(u32, RawFd)> = meshes
            .iter()
            .flat_map(|m| m.iter().enumerate())
            .filter_map(|(peer, l)| l.as_ref().map(|l| (peer as u32, l.fd())))
            .chain(outbound.iter().map(|(_, peer, l)| (*peer, l.fd())))
            .collect();
        let link = match listener
            .accept_watching(plan.transport, &watched, deadline)
            .map_err(|e| RendezvousError::io("accepting a peer", e))?
        {
            Accepted::Link(link) => link,
            // A higher rank that hangs up gave up on this formation: named, as before.
            Accepted::HungUp(peer) if peer > me => {
                return Err(RendezvousError::peer(
                    peer,
                    "waiting for the other ranks' connections",
                    std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "it hung up before the mesh was formed",
                    ),
                ))
            }
            // A lower rank that hangs up gave up too, most often because a higher rank this
            // rank also waits for never came (it timed out on it first): the answer names the
            // higher ranks still missing, as this rank's own deadline would have, only now.
            Accepted::HungUp(lower) => {
                return Err(RendezvousError::Timeout {
                    missing: still_missing(me, world, meshes),
                    detail: format!(
                        "rank {me} waiting for its peers' connections stopped early: rank \
                         {lower}, which it had connected to, hung up (it gave up on this \
                         formation)"
                    ),
                })
            }
            Accepted::Deadline => {
                return Err(RendezvousError::Timeout {
                    missing: still_missing(me, world, meshes),
                    detail: format!("rank {me} waiting for its peers' connections"),
                });
            }
        };
        let (h, from) = match admit_peer(plan, &link, handles, meshes, deadline) {
            None => continue,
            Some(Ok(place)) => place,
            Some(Err((from, e))) => {
                return Err(RendezvousError::peer(from, "acking its handshake", e));
            }
        };
        meshes[h as usize][from as usize] = Some(link);
        expected -= 1;
    }
    Ok(())
}

/// The higher ranks some of whose connections this rank has not accepted yet.
fn still_missing(me: u32, world: u32, meshes: &[Vec<Option<Link>>]) -> Vec<u32> {
    (me + 1..world)
        .filter(|&p| meshes.iter().any(|m| m[p as usize].is_none()))
        .collect()
}

/// Reads an accepted connection's handshake and acks it when it is meant for this rank's
/// meshes and its place there is still empty; its handle and rank, or `None` for a
/// connection to drop (silent, or meant for another group), or the member and the ack's
/// failure when the member greeted and was gone before its ack (it gave up on the formation).
fn admit_peer(
    plan: &MeshPlan<'_>,
    link: &Link,
    handles: u32,
    meshes: &[Vec<Option<Link>>],
    deadline: Instant,
) -> Option<Result<(u32, u32), (u32, std::io::Error)>> {
    let world = plan.members.len() as u32;
    let me = plan.rank;
    let mut b = [0u8; HANDSHAKE];
    let short = kv_loader::deadline_after(GREETING_WAIT).min(deadline);
    if read_exact_by(&mut blocking(link), &mut b, short).is_err() {
        return None;
    }
    let g = parse_handshake(&b);
    let (h, from) = (g.handle, g.from);
    let fits = g.magic == MAGIC
        && g.epoch == plan.epoch
        && g.to == me
        && h < handles
        && from > me
        && from < world
        && meshes[h as usize][from as usize].is_none();
    if !fits {
        tracing::debug!(
            epoch = g.epoch,
            h,
            from,
            to = g.to,
            "dropping a connection meant for another group"
        );
        return None;
    }
    if g.nonce != plan.nonce(from) {
        tracing::warn!(
            epoch = g.epoch,
            h,
            from,
            "dropping a connection that claims a member's place without its nonce (no member)"
        );
        return None;
    }
    if let Err(e) = write_all_by(link, &ack(plan.nonce(me)), short) {
        // The member greeted (with its nonce) and is gone: it gave up on this formation.
        return Some(Err((from, e)));
    }
    Some(Ok((h, from)))
}

/// Waits for each lower rank's ack of this rank's handshake, and puts each acked link in
/// its place in `meshes`.
fn take_acks(
    plan: &MeshPlan<'_>,
    outbound: Vec<(u32, u32, Link)>,
    meshes: &mut [Vec<Option<Link>>],
    deadline: Instant,
) -> Result<(), RendezvousError> {
    for (h, peer, link) in outbound {
        let mut got = [0u8; ACK_LEN];
        read_exact_by(&mut blocking(&link), &mut got, deadline)
            .map_err(|e| RendezvousError::peer(peer, "waiting for the handshake's ack", e))?;
        if got != ack(plan.nonce(peer)) {
            return Err(RendezvousError::Protocol(format!(
                "rank {peer}'s address answered the handshake with {got:?}, not that member's \
                 ack"
            )));
        }
        meshes[h as usize][peer as usize] = Some(link);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Error, ErrorKind};

    /// Two ranks' mesh listeners on loopback (`unix`: abstract Unix sockets too), their
    /// endpoints and the welcome's nonces.
    struct TwoRanks {
        l0: MeshListener,
        l1: MeshListener,
        members: [Endpoint; 2],
        nonces: [u64; 2],
    }

    impl TwoRanks {
        /// Listeners bound with nonces `seed` and `seed + 1`.
        fn bind(unix: bool, seed: u64) -> Self {
            let ip = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
            let l0 = MeshListener::bind(ip, unix, seed).unwrap();
            let l1 = MeshListener::bind(ip, unix, seed + 1).unwrap();
            let members = [l0.endpoint.clone(), l1.endpoint.clone()];
            TwoRanks {
                l0,
                l1,
                members,
                nonces: [seed, seed + 1],
            }
        }

        fn plan(&self, rank: u32, transport: Transport) -> MeshPlan<'_> {
            plan(&self.members, &self.nonces, rank, transport)
        }

        /// Both ranks connect their mesh over TCP at once, by `deadline`; rank 0's, rank 1's.
        fn connect_both(&self, deadline: Instant) -> (MeshResult, MeshResult) {
            std::thread::scope(|s| {
                let zero = s
                    .spawn(|| connect_meshes(&self.plan(0, Transport::Tcp), &self.l0, 1, deadline));
                let one = s
                    .spawn(|| connect_meshes(&self.plan(1, Transport::Tcp), &self.l1, 1, deadline));
                (zero.join().unwrap(), one.join().unwrap())
            })
        }
    }

    type MeshResult = Result<Vec<Vec<Option<Link>>>, RendezvousError>;

    /// Rank `rank`'s share of a mesh of `members` over `transport`, epoch 1.
    fn plan<'a>(
        members: &'a [Endpoint],
        nonces: &'a [u64],
        rank: u32,
        transport: Transport,
    ) -> MeshPlan<'a> {
        MeshPlan {
            rank,
            epoch: 1,
            nonces,
            transport,
            members,
            rendezvous_ip: None,
        }
    }

    /// A process that can connect but is no member greets rank 0 first, as rank 1 with the
    /// group's (guessable) epoch: it is dropped, and the real rank 1 takes its place. Before,
    /// the greeting carried nothing a non-member lacks: the outsider was acked, rank 0 formed
    /// with it, and the real rank 1's connection found its place taken.
    #[test]
    fn a_greeting_without_the_members_nonce_is_dropped() {
        let two = TwoRanks::bind(false, 0x1111);
        let deadline = kv_loader::deadline_after(Duration::from_secs(5));
        // The outsider knows everything but rank 1's nonce.
        let mut outsider = TcpStream::connect(two.members[0].tcp.unwrap()).unwrap();
        outsider.write_all(&handshake(1, 0, 1, 0, 0xbad)).unwrap();
        let (zero, one) = two.connect_both(deadline);
        assert!(one.is_ok(), "{:?}", one.err());
        let zero = zero.unwrap();
        assert!(zero[0][1].is_some());
        // The outsider got no ack: its connection was closed unanswered.
        outsider
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        let mut got = [0u8; ACK_LEN];
        assert!(!matches!(outsider.read(&mut got), Ok(n) if n > 0));
    }

    /// Before, a refused connection was tried again every 20 ms until the deadline: a member
    /// whose formation ended after the welcome (its listener gone) held every higher rank
    /// for the whole connect bound (about a minute on a first formation).
    #[test]
    fn a_peer_whose_listener_is_gone_fails_the_connect_at_once() {
        for transport in [Transport::Tcp, Transport::Unix] {
            let TwoRanks {
                l0,
                l1,
                members,
                nonces,
            } = TwoRanks::bind(transport == Transport::Unix, 21);
            drop(l0);
            let t0 = std::time::Instant::now();
            let deadline = kv_loader::deadline_after(Duration::from_secs(10));
            let r = connect_meshes(&plan(&members, &nonces, 1, transport), &l1, 1, deadline);
            assert!(r.is_err(), "{transport:?}");
            assert!(
                t0.elapsed() < Duration::from_secs(2),
                "{transport:?}: {:?}",
                t0.elapsed()
            );
        }
    }

    /// Rank 2 of three greets rank 0, then finds rank 1 gone (its listener closed) and gives
    /// up: rank 0 learns it from the link's hang-up at once. Before, rank 0 waited for rank
    /// 2's other connections until its deadline (a minute on a first formation).
    #[test]
    fn a_peer_that_gives_up_after_connecting_fails_the_lower_ranks_at_once() {
        for transport in [Transport::Tcp, Transport::Unix] {
            let ip = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
            let unix = transport == Transport::Unix;
            let listeners: Vec<MeshListener> = (0..3)
                .map(|r| MeshListener::bind(ip, unix, 40 + r).unwrap())
                .collect();
            let members: Vec<Endpoint> = listeners.iter().map(|l| l.endpoint.clone()).collect();
            let nonces = [40, 41, 42];
            let mut listeners = listeners.into_iter();
            let (l0, l1, l2) = (
                listeners.next().unwrap(),
                listeners.next().unwrap(),
                listeners.next().unwrap(),
            );
            drop(l1);
            let deadline = kv_loader::deadline_after(Duration::from_secs(20));
            let t0 = Instant::now();
            let (zero, two) = std::thread::scope(|s| {
                let zero = s.spawn(|| {
                    connect_meshes(&plan(&members, &nonces, 0, transport), &l0, 1, deadline)
                });
                let two = s.spawn(|| {
                    connect_meshes(&plan(&members, &nonces, 2, transport), &l2, 1, deadline)
                });
                (zero.join().unwrap(), two.join().unwrap())
            });
            assert!(two.is_err(), "{transport:?}: rank 1 is gone");
            match zero {
                Err(RendezvousError::Peer { rank: 2, .. }) => {}
                other => panic!("{transport:?}: rank 0 got {:?}", other.map(drop)),
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "{transport:?}: {:?}",
                t0.elapsed()
            );
        }
    }

    /// Rank 1 of three greets rank 0 and waits for rank 2, which never comes; rank 0 gives up
    /// (its own, short deadline) and hangs up: rank 1 learns it from its own link to rank 0
    /// at once, and names rank 2 missing, as its deadline would have. Before, it watched only
    /// the links it had accepted and waited out its deadline.
    #[test]
    fn a_lower_rank_that_gives_up_fails_the_ranks_waiting_for_higher_ones_at_once() {
        for transport in [Transport::Tcp, Transport::Unix] {
            let ip = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
            let unix = transport == Transport::Unix;
            let mut listeners = (0..3).map(|r| MeshListener::bind(ip, unix, 50 + r).unwrap());
            let (l0, l1) = (listeners.next().unwrap(), listeners.next().unwrap());
            let members: Vec<Endpoint> = [&l0.endpoint, &l1.endpoint]
                .into_iter()
                .cloned()
                .chain(listeners.map(|l| l.endpoint.clone()))
                .collect();
            let (members, nonces) = (&members, &[50, 51, 52]);
            let short = kv_loader::deadline_after(Duration::from_millis(300));
            let long = kv_loader::deadline_after(Duration::from_secs(10));
            let t0 = Instant::now();
            let (zero, one) = std::thread::scope(|s| {
                // Rank 0's listener goes with its failure, as a formation's does: a connection
                // still queued on it is refused then, not left waiting.
                let zero = s.spawn(move || {
                    connect_meshes(&plan(members, nonces, 0, transport), &l0, 1, short)
                });
                let one =
                    s.spawn(|| connect_meshes(&plan(members, nonces, 1, transport), &l1, 1, long));
                (zero.join().unwrap(), one.join().unwrap())
            });
            assert!(zero.is_err(), "{transport:?}: rank 2 never came");
            match one {
                Err(RendezvousError::Timeout { missing, detail }) => {
                    assert_eq!(missing, [2], "{transport:?}: {detail}");
                    assert!(detail.contains("rank 0"), "{transport:?}: {detail}");
                }
                other => panic!("{transport:?}: rank 1 got {:?}", other.map(drop)),
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "{transport:?}: {:?}",
                t0.elapsed()
            );
        }
    }

    /// Before, each silent connection held rank 0's accept for 2 s: three ahead of the real
    /// peer pushed a 5 s re-formation past its deadline. Half a second each now.
    #[test]
    fn silent_connections_do_not_push_the_mesh_past_its_deadline() {
        let two = TwoRanks::bind(false, 31);
        let silent: Vec<TcpStream> = (0..3)
            .map(|_| TcpStream::connect(two.members[0].tcp.unwrap()).unwrap())
            .collect();
        let t0 = std::time::Instant::now();
        let (zero, one) = two.connect_both(kv_loader::deadline_after(Duration::from_secs(5)));
        assert!(zero.is_ok(), "{:?}", zero.err());
        assert!(one.is_ok(), "{:?}", one.err());
        assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
        drop(silent);
    }

    #[test]
    fn accept_failures_of_one_connection_are_polled_again_and_a_broken_listener_is_not() {
        let again = |e: Error| accept_retry(&e);
        assert_eq!(again(ErrorKind::WouldBlock.into()), Some(Duration::ZERO));
        assert_eq!(
            again(ErrorKind::ConnectionAborted.into()),
            Some(Duration::ZERO)
        );
        assert_eq!(
            again(Error::from_raw_os_error(libc::EPROTO)),
            Some(Duration::ZERO)
        );
        assert_eq!(
            again(Error::from_raw_os_error(libc::ENETDOWN)),
            Some(Duration::ZERO)
        );
        assert!(again(Error::from_raw_os_error(libc::EMFILE)).is_some_and(|d| !d.is_zero()));
        assert!(again(Error::from_raw_os_error(libc::ENFILE)).is_some_and(|d| !d.is_zero()));
        assert_eq!(again(Error::from_raw_os_error(libc::EBADF)), None);
        assert_eq!(again(Error::from_raw_os_error(libc::EINVAL)), None);
    }

    #[test]
    fn a_connect_to_a_peer_whose_backlog_stays_full_ends_by_its_deadline() {
        use socket2::{Domain, SockAddr, Socket, Type};
        // A listener that never accepts, with the smallest backlog, filled by connections
        // that stay open: std's blocking connect waited on it for good.
        let name = format!("kvlink-test-mesh-backlog-{}", std::process::id());
        let path = [&[0u8][..], name.as_bytes()].concat();
        let addr = SockAddr::unix(std::ffi::OsStr::from_bytes(&path)).unwrap();
        let listener = Socket::new(Domain::UNIX, Type::STREAM, None).unwrap();
        listener.bind(&addr).unwrap();
        listener.listen(0).unwrap();
        let mut queued = Vec::new();
        loop {
            let s = Socket::new(Domain::UNIX, Type::STREAM, None).unwrap();
            s.set_nonblocking(true).unwrap();
            match s.connect(&addr) {
                Ok(()) => queued.push(s),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => panic!("filling the backlog: {e}"),
            }
            assert!(queued.len() < 1000, "the backlog never filled");
        }
        let peer = Endpoint {
            tcp: None,
            unix: Some(name),
            host: "here".into(),
        };
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let deadline = kv_loader::deadline_after(Duration::from_millis(300));
            let r = connect(Transport::Unix, &peer, None, deadline).map(drop);
            let _ = tx.send((r, t0.elapsed()));
        });
        let (r, took) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the connect returns, not blocks on the full backlog");
        assert!(r.is_err(), "nothing accepted, so nothing connected");
        assert!(took < Duration::from_secs(3), "{took:?}");
    }

    #[test]
    fn a_non_blocking_listener_accepts_each_peer_and_its_wait_ends_at_the_deadline() {
        let l = MeshListener::bind("127.0.0.1".parse().unwrap(), false, 7).unwrap();
        let at = l.endpoint.tcp.unwrap();
        // A connection that is gone before it is accepted, and one that stays: both taken.
        drop(TcpStream::connect(at).unwrap());
        let _stays = TcpStream::connect(at).unwrap();
        let deadline = kv_loader::deadline_after(Duration::from_secs(5));
        for _ in 0..2 {
            let link = l.accept(Transport::Tcp, deadline).unwrap();
            assert!(link.is_some());
        }
        // Nothing more: the wait ends at its deadline.
        let t0 = Instant::now();
        let none = l
            .accept(
                Transport::Tcp,
                kv_loader::deadline_after(Duration::from_millis(200)),
            )
            .unwrap();
        assert!(none.is_none());
        assert!(t0.elapsed() < Duration::from_secs(2));
    }
}
