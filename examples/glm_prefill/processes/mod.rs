//! TP ranks as processes, in two ways an engine runs them:
//! - **launched** (`--ranks-as processes --tp N`): this process is a launcher. It keeps the
//!   embedded store and serves it over a Unix socket (or leaves each rank its own Mooncake
//!   client), starts N rank processes of this program, and relays rank 0's report.
//! - **started by hand** (`--rank R --world N --rendezvous HOST:PORT`, one process per rank,
//!   as an engine's launcher would start them): rank 0 keeps the embedded store and serves it
//!   through the rendezvous (its address travels with the group), so two processes with the
//!   same `--rendezvous` and no other flags load and verify.
//!
//! Every rank process forms its group at the rendezvous (`TpGroup::from_rendezvous`: socket
//! collectives, re-formed by the linker after a failure), has its own `HostKvPool` and
//! `Linker`, loads every mode asked for, and verifies its own pool byte for byte. Rank 0
//! saves the prefix first and gathers every rank's numbers (over the group's control handle,
//! between loads) to print the same tables as the threads shape.

mod gather;
mod launcher;
mod rank;
mod stores;
mod tables;

use std::io::Write;

use anyhow::Result;

use crate::args::Args;

// `ChildSpawner`: the example's test starts its rank processes through its own harness.
#[allow(unused_imports)]
pub(crate) use launcher::{launch, ChildSpawner};

/// Runs the processes shape: a rank process when `--rank` was given, else the launcher of
/// `--tp` rank processes of this program.
pub(crate) fn run(args: &Args, out: &mut dyn Write) -> Result<()> {
    if args.procs.is_rank() {
        rank::run(args, out)
    } else {
        launch(args, out, &launcher::this_program)
    }
}
