//! Bytes a rank moved while loading, by direction: what the byte counters of a landing report
//! per layer, and what [`LoadStats`](crate::LoadStats) sums for a batch.

use std::ops::{Add, AddAssign};

/// Bytes one rank moved for one layer (or a whole batch), by direction.
///
/// - `host_to_device` / `device_to_host`: copies between host memory (pinned staging) and
///   this rank's device memory, i.e. what crosses PCIe on a GPU.
/// - `device_to_device`: copies inside this rank's device memory (the scatter of staged rows
///   into pool slots).
/// - `collective_received`: bytes of this rank's memory that a collective overwrote with
///   another rank's bytes (a broadcast receiver: the whole region; an all-gather: every chunk
///   but its own). `collective_sent`: bytes of this rank's own contribution that the other
///   ranks received, counted once however many ranks received them (a broadcast root: the
///   region; an all-gather: its chunk). These are the algorithm's bytes, not what a transport
///   puts on the wire (a ring forwards each byte more than once).
///
/// Host pools count only the collective directions: every other copy is a CPU copy.
///
/// ```
/// use kv_loader::TransferBytes;
/// let a = TransferBytes { host_to_device: 10, collective_received: 5, ..TransferBytes::default() };
/// let b = TransferBytes { host_to_device: 1, ..TransferBytes::default() };
/// assert_eq!((a + b).host_to_device, 11);
/// assert_eq!((a + b).pcie(), 11);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct TransferBytes {
    /// Host → this rank's device.
    pub host_to_device: u64,
    /// This rank's device → host.
    pub device_to_host: u64,
    /// Inside this rank's device memory.
    pub device_to_device: u64,
    /// Written into this rank's memory by a collective (other ranks' bytes).
    pub collective_received: u64,
    /// This rank's contribution to a collective, once per byte.
    pub collective_sent: u64,
}

impl TransferBytes {
    /// Bytes over PCIe: host→device plus device→host.
    pub fn pcie(&self) -> u64 {
        self.host_to_device.saturating_add(self.device_to_host)
    }
}

impl AddAssign for TransferBytes {
    fn add_assign(&mut self, o: TransferBytes) {
        // Counters of bytes: they saturate rather than panic on fields set by hand.
        self.host_to_device = self.host_to_device.saturating_add(o.host_to_device);
        self.device_to_host = self.device_to_host.saturating_add(o.device_to_host);
        self.device_to_device = self.device_to_device.saturating_add(o.device_to_device);
        self.collective_received = self
            .collective_received
            .saturating_add(o.collective_received);
        self.collective_sent = self.collective_sent.saturating_add(o.collective_sent);
    }
}

impl Add for TransferBytes {
    type Output = TransferBytes;
    fn add(mut self, o: TransferBytes) -> TransferBytes {
        self += o;
        self
    }
}

impl std::iter::Sum for TransferBytes {
    fn sum<I: Iterator<Item = TransferBytes>>(iter: I) -> TransferBytes {
        iter.fold(TransferBytes::default(), Add::add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counters_saturate_instead_of_panicking() {
        let full = TransferBytes {
            host_to_device: u64::MAX,
            device_to_host: 1,
            ..TransferBytes::default()
        };
        assert_eq!(full.pcie(), u64::MAX);
        let more = full + full;
        assert_eq!((more.host_to_device, more.device_to_host), (u64::MAX, 2));
        assert_eq!([full, full].into_iter().sum::<TransferBytes>(), more);
    }
}
