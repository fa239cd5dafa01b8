//! [`Ticket`]: the handle of one batch in a [`LayerCounter`](crate::LayerCounter).

use std::fmt;

/// The handle of one batch: a slot of the counter's fixed table and the generation the
/// slot had when [`begin`](crate::LayerCounter::begin) handed it out.
///
/// Generations are never reused within one counter, so a ticket whose slot was released
/// ([`finish`](crate::LayerCounter::finish) or [`reset`](crate::LayerCounter::reset)) and
/// handed out again is recognised as stale instead of reading the new batch's state.
///
/// Displays as `batch#<slot>.<generation>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket {
    slot: u32,
    generation: u64,
}

impl Ticket {
    /// A ticket for `slot` at `generation` (only the counter makes them).
    pub(crate) const fn new(slot: u32, generation: u64) -> Self {
        Self { slot, generation }
    }

    /// The generation of the slot this ticket was issued for (never 0).
    pub const fn generation(&self) -> u64 {
        self.generation
    }

    /// The index of the slot in the counter's table.
    pub const fn slot(&self) -> u32 {
        self.slot
    }
}

impl fmt::Display for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "batch#{}.{}", self.slot, self.generation)
    }
}

#[cfg(all(test, not(kvlink_loom)))]
mod tests {
    use super::Ticket;

    #[test]
    fn display_and_accessors() {
        let t = Ticket::new(3, 17);
        assert_eq!(t.to_string(), "batch#3.17");
        assert_eq!(t.slot(), 3);
        assert_eq!(t.generation(), 17);
        assert_ne!(t, Ticket::new(3, 18));
    }
}
