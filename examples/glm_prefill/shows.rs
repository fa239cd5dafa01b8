//! The few lines after the compare table that say what it shows: store bytes per rank, Auto's
//! pick with its reason, and, honestly, what sharing did to time on this store.

use std::io::{self, Write};
use std::time::Duration;

use kvlink::kv_loader::ShareMode;

use crate::report::{bytes, ms};

/// The README's command for the run where a store read crosses the network.
pub const MOONCAKE_RUN: &str = "MOONCAKE_GLOBAL_SEGMENT_SIZE=0 \
     MOONCAKE_STORAGE_NODE_SEGMENT=\"4 GB\" scripts/with-mooncake.sh --storage-node -- \
     target/release/examples/glm_prefill --store mooncake --mode compare";

/// One mode that loaded and verified.
pub struct ModeRow {
    /// What ran (`Auto` runs in the mode it picked).
    pub mode: ShareMode,
    /// Whether this row is `Auto`'s.
    pub auto: bool,
    /// The slowest rank's last layer ready, from its `start_load`.
    pub last_ready: Duration,
    /// Store bytes each rank read.
    pub per_rank: Vec<u64>,
}

/// What the table shows, in words computed from it.
pub struct Shows<'a> {
    /// The modes that loaded.
    pub rows: &'a [ModeRow],
    /// Auto's reason, when Auto ran.
    pub auto_reason: Option<&'a str>,
    /// The store is in this process (a read is a memory copy).
    pub embedded: bool,
}

impl Shows<'_> {
    /// Writes the lines.
    pub fn write(&self, out: &mut dyn Write) -> io::Result<()> {
        writeln!(out)?;
        writeln!(out, "what this shows:")?;
        for r in self.rows.iter().filter(|r| !r.auto) {
            let per: Vec<String> = r.per_rank.iter().map(|b| bytes(*b)).collect();
            let what = match r.mode {
                ShareMode::AllRanks => "every rank reads the whole prefix itself",
                ShareMode::Rank0Broadcast => "rank 0 reads, the others receive it",
                ShareMode::SplitAllGather => "each rank reads 1/TP, then an all-gather",
            };
            writeln!(
                out,
                "  {:<15} store bytes read per rank: {} ({what})",
                format!("{:?}", r.mode),
                per.join(" / ")
            )?;
        }
        if let Some(reason) = self.auto_reason {
            writeln!(out, "  {reason}")?;
        }
        if let Some(line) = self.time_line() {
            writeln!(out, "  {line}")?;
        }
        Ok(())
    }

    /// What sharing did to time here, said from the measurements.
    fn time_line(&self) -> Option<String> {
        let base = self
            .rows
            .iter()
            .find(|r| !r.auto && r.mode == ShareMode::AllRanks)?;
        let best = self
            .rows
            .iter()
            .filter(|r| !r.auto && r.mode != ShareMode::AllRanks)
            .min_by_key(|r| r.last_ready)?;
        let cmp = format!(
            "{:?} {} against AllRanks {}",
            best.mode,
            ms(best.last_ready),
            ms(base.last_ready)
        );
        if !self.embedded {
            let cut = 1.0 - best.last_ready.as_secs_f64() / base.last_ready.as_secs_f64();
            let said = if cut >= 0.0 {
                format!("{:.1} % less time to the last layer", cut * 100.0)
            } else {
                format!("{:.1} % more time to the last layer", -cut * 100.0)
            };
            return Some(format!(
                "time: here a store read leaves this process; the fastest sharing mode against \
                 every rank reading its own copy: {cmp} ({said})."
            ));
        }
        let head = if best.last_ready >= base.last_ready {
            format!(
                "time: on this embedded store sharing costs more than reading ({cmp}): a store \
                 read is a memory copy in this process, and sharing adds a copy between ranks."
            )
        } else {
            format!(
                "time: sharing was faster here ({cmp}) although no network is saved on this \
                 store: a store read here is a memory copy plus its per-layer checksum in this \
                 process{}, and sharing does that work once instead of on every rank.",
                if cfg!(debug_assertions) {
                    " (unoptimized in this debug build)"
                } else {
                    ""
                }
            )
        };
        Some(format!(
            "{head} Sharing pays where a read crosses the network: against a real Mooncake \
             Store (README, \"Real Mooncake\"): {MOONCAKE_RUN}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(mode: ShareMode, ms: u64) -> ModeRow {
        ModeRow {
            mode,
            auto: false,
            last_ready: Duration::from_millis(ms),
            per_rank: vec![1, 1],
        }
    }

    fn line(embedded: bool, sharing_ms: u64) -> String {
        let rows = [
            row(ShareMode::AllRanks, 100),
            row(ShareMode::SplitAllGather, sharing_ms),
        ];
        let shows = Shows {
            rows: &rows,
            auto_reason: None,
            embedded,
        };
        shows.time_line().unwrap_or_default()
    }

    #[test]
    fn the_time_line_says_what_was_measured() {
        let slower = line(true, 150);
        assert!(
            slower.contains("sharing costs more than reading"),
            "{slower}"
        );
        assert!(slower.contains("--store mooncake"), "{slower}");
        let faster = line(true, 60);
        assert!(faster.contains("sharing was faster here"), "{faster}");
        assert!(faster.contains("no network is saved"), "{faster}");
        assert!(line(false, 60).contains("(40.0 % less time to the last layer)"));
        assert!(line(false, 150).contains("(50.0 % more time to the last layer)"));
    }
}
