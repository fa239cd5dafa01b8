//! kvlink's read variants: each reads every layer of every object once, through the
//! `KvStore` trait of a `MooncakeStore`.

use std::ops::Range;
use std::time::Instant;

use anyhow::{bail, Result};
use kvlink::mooncake_linker::store::{KvStore, ObjectGet, RangedGet, ReadRange, StoreError};

use crate::objects::{Component, Dest, Objects};

/// How one kvlink variant reads.
#[derive(Debug, Clone)]
pub enum Read {
    /// `get_into` (Mooncake `batch_get_into`) of every whole object, in `parallel`
    /// concurrent calls over contiguous parts of the keys (1: one call).
    Whole {
        /// Concurrent calls.
        parallel: usize,
    },
    /// Read session over every key, then one `get_ranges` per layer group, split into
    /// `parallel` concurrent calls (scoped threads, as the linker's `read_parallelism` does),
    /// into `dest`.
    Ranged {
        /// The layer groups, in order, tiling every layer.
        groups: Vec<Range<u32>>,
        /// Destination layout (`Pool`: a range per layer per object; `PageMajor`: one range).
        dest: Dest,
        /// Concurrent calls each group is split into.
        parallel: usize,
    },
}

/// Groups of `k` layers (the last one shorter) over `layers` layers.
pub fn every(k: u32, layers: u32) -> Vec<Range<u32>> {
    (0..layers)
        .step_by(k as usize)
        .map(|s| s..(s + k).min(layers))
        .collect()
}

/// What one read took: in total, and until each layer was ready (its group's call returned).
pub struct Timing {
    /// Seconds from the start to the end (session end included).
    pub total: f64,
    /// Seconds from the start until each layer was ready (empty for whole-object reads).
    pub ready: Vec<f64>,
    /// Seconds the read session's start took, at the start (0 for whole-object reads).
    pub session: f64,
}

/// The ranged reads of layers `group` of every object into `dest`.
fn group_gets(objects: &mut Objects, group: Range<u32>, dest: Dest) -> Vec<RangedGet<'_>> {
    let mut gets = Vec::new();
    for c in objects.components.iter_mut() {
        let base = c.buf.as_mut_ptr();
        let c: &Component = c;
        let positions: Vec<u32> = group
            .clone()
            .filter_map(|l| c.position[l as usize])
            .collect();
        let Some(&first) = positions.first() else {
            continue;
        };
        let lb = c.layer_bytes as usize;
        let range = |p: usize, pos: u32, layers: usize| ReadRange {
            // SAFETY: `dest_offset` of an existing page and position, plus `layers` layer
            // lengths that stay inside that page's object span: inside the component's buffer.
            dst: unsafe { base.add(c.dest_offset(dest, p, pos)) },
            len: lb * layers,
            offset: u64::from(pos) * lb as u64,
        };
        for (p, key) in c.keys.iter().enumerate() {
            let ranges = match dest {
                Dest::Pool => positions.iter().map(|&pos| range(p, pos, 1)).collect(),
                Dest::PageMajor => [range(p, first, positions.len())].into_iter().collect(),
            };
            gets.push(RangedGet { key, ranges });
        }
    }
    gets
}

/// `gets` as one call or `parallel` concurrent calls over contiguous parts.
fn get_ranges(
    store: &dyn KvStore,
    gets: &[RangedGet<'_>],
    parallel: usize,
) -> Vec<Result<u64, StoreError>> {
    // SAFETY: distinct destinations inside the bench's registered buffers, untouched by
    // anything else during the call; the parts are disjoint.
    in_parts(gets, parallel, |part| unsafe { store.get_ranges(part) })
}

/// `gets` as one call or `parallel` concurrent calls over contiguous parts.
fn get_into(
    store: &dyn KvStore,
    gets: &[ObjectGet<'_>],
    parallel: usize,
) -> Vec<Result<u64, StoreError>> {
    // SAFETY: disjoint object-sized slots of the registered buffers, untouched by anything
    // else during the call; the parts are disjoint.
    in_parts(gets, parallel, |part| unsafe { store.get_into(part) })
}

/// `call` over `items` once, or over `parallel` contiguous parts on threads of their own; the
/// results in item order.
fn in_parts<T: Sync, R: Send>(
    items: &[T],
    parallel: usize,
    call: impl Fn(&[T]) -> Vec<R> + Sync,
) -> Vec<R> {
    let parts = parallel.clamp(1, items.len().max(1));
    if parts == 1 {
        return call(items);
    }
    let chunk = items.len().div_ceil(parts);
    let call = &call;
    std::thread::scope(|s| {
        let handles: Vec<_> = items
            .chunks(chunk)
            .map(|part| s.spawn(move || call(part)))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("reader thread panicked"))
            .collect()
    })
}

fn check(results: Vec<Result<u64, StoreError>>, gets: &[RangedGet<'_>]) -> Result<()> {
    for (r, g) in results.into_iter().zip(gets) {
        match r {
            Ok(n) if n == g.expected() => {}
            other => bail!("{}: {other:?} (expected {} bytes)", g.key, g.expected()),
        }
    }
    Ok(())
}

/// Reads everything once with `read`.
pub fn run(store: &dyn KvStore, objects: &mut Objects, read: &Read) -> Result<Timing> {
    match read {
        Read::Whole { parallel } => {
            let mut gets = Vec::new();
            for c in &mut objects.components {
                let obj = c.object_bytes() as usize;
                let base = c.buf.as_mut_ptr();
                for (p, key) in c.keys.iter().enumerate() {
                    gets.push(ObjectGet {
                        key,
                        // SAFETY: object slot `p` of the component's buffer.
                        dst: unsafe { base.add(p * obj) },
                        len: obj,
                    });
                }
            }
            let start = Instant::now();
            let results = get_into(store, &gets, *parallel);
            let total = start.elapsed().as_secs_f64();
            for (r, g) in results.into_iter().zip(&gets) {
                match r {
                    Ok(n) if n == g.len as u64 => {}
                    other => bail!("{}: {other:?}", g.key),
                }
            }
            Ok(Timing {
                total,
                ready: Vec::new(),
                session: 0.0,
            })
        }
        Read::Ranged {
            groups,
            dest,
            parallel,
        } => {
            let keys: Vec<String> = objects.all_keys().into_iter().map(str::to_owned).collect();
            let names: Vec<&str> = keys.iter().map(String::as_str).collect();
            let mut ready = vec![0.0; objects.layers as usize];
            let start = Instant::now();
            let session = store.start_session(&names)?;
            let pinned = start.elapsed().as_secs_f64();
            for group in groups {
                let gets = group_gets(objects, group.clone(), *dest);
                let results = get_ranges(store, &gets, *parallel);
                check(results, &gets)?;
                let t = start.elapsed().as_secs_f64();
                for r in &mut ready[group.start as usize..group.end as usize] {
                    *r = t;
                }
            }
            store.end_session(&session)?;
            Ok(Timing {
                total: start.elapsed().as_secs_f64(),
                ready,
                session: pinned,
            })
        }
    }
}
