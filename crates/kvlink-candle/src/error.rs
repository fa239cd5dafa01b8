//! Typed errors of the adapter.

use kv_device::DeviceError;
use kv_geometry::GeometryError;
use kv_loader::KvLoadError;

/// What went wrong reading or writing a layer of the pool as tensors, or waiting for it.
///
/// [`CandleKvError::is_load_failure`] separates the one case an engine answers by
/// recomputing the prefix (the load failed) from its own bugs and bad input. Non-exhaustive:
/// match the cases you handle with a `_` arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CandleKvError {
    /// The latent format does not fit the pool's component (row size, element type, rows per
    /// page), or names a dtype the adapter cannot move.
    #[error("latent format: {0}")]
    Format(String),
    /// The component or layer is not in the geometry.
    #[error("geometry: {0}")]
    Geometry(#[from] GeometryError),
    /// The pool refused a slot (out of the pool, layer not carried, wrong length), or its
    /// copy did not finish: a `Timeout`, or `Poisoned` while an earlier copy past its limit
    /// has not ended (the device's load stream is stuck: not bad input).
    #[error("pool: {0}")]
    Pool(#[from] DeviceError),
    /// A read or write asked for tokens past the sequence's page table.
    #[error("tokens {start}..{end} need {needed} pages; the page table has {have}")]
    PageTable {
        /// First token asked for.
        start: usize,
        /// One past the last token asked for.
        end: usize,
        /// Pages those tokens span.
        needed: usize,
        /// Pages in the page table.
        have: usize,
    },
    /// A tensor of the wrong shape was handed in.
    #[error("expected a tensor of shape {expected}, got {got:?}")]
    Shape {
        /// The shape the adapter expected, in words.
        expected: String,
        /// The shape it got.
        got: Vec<usize>,
    },
    /// A layer past the loaded batch's layers.
    #[error("layer {layer} is out of range for a load of {num_layers} layers")]
    LayerOutOfRange {
        /// Layer asked for.
        layer: u32,
        /// Layers the load covers.
        num_layers: u32,
    },
    /// The load feeding this cache failed (a layer wait, or the batch outcome): the prefix
    /// is not in the pool and the engine must recompute it. `layer` is the layer whose wait
    /// failed first, `None` when the batch outcome said so.
    #[error("{}the prefix load failed: {source}", layer.map(|l| format!("layer {l}: ")).unwrap_or_default())]
    Load {
        /// The layer whose wait failed first, if a wait saw it.
        layer: Option<u32>,
        /// The loader's error: a batch outcome's is the same verdict on every TP rank; a
        /// layer wait's own failure (its deadline) may be this rank's alone.
        #[source]
        source: KvLoadError,
    },
    /// A layer wait of this rank failed (its deadline passed) but the batch then loaded: the
    /// load has settled (nothing of it still writes the slots, no reset needed), yet this
    /// rank gave the layer up, so the prefix counts as failed here: recompute it. Other TP
    /// ranks may have used the load: ranks that must agree compare their verdicts themselves.
    #[error("layer {layer}: this rank's wait failed, though the load then ended: {source}")]
    WaitFailed {
        /// The layer whose wait failed first.
        layer: u32,
        /// The wait's error.
        #[source]
        source: KvLoadError,
    },
    /// The batch's outcome could not be taken (`wait_batch` itself failed: its deadline
    /// passed, or the ticket is stale). The prefix is unusable **and the
    /// load may still be writing its slots**: `reset()` the loader (it cancels and waits for
    /// everything in flight) before recomputing into them.
    #[error("the prefix load did not settle: {source}")]
    Unsettled {
        /// The loader's error from `wait_batch`.
        #[source]
        source: KvLoadError,
    },
    /// A read reached rows of a failed load's tokens that the engine has not written again
    /// since the failure ([`PagedLatentCache::write`](crate::PagedLatentCache::write), from
    /// the load's first token on): they hold whatever the slots held before, not this prompt's KV. An engine
    /// bug (recompute the layer's rows first), not a load failure.
    #[error("layer {layer}: tokens {from}..{to} of a failed load are not recomputed yet")]
    NotRecomputed {
        /// The layer read.
        layer: u32,
        /// First token not written again.
        from: usize,
        /// One past the last stale token the read reached.
        to: usize,
    },
    /// candle refused a tensor operation.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

impl CandleKvError {
    /// What the engine does about a failed prefix load, as [`KvLoadError::action`] says it
    /// (`HoldSlots` included, which [`needs_reset`](Self::needs_reset) cannot say): a `Load`
    /// error's own action; `ResetThenRecompute` for [`Unsettled`](Self::Unsettled);
    /// `Recompute` for [`WaitFailed`](Self::WaitFailed) (the load ended). `None` for the
    /// errors that are no load's failure: the engine's own input (a format, a tensor shape, a
    /// page table, a layer, a token not recomputed, a candle operation) and the pool's own
    /// refusal or stuck copy ([`Pool`](Self::Pool): see its words).
    ///
    /// ```
    /// use kv_loader::{BatchId, EngineAction, KvLoadError};
    /// use kvlink_candle::CandleKvError;
    /// let held = CandleKvError::Load {
    ///     layer: Some(2),
    ///     source: KvLoadError::SlotsHeld { batches: vec![BatchId(1)].into() },
    /// };
    /// assert_eq!(held.action(), Some(EngineAction::HoldSlots));
    /// assert!(!held.needs_reset());
    /// ```
    pub fn action(&self) -> Option<kv_loader::EngineAction> {
        match self {
            CandleKvError::Load { source, .. } => Some(source.action()),
            CandleKvError::Unsettled { .. } => Some(kv_loader::EngineAction::ResetThenRecompute),
            CandleKvError::WaitFailed { .. } => Some(kv_loader::EngineAction::Recompute),
            // Listed, so that a new load failure cannot answer `None` unnoticed.
            CandleKvError::Format(_)
            | CandleKvError::Geometry(_)
            | CandleKvError::Pool(_)
            | CandleKvError::PageTable { .. }
            | CandleKvError::Shape { .. }
            | CandleKvError::LayerOutOfRange { .. }
            | CandleKvError::NotRecomputed { .. }
            | CandleKvError::Candle(_) => None,
        }
    }

    /// True when the loaded prefix is unusable because its load failed (or did not
    /// settle): recompute it.
    pub fn is_load_failure(&self) -> bool {
        matches!(
            self,
            CandleKvError::Load { .. }
                | CandleKvError::WaitFailed { .. }
                | CandleKvError::Unsettled { .. }
        )
    }

    /// True when the load may still be writing its slots and a reset of the loader makes them
    /// safe again: an outcome that could not be taken, and a failed load whose own error says
    /// so ([`EngineAction::ResetThenRecompute`](kv_loader::EngineAction): a layer wait past its
    /// deadline, a device error that may leave copies in flight). False for
    /// [`WaitFailed`](Self::WaitFailed): that load has ended. A `Load` whose source is
    /// `SlotsHeld` (`HoldSlots`) is false here but its slots are not free either: a reset
    /// would not free them; take the outcome (`finish`) before reusing them.
    ///
    /// ```
    /// use std::time::Duration;
    /// use kv_loader::{BatchId, KvLoadError};
    /// use kvlink_candle::CandleKvError;
    /// let timed_out = CandleKvError::Load {
    ///     layer: Some(3),
    ///     source: KvLoadError::Timeout {
    ///         batch: BatchId(1),
    ///         layer: 3,
    ///         waited: Duration::from_secs(5),
    ///     },
    /// };
    /// assert!(timed_out.needs_reset());
    /// let cancelled = CandleKvError::Load {
    ///     layer: None,
    ///     source: KvLoadError::Cancelled { batch: BatchId(1) },
    /// };
    /// assert!(!cancelled.needs_reset());
    /// ```
    pub fn needs_reset(&self) -> bool {
        match self {
            CandleKvError::Unsettled { .. } => true,
            CandleKvError::Load { source, .. } => {
                source.action() == kv_loader::EngineAction::ResetThenRecompute
            }
            _ => false,
        }
    }

    /// The kvlink error inside `e`, a candle error made from one (`?` or `From` in a function
    /// returning `candle_core::Result`, such as a mistral.rs attention layer's), through the
    /// contexts, paths and backtraces candle wraps around it, so that the engine can still ask
    /// it for its [`action`](Self::action). `None` when `e` holds none, also when it was made
    /// with `candle_core::Error::wrap` (which keeps only the words: use `?` or `into()`).
    ///
    /// ```
    /// use kv_loader::{BatchId, EngineAction, KvLoadError};
    /// use kvlink_candle::CandleKvError;
    /// fn attention() -> candle_core::Result<()> {
    ///     let failed = KvLoadError::Cancelled { batch: BatchId(1) };
    ///     Err(CandleKvError::Load { layer: Some(3), source: failed })?
    /// }
    /// let e = attention().map_err(|e| e.context("layer 3")).unwrap_err();
    /// let kv = CandleKvError::find_in(&e).expect("kept whole");
    /// assert_eq!(kv.action(), Some(EngineAction::Recompute));
    /// ```
    pub fn find_in(e: &candle_core::Error) -> Option<&CandleKvError> {
        use candle_core::Error;
        match e {
            // `From` below makes these around a kvlink error; candle's own `Context` trait
            // makes them around a candle error (which may hold one further in).
            Error::WrappedContext { wrapped, .. } => wrapped
                .downcast_ref::<CandleKvError>()
                .or_else(|| wrapped.downcast_ref::<Error>().and_then(Self::find_in)),
            Error::Context { inner, .. }
            | Error::WithBacktrace { inner, .. }
            | Error::WithPath { inner, .. } => Self::find_in(inner),
            _ => None,
        }
    }
}

/// A kvlink error as a candle error, kept whole (not as words): `?` in a function returning
/// `candle_core::Result` passes it on, and [`CandleKvError::find_in`] gets it back.
impl From<CandleKvError> for candle_core::Error {
    fn from(e: CandleKvError) -> Self {
        // candle prints this variant as the wrapped error's `Debug`, then the context's: the
        // context carries the readable words.
        let words = e.to_string();
        candle_core::Error::WrappedContext {
            wrapped: Box::new(e),
            context: words,
        }
        .bt()
    }
}

#[cfg(test)]
mod action_tests {
    use super::*;
    use kv_loader::{BatchId, EngineAction, KvLoadError};

    /// Each load failure says its action, as the loader's error would; an error that is no
    /// load's failure says none.
    #[test]
    fn each_failure_says_what_the_engine_does() {
        let batch = BatchId(1);
        let cancelled = KvLoadError::Cancelled { batch };
        let load = CandleKvError::Load {
            layer: None,
            source: cancelled.clone(),
        };
        assert_eq!(load.action(), Some(cancelled.action()));
        let unsettled = CandleKvError::Unsettled {
            source: KvLoadError::StaleTicket { batch },
        };
        assert_eq!(unsettled.action(), Some(EngineAction::ResetThenRecompute));
        assert!(unsettled.needs_reset());
        let wait = CandleKvError::WaitFailed {
            layer: 3,
            source: cancelled,
        };
        assert_eq!(wait.action(), Some(EngineAction::Recompute));
        let shape = CandleKvError::LayerOutOfRange {
            layer: 9,
            num_layers: 4,
        };
        assert_eq!(shape.action(), None);
        assert!(!shape.is_load_failure());
    }

    /// A load failure that crossed a `candle_core::Result` boundary (a mistral.rs attention
    /// layer's) is still typed: through a context, a backtrace and a path it keeps its
    /// action, `HoldSlots` included, which its words alone would not give.
    #[test]
    fn a_load_failure_inside_a_candle_error_keeps_its_action() {
        let held = KvLoadError::SlotsHeld {
            batches: vec![BatchId(4)].into(),
        };
        let as_candle: candle_core::Error = CandleKvError::Load {
            layer: Some(1),
            source: held.clone(),
        }
        .into();
        let wrapped = candle_core::Error::WithBacktrace {
            inner: Box::new(as_candle.context("attention layer 1").with_path("model")),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        };
        let found = CandleKvError::find_in(&wrapped).expect("the kvlink error, whole");
        assert_eq!(found.action(), Some(held.action()));
        assert_eq!(found.action(), Some(EngineAction::HoldSlots));
        // candle's own `Context` trait on a `candle_core::Result` wraps the candle error in
        // another `WrappedContext`: still found.
        use candle_core::Context as _;
        let traited: candle_core::Result<()> = Err(wrapped);
        let outer = traited.context("the forward pass").unwrap_err();
        let found = CandleKvError::find_in(&outer).expect("through candle's Context trait");
        assert_eq!(found.action(), Some(EngineAction::HoldSlots));
        // Made with `wrap`, only its words are left: nothing to find.
        let words = candle_core::Error::wrap(CandleKvError::LayerOutOfRange {
            layer: 9,
            num_layers: 4,
        });
        assert!(CandleKvError::find_in(&words).is_none());
    }
}
