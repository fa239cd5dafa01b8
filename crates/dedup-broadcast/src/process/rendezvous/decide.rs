//! Rank 0's decision once every rank has said hello: the group (epoch, transport, members,
//! NCCL ids, attributes) or the refusal every rank gets. Pure: no I/O.

use kv_geometry::GeometryFingerprint;

use super::message::{Hello, Transport, TransportChoice, Welcome};
use super::{NcclIds, RendezvousError};
use crate::process::mesh::UNKNOWN_HOST;

/// Makes one NCCL unique id (rank 0 only).
pub(crate) type IdSource = dyn Fn() -> Result<[u8; 128], String> + Send + Sync;

/// Ranks `1..world` that no hello claims.
pub(crate) fn missing(world: u32, joiners: &[Hello]) -> Vec<u32> {
    (1..world)
        .filter(|r| !joiners.iter().any(|h| h.rank == *r))
        .collect()
}

/// The first refusal the hellos call for, checking every hello for one kind of problem
/// before the next kind: version, world size, duplicates, geometry, settings.
fn refusal(leader: &Hello, joiners: &[Hello]) -> Option<RendezvousError> {
    let mut by_rank: Vec<&Hello> = joiners.iter().collect();
    by_rank.sort_by_key(|h| h.rank);
    if let Some(h) = by_rank.iter().find(|h| h.version != leader.version) {
        return Some(RendezvousError::VersionMismatch {
            rank: h.rank,
            expected: leader.version.clone(),
            got: h.version.clone(),
        });
    }
    if let Some(h) = by_rank.iter().find(|h| h.world != leader.world) {
        return Some(RendezvousError::WorldSizeMismatch {
            rank: h.rank,
            expected: leader.world,
            got: h.world,
        });
    }
    // An epoch further past rank 0's than any group forms in its life: corrupt or hostile.
    // Formed at, it would leave few or no next epochs (`MAX_EPOCH`) for every later group.
    if let Some(h) = by_rank
        .iter()
        .find(|h| past_jump(leader.last_epoch, h.last_epoch))
    {
        return Some(RendezvousError::SettingsMismatch {
            rank: h.rank,
            what: "the last epoch".into(),
            expected: format!(
                "at most {EPOCH_JUMP_MAX} past rank 0's {}",
                leader.last_epoch
            ),
            got: h.last_epoch.to_string(),
        });
    }
    // A rank past the group (a foreign or broken client: a rank's own check refuses it)
    // would make a group of more members than its size, which every rank then refuses.
    if let Some(h) = by_rank.iter().find(|h| h.rank >= leader.world) {
        return Some(RendezvousError::SettingsMismatch {
            rank: h.rank,
            what: "the rank".into(),
            expected: format!("below the group's size {}", leader.world),
            got: h.rank.to_string(),
        });
    }
    if let Some(w) = by_rank
        .windows(2)
        .find(|w| w[0].rank == w[1].rank)
        .map(|w| w[0].rank)
        .or_else(|| by_rank.iter().find(|h| h.rank == 0).map(|h| h.rank))
    {
        return Some(RendezvousError::DuplicateRank { rank: w });
    }
    if let Some(h) = by_rank.iter().find(|h| h.fingerprint != leader.fingerprint) {
        return Some(RendezvousError::GeometryMismatch {
            rank: h.rank,
            expected: GeometryFingerprint(leader.fingerprint).to_string(),
            got: GeometryFingerprint(h.fingerprint).to_string(),
        });
    }
    if let Some(h) = by_rank.iter().find(|h| h.nccl != leader.nccl) {
        let says = |b: bool| if b { "on" } else { "off" }.to_string();
        return Some(RendezvousError::SettingsMismatch {
            rank: h.rank,
            what: "NCCL".into(),
            expected: says(leader.nccl),
            got: says(h.nccl),
        });
    }
    None
}

/// The transport rank 0's choice gives these members, or the refusal of a rank that cannot
/// use it.
fn transport(leader: &Hello, joiners: &[Hello]) -> Result<Transport, RendezvousError> {
    let one_host =
        |h: &&Hello| h.endpoint.unix.is_some() && h.endpoint.host == leader.endpoint.host;
    let all_local = leader.endpoint.unix.is_some() && joiners.iter().all(|h| one_host(&h));
    match leader.transport {
        TransportChoice::Tcp => Ok(Transport::Tcp),
        TransportChoice::Auto if all_local => Ok(Transport::Unix),
        TransportChoice::Auto => Ok(Transport::Tcp),
        TransportChoice::Unix => match joiners.iter().find(|h| !one_host(h)) {
            None if leader.endpoint.unix.is_some() => Ok(Transport::Unix),
            None => Err(RendezvousError::Config(
                "rank 0 asks for Unix sockets but cannot open one".into(),
            )),
            Some(h) => Err(RendezvousError::SettingsMismatch {
                rank: h.rank,
                what: "host (Unix sockets need every rank on rank 0's host)".into(),
                expected: leader.endpoint.host.clone(),
                got: h.endpoint.host.clone(),
            }),
        },
    }
}

/// Over TCP with ranks on more than one host, the first member whose TCP endpoint other hosts
/// cannot reach: a loopback address (a key-value exchange's default without `host_ip`), or
/// an unspecified one (but rank 0's where `rank0` says the peers rewrite it). Without this
/// the group formed, and every connect to that rank failed at the deadline as "connection
/// refused" (each host reached its own loopback), never naming the setting. Hosts not known
/// (their key could not be read: `unknown-…`) count for nothing: with fewer than two known
/// hosts, whether the ranks span several cannot be told, and nothing is refused.
fn unreachable_endpoint(
    leader: &Hello,
    joiners: &[Hello],
    rank0: Rank0Address,
) -> Option<RendezvousError> {
    let members = || std::iter::once(leader).chain(joiners);
    let known: std::collections::HashSet<&str> = members()
        .map(|h| h.endpoint.host.as_str())
        .filter(|host| !host.starts_with(UNKNOWN_HOST))
        .collect();
    if known.len() < 2 {
        return None;
    }
    members().find_map(|h| {
        let ip = h.endpoint.tcp?.ip();
        let rewritten = h.rank == 0 && rank0 == Rank0Address::Rewritten;
        let unreachable = ip.is_loopback() || (ip.is_unspecified() && !rewritten);
        unreachable.then(|| RendezvousError::SettingsMismatch {
            rank: h.rank,
            what: "TCP endpoint (ranks on several hosts: set the rendezvous `host_ip` to an \
                   address the other hosts reach)"
                .into(),
            expected: "an address other hosts can reach".into(),
            got: ip.to_string(),
        })
    })
}

/// The largest epoch a group forms at, and that a peer's message or the exchange may say
/// (larger is malformed). Formations count up by one from 1: far past any server's life.
/// A member's epoch more than [`EPOCH_JUMP_MAX`] past rank 0's is refused, and the exchange's
/// `closed` that far past is taken as absent, so no value forms a group near this bound.
pub(crate) const MAX_EPOCH: u64 = 1 << 62;

/// How far past rank 0's last epoch a member's (or the exchange's `closed`) may be: 2^32
/// formations, more than any deployment's life. A larger one is corrupt or hostile.
pub(crate) const EPOCH_JUMP_MAX: u64 = 1 << 32;

/// Whether `epoch` is further past `base` (rank 0's last epoch) than [`EPOCH_JUMP_MAX`].
pub(crate) fn past_jump(base: u64, epoch: u64) -> bool {
    epoch > base.saturating_add(EPOCH_JUMP_MAX)
}

/// The epoch after `last` (a rank's hello or the exchange says `last`: peer input), refused
/// where there is none at most [`MAX_EPOCH`].
pub(crate) fn next_epoch(last: u64) -> Result<u64, RendezvousError> {
    if last >= MAX_EPOCH {
        return Err(RendezvousError::Protocol(format!(
            "epoch {last} has no next one (epochs end at {MAX_EPOCH})"
        )));
    }
    Ok(last + 1)
}

/// Whether the peers reach rank 0's mesh at the IP it announced, or at the one they reached
/// its rendezvous at (an unspecified IP of rank 0's is then rewritten: the TCP meeting point).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rank0Address {
    /// Peers rewrite rank 0's unspecified IP to the one they reached it at.
    Rewritten,
    /// Peers connect to what rank 0 announced (a key-value exchange: no address was reached).
    AsAnnounced,
}

/// Rank 0's decision over its own hello and every joiner's (every rank `1..world` present,
/// possibly more: duplicates, ranks of another world size).
pub(crate) fn decide(
    leader: &Hello,
    joiners: &[Hello],
    ids: Option<&IdSource>,
    rank0: Rank0Address,
) -> Result<Welcome, RendezvousError> {
    if let Some(err) = refusal(leader, joiners) {
        return Err(err);
    }
    let missing = missing(leader.world, joiners);
    if !missing.is_empty() {
        return Err(RendezvousError::Timeout {
            missing,
            detail: "rank 0 decided before every rank had joined".into(),
        });
    }
    let transport = transport(leader, joiners)?;
    if transport == Transport::Tcp {
        if let Some(err) = unreachable_endpoint(leader, joiners, rank0) {
            return Err(err);
        }
    }
    let nccl = if leader.nccl {
        // Not curable by trying again: a refusal, which every rank reports as rank 0's.
        let ids = ids.ok_or_else(|| {
            RendezvousError::Config(
                "the group asks for NCCL communicators, and rank 0's build of kvlink has no \
                 NCCL (feature `nccl`)"
                    .into(),
            )
        })?;
        Some(NcclIds {
            data: ids().map_err(RendezvousError::Nccl)?,
            control: ids().map_err(RendezvousError::Nccl)?,
        })
    } else {
        None
    };
    let mut members = vec![leader];
    let mut sorted: Vec<&Hello> = joiners.iter().collect();
    sorted.sort_by_key(|h| h.rank);
    members.extend(sorted);
    let epoch = next_epoch(members.iter().map(|h| h.last_epoch).max().unwrap_or(0))?;
    Ok(Welcome {
        epoch,
        transport,
        algorithm: leader.algorithm,
        members: members.iter().map(|h| h.endpoint.clone()).collect(),
        nonces: members.iter().map(|h| h.nonce).collect(),
        nccl,
        attributes: leader.attributes.clone(),
    })
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::process::rendezvous::message::{Endpoint, PROTOCOL};
    use crate::process::socket_collective::Algorithm;

    /// A hello of `rank` in a world of 3 on host `h`, last epoch 0 (the exchange's tests too).
    pub(in crate::process::rendezvous) fn hello(rank: u32) -> Hello {
        Hello {
            protocol: PROTOCOL,
            version: "0.1.0".into(),
            rank,
            world: 3,
            fingerprint: [7; 32],
            nccl: false,
            last_epoch: 0,
            nonce: 100 + u64::from(rank),
            transport: TransportChoice::Auto,
            algorithm: Algorithm::Ring,
            endpoint: Endpoint {
                tcp: None,
                unix: Some(format!("u{rank}")),
                host: "h".into(),
            },
            attributes: Vec::new(),
        }
    }

    /// A rank of `host` whose TCP endpoint is at `ip`.
    fn on(rank: u32, host: &str, ip: &str) -> Hello {
        let mut h = hello(rank);
        h.endpoint.host = host.into();
        h.endpoint.tcp = Some(format!("{ip}:4000").parse().unwrap());
        h
    }

    /// Before, ranks on several hosts announcing loopback endpoints (a key-value exchange
    /// without `host_ip`) formed a group whose every connect then failed at the deadline as
    /// "connection refused"; now the formation is refused naming the rank and the setting.
    /// On one host, loopback stays fine; so it is where a host is not known.
    #[test]
    fn loopback_endpoints_across_hosts_are_refused_naming_the_setting() {
        let across = decide(
            &on(0, "a", "10.0.0.1"),
            &[on(1, "b", "127.0.0.1"), on(2, "b", "10.0.0.2")],
            None,
            Rank0Address::Rewritten,
        );
        match across {
            Err(RendezvousError::SettingsMismatch { rank: 1, what, .. }) => {
                assert!(what.contains("host_ip"), "{what}")
            }
            other => panic!("{other:?}"),
        }
        let unspecified = decide(
            &on(0, "a", "0.0.0.0"),
            &[on(1, "b", "0.0.0.0"), on(2, "b", "10.0.0.2")],
            None,
            Rank0Address::Rewritten,
        );
        assert!(
            matches!(
                unspecified,
                Err(RendezvousError::SettingsMismatch { rank: 1, .. })
            ),
            "rank 0's unspecified address is rewritten; a joiner's is not: {unspecified:?}"
        );
        let mut local = [
            on(0, "h", "127.0.0.1"),
            on(1, "h", "127.0.0.1"),
            on(2, "h", "127.0.0.1"),
        ];
        for h in &mut local {
            h.transport = TransportChoice::Tcp;
        }
        assert!(decide(&local[0], &local[1..], None, Rank0Address::Rewritten).is_ok());
        // Over a key-value exchange rank 0's unspecified address is what the peers get.
        let exchange = decide(
            &on(0, "a", "0.0.0.0"),
            &[on(1, "b", "10.0.0.3"), on(2, "b", "10.0.0.2")],
            None,
            Rank0Address::AsAnnounced,
        );
        assert!(
            matches!(
                exchange,
                Err(RendezvousError::SettingsMismatch { rank: 0, .. })
            ),
            "{exchange:?}"
        );
        // Hosts whose keys could not be read: one host, maybe; loopback is not refused.
        let unknown = [
            on(0, &format!("{UNKNOWN_HOST}1"), "127.0.0.1"),
            on(1, &format!("{UNKNOWN_HOST}2"), "127.0.0.1"),
            on(2, &format!("{UNKNOWN_HOST}3"), "127.0.0.1"),
        ];
        assert!(decide(&unknown[0], &unknown[1..], None, Rank0Address::Rewritten).is_ok());
        // Two known hosts beside an unknown one: several hosts for sure, loopback refused.
        let mixed = decide(
            &on(0, "a", "10.0.0.1"),
            &[
                on(1, "b", "127.0.0.1"),
                on(2, &format!("{UNKNOWN_HOST}3"), "10.0.0.2"),
            ],
            None,
            Rank0Address::Rewritten,
        );
        assert!(
            matches!(
                mixed,
                Err(RendezvousError::SettingsMismatch { rank: 1, .. })
            ),
            "{mixed:?}"
        );
    }

    #[test]
    fn a_full_group_forms_with_the_next_epoch_and_unix_sockets_on_one_host() {
        let mut l = hello(0);
        l.attributes = vec![("store".into(), "x".into())];
        let mut j = vec![hello(2), hello(1)];
        j[0].last_epoch = 6;
        let w = decide(&l, &j, None, Rank0Address::Rewritten).unwrap();
        assert_eq!(w.epoch, 7);
        assert_eq!(w.transport, Transport::Unix);
        assert_eq!(w.nonces, vec![100, 101, 102]);
        assert_eq!(w.members[2].unix.as_deref(), Some("u2"));
        assert_eq!(w.attributes, l.attributes);
        // Another host: TCP under Auto, a refusal under Unix.
        j[1].endpoint.host = "other".into();
        assert_eq!(
            decide(&l, &j, None, Rank0Address::Rewritten)
                .unwrap()
                .transport,
            Transport::Tcp
        );
        l.transport = TransportChoice::Unix;
        assert!(matches!(
            decide(&l, &j, None, Rank0Address::Rewritten),
            Err(RendezvousError::SettingsMismatch { rank: 1, .. })
        ));
    }

    /// A member's last epoch further past rank 0's than any group forms in its life is
    /// refused, naming it. Before, one just below the last epoch there is formed a group there,
    /// and every later formation had no next epoch.
    #[test]
    fn a_hello_with_an_epoch_far_past_rank_0s_is_refused() {
        let mut l = hello(0);
        let mut j = vec![hello(1), hello(2)];
        for last in [u64::MAX, MAX_EPOCH, MAX_EPOCH - 1, EPOCH_JUMP_MAX + 1] {
            j[1].last_epoch = last;
            assert!(
                matches!(
                    decide(&l, &j, None, Rank0Address::Rewritten),
                    Err(RendezvousError::SettingsMismatch { rank: 2, .. })
                ),
                "{last}"
            );
        }
        // Up to the jump from rank 0's it forms (a rank 0 that restarted knows no epoch).
        j[1].last_epoch = EPOCH_JUMP_MAX;
        let w = decide(&l, &j, None, Rank0Address::Rewritten).unwrap();
        assert_eq!(w.epoch, EPOCH_JUMP_MAX + 1);
        // The last epoch there is: no next one, refused rather than overflowed.
        l.last_epoch = MAX_EPOCH;
        j[1].last_epoch = MAX_EPOCH;
        assert!(matches!(
            decide(&l, &j, None, Rank0Address::Rewritten),
            Err(RendezvousError::Protocol(_))
        ));
        assert_eq!(next_epoch(3).unwrap(), 4);
    }

    #[test]
    fn every_refusal_names_the_rank() {
        let l = hello(0);
        let check = |f: &dyn Fn(&mut Vec<Hello>)| {
            let mut j = vec![hello(1), hello(2)];
            f(&mut j);
            decide(&l, &j, None, Rank0Address::Rewritten).unwrap_err()
        };
        assert!(matches!(
            check(&|j| j[1].world = 4),
            RendezvousError::WorldSizeMismatch {
                rank: 2,
                expected: 3,
                got: 4
            }
        ));
        assert!(matches!(
            check(&|j| j.push(hello(1))),
            RendezvousError::DuplicateRank { rank: 1 }
        ));
        assert!(matches!(
            check(&|j| j[0].rank = 0),
            RendezvousError::DuplicateRank { rank: 0 }
        ));
        assert!(matches!(
            check(&|j| j[0].fingerprint = [8; 32]),
            RendezvousError::GeometryMismatch { rank: 1, .. }
        ));
        assert!(matches!(
            check(&|j| j[1].version = "0.2.0".into()),
            RendezvousError::VersionMismatch { rank: 2, .. }
        ));
        assert!(matches!(
            check(&|j| j[1].nccl = true),
            RendezvousError::SettingsMismatch { rank: 2, .. }
        ));
        // A rank past the group, with the right size (a complete group besides it).
        assert!(matches!(
            check(&|j| j.push(hello(3))),
            RendezvousError::SettingsMismatch { rank: 3, .. }
        ));
        // A version mismatch is reported before a world-size one (the world may be a
        // symptom of the other build).
        assert!(matches!(
            check(&|j| {
                j[0].world = 9;
                j[1].version = "x".into();
            }),
            RendezvousError::VersionMismatch { rank: 2, .. }
        ));
        assert!(matches!(
            check(&|j| {
                j.pop();
            }),
            RendezvousError::Timeout { ref missing, .. } if missing == &[2]
        ));
    }

    #[test]
    fn nccl_ids_come_from_rank_0s_source_or_the_group_is_refused() {
        let mut l = hello(0);
        l.nccl = true;
        let mut j = vec![hello(1), hello(2)];
        j.iter_mut().for_each(|h| h.nccl = true);
        // A rank 0 built without NCCL: a refusal (trying again cannot cure it).
        let no_nccl = decide(&l, &j, None, Rank0Address::Rewritten).err();
        assert!(
            matches!(&no_nccl, Some(e @ RendezvousError::Config(d)) if d.contains("rank 0's build")
                && e.is_refusal()),
            "{no_nccl:?}"
        );
        // A rank 0 whose NCCL fails to make ids: every rank's report names rank 0.
        let failing = || Err("libnccl.so.2: cannot open shared object file".to_string());
        let failed = decide(&l, &j, Some(&failing), Rank0Address::Rewritten).err();
        assert!(
            matches!(&failed, Some(e @ RendezvousError::Nccl(_))
                if e.to_string().starts_with("rank 0 could not make") && !e.is_refusal()),
            "{failed:?}"
        );
        let n = std::sync::atomic::AtomicU8::new(1);
        let src = move || Ok([n.fetch_add(1, std::sync::atomic::Ordering::Relaxed); 128]);
        let ids = decide(&l, &j, Some(&src), Rank0Address::Rewritten)
            .unwrap()
            .nccl
            .unwrap();
        assert_ne!(ids.data, ids.control, "two communicators, two ids");
    }
}
