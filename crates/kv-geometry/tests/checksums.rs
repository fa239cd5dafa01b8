//! Per-layer object checksums: the companion object round-trips, garbage never panics its
//! parser, and the per-layer check finds any changed byte, a wrong length or a companion of
//! another layout, while objects without a companion are checked by length only.

use kv_geometry::{
    checksum_key, layer_checksum, ChecksumError, ComponentSpec, ElementType, KvGeometry, LayerMap,
    ModelKvSpec, ObjectChecksums, RowUnit, Verified,
};
use proptest::prelude::*;

/// A geometry of one token-row component on a sparse set of layers.
fn geometry(layers: u32, page: u32, row: u32, mask: &[bool]) -> KvGeometry {
    let carried: Vec<u32> = (0..layers)
        .filter(|l| mask[*l as usize % mask.len()])
        .collect();
    let map = if carried.is_empty() {
        LayerMap::Dense
    } else {
        LayerMap::Sparse(carried)
    };
    let spec = ModelKvSpec::new(
        "p",
        layers,
        page,
        vec![ComponentSpec::new("k", RowUnit::Token, ElementType::Bytes, row).on_layers(map)],
    )
    .unwrap();
    KvGeometry::new(spec, 1, 0).unwrap()
}

fn object(bytes: u64, seed: u8) -> Vec<u8> {
    (0..bytes)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

proptest! {
    #[test]
    fn companions_round_trip(layer_bytes in any::<u64>(), sums in proptest::collection::vec(any::<u64>(), 0..100)) {
        let c = ObjectChecksums { layer_bytes, sums };
        let bytes = c.encode();
        prop_assert_eq!(bytes.len(), 20 + 8 * c.sums.len() + 8);
        prop_assert_eq!(ObjectChecksums::decode(&bytes), Ok(c));
    }

    /// Garbage never panics the parser (the property is the absence of a panic: random bytes
    /// pass the trailer's hash with negligible odds; a changed good companion is refused, next).
    #[test]
    fn garbage_never_panics_the_parser(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = ObjectChecksums::decode(&bytes);
    }

    /// Random bodies behind a valid trailer reach the header's checks (random bytes alone stop
    /// at the trailer): each is refused as malformed, or decodes to checksums that encode back
    /// to exactly these bytes. Half the cases start with the magic and version, so the layer
    /// count and the reserved bytes are reached too.
    #[test]
    fn any_body_with_a_good_trailer_is_refused_or_read_back_whole(
        head in any::<bool>(),
        body in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut b = body;
        if head && b.len() >= 8 {
            b[..6].copy_from_slice(b"KVCS\x01\x01");
        }
        let trailer = xxhash_rust::xxh3::xxh3_64(&b);
        b.extend_from_slice(&trailer.to_le_bytes());
        match ObjectChecksums::decode(&b) {
            Ok(c) => prop_assert_eq!(c.encode(), b),
            Err(e) => prop_assert!(matches!(e, ChecksumError::Malformed(_)), "{e:?}"),
        }
    }

    /// A newer writer's companion (magic and trailer kept, another version or algorithm, any
    /// length past the magic and those two bytes) is `Unsupported`, never `Malformed`: a
    /// reader of version 1 must not take it for a bad one and discard a good object.
    #[test]
    fn a_whole_companion_of_another_version_is_unsupported_whatever_its_length(
        version in 1u8..=255,
        algorithm in any::<u8>(),
        rest in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        prop_assume!((version, algorithm) != (1, 1));
        let mut b = b"KVCS".to_vec();
        b.extend_from_slice(&[version, algorithm]);
        b.extend_from_slice(&rest);
        let trailer = xxhash_rust::xxh3::xxh3_64(&b);
        b.extend_from_slice(&trailer.to_le_bytes());
        prop_assert_eq!(
            ObjectChecksums::decode(&b),
            Err(ChecksumError::Unsupported { version, algorithm })
        );
    }

    #[test]
    fn a_changed_or_cut_companion_is_refused(
        sums in proptest::collection::vec(any::<u64>(), 1..20),
        at in any::<prop::sample::Index>(),
        flip in 1u8..=255,
        cut in any::<prop::sample::Index>(),
    ) {
        let bytes = ObjectChecksums { layer_bytes: 4096, sums }.encode();
        let mut changed = bytes.clone();
        changed[at.index(bytes.len())] ^= flip;
        prop_assert!(matches!(ObjectChecksums::decode(&changed), Err(ChecksumError::Malformed(_))));
        let short = &bytes[..cut.index(bytes.len())];
        prop_assert!(matches!(ObjectChecksums::decode(short), Err(ChecksumError::Malformed(_))));
    }

    /// Every layer of a good object verifies; any one changed byte of any layer does not.
    #[test]
    fn the_layer_check_finds_any_changed_byte(
        layers in 1u32..12, page in 1u32..8, row in 1u32..64,
        mask in proptest::collection::vec(any::<bool>(), 1..12),
        seed in any::<u8>(), at in any::<prop::sample::Index>(), flip in 1u8..=255,
    ) {
        let g = geometry(layers, page, row, &mask);
        let c = &g.components()[0];
        let obj = object(c.object_bytes(), seed);
        let sums = ObjectChecksums::decode(
            &ObjectChecksums::of_object(&obj, c.page_layer_bytes).unwrap().encode(),
        ).unwrap();
        let range = |l: u32| {
            let r = c.layer_range(l).unwrap();
            r.start as usize..r.end as usize
        };
        for &l in &c.layers {
            prop_assert_eq!(
                ObjectChecksums::verify_layer(Some(&sums), c, l, &obj[range(l)]),
                Ok(Verified::Checksum)
            );
        }
        let l = c.layers[at.index(c.layers.len())];
        let mut bad = obj[range(l)].to_vec();
        let i = (seed as usize * 7919) % bad.len();
        bad[i] ^= flip;
        prop_assert!(
            matches!(
                ObjectChecksums::verify_layer(Some(&sums), c, l, &bad),
                Err(ChecksumError::Mismatch { layer, .. }) if layer == l
            ),
            "byte {} of layer {} changed unnoticed", i, l
        );
        // Without a companion only the length is checked (an object SGLang wrote).
        prop_assert_eq!(ObjectChecksums::verify_layer(None, c, l, &bad), Ok(Verified::LengthOnly));
        // A checksum taken as the bytes landed gives the verdict hashing them gives.
        for bytes in [&obj[range(l)], &bad[..]] {
            prop_assert_eq!(
                ObjectChecksums::verify_layer_landed(Some(&sums), c, l, bytes, Some(layer_checksum(bytes))),
                ObjectChecksums::verify_layer(Some(&sums), c, l, bytes)
            );
        }
        // The length is checked whatever the landed checksum says.
        let long = [&obj[range(l)], &[0u8][..]].concat();
        let landed = Some(layer_checksum(&obj[range(l)]));
        prop_assert!(
            matches!(
                ObjectChecksums::verify_layer_landed(Some(&sums), c, l, &long, landed),
                Err(ChecksumError::Length { .. })
            ),
            "a range one byte too long passed on its checksum"
        );
    }
}

/// A companion whose reserved bytes are set (with a good trailer: a writer that gave them a
/// meaning without a new version) is refused. Before, it decoded as version 1.
#[test]
fn set_reserved_bytes_are_refused() {
    let mut b = ObjectChecksums {
        layer_bytes: 4096,
        sums: vec![1, 2, 3],
    }
    .encode();
    b[6] = 1;
    let n = b.len() - 8;
    let trailer = xxhash_rust::xxh3::xxh3_64(&b[..n]).to_le_bytes();
    b[n..].copy_from_slice(&trailer);
    assert!(matches!(
        ObjectChecksums::decode(&b),
        Err(ChecksumError::Malformed(m)) if m.contains("reserved")
    ));
}

#[test]
fn lengths_layers_and_layouts_are_checked() {
    let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
    let kv = g.component_by_name("k").unwrap();
    let ix = g.component_by_name("indexer").unwrap();
    let obj = object(ix.object_bytes(), 9);
    let sums = ObjectChecksums::of_object(&obj, ix.page_layer_bytes).unwrap();
    assert_eq!(sums.sums.len(), 21);
    assert_eq!(sums.sums[0], layer_checksum(&obj[..8448]));
    // Short bytes, a layer the component does not carry, a companion of the other component.
    assert!(matches!(
        ObjectChecksums::verify_layer(Some(&sums), ix, 0, &obj[..8000]),
        Err(ChecksumError::Length {
            expected: 8448,
            got: 8000,
            ..
        })
    ));
    assert!(matches!(
        ObjectChecksums::verify_layer(None, ix, 0, &obj[..8000]),
        Err(ChecksumError::Length { .. })
    ));
    assert_eq!(
        ObjectChecksums::verify_layer(Some(&sums), ix, 1, &obj[..8448]),
        Err(ChecksumError::NoLayer(1))
    );
    let kv_row = vec![0u8; kv.page_layer_bytes as usize];
    assert!(matches!(
        ObjectChecksums::verify_layer(Some(&sums), kv, 0, &kv_row),
        Err(ChecksumError::Layout { .. })
    ));
    // Objects whose length is not whole layers are refused when checksummed.
    assert!(ObjectChecksums::of_object(&obj[..100], ix.page_layer_bytes).is_err());
    assert!(ObjectChecksums::of_object(&obj, 0).is_err());
    assert_eq!(checksum_key("a_b_k"), "a_b_k_kvsum");
}

/// A layout's `layers` and `page_layer_bytes` are public: a changed copy whose layers no
/// longer reach a layer's position was indexed past its checksums (a panic), and a huge
/// `page_layer_bytes` wrapped `layer_range` in release builds.
#[test]
fn a_changed_copy_of_a_layout_is_refused_not_panicked_on() {
    let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
    let mut ix = g.component_by_name("indexer").unwrap().clone();
    let last = *ix.layers.last().unwrap();
    ix.layers.truncate(5);
    let object = vec![7u8; (5 * ix.page_layer_bytes) as usize];
    let sums = ObjectChecksums::of_object(&object, ix.page_layer_bytes).unwrap();
    let bytes = vec![7u8; ix.page_layer_bytes as usize];
    assert_eq!(
        ObjectChecksums::verify_layer(Some(&sums), &ix, last, &bytes),
        Err(ChecksumError::NoLayer(last))
    );
    ix.page_layer_bytes = u64::MAX / 2;
    let r = ix.layer_range(last).unwrap();
    assert!(r.start <= r.end, "{r:?}");
}
