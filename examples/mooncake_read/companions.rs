//! Before the first read: what a batch's checksum companions cost. A load reads one small
//! companion per object it reads (`28 + 8 × layers` bytes, read whole) before it may publish
//! layer 0. This probe writes objects of exactly those sizes under probe keys and times
//! reading them whole in one call (`MooncakeStore::get_into`, `read_streams` 1) against
//! the store's split into concurrent calls (`read_streams` N), rounds
//! interleaved, every byte checked; then removes them.

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Result};
use kvlink::kv_geometry::ObjectChecksums;
use kvlink::mooncake_linker::store::mooncake::MooncakeStore;
use kvlink::mooncake_linker::store::{KvStore, ObjectGet, ObjectPut, PutOutcome};

use crate::objects::Objects;

/// One probe object: its key and the bytes written under it.
struct Probe {
    key: String,
    bytes: Vec<u8>,
}

/// The probe objects: one per object of `objects`, companion-sized, each a distinct pattern.
fn probes(objects: &Objects) -> Vec<Probe> {
    let mut all = Vec::new();
    for c in &objects.components {
        let len = ObjectChecksums::encoded_len(c.layers_in_object as usize);
        for key in &c.keys {
            let seed = all.len() as u8;
            let bytes = (0..len)
                .map(|i| seed.wrapping_add(i as u8).wrapping_mul(31))
                .collect();
            all.push(Probe {
                key: format!("{key}_probe"),
                bytes,
            });
        }
    }
    all
}

fn put(store: &MooncakeStore, probes: &[Probe]) -> Result<()> {
    for chunk in probes.chunks(64) {
        let puts: Vec<ObjectPut<'_>> = chunk
            .iter()
            .map(|p| ObjectPut {
                key: &p.key,
                parts: [(p.bytes.as_ptr(), p.bytes.len())].into_iter().collect(),
            })
            .collect();
        // SAFETY: every part is a live `Vec` of its stated length, not written during the call.
        for (r, p) in unsafe { store.put(&puts) }.into_iter().zip(chunk) {
            match r {
                Ok(PutOutcome::Written) | Ok(PutOutcome::AlreadyPresent) => {}
                other => bail!("put {}: {other:?}", p.key),
            }
        }
    }
    Ok(())
}

/// Reads every probe whole through `store`; the failures (a key not read whole, or bytes
/// other than written).
fn read(store: &MooncakeStore, probes: &[Probe]) -> usize {
    let mut bufs: Vec<Vec<u8>> = probes.iter().map(|p| vec![0u8; p.bytes.len()]).collect();
    let gets: Vec<ObjectGet<'_>> = probes
        .iter()
        .zip(bufs.iter_mut())
        .map(|(p, b)| ObjectGet {
            key: &p.key,
            dst: b.as_mut_ptr(),
            len: b.len(),
        })
        .collect();
    // SAFETY: each destination is a distinct owned buffer of exactly `len` bytes, alive and
    // untouched by anyone else until the call returns.
    let got = unsafe { store.get_into(&gets) };
    got.iter()
        .zip(probes.iter().zip(&bufs))
        .filter(|(r, (p, b))| !matches!(r, Ok(n) if *n == p.bytes.len() as u64 && **b == p.bytes))
        .count()
}

/// Times the companions' read in one call (`stores[0]`) and split over concurrent calls (each
/// further store configured with that many whole-read streams), `rounds` rounds interleaved.
pub fn probe(
    stores: &[(usize, &MooncakeStore)],
    objects: &Objects,
    rounds: usize,
    out: &mut dyn Write,
) -> Result<()> {
    let Some((_, first)) = stores.first() else {
        return Ok(());
    };
    let probes = probes(objects);
    put(first, &probes)?;
    let mut took: Vec<Vec<f64>> = vec![Vec::new(); stores.len()];
    let mut failed = vec![0usize; stores.len()];
    for _ in 0..rounds.max(1) {
        for (i, (_, store)) in stores.iter().enumerate() {
            let t = Instant::now();
            failed[i] += read(store, &probes);
            took[i].push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let keys: Vec<&str> = probes.iter().map(|p| p.key.as_str()).collect();
    let kept = first
        .discard(&keys)
        .into_iter()
        .filter(Result::is_err)
        .count();
    if kept > 0 {
        writeln!(out, "{kept} probe objects could not be discarded")?;
    }
    let bytes: usize = probes.iter().map(|p| p.bytes.len()).sum();
    writeln!(
        out,
        "checksum companions ({} objects, {bytes} B, read whole; {} rounds interleaved, median and min–max):",
        probes.len(),
        rounds.max(1)
    )?;
    for (i, (streams, _)) in stores.iter().enumerate() {
        let mut t = took[i].clone();
        let mid = crate::median(&mut t);
        writeln!(
            out,
            "  `read_streams` {streams}: {mid:.1} ms ({:.1}–{:.1}); keys not read right: {}",
            t.first().copied().unwrap_or(f64::NAN),
            t.last().copied().unwrap_or(f64::NAN),
            failed[i]
        )?;
    }
    Ok(())
}
