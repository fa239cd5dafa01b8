//! Smoke test of the shim against a real Mooncake master.
//!
//! Runs when `MOONCAKE_MASTER` is set (`scripts/with-mooncake.sh cargo test -p mooncake-sys`);
//! skips with a message otherwise, unless `KVLINK_REQUIRE_MOONCAKE=1`, which turns a missing
//! Mooncake into a failure (CI).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use mooncake_sys::{
    sys, CKeys, Client, ErrorCode, ErrorKind, Health, Library, MooncakeError, Range,
    ReplicateConfig, SetupArgs,
};

fn require() -> bool {
    std::env::var("KVLINK_REQUIRE_MOONCAKE").is_ok_and(|v| v == "1")
}

/// The master's address, or `None` (after saying how to enable the test) when it is not set.
#[allow(clippy::print_stderr)] // the skip message is the point
fn master_or_skip(test: &str) -> Option<String> {
    match std::env::var("MOONCAKE_MASTER") {
        Ok(m) if !m.is_empty() => Some(m),
        _ if require() => panic!(
            "{test}: KVLINK_REQUIRE_MOONCAKE=1 but MOONCAKE_MASTER is not set; run under \
             scripts/with-mooncake.sh"
        ),
        _ => {
            eprintln!(
                "skipping {test}: MOONCAKE_MASTER is not set. To run it: \
                 scripts/mooncake-build-shim.sh && scripts/with-mooncake.sh cargo test -p mooncake-sys"
            );
            None
        }
    }
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_owned())
}

fn setup_args(master: String) -> SetupArgs {
    SetupArgs {
        local_hostname: env_or("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"),
        metadata_server: env_or("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
        global_segment_size: env_or("MOONCAKE_GLOBAL_SEGMENT_SIZE", "268435456")
            .parse()
            .unwrap(),
        local_buffer_size: env_or("MOONCAKE_LOCAL_BUFFER_SIZE", "67108864")
            .parse()
            .unwrap(),
        protocol: env_or("MOONCAKE_PROTOCOL", "tcp"),
        device_name: std::env::var("MOONCAKE_DEVICE").unwrap_or_default(),
        master_server_addr: master,
        tenant_id: env_or("MOONCAKE_TENANT_ID", "default"),
    }
}

fn unique(prefix: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}-{}-{nanos}", std::process::id())
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// `soft-pinned: N` from the master's `/metrics/summary`.
fn soft_pinned(metrics: &str) -> u64 {
    let mut s = TcpStream::connect(metrics).expect("connect to the master's metrics port");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET /metrics/summary HTTP/1.0\r\nHost: {metrics}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    let at = body
        .find("soft-pinned: ")
        .unwrap_or_else(|| panic!("no 'soft-pinned:' in the master summary: {body}"));
    body[at + "soft-pinned: ".len()..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap()
}

#[test]
fn missing_library_is_an_error_not_a_panic() {
    let err = Library::open("/nonexistent/libkvlink_mooncake.so").unwrap_err();
    assert!(
        matches!(err, MooncakeError::LibraryNotFound { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("MOONCAKE_STORE_LIBRARY"), "{err}");
}

#[test]
fn smoke_against_real_master() {
    let Some(master) = master_or_skip("smoke_against_real_master") else {
        return;
    };
    let lib = Library::load_default().expect("load the Mooncake store library");

    // ABI: the shim reports what it was compiled against; load_default already refused a
    // mismatch, this spells the expectation out.
    let abi = lib
        .abi_info()
        .expect("the kvlink shim exports kvlink_mc_abi_info");
    assert_eq!(abi.abi_version, sys::KVLINK_MC_ABI_VERSION);
    assert_eq!(abi.wheel_version, sys::EXPECTED_WHEEL_VERSION);
    assert_eq!(
        abi.replicate_config_size,
        sys::EXPECTED_REPLICATE_CONFIG_SIZE
    );
    assert_eq!(
        abi.replicate_config_offsets,
        sys::EXPECTED_REPLICATE_CONFIG_OFFSETS
    );
    // The error-code table of this crate against the loaded wheel's own names, both ways.
    for &(code, name) in sys::codes::ALL {
        assert_eq!(
            lib.wheel_error_name(code).as_deref(),
            Some(name),
            "code {code}"
        );
    }
    for code in -5000..=0 {
        let name = lib.wheel_error_name(code).unwrap();
        if !name.starts_with("UNKNOWN") {
            assert_eq!(sys::code_name(code), Some(name.as_str()), "new code {code}");
        }
    }

    let client = Client::connect(lib.clone(), &setup_args(master)).expect("setup");
    assert_eq!(client.health().unwrap(), Health::Healthy);
    let cfg = ReplicateConfig::default();

    // put / get_into / get_size; first write wins.
    let a = unique("smoke-a");
    let value = pattern(7, 4096);
    client.put(&a, &value, &cfg).unwrap();
    let mut buf = vec![0u8; 8192];
    // Over a transport that moves registered memory only, the slice calls on the client's
    // own buffers are refused up front; the rest of this test needs TCP.
    if !env_or("MOONCAKE_PROTOCOL", "tcp")
        .trim()
        .eq_ignore_ascii_case("tcp")
    {
        let refused = client.get_into(&a, &mut buf).unwrap_err();
        assert!(
            matches!(
                refused,
                mooncake_sys::MooncakeError::InvalidArguments { .. }
            ),
            "{refused}"
        );
        return;
    }
    assert_eq!(client.get_into(&a, &mut buf).unwrap(), 4096);
    assert_eq!(&buf[..4096], &value[..]);
    assert_eq!(client.get_size(&a).unwrap(), 4096);
    client.put(&a, &pattern(99, 4096), &cfg).unwrap();
    assert_eq!(client.get(&a).unwrap(), value, "put must not overwrite");

    // exists / missing key.
    let missing = unique("smoke-missing");
    assert!(client.is_exist(&a).unwrap());
    assert!(!client.is_exist(&missing).unwrap());
    assert_eq!(
        client.batch_is_exist(&[&a, &missing]).unwrap(),
        vec![Ok(true), Ok(false)]
    );
    let err = client.get_into(&missing, &mut buf).unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::OBJECT_NOT_FOUND), "{err}");
    assert_eq!(err.code().unwrap().kind(), ErrorKind::NotFound);
    assert!(err.to_string().contains(&missing), "{err}");

    // Batched put / get / upsert.
    let b: Vec<String> = (0..3).map(|i| unique(&format!("smoke-b{i}"))).collect();
    let vals: Vec<Vec<u8>> = (0..3).map(|i| pattern(i as u8, 1000 + i * 100)).collect();
    let refs: Vec<&[u8]> = vals.iter().map(Vec::as_slice).collect();
    assert!(client
        .batch_put(&b, &refs, &cfg)
        .unwrap()
        .iter()
        .all(Result::is_ok));
    let mut outs: Vec<Vec<u8>> = vec![vec![0; 2000]; 3];
    let mut out_refs: Vec<&mut [u8]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
    let got = client.batch_get_into(&b, &mut out_refs).unwrap();
    for i in 0..3 {
        assert_eq!(got[i], Ok(vals[i].len() as u64));
        assert_eq!(&outs[i][..vals[i].len()], &vals[i][..]);
    }
    let newer: Vec<Vec<u8>> = (0..3).map(|i| pattern(50 + i as u8, 700)).collect();
    let newer_refs: Vec<&[u8]> = newer.iter().map(Vec::as_slice).collect();
    assert!(client
        .batch_upsert(&b, &newer_refs, &cfg)
        .unwrap()
        .iter()
        .all(Result::is_ok));
    assert_eq!(
        client.get(&b[1]).unwrap(),
        newer[1],
        "upsert must overwrite"
    );

    // Ranged reads: 2 objects of 3 "layers" of 512 bytes; read layers 2 and 0 of each into a
    // registered destination, in a read session.
    let layer = 512usize;
    let objs: Vec<String> = (0..2).map(|i| unique(&format!("smoke-r{i}"))).collect();
    let data: Vec<Vec<u8>> = (0..2).map(|i| pattern(100 + i as u8, 3 * layer)).collect();
    for (k, d) in objs.iter().zip(&data) {
        client.put(k, d, &cfg).unwrap();
    }
    let mut dst = vec![0u8; 4 * layer];
    let base = dst.as_mut_ptr();
    // SAFETY: `dst` outlives the registration (unregistered below before it is dropped).
    unsafe { client.register_buffer(base, dst.len()) }.unwrap();
    let keys = CKeys::new(&objs).unwrap();
    assert!(client
        .batch_get_session_start(&objs)
        .unwrap()
        .iter()
        .all(Result::is_ok));
    let range = |slot: usize, layer_index: usize| Range {
        // SAFETY: slot < 4, so the pointer stays inside `dst`.
        dst: unsafe { base.add(slot * layer) }.cast(),
        size: layer as u64,
        offset: (layer_index * layer) as u64,
    };
    let ranges = [range(0, 2), range(1, 0), range(2, 2), range(3, 0)];
    // SAFETY: every range is a distinct 512-byte slot of `dst`, registered above and not
    // otherwise accessed during the call.
    let got = unsafe { client.batch_get_ranges_raw(&keys, &[2, 2], &ranges) }.unwrap();
    assert_eq!(got, vec![Ok(2 * layer as u64), Ok(2 * layer as u64)]);
    client.batch_get_session_end(&objs).unwrap();
    for obj in 0..2 {
        assert_eq!(
            &dst[(2 * obj) * layer..(2 * obj + 1) * layer],
            &data[obj][2 * layer..3 * layer]
        );
        assert_eq!(
            &dst[(2 * obj + 1) * layer..(2 * obj + 2) * layer],
            &data[obj][..layer]
        );
    }
    // SAFETY: no call using the region is in flight.
    unsafe { client.unregister_buffer(base) }.unwrap();

    // ABI check through the master: soft pin is a one-byte enum in the middle of the C++
    // ReplicateConfig; if the shim's layout were off, the master would not see it.
    if let Ok(metrics) = std::env::var("MOONCAKE_MASTER_METRICS") {
        let before = soft_pinned(&metrics);
        let pinned = ReplicateConfig {
            soft_pin: true,
            ..ReplicateConfig::default()
        };
        for i in 0..3 {
            client
                .put(&unique(&format!("smoke-pin{i}")), &pattern(i, 256), &pinned)
                .unwrap();
        }
        let after = soft_pinned(&metrics);
        assert_eq!(after, before + 3, "soft-pinned count {before} -> {after}");
    } else {
        assert!(
            !require(),
            "KVLINK_REQUIRE_MOONCAKE=1 needs MOONCAKE_MASTER_METRICS for the soft-pin ABI check"
        );
    }
    // A preferred segment that does not exist must be handled, not crash.
    let odd = ReplicateConfig {
        preferred_segments: vec!["no-such-segment:1".into()],
        ..ReplicateConfig::default()
    };
    let _ = client.put(&unique("smoke-pref"), &pattern(1, 64), &odd);

    // Invalid arguments are typed errors.
    assert!(matches!(
        client.put("bad\0key", b"x", &cfg),
        Err(MooncakeError::NulInString { .. })
    ));
    let err = client.put(&unique("smoke-empty"), b"", &cfg).unwrap_err();
    assert!(err.code().is_some(), "{err}");

    // remove: `a` was just read, so it holds a read lease (10 s by default) and a plain remove
    // is refused with a lease error; a forced one goes through.
    let err = client.remove(&a, false).unwrap_err();
    assert_eq!(
        err.code().map(ErrorCode::kind),
        Some(ErrorKind::Lease),
        "{err}"
    );
    client.remove(&a, true).unwrap();
    assert!(!client.is_exist(&a).unwrap());
    let err = client.remove(&a, false).unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::OBJECT_NOT_FOUND), "{err}");
}
