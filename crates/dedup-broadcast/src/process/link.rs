//! [`Link`]: one connected stream socket between two ranks (TCP, or a Unix socket when every
//! rank is on one host), non-blocking once the group is formed, with vectored I/O straight
//! between the socket and the ranks' rows.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

/// A stream socket to one peer rank.
#[derive(Debug)]
pub(crate) enum Link {
    /// TCP (ranks on several hosts, or Unix sockets turned off).
    Tcp(TcpStream),
    /// A Unix stream socket (every rank on one host).
    Unix(UnixStream),
}

/// One piece of memory a vectored read fills or a vectored write sends: `len` bytes at
/// `addr`. Plain data; the engine's caller vouches for the memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) addr: usize,
    pub(crate) len: usize,
}

/// Socket buffer size asked for (see [`Link::prepare`]).
pub(crate) const SOCKET_BUFFER: usize = 4 << 20;

/// The most iovecs one `readv`/`sendmsg` takes (Linux's `IOV_MAX`).
pub(crate) const MAX_IOV: usize = 1024;

impl Link {
    pub(crate) fn fd(&self) -> RawFd {
        match self {
            Link::Tcp(s) => s.as_raw_fd(),
            Link::Unix(s) => s.as_raw_fd(),
        }
    }

    /// Switches the socket to non-blocking mode (the engine polls) and, for TCP, turns off
    /// Nagle's delay (status words are small and latency-bound).
    pub(crate) fn prepare(&self) -> io::Result<()> {
        self.grow_buffers();
        match self {
            Link::Tcp(s) => {
                s.set_nodelay(true)?;
                s.set_nonblocking(true)
            }
            Link::Unix(s) => s.set_nonblocking(true),
        }
    }

    /// Asks for socket buffers of [`SOCKET_BUFFER`] bytes (the kernel caps them at its
    /// `wmem_max`/`rmem_max`): fewer wake-ups per layer when a rank relays megabytes. Best
    /// effort: the defaults work too.
    fn grow_buffers(&self) {
        let size = SOCKET_BUFFER as libc::c_int;
        for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
            // SAFETY: `size` is a live c_int whose address and size are passed; the socket
            // is open; setsockopt only reads the value.
            let _ = unsafe {
                libc::setsockopt(
                    self.fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&size as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
        }
    }

    /// Sends all of `bytes` on a socket in blocking mode (its send timeout bounds each wait:
    /// `TimedOut` when it passes), without `SIGPIPE`: a peer that is gone gives
    /// `BrokenPipe`/`ConnectionReset` instead of killing a process that did not ignore the
    /// signal. (Recent std's `UnixStream::write` sends with `MSG_NOSIGNAL` too; older ones
    /// use a plain `write`, so this does not depend on the toolchain.)
    pub(crate) fn send_all(&self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            // SAFETY: `bytes` is a live slice, valid for reads of its length for the call;
            // the socket is open (owned by this Link).
            let n = unsafe {
                libc::send(
                    self.fd(),
                    bytes.as_ptr().cast(),
                    bytes.len(),
                    libc::MSG_NOSIGNAL,
                )
            };
            if n > 0 {
                bytes = &bytes[(n as usize).min(bytes.len())..];
                continue;
            }
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => {}
                io::ErrorKind::WouldBlock => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the peer took no bytes before the send timeout",
                    ))
                }
                _ => return Err(e),
            }
        }
        Ok(())
    }

    /// Closes both directions: the peer's pending and later reads see end-of-stream, its
    /// writes fail. Used to tell every peer at once that this rank gave the group up.
    pub(crate) fn shut(&self) {
        let _ = match self {
            Link::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Link::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }

    /// Reads into `spans` (in order) what the socket has now, without blocking: `Ok(0)` is
    /// end-of-stream, `WouldBlock` means nothing is there yet.
    ///
    /// # Safety
    /// Every span is valid for writes of its length and touched by nothing else during the
    /// call.
    pub(crate) unsafe fn read_into(&self, spans: &[Span]) -> io::Result<usize> {
        let iov = iovecs(spans);
        loop {
            // SAFETY: `iov` describes memory the caller vouches for (valid for writes, not
            // accessed by anyone else); its length is at most MAX_IOV; `self.fd()` is an open
            // socket owned by this Link.
            let n = unsafe { libc::readv(self.fd(), iov.as_ptr(), iov.len() as libc::c_int) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// Sends from `spans` (in order) what the socket takes now, without blocking and without
    /// `SIGPIPE` (a peer that is gone gives `BrokenPipe`/`ConnectionReset`).
    ///
    /// # Safety
    /// Every span is valid for reads of its length and not written by anyone during the call.
    pub(crate) unsafe fn send_from(&self, spans: &[Span]) -> io::Result<usize> {
        let mut iov = iovecs(spans);
        // SAFETY: an all-zero msghdr is a valid empty message header (null name, no control).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len() as _;
        loop {
            // SAFETY: `msg` points at `iov`, which lives across the call and describes memory
            // the caller vouches for (valid for reads, not written); the socket is open.
            let n =
                unsafe { libc::sendmsg(self.fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

fn iovecs(spans: &[Span]) -> Vec<libc::iovec> {
    spans
        .iter()
        .take(MAX_IOV)
        .map(|s| libc::iovec {
            iov_base: s.addr as *mut libc::c_void,
            iov_len: s.len,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether SIGPIPE is pending for this thread (it is blocked here, so it stays pending),
    /// taking it if so.
    fn take_pending_sigpipe() -> bool {
        // SAFETY: plain libc signal-set calls on local, initialised sets.
        unsafe {
            let mut pending: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut pending);
            libc::sigpending(&mut pending);
            if libc::sigismember(&pending, libc::SIGPIPE) != 1 {
                return false;
            }
            let mut only: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut only);
            libc::sigaddset(&mut only, libc::SIGPIPE);
            let zero = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            libc::sigtimedwait(&only, std::ptr::null_mut(), &zero);
            true
        }
    }

    /// A send to a peer that is gone raises no SIGPIPE (which kills a process that did not
    /// ignore it), whatever std's own writes do.
    #[test]
    fn a_send_to_a_closed_peer_is_an_error_without_sigpipe() {
        std::thread::spawn(|| {
            // SAFETY: blocks SIGPIPE for this thread only, with a local initialised set.
            unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGPIPE);
                libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            }
            let (a, b) = UnixStream::pair().unwrap();
            drop(b);
            let e = Link::Unix(a.try_clone().unwrap())
                .send_all(b"hello")
                .unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::BrokenPipe);
            assert!(!take_pending_sigpipe(), "send_all raised SIGPIPE");
            // The check itself sees the signal a plain `write(2)` raises.
            // SAFETY: writes 5 bytes from a live array to an open socket.
            let n = unsafe { libc::write(a.as_raw_fd(), b"hello".as_ptr().cast(), 5) };
            assert_eq!(n, -1);
            assert!(take_pending_sigpipe(), "a plain write raises SIGPIPE");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn vectored_send_and_read_move_bytes_between_spans() {
        let (a, b) = UnixStream::pair().unwrap();
        let (a, b) = (Link::Unix(a), Link::Unix(b));
        a.prepare().unwrap();
        b.prepare().unwrap();
        let src1 = *b"hello ";
        let src2 = *b"world";
        let spans = [
            Span {
                addr: src1.as_ptr() as usize,
                len: 6,
            },
            Span {
                addr: src2.as_ptr() as usize,
                len: 5,
            },
        ];
        // SAFETY: both sources are live locals, read-only here.
        assert_eq!(unsafe { a.send_from(&spans) }.unwrap(), 11);
        let mut d1 = [0u8; 4];
        let mut d2 = [0u8; 7];
        let dst = [
            Span {
                addr: d1.as_mut_ptr() as usize,
                len: 4,
            },
            Span {
                addr: d2.as_mut_ptr() as usize,
                len: 7,
            },
        ];
        // SAFETY: both destinations are live locals, untouched during the call.
        assert_eq!(unsafe { b.read_into(&dst) }.unwrap(), 11);
        assert_eq!((&d1, &d2), (b"hell", b"o world"));
        // Nothing more: WouldBlock; after the peer closes: end-of-stream; writing to a closed
        // peer: an error, not SIGPIPE.
        // SAFETY: as above.
        let e = unsafe { b.read_into(&dst) }.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        a.shut();
        // SAFETY: as above.
        assert_eq!(unsafe { b.read_into(&dst) }.unwrap(), 0);
        drop(a);
        // SAFETY: as above.
        assert!(unsafe { b.send_from(&spans) }.is_err());
    }
}
