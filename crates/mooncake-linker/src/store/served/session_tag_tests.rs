//! A session start whose answer never reaches its client: the client gives it up by the tag
//! it sent, and the server ends it whether the start ran before the give-up or after.

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::Duration;

use super::protocol::{frame_len, op, Dec, Enc};
use super::*;
use crate::store::{EmbeddedStore, KvStore, ObjectPut, PutOutcome, StoreError};

/// A raw connection to `server` that has said hello as client `client`.
fn raw_connection(server: &StoreServer, client: u64) -> UnixStream {
    let (at, key) = super::protocol::split_address(server.address()).unwrap();
    let name = at.strip_prefix("unix:@").unwrap();
    let a = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let mut raw = UnixStream::connect_addr(&a).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let verdict = super::hello::by_hand::as_client(&mut raw, client, &key.unwrap());
    assert_eq!(verdict, super::hello::answer::ACCEPTED, "hello accepted");
    raw
}

/// Reads one framed message.
fn read_frame(c: &mut UnixStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    c.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    c.read_exact(&mut body).unwrap();
    body
}

/// Sends `body` framed.
fn send(c: &mut UnixStream, body: &Enc) {
    c.write_all(&frame_len(&body.0)).unwrap();
    c.write_all(&body.0).unwrap();
}

/// Starts a session over `key` tagged `tag` on `raw`; the server's answer.
fn try_start(raw: &mut UnixStream, tag: u64, key: &str) -> Result<u64, StoreError> {
    let mut body = Enc::default();
    body.u8(op::START_SESSION).u64(tag).u32(1).str(key);
    send(raw, &body);
    let reply = read_frame(raw);
    let mut d = Dec::new(&reply);
    d.result(|d| d.u64()).unwrap()
}

/// Starts a session over `key` tagged `tag` on `raw`; the token answered.
fn start(raw: &mut UnixStream, tag: u64, key: &str) -> u64 {
    try_start(raw, tag, key).unwrap()
}

/// Gives up the start tagged `tag` on `raw`.
fn give_up(raw: &mut UnixStream, tag: u64) {
    let mut body = Enc::default();
    body.u8(op::END_SESSION_TAG).u64(tag);
    send(raw, &body);
    let reply = read_frame(raw);
    let mut d = Dec::new(&reply);
    assert_eq!(d.result(|_| Ok(())).unwrap(), Ok(()));
}

fn put_k(store: &dyn KvStore) {
    let data = [7u8; 100];
    let p = ObjectPut {
        key: "k",
        parts: [(data.as_ptr(), data.len())].into_iter().collect(),
    };
    // SAFETY: `data` is a live array, read-only for the call.
    let r = unsafe { store.put(&[p]) };
    assert_eq!(r, vec![Ok(PutOutcome::Written)]);
}

/// Whether `k` is pinned: a pinned object is refused to `remove`; one that is not goes.
fn pinned(store: &dyn KvStore) -> bool {
    match &store.remove(&["k"])[0] {
        Err(StoreError::Lease { .. }) => true,
        Ok(()) => false,
        other => panic!("remove answered {other:?}"),
    }
}

#[test]
fn a_start_given_up_by_its_tag_lets_its_pins_go_whether_it_ran_before_or_after() {
    let server = StoreServer::start(Arc::new(EmbeddedStore::new(1 << 20)), ServeAt::Unix).unwrap();
    let other = SocketStore::connect(server.address()).unwrap();
    // This connection stays open for the whole test: the client's pins cannot go with it.
    let mut raw = raw_connection(&server, 0xfeed);

    // Given up after it ran: its session ends.
    put_k(&other);
    start(&mut raw, 1, "k");
    assert!(pinned(&other), "the session pins k");
    give_up(&mut raw, 1);
    assert!(!pinned(&other), "given up after it ran: ended");

    // Given up before it ran (the give-up overtook it): it is ended as it starts.
    put_k(&other);
    give_up(&mut raw, 2);
    let answer = try_start(&mut raw, 2, "k");
    assert!(
        matches!(&answer, Err(StoreError::Lease { key, .. }) if key == "k"),
        "a start given up is not answered with the token of a session already ended: {answer:?}"
    );
    assert!(!pinned(&other), "given up before it ran: ended at once");

    // Only the tag given up: another start keeps its pins, and is ended by its token.
    put_k(&other);
    let token = start(&mut raw, 3, "k");
    assert!(pinned(&other), "tag 3 was never given up");
    give_up(&mut raw, 4);
    assert!(pinned(&other), "giving up another tag ends nothing");
    let mut body = Enc::default();
    body.u8(op::END_SESSION).u64(token);
    send(&mut raw, &body);
    read_frame(&mut raw);
    assert!(!pinned(&other));
}

/// A fake server's listener (non-blocking) at a fresh abstract name; the name.
fn fake_listener(what: &str) -> (UnixListener, String) {
    let name = format!("kvlink-fake-store-{what}-{}", std::process::id());
    let a = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let listener = UnixListener::bind_addr(&a).unwrap();
    listener.set_nonblocking(true).unwrap();
    (listener, name)
}

/// Accepts a connection within 10 s (a client that never connects fails the test, not hangs
/// it) and answers its hello.
fn accept(l: &UnixListener) -> UnixStream {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut c = loop {
        match l.accept() {
            Ok((c, _)) => break c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(std::time::Instant::now() < deadline, "no connection came");
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    c.set_nonblocking(false).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    super::hello::by_hand::as_server(&mut c);
    c
}

/// Answers the health check a client's connect sends on `c`.
fn answer_health(c: &mut UnixStream) {
    assert_eq!(read_frame(c)[0], op::HEALTH);
    let mut ok = Enc::default();
    ok.result(&Ok(()), |_, _| {});
    send(c, &ok);
}

#[test]
fn a_client_whose_session_start_goes_unanswered_gives_it_up_by_its_tag() {
    // A fake server: answers the connect's health check, takes the anchor connection, then
    // leaves the session start unanswered and waits for its give-up on a new connection.
    let (listener, name) = fake_listener("tag");
    let fake = std::thread::spawn(move || {
        let mut c = accept(&listener);
        answer_health(&mut c);
        let mut ok = Enc::default();
        ok.result(&Ok(()), |_, _| {});
        let _anchor = accept(&listener);
        let start = read_frame(&mut c);
        assert_eq!(start[0], op::START_SESSION);
        let tag = Dec::new(&start[1..]).u64().unwrap();
        // Unanswered: the client's call runs out and it gives the start up.
        let mut g = accept(&listener);
        let give_up = read_frame(&mut g);
        assert_eq!(give_up[0], op::END_SESSION_TAG);
        assert_eq!(
            Dec::new(&give_up[1..]).u64().unwrap(),
            tag,
            "the start's own tag"
        );
        send(&mut g, &ok);
        let _ = c.read(&mut [0u8; 1]);
    });
    // 1.5 s: the connect's two connections open within it on a loaded machine too.
    let client =
        SocketStore::connect_with(&format!("unix:@{name}"), Duration::from_millis(1500)).unwrap();
    let got = client.start_session(&["k"]);
    assert!(matches!(got, Err(StoreError::RpcTimeout { .. })), "{got:?}");
    drop(client);
    fake.join().unwrap();
}

#[test]
fn a_session_start_never_sent_is_not_given_up() {
    // A fake server that takes the connect's two connections, then leaves every later
    // connection's hello unanswered: the start's own connection never opens, so its request
    // is never sent and there is nothing to give up. Before, the client gave it up anyway on
    // one more connection, waiting for it, and warned that pins might stay.
    let (listener, name) = fake_listener("unsent");
    let (returned, client_returned) = std::sync::mpsc::channel::<()>();
    let fake = std::thread::spawn(move || {
        let mut c = accept(&listener);
        answer_health(&mut c);
        let _anchor = accept(&listener);
        client_returned
            .recv_timeout(Duration::from_secs(20))
            .expect("the client's start returned");
        // Every connection the client opened since, answered or not, waits to be accepted.
        let mut later = 0;
        while listener.accept().is_ok() {
            later += 1;
        }
        later
    });
    // 1.5 s: the connect's two connections open within it on a loaded machine too.
    let client =
        SocketStore::connect_with(&format!("unix:@{name}"), Duration::from_millis(1500)).unwrap();
    assert_eq!(client.drop_pooled(), 1, "the health check's connection");
    let got = client.start_session(&["k"]);
    assert!(matches!(got, Err(StoreError::RpcTimeout { .. })), "{got:?}");
    returned.send(()).unwrap();
    assert_eq!(
        fake.join().unwrap(),
        1,
        "only the start's own connection, which never opened: no give-up"
    );
    drop(client);
}

/// Calls to a served store that never replies fail `RpcTimeout` (which names no address), and
/// the log says where: one line at `warn` naming the server, the next at `debug` within the
/// minute. Before, nothing told a hung server from a slow Mooncake master behind it.
#[test]
fn calls_a_served_store_never_answers_are_logged_naming_it_once_a_minute() {
    let (listener, name) = fake_listener("mute");
    let (done, client_done) = std::sync::mpsc::channel::<()>();
    let fake = std::thread::spawn(move || {
        let mut c = accept(&listener);
        answer_health(&mut c);
        let _anchor = accept(&listener);
        // The first call's request, unanswered; its connection is dropped, and the second
        // call comes on a new one, unanswered too.
        assert_eq!(read_frame(&mut c)[0], op::EXISTS);
        let mut again = accept(&listener);
        assert_eq!(read_frame(&mut again)[0], op::EXISTS);
        client_done
            .recv_timeout(Duration::from_secs(20))
            .expect("the client's calls returned");
    });
    // 1.5 s: the connect's two connections open within it on a loaded machine too.
    let client =
        SocketStore::connect_with(&format!("unix:@{name}"), Duration::from_millis(1500)).unwrap();
    let (got, lines) = crate::test_logs::logged(|| [client.exists(&["k"]), client.exists(&["k"])]);
    done.send(()).unwrap();
    for r in &got {
        assert!(
            matches!(r[..], [Err(StoreError::RpcTimeout { .. })]),
            "{r:?}"
        );
    }
    let mute: Vec<_> = lines
        .iter()
        .filter(|e| e.message.contains("no reply by a call's deadline"))
        .collect();
    let at = |level| mute.iter().filter(|e| e.level == level).count();
    assert_eq!(
        (at(tracing::Level::WARN), at(tracing::Level::DEBUG)),
        (1, 1),
        "{lines:?}"
    );
    assert!(mute.iter().all(|e| e.fields.contains(&name)), "{mute:?}");
    drop(client);
    fake.join().unwrap();
}
