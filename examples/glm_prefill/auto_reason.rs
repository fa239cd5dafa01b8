//! Auto's pick with its reason, from the calibration batches the example watched: each batch's
//! time from `start_load` to its last layer on the slowest rank, per landed byte (what `Auto`
//! measures: an engine's forward waits for every rank), median per mode.

use std::time::Duration;

use kvlink::kv_loader::ShareMode;

/// Modes within this fraction of the fastest median count as equally fast (the linker's rule).
const TIE: f64 = 0.10;

/// The calibration batches, in the order they ran, each timed on its slowest rank.
#[derive(Debug, Default, Clone)]
pub struct Calibration {
    /// (mode the batch ran in, milliseconds per GB landed).
    samples: Vec<(ShareMode, f64)>,
}

impl Calibration {
    /// Notes one batch: its `LoadStats`' mode and bytes landed, and the slowest rank's last
    /// layer.
    pub fn record(&mut self, mode: ShareMode, bytes_landed: u64, last_layer: Duration) {
        let gb = bytes_landed as f64 / 1e9;
        if gb > 0.0 {
            self.samples
                .push((mode, last_layer.as_secs_f64() * 1e3 / gb));
        }
    }

    /// Number of batches noted.
    pub fn batches(&self) -> usize {
        self.samples.len()
    }

    /// The modes of the batches, in order.
    pub fn order(&self) -> Vec<String> {
        self.samples.iter().map(|(m, _)| format!("{m:?}")).collect()
    }

    /// Median ms per GB landed of `mode`, and its number of batches.
    fn median(&self, mode: ShareMode) -> Option<(f64, usize)> {
        let mut v: Vec<f64> = self
            .samples
            .iter()
            .filter(|(m, _)| *m == mode)
            .map(|(_, t)| *t)
            .collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let m = v.len() / 2;
        let med = if v.len() % 2 == 1 {
            v[m]
        } else {
            0.5 * (v[m - 1] + v[m])
        };
        Some((med, v.len()))
    }

    /// Why `kept` was kept, in one sentence, from the medians.
    pub fn reason(&self, kept: ShareMode) -> String {
        let modes = [
            ShareMode::AllRanks,
            ShareMode::Rank0Broadcast,
            ShareMode::SplitAllGather,
        ];
        let medians: Vec<(ShareMode, f64, usize)> = modes
            .iter()
            .filter_map(|&m| self.median(m).map(|(t, n)| (m, t, n)))
            .collect();
        let listed: Vec<String> = medians
            .iter()
            .map(|(m, t, n)| {
                let s = if *n == 1 { "batch" } else { "batches" };
                format!("{m:?} {t:.0} ms/GB ({n} {s})")
            })
            .collect();
        let best = medians
            .iter()
            .map(|(_, t, _)| *t)
            .fold(f64::INFINITY, f64::min);
        let kept_t = medians
            .iter()
            .find(|(m, _, _)| *m == kept)
            .map(|(_, t, _)| *t);
        let why = match kept_t {
            Some(t) if t <= best => "the fastest median".to_string(),
            Some(t) if t <= best * (1.0 + TIE) => format!(
                "within {:.0} % of the fastest median ({:+.1} %), so equally fast, and it reads \
                 fewer store bytes per rank",
                TIE * 100.0,
                (t / best - 1.0) * 100.0
            ),
            Some(_) => "not the fastest median here: Auto decided on batches measured \
                        with noise (see the linker's log, RUST_LOG=info)"
                .to_string(),
            None => "no calibration batch of it was seen here".to_string(),
        };
        format!(
            "Auto keeps {kept:?}: {why}. Calibration batches, median time from start_load \
             to last layer on the slowest rank per GB landed: {}",
            listed.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_fastest_and_a_tie() {
        let mut c = Calibration::default();
        for (m, t) in [
            (ShareMode::AllRanks, 100),
            (ShareMode::Rank0Broadcast, 300),
            (ShareMode::SplitAllGather, 105),
        ] {
            c.record(m, 1_000_000_000, Duration::from_millis(t));
        }
        assert!(c.reason(ShareMode::AllRanks).contains("the fastest median"));
        let tie = c.reason(ShareMode::SplitAllGather);
        assert!(
            tie.contains("within 10 % of the fastest median (+5.0 %)"),
            "{tie}"
        );
        assert!(tie.contains("Rank0Broadcast 300 ms/GB (1 batch)"), "{tie}");
    }
}
