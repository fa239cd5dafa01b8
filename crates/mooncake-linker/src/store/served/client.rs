//! [`SocketStore`]: a [`KvStore`] whose objects live in another process's embedded store,
//! served by a [`StoreServer`](super::StoreServer).
//!
//! Reads land straight in the caller's memory (`readv` into the destinations), puts leave
//! straight from it (`writev` from the parts): the socket's own copies are the only ones.
//! Connections are pooled (one per concurrent caller); a connection that fails is dropped,
//! and every key of that call gets the error ([`StoreError::Unavailable`], or
//! [`StoreError::RpcTimeout`] past the request timeout). A call naming a null destination or
//! source (with a length) is refused whole before anything is sent: every key gets
//! [`StoreError::InvalidArgument`] naming the first such key (the embedded store refuses only
//! that key). One more connection, opened at
//! connect and never used for a request, stays open while the client lives (a session start
//! opens it again if the server closed it): the server ends a client's read sessions when its
//! last connection closes, which a dropped pooled connection must not cause.

use std::ffi::OsStr;
use std::io::{self, IoSlice, IoSliceMut};
use std::net::TcpStream;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dedup_broadcast::{AddressLookups, ResolveFailure};
use kv_loader::Cause;
use parking_lot::Mutex;

use super::hello::{self, answer, Role, NONCE_LEN, PROOF_LEN};
use super::protocol::{
    frame_len, location, op, read_all_vectored, read_exact_by, read_frame, split_address,
    write_all_vectored, Conn, Dec, Enc, Malformed, StoreKey, MAX_FRAME, MAX_ITEMS,
};
use crate::store::{
    KvStore, MemoryRegion, ObjectGet, ObjectPut, PutOutcome, RangedGet, ReadSession, StoreError,
};

/// How long one request may take by default.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A client of a served embedded store (see the module docs).
pub struct SocketStore {
    /// Where to connect (the address without its key: what logs and errors name).
    address: String,
    /// The server's key, said at hello (zeros when the address names none).
    key: Option<StoreKey>,
    client: u64,
    timeout: Duration,
    pool: Mutex<Vec<Conn>>,
    /// Lookups of a `tcp:` address's host, bounded by each connect's deadline.
    lookups: Option<Mutex<AddressLookups>>,
    /// A connection that carries no request and stays open while this client lives: the
    /// server ends a client's read sessions when its last connection closes, and a pooled
    /// connection that fails is dropped, which must not end the sessions of the client's
    /// other loads. Reopened by the next session start if the server closed it.
    anchor: Mutex<Option<Conn>>,
    /// The tag of this client's next session start.
    next_session_tag: AtomicU64,
    /// The "no reply in time" line, at `warn` once a minute while calls time out.
    timeouts: crate::log_every::LogEvery,
}

impl std::fmt::Debug for SocketStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SocketStore")
            .field("address", &self.address)
            .finish()
    }
}

/// What went wrong with one request: the whole call fails with it, per key.
enum CallError {
    Timeout,
    /// A request of this many bytes, over the protocol's frame limit: not sent.
    TooLarge(usize),
    /// The server is unreachable or broke the protocol (the I/O error behind it, if any).
    Down(Cause),
}

impl From<io::Error> for CallError {
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::TimedOut {
            CallError::Timeout
        } else {
            CallError::Down(Cause::from_error(e))
        }
    }
}

impl From<Malformed> for CallError {
    fn from(m: Malformed) -> Self {
        CallError::Down(format!("a reply that does not decode: {}", m.0).into())
    }
}

impl CallError {
    fn for_key(&self, address: &str, key: &str) -> StoreError {
        match self {
            CallError::Timeout => StoreError::RpcTimeout {
                key: key.to_string(),
            },
            CallError::TooLarge(n) => StoreError::InvalidArgument {
                key: key.to_string(),
                detail: format!("a request of {n} bytes (keys and ranges; at most {MAX_FRAME})"),
            },
            CallError::Down(d) => StoreError::Unavailable {
                detail: d.clone().context(format!("served store at {address}")),
            },
        }
    }
}

/// How long a Unix connect waits before it tries again while the listener's backlog is full.
const CONNECT_RETRY: Duration = Duration::from_millis(5);

/// Connects a Unix stream socket to `path` by `deadline`. std's connect blocks for as long as
/// the listener's backlog stays full (a server that stopped accepting); this one connects
/// without blocking and tries again until the deadline, then answers `TimedOut`.
fn connect_unix(path: &OsStr, deadline: Instant) -> io::Result<UnixStream> {
    use socket2::{Domain, SockAddr, Socket, Type};
    let addr = SockAddr::unix(path)?;
    let socket = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    socket.set_nonblocking(true)?;
    loop {
        match socket.connect(&addr) {
            Ok(()) => break,
            // Linux answers EAGAIN (`WouldBlock`) while the backlog is full.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the listener's backlog stayed full until the deadline",
                    ));
                }
                std::thread::sleep(CONNECT_RETRY.min(deadline - now));
            }
            Err(e) => return Err(e),
        }
    }
    socket.set_nonblocking(false)?;
    Ok(UnixStream::from(socket))
}

/// Connects to the first address `lookups` finds that accepts, by `deadline`: the lookup (a
/// name's, on a thread of its own) and the connects share the time left.
fn connect_tcp(lookups: &Mutex<AddressLookups>, deadline: Instant) -> Result<TcpStream, CallError> {
    let left = || deadline.saturating_duration_since(Instant::now());
    let found = match lookups.try_lock_until(deadline) {
        Some(mut l) => l.resolve(left()),
        None => return Err(CallError::Timeout),
    };
    let addrs = match found {
        Ok(a) => a,
        Err(e @ ResolveFailure::Invalid(_)) => {
            return Err(CallError::Down(Cause::from_error(e)));
        }
        Err(e) => {
            tracing::warn!(error = %e, "a served store's address did not resolve");
            if left().is_zero() {
                return Err(CallError::Timeout);
            }
            return Err(CallError::Down(Cause::from_error(e)));
        }
    };
    let mut last = None;
    for (i, addr) in addrs.iter().enumerate() {
        let now_left = left();
        if now_left.is_zero() {
            break;
        }
        // An equal share of what is left for each address still to try: one that drops
        // the connect (an unreachable AAAA record) leaves time for the next.
        let share = now_left / (addrs.len() - i) as u32;
        match TcpStream::connect_timeout(addr, share.max(Duration::from_millis(1))) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    // None accepted: the name may point elsewhere now (the server restarted on another host).
    // Only this answer is dropped: another connection may have kept a newer one meanwhile.
    if let Some(mut l) = lookups.try_lock_until(deadline) {
        l.forget_tried(&addrs);
    }
    Err(match last {
        Some(e) => connect_error(e),
        None => CallError::Timeout,
    })
}

/// One `u32` answer of the server's hello.
fn read_answer(conn: &mut Conn, deadline: Instant) -> Result<u32, CallError> {
    let mut a = [0u8; 4];
    read_exact_by(conn, &mut a, deadline)?;
    Ok(u32::from_le_bytes(a))
}

/// A failed connect: one that ran out its deadline is the call's timeout (`RpcTimeout`, as a
/// request past it); any other, the store is unreachable.
fn connect_error(e: io::Error) -> CallError {
    if e.kind() == io::ErrorKind::TimedOut {
        tracing::debug!(error = %e, "connecting to a served store ran out its deadline");
        return CallError::Timeout;
    }
    CallError::Down(Cause::with_source(format!("connecting: {e}"), e))
}

fn fresh_client_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
}

impl SocketStore {
    /// Connects to the store served at `address` (`unix:@name`, `unix:/path` or
    /// `tcp:host:port`, then `#key=…`: [`StoreServer::address`](super::StoreServer::address)
    /// whole), checking it answers.
    pub fn connect(address: &str) -> Result<SocketStore, StoreError> {
        Self::connect_with(address, DEFAULT_REQUEST_TIMEOUT)
    }

    /// [`connect`](Self::connect) with another request timeout. The server gives each step of
    /// a request at most 60 s (its arrival, then its handling and reply): a longer timeout
    /// waits longer for a reply, but a request the server gave up on ends as `Unavailable`.
    pub fn connect_with(address: &str, timeout: Duration) -> Result<SocketStore, StoreError> {
        if timeout.is_zero() {
            return Err(StoreError::InvalidArgument {
                key: "connect".into(),
                detail: "a served store's request timeout of zero: every request would time \
                         out at once"
                    .into(),
            });
        }
        let (address, key) = split_address(address)
            .map_err(|e| CallError::Down(e.into()).for_key(location(address), "connect"))?;
        let s = SocketStore {
            address: address.to_string(),
            key,
            client: fresh_client_id(),
            timeout,
            pool: Mutex::new(Vec::new()),
            lookups: address
                .strip_prefix("tcp:")
                .map(|hp| Mutex::new(AddressLookups::new(hp, "served store address"))),
            anchor: Mutex::new(None),
            next_session_tag: AtomicU64::new(0),
            timeouts: crate::log_every::LogEvery::new(),
        };
        // One deadline for both steps: the timeout bounds the whole connect.
        let deadline = kv_loader::deadline_after(timeout);
        s.single_by(deadline, &health_request(), "", |_| Ok(()))?;
        s.keep_anchor(deadline)
            .map_err(|e| e.for_key(address, "connect"))?;
        Ok(s)
    }

    /// The server's address, without its key.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Pools `conn`: the next call takes it first.
    #[cfg(test)]
    pub(super) fn pool_connection(&self, conn: Conn) {
        self.pool.lock().push(conn);
    }

    /// Drops the pooled connections, as a failed call drops its own; how many.
    #[cfg(test)]
    pub(super) fn drop_pooled(&self) -> usize {
        std::mem::take(&mut *self.pool.lock()).len()
    }

    fn open(&self, deadline: Instant) -> Result<Conn, CallError> {
        let mut conn = if let Some(name) = self.address.strip_prefix("unix:@") {
            // An abstract name is a socket path that starts with a NUL byte.
            let path = [&[0u8][..], name.as_bytes()].concat();
            Conn::Unix(connect_unix(OsStr::from_bytes(&path), deadline).map_err(connect_error)?)
        } else if let Some(path) = self.address.strip_prefix("unix:") {
            Conn::Unix(connect_unix(OsStr::new(path), deadline).map_err(connect_error)?)
        } else if let Some(lookups) = &self.lookups {
            let s = connect_tcp(lookups, deadline)?;
            s.set_nodelay(true).map_err(connect_error)?;
            Conn::Tcp(s)
        } else {
            return Err(CallError::Down(
                format!("address {:?} is neither unix: nor tcp:", self.address).into(),
            ));
        };
        self.say_hello(&mut conn, deadline)?;
        Ok(conn)
    }

    /// The hello ([`hello`](super::hello)): the server proves the address's key first, then
    /// this client does. An address without a key proves the all-zero one (test servers).
    fn say_hello(&self, conn: &mut Conn, deadline: Instant) -> Result<(), CallError> {
        let key = self.key.unwrap_or(StoreKey([0; 16]));
        let said = hello::client_hello(self.client).map_err(connect_error)?;
        write_all_vectored(conn, &mut [IoSlice::new(&said)], deadline)?;
        match read_answer(conn, deadline)? {
            answer::PROVE => {}
            answer::OTHER_PROTOCOL => {
                return Err(CallError::Down("the server speaks another protocol".into()))
            }
            other => {
                return Err(CallError::Down(
                    format!("the server answered the hello with {other}, not a proof").into(),
                ))
            }
        }
        let mut theirs = [0u8; NONCE_LEN];
        let mut proved = [0u8; PROOF_LEN];
        read_exact_by(conn, &mut theirs, deadline)?;
        read_exact_by(conn, &mut proved, deadline)?;
        if !hello::same_proof(&proved, &hello::proof(Role::Server, &key, &said, &theirs)) {
            tracing::warn!(address = %location(&self.address),
                "the server at this store address does not hold its key: nothing was sent to it");
            return Err(CallError::Down(
                if self.key.is_none() {
                    "the address names no key (its `#key=` part is missing): connect with the \
                     address the server announced; nothing was sent to the server"
                } else {
                    "the server at this address could not prove it holds the address's key (a \
                     server started anew there, whose new address was not passed on, or \
                     another process took the address): nothing was sent to it"
                }
                .into(),
            ));
        }
        let mine = hello::proof(Role::Client, &key, &said, &theirs);
        write_all_vectored(conn, &mut [IoSlice::new(&mine)], deadline)?;
        match read_answer(conn, deadline)? {
            answer::ACCEPTED => Ok(()),
            answer::WRONG_KEY => Err(CallError::Down(
                "the server refused this client's key: connect with the address the server \
                 announced, its `#key=` part included"
                    .into(),
            )),
            other => Err(CallError::Down(
                format!("the server answered the client's proof with {other}").into(),
            )),
        }
    }

    /// Opens the anchor connection, or opens it again if the server has closed it (a server
    /// that restarted, or ended the connection), so that the sessions started from now on
    /// are kept while this client lives. Sessions started before it closed may be gone: the
    /// server ends a client's sessions with its last connection.
    fn keep_anchor(&self, deadline: Instant) -> Result<(), CallError> {
        let mut anchor = self.anchor.lock();
        if anchor.as_ref().is_some_and(|c| !c.is_closed()) {
            return Ok(());
        }
        let fresh = self.open(deadline)?;
        if anchor.is_some() {
            tracing::warn!(
                address = %self.address,
                "served store: the server closed this client's anchor connection; reopened \
                 (read sessions started before it closed may have ended with it)"
            );
        }
        *anchor = Some(fresh);
        Ok(())
    }

    /// A pooled connection the server has not closed, if any (closed ones are dropped: a
    /// call on one would fail for nothing).
    fn pooled(&self) -> Option<Conn> {
        loop {
            let conn = self.pool.lock().pop()?;
            if !conn.is_closed() {
                return Some(conn);
            }
            tracing::debug!(address = %self.address, "served store: a pooled connection was closed by the server; dropped");
        }
    }

    /// Runs `f` on a pooled connection (or a new one) within the request timeout; a
    /// connection that fails is dropped.
    fn call<T>(
        &self,
        f: impl FnOnce(&mut Conn, Instant) -> Result<T, CallError>,
    ) -> Result<T, CallError> {
        self.call_by(kv_loader::deadline_after(self.timeout), f)
    }

    /// [`call`](Self::call) by `deadline`.
    fn call_by<T>(
        &self,
        deadline: Instant,
        f: impl FnOnce(&mut Conn, Instant) -> Result<T, CallError>,
    ) -> Result<T, CallError> {
        let pooled = self.pooled();
        let mut conn = match pooled {
            Some(c) => c,
            None => self.open(deadline)?,
        };
        let out = match f(&mut conn, deadline) {
            Ok(out) => out,
            // Nothing was sent: the connection is still in step.
            Err(e @ CallError::TooLarge(_)) => {
                self.pool.lock().push(conn);
                return Err(e);
            }
            Err(e @ CallError::Timeout) => {
                // The error (`RpcTimeout`, per key) has no room for where: the log says it,
                // so that a hung server is told from a slow Mooncake master behind it.
                let waited = self.timeout;
                match self.timeouts.due_after("timeout") {
                    Some(skipped) => tracing::warn!(address = %self.address, ?waited, skipped,
                        "served store: no reply by a call's deadline (its error: RPC timeout); \
                         the connection is dropped (`skipped`: such calls since the last such \
                         line, at debug)"),
                    None => tracing::debug!(address = %self.address, ?waited,
                        "served store: no reply by a call's deadline"),
                }
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        self.pool.lock().push(conn);
        Ok(out)
    }

    /// Sends `body` (framed) and reads the reply's frame.
    fn request(conn: &mut Conn, body: &[u8], deadline: Instant) -> Result<Vec<u8>, CallError> {
        if body.len() > MAX_FRAME {
            return Err(CallError::TooLarge(body.len()));
        }
        let len = frame_len(body);
        write_all_vectored(
            conn,
            &mut [IoSlice::new(&len), IoSlice::new(body)],
            deadline,
        )?;
        Ok(read_frame(conn, deadline)?)
    }

    /// A request about `keys` whose reply is one result per key.
    fn per_key<T>(
        &self,
        opcode: u8,
        keys: &[&str],
        value: impl Fn(&mut Dec<'_>) -> Result<T, Malformed>,
    ) -> Vec<Result<T, StoreError>> {
        if let Some(e) = too_many(keys.len(), keys.first().copied().unwrap_or("")) {
            return all_err(keys.len(), e);
        }
        let body = keys_body(opcode, keys);
        let r = self.call(|c, deadline| {
            let reply = Self::request(c, &body.0, deadline)?;
            let mut d = Dec::new(&reply);
            let results = keys
                .iter()
                .map(|_| d.result(&value))
                .collect::<Result<Vec<_>, _>>()?;
            d.finish()?;
            Ok(results)
        });
        self.spread(r, keys.iter().copied())
    }

    /// A read request (`body`): one result per get (the bytes it read, or its error), then
    /// the bytes of the gets that succeeded, received into the slices `dsts` makes for those
    /// results (in get order). One result per key of `keys`, or the call's error for each.
    fn read<'k, 'd>(
        &self,
        body: &Enc,
        keys: impl Iterator<Item = &'k str> + Clone,
        dsts: impl FnOnce(&[Result<u64, StoreError>]) -> Result<Vec<IoSliceMut<'d>>, CallError>,
    ) -> Vec<Result<u64, StoreError>> {
        let r = self.call(|c, deadline| {
            let reply = Self::request(c, &body.0, deadline)?;
            let mut d = Dec::new(&reply);
            let results: Vec<Result<u64, StoreError>> = keys
                .clone()
                .map(|_| d.result(|d| d.u64()))
                .collect::<Result<_, _>>()?;
            d.finish()?;
            let mut dsts = dsts(&results)?;
            read_all_vectored(c, &mut dsts, deadline)?;
            Ok(results)
        });
        self.spread(r, keys)
    }

    /// One result per key, or the call's error for every key.
    fn spread<'k, T>(
        &self,
        r: Result<Vec<Result<T, StoreError>>, CallError>,
        keys: impl Iterator<Item = &'k str>,
    ) -> Vec<Result<T, StoreError>> {
        match r {
            Ok(v) => v,
            Err(e) => keys.map(|k| Err(e.for_key(&self.address, k))).collect(),
        }
    }

    /// A request (`body`) whose reply is one result; `key` names the call in its error.
    fn single<T>(
        &self,
        body: &Enc,
        key: &str,
        value: impl Fn(&mut Dec<'_>) -> Result<T, Malformed>,
    ) -> Result<T, StoreError> {
        self.single_by(kv_loader::deadline_after(self.timeout), body, key, value)
    }

    /// [`single`](Self::single) by `deadline`.
    fn single_by<T>(
        &self,
        deadline: Instant,
        body: &Enc,
        key: &str,
        value: impl Fn(&mut Dec<'_>) -> Result<T, Malformed>,
    ) -> Result<T, StoreError> {
        let r = self.call_by(deadline, |c, deadline| {
            let reply = Self::request(c, &body.0, deadline)?;
            let mut d = Dec::new(&reply);
            let result = d.result(&value)?;
            d.finish()?;
            Ok(result)
        });
        match r {
            Ok(v) => v,
            Err(e) => Err(e.for_key(&self.address, key)),
        }
    }
}

/// How long a client tries to give up a session start whose answer it never got.
const GIVE_UP_TIMEOUT: Duration = Duration::from_secs(2);

impl SocketStore {
    /// Ends the session started with `tag` whose answer never came, or has the server end it
    /// when its start comes later (best effort, within [`GIVE_UP_TIMEOUT`], and as long again
    /// when the connection broke under the first try): else it would keep
    /// its pins for as long as this client lives.
    fn give_up_start(&self, tag: u64) {
        let mut body = Enc::default();
        body.u8(op::END_SESSION_TAG).u64(tag);
        let within = self.timeout.min(GIVE_UP_TIMEOUT);
        let failed = self.idempotent(&body, "", within, within).err();
        match failed {
            None => tracing::debug!(
                address = %self.address,
                tag,
                "served store: a session start without answer given up"
            ),
            Some(e) => tracing::warn!(
                address = %self.address,
                tag,
                error = %e,
                "served store: a session start without answer could not be given up; its \
                 pins may stay while this client lives"
            ),
        }
    }

    /// Sends `body`, a request whose reply carries nothing but its result and which the server
    /// may carry out twice (ending a session or a session start this client holds), within
    /// `first`; when its connection failed (broke under it, as a pooled one the server had
    /// dropped: the request may never have reached the server; or any other `Down`, where the
    /// second try only fails alike), once more within `again`. Else what a
    /// lost request holds (a session's pins) would stay while this client lives.
    fn idempotent(
        &self,
        body: &Enc,
        key: &str,
        first: Duration,
        again: Duration,
    ) -> Result<(), StoreError> {
        let send = |within| {
            self.call_by(kv_loader::deadline_after(within), |c, deadline| {
                let reply = Self::request(c, &body.0, deadline)?;
                let mut d = Dec::new(&reply);
                let result = d.result(|_| Ok(()))?;
                d.finish()?;
                Ok(result)
            })
        };
        let broke = match send(first) {
            Ok(answered) => return answered,
            Err(e @ CallError::Down(_)) => e.for_key(&self.address, key),
            Err(e) => return Err(e.for_key(&self.address, key)),
        };
        tracing::debug!(address = %self.address, error = %broke, "served store: a request failed on its connection; once more");
        match send(again) {
            Ok(answered) => answered,
            Err(e) => Err(e.for_key(&self.address, key)),
        }
    }
}

/// The body of a request about `keys`: the opcode, the count, each key.
fn keys_body(opcode: u8, keys: &[&str]) -> Enc {
    let mut body = Enc::default();
    body.u8(opcode).u32(keys.len() as u32);
    keys.iter().for_each(|k| {
        body.str(k);
    });
    body
}

/// `n` results, each refusing the call for `key`'s `detail` (a call with an invalid
/// argument sends nothing).
fn refuse_all<T>(n: usize, key: &str, detail: &str) -> Vec<Result<T, StoreError>> {
    let e = StoreError::InvalidArgument {
        key: key.to_string(),
        detail: detail.into(),
    };
    (0..n).map(|_| Err(e.clone())).collect()
}

/// A call naming more items than one request may ([`MAX_ITEMS`]; the server would close the
/// connection): refused whole for `first`, nothing sent.
fn too_many(n: usize, first: &str) -> Option<StoreError> {
    (n > MAX_ITEMS).then(|| StoreError::InvalidArgument {
        key: first.to_string(),
        detail: format!("a call of {n} items (at most {MAX_ITEMS} in one request)"),
    })
}

/// `n` results, each `e`.
fn all_err<T>(n: usize, e: StoreError) -> Vec<Result<T, StoreError>> {
    (0..n).map(|_| Err(e.clone())).collect()
}

// SAFETY: a request is written from the caller's memory and its reply read straight into it
// by this call's own socket I/O, on the calling thread, synchronously: nothing touches that
// memory once the call has returned or unwound.
unsafe impl KvStore for SocketStore {
    fn name(&self) -> &str {
        "embedded (served)"
    }

    fn exists(&self, keys: &[&str]) -> Vec<Result<bool, StoreError>> {
        self.per_key(op::EXISTS, keys, |d| Ok(d.u8()? != 0))
    }

    fn object_size(&self, keys: &[&str]) -> Vec<Result<u64, StoreError>> {
        self.per_key(op::OBJECT_SIZE, keys, |d| d.u64())
    }

    unsafe fn get_into(&self, gets: &[ObjectGet<'_>]) -> Vec<Result<u64, StoreError>> {
        if let Some(bad) = gets.iter().find(|g| g.dst.is_null() && g.len > 0) {
            return refuse_all(gets.len(), bad.key, "null destination");
        }
        if let Some(e) = too_many(gets.len(), gets.first().map_or("", |g| g.key)) {
            return all_err(gets.len(), e);
        }
        let mut body = Enc::default();
        body.u8(op::GET_INTO).u32(gets.len() as u32);
        for g in gets {
            body.str(g.key).u64(g.len as u64);
        }
        self.read(&body, gets.iter().map(|g| g.key), |results| {
            let mut dsts = Vec::new();
            for (g, r) in gets.iter().zip(results) {
                if let Ok(len) = r {
                    if *len as usize > g.len {
                        return Err(CallError::Down(
                            format!("{}: {len} bytes for a buffer of {}", g.key, g.len).into(),
                        ));
                    }
                    if *len > 0 {
                        // SAFETY: the caller promised `dst` is valid for writes of `g.len`
                        // bytes (>= len, checked) and touched by nothing else for the call
                        // (trait contract); destinations of one call do not overlap.
                        dsts.push(IoSliceMut::new(unsafe {
                            std::slice::from_raw_parts_mut(g.dst, *len as usize)
                        }));
                    }
                }
            }
            Ok(dsts)
        })
    }

    unsafe fn get_ranges(&self, gets: &[RangedGet<'_>]) -> Vec<Result<u64, StoreError>> {
        if let Some(bad) = gets
            .iter()
            .find(|g| g.ranges.iter().any(|r| r.dst.is_null() && r.len > 0))
        {
            return refuse_all(gets.len(), bad.key, "null destination");
        }
        let most = gets.iter().map(|g| g.ranges.len()).max().unwrap_or(0);
        if let Some(e) = too_many(gets.len().max(most), gets.first().map_or("", |g| g.key)) {
            return all_err(gets.len(), e);
        }
        let mut body = Enc::default();
        body.u8(op::GET_RANGES).u32(gets.len() as u32);
        for g in gets {
            body.str(g.key).u32(g.ranges.len() as u32);
            for r in &g.ranges {
                body.u64(r.offset).u64(r.len as u64);
            }
        }
        self.read(&body, gets.iter().map(|g| g.key), |results| {
            let mut dsts = Vec::new();
            for (g, r) in gets.iter().zip(results) {
                if let Ok(total) = r {
                    let asked = g
                        .ranges
                        .iter()
                        .fold(0u64, |t, r| t.saturating_add(r.len as u64));
                    if *total != asked {
                        return Err(CallError::Down(
                            format!("{}: {total} bytes for ranges of {asked}", g.key).into(),
                        ));
                    }
                    for range in g.ranges.iter().filter(|r| r.len > 0) {
                        // SAFETY: the caller promised every destination range is valid for
                        // writes of its length and touched by nothing else for the call;
                        // destinations of one call do not overlap (trait contract).
                        dsts.push(IoSliceMut::new(unsafe {
                            std::slice::from_raw_parts_mut(range.dst, range.len)
                        }));
                    }
                }
            }
            Ok(dsts)
        })
    }

    unsafe fn put(&self, puts: &[ObjectPut<'_>]) -> Vec<Result<PutOutcome, StoreError>> {
        if let Some(bad) = puts
            .iter()
            .find(|p| p.parts.iter().any(|(ptr, n)| ptr.is_null() && *n > 0))
        {
            return refuse_all(puts.len(), bad.key, "null source");
        }
        if let Some(e) = too_many(puts.len(), puts.first().map_or("", |p| p.key)) {
            return all_err(puts.len(), e);
        }
        let mut body = Enc::default();
        body.u8(op::PUT).u32(puts.len() as u32);
        for p in puts {
            body.str(p.key).u64(p.len());
        }
        let r = self.call(|c, deadline| {
            // As `request` does: a frame the server would refuse is not sent.
            if body.0.len() > MAX_FRAME {
                return Err(CallError::TooLarge(body.0.len()));
            }
            let len = frame_len(&body.0);
            let mut slices = vec![IoSlice::new(&len), IoSlice::new(&body.0)];
            for p in puts {
                for &(ptr, n) in p.parts.iter().filter(|(_, n)| *n > 0) {
                    // SAFETY: the caller promised each part is valid for reads of `n` bytes
                    // and not written during the call (trait contract).
                    slices.push(IoSlice::new(unsafe { std::slice::from_raw_parts(ptr, n) }));
                }
            }
            write_all_vectored(c, &mut slices, deadline)?;
            let reply = read_frame(c, deadline)?;
            let mut d = Dec::new(&reply);
            let results = puts
                .iter()
                .map(|_| d.result(|d| d.outcome()))
                .collect::<Result<Vec<_>, _>>()?;
            d.finish()?;
            Ok(results)
        });
        self.spread(r, puts.iter().map(|p| p.key))
    }

    fn remove(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
        self.per_key(op::REMOVE, keys, |_| Ok(()))
    }

    fn discard(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
        self.per_key(op::DISCARD, keys, |_| Ok(()))
    }

    unsafe fn register(&self, _region: MemoryRegion) -> Result<(), StoreError> {
        Ok(())
    }

    fn unregister(&self, _region: MemoryRegion) -> Result<(), StoreError> {
        Ok(())
    }

    fn start_session(&self, keys: &[&str]) -> Result<ReadSession, StoreError> {
        let key = keys.first().copied().unwrap_or("");
        if let Some(e) = too_many(keys.len(), key) {
            return Err(e);
        }
        // The session's pins last while this client has a connection open: make sure the
        // anchor is one.
        // One deadline for the anchor and the start: the call fails within the request timeout
        // (then at most twice GIVE_UP_TIMEOUT more to give the start up: a second try when the
        // connection broke under the first, see `give_up_start`).
        let deadline = kv_loader::deadline_after(self.timeout);
        self.keep_anchor(deadline)
            .map_err(|e| e.for_key(&self.address, key))?;
        let tag = self.next_session_tag.fetch_add(1, Ordering::Relaxed);
        let mut body = Enc::default();
        body.u8(op::START_SESSION).u64(tag).u32(keys.len() as u32);
        keys.iter().for_each(|k| {
            body.str(k);
        });
        // Whether the request may have gone out: not when no connection opened.
        let mut sent = false;
        let answer = self.call_by(deadline, |c, deadline| {
            sent = true;
            let reply = Self::request(c, &body.0, deadline)?;
            let mut d = Dec::new(&reply);
            let result = d.result(|d| Ok((d.u64()?, d.u64()?)))?;
            d.finish()?;
            Ok(result)
        });
        let (token, lease_ms) = match answer {
            Ok(answered) => answered?,
            Err(e) => {
                if sent && !matches!(e, CallError::TooLarge(_)) {
                    // Sent, and no answer: the session may have started, with a token this
                    // client never learns. (Too large: refused unsent.)
                    self.give_up_start(tag);
                }
                return Err(e.for_key(&self.address, key));
            }
        };
        Ok(ReadSession {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            // The server's store's lease (0: until ended, or the client's connections close).
            lease: (lease_ms > 0).then(|| std::time::Duration::from_millis(lease_ms)),
            token,
        })
    }

    /// Ends the session the server named by its token (only the pins it took go).
    fn end_session(&self, session: &ReadSession) -> Result<(), StoreError> {
        let mut body = Enc::default();
        body.u8(op::END_SESSION).u64(session.token);
        let key = session.keys.first().map(String::as_str).unwrap_or("");
        // Ending is idempotent: the server ends only a session this client still holds.
        let again = self.timeout.min(GIVE_UP_TIMEOUT);
        self.idempotent(&body, key, self.timeout, again)
    }

    fn health(&self) -> Result<(), StoreError> {
        self.single(&health_request(), "", |_| Ok(()))
    }
}

/// The body of a health check.
fn health_request() -> Enc {
    let mut body = Enc::default();
    body.u8(op::HEALTH);
    body
}
