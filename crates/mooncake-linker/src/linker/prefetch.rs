//! Checksum companions read when a prefix is looked up, so that its load need not read them
//! before layer 0.
//!
//! A load may publish layer 0 only once it has the companion of every object it reads: one
//! small whole-object read each (about 20 ms for a 32K-token GLM-5.2 prefix over TCP), on the
//! client that reads layer 0. An engine looks a prefix up (`KvLoader::lookup`) before it
//! allocates slots and starts the load, often well before (while the request waits to be
//! scheduled). So a lookup that found pages starts reading their companions into the
//! linker's kept checksums (`checksum_cache`) on a thread of its own and returns at once; the
//! load takes them from there, and waits for a read still under way rather than reading the
//! same companions again (never longer than that read's own deadline).
//!
//! Only where the companions this rank will read can be told at lookup: a rank alone, or a
//! group whose mode is known (fixed, or kept by `Auto`) and in which this rank reads every
//! page (`AllRanks`; rank 0 of `Rank0Broadcast`). `SplitAllGather` reads a share of the
//! pages per rank (a fraction of the companions), and ranks other than 0 read no replicated
//! component in `Rank0Broadcast`: none is read ahead there. One prefetch at a time per linker
//! (a lookup while one runs starts none); none without checksums or kept checksums.

use std::collections::HashSet;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use kv_geometry::{checksum_key, ComponentLayout, ObjectChecksums, PageHash};
use kv_loader::{ModeChoice, ShareMode};
use parking_lot::{Condvar, Mutex};

use super::Inner;

/// The companions being read ahead, and the thread reading them.
#[derive(Debug, Default)]
pub(crate) struct CompanionPrefetch {
    state: Mutex<Option<Running>>,
    done: Condvar,
}

#[derive(Debug)]
struct Running {
    /// Object keys whose companions are being read.
    keys: HashSet<String>,
    /// When the read gives up.
    deadline: Instant,
    thread: Option<JoinHandle<()>>,
}

impl CompanionPrefetch {
    /// Waits (until the read's own deadline at most) while a prefetch reads the companion of
    /// any of `objects`; true if it waited.
    pub(crate) fn wait_for(&self, objects: &[&str]) -> bool {
        let mut st = self.state.lock();
        let Some(deadline) = st
            .as_ref()
            .filter(|r| objects.iter().any(|k| r.keys.contains(*k)))
            .map(|r| r.deadline)
        else {
            return false;
        };
        while st.as_ref().is_some_and(|r| !r.keys.is_empty()) {
            if self.done.wait_until(&mut st, deadline).timed_out() {
                break;
            }
        }
        true
    }

    /// Waits for a prefetch's thread to end (its read is bounded by its deadline).
    pub(crate) fn join(&self) {
        let thread = self.state.lock().as_mut().and_then(|r| r.thread.take());
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Inner {
    /// The mode this rank's next load will read in, when it can be told now.
    fn mode_ahead(&self) -> Option<ShareMode> {
        if self.group.is_none() {
            return Some(ShareMode::AllRanks);
        }
        match self.config.mode {
            ModeChoice::Fixed(m) => Some(m),
            ModeChoice::Auto => self.auto.kept(),
        }
    }

    /// The objects of `pages` this rank will read every page of, with their layouts (see the
    /// module docs); empty when that cannot be told or nothing is read ahead.
    fn objects_ahead(&self, pages: &[PageHash]) -> Vec<(String, ComponentLayout)> {
        if !self.config.verify_checksums || self.config.checksum_cache_entries == 0 {
            return Vec::new();
        }
        let rank = self.geometry.tp_rank;
        let reads = |c: &ComponentLayout| match self.mode_ahead() {
            Some(ShareMode::AllRanks) => true,
            Some(ShareMode::Rank0Broadcast) => rank == 0 || !c.replicated,
            // A share of the pages per rank (or nothing known): none ahead.
            _ => false,
        };
        let mut out = Vec::new();
        for c in self.geometry.components().iter().filter(|c| reads(c)) {
            for p in pages {
                let key = self.keys.object_key(p, c);
                if self.checksums.get(&key).is_none() {
                    out.push((key, c.clone()));
                }
            }
        }
        out
    }

    /// After a lookup that found `pages`: starts reading their companions into the kept
    /// checksums on a thread of its own (see the module docs); returns at once.
    pub(crate) fn prefetch_companions(self: &Arc<Self>, pages: &[PageHash]) {
        let objects = self.objects_ahead(pages);
        if objects.is_empty() {
            return;
        }
        let deadline = kv_loader::deadline_after(self.config.store_call_timeout);
        {
            let mut st = self.prefetch.state.lock();
            if st.as_ref().is_some_and(|r| !r.keys.is_empty()) {
                return;
            }
            // The last prefetch's thread has ended its read; reap it before the next.
            if let Some(t) = st.as_mut().and_then(|r| r.thread.take()) {
                let _ = t.join();
            }
            *st = Some(Running {
                keys: objects.iter().map(|(k, _)| k.clone()).collect(),
                deadline,
                thread: None,
            });
        }
        let inner = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("kvlink-prefetch-r{}", self.geometry.tp_rank))
            .spawn(move || inner.read_ahead(&objects, deadline));
        let mut st = self.prefetch.state.lock();
        match spawned {
            Ok(t) => {
                if let Some(r) = st.as_mut() {
                    r.thread = Some(t);
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "no thread to read companions ahead");
                *st = None;
                self.prefetch.done.notify_all();
            }
        }
    }

    /// The prefetch thread: reads the companions of `objects`, keeps those that decode and fit
    /// their layout (anything else is left to the load's own read), then says it is done.
    fn read_ahead(&self, objects: &[(String, ComponentLayout)], deadline: Instant) {
        let t0 = Instant::now();
        let companions: Vec<String> = objects.iter().map(|(k, _)| checksum_key(k)).collect();
        let keys: Vec<&str> = companions.iter().map(String::as_str).collect();
        let lens: Vec<usize> = objects
            .iter()
            .map(|(_, c)| ObjectChecksums::encoded_len(c.layers.len()))
            .collect();
        let got = self.calls.read_whole_owned(&keys, &lens, deadline);
        let mut kept = 0u64;
        for ((key, layout), r) in objects.iter().zip(got) {
            let Ok(bytes) = r else { continue };
            if let Ok(sums) =
                ObjectChecksums::decode(&bytes).and_then(|s| s.check_layout(layout).map(|()| s))
            {
                self.checksums.insert(key, sums);
                kept += 1;
            }
        }
        self.metrics.companions_prefetched(kept);
        tracing::debug!(objects = objects.len(), kept, took = ?t0.elapsed(), "companions read ahead");
        let mut st = self.prefetch.state.lock();
        if let Some(r) = st.as_mut() {
            r.keys.clear();
        }
        self.prefetch.done.notify_all();
    }
}
