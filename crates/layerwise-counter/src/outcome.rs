//! [`WaitOutcome`]: how a [`wait`](crate::LayerCounter::wait) ended.

/// How a [`wait`](crate::LayerCounter::wait) for one layer of a live ticket ended.
///
/// A ticket that is already stale when `wait` looks at it is an
/// [`Err(CounterError::StaleTicket)`](crate::CounterError::StaleTicket) instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WaitOutcome<E> {
    /// The layer and every layer below it are complete, and the hook (if any) has returned
    /// for each of them.
    Ready,
    /// The batch failed before the layer became ready; carries the first failure.
    Failed(E),
    /// The deadline passed before the layer became ready.
    TimedOut,
    /// The ticket was released ([`reset`](crate::LayerCounter::reset) or
    /// [`finish`](crate::LayerCounter::finish)) while this call was waiting.
    Cancelled,
}

impl<E> WaitOutcome<E> {
    /// True for [`WaitOutcome::Ready`].
    pub const fn is_ready(&self) -> bool {
        matches!(self, Self::Ready)
    }
}
