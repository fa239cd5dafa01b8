//! The engine's compute time per layer, measured from the gaps between its `wait_layer` calls:
//! a thread that returns from `wait_layer(b, l)` and calls `wait_layer(b, l + 1)` later spent
//! that time on layer *l* (or on launching its kernels: a device engine whose compute runs
//! asynchronously on its stream shows only the launch time here, and should configure its
//! compute instead). Several threads may wait on one linker (an engine thread and a
//! watcher); the slowest thread's running mean is the estimate, since only a thread that
//! computes between waits has gaps longer than a wake-up. A thread may wait on several
//! batches before each layer (one per request of a forward): gaps are taken per batch, less
//! the thread's time in waits on other batches in between.

use std::thread::ThreadId;
use std::time::{Duration, Instant};

use kv_loader::BatchId;
use parking_lot::Mutex;

/// Threads followed at once (the least recently active one is forgotten first).
const MAX_THREADS: usize = 16;
/// Weight of a new gap in a thread's running mean.
const EWMA: f64 = 0.1;
/// Gaps a thread must have shown before it counts.
const MIN_GAPS: u32 = 4;
/// A thread that has not returned from a wait for this long no longer counts while another
/// thread has counted more recently.
const STALE: Duration = Duration::from_secs(60);

/// The last layer one thread got of one batch.
#[derive(Debug)]
struct LastLayer {
    batch: BatchId,
    layer: u32,
    returned: Instant,
    /// The thread's time in waits ([`Track::waited`]) at that return: waits since (on other
    /// batches) are not compute.
    waited_then: Duration,
    /// Whether the gap after `layer` was counted (a wait for the next layer that timed out
    /// and is tried again must not count it twice, the second time with the failed wait in).
    counted: bool,
}

/// One thread's gaps.
#[derive(Debug)]
struct Track {
    thread: ThreadId,
    /// Per batch it waits on (an engine may wait on several batches before each layer: one
    /// per request of its forward), the latest first-returned of each, at most
    /// [`BATCHES_PER_THREAD`].
    last: Vec<LastLayer>,
    /// When it last returned from a wait.
    active: Instant,
    /// When it entered the wait it is in, if any.
    entered: Option<Instant>,
    /// Time it spent in waits, all batches together.
    waited: Duration,
    mean: f64,
    gaps: u32,
}

/// Batches followed per thread (the least recently returned one is forgotten first).
const BATCHES_PER_THREAD: usize = 8;

impl Track {
    fn count(&mut self, gap: Duration) {
        let gap = gap.as_secs_f64();
        self.mean = if self.gaps == 0 {
            gap
        } else {
            self.mean * (1.0 - EWMA) + gap * EWMA
        };
        self.gaps = self.gaps.saturating_add(1);
    }
}

/// Running estimate of the engine's compute per layer (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct ComputeMeter {
    tracks: Mutex<Vec<Track>>,
}

impl ComputeMeter {
    /// The calling thread enters `wait_layer(batch, layer)`.
    pub(crate) fn entering(&self, batch: BatchId, layer: u32) {
        let me = std::thread::current().id();
        let now = Instant::now();
        let mut tracks = self.tracks.lock();
        let Some(t) = tracks.iter_mut().find(|t| t.thread == me) else {
            return;
        };
        t.entered = Some(now);
        let waited = t.waited;
        let Some(last) = t.last.iter_mut().find(|b| b.batch == batch) else {
            return;
        };
        if !last.counted && last.layer.checked_add(1) == Some(layer) {
            last.counted = true;
            // The time since the layer's return, less the thread's waits on other batches
            // in between (a stalled load of one request is not the engine's compute).
            let gap = now
                .saturating_duration_since(last.returned)
                .saturating_sub(waited.saturating_sub(last.waited_then));
            t.count(gap);
        }
    }

    /// The calling thread's `wait_layer(batch, layer)` returned the layer.
    pub(crate) fn returned(&self, batch: BatchId, layer: u32) {
        let me = std::thread::current().id();
        let now = Instant::now();
        let mut tracks = self.tracks.lock();
        let i = match tracks.iter().position(|t| t.thread == me) {
            Some(i) => i,
            None => {
                if tracks.len() >= MAX_THREADS {
                    if let Some(oldest) = tracks
                        .iter()
                        .enumerate()
                        .min_by_key(|(_, t)| t.active)
                        .map(|(i, _)| i)
                    {
                        tracks.swap_remove(oldest);
                    }
                }
                tracks.push(Track {
                    thread: me,
                    last: Vec::new(),
                    active: now,
                    entered: None,
                    waited: Duration::ZERO,
                    mean: 0.0,
                    gaps: 0,
                });
                tracks.len() - 1
            }
        };
        let t = &mut tracks[i];
        t.active = now;
        if let Some(entered) = t.entered.take() {
            t.waited = t
                .waited
                .saturating_add(now.saturating_duration_since(entered));
        }
        let waited = t.waited;
        match t.last.iter_mut().find(|b| b.batch == batch) {
            // A layer waited on again (an engine reads it twice) keeps its first return, so
            // the next gap is still the layer's whole compute.
            Some(last) if last.layer == layer => {}
            Some(last) => {
                last.layer = layer;
                last.returned = now;
                last.waited_then = waited;
                last.counted = false;
            }
            None => {
                if t.last.len() >= BATCHES_PER_THREAD {
                    if let Some(oldest) = t
                        .last
                        .iter()
                        .enumerate()
                        .min_by_key(|(_, b)| b.returned)
                        .map(|(i, _)| i)
                    {
                        t.last.swap_remove(oldest);
                    }
                }
                t.last.push(LastLayer {
                    batch,
                    layer,
                    returned: now,
                    waited_then: waited,
                    counted: false,
                });
            }
        }
    }

    /// The calling thread's wait ended without its layer (it failed, timed out, or the batch
    /// was cancelled): the time in it was a wait all the same, not the engine's compute.
    pub(crate) fn left(&self) {
        let me = std::thread::current().id();
        let now = Instant::now();
        let mut tracks = self.tracks.lock();
        if let Some(t) = tracks.iter_mut().find(|t| t.thread == me) {
            if let Some(entered) = t.entered.take() {
                t.waited = t
                    .waited
                    .saturating_add(now.saturating_duration_since(entered));
            }
        }
    }

    /// The compute per layer measured so far: the largest running mean of the threads active
    /// in the last minute that showed enough gaps; when none was active (an engine idle for a
    /// while), the largest of all that did (the engine's compute has not changed for being
    /// idle); `None` before any did.
    pub(crate) fn estimate(&self) -> Option<Duration> {
        let now = Instant::now();
        let tracks = self.tracks.lock();
        let largest = |fresh: bool| {
            tracks
                .iter()
                .filter(|t| t.gaps >= MIN_GAPS)
                .filter(|t| !fresh || now.saturating_duration_since(t.active) < STALE)
                .map(|t| t.mean)
                .fold(None, |acc: Option<f64>, m| {
                    Some(acc.map_or(m, |a| a.max(m)))
                })
        };
        largest(true)
            .or_else(|| largest(false))
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layers(meter: &ComputeMeter, batch: u64, n: u32, compute: Duration) {
        for l in 0..n {
            meter.entering(BatchId(batch), l);
            meter.returned(BatchId(batch), l);
            std::thread::sleep(compute);
        }
    }

    #[test]
    fn the_computing_thread_sets_the_estimate() {
        let meter = ComputeMeter::default();
        assert_eq!(meter.estimate(), None);
        std::thread::scope(|s| {
            // A watcher that waits back to back, and an engine that computes 3 ms per layer.
            s.spawn(|| layers(&meter, 1, 12, Duration::ZERO));
            s.spawn(|| layers(&meter, 1, 12, Duration::from_millis(3)));
        });
        let est = meter.estimate().expect("measured");
        assert!(est >= Duration::from_millis(3), "{est:?}");
        assert!(est < Duration::from_millis(50), "{est:?}");
    }

    #[test]
    fn gaps_across_batches_or_skipped_layers_do_not_count() {
        let meter = ComputeMeter::default();
        for l in [0u32, 2, 4, 6, 8, 10] {
            meter.entering(BatchId(1), l);
            meter.returned(BatchId(1), l);
        }
        for b in 2..10 {
            meter.entering(BatchId(b), 1);
            meter.returned(BatchId(b), 0);
        }
        assert_eq!(meter.estimate(), None);
    }

    /// A wait on another batch that fails (it timed out, or the batch failed) is a wait too:
    /// the gap over it is not compute. Before, a failed wait's time was never added to the
    /// thread's time in waits, so it counted as compute of the batch followed.
    #[test]
    fn a_failed_wait_on_another_batch_is_not_compute() {
        let meter = ComputeMeter::default();
        for l in 0..8u32 {
            meter.entering(BatchId(1), l);
            meter.returned(BatchId(1), l);
            // A wait on batch 2 that fails after 100 ms.
            meter.entering(BatchId(2), l);
            std::thread::sleep(Duration::from_millis(100));
            meter.left();
        }
        // No compute at all; counting the failed waits would give about 100 ms. The bound
        // leaves room for a loaded machine's late wake-ups.
        let est = meter.estimate().expect("measured");
        assert!(est < Duration::from_millis(50), "{est:?}");
    }

    /// A wait for the next layer that times out and is tried again counts the gap before it
    /// once: the estimate stays the compute, not compute plus the failed wait.
    #[test]
    fn a_wait_tried_again_counts_its_gap_once() {
        let meter = ComputeMeter::default();
        for l in 0..8u32 {
            meter.entering(BatchId(1), l);
            if l > 0 {
                // The first try of this layer's wait times out after 20 ms; the engine tries
                // again.
                std::thread::sleep(Duration::from_millis(20));
                meter.entering(BatchId(1), l);
            }
            meter.returned(BatchId(1), l);
        }
        let t = &meter.tracks.lock()[0];
        assert_eq!(t.gaps, 7, "one gap per layer after the first");
        assert!(t.mean < 0.005, "{}", t.mean);
    }

    /// An engine that waits on two batches before each layer (one per request of its
    /// forward). Before, each wait found the other batch's layer and no gap was counted: the
    /// estimate stayed `None` and reads were planned for no compute.
    #[test]
    fn an_engine_waiting_on_two_batches_per_layer_is_measured() {
        let meter = ComputeMeter::default();
        for l in 0..12u32 {
            for b in [1, 2] {
                meter.entering(BatchId(b), l);
                meter.returned(BatchId(b), l);
            }
            std::thread::sleep(Duration::from_millis(3));
        }
        let est = meter.estimate().expect("measured");
        assert!(est >= Duration::from_millis(3), "{est:?}");
        assert!(est < Duration::from_millis(50), "{est:?}");
    }

    /// Two batches per layer where one request's load lags: the engine's waits on batch 2
    /// (100 ms each) fall inside batch 1's gaps, and are not its compute (5 ms). Before, they
    /// were counted, and reads were planned for a compute many times the engine's.
    #[test]
    fn waits_on_another_batch_are_not_compute() {
        let meter = ComputeMeter::default();
        for l in 0..12u32 {
            meter.entering(BatchId(1), l);
            meter.returned(BatchId(1), l);
            meter.entering(BatchId(2), l);
            std::thread::sleep(Duration::from_millis(100));
            meter.returned(BatchId(2), l);
            std::thread::sleep(Duration::from_millis(5));
        }
        // Nearer the compute than compute + wait (105 ms), with room for late wake-ups.
        let est = meter.estimate().expect("measured");
        assert!(est >= Duration::from_millis(5), "{est:?}");
        assert!(est < Duration::from_millis(50), "{est:?}");
    }

    /// After a lull longer than [`STALE`] the engine's last measured compute still stands.
    /// Before, the estimate was `None` and the first batch after every lull was planned for no
    /// compute.
    #[test]
    fn an_idle_engines_compute_is_kept() {
        let meter = ComputeMeter::default();
        layers(&meter, 1, 8, Duration::from_millis(30));
        let Some(past) = Instant::now().checked_sub(STALE * 2) else {
            return; // A clock too young to go back a lull: nothing to check.
        };
        meter.tracks.lock()[0].active = past;
        let est = meter.estimate().expect("kept");
        assert!(est >= Duration::from_millis(30), "{est:?}");
        // A thread active since, with enough gaps, is the estimate instead.
        std::thread::scope(|s| {
            // Enough layers that one preempted gap fades from the running mean.
            s.spawn(|| layers(&meter, 2, 40, Duration::ZERO));
        });
        // Well under the lull's 30 ms, with room for a preempted gap or two.
        let est = meter.estimate().expect("measured");
        assert!(est < Duration::from_millis(15), "{est:?}");
    }

    #[test]
    fn a_layer_waited_on_twice_keeps_its_whole_compute() {
        let meter = ComputeMeter::default();
        for l in 0..8u32 {
            meter.entering(BatchId(1), l);
            meter.returned(BatchId(1), l);
            std::thread::sleep(Duration::from_millis(3));
            // The engine reads the layer again late in its compute: a second wait.
            meter.entering(BatchId(1), l);
            meter.returned(BatchId(1), l);
        }
        let est = meter.estimate().expect("measured");
        assert!(est >= Duration::from_millis(3), "{est:?}");
    }
}
