//! The served store's wire format: framed requests and replies (a `u32` length, then the
//! body), bulk bytes right after the frame that announces them, so both sides move them
//! straight between the socket and the store's or the caller's memory.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::store::{PutOutcome, StoreError};

pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"KVST");
/// Version 2: error kind 11 ([`StoreError::Panicked`]); version 3: error kind 12
/// ([`StoreError::Abandoned`]); version 4: a session is named by the token its start answers
/// (its end sends the token, not keys), and `DISCARD`; version 5: a session start carries
/// the client's tag for it, and `END_SESSION_TAG` ends a start whose answer the client never
/// got; version 6: the hello carries the server's key ([`StoreKey`]); version 7: each side
/// proves the key to the other without sending it ([`hello`](super::hello)); version 8: a
/// session start answers the store's lease after the token. A peer of another version is
/// refused at hello.
pub(crate) const PROTOCOL: u32 = 8;
/// The code of a [`StoreError::TransferFailed`] that the served store's own store gave up on
/// (sent as [`StoreError::Abandoned`]).
pub(crate) const ABANDONED_ON_SERVER: i64 = -12;
/// Largest request or reply frame (keys and ranges, not bulk bytes).
pub(crate) const MAX_FRAME: usize = 64 << 20;
/// Most items (keys, gets, puts, ranges of one get) one request may name. An item takes a
/// few bytes on the wire (an empty key: its 4-byte length) and tens in memory where it is
/// handled (the key, its reference, its result), so the frame limit alone let one request of
/// empty keys ask the serving process for gigabytes. A linker's calls name far fewer (a
/// batch's pages times its components).
pub(crate) const MAX_ITEMS: usize = 1 << 20;
/// The call named by a [`StoreError::Panicked`] that came over the wire (its own name stays
/// in the server's log).
const SERVED_CALL: &str = "the serving store's call";

/// Operations.
pub(crate) mod op {
    pub(crate) const EXISTS: u8 = 1;
    pub(crate) const OBJECT_SIZE: u8 = 2;
    pub(crate) const GET_INTO: u8 = 3;
    pub(crate) const GET_RANGES: u8 = 4;
    pub(crate) const PUT: u8 = 5;
    pub(crate) const REMOVE: u8 = 6;
    pub(crate) const START_SESSION: u8 = 7;
    pub(crate) const END_SESSION: u8 = 8;
    pub(crate) const HEALTH: u8 = 9;
    pub(crate) const DISCARD: u8 = 10;
    /// Ends the session the client started with a tag (its start's answer never came), or
    /// marks the tag so that its start, if it comes later, is ended at once.
    pub(crate) const END_SESSION_TAG: u8 = 11;
}

/// The most slices one `sendmsg` takes (Linux's `UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// What separates a served store's address (where to connect) from its key.
const KEY_MARK: &str = "#key=";

/// A served store's key: 16 random bytes the server makes at start and announces in its
/// address (`unix:@name#key=<32 hex digits>`), which a client says at hello. Only a process
/// given the address (through the group's rendezvous) can use the store: an abstract socket's
/// name is listed to every user of the host (`/proc/net/unix`), and a TCP port to anyone who
/// can reach it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct StoreKey(pub(crate) [u8; 16]);

impl StoreKey {
    /// A fresh key from the kernel's random source.
    pub(crate) fn fresh() -> io::Result<StoreKey> {
        // As many random bytes as a hello's nonce, from the same source.
        super::hello::nonce().map(StoreKey)
    }

    /// `address` with this key.
    pub(crate) fn in_address(&self, address: &str) -> String {
        let hex: String = self.0.iter().map(|b| format!("{b:02x}")).collect();
        format!("{address}{KEY_MARK}{hex}")
    }
}

impl std::fmt::Debug for StoreKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreKey(..)")
    }
}

/// A served store's address without its key (whatever follows the key's mark is dropped,
/// well-formed or not): what logs, errors and reports may print.
pub(crate) fn location(address: &str) -> &str {
    address.rsplit_once(KEY_MARK).map_or(address, |(at, _)| at)
}

/// Splits a served store's address into where to connect and its key (`None`: the address
/// names none). A key that is not 32 hex digits is an error (what is wrong with it).
pub(crate) fn split_address(address: &str) -> Result<(&str, Option<StoreKey>), String> {
    let Some((at, hex)) = address.rsplit_once(KEY_MARK) else {
        return Ok((address, None));
    };
    let bytes = hex.as_bytes();
    if bytes.len() != 32 || !bytes.iter().all(u8::is_ascii_hexdigit) {
        return Err(format!(
            "the key in a served store's address is {} characters, not 32 hex digits",
            hex.len()
        ));
    }
    let mut k = [0u8; 16];
    for (i, b) in k.iter_mut().enumerate() {
        // Two ASCII hex digits (checked above).
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
    }
    Ok((at, Some(StoreKey(k))))
}

/// A connected stream socket (Unix on one host, TCP otherwise).
#[derive(Debug)]
pub(crate) enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    pub(crate) fn set_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
            Conn::Unix(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
        }
    }

    /// The socket, for calls std does not offer (flags).
    fn sock(&self) -> socket2::SockRef<'_> {
        match self {
            Conn::Tcp(s) => socket2::SockRef::from(s),
            Conn::Unix(s) => socket2::SockRef::from(s),
        }
    }

    pub(crate) fn shutdown(&self) {
        let _ = match self {
            Conn::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Conn::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }

    /// True when the peer has closed this idle connection, or it has failed; never waits. A
    /// connection at rest between requests has nothing to read, so a byte waiting on it (a
    /// breach of the protocol) counts as closed too: it is out of step.
    pub(crate) fn is_closed(&self) -> bool {
        let sock = self.sock();
        // One peek that does not wait (MSG_DONTWAIT), rather than switching the socket to
        // non-blocking and back: one call, and the mode of a descriptor a clone shares is
        // never changed under it.
        let mut byte = [MaybeUninit::<u8>::uninit()];
        let peeked = sock.recv_with_flags(&mut byte, libc::MSG_PEEK | libc::MSG_DONTWAIT);
        !matches!(&peeked, Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// True when at least `n` bytes wait to be read on this connection; never waits (a peek,
    /// as [`is_closed`](Self::is_closed)'s).
    pub(crate) fn has_waiting(&self, n: usize) -> bool {
        let mut buf = vec![MaybeUninit::<u8>::uninit(); n];
        let flags = libc::MSG_PEEK | libc::MSG_DONTWAIT;
        matches!(self.sock().recv_with_flags(&mut buf, flags), Ok(got) if got >= n)
    }

    pub(crate) fn try_clone(&self) -> io::Result<Conn> {
        Ok(match self {
            Conn::Tcp(s) => Conn::Tcp(s.try_clone()?),
            Conn::Unix(s) => Conn::Unix(s.try_clone()?),
        })
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.read(buf),
            Conn::Unix(s) => s.read(buf),
        }
    }
    fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.read_vectored(bufs),
            Conn::Unix(s) => s.read_vectored(bufs),
        }
    }
}

/// Writes send with `MSG_NOSIGNAL`: a peer that is gone (a rank killed mid-reply, a client
/// that dropped its connection at its deadline) gives `BrokenPipe`, not a `SIGPIPE` that kills
/// a process that did not ignore the signal (std's own writes are plain `write(2)`/`writev(2)`
/// on some toolchains).
impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.sock().send_with_flags(buf, libc::MSG_NOSIGNAL)
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        // `sendmsg` refuses more than IOV_MAX slices (EMSGSIZE) where std's `writev` sends
        // the first IOV_MAX: send those, the caller's loop sends the rest.
        let bufs = &bufs[..bufs.len().min(IOV_MAX)];
        self.sock()
            .send_vectored_with_flags(bufs, libc::MSG_NOSIGNAL)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Re-arms the socket timeout with what is left of `deadline`.
pub(crate) fn arm(c: &Conn, deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
    }
    c.set_timeout(Some(left.max(Duration::from_millis(1))))
}

/// Reads exactly `buf` before `deadline`.
pub(crate) fn read_exact_by(c: &mut Conn, mut buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        arm(c, deadline)?;
        match c.read(buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(timeout_kind(e)),
        }
    }
    Ok(())
}

/// Fills every slice of `bufs`, in order, before `deadline`: bulk bytes straight into their
/// destinations.
pub(crate) fn read_all_vectored(
    c: &mut Conn,
    mut bufs: &mut [IoSliceMut<'_>],
    deadline: Instant,
) -> io::Result<()> {
    IoSliceMut::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        arm(c, deadline)?;
        match c.read_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => IoSliceMut::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(timeout_kind(e)),
        }
    }
    Ok(())
}

/// Sends every slice of `bufs`, in order, before `deadline`.
pub(crate) fn write_all_vectored(
    c: &mut Conn,
    mut bufs: &mut [IoSlice<'_>],
    deadline: Instant,
) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        arm(c, deadline)?;
        match c.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(timeout_kind(e)),
        }
    }
    Ok(())
}

fn timeout_kind(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock {
        io::Error::new(io::ErrorKind::TimedOut, "deadline passed")
    } else {
        e
    }
}

/// Reads one frame body before `deadline`.
pub(crate) fn read_frame(c: &mut Conn, deadline: Instant) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    read_exact_by(c, &mut len, deadline)?;
    read_body(c, u32::from_le_bytes(len) as usize, deadline)
}

/// Reads a frame body of `n` bytes (its length already read).
pub(crate) fn read_body(c: &mut Conn, n: usize, deadline: Instant) -> io::Result<Vec<u8>> {
    if n > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {n} bytes (at most {MAX_FRAME})"),
        ));
    }
    let mut body = vec![0u8; n];
    read_exact_by(c, &mut body, deadline)?;
    Ok(body)
}

/// The frame header (length) of `body`, to send before it.
pub(crate) fn frame_len(body: &[u8]) -> [u8; 4] {
    (body.len() as u32).to_le_bytes()
}

/// Appends fields.
#[derive(Default)]
pub(crate) struct Enc(pub(crate) Vec<u8>);

impl Enc {
    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn str(&mut self, v: &str) -> &mut Self {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v.as_bytes());
        self
    }
    pub(crate) fn error(&mut self, e: &StoreError) -> &mut Self {
        match e {
            StoreError::NotFound { key } => self.u8(1).str(key),
            StoreError::NoSpace { key, detail } => self.u8(2).str(key).str(detail),
            StoreError::TransferFailed { key, code } => self.u8(3).str(key).u64(*code as u64),
            StoreError::Lease { key, detail } => self.u8(4).str(key).str(detail),
            StoreError::RpcTimeout { key } | StoreError::Overdue { key, .. } => self.u8(5).str(key),
            StoreError::InvalidArgument { key, detail } => self.u8(6).str(key).str(detail),
            // Refused before any store saw it; a server passes it on as an invalid argument.
            StoreError::InvalidTarget { key, reason } => self.u8(6).str(key).str(reason),
            StoreError::Unavailable { detail } => self.u8(7).str(detail),
            StoreError::ShortRead { key, expected, got } => {
                self.u8(8).str(key).u64(*expected).u64(*got)
            }
            StoreError::Other { key, code } => self.u8(9).str(key).u64(*code as u64),
            // The call's name does not cross the wire (decoded as the server's call).
            StoreError::Panicked { key, .. } => self.u8(11).str(key),
            StoreError::Abandoned { key, detail, .. } => self.u8(12).str(key).str(detail),
            StoreError::ResultCount { key, expected, got } => {
                self.u8(10).str(key).u64(*expected as u64).u64(*got as u64)
            }
        }
    }
    /// A per-key result: `0` then the value, or `1` then the error.
    pub(crate) fn result<T>(&mut self, r: &Result<T, StoreError>, ok: impl FnOnce(&mut Self, &T)) {
        match r {
            Ok(v) => {
                self.u8(0);
                ok(self, v);
            }
            Err(e) => {
                self.u8(1).error(e);
            }
        }
    }
}

/// A message that does not decode.
#[derive(Debug)]
pub(crate) struct Malformed(pub(crate) String);

impl From<Malformed> for io::Error {
    fn from(m: Malformed) -> Self {
        io::Error::new(io::ErrorKind::InvalidData, m.0)
    }
}

/// Reads fields, bounds-checked.
pub(crate) struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Dec<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Dec { buf, pos: 0 }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                Malformed(format!(
                    "message ends at {} of {} + {n}",
                    self.buf.len(),
                    self.pos
                ))
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.take(1)?[0])
    }
    /// A count of items that each take at least `item_bytes` of what follows: refused past
    /// [`MAX_ITEMS`], and when the message cannot hold that many (so a count from the wire
    /// sizes an allocation of at most the message's length times an item's size in memory
    /// over `item_bytes`: a put's items, 32 bytes each for at least 12 on the wire, about 2.7
    /// times the message; a ranged read's, its 16-byte ranges then a 32-byte piece and a
    /// 16-byte reply slice each, about 4 times: 256 MiB for a 64 MiB request of ranges, one
    /// request at a time per connection of a client that proved its key).
    pub(crate) fn count(&mut self, item_bytes: usize) -> Result<usize, Malformed> {
        let n = self.u32()? as usize;
        if n > MAX_ITEMS {
            return Err(Malformed(format!("{n} items (at most {MAX_ITEMS})")));
        }
        let left = self.buf.len() - self.pos;
        if n.saturating_mul(item_bytes.max(1)) > left {
            return Err(Malformed(format!(
                "{n} items of at least {item_bytes} bytes in the {left} bytes left"
            )));
        }
        Ok(n)
    }
    /// Checks that the whole message was read (a longer one, say more results than asked
    /// for, is refused rather than cut short).
    pub(crate) fn finish(&self) -> Result<(), Malformed> {
        match self.buf.len() - self.pos {
            0 => Ok(()),
            extra => Err(Malformed(format!(
                "{extra} bytes past the end of the message"
            ))),
        }
    }
    pub(crate) fn u32(&mut self) -> Result<u32, Malformed> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, Malformed> {
        let mut w = [0u8; 8];
        w.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(w))
    }
    pub(crate) fn str(&mut self) -> Result<String, Malformed> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| Malformed("a key that is not UTF-8".into()))
    }
    pub(crate) fn error(&mut self) -> Result<StoreError, Malformed> {
        Ok(match self.u8()? {
            1 => StoreError::NotFound { key: self.str()? },
            2 => StoreError::NoSpace {
                key: self.str()?,
                detail: self.str()?,
            },
            3 => StoreError::TransferFailed {
                key: self.str()?,
                code: self.u64()? as i64,
            },
            4 => StoreError::Lease {
                key: self.str()?,
                detail: self.str()?,
            },
            5 => StoreError::RpcTimeout { key: self.str()? },
            6 => StoreError::InvalidArgument {
                key: self.str()?,
                detail: self.str()?,
            },
            7 => StoreError::Unavailable {
                detail: self.str()?.into(),
            },
            8 => StoreError::ShortRead {
                key: self.str()?,
                expected: self.u64()?,
                got: self.u64()?,
            },
            9 => StoreError::Other {
                key: self.str()?,
                code: self.u64()? as i64,
            },
            10 => StoreError::ResultCount {
                key: self.str()?,
                expected: self.u64()? as usize,
                got: self.u64()? as usize,
            },
            11 => StoreError::Panicked {
                key: self.str()?,
                call: SERVED_CALL,
            },
            // The server's store gave up on a transfer that may still run there: on this side
            // the call is over (the client writes its destinations itself, from the reply), so
            // no memory of the caller's needs keeping, as `Abandoned` would tell it.
            12 => {
                let key = self.str()?;
                let detail = self.str()?;
                tracing::warn!(key, detail, "the served store's call gave up on a transfer");
                StoreError::TransferFailed {
                    key,
                    code: ABANDONED_ON_SERVER,
                }
            }
            t => return Err(Malformed(format!("error kind {t}"))),
        })
    }
    /// A per-key result written by [`Enc::result`].
    pub(crate) fn result<T>(
        &mut self,
        ok: impl FnOnce(&mut Self) -> Result<T, Malformed>,
    ) -> Result<Result<T, StoreError>, Malformed> {
        match self.u8()? {
            0 => Ok(Ok(ok(self)?)),
            1 => Ok(Err(self.error()?)),
            t => Err(Malformed(format!("result tag {t}"))),
        }
    }
    pub(crate) fn outcome(&mut self) -> Result<PutOutcome, Malformed> {
        match self.u8()? {
            0 => Ok(PutOutcome::Written),
            1 => Ok(PutOutcome::AlreadyPresent),
            t => Err(Malformed(format!("put outcome {t}"))),
        }
    }
}

pub(crate) fn outcome_code(o: PutOutcome) -> u8 {
    match o {
        PutOutcome::Written => 0,
        PutOutcome::AlreadyPresent => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_splits_into_where_to_connect_and_its_key() {
        let key = StoreKey([0xa5; 16]);
        let address = key.in_address("tcp:10.0.0.1:7000");
        assert_eq!(
            address,
            format!("tcp:10.0.0.1:7000#key={}", "a5".repeat(16))
        );
        let (at, got) = split_address(&address).unwrap();
        assert_eq!((at, got), ("tcp:10.0.0.1:7000", Some(key)));
        assert_eq!(split_address("unix:@x").unwrap(), ("unix:@x", None));
        assert_eq!(location(&address), "tcp:10.0.0.1:7000");
        assert_eq!(location("unix:@x#key=zz"), "unix:@x");
        assert_eq!(location("unix:@x"), "unix:@x");
        for bad in [
            "unix:@x#key=",
            "unix:@x#key=zz",
            &format!("unix:@x#key={}", "g".repeat(32)),
        ] {
            assert!(split_address(bad).is_err(), "{bad}");
        }
        assert_eq!(key, StoreKey([0xa5; 16]));
        assert_ne!(StoreKey::fresh().unwrap(), StoreKey::fresh().unwrap());
        assert_eq!(format!("{key:?}"), "StoreKey(..)");
    }

    /// A write of more slices than one `sendmsg` takes sends them all, in order (a ranged
    /// reply carries one slice per range).
    #[test]
    fn a_write_of_more_slices_than_one_sendmsg_takes_sends_them_all() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let data: Vec<[u8; 3]> = (0..3000u32).map(|i| [i as u8, (i >> 8) as u8, 7]).collect();
        let want: Vec<u8> = data.iter().flatten().copied().collect();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            b.read_to_end(&mut got).unwrap();
            got
        });
        let mut c = Conn::Unix(a);
        let mut bufs: Vec<IoSlice<'_>> = data.iter().map(|d| IoSlice::new(d)).collect();
        let deadline = kv_loader::deadline_after(Duration::from_secs(5));
        write_all_vectored(&mut c, &mut bufs, deadline).unwrap();
        drop(c);
        assert_eq!(reader.join().unwrap(), want);
    }

    /// Blocks SIGPIPE on this thread, runs `f`, and says whether a SIGPIPE came (taking it).
    fn sigpipe_during(f: impl FnOnce()) -> bool {
        // SAFETY: plain libc signal-set calls on local, initialised sets; the mask is this
        // thread's own, and the one pending signal taken is the SIGPIPE asked about.
        unsafe {
            let mut only: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut only);
            libc::sigaddset(&mut only, libc::SIGPIPE);
            libc::pthread_sigmask(libc::SIG_BLOCK, &only, std::ptr::null_mut());
            f();
            let mut pending: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut pending);
            libc::sigpending(&mut pending);
            let came = libc::sigismember(&pending, libc::SIGPIPE) == 1;
            if came {
                let zero = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                libc::sigtimedwait(&only, std::ptr::null_mut(), &zero);
            }
            came
        }
    }

    /// A write to a peer that is gone (a rank killed mid-reply) is `BrokenPipe`, without the
    /// SIGPIPE that kills a process which did not ignore it; over both socket kinds.
    #[test]
    fn a_write_to_a_peer_that_is_gone_raises_no_sigpipe() {
        std::thread::spawn(|| {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let tcp = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            drop(listener.accept().unwrap());
            drop(listener);
            let unix = {
                let (a, b) = UnixStream::pair().unwrap();
                drop(b);
                a
            };
            for mut c in [Conn::Unix(unix), Conn::Tcp(tcp)] {
                let deadline = kv_loader::deadline_after(Duration::from_secs(5));
                let block = vec![7u8; 1 << 20];
                let mut err = None;
                let came = sigpipe_during(|| {
                    // A TCP peer's close is seen after a write or two (its reset).
                    for _ in 0..50 {
                        let mut bufs = [IoSlice::new(&block)];
                        if let Err(e) = write_all_vectored(&mut c, &mut bufs, deadline) {
                            err = Some(e);
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                });
                let e = err.expect("writes to a closed peer kept succeeding");
                assert!(
                    matches!(
                        e.kind(),
                        io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
                    ),
                    "{e}"
                );
                assert!(!came, "a write raised SIGPIPE");
            }
            // The check itself sees the signal a plain `write(2)` raises.
            let (a, b) = UnixStream::pair().unwrap();
            drop(b);
            let came = sigpipe_during(|| {
                use std::os::fd::AsRawFd;
                // SAFETY: writes 5 bytes from a live array to an open socket.
                let n = unsafe { libc::write(a.as_raw_fd(), b"hello".as_ptr().cast(), 5) };
                assert_eq!(n, -1);
            });
            assert!(came, "a plain write raises SIGPIPE");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_connection_is_closed_when_its_peer_closed_it_or_it_is_out_of_step() {
        use std::io::Write;
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let ours = Conn::Unix(ours);
        assert!(!ours.is_closed(), "idle and open");
        theirs.write_all(&[1]).unwrap();
        assert!(
            ours.is_closed(),
            "a byte waiting between requests: out of step"
        );
        // The peek took nothing, and the socket still blocks (a read waits for its timeout).
        let Conn::Unix(mut s) = ours else {
            unreachable!()
        };
        let mut b = [0u8; 2];
        assert_eq!(s.read(&mut b).unwrap(), 1);
        s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let t0 = Instant::now();
        assert!(s.read(&mut b).is_err(), "nothing more to read");
        assert!(t0.elapsed() >= Duration::from_millis(15));
        let ours = Conn::Unix(s);
        assert!(!ours.is_closed(), "idle again");
        drop(theirs);
        assert!(ours.is_closed(), "the peer closed it");
    }

    /// What the server's greeting bound looks at before it closes a waiting connection: the
    /// whole hello in the socket, taking nothing from it.
    #[test]
    fn a_whole_hello_waiting_is_seen_without_being_taken() {
        use std::io::Write;
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let ours = Conn::Unix(ours);
        assert!(!ours.has_waiting(32), "nothing yet");
        theirs.write_all(&[7; 31]).unwrap();
        assert!(!ours.has_waiting(32), "one byte short");
        theirs.write_all(&[7]).unwrap();
        assert!(ours.has_waiting(32));
        assert!(ours.has_waiting(32), "the peek took nothing");
        let Conn::Unix(mut s) = ours else {
            unreachable!()
        };
        let mut b = [0u8; 32];
        s.read_exact(&mut b).unwrap();
        assert_eq!(b, [7; 32]);
    }

    #[test]
    fn every_store_error_round_trips() {
        let errors = [
            StoreError::NotFound { key: "k".into() },
            StoreError::NoSpace {
                key: "k".into(),
                detail: "d".into(),
            },
            StoreError::TransferFailed {
                key: "k".into(),
                code: -7,
            },
            StoreError::Lease {
                key: "k".into(),
                detail: "d".into(),
            },
            StoreError::RpcTimeout { key: "k".into() },
            StoreError::InvalidArgument {
                key: "k".into(),
                detail: "d".into(),
            },
            StoreError::Unavailable { detail: "d".into() },
            StoreError::ShortRead {
                key: "k".into(),
                expected: 9,
                got: 3,
            },
            StoreError::Other {
                key: "k".into(),
                code: 5,
            },
            StoreError::Panicked {
                key: "k".into(),
                call: SERVED_CALL,
            },
            StoreError::Abandoned {
                key: "k".into(),
                call: SERVED_CALL,
                detail: "d".into(),
            },
        ];
        for e in errors {
            let mut enc = Enc::default();
            enc.result::<u64>(&Err(e.clone()), |_, _| {});
            let back = Dec::new(&enc.0).result(|d| d.u64()).unwrap();
            let want = match e {
                // Over on the client: no memory to keep.
                StoreError::Abandoned { key, .. } => StoreError::TransferFailed {
                    key,
                    code: ABANDONED_ON_SERVER,
                },
                e => e,
            };
            assert_eq!(back, Err(want));
        }
        let mut enc = Enc::default();
        enc.result(&Ok(42u64), |e, v| {
            e.u64(*v);
        });
        assert_eq!(Dec::new(&enc.0).result(|d| d.u64()).unwrap(), Ok(42));
        assert!(Dec::new(&enc.0[..3]).result(|d| d.u64()).is_err());
    }

    #[test]
    fn a_count_the_message_cannot_hold_is_refused_and_trailing_bytes_are_seen() {
        let mut enc = Enc::default();
        enc.u32(3).u64(1).u64(2).u64(3);
        assert_eq!(Dec::new(&enc.0).count(8).unwrap(), 3);
        assert!(Dec::new(&enc.0).count(9).is_err(), "3 × 9 > 24 bytes left");
        let mut huge = Enc::default();
        huge.u32(u32::MAX);
        assert!(Dec::new(&huge.0).count(16).is_err());
        let mut d = Dec::new(&enc.0);
        d.u32().unwrap();
        d.u64().unwrap();
        assert!(d.finish().is_err(), "16 bytes left");
        d.u64().unwrap();
        d.u64().unwrap();
        assert!(d.finish().is_ok());
    }
}
