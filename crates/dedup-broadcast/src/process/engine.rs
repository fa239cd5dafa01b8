//! The transfer engine of the socket collective: runs one operation's byte streams to their
//! ends, all at once, from one thread, with `poll(2)` and non-blocking vectored I/O.
//!
//! An operation is a set of **inbound** streams (bytes a peer sends this rank) and
//! **outbound** streams (bytes this rank sends a peer), at most one of each per peer. Every
//! stream starts with a fixed-size header (the operation's description, checked on arrival)
//! followed by its body: a list of spans of the caller's rows. Bytes go from the socket
//! straight into the rows (`readv`) and from the rows straight into the socket (`sendmsg`):
//! no staging copy.
//!
//! An outbound stream may be **gated** on an inbound one: it may send its first `head` body
//! bytes at once and each further byte only once the inbound stream has received the
//! matching body byte. That is how a rank relays what it receives (the chain broadcast and
//! the ring all-gather) while it is still arriving, pipelined at the socket's own pace.
//!
//! Failure rules: the run ends with an error when the deadline passes, when a peer whose
//! stream is unfinished hangs up (end-of-stream, reset), or when a header does not match.
//! A hang-up of a peer that this operation does not need (not a participant, or whose
//! streams are complete) is only remembered in `hung`: it is not an error by itself, since a
//! peer that finished the group's last operation may exit before this rank has read what it
//! sent. Whatever that peer's absence breaks shows up as an unfinished stream.

use std::io;
use std::time::Instant;

use super::link::{Link, Span, MAX_IOV};
use crate::CollectiveError;

/// Bytes of the header that starts every stream.
pub(crate) const HEADER: usize = 40;

/// Most bytes one inbound stream reads per turn of the loop before the loop sends again.
/// A rank that relays (the chain broadcast, the ring all-gather) forwards what it received
/// only between reads: reading on while the sender keeps the socket full (4 MiB buffers)
/// would make each hop wait for megabytes, and a chain of seven hops seven times that.
pub(crate) const READ_TURN: usize = 256 << 10;

/// Position in a list of spans.
#[derive(Debug, Clone, Copy, Default)]
struct Cursor {
    span: usize,
    offset: usize,
}

/// Bytes a peer sends this rank: the header, then `body`.
pub(crate) struct Inbound {
    pub(crate) peer: u32,
    pub(crate) header: [u8; HEADER],
    pub(crate) body: Vec<Span>,
    done: usize,
    cursor: Cursor,
    checked: bool,
}

/// Bytes this rank sends a peer: `header`, then `body`, optionally gated.
pub(crate) struct Outbound {
    pub(crate) peer: u32,
    pub(crate) header: [u8; HEADER],
    pub(crate) body: Vec<Span>,
    pub(crate) gate: Option<Gate>,
    done: usize,
    cursor: Cursor,
    blocked: bool,
}

/// Body bytes of an outbound stream past `head` may be sent only once inbound stream
/// `inbound` (an index into the run's inbound list) has received the matching body bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gate {
    pub(crate) inbound: usize,
    pub(crate) head: usize,
}

impl Inbound {
    pub(crate) fn new(peer: u32, body: Vec<Span>) -> Self {
        Inbound {
            peer,
            header: [0; HEADER],
            body,
            done: 0,
            cursor: Cursor::default(),
            checked: false,
        }
    }
    fn total(&self) -> usize {
        HEADER + body_len(&self.body)
    }
    fn finished(&self) -> bool {
        self.done >= self.total()
    }
    fn body_done(&self) -> usize {
        self.done.saturating_sub(HEADER)
    }
}

impl Outbound {
    pub(crate) fn new(
        peer: u32,
        header: [u8; HEADER],
        body: Vec<Span>,
        gate: Option<Gate>,
    ) -> Self {
        Outbound {
            peer,
            header,
            body,
            gate,
            done: 0,
            cursor: Cursor::default(),
            blocked: false,
        }
    }
    fn total(&self) -> usize {
        HEADER + body_len(&self.body)
    }
    fn finished(&self) -> bool {
        self.done >= self.total()
    }
}

fn body_len(spans: &[Span]) -> usize {
    spans.iter().map(|s| s.len).sum()
}

/// Why a run ended early.
#[derive(Debug)]
pub(crate) enum Failure {
    /// These peers hung up while this rank still had bytes to move with them.
    Gone(Vec<u32>),
    /// The deadline passed; these peers' headers had not arrived (empty: every peer had
    /// started, some stream stalled further along).
    Timeout(Vec<u32>),
    /// A peer's header does not match this rank's operation.
    Refused(CollectiveError),
    /// A socket error other than a hang-up.
    Io { peer: u32, error: io::Error },
    /// The wait on every socket (`poll`) failed: this rank's own failure, no peer's.
    Wait(io::Error),
}

/// The header span (its [`HEADER`] bytes at `header`) followed by the body spans, from
/// `cursor`, at most `limit` bytes and [`MAX_IOV`] spans. An inbound stream passes its header
/// array's address taken from a `&mut` (the read writes it), an outbound one from a `&`.
fn pending(header: usize, body: &[Span], cursor: Cursor, limit: usize) -> Vec<Span> {
    let head = Span {
        addr: header,
        len: HEADER,
    };
    let all = std::iter::once(&head).chain(body.iter());
    let mut out = Vec::new();
    let mut left = limit;
    for (i, s) in all.enumerate().skip(cursor.span) {
        if left == 0 || out.len() == MAX_IOV {
            break;
        }
        let skip = if i == cursor.span { cursor.offset } else { 0 };
        let len = (s.len - skip).min(left);
        if len > 0 {
            out.push(Span {
                addr: s.addr + skip,
                len,
            });
            left -= len;
        }
    }
    out
}

/// Moves `cursor` forward by `n` bytes over the header span then `body`.
fn advance(cursor: &mut Cursor, body: &[Span], mut n: usize) {
    while n > 0 {
        let len = if cursor.span == 0 {
            HEADER
        } else {
            body[cursor.span - 1].len
        };
        let step = (len - cursor.offset).min(n);
        cursor.offset += step;
        n -= step;
        if cursor.offset == len {
            cursor.span += 1;
            cursor.offset = 0;
        }
    }
    // Skip empty spans so the cursor always points at a byte still to move.
    while cursor.span > 0 && cursor.span <= body.len() && body[cursor.span - 1].len == 0 {
        cursor.span += 1;
    }
}

fn is_hangup(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::NotConnected
            | io::ErrorKind::UnexpectedEof
    )
}

/// Header check: called once per inbound stream with the peer and its header.
pub(crate) type HeaderCheck<'c> = dyn FnMut(u32, &[u8; HEADER]) -> Result<(), CollectiveError> + 'c;

/// One operation in flight.
pub(crate) struct Run<'a> {
    pub(crate) links: &'a [Option<Link>],
    /// Peers known to have hung up (kept by the handle across operations).
    pub(crate) hung: &'a mut [bool],
    pub(crate) inbound: Vec<Inbound>,
    pub(crate) outbound: Vec<Outbound>,
}

/// Each peer's stream in a run, by peer rank: the index of its inbound stream in the run's
/// inbound list, and of its outbound stream in the outbound list (`None`: no such stream).
struct ByPeer {
    in_of: Vec<Option<usize>>,
    out_of: Vec<Option<usize>>,
}

impl Run<'_> {
    /// Runs every stream to its end, or fails (see the module docs).
    ///
    /// # Safety
    /// Every inbound body span is valid for writes and every outbound body span valid for
    /// reads for the whole call, and nothing else touches them; inbound spans do not overlap
    /// one another nor any outbound span, except that a gated outbound stream may send
    /// bytes of its gate's inbound spans (it sends them only after they have arrived).
    pub(crate) unsafe fn run(
        &mut self,
        deadline: Instant,
        check: &mut HeaderCheck<'_>,
    ) -> Result<(), Failure> {
        let by_peer = self.streams_by_peer();
        loop {
            // SAFETY: forwarded from this function's contract.
            unsafe { self.send_what_is_ready()? };
            if self.all_finished() {
                return Ok(());
            }
            let gone = self.gone_with_bytes_to_send();
            if !gone.is_empty() {
                return Err(Failure::Gone(gone));
            }
            let (mut fds, peers) = self.poll_set(&by_peer);
            if !self.wait(&mut fds, deadline)? {
                continue;
            }
            // SAFETY: forwarded from this function's contract.
            unsafe { self.take_events(&fds, &peers, &by_peer, check)? };
        }
    }

    /// Each peer's inbound and outbound stream, indexed by peer rank.
    fn streams_by_peer(&self) -> ByPeer {
        let n = self.links.len();
        let mut in_of = vec![None; n];
        let mut out_of = vec![None; n];
        for (i, s) in self.inbound.iter().enumerate() {
            in_of[s.peer as usize] = Some(i);
        }
        for (i, s) in self.outbound.iter().enumerate() {
            out_of[s.peer as usize] = Some(i);
        }
        ByPeer { in_of, out_of }
    }

    /// True when every stream, inbound and outbound, has reached its end.
    fn all_finished(&self) -> bool {
        self.inbound.iter().all(Inbound::finished) && self.outbound.iter().all(Outbound::finished)
    }

    /// Peers known to have hung up while an outbound stream to them is unfinished.
    fn gone_with_bytes_to_send(&self) -> Vec<u32> {
        self.outbound
            .iter()
            .filter(|o| !o.finished() && self.hung[o.peer as usize])
            .map(|o| o.peer)
            .collect()
    }

    /// What to wait for on each peer's link: its pollfds, and the peer of each.
    fn poll_set(&self, by_peer: &ByPeer) -> (Vec<libc::pollfd>, Vec<usize>) {
        let n = self.links.len();
        let mut fds = Vec::with_capacity(n);
        let mut peers = Vec::with_capacity(n);
        for (peer, link) in self.links.iter().enumerate() {
            let Some(link) = link else { continue };
            let mut events: libc::c_short = 0;
            if by_peer.in_of[peer].is_some_and(|i| !self.inbound[i].finished()) {
                events |= libc::POLLIN;
            }
            if by_peer.out_of[peer].is_some_and(|i| self.outbound[i].blocked) {
                events |= libc::POLLOUT;
            }
            if !self.hung[peer] {
                events |= libc::POLLRDHUP;
            } else if events == 0 {
                continue;
            }
            fds.push(libc::pollfd {
                fd: link.fd(),
                events,
                revents: 0,
            });
            peers.push(peer);
        }
        (fds, peers)
    }

    /// Waits on `fds` until one is ready: `Ok(true)` then, `Ok(false)` when a signal
    /// interrupted the wait (the caller goes round again), a timeout once `deadline` is past.
    fn wait(&self, fds: &mut [libc::pollfd], deadline: Instant) -> Result<bool, Failure> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Failure::Timeout(self.not_arrived()));
        }
        let ms = left.as_millis().saturating_add(1).min(i32::MAX as u128) as libc::c_int;
        // SAFETY: `fds` is a live, correctly sized array of pollfd for the call.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(Failure::Wait(e));
        }
        Ok(true)
    }

    /// Acts on what `poll` reported for each peer (`fds[k]` is `peers[k]`'s): reads a
    /// readable inbound stream, marks a peer that hung up, and unblocks an outbound stream
    /// whose socket has room.
    ///
    /// # Safety
    /// As for [`run`](Self::run).
    unsafe fn take_events(
        &mut self,
        fds: &[libc::pollfd],
        peers: &[usize],
        by_peer: &ByPeer,
        check: &mut HeaderCheck<'_>,
    ) -> Result<(), Failure> {
        for (pfd, &peer) in fds.iter().zip(peers) {
            let ev = pfd.revents;
            if ev == 0 {
                continue;
            }
            let hangup = ev & (libc::POLLHUP | libc::POLLERR | libc::POLLRDHUP) != 0;
            if let Some(i) = by_peer.in_of[peer] {
                if ev & (libc::POLLIN | libc::POLLHUP | libc::POLLERR | libc::POLLRDHUP) != 0
                    && !self.inbound[i].finished()
                {
                    // SAFETY: forwarded from this function's contract.
                    unsafe { self.read(i, check)? };
                }
            }
            if hangup {
                self.hung[peer] = true;
            }
            if ev & libc::POLLOUT != 0 {
                if let Some(i) = by_peer.out_of[peer] {
                    self.outbound[i].blocked = false;
                }
            }
        }
        Ok(())
    }

    /// Peers whose header has not arrived, for a timeout's report.
    fn not_arrived(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .inbound
            .iter()
            .filter(|s| s.done < HEADER)
            .map(|s| s.peer)
            .collect();
        v.sort_unstable();
        v
    }

    /// Reads what inbound stream `i`'s socket holds, up to the stream's end and
    /// [`READ_TURN`] bytes (the socket stays readable: the next turn reads on).
    ///
    /// # Safety
    /// As for [`run`](Self::run).
    unsafe fn read(&mut self, i: usize, check: &mut HeaderCheck<'_>) -> Result<(), Failure> {
        let s = &mut self.inbound[i];
        let Some(link) = self.links[s.peer as usize].as_ref() else {
            return Err(Failure::Gone(vec![s.peer]));
        };
        let mut turn = READ_TURN;
        while !s.finished() && turn > 0 {
            let header = std::ptr::addr_of_mut!(s.header) as usize;
            // The header alone until it is checked: a body byte of an operation this rank did
            // not issue (another sequence number, size or kind) never reaches its rows.
            let want = if s.checked {
                (s.total() - s.done).min(turn)
            } else {
                HEADER.saturating_sub(s.done).max(1)
            };
            let spans = pending(header, &s.body, s.cursor, want);
            // SAFETY: the header is this stream's own array; body spans are valid for writes
            // and untouched by others (this function's contract); `pending` never goes past
            // the stream's end, so no byte of the next operation is consumed.
            match unsafe { link.read_into(&spans) } {
                Ok(0) => {
                    self.hung[s.peer as usize] = true;
                    return Err(Failure::Gone(vec![s.peer]));
                }
                Ok(got) => {
                    s.done += got;
                    turn = turn.saturating_sub(got);
                    advance(&mut s.cursor, &s.body, got);
                    if !s.checked && s.done >= HEADER {
                        s.checked = true;
                        check(s.peer, &s.header).map_err(Failure::Refused)?;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(link_failure(self.hung, s.peer, e)),
            }
        }
        Ok(())
    }

    /// How many more bytes outbound stream `i` may send now.
    fn sendable(&self, i: usize) -> usize {
        let o = &self.outbound[i];
        let body = body_len(&o.body);
        let body_limit = match o.gate {
            None => body,
            Some(g) => body.min(g.head + self.inbound[g.inbound].body_done()),
        };
        (HEADER + body_limit).saturating_sub(o.done)
    }

    /// Sends on every outbound stream that has bytes it may send and a socket that is not
    /// known to be full.
    ///
    /// # Safety
    /// As for [`run`](Self::run).
    unsafe fn send_what_is_ready(&mut self) -> Result<(), Failure> {
        for i in 0..self.outbound.len() {
            loop {
                let can = self.sendable(i);
                let o = &mut self.outbound[i];
                if can == 0 || o.blocked || o.finished() {
                    break;
                }
                let Some(link) = self.links[o.peer as usize].as_ref() else {
                    return Err(Failure::Gone(vec![o.peer]));
                };
                let spans = pending(o.header.as_ptr() as usize, &o.body, o.cursor, can);
                // SAFETY: the header is this stream's own array; body spans are valid for
                // reads and not written (contract); a gated stream's spans past its head are
                // bytes its inbound stream has already received.
                match unsafe { link.send_from(&spans) } {
                    Ok(sent) => {
                        o.done += sent;
                        advance(&mut o.cursor, &o.body, sent);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => o.blocked = true,
                    Err(e) => return Err(link_failure(self.hung, o.peer, e)),
                }
            }
        }
        Ok(())
    }
}

/// What an I/O error (not `WouldBlock`) on `peer`'s link means: a hang-up is the peer gone
/// (marked in `hung`, its link not used again), anything else an I/O failure.
fn link_failure(hung: &mut [bool], peer: u32, error: io::Error) -> Failure {
    if is_hangup(&error) {
        hung[peer as usize] = true;
        Failure::Gone(vec![peer])
    } else {
        Failure::Io { peer, error }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    fn span(v: &[u8]) -> Span {
        Span {
            addr: v.as_ptr() as usize,
            len: v.len(),
        }
    }

    #[test]
    fn cursor_walks_header_then_body_skipping_empty_spans() {
        let a = vec![0u8; 3];
        let b: Vec<u8> = Vec::new();
        let c = vec![0u8; 2];
        let body = vec![span(&a), span(&b), span(&c)];
        let header = [0u8; HEADER];
        let mut cur = Cursor::default();
        let p = pending(header.as_ptr() as usize, &body, cur, usize::MAX);
        assert_eq!(
            p.iter().map(|s| s.len).collect::<Vec<_>>(),
            vec![HEADER, 3, 2]
        );
        advance(&mut cur, &body, HEADER + 2);
        let p = pending(header.as_ptr() as usize, &body, cur, 2);
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].addr, p[0].len), (a.as_ptr() as usize + 2, 1));
        assert_eq!(p[1].len, 1);
        advance(&mut cur, &body, 1);
        assert_eq!(cur.span, 3, "the empty span is skipped");
    }

    /// One turn reads at most READ_TURN bytes even when the socket holds more, so that a
    /// relaying rank gets back to sending; the next turns read the rest.
    #[test]
    fn a_read_turn_stops_at_its_share_and_the_next_turns_read_on() {
        let len = READ_TURN * 2;
        let (sender, receiver) = link_pair();
        let src: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        let hdr = [3u8; HEADER];
        // Fill the socket with more than one turn's bytes before reading.
        let mut sent = 0;
        let want = HEADER + READ_TURN + 1;
        let limit = std::time::Instant::now() + Duration::from_secs(10);
        while sent < want && std::time::Instant::now() < limit {
            let spans = pending(
                hdr.as_ptr() as usize,
                &[span(&src)],
                advanced(&[span(&src)], sent),
                want - sent,
            );
            // SAFETY: `hdr` and `src` are live and only read.
            match unsafe { sender.send_from(&spans) } {
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(sent, want, "the socket took more than one turn's bytes");
        let links = vec![None, Some(receiver)];
        let mut rows = vec![0u8; len];
        let mut hung = vec![false; 2];
        let mut run = receiving_run(&links, &mut hung, &mut rows);
        let mut check = |_: u32, _: &[u8; HEADER]| Ok(());
        // SAFETY: `rows` is this thread's own and outlives the run.
        unsafe { run.read(0, &mut check) }.unwrap();
        assert_eq!(
            run.inbound[0].done, READ_TURN,
            "one turn's share, header included"
        );
        // SAFETY: as above.
        unsafe { run.read(0, &mut check) }.unwrap();
        assert_eq!(
            run.inbound[0].done, want,
            "the next turn reads what is left"
        );
        assert_eq!(&rows[..want - HEADER], &src[..want - HEADER]);
    }

    #[test]
    fn a_refused_header_lands_no_body_byte_in_the_rows() {
        let (sender, receiver) = link_pair();
        // A peer's operation this rank did not issue: its header, then its body, all sent.
        let src = vec![0xabu8; 4096];
        let hdr = [9u8; HEADER];
        let spans = pending(
            hdr.as_ptr() as usize,
            &[span(&src)],
            Cursor::default(),
            usize::MAX,
        );
        // SAFETY: `hdr` and `src` are live and only read.
        let sent = unsafe { sender.send_from(&spans) }.unwrap();
        assert_eq!(sent, HEADER + src.len());
        let links = vec![None, Some(receiver)];
        let mut rows = vec![0u8; src.len()];
        let mut hung = vec![false; 2];
        let mut run = receiving_run(&links, &mut hung, &mut rows);
        let mut check =
            |_: u32, _: &[u8; HEADER]| Err(CollectiveError::Backend("another operation".into()));
        // SAFETY: `rows` is this thread's own and outlives the run.
        let r = unsafe { run.read(0, &mut check) };
        assert!(matches!(r, Err(Failure::Refused(_))));
        assert!(
            rows.iter().all(|b| *b == 0),
            "a body byte landed before the check"
        );
    }

    /// A run of rank 0 receiving one stream from rank 1 (`links[1]`) into `rows`.
    fn receiving_run<'a>(
        links: &'a [Option<Link>],
        hung: &'a mut [bool],
        rows: &mut [u8],
    ) -> Run<'a> {
        let body = vec![Span {
            addr: rows.as_mut_ptr() as usize,
            len: rows.len(),
        }];
        Run {
            links,
            hung,
            inbound: vec![Inbound::new(1, body)],
            outbound: vec![],
        }
    }

    /// Two ends of a socket pair, prepared as the engine's links.
    fn link_pair() -> (Link, Link) {
        let (tx, rx) = UnixStream::pair().unwrap();
        let (a, b) = (Link::Unix(tx), Link::Unix(rx));
        a.prepare().unwrap();
        b.prepare().unwrap();
        (a, b)
    }

    /// A cursor `n` bytes into the header and then `body`.
    fn advanced(body: &[Span], n: usize) -> Cursor {
        let mut c = Cursor::default();
        advance(&mut c, body, n);
        c
    }

    /// A three-rank chain over socket pairs, in threads: rank 0 sends, rank 1 relays while
    /// receiving, rank 2 receives. Large enough to need many socket-buffer rounds.
    #[test]
    fn a_gated_relay_pipelines_bytes_through_a_middle_rank() {
        let len = 3 << 20;
        let (a01, a10) = UnixStream::pair().unwrap();
        let (a12, a21) = UnixStream::pair().unwrap();
        let link = |s: UnixStream| {
            let l = Link::Unix(s);
            l.prepare().unwrap();
            Some(l)
        };
        let links0 = vec![None, link(a01), None];
        let links1 = vec![link(a10), None, link(a12)];
        let links2 = vec![None, link(a21), None];
        let src: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let deadline = kv_loader::deadline_after(Duration::from_secs(30));
        let hdr = [9u8; HEADER];
        let out = std::thread::scope(|s| {
            let src = &src;
            s.spawn(move || {
                let mut hung = vec![false; 3];
                let mut run = Run {
                    links: &links0,
                    hung: &mut hung,
                    inbound: vec![],
                    outbound: vec![Outbound::new(1, hdr, vec![span(src)], None)],
                };
                // SAFETY: `src` is live and read-only for the run.
                unsafe { run.run(deadline, &mut |_, _| Ok(())) }.unwrap();
            });
            let mid = s.spawn(move || {
                let mut rows = vec![0u8; len];
                let body = vec![Span {
                    addr: rows.as_mut_ptr() as usize,
                    len,
                }];
                let mut hung = vec![false; 3];
                let mut run = Run {
                    links: &links1,
                    hung: &mut hung,
                    inbound: vec![Inbound::new(0, body.clone())],
                    outbound: vec![Outbound::new(
                        2,
                        hdr,
                        body,
                        Some(Gate {
                            inbound: 0,
                            head: 0,
                        }),
                    )],
                };
                let mut seen = 0;
                // SAFETY: `rows` is this thread's own; the gated stream only sends bytes that
                // have arrived.
                unsafe {
                    run.run(deadline, &mut |peer, h| {
                        seen += 1;
                        assert_eq!((peer, h), (0, &hdr));
                        Ok(())
                    })
                }
                .unwrap();
                assert_eq!(seen, 1);
                rows
            });
            let last = s.spawn(move || {
                let mut rows = vec![0u8; len];
                let body = vec![Span {
                    addr: rows.as_mut_ptr() as usize,
                    len,
                }];
                let mut hung = vec![false; 3];
                let mut run = Run {
                    links: &links2,
                    hung: &mut hung,
                    inbound: vec![Inbound::new(1, body)],
                    outbound: vec![],
                };
                // SAFETY: `rows` is this thread's own.
                unsafe { run.run(deadline, &mut |_, _| Ok(())) }.unwrap();
                rows
            });
            (mid.join().unwrap(), last.join().unwrap())
        });
        assert!(out.0 == src && out.1 == src);
    }

    #[test]
    fn a_peer_that_hangs_up_mid_stream_is_gone_and_a_silent_one_times_out() {
        let (a, b) = UnixStream::pair().unwrap();
        let links = vec![None, Some(Link::Unix(a))];
        links[1].as_ref().unwrap().prepare().unwrap();
        let mut rows = vec![0u8; 100];
        let body = vec![Span {
            addr: rows.as_mut_ptr() as usize,
            len: 100,
        }];
        let mut hung = vec![false; 2];
        let t = Instant::now();
        let mut run = Run {
            links: &links,
            hung: &mut hung,
            inbound: vec![Inbound::new(1, body.clone())],
            outbound: vec![],
        };
        // SAFETY: `rows` is ours.
        let r = unsafe { run.run(t + Duration::from_millis(50), &mut |_, _| Ok(())) };
        assert!(
            matches!(r, Err(Failure::Timeout(ref m)) if m == &[1]),
            "{r:?}"
        );
        assert!(t.elapsed() < Duration::from_secs(5));
        // The peer sends half a header, then dies.
        use std::io::Write;
        (&b).write_all(&[0u8; 10]).unwrap();
        drop(b);
        let mut run = Run {
            links: &links,
            hung: &mut hung,
            inbound: vec![Inbound::new(1, body)],
            outbound: vec![],
        };
        // SAFETY: `rows` is ours.
        let r = unsafe {
            run.run(
                kv_loader::deadline_after(Duration::from_secs(30)),
                &mut |_, _| Ok(()),
            )
        };
        assert!(matches!(r, Err(Failure::Gone(ref g)) if g == &[1]), "{r:?}");
        assert!(hung[1]);
    }
}
