//! The flags of TP ranks as processes: how the ranks run, and what a rank process started by
//! hand (or by the launcher) is told.

use clap::ValueEnum;

use super::UsageError;

/// How the TP ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum RanksAs {
    /// Threads of this process, one `TpGroup::in_process` group [default].
    #[default]
    Threads,
    /// Processes of this program: one rank each, with its own pool and linker, meeting at a
    /// rendezvous (`TpGroup::from_rendezvous`: socket collectives).
    Processes,
}

/// What a process of the processes shape is (all `None`: the launcher, or the threads shape).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ProcessArgs {
    /// threads: TP ranks are threads of this process. processes: this process launches --tp
    /// rank processes of this program, each with its own pool and linker, meeting at a
    /// rendezvous on 127.0.0.1 (socket collectives); it serves the embedded store to them (or
    /// each opens its own Mooncake client) and relays rank 0's report.
    #[arg(long, value_enum, value_name = "SHAPE", default_value = "threads")]
    pub ranks_as: RanksAs,
    /// This process is TP rank R of --world N, as an engine's launcher would start it: rank 0
    /// listens at --rendezvous HOST:PORT, every other rank meets it there (start one process
    /// per rank, same flags otherwise). With the embedded store, rank 0 keeps it and serves it
    /// to the others through the rendezvous (no setup); rank 0 saves the prefix and prints the
    /// report, every rank verifies its own pool. --world replaces --tp.
    #[arg(long, value_name = "R")]
    pub rank: Option<u32>,
    /// Ranks in the group (with --rank).
    #[arg(long, value_name = "N")]
    pub world: Option<u32>,
    /// Where the ranks meet: rank 0 listens at this HOST:PORT (with --rank).
    #[arg(long, value_name = "HOST:PORT")]
    pub rendezvous: Option<String>,
    /// (set by the launcher) the store it serves, instead of rank 0's.
    #[arg(long, value_name = "ADDR")]
    pub store_at: Option<String>,
    /// The command line without the flags that say how ranks run (`--tp` and [`FLAGS`]):
    /// what the launcher gives every rank process, with its own rank flags.
    #[arg(skip)]
    pub argv: Vec<String>,
}

impl ProcessArgs {
    /// True for a rank process (started by hand or by the launcher).
    pub fn is_rank(&self) -> bool {
        self.rank.is_some()
    }
}

/// The flags parsed here.
pub const FLAGS: [&str; 5] = [
    "--ranks-as",
    "--rank",
    "--world",
    "--rendezvous",
    "--store-at",
];

/// `argv` without `--tp` and [`FLAGS`] (each as `--flag value` or `--flag=value`).
pub fn passthrough(argv: &[String]) -> Vec<String> {
    let drop = |f: &str| f == "--tp" || FLAGS.contains(&f);
    let mut out = Vec::new();
    let mut it = argv.iter();
    while let Some(a) = it.next() {
        match a.split_once('=') {
            Some((f, _)) if f.starts_with("--") && drop(f) => {}
            _ if drop(a) => {
                it.next();
            }
            _ => out.push(a.clone()),
        }
    }
    out
}

impl ProcessArgs {
    /// Checks the combination; a rank process runs in the processes shape with `tp = world`.
    pub fn check(&mut self, tp: &mut u32) -> Result<(), UsageError> {
        match (self.rank, self.world, &self.rendezvous) {
            (None, None, None) => {
                if self.store_at.is_some() {
                    return Err(UsageError(
                        "--store-at is for rank processes (--rank)".into(),
                    ));
                }
                Ok(())
            }
            (Some(rank), Some(world), Some(_)) => {
                if world == 0 || world > 64 || rank >= world {
                    return Err(UsageError(format!(
                        "--rank {rank} --world {world}: the rank must be in 0..world, world in \
                         1..=64"
                    )));
                }
                self.ranks_as = RanksAs::Processes;
                *tp = world;
                Ok(())
            }
            _ => Err(UsageError(
                "a rank process needs all of --rank, --world and --rendezvous".into(),
            )),
        }
    }
}
