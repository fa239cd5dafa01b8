//! Child processes that end with the process that started them, and their output read on a
//! thread of its own (so that every wait for a line can be bounded).

use std::io::{BufRead, BufReader, Read};
use std::process::Command;
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

/// Makes the child started by `cmd` receive SIGKILL when the thread that starts it ends (on
/// Linux, `PR_SET_PDEATHSIG`; call `spawn` from a thread that outlives the child, such as the
/// main thread). A parent killed by a time limit (`timeout` signals only its own process
/// group) then leaves no rank process behind, also one that made a process group of its own.
/// A child whose parent is already gone when it starts exits before running anything.
pub fn end_with_parent(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: getpid is async-signal-safe and runs here, in the parent.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure runs in the child between fork and exec and calls only prctl,
    // getppid and errno access, which are async-signal-safe; it allocates nothing (the
    // error is built from a raw OS code).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
