//! [`CounterError`]: misuse of a [`LayerCounter`](crate::LayerCounter).

use crate::Ticket;

/// Why a [`LayerCounter`](crate::LayerCounter) call was refused. Nothing changed when
/// one is returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CounterError {
    /// The ticket was released by `finish` or `reset` (or never issued by this counter).
    #[error("stale ticket {ticket}: its batch was finished or reset")]
    StaleTicket {
        /// The stale ticket.
        ticket: Ticket,
    },
    /// The layer index is not below the ticket's number of layers.
    #[error("layer {layer} out of range for {ticket} with {num_layers} layers")]
    LayerOutOfRange {
        /// The ticket the call was for.
        ticket: Ticket,
        /// The layer asked for.
        layer: u32,
        /// The ticket's number of layers.
        num_layers: u32,
    },
    /// Every slot holds a live ticket; `finish` one first.
    #[error("layer counter full: {capacity} batches in flight")]
    Full {
        /// The number of slots of the counter.
        capacity: u32,
    },
    /// `begin` was asked for a batch of zero layers.
    #[error("a batch needs at least one layer")]
    ZeroLayers,
    /// `begin` was asked for more than [`MAX_LAYERS`](crate::MAX_LAYERS) layers.
    #[error("{num_layers} layers asked for, at most {max} supported")]
    TooManyLayers {
        /// The number of layers asked for.
        num_layers: u32,
        /// The largest number of layers a batch may have.
        max: u32,
    },
}
