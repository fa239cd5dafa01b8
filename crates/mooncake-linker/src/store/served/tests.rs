//! The served store against the embedded store it serves: the same answers for every
//! operation, bytes straight into scattered destinations, pins released when a client
//! leaves, and bounded failures when the server goes away.

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::os::linux::net::SocketAddrExt;

use super::protocol::{frame_len, op, Enc};
use super::*;
use crate::store::{
    EmbeddedStore, KvStore, ObjectGet, ObjectPut, PutOutcome, RangedGet, ReadRange, StoreError,
};

fn serve(capacity: u64) -> (StoreServer, SocketStore) {
    let server = StoreServer::start(Arc::new(EmbeddedStore::new(capacity)), ServeAt::Unix).unwrap();
    let client = SocketStore::connect(server.address()).unwrap();
    (server, client)
}

fn put(s: &dyn KvStore, key: &str, parts: &[&[u8]]) -> Result<PutOutcome, StoreError> {
    let p = ObjectPut {
        key,
        parts: parts.iter().map(|b| (b.as_ptr(), b.len())).collect(),
    };
    // SAFETY: every part is a live slice, read-only for the call.
    unsafe { s.put(&[p]) }.remove(0)
}

fn pattern(seed: usize, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (seed * 31 + i * 7 + (i >> 9)) as u8)
        .collect()
}

#[test]
fn every_operation_answers_like_the_embedded_store() {
    let (server, client) = serve(1 << 20);
    let local = EmbeddedStore::new(1 << 20);
    let a = pattern(1, 1000);
    let b = pattern(2, 300);
    for s in [&client as &dyn KvStore, &local] {
        assert_eq!(
            put(s, "a", &[&a[..400], &a[400..]]),
            Ok(PutOutcome::Written)
        );
        assert_eq!(put(s, "a", &[&b]), Ok(PutOutcome::AlreadyPresent));
        assert_eq!(put(s, "b", &[&b]), Ok(PutOutcome::Written));
        assert!(matches!(
            put(s, "huge", &[&vec![0u8; 2 << 20]]),
            Err(StoreError::NoSpace { .. })
        ));
    }
    // The put that did not fit was drained: the connection still works.
    for s in [&client as &dyn KvStore, &local] {
        assert_eq!(
            s.exists(&["a", "b", "c"]),
            vec![Ok(true), Ok(true), Ok(false)]
        );
        assert_eq!(
            s.object_size(&["a", "c"]),
            vec![Ok(1000), Err(StoreError::NotFound { key: "c".into() })]
        );
        let mut whole = vec![0u8; 1200];
        let mut small = vec![0u8; 10];
        let mut small2 = vec![0u8; 10];
        let gets = [
            ObjectGet {
                key: "a",
                dst: whole.as_mut_ptr(),
                len: 1200,
            },
            ObjectGet {
                key: "c",
                dst: small.as_mut_ptr(),
                len: 10,
            },
            ObjectGet {
                key: "b",
                dst: small2.as_mut_ptr(),
                len: 10,
            },
        ];
        // SAFETY: destinations are live and distinct (the failing gets write nothing).
        let got = unsafe { s.get_into(&gets) };
        assert_eq!(got[0], Ok(1000));
        assert!(matches!(got[1], Err(StoreError::NotFound { .. })));
        assert!(matches!(got[2], Err(StoreError::InvalidArgument { .. })));
        assert_eq!(&whole[..1000], &a[..]);
        let mut r1 = [0u8; 5];
        let mut r2 = [0u8; 3];
        let ranged = [
            RangedGet {
                key: "a",
                ranges: [
                    ReadRange {
                        dst: r1.as_mut_ptr(),
                        len: 5,
                        offset: 995,
                    },
                    ReadRange {
                        dst: r2.as_mut_ptr(),
                        len: 3,
                        offset: 0,
                    },
                ]
                .into_iter()
                .collect(),
            },
            RangedGet {
                key: "b",
                ranges: [ReadRange {
                    dst: small.as_mut_ptr(),
                    len: 5,
                    offset: 299,
                }]
                .into_iter()
                .collect(),
            },
        ];
        // SAFETY: as above.
        let got = unsafe { s.get_ranges(&ranged) };
        assert_eq!(got[0], Ok(8));
        assert!(matches!(got[1], Err(StoreError::InvalidArgument { .. })));
        assert_eq!((&r1[..], &r2[..]), (&a[995..], &a[..3]));
        let sess = s.start_session(&["a"]).unwrap();
        s.end_session(&sess).unwrap();
        assert_eq!(
            s.remove(&["b", "b"])[1],
            Err(StoreError::NotFound { key: "b".into() })
        );
        assert_eq!(s.health(), Ok(()));
    }
    assert_eq!(server.store().len(), 1);
}

#[test]
fn a_layer_of_many_objects_lands_in_scattered_destinations() {
    let (_server, client) = serve(256 << 20);
    let objects: Vec<Vec<u8>> = (0..200).map(|i| pattern(i, 41_984 * 3)).collect();
    let keys: Vec<String> = (0..200).map(|i| format!("page{i}")).collect();
    let puts: Vec<ObjectPut<'_>> = keys
        .iter()
        .zip(&objects)
        .map(|(k, o)| ObjectPut {
            key: k,
            parts: [(o.as_ptr(), o.len())].into_iter().collect(),
        })
        .collect();
    // SAFETY: sources are live and read-only.
    assert!(unsafe { client.put(&puts) }
        .iter()
        .all(|r| *r == Ok(PutOutcome::Written)));
    // Layer 1 of every object, into slots in reverse order with gaps.
    let slot = 41_984 + 64;
    let mut pool = vec![0u8; slot * 200];
    let base = pool.as_mut_ptr();
    let gets: Vec<RangedGet<'_>> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| RangedGet {
            key: k,
            ranges: [ReadRange {
                // SAFETY: slot (199 - i) lies inside `pool`.
                dst: unsafe { base.add((199 - i) * slot) },
                len: 41_984,
                offset: 41_984,
            }]
            .into_iter()
            .collect(),
        })
        .collect();
    // SAFETY: every destination is a distinct slot of `pool`, untouched during the call.
    let got = unsafe { client.get_ranges(&gets) };
    assert!(got.iter().all(|r| *r == Ok(41_984)));
    for (i, object) in objects.iter().enumerate() {
        let s = (199 - i) * slot;
        assert!(
            pool[s..s + 41_984] == object[41_984..2 * 41_984],
            "page {i}"
        );
    }
}

#[test]
fn a_client_that_leaves_releases_its_pins() {
    let (server, client) = serve(30);
    put(&client, "a", &[&[0u8; 10]]).unwrap();
    put(&client, "b", &[&[0u8; 10]]).unwrap();
    put(&client, "c", &[&[0u8; 10]]).unwrap();
    client.start_session(&["a", "b", "c"]).unwrap();
    let other = SocketStore::connect(server.address()).unwrap();
    assert!(matches!(
        put(&other, "d", &[&[0u8; 10]]),
        Err(StoreError::NoSpace { .. })
    ));
    drop(client);
    // The server notices the closed connection shortly.
    let deadline = kv_loader::deadline_after(Duration::from_secs(10));
    loop {
        match put(&other, "d", &[&[0u8; 10]]) {
            Ok(PutOutcome::Written) => break,
            r => {
                assert!(Instant::now() < deadline, "pins never released: {r:?}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// A live client whose session end never comes (its call gave up, or the end failed) holds
/// its pins until the server's store's lease is over, not for as long as it stays connected;
/// a session start answers that lease. Before, the pins stayed until the client left, and
/// once they filled the store every put of every rank failed `NoSpace`.
#[test]
fn a_live_clients_session_never_ended_lets_go_at_the_lease() {
    let lease = Duration::from_millis(200);
    let store = Arc::new(EmbeddedStore::new(20).with_lease(Some(lease)));
    let server = StoreServer::start(store, ServeAt::Unix).unwrap();
    let client = SocketStore::connect(server.address()).unwrap();
    put(&client, "a", &[&[0u8; 10]]).unwrap();
    put(&client, "b", &[&[0u8; 10]]).unwrap();
    let left = client.start_session(&["a", "b"]).unwrap();
    assert_eq!(left.lease, Some(lease));
    std::thread::sleep(lease + Duration::from_millis(100));
    let other = SocketStore::connect(server.address()).unwrap();
    assert_eq!(put(&other, "c", &[&[0u8; 10]]), Ok(PutOutcome::Written));
    // The client is still connected; its late end does nothing.
    client.end_session(&left).unwrap();
    assert_eq!(other.exists(&["c"]), vec![Ok(true)]);
    // A store without a lease says so: pins until ended (or the client leaves).
    let (_server, unleased) = {
        let store = Arc::new(EmbeddedStore::new(20).with_lease(None));
        let server = StoreServer::start(store, ServeAt::Unix).unwrap();
        let client = SocketStore::connect(server.address()).unwrap();
        (server, client)
    };
    put(&unleased, "a", &[&[0u8; 10]]).unwrap();
    let pin = unleased.start_session(&["a"]).unwrap();
    assert_eq!(pin.lease, None);
    unleased.end_session(&pin).unwrap();
}

#[test]
fn calls_fail_fast_once_the_server_is_gone() {
    let (server, client) = serve(1 << 20);
    put(&client, "a", &[&[1u8; 10]]).unwrap();
    drop(server);
    let t = Instant::now();
    let r = client.exists(&["a", "b"]);
    assert!(
        r.iter()
            .all(|x| matches!(x, Err(StoreError::Unavailable { .. }))),
        "{r:?}"
    );
    assert!(matches!(
        client.health(),
        Err(StoreError::Unavailable { .. })
    ));
    assert!(t.elapsed() < Duration::from_secs(5));
    // The connection's I/O error is kept behind the words.
    match SocketStore::connect("unix:@kvlink-no-such-store") {
        Err(StoreError::Unavailable { detail }) => {
            assert!(
                detail.downcast_ref::<std::io::Error>().is_some(),
                "{detail:?}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(SocketStore::connect("pigeon:coop").is_err());
}

#[test]
fn concurrent_clients_and_threads_see_whole_objects() {
    let (server, client) = serve(1 << 24);
    let client = Arc::new(client);
    std::thread::scope(|s| {
        for t in 0..4u8 {
            let c = if t % 2 == 0 {
                client.clone()
            } else {
                Arc::new(SocketStore::connect(server.address()).unwrap())
            };
            s.spawn(move || {
                for i in 0..100u32 {
                    let key = format!("k{}", i % 20);
                    // Stored, or already there (a put never replaces an object).
                    put(c.as_ref(), &key, &[&[t; 512]])
                        .unwrap_or_else(|e| panic!("thread {t} put {i}: {e}"));
                    let mut out = [0u8; 512];
                    let g = ObjectGet {
                        key: &key,
                        dst: out.as_mut_ptr(),
                        len: 512,
                    };
                    // SAFETY: `out` is this thread's own.
                    let got = unsafe { c.get_into(&[g]) }.remove(0);
                    // Nothing removes or evicts it (the store holds far more): whole, one
                    // writer's bytes.
                    assert_eq!(got, Ok(512), "thread {t} get {i}");
                    assert!(out.iter().all(|&x| x == out[0] && usize::from(x) < 4));
                }
            });
        }
    });
    assert_eq!(server.store().len(), 20);
}

/// A raw connection to `server` that has said nothing yet (reads time out after 5 s).
fn silent_connection(server: &StoreServer) -> std::os::unix::net::UnixStream {
    let (at, _) = super::protocol::split_address(server.address()).unwrap();
    let name = at.strip_prefix("unix:@").unwrap();
    let a = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let raw = std::os::unix::net::UnixStream::connect_addr(&a).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    raw
}

/// A raw connection to `server` that has said hello (as a client would, or a hostile peer).
fn raw_connection(server: &StoreServer) -> std::os::unix::net::UnixStream {
    let (_, key) = super::protocol::split_address(server.address()).unwrap();
    let mut raw = silent_connection(server);
    let verdict = super::hello::by_hand::as_client(&mut raw, 0xfeed, &key.unwrap());
    assert_eq!(verdict, super::hello::answer::ACCEPTED, "hello accepted");
    raw
}

/// Connections that never say their hello hold a thread each of the process that serves the
/// store only up to a bound: past `MAX_GREETING` waiting at once, the oldest is closed once
/// it has waited `GREETING_GRACE`, and a real client (which says its hello at once) is still
/// served while the others wait. (Anyone
/// on the host may connect: the socket's name is listed in `/proc/net/unix`; the key is
/// checked only at hello.)
#[test]
fn connections_that_say_nothing_are_bounded() {
    use super::server::MAX_GREETING;
    let (server, _client) = serve(1 << 10);
    let mut silent: Vec<_> = (0..MAX_GREETING)
        .map(|_| silent_connection(&server))
        .collect();
    let until = Instant::now() + Duration::from_secs(5);
    while server.greeting() < MAX_GREETING {
        assert!(
            Instant::now() < until,
            "the silent connections were not all taken"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(super::server::GREETING_GRACE + Duration::from_millis(100));
    let t0 = Instant::now();
    let c = SocketStore::connect_with(server.address(), Duration::from_secs(5)).unwrap();
    assert_eq!(c.exists(&["k"]), vec![Ok(false)]);
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    // Well before its 5 s to say a hello: closed because it was the oldest.
    silent[0]
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    assert!(
        closed_by_server(&mut silent[0]),
        "the oldest silent one was closed"
    );
    assert!(server.greeting() <= MAX_GREETING);
}

/// A burst of more connections than `MAX_GREETING`, each saying its hello moments after it
/// connected (real clients starting together), is served whole: the oldest waiting one is
/// closed only after `GREETING_GRACE`. Before, the connection past the bound closed the
/// oldest at once, a real client's included.
#[test]
fn a_burst_of_clients_past_the_greeting_bound_is_not_cut() {
    use super::server::MAX_GREETING;
    let (server, _client) = serve(1 << 10);
    let (_, key) = super::protocol::split_address(server.address()).unwrap();
    let key = key.unwrap();
    let mut burst: Vec<_> = (0..=MAX_GREETING)
        .map(|_| silent_connection(&server))
        .collect();
    // Every connection accepted before any hello comes (the bound's worth waiting, and the
    // one past it, accepted right after them), the hellos 100 ms later: well inside the
    // grace of the oldest.
    let until = Instant::now() + Duration::from_secs(5);
    while server.greeting() < MAX_GREETING {
        assert!(Instant::now() < until, "the burst was not all taken");
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(Duration::from_millis(100));
    let hellos: Vec<_> = burst
        .iter_mut()
        .enumerate()
        .map(|(i, raw)| super::hello::by_hand::send_head(raw, 0xb00 + i as u64))
        .collect();
    for (i, (raw, said)) in burst.iter_mut().zip(&hellos).enumerate() {
        let verdict = super::hello::by_hand::finish_as_client(raw, &key, said);
        assert_eq!(
            verdict,
            super::hello::answer::ACCEPTED,
            "connection {i}: hello accepted"
        );
    }
}

/// Past `MAX_GREETING_HARD` connections waiting to say their hello, the oldest is closed at
/// once, however young: a flood cannot start threads without bound, nor make the accept
/// thread wait.
#[test]
fn a_flood_of_silent_connections_is_cut_at_the_hard_bound() {
    use super::server::MAX_GREETING_HARD;
    let (server, _client) = serve(1 << 10);
    let mut flood: Vec<_> = (0..=MAX_GREETING_HARD)
        .map(|_| silent_connection(&server))
        .collect();
    flood[0]
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    assert!(closed_by_server(&mut flood[0]), "the oldest was closed");
    assert!(server.greeting() <= MAX_GREETING_HARD);
}

/// Reads until the server closes the connection; false when it stays open past the timeout.
fn closed_by_server(raw: &mut std::os::unix::net::UnixStream) -> bool {
    use std::io::Read;
    let mut buf = [0u8; 64];
    loop {
        match raw.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(_) => return false,
        }
    }
}

#[test]
fn counts_a_request_cannot_hold_are_refused_before_anything_is_allocated() {
    use std::io::Write;
    let (server, client) = serve(1 << 20);
    // A put of u32::MAX items (32 bytes each in memory: 137 GB), and a ranged read of one key
    // with u32::MAX ranges, each in a message of a few bytes.
    let mut put = Enc::default();
    put.u8(op::PUT).u32(u32::MAX);
    let mut ranges = Enc::default();
    ranges.u8(op::GET_RANGES).u32(1).str("k").u32(u32::MAX);
    for body in [put, ranges] {
        let mut raw = raw_connection(&server);
        raw.write_all(&frame_len(&body.0)).unwrap();
        raw.write_all(&body.0).unwrap();
        assert!(
            closed_by_server(&mut raw),
            "a malformed request ends its connection"
        );
    }
    assert_eq!(client.health(), Ok(()), "the server serves on");
}

/// A request with bytes past its end (a count of one followed by two keys, say: a client of
/// another build) ends its connection instead of being answered as the shorter request it
/// starts with; the same request without them is answered.
#[test]
fn a_request_with_bytes_past_its_end_is_refused() {
    use std::io::{Read, Write};
    let (server, client) = serve(1 << 20);
    let requests = |extra: bool| {
        let mut exists = Enc::default();
        exists.u8(op::EXISTS).u32(1).str("a");
        let mut get = Enc::default();
        get.u8(op::GET_INTO).u32(1).str("a").u64(8);
        let mut ranges = Enc::default();
        ranges
            .u8(op::GET_RANGES)
            .u32(1)
            .str("a")
            .u32(1)
            .u64(0)
            .u64(1);
        let mut put = Enc::default();
        put.u8(op::PUT).u32(0);
        let mut end = Enc::default();
        end.u8(op::END_SESSION).u64(7);
        let mut health = Enc::default();
        health.u8(op::HEALTH);
        let mut all = [exists, get, ranges, put, end, health];
        if extra {
            for body in &mut all {
                body.str("b");
            }
        }
        all
    };
    for (shorter, longer) in requests(false).into_iter().zip(requests(true)) {
        let mut raw = raw_connection(&server);
        raw.write_all(&frame_len(&shorter.0)).unwrap();
        raw.write_all(&shorter.0).unwrap();
        let mut len = [0u8; 4];
        assert!(
            raw.read_exact(&mut len).is_ok(),
            "op {}: answered",
            shorter.0[0]
        );
        let mut raw = raw_connection(&server);
        raw.write_all(&frame_len(&longer.0)).unwrap();
        raw.write_all(&longer.0).unwrap();
        assert!(
            closed_by_server(&mut raw),
            "op {}: a longer request ends its connection",
            longer.0[0]
        );
    }
    assert_eq!(client.health(), Ok(()), "the server serves on");
}

/// A request naming more items than `MAX_ITEMS` ends its connection before its keys are
/// taken apart (empty keys, 4 bytes each on the wire, cost the serving process tens of bytes
/// each: a 64 MiB frame of them asked it for gigabytes); a client refuses such a call itself,
/// sending nothing, and goes on.
#[test]
fn a_request_of_more_items_than_one_may_name_is_refused() {
    use super::protocol::MAX_ITEMS;
    use std::io::Write;
    let (server, client) = serve(1 << 20);
    let mut body = Enc::default();
    body.u8(op::EXISTS).u32(MAX_ITEMS as u32 + 1);
    for _ in 0..=MAX_ITEMS {
        body.str("");
    }
    let mut raw = raw_connection(&server);
    raw.write_all(&frame_len(&body.0)).unwrap();
    raw.write_all(&body.0).unwrap();
    assert!(closed_by_server(&mut raw), "refused: the connection ends");
    let keys = vec![""; MAX_ITEMS + 1];
    let got = client.exists(&keys);
    assert_eq!(got.len(), keys.len());
    assert!(
        matches!(&got[0], Err(StoreError::InvalidArgument { detail, .. }) if detail.contains("items")),
        "{:?}",
        got[0]
    );
    assert_eq!(client.exists(&["k"]), vec![Ok(false)], "the client goes on");
}

#[test]
fn a_connection_the_server_ends_is_closed_for_its_client_at_once() {
    use std::io::Write;
    let (server, _client) = serve(1 << 20);
    let mut raw = raw_connection(&server);
    let mut body = Enc::default();
    body.u8(99);
    raw.write_all(&frame_len(&body.0)).unwrap();
    raw.write_all(&body.0).unwrap();
    // Before, the server kept a clone of every connection until it stopped: the client saw
    // no end and waited out its own timeout.
    let t0 = Instant::now();
    assert!(closed_by_server(&mut raw), "closed, not left open");
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
}

/// A fake server's listener on a fresh abstract name (`tag` in it), and its address.
fn fake_listener(tag: &str) -> (std::os::unix::net::UnixListener, String) {
    let name = format!("kvlink-{tag}-{}", std::process::id());
    let a = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let listener = std::os::unix::net::UnixListener::bind_addr(&a).unwrap();
    (listener, format!("unix:@{name}"))
}

/// The fake server's next connection, its hello read and answered as the server does.
fn accept_greeted(listener: &std::os::unix::net::UnixListener) -> std::os::unix::net::UnixStream {
    let (mut c, _) = listener.accept().unwrap();
    super::hello::by_hand::as_server(&mut c);
    c
}

/// The operation of the next request on `c` (the request read whole).
fn next_request(c: &mut std::os::unix::net::UnixStream) -> u8 {
    use std::io::Read;
    let mut len = [0u8; 4];
    c.read_exact(&mut len).unwrap();
    let mut req = vec![0u8; u32::from_le_bytes(len) as usize];
    c.read_exact(&mut req).unwrap();
    req[0]
}

/// Sends `reply` on `c` as one frame.
fn send_reply(c: &mut std::os::unix::net::UnixStream, reply: &Enc) {
    use std::io::Write;
    c.write_all(&frame_len(&reply.0)).unwrap();
    c.write_all(&reply.0).unwrap();
}

/// A health check's answer: `Ok`.
fn healthy() -> Enc {
    let mut reply = Enc::default();
    reply.result(&Ok(()), |_, _| {});
    reply
}

/// A server that answers the connect's health check late and never greets its second
/// connection: the connect fails by its one timeout. Before, the health check and the
/// anchor connection each had the whole timeout (here 1.5 s + 2 s).
#[test]
fn a_connect_ends_by_its_timeout_over_both_its_steps() {
    use std::io::Read;
    let (listener, address) = fake_listener("slow-store");
    let fake = std::thread::spawn(move || {
        let mut c = accept_greeted(&listener);
        assert_eq!(next_request(&mut c), op::HEALTH);
        std::thread::sleep(Duration::from_millis(1500));
        send_reply(&mut c, &healthy());
        // The anchor connection: its hello is read and never answered, until the client
        // closes it (or 10 s pass).
        let (mut anchor, _) = listener.accept().unwrap();
        anchor
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let _ = anchor.read_exact(&mut [0u8; 32]);
        let _ = anchor.read(&mut [0u8; 1]);
    });
    let started = Instant::now();
    let got = SocketStore::connect_with(&address, Duration::from_secs(2));
    let took = started.elapsed();
    assert!(got.is_err(), "the anchor is never greeted");
    assert!(took < Duration::from_millis(2_900), "took {took:?}");
    fake.join().unwrap();
}

#[test]
fn a_reply_with_more_results_than_keys_is_refused() {
    use std::io::Read;
    // A fake server: accepts the hello, then answers one `exists` of one key with two
    // results.
    let (listener, address) = fake_listener("fake-store");
    let fake = std::thread::spawn(move || {
        let mut c = accept_greeted(&listener);
        // The connection's health check, answered right.
        assert_eq!(next_request(&mut c), op::HEALTH);
        send_reply(&mut c, &healthy());
        // The client's idle connection, kept open while it lives.
        let _anchor = accept_greeted(&listener);
        // Then `exists`, answered with a result too many.
        assert_eq!(next_request(&mut c), op::EXISTS);
        let mut reply = Enc::default();
        for _ in 0..2 {
            reply.result(&Ok(true), |e, v| {
                e.u8(u8::from(*v));
            });
        }
        send_reply(&mut c, &reply);
        // Keep the connection until the client has read the reply.
        let _ = c.read(&mut [0u8; 1]);
    });
    let client = SocketStore::connect(&address).unwrap();
    let got = client.exists(&["a"]);
    assert!(got[0].is_err(), "{got:?}");
    drop(client);
    fake.join().unwrap();
}

#[test]
fn a_failed_pooled_connection_ends_none_of_its_clients_sessions() {
    let (server, x) = serve(3000);
    let y = SocketStore::connect(server.address()).unwrap();
    assert_eq!(put(&x, "k", &[&pattern(1, 1000)]), Ok(PutOutcome::Written));
    let _sx = x.start_session(&["k"]).unwrap();
    // X's one pooled connection fails and is dropped (as `call` drops it on any error).
    assert_eq!(x.drop_pooled(), 1);
    // Fill the store past its capacity: `k`, still pinned by X, is not evicted.
    for i in 0..5 {
        let _ = put(&y, &format!("f{i}"), &[&pattern(i + 2, 1000)]);
    }
    assert_eq!(y.exists(&["k"]), vec![Ok(true)]);
    // X itself goes: its pins go with it.
    drop(x);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        for i in 5..10 {
            let _ = put(&y, &format!("f{i}"), &[&pattern(i + 2, 1000)]);
        }
        if y.exists(&["k"]) == vec![Ok(false)] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "k stayed pinned after its client left"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_client_whose_connections_the_server_ended_goes_on_and_keeps_its_new_sessions() {
    let (server, x) = serve(3000);
    let y = SocketStore::connect(server.address()).unwrap();
    assert_eq!(put(&x, "k", &[&pattern(1, 1000)]), Ok(PutOutcome::Written));
    // Every connection ends, X's anchor and pooled ones among them (as a restart would).
    assert!(server.end_connections() >= 4);
    // A call goes on a fresh connection, not on the closed pooled one.
    assert_eq!(x.health(), Ok(()));
    assert_eq!(y.exists(&["k"]), vec![Ok(true)]);
    // A session started now is kept by a reopened anchor: X's pooled connection may fail
    // and go, and `k` stays pinned while others fill the store past its capacity.
    let _sx = x.start_session(&["k"]).unwrap();
    assert_eq!(x.drop_pooled(), 1);
    let watch = Instant::now() + Duration::from_millis(500);
    let mut i = 0;
    while Instant::now() < watch {
        let _ = put(&y, &format!("f{}", i % 8), &[&pattern(i + 2, 1000)]);
        assert_eq!(
            y.exists(&["k"]),
            vec![Ok(true)],
            "k was evicted after {i} puts"
        );
        i += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_request_over_the_frame_limit_is_refused_unsent_and_the_client_goes_on() {
    let (_server, x) = serve(1 << 20);
    let long = "k".repeat(1 << 20);
    let keys: Vec<&str> = std::iter::repeat_n(long.as_str(), 65).collect();
    let got = x.exists(&keys);
    assert!(
        got.iter()
            .all(|r| matches!(r, Err(StoreError::InvalidArgument { .. }))),
        "{:?}",
        got.first()
    );
    assert_eq!(x.health(), Ok(()));
}

#[test]
fn a_client_lets_go_only_of_the_pins_it_took() {
    let (server, x) = serve(3000);
    let y = SocketStore::connect(server.address()).unwrap();
    // X's session on `k` before `k` exists is refused (as Mooncake refuses it) and pins
    // nothing; one X started and ended on another object is one it ends again below.
    assert!(x.start_session(&["k"]).is_err());
    assert_eq!(put(&y, "j", &[&pattern(9, 10)]), Ok(PutOutcome::Written));
    let sx = x.start_session(&["j"]).unwrap();
    assert_eq!(put(&y, "k", &[&pattern(1, 1000)]), Ok(PutOutcome::Written));
    let _sy = y.start_session(&["k"]).unwrap();
    // X ends its session twice, then leaves: none of that may take Y's pin.
    x.end_session(&sx).unwrap();
    x.end_session(&sx).unwrap();
    drop(x);
    // Fill the store past its capacity: `k`, pinned by Y, is not evicted.
    for i in 0..5 {
        let _ = put(&y, &format!("f{i}"), &[&pattern(i + 2, 1000)]);
    }
    assert_eq!(y.exists(&["k"]), vec![Ok(true)]);
}

#[test]
fn a_connect_to_a_listener_whose_backlog_stays_full_ends_by_its_deadline() {
    use socket2::{Domain, SockAddr, Socket, Type};
    use std::os::unix::ffi::OsStrExt;
    // A listener that never accepts, with the smallest backlog, filled by connections that
    // stay open: std's blocking connect waited on it for good.
    let name = format!("kvlink-test-full-backlog-{}", std::process::id());
    let path = [&[0u8][..], name.as_bytes()].concat();
    let addr = SockAddr::unix(std::ffi::OsStr::from_bytes(&path)).unwrap();
    let listener = Socket::new(Domain::UNIX, Type::STREAM, None).unwrap();
    listener.bind(&addr).unwrap();
    listener.listen(0).unwrap();
    let mut queued = Vec::new();
    loop {
        let s = Socket::new(Domain::UNIX, Type::STREAM, None).unwrap();
        s.set_nonblocking(true).unwrap();
        match s.connect(&addr) {
            Ok(()) => queued.push(s),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("filling the backlog: {e}"),
        }
        assert!(queued.len() < 1000, "the backlog never filled");
    }
    let address = format!("unix:@{name}");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = SocketStore::connect_with(&address, Duration::from_millis(300)).map(drop);
        let _ = tx.send((r, t0.elapsed()));
    });
    let (r, took) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the connect returns, not blocks on the full backlog");
    // A connect that ran out its deadline is the request timeout, not an unreachable store.
    assert!(matches!(r, Err(StoreError::RpcTimeout { .. })), "{r:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    drop(queued);
}

#[test]
fn a_session_over_an_object_written_again_keeps_only_its_own_pin() {
    let (server, x) = serve(3000);
    let y = SocketStore::connect(server.address()).unwrap();
    assert_eq!(put(&x, "k", &[&pattern(1, 1000)]), Ok(PutOutcome::Written));
    let sx = x.start_session(&["k"]).unwrap();
    // A pinned object is not removed, but discarded (it was found bad), then written again.
    assert!(matches!(
        &x.remove(&["k"])[0],
        Err(StoreError::Lease { .. })
    ));
    assert_eq!(x.discard(&["k"]), vec![Ok(())]);
    assert_eq!(put(&y, "k", &[&pattern(2, 1000)]), Ok(PutOutcome::Written));
    let _sy = y.start_session(&["k"]).unwrap();
    // X's end names its own session: before, it let go of one pin of the key `k`, which
    // was now Y's.
    x.end_session(&sx).unwrap();
    for i in 0..5 {
        let _ = put(&x, &format!("f{i}"), &[&pattern(i + 3, 1000)]);
    }
    assert_eq!(y.exists(&["k"]), vec![Ok(true)]);
}

/// A server on the unspecified address of either family stops within a bound: its wake-up
/// connects to that family's loopback address. (Whether `[::]` also takes IPv4 depends on the
/// host's `net.ipv6.bindv6only`, which a test cannot set for `TcpListener::bind`.)
#[test]
fn a_tcp_server_on_an_unspecified_address_of_either_family_stops() {
    for at in ["0.0.0.0:0", "[::]:0"] {
        let addr: std::net::SocketAddr = at.parse().unwrap();
        let server =
            match StoreServer::start(Arc::new(EmbeddedStore::new(1 << 10)), ServeAt::Tcp(addr)) {
                Ok(s) => s,
                // A host without IPv6 cannot bind `[::]`: nothing to stop.
                Err(e) if addr.is_ipv6() => {
                    tracing::info!(at, error = %e, "not bound here; skipped");
                    continue;
                }
                Err(e) => panic!("{at}: {e}"),
            };
        match SocketStore::connect(server.address()) {
            Ok(client) => assert_eq!(client.exists(&["k"]), vec![Ok(false)], "{at}: served"),
            // A host whose loopback of this family is off: bound, not reachable that way.
            Err(e) if addr.is_ipv6() => tracing::info!(at, error = %e, "not reachable here"),
            Err(e) => panic!("{at}: {e}"),
        }
        let (done, stopped) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(server);
            let _ = done.send(());
        });
        assert!(
            stopped.recv_timeout(Duration::from_secs(10)).is_ok(),
            "{at}: the server did not stop"
        );
    }
}

/// A `tcp:` address by name is looked up within the client's request timeout (on a thread of
/// its own, which the system's resolver has no deadline for) and connected at the first of
/// its addresses that accepts; one that does not resolve fails the connect within the bound,
/// and one that is not `host:port` fails as unavailable at once.
#[test]
fn a_tcp_address_by_name_is_looked_up_within_the_request_timeout() {
    let addr: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    let server =
        StoreServer::start(Arc::new(EmbeddedStore::new(1 << 10)), ServeAt::Tcp(addr)).unwrap();
    let (at, key) = server.address().split_once('#').unwrap();
    let port = at.rsplit_once(':').unwrap().1.to_string();
    let client = SocketStore::connect(&format!("tcp:localhost:{port}#{key}")).unwrap();
    assert_eq!(client.exists(&["k"]), vec![Ok(false)], "served by name");
    // `.invalid` never resolves (RFC 6761).
    let wait = Duration::from_millis(1500);
    let t0 = Instant::now();
    let r = SocketStore::connect_with("tcp:store.kvlink.invalid:7000", wait);
    assert!(
        matches!(
            r,
            Err(StoreError::Unavailable { .. } | StoreError::RpcTimeout { .. })
        ),
        "{r:?}"
    );
    assert!(
        t0.elapsed() < wait + Duration::from_secs(1),
        "{:?}",
        t0.elapsed()
    );
    let r = SocketStore::connect_with("tcp:no-port", wait);
    assert!(
        matches!(&r, Err(StoreError::Unavailable { detail }) if detail.to_string().contains("no port")),
        "{r:?}"
    );
}

/// The server's address carries its key: a client without it, or with another server's, is
/// refused at hello (over TCP as over a Unix socket), and the refusal says why; the address
/// with the key connects.
#[test]
fn a_client_without_the_servers_key_is_refused() {
    for at in [ServeAt::Unix, ServeAt::Tcp("127.0.0.1:0".parse().unwrap())] {
        let server = StoreServer::start(Arc::new(EmbeddedStore::new(1 << 10)), at).unwrap();
        let (location, key) = server.address().split_once('#').unwrap();
        assert_eq!(location, server.location());
        assert!(key.starts_with("key=") && key.len() == 4 + 32, "{key}");
        let other =
            StoreServer::start(Arc::new(EmbeddedStore::new(1 << 10)), ServeAt::Unix).unwrap();
        let (_, other_key) = other.address().split_once('#').unwrap();
        for (wrong, why) in [
            (location.to_string(), "names no key"),
            (
                format!("{location}#{other_key}"),
                "could not prove it holds",
            ),
        ] {
            // The server's proof fails first: the client sends nothing more.
            match SocketStore::connect_with(&wrong, Duration::from_secs(5)) {
                Err(StoreError::Unavailable { detail }) => {
                    assert!(detail.to_string().contains(why), "{detail}")
                }
                other => panic!("{wrong}: {other:?}"),
            }
        }
        let r = SocketStore::connect_with(&format!("{location}#key=12"), Duration::from_secs(5));
        assert!(
            matches!(&r, Err(StoreError::Unavailable { detail }) if detail.to_string().contains("32 hex")),
            "{r:?}"
        );
        let client = SocketStore::connect(server.address()).unwrap();
        assert_eq!(client.address(), location, "the key is not named in errors");
        assert_eq!(client.exists(&["k"]), vec![Ok(false)]);
        assert!(!format!("{server:?}{client:?}").contains(&key[4..]));
    }
}

/// A process at a served store's address that does not hold its key (the server's process
/// gone, its abstract name taken by another) learns nothing from a client of that address:
/// the client checks the server's proof before it proves anything, so the impostor gets the
/// client's id and nonce, never the key, a put's bytes or a request; the client fails
/// `Unavailable`, saying why. Before, the hello carried the key itself, and the client took
/// any answer of 0 as the real server.
#[test]
fn a_process_without_the_key_at_the_stores_address_gets_nothing_from_a_client() {
    use std::io::Read;
    let (listener, location) = fake_listener("impostor");
    let key = super::protocol::StoreKey([0x5a; 16]);
    let address = key.in_address(&location);
    let impostor = std::thread::spawn(move || {
        let (mut c, _) = listener.accept().unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // Plays the server with a key of its own (the all-zero one), then reads whatever
        // the client sends until it closes.
        let mut seen =
            super::hello::by_hand::as_server_of(&mut c, &super::protocol::StoreKey([0; 16]))
                .to_vec();
        let _ = c.read_to_end(&mut seen);
        seen
    });
    let got = SocketStore::connect_with(&address, Duration::from_secs(5));
    match got {
        Err(StoreError::Unavailable { detail }) => {
            assert!(
                detail.to_string().contains("could not prove it holds"),
                "{detail}"
            )
        }
        other => panic!("{other:?}"),
    }
    let seen = impostor.join().unwrap();
    assert_eq!(
        seen.len(),
        super::hello::HELLO_LEN,
        "only the hello reached the impostor"
    );
    assert!(
        !seen.windows(16).any(|w| w == key.0),
        "the key never travels"
    );
}

/// A peer of the previous protocol (6, whose hello carried the key itself) is answered
/// `OTHER_PROTOCOL` before anything of its hello past the protocol is read, and its connection
/// ends; the server goes on serving.
#[test]
fn a_client_of_the_previous_protocol_is_refused_at_hello() {
    use std::io::{Read, Write};
    let (server, client) = serve(1 << 10);
    let mut raw = silent_connection(&server);
    let mut head = Enc::default();
    head.u32(super::protocol::MAGIC).u32(6).u64(0x01d);
    raw.write_all(&head.0).unwrap();
    raw.write_all(&[0u8; 16]).unwrap();
    let mut verdict = [0u8; 4];
    raw.read_exact(&mut verdict).unwrap();
    assert_eq!(
        u32::from_le_bytes(verdict),
        super::hello::answer::OTHER_PROTOCOL
    );
    // Ended: the rest of its hello unread, the close may come as a reset.
    let mut more = [0u8; 8];
    match raw.read(&mut more) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the refused connection stays open: {other:?}"),
    }
    assert_eq!(client.exists(&["k"]), vec![Ok(false)]);
}

/// A server of another protocol (it answers `OTHER_PROTOCOL`) is refused by the client
/// with that reason, and sent nothing past the hello.
#[test]
fn a_server_of_another_protocol_is_refused_by_the_client() {
    use std::io::{Read, Write};
    let (listener, address) = fake_listener("old-server");
    let fake = std::thread::spawn(move || {
        let (mut c, _) = listener.accept().unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut hello = [0u8; super::hello::HELLO_LEN];
        c.read_exact(&mut hello).unwrap();
        c.write_all(&super::hello::answer::OTHER_PROTOCOL.to_le_bytes())
            .unwrap();
        let mut rest = Vec::new();
        let _ = c.read_to_end(&mut rest);
        rest.len()
    });
    match SocketStore::connect_with(&address, Duration::from_secs(5)) {
        Err(StoreError::Unavailable { detail }) => {
            assert!(detail.to_string().contains("another protocol"), "{detail}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(fake.join().unwrap(), 0, "nothing past the hello");
}

/// A put whose client goes away part-way through its bytes lets go of the receive budget it
/// took (nothing of it is stored), so the next put of nearly the store's capacity is taken at
/// once, not refused or kept waiting for room that never comes back.
#[test]
fn a_put_cut_off_part_way_lets_its_room_go() {
    use std::io::Write;
    let (server, client) = serve(1000);
    let mut raw = raw_connection(&server);
    let mut body = Enc::default();
    body.u8(op::PUT).u32(1).str("cut").u64(900);
    raw.write_all(&frame_len(&body.0)).unwrap();
    raw.write_all(&body.0).unwrap();
    raw.write_all(&[5u8; 100]).unwrap();
    // Let the server take the room and start reading the bytes, then go away.
    std::thread::sleep(Duration::from_millis(100));
    drop(raw);
    let t0 = Instant::now();
    let mut got = put(&client, "whole", &[&[7u8; 900]]);
    while got.is_err() && t0.elapsed() < Duration::from_secs(10) {
        // The server may not have seen the end of the cut connection yet.
        std::thread::sleep(Duration::from_millis(20));
        got = put(&client, "whole", &[&[7u8; 900]]);
    }
    assert_eq!(got, Ok(PutOutcome::Written), "after {:?}", t0.elapsed());
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert_eq!(client.exists(&["cut", "whole"]), vec![Ok(false), Ok(true)]);
}

/// A client whose proof does not match the server's key (one that did not check the server's
/// proof, or forged its own) is refused `WRONG_KEY` and its connection ends: no request is
/// served.
#[test]
fn a_client_whose_proof_is_wrong_is_refused() {
    use std::io::{Read, Write};
    let (server, _client) = serve(1 << 10);
    let mut raw = silent_connection(&server);
    super::hello::by_hand::send_head(&mut raw, 0xbad);
    let mut challenge = [0u8; 4 + super::hello::NONCE_LEN + super::hello::PROOF_LEN];
    raw.read_exact(&mut challenge).unwrap();
    assert_eq!(challenge[..4], super::hello::answer::PROVE.to_le_bytes());
    raw.write_all(&[0u8; super::hello::PROOF_LEN]).unwrap();
    let mut verdict = [0u8; 4];
    raw.read_exact(&mut verdict).unwrap();
    assert_eq!(u32::from_le_bytes(verdict), super::hello::answer::WRONG_KEY);
    assert!(closed_by_server(&mut raw), "the refused connection ends");
}

/// A put whose keys alone pass the protocol's frame limit is refused before anything is sent
/// (every key `InvalidArgument`), and the connection stays in step for the next call; before,
/// the frame went out, the server closed the connection without a word, and the client
/// answered `Unavailable`.
#[test]
fn a_put_over_the_frame_limit_is_refused_before_it_is_sent() {
    let (_server, client) = serve(1 << 20);
    let keys: Vec<String> = (0..700_000).map(|i| format!("{i:0>100}")).collect();
    let one = [7u8; 1];
    let puts: Vec<ObjectPut<'_>> = keys
        .iter()
        .map(|k| ObjectPut {
            key: k,
            parts: [(one.as_ptr(), 1)].into_iter().collect(),
        })
        .collect();
    // SAFETY: every part is a live one-byte array, read-only for the call.
    let r = unsafe { client.put(&puts) };
    assert_eq!(r.len(), keys.len());
    assert!(
        r.iter().all(|x| matches!(
            x,
            Err(StoreError::InvalidArgument { detail, .. }) if detail.contains("at most")
        )),
        "{:?}",
        &r[..1]
    );
    assert_eq!(client.drop_pooled(), 1, "the connection was kept");
    assert_eq!(put(&client, "k", &[&one]), Ok(PutOutcome::Written));
}

/// Dropping the server ends within the accept loop's idle check even when its wake-up
/// connection cannot be made (out of file descriptors, say): before, the accept thread stayed
/// blocked in `accept` and the drop never returned.
#[test]
fn a_server_stops_when_its_wake_up_connection_fails() {
    for at in [ServeAt::Unix, ServeAt::Tcp("127.0.0.1:0".parse().unwrap())] {
        let server = StoreServer::start(Arc::new(EmbeddedStore::new(1 << 10)), at)
            .unwrap()
            .without_wake();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            drop(server);
            let _ = tx.send(t0.elapsed());
        });
        let took = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the drop returns");
        assert!(took < Duration::from_secs(3), "{took:?}");
    }
}

/// Before, an end whose pooled connection broke under it failed, and the session's pins stayed
/// for as long as the client lived (its anchor connection kept them): the store could not
/// evict the object again. The end is now tried once more, on another connection.
#[test]
fn an_end_on_a_connection_that_breaks_is_tried_again_and_the_pins_go() {
    use std::io::Read;
    let (_server, x) = serve(3000);
    let y = SocketStore::connect(_server.address()).unwrap();
    assert_eq!(put(&x, "k", &[&pattern(1, 1000)]), Ok(PutOutcome::Written));
    let sx = x.start_session(&["k"]).unwrap();
    // The next call of X takes a connection whose far end reads the request and closes.
    let (near, mut far) = std::os::unix::net::UnixStream::pair().unwrap();
    x.pool_connection(super::protocol::Conn::Unix(near));
    let breaker = std::thread::spawn(move || {
        let mut got = [0u8; 8];
        let _ = far.read(&mut got);
    });
    assert_eq!(x.end_session(&sx), Ok(()));
    breaker.join().unwrap();
    // `k` is no longer pinned: filling the store evicts it.
    for i in 0..5 {
        let _ = put(&y, &format!("f{i}"), &[&pattern(i + 2, 1000)]);
    }
    assert_eq!(y.exists(&["k"]), vec![Ok(false)], "k stayed pinned");
}

/// A zero request timeout is refused when connecting: every request would time out at once,
/// which read as a network fault.
#[test]
fn a_zero_request_timeout_is_refused() {
    match SocketStore::connect_with("unix:@kvlink-no-such-store", Duration::ZERO) {
        Err(StoreError::InvalidArgument { detail, .. }) => assert!(detail.contains("zero")),
        other => panic!("{:?}", other.map(drop)),
    }
}
