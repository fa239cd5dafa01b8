//! A child process that ends with the thread that started it (Linux, `PR_SET_PDEATHSIG`).

use std::process::Command;

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
