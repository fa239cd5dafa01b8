//! Byte encoding of the small messages ranks exchange when they meet (hellos, welcomes,
//! handshakes): fixed-width little-endian integers and length-prefixed byte strings, framed
//! by a `u32` length. Bulk data never goes through here.

use std::io::{self, Read, Write};
use std::time::Instant;

/// Largest frame accepted: rendezvous messages are a few hundred bytes per rank.
pub(crate) const MAX_FRAME: usize = 1 << 20;

/// Appends fields to a message body.
#[derive(Default)]
pub(crate) struct Encoder(pub(crate) Vec<u8>);

impl Encoder {
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
    pub(crate) fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
        self
    }
    pub(crate) fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
    pub(crate) fn opt_str(&mut self, v: Option<&str>) -> &mut Self {
        match v {
            Some(s) => self.u8(1).str(s),
            None => self.u8(0),
        }
    }
}

/// Reads fields of a message body; every read is bounds-checked.
pub(crate) struct Decoder<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// A message that does not decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Malformed(pub(crate) String);

impl<'a> Decoder<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Decoder { buf, pos: 0 }
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], Malformed> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let Some(end) = end else {
            return Err(Malformed(format!(
                "{what}: needs {n} bytes at {}, message has {}",
                self.pos,
                self.buf.len()
            )));
        };
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    pub(crate) fn u8(&mut self, what: &str) -> Result<u8, Malformed> {
        Ok(self.take(1, what)?[0])
    }
    pub(crate) fn u32(&mut self, what: &str) -> Result<u32, Malformed> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(crate) fn u64(&mut self, what: &str) -> Result<u64, Malformed> {
        let mut w = [0u8; 8];
        w.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(w))
    }
    pub(crate) fn bytes(&mut self, what: &str) -> Result<&'a [u8], Malformed> {
        let n = self.u32(what)? as usize;
        self.take(n, what)
    }
    pub(crate) fn str(&mut self, what: &str) -> Result<String, Malformed> {
        let b = self.bytes(what)?;
        String::from_utf8(b.to_vec()).map_err(|_| Malformed(format!("{what}: not UTF-8")))
    }
    pub(crate) fn opt_str(&mut self, what: &str) -> Result<Option<String>, Malformed> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => Ok(Some(self.str(what)?)),
            t => Err(Malformed(format!("{what}: option tag {t}"))),
        }
    }
}

/// The time left until `deadline`, at least one millisecond (a zero socket timeout means
/// "wait forever" to the OS), or `TimedOut` when it has passed.
pub(crate) fn remaining(deadline: Instant) -> io::Result<std::time::Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
    }
    Ok(left.max(std::time::Duration::from_millis(1)))
}

/// A blocking stream whose read and write timeouts can be set (TCP or Unix).
pub(crate) trait TimedStream: Read + Write {
    fn set_timeouts(&self, left: std::time::Duration) -> io::Result<()>;
}

impl TimedStream for std::net::TcpStream {
    fn set_timeouts(&self, left: std::time::Duration) -> io::Result<()> {
        self.set_read_timeout(Some(left))?;
        self.set_write_timeout(Some(left))
    }
}

impl TimedStream for std::os::unix::net::UnixStream {
    fn set_timeouts(&self, left: std::time::Duration) -> io::Result<()> {
        self.set_read_timeout(Some(left))?;
        self.set_write_timeout(Some(left))
    }
}

/// Writes one frame (`u32` length, then `body`) before `deadline`.
pub(crate) fn write_frame<S: TimedStream>(
    s: &mut S,
    body: &[u8],
    deadline: Instant,
) -> io::Result<()> {
    if body.len() > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("frame of {} bytes (at most {MAX_FRAME})", body.len()),
        ));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    write_all_by(s, &frame, deadline)?;
    // Sent whole: no deadline past this point makes it a failure (a socket's flush is a
    // no-op), or the two ends would disagree on a message one of them has.
    s.flush()
}

/// Most bytes one write call hands the socket: a Unix socket's send timeout applies to each
/// of its buffers in turn, not to the call, so one large write to a peer that reads slowly
/// could run for many timeouts.
const WRITE_TURN: usize = 64 << 10;

/// `write_all`, re-arming the socket timeout with what is left of `deadline` before each
/// write of at most [`WRITE_TURN`] bytes, so a peer that reads slowly cannot stretch the wait.
fn write_all_by<S: TimedStream>(s: &mut S, mut buf: &[u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        s.set_timeouts(remaining(deadline)?)?;
        match s.write(&buf[..buf.len().min(WRITE_TURN)]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads one frame before `deadline`. A frame over [`MAX_FRAME`] is `InvalidData`.
pub(crate) fn read_frame<S: TimedStream>(s: &mut S, deadline: Instant) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    read_exact_by(s, &mut len, deadline)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {n} bytes (at most {MAX_FRAME})"),
        ));
    }
    let mut body = vec![0u8; n];
    read_exact_by(s, &mut body, deadline)?;
    Ok(body)
}

/// `read_exact`, re-arming the socket timeout with what is left of `deadline` before each
/// read, so a peer that trickles bytes cannot stretch the wait.
pub(crate) fn read_exact_by<S: TimedStream>(
    s: &mut S,
    mut buf: &mut [u8],
    deadline: Instant,
) -> io::Result<()> {
    while !buf.is_empty() {
        s.set_timeouts(remaining(deadline)?)?;
        match s.read(buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// True for the errors a socket timeout produces (`WouldBlock` on Unix, `TimedOut` elsewhere).
pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_written_to_a_peer_that_reads_slowly_ends_at_its_deadline() {
        use std::os::unix::net::UnixStream;
        let (mut a, mut b) = UnixStream::pair().unwrap();
        // The reader takes 16 KiB every 50 ms: each write makes progress well within the
        // socket timeout, so a timeout set once never fired (the frame took seconds).
        let reader = std::thread::spawn(move || {
            let mut buf = vec![0u8; 16 << 10];
            b.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
            while let Ok(n) = b.read(&mut buf) {
                if n == 0 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        });
        let body = vec![7u8; MAX_FRAME];
        let t0 = Instant::now();
        let deadline = t0 + std::time::Duration::from_millis(400);
        let r = write_frame(&mut a, &body, deadline);
        let took = t0.elapsed();
        drop(a);
        reader.join().unwrap();
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::TimedOut);
        assert!(took < std::time::Duration::from_millis(1500), "{took:?}");
        let too_big = vec![0u8; MAX_FRAME + 1];
        let (mut c, _d) = UnixStream::pair().unwrap();
        let r = write_frame(
            &mut c,
            &too_big,
            kv_loader::deadline_after(std::time::Duration::from_secs(1)),
        );
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn fields_round_trip_and_truncation_is_an_error() {
        let mut e = Encoder::default();
        e.u8(7)
            .u32(0xdead_beef)
            .u64(u64::MAX - 3)
            .str("héllo")
            .opt_str(None)
            .opt_str(Some("x"))
            .bytes(&[1, 2, 3]);
        let mut d = Decoder::new(&e.0);
        assert_eq!(d.u8("a").unwrap(), 7);
        assert_eq!(d.u32("b").unwrap(), 0xdead_beef);
        assert_eq!(d.u64("c").unwrap(), u64::MAX - 3);
        assert_eq!(d.str("d").unwrap(), "héllo");
        assert_eq!(d.opt_str("e").unwrap(), None);
        assert_eq!(d.opt_str("f").unwrap().as_deref(), Some("x"));
        assert_eq!(d.bytes("g").unwrap(), &[1, 2, 3]);
        for cut in 0..e.0.len() {
            let mut d = Decoder::new(&e.0[..cut]);
            let all = (|| {
                d.u8("a")?;
                d.u32("b")?;
                d.u64("c")?;
                d.str("d")?;
                d.opt_str("e")?;
                d.opt_str("f")?;
                d.bytes("g")?;
                Ok::<_, Malformed>(())
            })();
            assert!(all.is_err(), "cut at {cut} decoded");
        }
    }

    #[test]
    fn frames_round_trip_and_respect_the_deadline() {
        let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let far = kv_loader::deadline_after(std::time::Duration::from_secs(5));
        write_frame(&mut a, b"hello", far).unwrap();
        assert_eq!(read_frame(&mut b, far).unwrap(), b"hello");
        let soon = kv_loader::deadline_after(std::time::Duration::from_millis(30));
        let t = Instant::now();
        let err = read_frame(&mut b, soon).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(t.elapsed() < std::time::Duration::from_secs(2));
        drop(a);
        let err = read_frame(&mut b, far).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
