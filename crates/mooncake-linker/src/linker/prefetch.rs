//! Checksum companions read when a prefix is looked up, so that its load need not read them
//! before layer 0 (and, beside them on a thread of their own, the objects pinned for the load:
//! `pins_ahead`).
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
//! Only the companions this rank will read: its sharded components' (read whole by every rank in
//! every mode) and, where the mode is known (a rank alone; fixed, or kept by `Auto`), those of the
//! replicated pages the mode has it read ([`dedup_broadcast::pages_read`]: every page in `AllRanks`
//! and on rank 0 of `Rank0Broadcast`, none on its other ranks, its share in `SplitAllGather`),
//! reckoned on the looked-up pages as the batch's plan pages. A load of other pages, or a batch
//! that falls back to `AllRanks` (the group down with `ReadAlone`, plans that differ across ranks),
//! reads the companions it misses itself. One read ahead of companions at a time per linker: a
//! lookup while one runs reads none ahead, but still pins (a burst of requests looked up together:
//! each load finds its pins), on a thread of its own, at most [`KEPT`](super::pins_ahead::KEPT)
//! such threads at once. None without checksums or kept checksums (`verify_checksums`,
//! `checksum_cache_entries`). A load waits for a read ahead of its companions for a quarter of
//! `store_call_timeout` at most, then reads what is missing itself (the preflight's bounds allow
//! for that wait); `close` waits for one under way until its `wait_deadline` at most.

use std::collections::HashSet;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use kv_geometry::{ComponentLayout, ObjectChecksums, PageHash};
use kv_loader::{ModeChoice, ShareMode};
use parking_lot::{Condvar, Mutex};

use super::companion::companion_of;
use super::pins_ahead::{PinUnderWay, KEPT};
use super::Inner;

/// The companions being read ahead, and the thread reading them.
#[derive(Debug, Default)]
pub(crate) struct CompanionPrefetch {
    state: Mutex<State>,
    done: Condvar,
}

#[derive(Debug, Default)]
struct State {
    running: Option<Running>,
    generations: u64,
    /// Threads pinning for a lookup beside a read ahead (`pin_alone`), at most [`KEPT`].
    pins_alone: usize,
    /// The linker is closing: no read ahead starts.
    shut: bool,
}

#[derive(Debug)]
struct Running {
    /// Which read ahead this is (a waiter waits for its own, not a later one).
    generation: u64,
    /// Object keys whose companions are being read (emptied when the read ends).
    keys: HashSet<String>,
    /// When the read gives up.
    deadline: Instant,
    /// The thread still runs (its companions' read, its pin: `pins_ahead`).
    active: bool,
    thread: Option<JoinHandle<()>>,
}

/// The pins a lookup takes: begun at the lookup (so a load after it finds them under way),
/// and the keys whose session its thread starts.
#[derive(Debug)]
struct PinJob {
    under_way: PinUnderWay,
    keys: Vec<String>,
}

/// Longest a load waits for a read ahead of its companions: a quarter of one store call (the
/// preflight's bounds include it).
pub(crate) fn read_ahead_wait(store_call_timeout: std::time::Duration) -> std::time::Duration {
    store_call_timeout / 4
}

impl CompanionPrefetch {
    /// A read ahead is under way (its companions' read or its pin), or the linker is closing:
    /// none starts now.
    fn busy(&self) -> bool {
        let st = self.state.lock();
        st.shut || st.running.as_ref().is_some_and(|r| r.active)
    }

    /// The linker is closing: nothing is read or pinned ahead.
    fn is_shut(&self) -> bool {
        self.state.lock().shut
    }

    /// Counts a thread pinning beside a read ahead about to start: false (none may) when
    /// closing or with [`KEPT`] of them under way.
    fn pin_alone_begins(&self) -> bool {
        let mut st = self.state.lock();
        if st.shut || st.pins_alone >= KEPT {
            return false;
        }
        st.pins_alone += 1;
        true
    }

    /// A thread pinning beside a read ahead has ended (or never started).
    fn pin_alone_ended(&self) {
        let mut st = self.state.lock();
        st.pins_alone = st.pins_alone.saturating_sub(1);
        self.done.notify_all();
    }

    /// Waits while the read ahead under way reads the companion of any of `objects`, until it
    /// ends, its own deadline or `limit`, whichever is first (`waiting` is called once, before
    /// the wait); true if it waited.
    pub(crate) fn wait_for(
        &self,
        objects: &[&str],
        limit: Instant,
        waiting: impl FnOnce(),
    ) -> bool {
        let mut st = self.state.lock();
        let Some((generation, deadline)) = st
            .running
            .as_ref()
            .filter(|r| objects.iter().any(|k| r.keys.contains(*k)))
            .map(|r| (r.generation, r.deadline.min(limit)))
        else {
            return false;
        };
        waiting();
        let running = |st: &State| {
            st.running
                .as_ref()
                .is_some_and(|r| r.generation == generation && !r.keys.is_empty())
        };
        while running(&st) {
            if self.done.wait_until(&mut st, deadline).timed_out() {
                break;
            }
        }
        true
    }

    /// No read ahead starts from now on; waits for one under way as [`wait_idle`] does.
    ///
    /// [`wait_idle`]: Self::wait_idle
    pub(crate) fn shut(&self, deadline: Instant) {
        self.state.lock().shut = true;
        self.wait_idle(deadline);
    }

    /// Waits for a read ahead under way, and threads pinning beside it, until they end or
    /// `deadline`, and joins the read ahead's thread if it ended (one past the deadline ends
    /// by its own, bounded by its store call).
    pub(crate) fn wait_idle(&self, deadline: Instant) {
        let mut st = self.state.lock();
        while st.running.as_ref().is_some_and(|r| r.active) || st.pins_alone > 0 {
            if self.done.wait_until(&mut st, deadline).timed_out() {
                break;
            }
        }
        let ended = st.running.as_ref().is_some_and(|r| !r.active);
        let thread = st.running.as_mut().and_then(|r| r.thread.take());
        drop(st);
        if let (true, Some(t)) = (ended, thread) {
            let _ = t.join();
        }
    }

    /// Read ahead `generation` has read its companions: loads waiting for them go on (its
    /// pin may still be under way).
    fn companions_done(&self, generation: u64) {
        let mut st = self.state.lock();
        if let Some(r) = st.running.as_mut().filter(|r| r.generation == generation) {
            r.keys.clear();
        }
        self.done.notify_all();
    }
}

/// Ends a read ahead when its thread returns or unwinds: its keys are cleared and waiters
/// woken, so a panic cannot leave loads waiting or read-ahead off for good.
struct Ended<'a> {
    prefetch: &'a CompanionPrefetch,
    generation: u64,
}

impl Drop for Ended<'_> {
    fn drop(&mut self) {
        let mut st = self.prefetch.state.lock();
        if let Some(r) = st
            .running
            .as_mut()
            .filter(|r| r.generation == self.generation)
        {
            r.keys.clear();
            r.active = false;
        }
        self.prefetch.done.notify_all();
    }
}

/// Counts a thread pinning beside a read ahead out when it returns or unwinds.
struct PinAloneEnded<'a>(&'a CompanionPrefetch);

impl Drop for PinAloneEnded<'_> {
    fn drop(&mut self) {
        self.0.pin_alone_ended();
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

    /// The objects of `pages` this rank's load will read (see the module docs), with their
    /// components' indices in the geometry: every page of its sharded components, and of the
    /// replicated ones the pages `mode` has it read (none when the mode is not known).
    fn objects_read(&self, pages: &[PageHash], mode: Option<ShareMode>) -> Vec<(String, usize)> {
        let g = &self.geometry;
        // Replicated components: reckoned on the looked-up pages as the batch's plan pages.
        let replicated = mode.map_or(0..0, |m| {
            dedup_broadcast::pages_read(m.spec().reads, g.tp_rank(), g.tp_size(), pages.len())
        });
        let mut out = Vec::new();
        for (ci, c) in g.components().iter().enumerate() {
            let read = if c.replicated {
                &pages[replicated.clone()]
            } else {
                pages
            };
            out.extend(read.iter().map(|p| (self.keys.object_key(p, c), ci)));
        }
        out
    }

    /// Of the objects this rank will read (`objects_read`), those whose companions are read
    /// ahead: not kept yet; none without kept checksums.
    fn objects_ahead(&self, read: &[(String, usize)]) -> Vec<(String, usize)> {
        if !self.config.verify_checksums || self.config.checksum_cache_entries == 0 {
            return Vec::new();
        }
        read.iter()
            .filter(|(key, _)| self.checksums.get(key).is_none())
            .cloned()
            .collect()
    }

    /// The keys to pin ahead of the load (`pins_ahead`): every object of `read` (this rank's
    /// reads, `mode_known` if they include the replicated components'); none where the mode is
    /// not known, pins held or under way already cover them, or `pin_at_lookup` is off.
    fn pins_wanted(&self, read: &[(String, usize)], mode_known: bool) -> Option<Vec<String>> {
        if !self.config.pin_at_lookup || !mode_known || read.is_empty() {
            return None;
        }
        let keys: Vec<String> = read.iter().map(|(key, _)| key.clone()).collect();
        let fresh = self.pins_ahead.hold_fresh(&keys, self.config.lease_renewal);
        (!fresh).then_some(keys)
    }

    /// After a lookup that found `pages`: starts reading their companions into the kept
    /// checksums, and pinning the objects the load will read, on a thread of its own (see the
    /// module docs and `pins_ahead`); returns at once. While another read ahead runs it only
    /// pins, on a thread of its own (`pin_alone`).
    pub(crate) fn read_ahead_at_lookup(self: &Arc<Self>, pages: &[PageHash]) {
        if self.prefetch.is_shut() {
            return;
        }
        // The epoch is read here, at lookup, so a reset between the lookup and its thread's
        // start counts too (the pins are begun here, then taken out by the reset).
        let epoch = self.pins_ahead.epoch();
        let mode = self.mode_ahead();
        let read = self.objects_read(pages, mode);
        // Begun here, so that a load right after this lookup finds them under way.
        let pin = self.pins_wanted(&read, mode.is_some()).and_then(|keys| {
            let under_way = self.pins_ahead.begin(epoch, &keys)?;
            Some(PinJob { under_way, keys })
        });
        if self.prefetch.busy() {
            if let Some(pin) = pin {
                self.pin_alone(pin);
            }
            return;
        }
        let objects = self.objects_ahead(&read);
        if objects.is_empty() && pin.is_none() {
            return;
        }
        if let Err(pin) = self.start_read_ahead(objects, pin) {
            self.pin_alone(pin);
        }
    }

    /// Starts the read ahead of `objects`' companions, with `pin` beside it, on a thread of
    /// its own; hands `pin` back if another read ahead started meanwhile (or the linker is
    /// closing: it is then abandoned by `pin_alone`).
    fn start_read_ahead(
        self: &Arc<Self>,
        objects: Vec<(String, usize)>,
        pin: Option<PinJob>,
    ) -> Result<(), PinJob> {
        let deadline = kv_loader::deadline_after(self.config.store_call_timeout);
        let generation = {
            let mut st = self.prefetch.state.lock();
            if st.shut || st.running.as_ref().is_some_and(|r| r.active) {
                return pin.map_or(Ok(()), Err);
            }
            // The last read ahead has ended; reap its thread.
            if let Some(t) = st.running.as_mut().and_then(|r| r.thread.take()) {
                let _ = t.join();
            }
            st.generations += 1;
            st.running = Some(Running {
                generation: st.generations,
                keys: objects.iter().map(|(k, _)| k.clone()).collect(),
                deadline,
                active: true,
                thread: None,
            });
            st.generations
        };
        let inner = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("kvlink-prefetch-r{}", self.geometry.tp_rank()))
            .spawn(move || {
                let _ended = Ended {
                    prefetch: &inner.prefetch,
                    generation,
                };
                inner.read_ahead(&objects, pin, generation);
            });
        let mut st = self.prefetch.state.lock();
        match (spawned, st.running.as_mut()) {
            (Ok(t), Some(r)) if r.generation == generation => r.thread = Some(t),
            // A later read ahead took its place (this one ended meanwhile): reap it here.
            (Ok(t), _) => {
                drop(st);
                let _ = t.join();
            }
            // The pin went with the closure: abandoned.
            (Err(e), _) => {
                tracing::debug!(error = %e, "no thread to read ahead");
                if st
                    .running
                    .as_ref()
                    .is_some_and(|r| r.generation == generation)
                {
                    st.running = None;
                }
                self.prefetch.done.notify_all();
            }
        }
        Ok(())
    }

    /// Pins for a lookup while another read ahead runs (a burst of lookups), on a thread of
    /// its own: at most [`KEPT`] at once. Past that, when closing, or without a thread, the
    /// pin is abandoned and its load pins for itself.
    fn pin_alone(self: &Arc<Self>, pin: PinJob) {
        if !self.prefetch.pin_alone_begins() {
            tracing::debug!(
                keys = pin.keys.len(),
                "pins at lookup beside a read ahead: too many under way, the load pins for itself"
            );
            return;
        }
        let inner = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("kvlink-pin-r{}", self.geometry.tp_rank()))
            .spawn(move || {
                let _ended = PinAloneEnded(&inner.prefetch);
                inner.pin_ahead(pin);
            });
        if let Err(e) = spawned {
            // The pin went with the closure: abandoned.
            self.prefetch.pin_alone_ended();
            tracing::debug!(error = %e, "no thread to pin at lookup: the load pins for itself");
        }
    }

    /// The read-ahead thread: pins (on a scoped thread of its own where one can be had, so
    /// that neither waits for the other) and reads the companions of `objects`.
    fn read_ahead(&self, objects: &[(String, usize)], pin: Option<PinJob>, generation: u64) {
        // The pin's thread takes it from here; without that thread it is taken after the
        // companions' read.
        let pin = Mutex::new(pin);
        std::thread::scope(|s| {
            if pin.lock().is_some() {
                let beside = std::thread::Builder::new()
                    .name(format!("kvlink-pin-r{}", self.geometry.tp_rank()))
                    .spawn_scoped(s, || {
                        let taken = pin.lock().take();
                        if let Some(p) = taken {
                            self.pin_ahead(p);
                        }
                    });
                if let Err(e) = beside {
                    tracing::debug!(error = %e, "no thread to pin beside the companions' read: pinning after it");
                }
            }
            if !objects.is_empty() {
                self.read_companions_ahead(objects);
                self.prefetch.companions_done(generation);
            }
            let left = pin.lock().take();
            if let Some(p) = left {
                self.pin_ahead(p);
            }
        });
    }

    /// Starts the read session over the keys of `pin` for their load (`pins_ahead`), then ends
    /// the pins it replaces (after, so keys in both stay pinned throughout). None if it is no
    /// longer wanted (a load gave it up, or `reset` or `close` took it).
    fn pin_ahead(&self, pin: PinJob) {
        let PinJob { under_way, keys } = pin;
        if !under_way.wanted() {
            tracing::debug!("pins at lookup no longer wanted before their start: none taken");
            return;
        }
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let started = Instant::now();
        let deadline = kv_loader::deadline_after(self.config.store_call_timeout);
        let session = match self.calls.start_session(&refs, deadline) {
            Ok(session) => session,
            Err(e) => {
                under_way.abandon();
                tracing::debug!(error = %e, keys = keys.len(), "pinning at lookup failed: the load pins for itself");
                return;
            }
        };
        // Counted as started, wanted or not: `pins_ahead - pins_ahead_taken` is the master
        // calls a lookup made for no load.
        self.metrics.pins_ahead();
        let finished = under_way.finish(session, started);
        if let Some(unwanted) = &finished.unwanted {
            tracing::debug!(
                keys = keys.len(),
                "pins taken at lookup no longer wanted: ended"
            );
            self.end_session_logged(unwanted);
        } else {
            tracing::debug!(keys = keys.len(), took = ?started.elapsed(),
                            replaced = finished.replaced.len(), "pinned at lookup");
        }
        for replaced in &finished.replaced {
            self.end_session_logged(replaced);
        }
    }

    /// Ends the pins held ahead of loads (`reset`, `close`); pins of lookups before are not
    /// started from now on.
    pub(crate) fn end_pins_ahead(&self, by: Instant) {
        self.end_pins(self.pins_ahead.take_all(), by);
    }

    /// Ends pins taken out of `pins_ahead` (`PinsAhead::take_all`), all by `by` (what `reset`
    /// and `close` promise to return within): a session not ended by then is left to the
    /// store's lease.
    pub(crate) fn end_pins(&self, sessions: Vec<crate::store::ReadSession>, by: Instant) {
        for session in &sessions {
            self.end_session_by(session, by);
        }
    }

    /// Ends `session` (bounded by `store_call_timeout`), logging a failure: the store's lease
    /// lets the pins go on its own then.
    fn end_session_logged(&self, session: &crate::store::ReadSession) {
        self.end_session_by(
            session,
            kv_loader::deadline_after(self.config.store_call_timeout),
        );
    }

    /// Ends `session`, bounded by `by` and by `store_call_timeout`, logging a failure.
    fn end_session_by(&self, session: &crate::store::ReadSession, by: Instant) {
        let deadline = kv_loader::deadline_after(self.config.store_call_timeout).min(by);
        if let Err(e) = self.calls.end_session(session, deadline) {
            tracing::warn!(error = %e, keys = session.keys.len(), "ending pins taken at lookup failed");
        }
    }

    /// Reads the companions of `objects`, keeps those that decode and fit their layout
    /// (anything else is left to the load's own read).
    fn read_companions_ahead(&self, objects: &[(String, usize)]) {
        let comps = self.geometry.components();
        let t0 = Instant::now();
        let deadline = kv_loader::deadline_after(self.config.store_call_timeout);
        let objects: Vec<(&str, &ComponentLayout)> = objects
            .iter()
            .filter_map(|(k, ci)| Some((k.as_str(), comps.get(*ci)?)))
            .collect();
        let (companions, lens): (Vec<String>, Vec<usize>) =
            objects.iter().map(|&(k, c)| companion_of(k, c)).unzip();
        let keys: Vec<&str> = companions.iter().map(String::as_str).collect();
        let got = self.calls.read_whole_owned(&keys, &lens, deadline);
        let mut kept = 0u64;
        for (&(key, layout), r) in objects.iter().zip(got) {
            let Ok(bytes) = r else { continue };
            if let Ok(sums) = ObjectChecksums::decode_for(&bytes, layout) {
                self.checksums.insert(key, Arc::new(sums));
                kept += 1;
            }
        }
        self.metrics.companions_prefetched(kept);
        tracing::debug!(objects = objects.len(), kept, took = ?t0.elapsed(), "companions read ahead");
    }
}
