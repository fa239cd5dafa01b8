//! What each rank process reports about one mode's load, and how rank 0 gets every rank's
//! report: an all-gather of a small text over the group's control handle (between loads,
//! when no linker uses it).

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use kvlink::dedup_broadcast::Collective;
use kvlink::kv_loader::ShareMode;

/// One rank's load of one mode, as numbers (times from this rank's `start_load`).
#[derive(Debug, Clone, Default)]
pub(super) struct RankReport {
    pub(super) hit: u64,
    pub(super) start_err: Option<String>,
    pub(super) layer_err: Option<String>,
    /// The batch's error, when it failed.
    pub(super) batch_err: Option<String>,
    pub(super) mode: Option<ShareMode>,
    pub(super) pages: u32,
    pub(super) bytes_read: u64,
    pub(super) bytes_landed: u64,
    pub(super) first_layer: Duration,
    pub(super) last_layer: Duration,
    pub(super) store_bytes_read: u64,
    pub(super) ready: Vec<Duration>,
    pub(super) seen: Vec<Duration>,
    pub(super) done: Vec<Duration>,
    /// Bytes compared in this rank's pool, or where it differs.
    pub(super) verified: Option<Result<u64, String>>,
    pub(super) verify_time: Duration,
    /// Auto's pick with its reason, from this rank's calibration batches (rank 0's decide).
    pub(super) auto_reason: Option<String>,
    /// This rank's warm-up batches' last layers (or errors): kept on the rank, not gathered
    /// (rank 0 prints its own).
    pub(super) warmups: Vec<Result<Duration, String>>,
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\t'], " ")
}

fn ns(d: Duration) -> String {
    d.as_nanos().to_string()
}

fn list(v: &[Duration]) -> String {
    v.iter().map(|d| ns(*d)).collect::<Vec<_>>().join(",")
}

fn mode_name(m: ShareMode) -> &'static str {
    match m {
        ShareMode::AllRanks => "AllRanks",
        ShareMode::Rank0Broadcast => "Rank0Broadcast",
        ShareMode::SplitAllGather => "SplitAllGather",
    }
}

impl RankReport {
    /// One `key\tvalue` line per field.
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut lines = vec![
            format!("hit\t{}", self.hit),
            format!("pages\t{}", self.pages),
            format!("bytes_read\t{}", self.bytes_read),
            format!("bytes_landed\t{}", self.bytes_landed),
            format!("first_layer\t{}", ns(self.first_layer)),
            format!("last_layer\t{}", ns(self.last_layer)),
            format!("store_bytes_read\t{}", self.store_bytes_read),
            format!("ready\t{}", list(&self.ready)),
            format!("seen\t{}", list(&self.seen)),
            format!("done\t{}", list(&self.done)),
            format!("verify_time\t{}", ns(self.verify_time)),
        ];
        let mut opt = |k: &str, v: &Option<String>| {
            if let Some(v) = v {
                lines.push(format!("{k}\t{}", one_line(v)));
            }
        };
        opt("start_err", &self.start_err);
        opt("layer_err", &self.layer_err);
        opt("batch_err", &self.batch_err);
        opt("auto_reason", &self.auto_reason);
        if let Some(m) = self.mode {
            lines.push(format!("mode\t{}", mode_name(m)));
        }
        match &self.verified {
            Some(Ok(b)) => lines.push(format!("verified\t{b}")),
            Some(Err(e)) => lines.push(format!("differs\t{}", one_line(e))),
            None => {}
        }
        lines.join("\n").into_bytes()
    }

    pub(super) fn decode(bytes: &[u8]) -> Result<Self> {
        let text = std::str::from_utf8(bytes).map_err(|e| anyhow!("a rank report: {e}"))?;
        let mut r = RankReport::default();
        let dur = |v: &str| -> Result<Duration> { Ok(Duration::from_nanos(v.parse()?)) };
        let durs = |v: &str| -> Result<Vec<Duration>> {
            v.split(',').filter(|s| !s.is_empty()).map(dur).collect()
        };
        for line in text.lines() {
            let Some((k, v)) = line.split_once('\t') else {
                bail!("a rank report line without a value: {line:?}");
            };
            match k {
                "hit" => r.hit = v.parse()?,
                "pages" => r.pages = v.parse()?,
                "bytes_read" => r.bytes_read = v.parse()?,
                "bytes_landed" => r.bytes_landed = v.parse()?,
                "first_layer" => r.first_layer = dur(v)?,
                "last_layer" => r.last_layer = dur(v)?,
                "store_bytes_read" => r.store_bytes_read = v.parse()?,
                "ready" => r.ready = durs(v)?,
                "seen" => r.seen = durs(v)?,
                "done" => r.done = durs(v)?,
                "verify_time" => r.verify_time = dur(v)?,
                "start_err" => r.start_err = Some(v.to_string()),
                "layer_err" => r.layer_err = Some(v.to_string()),
                "batch_err" => r.batch_err = Some(v.to_string()),
                "auto_reason" => r.auto_reason = Some(v.to_string()),
                "mode" => {
                    r.mode = Some(match v {
                        "AllRanks" => ShareMode::AllRanks,
                        "Rank0Broadcast" => ShareMode::Rank0Broadcast,
                        "SplitAllGather" => ShareMode::SplitAllGather,
                        other => bail!("a rank report's mode {other:?}"),
                    })
                }
                "verified" => r.verified = Some(Ok(v.parse()?)),
                "differs" => r.verified = Some(Err(v.to_string())),
                other => bail!("a rank report's field {other:?}"),
            }
        }
        Ok(r)
    }
}

fn deadline() -> Instant {
    kvlink::kv_loader::deadline_after(Duration::from_secs(120))
}

/// Every rank's `bytes`, index = rank (each rank calls it at the same point).
pub(super) fn all_gather(coll: &dyn Collective, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    let lens = coll.all_gather_u64(bytes.len() as u64, deadline())?;
    let longest = lens.iter().copied().max().unwrap_or(0) as usize;
    let mut padded = bytes.to_vec();
    padded.resize(longest, 0);
    let all = coll.all_gather_bytes(&padded, deadline())?;
    Ok(all
        .into_iter()
        .zip(lens)
        .map(|(mut b, n)| {
            b.truncate(n as usize);
            b
        })
        .collect())
}

/// Every rank's `word`, index = rank (each rank calls it at the same point with its own).
pub(super) fn words(coll: &dyn Collective, word: u64) -> Result<Vec<u64>> {
    Ok(coll.all_gather_u64(word, deadline())?)
}

/// Waits until every rank is here.
pub(super) fn barrier(coll: &dyn Collective) -> Result<()> {
    coll.all_gather_u64(0, deadline())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_survives_its_encoding() {
        let r = RankReport {
            hit: 4,
            layer_err: Some("layer 3:\nbad".into()),
            mode: Some(ShareMode::SplitAllGather),
            ready: vec![Duration::from_micros(5), Duration::from_millis(2)],
            verified: Some(Ok(99)),
            auto_reason: Some("Auto keeps SplitAllGather:\tthe fastest median".into()),
            ..RankReport::default()
        };
        let back = RankReport::decode(&r.encode()).unwrap();
        assert_eq!(back.hit, 4);
        assert_eq!(
            back.auto_reason.as_deref(),
            Some("Auto keeps SplitAllGather: the fastest median")
        );
        assert_eq!(back.layer_err.as_deref(), Some("layer 3: bad"));
        assert_eq!(back.mode, Some(ShareMode::SplitAllGather));
        assert_eq!(back.ready, r.ready);
        assert!(matches!(back.verified, Some(Ok(99))));
    }
}
