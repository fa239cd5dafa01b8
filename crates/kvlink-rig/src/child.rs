//! Child processes that end with the process that started them, and their output read on a
//! thread of its own (so that every wait for a line can be bounded).

use std::io::{BufRead, BufReader, Read};
use std::sync::mpsc;

/// The lines of `output` (a child's stdout), on a channel: a thread reads them until the
/// output ends or the receiver is dropped, so the caller waits for each with
/// `recv_timeout`.
///
/// ```
/// let rx = kvlink_rig::child::lines(&b"one\ntwo\n"[..]);
/// let got: Vec<String> = rx.iter().collect();
/// assert_eq!(got, ["one", "two"]);
/// ```
pub fn lines(output: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(output).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

// In a file of its own: the rank-process tests of dedup-broadcast, which cannot depend on this
// crate (it depends on theirs), include the same file.
mod end_with_parent;
pub use end_with_parent::end_with_parent;

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::time::{Duration, Instant};

    /// The child ends with the thread that started it (as it would with a parent process
    /// killed by a time limit): `sleep 30` started by a thread that then ends is killed at
    /// once, long before its 30 s.
    #[test]
    fn a_child_is_killed_when_its_parent_thread_ends() {
        let mut child = std::thread::spawn(|| {
            end_with_parent(Command::new("sleep").arg("30"))
                .spawn()
                .expect("sleep starts")
        })
        .join()
        .expect("the spawning thread");
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(s) = child.try_wait().expect("try_wait") {
                break Some(s);
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        use std::os::unix::process::ExitStatusExt;
        let status = status.expect("the child outlived the thread that started it");
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    }
}
