//! [`StoreServer`]: serves one [`EmbeddedStore`] to the rank processes of a host (or of a
//! group, over TCP): a thread accepts, one thread per connection answers requests.
//!
//! Reads go from the store's own memory straight into the socket (`writev` over the
//! objects' bytes, no copy); a put's bytes go from the socket straight into the buffer the
//! store then keeps. Pins (read sessions) are kept per client (each
//! [`SocketStore`](super::SocketStore): two in one process are two clients) and released when
//! its last connection closes, so a rank that dies never pins objects forever; a session
//! whose end never comes from a live client goes at the end of the store's lease
//! ([`EmbeddedStore::lease`]), which a session start answers with its token.

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice, Read};
use std::net::{SocketAddr, TcpListener};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::hello::{self, answer, Role, HELLO_LEN, NONCE_LEN, PROOF_LEN};
use super::protocol::{
    frame_len, location, op, outcome_code, read_body, read_exact_by, write_all_vectored, Conn, Dec,
    Enc, Malformed, StoreKey, MAGIC, PROTOCOL,
};
use crate::store::embedded::new_object;
use crate::store::{EmbeddedStore, KvStore, StoreError};

/// How long each step of a request may take: the rest of its length prefix once its first
/// byte came, then its body, then its handling with a put's bytes and the reply's write. A
/// client whose own request timeout is longer
/// ([`SocketStore::connect_with`](super::SocketStore::connect_with)) sees a request that ran
/// past one of these steps as its connection closed (`Unavailable`), not as `RpcTimeout`.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How often an idle connection thread looks at the stop flag.
const IDLE_CHECK: Duration = Duration::from_millis(500);
/// How long a put waits for room among the puts being received (their bytes held at most
/// the store's capacity) before it fails `Unavailable`.
const RECEIVE_WAIT: Duration = Duration::from_secs(5);
/// How long a connection may take to say its hello (a client sends it as soon as it is
/// connected): the socket's name is listed to every user of the host, and anyone may connect.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections accepted and not yet through their hello, at most: past it the oldest of them
/// is closed (logged), so that connections that say nothing cannot start a thread each
/// without bound in the process that serves the store (rank 0's linker, whose own store calls
/// need threads), nor keep a real client (which says its hello at once) out.
pub(super) const MAX_GREETING: usize = 64;
/// How long the oldest connection waiting to say its hello has before it may be closed to
/// make room: a burst of more than [`MAX_GREETING`] real clients, whose hellos come within
/// moments, is not cut, up to [`MAX_GREETING_HARD`] at once.
pub(super) const GREETING_GRACE: Duration = Duration::from_millis(500);
/// Connections waiting to say their hello, at most, grace or not: past it the oldest is
/// closed at once (the accept thread never waits, so silent connections cannot slow the
/// accepts of real clients).
pub(super) const MAX_GREETING_HARD: usize = 2 * MAX_GREETING;

/// Where a [`StoreServer`] listens.
#[derive(Debug, Clone)]
pub enum ServeAt {
    /// A fresh abstract Unix socket: every process of this host (and network namespace).
    Unix,
    /// A TCP address (port 0: any free port). On an unspecified IP (`0.0.0.0`, `::`: every
    /// interface) the address is announced as it is, and a rank that met rank 0 over TCP
    /// connects at the IP it reached rank 0 at
    /// ([`FormedTpGroup::store`](crate::FormedTpGroup::store)).
    Tcp(SocketAddr),
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    /// Waits at most `limit` for a connection to accept: true when one may be there (or the
    /// wait failed, which the accept then reports).
    fn wait_ready(&self, limit: Duration) -> bool {
        use std::os::fd::AsRawFd;
        let fd = match self {
            Listener::Tcp(l) => l.as_raw_fd(),
            Listener::Unix(l) => l.as_raw_fd(),
        };
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = limit.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: `pfd` is one live, initialised pollfd for the call, over a descriptor the
        // listener owns and keeps open across it.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        // Interrupted (a signal): not ready, so that the stop flag is looked at again rather
        // than an `accept` blocking with nothing to accept.
        r > 0 || (r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted)
    }

    fn accept(&self) -> io::Result<Conn> {
        Ok(match self {
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                s.set_nodelay(true)?;
                // A client host that dies without a FIN (power, network cut) is found within
                // about a minute: its connections end, and so do its read sessions' pins.
                socket2::SockRef::from(&s).set_tcp_keepalive(&keepalive())?;
                Conn::Tcp(s)
            }
            Listener::Unix(l) => Conn::Unix(l.accept()?.0),
        })
    }
}

/// Keep-alive probes of a served TCP connection: the first after 30 s idle, then every 10 s,
/// three unanswered ones end it.
fn keepalive() -> socket2::TcpKeepalive {
    socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(30))
        .with_interval(Duration::from_secs(10))
        .with_retries(3)
}

/// One client process: its open connections, its open read sessions, and the session starts
/// it gave up on before they ran.
#[derive(Default)]
struct ClientSessions {
    conns: usize,
    /// Open sessions: the store's token (unique across clients) → the tag the client started
    /// it with (unique within the client).
    sessions: HashMap<u64, u64>,
    /// Tags the client gave up on ([`op::END_SESSION_TAG`]) before a session of theirs
    /// started: a start that comes later with one of them is ended at once. Oldest first, at
    /// most [`GIVEN_UP_KEPT`].
    given_up: VecDeque<u64>,
}

/// Tags of given-up starts kept per client: a start request the server never received leaves
/// its tag here for good, so the oldest go.
const GIVEN_UP_KEPT: usize = 1024;

impl ClientSessions {
    /// Records session `token`, started with `tag`; false (not recorded) when the client gave
    /// that tag up already.
    fn started(&mut self, token: u64, tag: u64) -> bool {
        if let Some(at) = self.given_up.iter().position(|&t| t == tag) {
            self.given_up.remove(at);
            return false;
        }
        self.sessions.insert(token, tag);
        true
    }

    /// The client gave up on its start tagged `tag`: the session's token if it started, else
    /// the tag is kept so that its start, when it comes, is ended at once.
    fn give_up(&mut self, tag: u64) -> Option<u64> {
        let token = self
            .sessions
            .iter()
            .find(|(_, &t)| t == tag)
            .map(|(&k, _)| k);
        match token {
            Some(token) => {
                self.sessions.remove(&token);
                Some(token)
            }
            None => {
                if self.given_up.len() == GIVEN_UP_KEPT {
                    self.given_up.pop_front();
                }
                self.given_up.push_back(tag);
                None
            }
        }
    }
}

struct Served {
    store: Arc<EmbeddedStore>,
    /// What a client must say at hello (announced in the address).
    key: StoreKey,
    stop: AtomicBool,
    clients: Mutex<HashMap<u64, ClientSessions>>,
    /// Clones of open connections by number, to shut them when the server stops; each is
    /// taken out (and closed) when its connection ends.
    open: Mutex<HashMap<u64, Conn>>,
    /// Bytes of the puts being received now, on every connection: at most the store's
    /// capacity, so that many connections each putting an object up to the capacity at once
    /// cannot ask the host for many times it.
    receiving: Mutex<u64>,
    /// Told when bytes of `receiving` are let go.
    received: parking_lot::Condvar,
    /// Connections accepted and not yet through their hello, by number, with when each was
    /// accepted, oldest first (at most [`MAX_GREETING`]).
    greeting: Mutex<VecDeque<(u64, Instant)>>,
    /// Hellos refused (another protocol, a wrong key): logged the first time and then one in
    /// a hundred, as anyone on the host may connect and say anything, as often as it likes.
    refused: AtomicU64,
}

impl Served {
    /// What a server of `store` under `key` shares with its threads, before any connection.
    fn new(store: Arc<EmbeddedStore>, key: StoreKey) -> Self {
        Served {
            store,
            key,
            stop: AtomicBool::new(false),
            clients: Mutex::new(HashMap::new()),
            open: Mutex::new(HashMap::new()),
            receiving: Mutex::new(0),
            received: parking_lot::Condvar::new(),
            greeting: Mutex::new(VecDeque::new()),
            refused: AtomicU64::new(0),
        }
    }
}

/// Serves an [`EmbeddedStore`] over a socket; stops (and closes every connection) when
/// dropped. Clients: [`SocketStore`](super::SocketStore).
///
/// Its [`address`](Self::address) carries a key made at start (`…#key=<32 hex digits>`)
/// that a client must prove at hello, after the server proved it (neither sends it): only
/// processes given the address (through the group's rendezvous,
/// [`STORE_ATTRIBUTE`](super::STORE_ATTRIBUTE)) can use the store, not every user of the
/// host that lists its abstract socket, nor anyone who reaches its TCP port; and a process
/// that takes the address once this server is gone gets nothing from its clients. Pass the
/// address whole; a client without the key, or with another, is refused at hello. After the
/// hello the bytes travel in the clear: `tcp:` is for networks whose hosts are trusted.
///
/// ```
/// use std::sync::Arc;
/// use mooncake_linker::store::{EmbeddedStore, KvStore, ServeAt, SocketStore, StoreServer};
/// let server = StoreServer::start(Arc::new(EmbeddedStore::new(1 << 20)), ServeAt::Unix).unwrap();
/// assert!(server.address().starts_with("unix:@"));
/// let client = SocketStore::connect(server.address()).unwrap();
/// assert_eq!(client.exists(&["nothing"]), vec![Ok(false)]);
/// ```
#[must_use = "dropping the server stops serving the store"]
pub struct StoreServer {
    /// Where it listens, with its key.
    address: String,
    served: Arc<Served>,
    /// How the accepting thread is woken to stop: a connection to the listener itself.
    wake: Wake,
    thread: Option<JoinHandle<()>>,
}

enum Wake {
    /// The addresses to try, in order, until one connects.
    Tcp(Vec<SocketAddr>),
    Unix(String),
}

impl Wake {
    fn poke(&self) {
        let _ = match self {
            Wake::Tcp(addrs) => addrs
                .iter()
                .find_map(|a| std::net::TcpStream::connect_timeout(a, Duration::from_secs(1)).ok())
                .map(drop)
                .ok_or_else(|| io::Error::other("no wake-up address connected")),
            Wake::Unix(name) => std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
                .and_then(|a| UnixStream::connect_addr(&a))
                .map(drop),
        };
    }
}

/// A name no other server of this host uses.
fn fresh_name() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::AtomicU64;
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    format!("kvlink-store-{}-{:016x}", std::process::id(), h.finish())
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("location", &self.location())
            .finish()
    }
}

impl StoreServer {
    /// Starts serving `store` at `at`.
    pub fn start(store: Arc<EmbeddedStore>, at: ServeAt) -> io::Result<StoreServer> {
        let (listener, address, wake) = match at {
            ServeAt::Unix => {
                let name = fresh_name();
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
                let l = Listener::Unix(UnixListener::bind_addr(&addr)?);
                (l, format!("unix:@{name}"), Wake::Unix(name))
            }
            ServeAt::Tcp(a) => {
                let l = TcpListener::bind(a)?;
                let local = l.local_addr()?;
                let address = format!("tcp:{local}");
                // On an unspecified address the wake-up tries the loopback addresses: its own
                // family's first (an IPv6-only `[::]` listener refuses 127.0.0.1), then
                // 127.0.0.1 (a `[::]` listener on a host whose `::1` is off takes IPv4).
                let wake = if local.ip().is_unspecified() {
                    let v4 = SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, local.port()));
                    match local {
                        SocketAddr::V4(_) => vec![v4],
                        SocketAddr::V6(_) => vec![
                            SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, local.port())),
                            v4,
                        ],
                    }
                } else {
                    vec![local]
                };
                (Listener::Tcp(l), address, Wake::Tcp(wake))
            }
        };
        let key = StoreKey::fresh()?;
        let served = Arc::new(Served::new(store, key));
        let s = served.clone();
        let thread = std::thread::Builder::new()
            .name("kvlink-store-accept".into())
            .spawn(move || accept_loop(listener, s))?;
        tracing::info!(%address, "serving the embedded store");
        Ok(StoreServer {
            address: key.in_address(&address),
            served,
            wake,
            thread: Some(thread),
        })
    }

    /// Where clients connect, with the server's key: `unix:@name#key=…` or
    /// `tcp:host:port#key=…`; what [`SocketStore::connect`](super::SocketStore::connect)
    /// takes. Give it only to the processes that may use the store.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Where it listens, without its key (`unix:@name`, `tcp:host:port`): what logs and
    /// reports may print.
    pub fn location(&self) -> &str {
        location(&self.address)
    }

    /// The store served.
    pub fn store(&self) -> &Arc<EmbeddedStore> {
        &self.served.store
    }

    /// The same server with a wake-up that never connects (as when `drop` cannot open a
    /// socket).
    #[cfg(test)]
    pub(super) fn without_wake(mut self) -> Self {
        self.wake = Wake::Unix(format!("{}-no-wake", fresh_name()));
        self
    }

    /// Ends every open connection (as a restart would) and keeps serving; how many.
    #[cfg(test)]
    pub(super) fn end_connections(&self) -> usize {
        let open = self.served.open.lock();
        for c in open.values() {
            c.shutdown();
        }
        open.len()
    }
}

#[cfg(test)]
impl StoreServer {
    /// Connections accepted and not yet through their hello.
    pub(super) fn greeting(&self) -> usize {
        self.served.greeting.lock().len()
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.served.stop.store(true, Ordering::Release);
        self.wake.poke();
        for (_, c) in self.served.open.lock().drain() {
            c.shutdown();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long the accept loop rests after a failed accept (out of file descriptors, say)
/// before it tries again, rather than spinning.
const ACCEPT_RETRY: Duration = Duration::from_millis(20);

fn accept_loop(listener: Listener, served: Arc<Served>) {
    let mut conns: Vec<JoinHandle<()>> = Vec::new();
    let mut next_id = 0u64;
    let mut failed_accepts = 0u64;
    let mut closed_silent = 0u64;
    loop {
        // The stop flag is looked at every IDLE_CHECK even when no connection comes: the
        // wake-up connection of `drop` may fail (out of file descriptors, say).
        let ready = listener.wait_ready(IDLE_CHECK);
        if served.stop.load(Ordering::Acquire) {
            break;
        }
        if !ready {
            // Threads of connections that ended are reaped while none comes too (their
            // stacks stay mapped until joined).
            conns.retain(|h| !h.is_finished());
            continue;
        }
        let accepted = listener.accept();
        if served.stop.load(Ordering::Acquire) {
            break;
        }
        let conn = match accepted {
            Ok(conn) => {
                failed_accepts = 0;
                conn
            }
            Err(e) => {
                failed_accepts += 1;
                // The first failure of a run and then one in a hundred (out of file
                // descriptors, this repeats every ACCEPT_RETRY).
                if failed_accepts % 100 == 1 {
                    tracing::warn!(error = %e, failed_accepts, "accepting a store connection failed");
                }
                std::thread::sleep(ACCEPT_RETRY);
                continue;
            }
        };
        let id = next_id;
        next_id += 1;
        // Tracked before it is counted as greeting: `make_room` may shut it at once.
        match conn.try_clone() {
            Ok(clone) => {
                served.open.lock().insert(id, clone);
            }
            Err(e) => {
                // Without a clone it could be neither shut when evicted nor when the server
                // stops: not served.
                tracing::warn!(error = %e, "a store connection closed: it cannot be tracked");
                continue;
            }
        }
        served.greeting.lock().push_back((id, Instant::now()));
        let greeting = Greeting(Some((served.clone(), id)));
        if make_room(&served) {
            closed_silent += 1;
            if closed_silent % 100 == 1 {
                tracing::warn!(
                    closed_silent,
                    "a store connection that had not said its hello closed: {MAX_GREETING} \
                     newer ones were waiting to"
                );
            }
        }
        let s = served.clone();
        let spawned = std::thread::Builder::new()
            .name("kvlink-store-conn".into())
            .spawn(move || {
                // Closed for the client too (the clone would keep the socket open), also when
                // serving it panicked: the client then sees its end at once.
                let _closed = Closed { served: &s, id };
                serve_connection(conn, &s, greeting);
            });
        match spawned {
            Ok(h) => conns.push(h),
            Err(e) => {
                tracing::error!(error = %e, "cannot start a store connection thread");
                if let Some(c) = served.open.lock().remove(&id) {
                    c.shutdown();
                }
            }
        }
        conns.retain(|h| !h.is_finished());
    }
    for (_, c) in served.open.lock().drain() {
        c.shutdown();
    }
    for h in conns {
        let _ = h.join();
    }
}

/// A served connection's entry in `open`: shut down and removed when dropped (also while
/// unwinding).
struct Closed<'s> {
    served: &'s Served,
    id: u64,
}

impl Drop for Closed<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.served.open.lock().remove(&self.id) {
            c.shutdown();
        }
    }
}

/// Reads the next frame's length, waiting as long as the client stays idle (checking the
/// stop flag), then the body within [`REQUEST_TIMEOUT`]. `None` when the client is gone.
fn next_request(conn: &mut Conn, served: &Served) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    // Idle before a request begins, for as long as the client likes; once its first byte
    // came, the rest of the length within REQUEST_TIMEOUT.
    let mut begun: Option<Instant> = None;
    let _ = conn.set_timeout(Some(IDLE_CHECK));
    while got < 4 {
        if served.stop.load(Ordering::Acquire) || begun.is_some_and(|d| Instant::now() >= d) {
            return None;
        }
        if got > 0 && begun.is_none() {
            begun = Some(kv_loader::deadline_after(REQUEST_TIMEOUT));
        }
        match conn.read(&mut len[got..]) {
            Ok(0) => return None,
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(_) => return None,
        }
    }
    let n = u32::from_le_bytes(len) as usize;
    match read_body(conn, n, kv_loader::deadline_after(REQUEST_TIMEOUT)) {
        Ok(body) => Some(body),
        Err(e) => {
            // Over the frame limit, cut short, or too slow: the connection is out of step.
            tracing::warn!(bytes = n, error = %e, "store request not read whole; closing its connection");
            None
        }
    }
}

/// Closes the oldest connections still to say their hello while more than [`MAX_GREETING`]
/// are: each once it has waited [`GREETING_GRACE`], or at once past [`MAX_GREETING_HARD`].
/// A connection whose whole hello already waits to be read (its thread has not run yet: a
/// real client on a busy host) is passed over. Never waits. True when one was closed.
fn make_room(served: &Served) -> bool {
    let mut greeting = served.greeting.lock();
    let mut closed = false;
    let mut next = 0;
    while greeting.len() > MAX_GREETING {
        let Some(&(old, at)) = greeting.get(next) else {
            break;
        };
        if greeting.len() <= MAX_GREETING_HARD && at.elapsed() < GREETING_GRACE {
            break;
        }
        let open = served.open.lock();
        let conn = open.get(&old);
        if conn.is_some_and(|c| c.has_waiting(HELLO_LEN)) {
            next += 1;
            continue;
        }
        greeting.remove(next);
        // Shut under the lock: its thread, done with the hello, finds its entry gone only
        // after this (and stops), never serving a connection shut beneath it.
        if let Some(c) = conn {
            c.shutdown();
        }
        closed = true;
    }
    closed
}

/// A connection counted in [`Served::greeting`] until its hello is read (or it ends, a panic
/// included): dropped then.
struct Greeting(Option<(Arc<Served>, u64)>);

impl Greeting {
    /// Leaves the list; false when the connection was no longer in it (closed as the oldest
    /// silent one: not to be served).
    fn leave(mut self) -> bool {
        self.0.take().is_some_and(|(s, id)| {
            let mut greeting = s.greeting.lock();
            let listed = greeting.iter().any(|&(g, _)| g == id);
            greeting.retain(|&(g, _)| g != id);
            listed
        })
    }
}

impl Drop for Greeting {
    fn drop(&mut self) {
        if let Some((s, id)) = self.0.take() {
            s.greeting.lock().retain(|&(g, _)| g != id);
        }
    }
}

fn serve_connection(mut conn: Conn, served: &Served, greeting: Greeting) {
    let hello = read_hello(&mut conn, served, kv_loader::deadline_after(HELLO_TIMEOUT));
    if !greeting.leave() {
        return;
    }
    let Some((client, verdict)) = hello else {
        return;
    };
    let deadline = kv_loader::deadline_after(REQUEST_TIMEOUT);
    let ok_bytes = verdict.to_le_bytes();
    let mut answer = [IoSlice::new(&ok_bytes)];
    if verdict != answer::ACCEPTED {
        let _ = write_all_vectored(&mut conn, &mut answer, deadline);
        return;
    }
    // Counted before the hello is answered: a client that, once answered, closes another
    // connection of its own (an anchor it replaces) must never leave the count at 0 between
    // the two, which would end its sessions.
    served.clients.lock().entry(client).or_default().conns += 1;
    // Released however this ends, a panic in a request's handling included: else the
    // client's count never reaches 0 and its pins stay until the server stops.
    let _counted = Counted { served, client };
    if write_all_vectored(&mut conn, &mut answer, deadline).is_err() {
        return;
    }
    while let Some(body) = next_request(&mut conn, served) {
        if let Err(e) = handle(&mut conn, served, client, &body) {
            tracing::debug!(error = %e, "store connection closed");
            break;
        }
    }
}

/// Hears a connection's hello ([`hello`](super::hello)): the client's id and the answer it
/// gets (`None`: the connection ended, sent no hello, or did not answer this server's proof).
/// A hello of another protocol is answered without its nonce being read (its layout may
/// differ); a client whose proof does not match this server's key is refused and logged.
fn read_hello(conn: &mut Conn, served: &Served, deadline: Instant) -> Option<(u64, u32)> {
    let mut said = [0u8; HELLO_LEN];
    let (head, theirs) = said.split_at_mut(HELLO_LEN - NONCE_LEN);
    read_exact_by(conn, head, deadline).ok()?;
    let mut d = Dec::new(head);
    let (magic, protocol, client) = match (d.u32(), d.u32(), d.u64()) {
        (Ok(m), Ok(p), Ok(c)) => (m, p, c),
        _ => return None,
    };
    if magic != MAGIC || protocol != PROTOCOL {
        let refused = served.refused.fetch_add(1, Ordering::Relaxed) + 1;
        if refused % 100 == 1 {
            tracing::warn!(
                magic,
                protocol,
                expected = PROTOCOL,
                refused,
                "store connection refused: another protocol (one in a hundred refusals logged)"
            );
        }
        return Some((client, answer::OTHER_PROTOCOL));
    }
    read_exact_by(conn, theirs, deadline).ok()?;
    let ours = match hello::nonce() {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(error = %e, "store connection closed: no random nonce for its hello");
            return None;
        }
    };
    let prove = answer::PROVE.to_le_bytes();
    let proof = hello::proof(Role::Server, &served.key, &said, &ours);
    let challenge = &mut [
        IoSlice::new(&prove),
        IoSlice::new(&ours),
        IoSlice::new(&proof),
    ];
    write_all_vectored(conn, challenge, deadline).ok()?;
    let mut proved = [0u8; PROOF_LEN];
    if read_exact_by(conn, &mut proved, deadline).is_err() {
        // A client that found this server's proof wrong (a stale address) sends nothing.
        tracing::debug!(
            client,
            "store connection ended at hello, the client's proof unsent"
        );
        return None;
    }
    let want = hello::proof(Role::Client, &served.key, &said, &ours);
    if !hello::same_proof(&proved, &want) {
        let refused = served.refused.fetch_add(1, Ordering::Relaxed) + 1;
        if refused % 100 == 1 {
            tracing::warn!(
                client,
                refused,
                "store connection refused: the client did not prove this server's key (an \
                 address without it, or another server's; one in a hundred refusals logged)"
            );
        }
        return Some((client, answer::WRONG_KEY));
    }
    Some((client, answer::ACCEPTED))
}

/// One counted connection of a client: released when dropped (also while unwinding).
struct Counted<'s> {
    served: &'s Served,
    client: u64,
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        release(self.served, self.client);
    }
}

/// The client's connection closed: when it was its last, its pins go.
fn release(served: &Served, client: u64) {
    let mut clients = served.clients.lock();
    let Some(c) = clients.get_mut(&client) else {
        return;
    };
    c.conns -= 1;
    if c.conns > 0 {
        return;
    }
    let Some(c) = clients.remove(&client) else {
        return;
    };
    drop(clients);
    if !c.sessions.is_empty() {
        tracing::info!(
            client,
            sessions = c.sessions.len(),
            "a client left: ending its read sessions"
        );
    }
    for token in c.sessions.into_keys() {
        end_session(&served.store, token);
    }
}

/// Ends session `token` of `client`. Only a session this client holds is ended: a session
/// ended twice, or another client's token, takes no one's pins.
fn end_clients_session(served: &Served, client: u64, token: u64) {
    let mine = served
        .clients
        .lock()
        .get_mut(&client)
        .is_some_and(|c| c.sessions.remove(&token).is_some());
    if mine {
        end_session(&served.store, token);
    }
}

/// A session's lease on the wire: whole milliseconds, at least 1; 0 for none (until ended).
pub(super) fn lease_ms(lease: Option<std::time::Duration>) -> u64 {
    lease.map_or(0, |l| {
        u64::try_from(l.as_millis()).unwrap_or(u64::MAX).max(1)
    })
}

/// Ends the store's session `token` (the embedded store's end cannot fail).
fn end_session(store: &EmbeddedStore, token: u64) {
    let session = crate::store::ReadSession {
        keys: Vec::new(),
        lease: None,
        token,
    };
    let _ = store.end_session(&session);
}

/// A request's list of keys, which ends its message (bytes past it are refused: a request
/// read as one it is not, say from a client of another build, is not answered as if it were).
fn keys(d: &mut Dec<'_>) -> Result<Vec<String>, Malformed> {
    // Each key is at least its 4-byte length on the wire.
    let n = d.count(4)?;
    let keys = (0..n).map(|_| d.str()).collect::<Result<_, _>>()?;
    d.finish()?;
    Ok(keys)
}

/// Answers one request.
fn handle(conn: &mut Conn, served: &Served, client: u64, body: &[u8]) -> io::Result<()> {
    let store = &served.store;
    let mut d = Dec::new(body);
    let mut out = Enc::default();
    let deadline = kv_loader::deadline_after(REQUEST_TIMEOUT);
    match d.u8()? {
        op::EXISTS => {
            let ks = keys(&mut d)?;
            let refs: Vec<&str> = ks.iter().map(String::as_str).collect();
            for r in store.exists(&refs) {
                out.result(&r, |e, v| {
                    e.u8(u8::from(*v));
                });
            }
        }
        op::OBJECT_SIZE => {
            let ks = keys(&mut d)?;
            let refs: Vec<&str> = ks.iter().map(String::as_str).collect();
            for r in store.object_size(&refs) {
                out.result(&r, |e, v| {
                    e.u64(*v);
                });
            }
        }
        op::GET_INTO => return get_into(store, &mut d)?.send(conn, deadline),
        op::GET_RANGES => return get_ranges(store, &mut d)?.send(conn, deadline),
        op::PUT => return put(conn, served, &mut d, deadline)?.send(conn, deadline),
        op::REMOVE => {
            let ks = keys(&mut d)?;
            let refs: Vec<&str> = ks.iter().map(String::as_str).collect();
            for r in store.remove(&refs) {
                out.result(&r, |_, _| {});
            }
        }
        op::DISCARD => {
            let ks = keys(&mut d)?;
            let refs: Vec<&str> = ks.iter().map(String::as_str).collect();
            for r in store.discard(&refs) {
                out.result(&r, |_, _| {});
            }
        }
        op::START_SESSION => {
            let tag = d.u64()?;
            let ks = keys(&mut d)?;
            let refs: Vec<&str> = ks.iter().map(String::as_str).collect();
            let mut r = store.start_session(&refs).map(|s| (s.token, s.lease));
            if let Ok((token, _)) = r {
                let kept = {
                    let mut clients = served.clients.lock();
                    let sessions = clients.entry(client).or_default();
                    // Sessions the store ended at their lease (their end never came) leave the
                    // client's record too, which else grew with every lost end.
                    sessions.sessions.retain(|t, _| store.session_open(*t));
                    sessions.started(token, tag)
                };
                if !kept {
                    // Its client gave it up (its call ran out) before it ran: nobody will
                    // end it. Nor is its token answered: that session is gone.
                    tracing::debug!(client, tag, "a session start its client gave up on: ended");
                    end_session(store, token);
                    r = Err(StoreError::Lease {
                        key: refs.first().copied().unwrap_or("").to_string(),
                        detail: format!(
                            "session start {tag} was given up by its client before it ran; \
                             it was ended at once"
                        ),
                    });
                }
            }
            // The token, then the lease in milliseconds (0: until ended).
            out.result(&r, |e, (t, lease)| {
                e.u64(*t).u64(lease_ms(*lease));
            });
            let sent = Reply::new(out).send(conn, deadline);
            if let (Err(_), Ok((token, _))) = (&sent, r) {
                // The client never learns the token, so it can never end the session: end
                // it here rather than keep its pins for as long as the client stays.
                end_clients_session(served, client, token);
            }
            return sent;
        }
        op::END_SESSION => {
            let token = d.u64()?;
            d.finish()?;
            end_clients_session(served, client, token);
            out.result(&Ok(()), |_, _| {});
        }
        op::END_SESSION_TAG => {
            let tag = d.u64()?;
            d.finish()?;
            let token = served
                .clients
                .lock()
                .entry(client)
                .or_default()
                .give_up(tag);
            if let Some(token) = token {
                end_session(store, token);
            }
            out.result(&Ok(()), |_, _| {});
        }
        op::HEALTH => {
            d.finish()?;
            out.result(&store.health(), |_, _| {});
        }
        other => return Err(Malformed(format!("operation {other}")).into()),
    }
    Reply::new(out).send(conn, deadline)
}

/// A reply: its framed results, then the object bytes a read sends after them.
struct Reply {
    results: Enc,
    /// (object, offset, len) of every piece of bytes, in order.
    pieces: Vec<(Arc<[u8]>, usize, usize)>,
}

impl Reply {
    fn new(results: Enc) -> Self {
        Reply {
            results,
            pieces: Vec::new(),
        }
    }

    fn send(self, conn: &mut Conn, deadline: Instant) -> io::Result<()> {
        let len = frame_len(&self.results.0);
        let mut slices = vec![IoSlice::new(&len), IoSlice::new(&self.results.0)];
        slices.extend(
            self.pieces
                .iter()
                .map(|(o, off, len)| IoSlice::new(&o[*off..*off + *len])),
        );
        write_all_vectored(conn, &mut slices, deadline)
    }
}

/// A read request of gets read from `d` one by one by `get`, which queues the pieces of bytes
/// its get sends and returns the get's result (the bytes it sends, or its error).
fn reads(
    d: &mut Dec<'_>,
    mut get: impl FnMut(&mut Dec<'_>, &mut Reply) -> io::Result<Result<u64, StoreError>>,
) -> io::Result<Reply> {
    // Each get is at least a key's length and a u64 (a capacity, or a range count and more).
    let n = d.count(8)?;
    let mut reply = Reply::new(Enc::default());
    for _ in 0..n {
        let r = get(d, &mut reply)?;
        reply.results.result(&r, |e, v| {
            e.u64(*v);
        });
    }
    d.finish()?;
    Ok(reply)
}

fn get_into(store: &EmbeddedStore, d: &mut Dec<'_>) -> io::Result<Reply> {
    reads(d, |d, reply| {
        let key = d.str()?;
        let cap = d.u64()?;
        let r = match store.object(&key) {
            None => Err(StoreError::NotFound { key }),
            Some(o) if o.len() as u64 > cap => Err(StoreError::InvalidArgument {
                detail: format!("object of {} bytes, buffer of {cap}", o.len()),
                key,
            }),
            Some(o) => {
                let len = o.len();
                reply.pieces.push((o, 0, len));
                Ok(len as u64)
            }
        };
        Ok(r)
    })
}

fn get_ranges(store: &EmbeddedStore, d: &mut Dec<'_>) -> io::Result<Reply> {
    reads(d, |d, reply| {
        let key = d.str()?;
        // Each range is two u64s on the wire.
        let m = d.count(16)?;
        let mut ranges = Vec::with_capacity(m);
        for _ in 0..m {
            ranges.push((d.u64()?, d.u64()?));
        }
        let r = match store.object(&key) {
            None => Err(StoreError::NotFound { key }),
            Some(o) => {
                let bad = ranges
                    .iter()
                    .find(|(off, len)| off.checked_add(*len).is_none_or(|e| e > o.len() as u64));
                match bad {
                    Some((off, len)) => Err(StoreError::InvalidArgument {
                        detail: format!("range {off}+{len} outside an object of {} bytes", o.len()),
                        key,
                    }),
                    None => {
                        let total = ranges.iter().fold(0u64, |t, r| t.saturating_add(r.1));
                        for (off, len) in ranges {
                            reply.pieces.push((o.clone(), off as usize, len as usize));
                        }
                        Ok(total)
                    }
                }
            }
        };
        Ok(r)
    })
}

fn put(conn: &mut Conn, served: &Served, d: &mut Dec<'_>, deadline: Instant) -> io::Result<Reply> {
    let store = &served.store;
    // Each item is a key (a u32 length, then its bytes) and a u64 length on the wire.
    let n = d.count(12)?;
    let mut items = Vec::with_capacity(n);
    for _ in 0..n {
        items.push((d.str()?, d.u64()?));
    }
    // Before any of its bytes are taken from the connection.
    d.finish()?;
    let mut out = Enc::default();
    // One wait for room for the whole request, within its deadline: a put of many items
    // beside others being received is answered before its client gives up.
    let room_by = kv_loader::deadline_after(RECEIVE_WAIT).min(deadline);
    for (key, len) in items {
        let r = match store.admit(&key, len) {
            Some(answer) => {
                drain(conn, len, deadline)?;
                answer
            }
            None => match Receiving::take(served, len, room_by) {
                Some(_receiving) => {
                    let data = new_object(len as usize, |dst| read_exact_by(conn, dst, deadline))?;
                    store.insert(&key, data)
                }
                None => {
                    drain(conn, len, deadline)?;
                    // Passing: the store itself had room (`admit`).
                    Err(StoreError::Unavailable {
                        detail: kv_loader::Cause::new(format!(
                            "`{key}`: a put of {len} bytes found no room (its request waits up \
                             to {RECEIVE_WAIT:?}) beside the puts being received, which hold \
                             up to the store's capacity"
                        )),
                    })
                }
            },
        };
        out.result(&r, |e, v| {
            e.u8(outcome_code(*v));
        });
    }
    Ok(Reply::new(out))
}

/// `len` bytes of a put being received, counted in [`Served::receiving`] until dropped.
struct Receiving<'s> {
    served: &'s Served,
    len: u64,
}

impl<'s> Receiving<'s> {
    /// Counts `len` bytes more once that keeps the puts being received within the store's
    /// capacity, waiting for others to be let go until `until`; `None` past it, once the
    /// server stops, or at once for more than the capacity.
    fn take(served: &'s Served, len: u64, until: Instant) -> Option<Self> {
        let capacity = served.store.capacity();
        if len > capacity {
            return None;
        }
        let mut receiving = served.receiving.lock();
        loop {
            let total = receiving.checked_add(len)?;
            if total <= capacity {
                *receiving = total;
                return Some(Receiving { served, len });
            }
            if Instant::now() >= until || served.stop.load(Ordering::Acquire) {
                return None;
            }
            // In slices, to see the stop flag (a server's drop waits for this thread).
            let slice = kv_loader::deadline_after(IDLE_CHECK).min(until);
            served.received.wait_until(&mut receiving, slice);
        }
    }
}

impl Drop for Receiving<'_> {
    fn drop(&mut self) {
        let mut receiving = self.served.receiving.lock();
        *receiving = receiving.saturating_sub(self.len);
        self.served.received.notify_all();
    }
}

/// Reads and drops `n` bytes (a put the store does not take).
fn drain(conn: &mut Conn, mut n: u64, deadline: Instant) -> io::Result<()> {
    let mut scratch = vec![0u8; 1 << 16];
    while n > 0 {
        let k = n.min(scratch.len() as u64) as usize;
        read_exact_by(conn, &mut scratch[..k], deadline)?;
        n -= k as u64;
    }
    Ok(())
}

#[cfg(test)]
mod accept_tests {
    use super::*;

    #[test]
    fn an_accepted_tcp_connection_probes_a_silent_client() {
        let l = Listener::Tcp(TcpListener::bind("127.0.0.1:0").unwrap());
        let Listener::Tcp(t) = &l else { unreachable!() };
        let _client = std::net::TcpStream::connect(t.local_addr().unwrap()).unwrap();
        let Conn::Tcp(s) = l.accept().unwrap() else {
            panic!("a TCP listener gave another kind of connection")
        };
        let s = socket2::SockRef::from(&s);
        assert!(s.keepalive().unwrap());
        assert_eq!(s.keepalive_time().unwrap(), Duration::from_secs(30));
        assert_eq!(s.keepalive_interval().unwrap(), Duration::from_secs(10));
        assert_eq!(s.keepalive_retries().unwrap(), 3);
    }
}

#[cfg(test)]
mod receiving_tests {
    use super::*;

    fn served(capacity: u64) -> Served {
        Served::new(Arc::new(EmbeddedStore::new(capacity)), StoreKey([0; 16]))
    }

    #[test]
    fn puts_being_received_hold_at_most_the_stores_capacity() {
        let served = served(1000);
        let now = Instant::now;
        let a = Receiving::take(&served, 600, now()).unwrap();
        assert!(
            Receiving::take(&served, 500, now()).is_none(),
            "past the capacity"
        );
        let b = Receiving::take(&served, 400, now()).unwrap();
        assert!(Receiving::take(&served, 1, now()).is_none());
        drop(a);
        assert!(
            Receiving::take(&served, 600, now()).is_some(),
            "a's bytes counted no more"
        );
        drop(b);
        assert_eq!(*served.receiving.lock(), 0);
        let t0 = Instant::now();
        let far = t0 + Duration::from_secs(30);
        assert!(Receiving::take(&served, u64::MAX, far).is_none());
        assert!(Receiving::take(&served, 1001, far).is_none());
        assert!(t0.elapsed() < Duration::from_secs(5), "refused at once");
    }

    /// A put that does not fit beside the puts being received waits (bounded) for one of them
    /// to be let go, rather than fail at once as if the store were full.
    #[test]
    fn a_put_waits_for_room_among_the_puts_being_received() {
        let served = served(1000);
        std::thread::scope(|s| {
            let a = Receiving::take(&served, 800, Instant::now()).unwrap();
            let waiter = s.spawn(|| {
                Receiving::take(&served, 500, Instant::now() + Duration::from_secs(10))
                    .map(|r| r.len)
            });
            std::thread::sleep(Duration::from_millis(100));
            drop(a);
            assert_eq!(waiter.join().unwrap(), Some(500));
        });
        let _full = Receiving::take(&served, 1000, Instant::now()).unwrap();
        let t0 = Instant::now();
        let late = Receiving::take(&served, 1, t0 + Duration::from_millis(100));
        assert!(late.is_none() && t0.elapsed() >= Duration::from_millis(90));
        // A server that stops ends the wait within one idle check, whatever its bound.
        std::thread::scope(|s| {
            let t0 = Instant::now();
            let until = t0 + Duration::from_secs(30);
            let served = &served;
            let waiter = s.spawn(move || Receiving::take(served, 1, until).is_none());
            std::thread::sleep(Duration::from_millis(50));
            served.stop.store(true, Ordering::Release);
            assert!(waiter.join().unwrap(), "no room was taken");
            assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        });
    }
}

#[cfg(test)]
mod lease_tests {
    use super::*;
    use crate::store::{KvStore, ObjectPut, SocketStore};

    /// Sessions the store ended at their lease leave the client's record at its next start.
    /// Before, a live client whose ends were lost kept a record of each for its life.
    #[test]
    fn sessions_past_their_lease_leave_the_clients_record() {
        // A second: the three starts below come well within it on a loaded machine.
        let lease = Duration::from_secs(1);
        let store = Arc::new(EmbeddedStore::new(1 << 10).with_lease(Some(lease)));
        let server = StoreServer::start(store, ServeAt::Unix).unwrap();
        let client = SocketStore::connect(server.address()).unwrap();
        let data = [1u8; 8];
        let put = ObjectPut {
            key: "a",
            parts: [(data.as_ptr(), data.len())].into_iter().collect(),
        };
        // SAFETY: `data` is a live array, read-only for the call.
        assert!(unsafe { client.put(&[put]) }[0].is_ok());
        let recorded = || -> usize {
            let clients = server.served.clients.lock();
            clients.values().map(|c| c.sessions.len()).sum()
        };
        for _ in 0..3 {
            client.start_session(&["a"]).unwrap();
        }
        assert_eq!(recorded(), 3, "never ended");
        std::thread::sleep(lease + Duration::from_millis(100));
        let last = client.start_session(&["a"]).unwrap();
        assert_eq!(recorded(), 1, "only the session still open");
        client.end_session(&last).unwrap();
        assert_eq!(recorded(), 0);
    }
}
