//! The regions registered through one Mooncake client, counted. The same region registered
//! twice (two linkers over one pool, or a registration undone late while a newer one already
//! holds the same memory) is one registration with the wheel, let go only when its last
//! holder lets go: otherwise the first unregister would take the memory away from the
//! other holder's transfers.
//!
//! Keyed by address and length while the wheel unregisters by address alone: the two cannot
//! disagree, because the wheel refuses a registration that shares any byte with one it holds
//! (`TransferEngineImpl::registerLocalMemory`, `ERR_ADDRESS_OVERLAPPED`, read in Mooncake
//! 0.3.12.post1 and later, the strings found in the pinned wheel's `store.so`): a second region
//! at the same address, or overlapping one, fails its `register` and is never counted here.

use std::collections::HashMap;

use crate::store::MemoryRegion;

/// What an unregister of a region asks the wheel to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Release {
    /// The region is not registered here: nothing to undo.
    NotHeld,
    /// Another holder still has it: one count less, the wheel keeps it.
    StillHeld,
    /// The last holder: the wheel lets it go (then [`RegionCounts::forget`]).
    Last,
}

/// Holders of each registered region (address and length).
#[derive(Debug, Default)]
pub(super) struct RegionCounts(HashMap<(usize, usize), u32>);

fn key(region: &MemoryRegion) -> (usize, usize) {
    (region.addr, region.len)
}

impl RegionCounts {
    /// True when `region` is registered here already: one holder more was counted, and the
    /// wheel is not asked again. False: register it with the wheel, then [`added`](Self::added).
    pub(super) fn hold_again(&mut self, region: &MemoryRegion) -> bool {
        match self.0.get_mut(&key(region)) {
            Some(holders) => {
                *holders = holders.saturating_add(1);
                true
            }
            None => false,
        }
    }

    /// The wheel registered `region`: its first holder.
    pub(super) fn added(&mut self, region: &MemoryRegion) {
        self.0.insert(key(region), 1);
    }

    /// What unregistering `region` means; a [`StillHeld`](Release::StillHeld) is counted at
    /// once.
    pub(super) fn release(&mut self, region: &MemoryRegion) -> Release {
        match self.0.get_mut(&key(region)) {
            None => Release::NotHeld,
            Some(holders) if *holders > 1 => {
                *holders -= 1;
                Release::StillHeld
            }
            Some(_) => Release::Last,
        }
    }

    /// The wheel let `region` go.
    pub(super) fn forget(&mut self, region: &MemoryRegion) {
        self.0.remove(&key(region));
    }

    /// The registered regions (address, length), for [`moves_in_place`] (a snapshot the
    /// store keeps beside the counts, so that transfers never wait for a registration).
    pub(super) fn regions(&self) -> Vec<(usize, usize)> {
        self.0.keys().copied().collect()
    }
}

/// True when the `len` bytes at `addr` lie inside one of `regions` (address, length).
fn covers(regions: &[(usize, usize)], addr: usize, len: usize) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    regions
        .iter()
        .any(|&(a, l)| a <= addr && a.checked_add(l).is_some_and(|e| end <= e))
}

/// Whether the wheel moves the `len` bytes at `addr` in place: over TCP any memory (the
/// transport copies through its own buffers); over any other protocol (RDMA) only memory
/// inside a registered region (`regions`), which the NIC reads and writes directly. Nothing
/// (`len` 0) always.
pub(super) fn moves_in_place(
    tcp: bool,
    regions: &[(usize, usize)],
    addr: usize,
    len: usize,
) -> bool {
    tcp || len == 0 || covers(regions, addr, len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(addr: usize, len: usize) -> MemoryRegion {
        MemoryRegion { addr, len }
    }

    /// Over RDMA only memory inside a registered region moves in place (a range that runs
    /// past a region's end, or between two regions, does not); over TCP any memory does.
    #[test]
    fn only_registered_memory_moves_in_place_over_rdma() {
        let mut c = RegionCounts::default();
        c.added(&r(4096, 64));
        c.added(&r(4160, 64));
        for (addr, len, inside) in [
            (4096, 64, true),
            (4100, 10, true),
            (4160, 64, true),
            (4150, 20, false), // across two regions
            (4200, 64, false), // past the end
            (100, 8, false),
            (usize::MAX, 2, false),
        ] {
            assert_eq!(
                moves_in_place(false, &c.regions(), addr, len),
                inside,
                "{addr}+{len}"
            );
            assert!(
                moves_in_place(true, &c.regions(), addr, len),
                "tcp: {addr}+{len}"
            );
        }
        assert!(moves_in_place(false, &c.regions(), 100, 0), "nothing moves");
    }

    #[test]
    fn a_region_registered_twice_is_let_go_by_its_last_holder_only() {
        let mut c = RegionCounts::default();
        assert!(!c.hold_again(&r(4096, 64)));
        c.added(&r(4096, 64));
        assert!(c.hold_again(&r(4096, 64)));
        assert_eq!(c.release(&r(4096, 64)), Release::StillHeld);
        assert_eq!(c.release(&r(4096, 64)), Release::Last);
        c.forget(&r(4096, 64));
        assert_eq!(c.release(&r(4096, 64)), Release::NotHeld);
    }

    #[test]
    fn regions_of_another_length_or_address_are_their_own() {
        let mut c = RegionCounts::default();
        c.added(&r(4096, 64));
        assert!(!c.hold_again(&r(4096, 128)));
        assert!(!c.hold_again(&r(8192, 64)));
        assert_eq!(c.release(&r(8192, 64)), Release::NotHeld);
        assert_eq!(c.release(&r(4096, 64)), Release::Last);
    }

    /// `MooncakeStore::unregister` asks before its wait for the store to go quiet and again
    /// after it: a register of the same memory in between keeps the region, and the waiting
    /// holder's release still counts.
    #[test]
    fn a_register_between_the_two_asks_of_an_unregister_keeps_the_region() {
        let mut c = RegionCounts::default();
        c.added(&r(4096, 64));
        assert_eq!(
            c.release(&r(4096, 64)),
            Release::Last,
            "asked before the wait"
        );
        assert!(
            c.hold_again(&r(4096, 64)),
            "registered again during the wait"
        );
        assert_eq!(
            c.release(&r(4096, 64)),
            Release::StillHeld,
            "asked after it"
        );
        assert_eq!(
            c.release(&r(4096, 64)),
            Release::Last,
            "the newer holder's own"
        );
    }

    #[test]
    fn a_failed_last_release_keeps_the_region_held() {
        let mut c = RegionCounts::default();
        c.added(&r(1, 1));
        // The wheel refused: no `forget`, so the next unregister tries again.
        assert_eq!(c.release(&r(1, 1)), Release::Last);
        assert_eq!(c.release(&r(1, 1)), Release::Last);
    }
}
