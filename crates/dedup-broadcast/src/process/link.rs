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
