//! The flags of TP ranks as processes: how the ranks run, and what a rank process started by
//! hand (or by the launcher) is told.

use super::UsageError;

/// How the TP ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RanksAs {
    /// Threads of this process, one `TpGroup::in_process` group [default].
    #[default]
    Threads,
    /// Processes of this program: one rank each, with its own pool and linker, meeting at a
    /// rendezvous (`TpGroup::from_rendezvous`: socket collectives).
    Processes,
}

/// What a process of the processes shape is (all `None`: the launcher, or the threads shape).
#[derive(Debug, Clone, Default)]
pub struct ProcessArgs {
    /// Threads or processes.
    pub ranks_as: RanksAs,
    /// This process is TP rank `rank` (started by hand, or by the launcher).
    pub rank: Option<u32>,
    /// Ranks in the group (with `rank`).
    pub world: Option<u32>,
    /// Where the ranks meet: rank 0 listens at this `host:port`.
    pub rendezvous: Option<String>,
    /// The address of a store the launcher serves (set by the launcher for its ranks).
    pub store_at: Option<String>,
    /// The command line without the flags that say how ranks run (`--tp` and [`FLAGS`]):
    /// what the launcher gives every rank process, with its own rank flags.
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

/// The help text of these flags.
pub const HELP: &str = "\
    --ranks-as SHAPE    threads: TP ranks are threads of this process [default].
                        processes: this process launches --tp rank processes of this program,
                        each with its own pool and linker, meeting at a rendezvous on
                        127.0.0.1 (socket collectives); it serves the embedded store to them
                        (or each opens its own Mooncake client) and relays rank 0's report.
    --rank R --world N --rendezvous HOST:PORT
                        This process is TP rank R of N, as an engine's launcher would start it:
                        rank 0 listens at HOST:PORT, every other rank meets it there (start one
                        process per rank, same flags otherwise). With the embedded store, rank 0
                        keeps it and serves it to the others through the rendezvous (no setup);
                        rank 0 saves the prefix and prints the report, every rank verifies its
                        own pool. --world replaces --tp.
    --store-at ADDR     (set by the launcher) the store it serves, instead of rank 0's.
";

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

fn num(flag: &str, v: &str) -> Result<u32, UsageError> {
    v.parse()
        .map_err(|_| UsageError(format!("{flag}: `{v}` is not a non-negative integer")))
}

impl ProcessArgs {
    /// Takes one of [`FLAGS`] with its value.
    pub fn set(&mut self, flag: &str, value: &str) -> Result<(), UsageError> {
        match flag {
            "--ranks-as" => {
                self.ranks_as = match value {
                    "threads" => RanksAs::Threads,
                    "processes" => RanksAs::Processes,
                    other => {
                        return Err(UsageError(format!(
                            "--ranks-as: `{other}` is not one of threads, processes"
                        )))
                    }
                }
            }
            "--rank" => self.rank = Some(num(flag, value)?),
            "--world" => self.world = Some(num(flag, value)?),
            "--rendezvous" => self.rendezvous = Some(value.to_string()),
            "--store-at" => self.store_at = Some(value.to_string()),
            other => return Err(UsageError(format!("unknown argument `{other}`"))),
        }
        Ok(())
    }

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
