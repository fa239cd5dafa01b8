//! The engine-facing trait.

use kv_geometry::PageHash;

use crate::{
    BatchOutcome, BatchPlan, KvLoadError, LayerReady, LoadTicket, LookupHit, LookupRequest,
    RawStream, SaveReport,
};

/// What an LLM server calls, on every TP rank, between its prefix cache and its attention
/// layers. Object-safe: engines hold an `Arc<dyn KvLoader>`.
///
/// The calls of one batch, in order ([`LoadHandle`](crate::LoadHandle) wraps steps 2-4 in
/// one value; docs/architecture.md, "One batch, step by step"):
/// 1. [`lookup`](KvLoader::lookup) (tokens) or [`lookup_pages`](KvLoader::lookup_pages) (page
///    hashes, what `save` takes) after the engine's own prefix match: the pages the store
///    can give (the same answer on every rank of a TP group).
/// 2. The engine allocates slots, then [`start_load`](KvLoader::start_load) on every rank in
///    the same batch order.
/// 3. Before attention on layer *l*: [`wait_layer`](KvLoader::wait_layer).
/// 4. [`wait_batch`](KvLoader::wait_batch) or [`completed`](KvLoader::completed): the
///    outcome (on failure, [`KvLoadError::action`] says what to do).
/// 5. After prefill: [`save`](KvLoader::save) of the new pages.
///
/// Every method is synchronous and may block the calling thread, each wait bounded (kvlink's
/// linker lists the bounds in docs/integration.md, "Which calls block the calling thread"):
/// an async engine calls them from `spawn_blocking` or a thread of its own, never on its
/// runtime's worker threads. [`start_load`](KvLoader::start_load) and
/// [`abandon`](KvLoader::abandon) do no I/O and return at once.
///
/// ```
/// use kv_loader::KvLoader;
/// fn assert_object_safe(_: &dyn KvLoader) {}
/// ```
pub trait KvLoader: Send + Sync {
    /// Layers of the model this loader serves.
    fn num_layers(&self) -> u32;

    /// The longest run of pages after the engine's own hit that the store holds.
    ///
    /// An implementation may start preparing the hit's load here, off the caller's thread
    /// (reading what the load will check its bytes against, pinning the objects it will
    /// read). A lookup never followed by a load must be harmless: whatever it holds is let
    /// go within a bound the implementation documents, and by [`reset`](KvLoader::reset) and
    /// [`close`](KvLoader::close).
    ///
    /// In a TP group a lookup is collective: every rank makes the same lookups in the same
    /// order, so call it (and `start_load`) from one issuer per rank (the scheduler's thread;
    /// in an async server one task awaiting each call in turn, not a task per request).
    fn lookup(&self, request: &LookupRequest<'_>) -> Result<LookupHit, KvLoadError>;

    /// [`lookup`](KvLoader::lookup) in the language of [`save`](KvLoader::save) and of a
    /// prefix cache keyed by block hash: `pages` are the prompt's page hashes from its first
    /// page (`kv_geometry::page_hashes(tokens, page_size, None)` gives them from tokens),
    /// `skip_pages` the leading pages the engine already holds. The same answer as `lookup`
    /// of those tokens; in a TP group it is collective the same way.
    fn lookup_pages(&self, pages: &[PageHash], skip_pages: usize)
        -> Result<LookupHit, KvLoadError>;

    /// Validates `plan` (typed errors, before any I/O) and starts loading it layer by layer.
    /// [`KvLoadError::Busy`] when as many batches as the loader's capacity are in flight
    /// (started, their outcomes not taken; a reset frees the count of those it ended, and
    /// kvlink's loaders take back the places of abandoned batches whose load is over): take
    /// outcomes first.
    fn start_load(&self, plan: BatchPlan) -> Result<LoadTicket, KvLoadError>;

    /// Waits (bounded by the loader's deadline) for layer `layer` of the batch. Host pools:
    /// returns [`LayerReady::Resident`] once the bytes are in the pool. Device pools: may
    /// return an event for the compute stream to wait on instead of blocking.
    ///
    /// An error here does not settle the batch: the load may still be copying another layer
    /// (a `Cancelled` from a `reset` on another thread comes before that reset has waited
    /// for the batch). Take the batch's outcome ([`wait_batch`](Self::wait_batch)) before
    /// touching its slots; the error's [`action`](KvLoadError::action) applies then. In a TP
    /// group, on a batch that fails, the last layer a rank saw ready may be one more than on
    /// another rank (a failure after the layer's status exchange): an engine whose layers run
    /// collectives of their own stops its forward pass symmetrically (a rank whose wait failed
    /// still enters them, with a failure flag).
    fn wait_layer(&self, ticket: &LoadTicket, layer: u32) -> Result<LayerReady, KvLoadError>;

    /// Waits (bounded) for the batch to finish and takes its outcome.
    fn wait_batch(&self, ticket: &LoadTicket) -> Result<BatchOutcome, KvLoadError>;

    /// Takes the outcomes of batches finished since the last call (not already taken by
    /// `wait_batch`).
    fn completed(&self) -> Vec<BatchOutcome>;

    /// The engine will not read the batch's pages (its request was aborted, its handle
    /// dropped): its slots may go to another batch's plan once the load is over, before its
    /// outcome is taken. Until then `start_load` refuses a plan that lands in a slot of a
    /// batch whose outcome is not taken (`PlanError::SlotInFlight`), so that two batches never
    /// write each other's pages. The outcome is still handed out (`wait_batch`, `completed`);
    /// once the load is over, the batch's place among those in flight is taken back when a
    /// start needs it (an implementation's bound on batches in flight, such as the linker's
    /// `max_in_flight`; its ticket then goes stale). The linker also stops the load at its
    /// next group of layers (the outcome is then `Cancelled`, or in a TP group `PeerFailed`
    /// of kind `cancelled` on every rank alike, as for a batch a reset cancels), so the
    /// batches queued behind it are not held up.
    /// A [`wait_batch`](Self::wait_batch) that times out abandons its batch the same way (the
    /// engine resets and recomputes into the slots).
    ///
    /// The default does nothing: the slots stay the batch's until its outcome is taken.
    fn abandon(&self, ticket: &LoadTicket) {
        let _ = ticket;
    }

    /// Writes the plan's pages from this rank's pool to the store, skipping objects the store
    /// already has and objects this rank does not own.
    ///
    /// Nothing orders the save after the engine's device work: on a device pool it reads the
    /// slots as they are when it runs, and stores (with checksums of those bytes) whatever
    /// the engine's kernels have not written yet. Call it once the compute that wrote the
    /// pages has finished (its stream synchronized), or use
    /// [`save_after_stream`](Self::save_after_stream) with the compute stream. Host pools are
    /// written by the engine's own thread before it calls this: nothing to order.
    ///
    /// It blocks the calling thread for the store calls it makes (kvlink's linker: one bounded
    /// wait per call, several per chunk of pages): call it off the forward thread.
    ///
    /// A save that fails because a store call outlived its deadline may leave that call
    /// reading the slots (kvlink's linker on a host pool reads them in place): the pool's
    /// claims say when they are free again (kvlink's `SlotClaims::wait_free`).
    fn save(&self, plan: &BatchPlan) -> Result<SaveReport, KvLoadError>;

    /// [`save`](Self::save), ordered after the work queued so far on `stream`, the engine's
    /// device stream whose compute wrote the pages: nothing of the pool is read before that
    /// work has run (kvlink's linker orders its gather device-side). The calling thread is
    /// blocked until the compute, the gather and the save's store calls have all run: call
    /// it off the forward thread.
    ///
    /// kvlink's linker records an event on `stream` and orders its gather after it. On a host
    /// pool it saves at once, `stream` unused: the engine writes host slots from its own
    /// thread before it calls (one that fills them with device-to-host copies on `stream`
    /// synchronizes it first). The mock records the call and saves.
    ///
    /// The default refuses ([`KvLoadError::Config`]): a loader that does not know how to
    /// order its save after `stream` must not store pages the engine may not have written.
    /// The engine then synchronizes the stream and calls `save`.
    fn save_after_stream(
        &self,
        plan: &BatchPlan,
        stream: RawStream,
    ) -> Result<SaveReport, KvLoadError> {
        let _ = (plan, stream);
        Err(KvLoadError::config(
            "this loader cannot order a save after an engine stream: synchronize the stream, \
             then call `save`",
        ))
    }

    /// Cancels every batch in flight and waits, bounded, until nothing is in flight; waiters
    /// get `Cancelled`. The loader stays usable. Outcomes not yet taken stay to be taken (by
    /// [`completed`](Self::completed)), and their batch ids stay in use until then. Of those
    /// no one takes, a loader may keep only its capacity's worth (kvlink's linker and the
    /// mock let those of abandoned batches go first, then the earliest started, with a line
    /// at `warn`, or `debug` when all are abandoned ones; never one a `SlotsHeld` answer
    /// named).
    ///
    /// The wait is bounded (kvlink's linker: its `wait_deadline`). When a batch may still
    /// write its slots at the bound (a store call past its deadline, device copies past the
    /// drain limit, or work still running),
    /// the answer is [`KvLoadError::SlotsHeld`] naming those batches: their slots must not be
    /// reused until their outcomes come (through [`completed`](Self::completed)).
    fn reset(&self) -> Result<(), KvLoadError>;

    /// Like `reset`, then releases every resource. Later `lookup`, `lookup_pages`,
    /// `start_load`, `save` and `reset` return `Closed`; `wait_batch` and `completed` still
    /// hand out the outcomes not taken yet, a layer wait on a ticket of before is
    /// `StaleTicket` (close ended its batch), and a second `close` (or one beside it) answers
    /// as the first did. Its wait is bounded as `reset`'s: `SlotsHeld` names the batches
    /// that may still write their slots.
    fn close(&self) -> Result<(), KvLoadError>;
}
