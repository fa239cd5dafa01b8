//! [`LayerCounter`]: a fixed table of [`Slot`]s, a free list and the generation counter.

use std::fmt;
use std::time::Instant;

use crate::slot::Slot;
use crate::sync::Mutex;
use crate::{CounterError, LayerHook, Ticket, WaitOutcome};

/// Number of slots of [`LayerCounter::new`] and [`LayerCounter::default`].
pub const DEFAULT_CAPACITY: u32 = 64;
/// Largest number of slots; [`LayerCounter::with_capacity`] clamps to it.
pub const MAX_CAPACITY: u32 = 1 << 16;
/// Largest number of layers of one batch ([`CounterError::TooManyLayers`] above it).
pub const MAX_LAYERS: u32 = 1 << 16;

/// Per-batch, per-layer readiness for up to `capacity` batches in flight.
///
/// `E` is the failure a batch carries to its waiters; it is cloned once per waiter that
/// returns [`WaitOutcome::Failed`], so keep it cheap to clone (an `Arc`, an enum).
///
/// See the [crate documentation](crate) for the semantics.
pub struct LayerCounter<E> {
    slots: Box<[Slot<E>]>,
    free: Mutex<FreeList>,
}

/// Slots that hold no batch.
struct FreeList {
    /// Free slot indices; `pop` takes the lowest first. Never holds more than the
    /// capacity, which it was allocated with.
    slots: Vec<u32>,
}

/// The next generation to hand out, shared by every counter of the process, so that a ticket
/// of one counter is stale for every other (its generation is never theirs). Starts at 1
/// ([`crate::slot::FREE`] is 0); 2^64 batches never happen. Not one of loom's atomics: it
/// only numbers batches, taken under the free list's lock.
static NEXT_GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl<E: Clone + Send + Sync + 'static> LayerCounter<E> {
    /// A counter with `max_in_flight` slots (clamped to [`MAX_CAPACITY`]), all allocated
    /// now. With 0 slots every `begin` is refused with [`CounterError::Full`].
    pub fn with_capacity(max_in_flight: u32) -> Self {
        let capacity = max_in_flight.min(MAX_CAPACITY);
        Self {
            slots: (0..capacity).map(|_| Slot::new()).collect(),
            free: Mutex::new(FreeList {
                slots: (0..capacity).rev().collect(),
            }),
        }
    }

    /// A counter with [`DEFAULT_CAPACITY`] slots.
    pub fn new() -> Self {
        Self::with_capacity(DEFAULT_CAPACITY)
    }

    /// Number of slots: the most batches that can be in flight at once.
    pub fn capacity(&self) -> u32 {
        // The table was built from a u32 range.
        self.slots.len() as u32
    }

    /// Starts a batch of `num_layers` layers, none complete.
    ///
    /// Errors: [`CounterError::ZeroLayers`], [`CounterError::TooManyLayers`],
    /// [`CounterError::Full`] when every slot holds a live batch.
    pub fn begin(&self, num_layers: u32) -> Result<Ticket, CounterError> {
        self.begin_inner(num_layers, None)
    }

    /// Like [`begin`](Self::begin), with a hook called as `hook(ticket, layer)` exactly once
    /// per layer, in layer order, as each layer becomes ready; see the crate docs.
    pub fn begin_with_hook(
        &self,
        num_layers: u32,
        hook: LayerHook,
    ) -> Result<Ticket, CounterError> {
        self.begin_inner(num_layers, Some(hook))
    }

    fn begin_inner(
        &self,
        num_layers: u32,
        hook: Option<LayerHook>,
    ) -> Result<Ticket, CounterError> {
        if num_layers == 0 {
            return Err(CounterError::ZeroLayers);
        }
        if num_layers > MAX_LAYERS {
            return Err(CounterError::TooManyLayers {
                num_layers,
                max: MAX_LAYERS,
            });
        }
        let (index, generation) = {
            let mut free = self.free.lock();
            let Some(index) = free.slots.pop() else {
                return Err(CounterError::Full {
                    capacity: self.capacity(),
                });
            };
            let generation = NEXT_GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            (index, generation)
        };
        let ticket = Ticket::new(index, generation);
        let Some(slot) = self.slots.get(index as usize) else {
            // Free lists hold indices of the table only.
            return Err(CounterError::Full {
                capacity: self.capacity(),
            });
        };
        slot.activate(generation, num_layers, hook);
        tracing::debug!(%ticket, num_layers, "layer counter: begin");
        Ok(ticket)
    }

    fn slot(&self, ticket: Ticket) -> Result<&Slot<E>, CounterError> {
        self.slots
            .get(ticket.slot() as usize)
            .ok_or(CounterError::StaleTicket { ticket })
    }

    /// Marks `layer` of the batch complete. Any order; completing a layer twice is a no-op,
    /// and so is completing a layer of a failed batch.
    ///
    /// When this completion extends the ready prefix and the batch has a hook, this thread
    /// may run the hook for the newly ready layers before returning (unless another thread
    /// is already running them, which then runs these too).
    ///
    /// Errors: [`CounterError::StaleTicket`], [`CounterError::LayerOutOfRange`].
    pub fn complete(&self, ticket: Ticket, layer: u32) -> Result<(), CounterError> {
        self.slot(ticket)?.complete(ticket, layer)
    }

    /// Fails the batch: every waiter of a layer not yet ready returns
    /// [`WaitOutcome::Failed`] with the first error given (later ones are dropped), and
    /// hooks stop. Layers already ready stay ready.
    ///
    /// Errors: [`CounterError::StaleTicket`].
    pub fn fail(&self, ticket: Ticket, error: E) -> Result<(), CounterError> {
        let first = self.slot(ticket)?.fail(ticket, error)?;
        tracing::debug!(%ticket, first, "layer counter: fail");
        Ok(())
    }

    /// Waits until `layer` is ready, the batch fails, the deadline passes, or the ticket is
    /// released while waiting (see [`WaitOutcome`]). A layer that is ready already
    /// returns `Ready` without a lock, a clock read or an allocation, even after a
    /// failure.
    ///
    /// Errors: [`CounterError::StaleTicket`], [`CounterError::LayerOutOfRange`].
    #[inline]
    pub fn wait(
        &self,
        ticket: Ticket,
        layer: u32,
        deadline: Instant,
    ) -> Result<WaitOutcome<E>, CounterError> {
        let slot = self.slot(ticket)?;
        match slot.snapshot(ticket.generation()) {
            Some((ready, _)) if layer < ready => Ok(WaitOutcome::Ready),
            _ => slot.wait(ticket, layer, deadline),
        }
    }

    /// Whether `layer` is ready now (never blocks, takes no lock).
    ///
    /// Errors: [`CounterError::StaleTicket`], [`CounterError::LayerOutOfRange`].
    pub fn is_ready(&self, ticket: Ticket, layer: u32) -> Result<bool, CounterError> {
        let (ready, num_layers) = self.snapshot(ticket)?;
        if layer < num_layers {
            Ok(layer < ready)
        } else {
            Err(CounterError::LayerOutOfRange {
                ticket,
                layer,
                num_layers,
            })
        }
    }

    /// Number of ready layers: the length of the ready prefix (never blocks, no lock).
    ///
    /// Errors: [`CounterError::StaleTicket`].
    pub fn ready_layers(&self, ticket: Ticket) -> Result<u32, CounterError> {
        Ok(self.snapshot(ticket)?.0)
    }

    fn snapshot(&self, ticket: Ticket) -> Result<(u32, u32), CounterError> {
        self.slot(ticket)?
            .snapshot(ticket.generation())
            .ok_or(CounterError::StaleTicket { ticket })
    }

    /// Ends the batch and frees its slot; the ticket becomes stale. Threads still waiting
    /// on it return [`WaitOutcome::Cancelled`].
    ///
    /// Errors: [`CounterError::StaleTicket`] (already finished or reset).
    pub fn finish(&self, ticket: Ticket) -> Result<(), CounterError> {
        let slot = self.slot(ticket)?;
        let Some((_, leftovers)) = slot.release(Some(ticket.generation())) else {
            return Err(CounterError::StaleTicket { ticket });
        };
        self.free.lock().slots.push(ticket.slot());
        drop(leftovers);
        tracing::trace!(%ticket, "layer counter: finish");
        Ok(())
    }

    /// Releases every live batch: their waiters return [`WaitOutcome::Cancelled`], their
    /// hooks stop, their tickets become stale. The counter stays usable. A batch begun
    /// while `reset` runs may or may not be released by it.
    pub fn reset(&self) {
        let mut cancelled = 0u32;
        for (index, slot) in (0u32..).zip(self.slots.iter()) {
            if let Some((_, leftovers)) = slot.release(None) {
                self.free.lock().slots.push(index);
                drop(leftovers);
                cancelled += 1;
            }
        }
        tracing::debug!(cancelled, "layer counter: reset");
    }

    /// Number of live batches (begun, not yet finished or reset).
    pub fn in_flight(&self) -> u32 {
        let free = self.free.lock().slots.len() as u32;
        self.capacity().saturating_sub(free)
    }
}

#[cfg(test)]
impl<E: Clone + Send + Sync + 'static> LayerCounter<E> {
    /// Threads blocked waiting on any slot now.
    pub(crate) fn waiting(&self) -> u32 {
        self.slots.iter().map(Slot::waiting).sum()
    }
}

impl<E: Clone + Send + Sync + 'static> Default for LayerCounter<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E: Clone + Send + Sync + 'static> fmt::Debug for LayerCounter<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LayerCounter")
            .field("capacity", &self.capacity())
            .field("in_flight", &self.in_flight())
            .finish()
    }
}
