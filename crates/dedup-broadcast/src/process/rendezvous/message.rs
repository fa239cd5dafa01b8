//! What ranks say when they meet: each rank's hello to rank 0, and rank 0's reply (the
//! group, a refusal, or "not forming now").
//!
//! Every message starts with a magic word and the protocol number, then (hellos) the kvlink
//! version and the rank: whatever else changes between versions, rank 0 can still tell who
//! sent a hello and refuse it as a version mismatch.

use std::net::SocketAddr;

use super::decide::MAX_EPOCH;
use super::RendezvousError;
use crate::process::socket_collective::Algorithm;
use crate::process::wire::{Decoder, Encoder, Malformed, MAX_FRAME};

const MAGIC: u32 = u32::from_le_bytes(*b"KVRZ");
/// Version of these messages and of what the formed group speaks; ranks with another refuse
/// each other. 2: a batch's verdict word ends with a completion round on the socket group
/// (`Collective::all_gather_u64_settled`), and a rank claimed twice over a key-value exchange
/// is answered as error kind 10 (`ClaimedTwice`). 3: a batch's gate ends with that round too
/// (`Collective::all_gather_bytes_settled`). 4: the socket group's connections greet with the
/// sender's nonce of the welcome and are acked with the acceptor's, and connecting ends with a
/// settled gather of the epoch on the first handle. 5: a batch's gate word is 64 bytes
/// (`"KVG2"`, with which of its last 64 batches the rank loaded alone). 6: the gate word is
/// 344 bytes (`"KVG3"`: the batches loaded alone as runs of batch ids and a mask of the last
/// 64 ids, `AloneLoads`). 7: the gate word's proposal carries a flag in its top bit (the
/// proposing rank's `Auto` keeps that mode; an older rank would read it as no mode). 8: the
/// plan digest covers each rank's key space (`PLAN_DIGEST_SEED` v2): a rank of protocol 7
/// would disagree at every gate and load `AllRanks`, so the two are refused instead.
///
/// What the formed group speaks includes the gate's digests and words and the status word:
/// a change to any of them (kinds appended to the status word excepted: an older peer reads
/// them as "other") bumps this number (`the_wire_of_this_protocol_is_pinned` fails
/// until it does), since kvlink's version string alone does not tell builds apart.
pub(crate) const PROTOCOL: u32 = 8;

/// Longest version or host string a hello may carry (bytes). Both go into refusals rank 0
/// sends every member and keeps for later idle replies: a peer's megabyte string made each
/// of those past the frame limit, so none was delivered.
pub(crate) const MAX_PEER_TEXT: usize = 1024;

/// `s`, refused when longer than [`MAX_PEER_TEXT`].
fn peer_text(what: &str, s: String) -> Result<String, Malformed> {
    if s.len() > MAX_PEER_TEXT {
        return Err(Malformed(format!(
            "a {what} of {} bytes (at most {MAX_PEER_TEXT})",
            s.len()
        )));
    }
    Ok(s)
}

/// Where a rank's collective listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Endpoint {
    /// TCP address (its IP may be unspecified for rank 0: peers then use the address they
    /// reached rank 0 at).
    pub(crate) tcp: Option<SocketAddr>,
    /// Abstract Unix socket name, when Unix sockets are allowed.
    pub(crate) unix: Option<String>,
    /// Which host and network namespace the rank runs in (Unix sockets need all the same).
    pub(crate) host: String,
}

/// How the group's sockets connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// TCP.
    Tcp,
    /// Unix sockets (every rank on one host, in one network namespace).
    Unix,
}

/// Which transport a rank wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// Unix sockets when every rank is on one host, TCP otherwise.
    #[default]
    Auto,
    /// TCP always.
    Tcp,
    /// Unix sockets; a rank on another host is refused.
    Unix,
}

impl TransportChoice {
    /// Parses `auto`, `tcp` or `unix` (any case).
    pub fn parse(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "auto" => Some(TransportChoice::Auto),
            "tcp" => Some(TransportChoice::Tcp),
            "unix" => Some(TransportChoice::Unix),
            _ => None,
        }
    }
    fn code(self) -> u8 {
        self as u8
    }
    fn from_code(c: u8) -> Option<Self> {
        [
            TransportChoice::Auto,
            TransportChoice::Tcp,
            TransportChoice::Unix,
        ]
        .into_iter()
        .find(|t| t.code() == c)
    }
}

/// The two NCCL unique ids of a group: one per communicator (data, control).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclIds {
    /// For the data handle (the load thread's collectives).
    pub data: [u8; 128],
    /// For the control handle (lookups).
    pub control: [u8; 128],
}

impl std::fmt::Debug for NcclIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclIds { .. }")
    }
}

/// A rank's hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) protocol: u32,
    pub(crate) version: String,
    pub(crate) rank: u32,
    pub(crate) world: u32,
    pub(crate) fingerprint: [u8; 32],
    pub(crate) nccl: bool,
    /// The epoch of the last group this process belonged to (0: none).
    pub(crate) last_epoch: u64,
    /// Random per join attempt: tells this hello from another process's for the same rank.
    pub(crate) nonce: u64,
    pub(crate) transport: TransportChoice,
    pub(crate) algorithm: Algorithm,
    pub(crate) endpoint: Endpoint,
    /// Rank 0's attributes travel to every rank; a joiner's are ignored.
    pub(crate) attributes: Vec<(String, String)>,
}

/// A formed group, as rank 0 announces it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Welcome {
    pub(crate) epoch: u64,
    pub(crate) transport: Transport,
    pub(crate) algorithm: Algorithm,
    /// Index = rank.
    pub(crate) members: Vec<Endpoint>,
    /// Index = rank: the accepted hello's nonce.
    pub(crate) nonces: Vec<u64>,
    pub(crate) nccl: Option<NcclIds>,
    pub(crate) attributes: Vec<(String, String)>,
}

/// Rank 0's answer to a hello.
#[derive(Debug, Clone)]
pub(crate) enum Reply {
    Welcome(Box<Welcome>),
    Refused(RendezvousError),
    /// Rank 0 is not forming a group now.
    Idle {
        live_epoch: Option<u64>,
        last_failure: Option<String>,
    },
}

fn malformed(m: Malformed) -> RendezvousError {
    RendezvousError::Protocol(m.0)
}

fn endpoint(e: &mut Encoder, ep: &Endpoint) {
    e.opt_str(ep.tcp.map(|a| a.to_string()).as_deref())
        .opt_str(ep.unix.as_deref())
        .str(&ep.host);
}

fn read_endpoint(d: &mut Decoder<'_>) -> Result<Endpoint, Malformed> {
    // Each string capped: an endpoint goes into the welcome every rank reads (one too long
    // for a frame refused the whole group, `Config` at rank 0).
    let tcp = match d.opt_str("tcp address")? {
        Some(s) => Some(
            peer_text("tcp address", s)?
                .parse()
                .map_err(|e| Malformed(format!("tcp address: {e}")))?,
        ),
        None => None,
    };
    let unix = match d.opt_str("unix name")? {
        Some(s) => Some(peer_text("unix name", s)?),
        None => None,
    };
    Ok(Endpoint {
        tcp,
        unix,
        host: peer_text("host", d.str("host")?)?,
    })
}

/// An epoch a peer sent, refused past [`MAX_EPOCH`] (no formation counts that far: a group
/// formed there would leave no next epoch, and every later formation would be refused).
fn epoch(d: &mut Decoder<'_>, what: &str) -> Result<u64, Malformed> {
    let e = d.u64(what)?;
    if e > MAX_EPOCH {
        return Err(Malformed(format!("{what} {e} (at most {MAX_EPOCH})")));
    }
    Ok(e)
}

/// `welcome` when its message fits a frame; else a refusal to every rank (the same each
/// time: rank 0's attributes are too large), where writing it would fail for every rank.
pub(crate) fn fits_a_frame(welcome: Welcome) -> Result<Welcome, RendezvousError> {
    let reply = Reply::Welcome(Box::new(welcome));
    let len = reply.encode().len();
    match reply {
        Reply::Welcome(w) if len <= MAX_FRAME => Ok(*w),
        _ => Err(RendezvousError::Config(format!(
            "rank 0's welcome is {len} bytes, past the {MAX_FRAME}-byte message limit: its \
             attributes are too large"
        ))),
    }
}

fn algorithm_code(a: Algorithm) -> u8 {
    match a {
        Algorithm::Ring => 0,
        Algorithm::Direct => 1,
    }
}

fn read_algorithm(d: &mut Decoder<'_>) -> Result<Algorithm, Malformed> {
    match d.u8("algorithm")? {
        0 => Ok(Algorithm::Ring),
        1 => Ok(Algorithm::Direct),
        c => Err(Malformed(format!("algorithm {c}"))),
    }
}

fn attributes(e: &mut Encoder, attrs: &[(String, String)]) {
    e.u32(attrs.len() as u32);
    for (k, v) in attrs {
        e.str(k).str(v);
    }
}

fn read_attributes(d: &mut Decoder<'_>) -> Result<Vec<(String, String)>, Malformed> {
    let n = d.u32("attributes")?;
    (0..n)
        .map(|_| Ok((d.str("attribute key")?, d.str("attribute value")?)))
        .collect()
}

impl Hello {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.u32(MAGIC)
            .u32(self.protocol)
            .str(&self.version)
            .u32(self.rank)
            .u32(self.world)
            .bytes(&self.fingerprint)
            .u8(u8::from(self.nccl))
            .u64(self.last_epoch)
            .u64(self.nonce)
            .u8(self.transport.code())
            .u8(algorithm_code(self.algorithm));
        endpoint(&mut e, &self.endpoint);
        attributes(&mut e, &self.attributes);
        e.0
    }

    /// Decodes a hello. One of another protocol decodes only as far as its version and
    /// rank: the error is then the version mismatch, naming that rank.
    pub(crate) fn decode(buf: &[u8], own_version: &str) -> Result<Hello, RendezvousError> {
        let mut d = Decoder::new(buf);
        let head = (|| {
            if d.u32("magic")? != MAGIC {
                return Err(Malformed("not a kvlink hello".into()));
            }
            let protocol = d.u32("protocol")?;
            let version = peer_text("version", d.str("version")?)?;
            Ok((protocol, version, d.u32("rank")?))
        })();
        let (protocol, version, rank) = head.map_err(malformed)?;
        if protocol != PROTOCOL {
            return Err(RendezvousError::VersionMismatch {
                rank,
                expected: format!("{own_version} (rendezvous protocol {PROTOCOL})"),
                got: format!("{version} (rendezvous protocol {protocol})"),
            });
        }
        let rest = (|| {
            let world = d.u32("world")?;
            let fp = d.bytes("fingerprint")?;
            let fingerprint: [u8; 32] = fp
                .try_into()
                .map_err(|_| Malformed("fingerprint of the wrong length".into()))?;
            let nccl = d.u8("nccl")? != 0;
            let last_epoch = epoch(&mut d, "last epoch")?;
            let nonce = d.u64("nonce")?;
            let t = d.u8("transport")?;
            let transport =
                TransportChoice::from_code(t).ok_or_else(|| Malformed(format!("transport {t}")))?;
            let algorithm = read_algorithm(&mut d)?;
            let endpoint = read_endpoint(&mut d)?;
            let attributes = read_attributes(&mut d)?;
            Ok(Hello {
                protocol,
                version,
                rank,
                world,
                fingerprint,
                nccl,
                last_epoch,
                nonce,
                transport,
                algorithm,
                endpoint,
                attributes,
            })
        })();
        rest.map_err(malformed)
    }
}

const REPLY_WELCOME: u8 = 1;
const REPLY_REFUSED: u8 = 2;
const REPLY_IDLE: u8 = 3;

impl Reply {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.u32(MAGIC).u32(PROTOCOL);
        match self {
            Reply::Welcome(w) => {
                e.u8(REPLY_WELCOME)
                    .u64(w.epoch)
                    .u8(match w.transport {
                        Transport::Tcp => 0,
                        Transport::Unix => 1,
                    })
                    .u8(algorithm_code(w.algorithm))
                    .u32(w.members.len() as u32);
                for (m, nonce) in w.members.iter().zip(&w.nonces) {
                    endpoint(&mut e, m);
                    e.u64(*nonce);
                }
                match &w.nccl {
                    Some(ids) => e.u8(1).bytes(&ids.data).bytes(&ids.control),
                    None => e.u8(0),
                };
                attributes(&mut e, &w.attributes);
            }
            Reply::Refused(err) => {
                e.u8(REPLY_REFUSED);
                encode_error(&mut e, err);
            }
            Reply::Idle {
                live_epoch,
                last_failure,
            } => {
                e.u8(REPLY_IDLE)
                    .u64(live_epoch.unwrap_or(0))
                    .opt_str(last_failure.as_deref());
            }
        }
        e.0
    }

    /// Decodes rank 0's reply to `own`, this rank's hello. A reply of another rendezvous
    /// protocol (rank 0 runs another kvlink build) is [`RendezvousError::VersionMismatch`],
    /// a refusal like the one rank 0 sends a hello of another protocol: retrying cannot
    /// cure it, so it must not read as a garbled message (`Protocol`, which may pass).
    pub(crate) fn decode_for(buf: &[u8], own: &Hello) -> Result<Reply, RendezvousError> {
        let mut d = Decoder::new(buf);
        if let (Ok(MAGIC), Ok(protocol)) = (d.u32("magic"), d.u32("protocol")) {
            if protocol != PROTOCOL {
                return Err(RendezvousError::VersionMismatch {
                    rank: own.rank,
                    expected: format!("a build of rendezvous protocol {protocol}"),
                    got: format!("{} (rendezvous protocol {PROTOCOL})", own.version),
                });
            }
        }
        Self::decode(buf)
    }

    /// Decodes a reply of this protocol; anything else is malformed.
    pub(crate) fn decode(buf: &[u8]) -> Result<Reply, RendezvousError> {
        let mut d = Decoder::new(buf);
        let r = (|| {
            if d.u32("magic")? != MAGIC {
                return Err(Malformed("not a kvlink reply".into()));
            }
            let protocol = d.u32("protocol")?;
            if protocol != PROTOCOL {
                return Err(Malformed(format!(
                    "rank 0 speaks rendezvous protocol {protocol}, this rank {PROTOCOL}"
                )));
            }
            match d.u8("reply kind")? {
                REPLY_WELCOME => {
                    let epoch = epoch(&mut d, "epoch")?;
                    let transport = match d.u8("transport")? {
                        0 => Transport::Tcp,
                        1 => Transport::Unix,
                        t => return Err(Malformed(format!("transport {t}"))),
                    };
                    let algorithm = read_algorithm(&mut d)?;
                    let n = d.u32("members")?;
                    let mut members = Vec::new();
                    let mut nonces = Vec::new();
                    for _ in 0..n {
                        members.push(read_endpoint(&mut d)?);
                        nonces.push(d.u64("nonce")?);
                    }
                    let nccl = match d.u8("nccl")? {
                        0 => None,
                        _ => Some(NcclIds {
                            data: id(d.bytes("nccl data id")?)?,
                            control: id(d.bytes("nccl control id")?)?,
                        }),
                    };
                    let attributes = read_attributes(&mut d)?;
                    Ok(Reply::Welcome(Box::new(Welcome {
                        epoch,
                        transport,
                        algorithm,
                        members,
                        nonces,
                        nccl,
                        attributes,
                    })))
                }
                REPLY_REFUSED => Ok(Reply::Refused(decode_error(&mut d)?)),
                REPLY_IDLE => {
                    let e = epoch(&mut d, "live epoch")?;
                    Ok(Reply::Idle {
                        live_epoch: (e != 0).then_some(e),
                        last_failure: d.opt_str("last failure")?,
                    })
                }
                k => Err(Malformed(format!("reply kind {k}"))),
            }
        })();
        r.map_err(malformed)
    }
}

fn id(b: &[u8]) -> Result<[u8; 128], Malformed> {
    b.try_into()
        .map_err(|_| Malformed("an NCCL unique id is 128 bytes".into()))
}

fn encode_error(e: &mut Encoder, err: &RendezvousError) {
    match err {
        RendezvousError::WorldSizeMismatch {
            rank,
            expected,
            got,
        } => {
            e.u8(1).u32(*rank).u32(*expected).u32(*got);
        }
        RendezvousError::DuplicateRank { rank } => {
            e.u8(2).u32(*rank);
        }
        RendezvousError::GeometryMismatch {
            rank,
            expected,
            got,
        } => {
            e.u8(3).u32(*rank).str(expected).str(got);
        }
        RendezvousError::VersionMismatch {
            rank,
            expected,
            got,
        } => {
            e.u8(4).u32(*rank).str(expected).str(got);
        }
        RendezvousError::SettingsMismatch {
            rank,
            what,
            expected,
            got,
        } => {
            e.u8(5).u32(*rank).str(what).str(expected).str(got);
        }
        RendezvousError::Timeout { missing, detail } => {
            e.u8(6).u32(missing.len() as u32);
            missing.iter().for_each(|m| {
                e.u32(*m);
            });
            e.str(detail);
        }
        RendezvousError::Nccl(detail) => {
            e.u8(7).str(detail);
        }
        // The words go first: a decoder that does not know the kind reads them as the detail
        // of a protocol error.
        RendezvousError::Config(detail) => {
            e.u8(8).str(&err.to_string()).str(detail);
        }
        RendezvousError::Occupied { rank, epoch } => {
            e.u8(9).str(&err.to_string()).u32(*rank).u64(*epoch);
        }
        RendezvousError::ClaimedTwice { rank, epoch } => {
            e.u8(10).str(&err.to_string()).u32(*rank).u64(*epoch);
        }
        other => {
            e.u8(0).str(&other.to_string());
        }
    }
}

fn decode_error(d: &mut Decoder<'_>) -> Result<RendezvousError, Malformed> {
    Ok(match d.u8("error kind")? {
        1 => RendezvousError::WorldSizeMismatch {
            rank: d.u32("rank")?,
            expected: d.u32("expected")?,
            got: d.u32("got")?,
        },
        2 => RendezvousError::DuplicateRank {
            rank: d.u32("rank")?,
        },
        3 => RendezvousError::GeometryMismatch {
            rank: d.u32("rank")?,
            expected: d.str("expected")?,
            got: d.str("got")?,
        },
        4 => RendezvousError::VersionMismatch {
            rank: d.u32("rank")?,
            expected: d.str("expected")?,
            got: d.str("got")?,
        },
        5 => RendezvousError::SettingsMismatch {
            rank: d.u32("rank")?,
            what: d.str("what")?,
            expected: d.str("expected")?,
            got: d.str("got")?,
        },
        6 => {
            let n = d.u32("missing")?;
            let missing = (0..n).map(|_| d.u32("rank")).collect::<Result<_, _>>()?;
            RendezvousError::Timeout {
                missing,
                detail: d.str("detail")?,
            }
        }
        7 => RendezvousError::Nccl(d.str("detail")?),
        8 => {
            d.str("words")?;
            RendezvousError::Config(d.str("detail")?)
        }
        9 => {
            d.str("words")?;
            RendezvousError::Occupied {
                rank: d.u32("rank")?,
                epoch: d.u64("epoch")?,
            }
        }
        10 => {
            d.str("words")?;
            RendezvousError::ClaimedTwice {
                rank: d.u32("rank")?,
                epoch: d.u64("epoch")?,
            }
        }
        _ => RendezvousError::Protocol(format!("rank 0 refused: {}", d.str("detail")?)),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A hello of rank `rank` (of 3, version 0.1.0) for tests.
    pub(crate) fn hello(rank: u32) -> Hello {
        Hello {
            protocol: PROTOCOL,
            version: "0.1.0".into(),
            rank,
            world: 3,
            fingerprint: [7; 32],
            nccl: false,
            last_epoch: 4,
            nonce: 99 + u64::from(rank),
            transport: TransportChoice::Auto,
            algorithm: Algorithm::Ring,
            endpoint: Endpoint {
                tcp: Some("127.0.0.1:4000".parse().unwrap()),
                unix: Some("kvlink-1".into()),
                host: "h".into(),
            },
            attributes: vec![("store".into(), "unix:@x".into())],
        }
    }

    #[test]
    fn hello_and_replies_round_trip() {
        let h = hello(2);
        assert_eq!(Hello::decode(&h.encode(), "0.1.0").unwrap(), h);
        let w = Welcome {
            epoch: 5,
            transport: Transport::Unix,
            algorithm: Algorithm::Direct,
            members: vec![h.endpoint.clone(), h.endpoint.clone()],
            nonces: vec![1, 2],
            nccl: Some(NcclIds {
                data: [1; 128],
                control: [2; 128],
            }),
            attributes: vec![("a".into(), "b".into())],
        };
        match Reply::decode(&Reply::Welcome(Box::new(w.clone())).encode()).unwrap() {
            Reply::Welcome(got) => assert_eq!(*got, w),
            other => panic!("{other:?}"),
        }
        // A welcome at an epoch past the last one is malformed (the rank would keep it as its
        // last epoch, and no formation after would have a next one).
        let far = Welcome {
            epoch: MAX_EPOCH + 1,
            ..w.clone()
        };
        assert!(Reply::decode(&Reply::Welcome(Box::new(far)).encode()).is_err());
        for err in [
            RendezvousError::WorldSizeMismatch {
                rank: 2,
                expected: 3,
                got: 4,
            },
            RendezvousError::DuplicateRank { rank: 1 },
            RendezvousError::GeometryMismatch {
                rank: 1,
                expected: "aa".into(),
                got: "bb".into(),
            },
            RendezvousError::Timeout {
                missing: vec![1, 2],
                detail: "x".into(),
            },
            RendezvousError::Config("rank 5 of a group of 3".into()),
            RendezvousError::Occupied { rank: 2, epoch: 7 },
        ] {
            let back = Reply::decode(&Reply::Refused(err.clone()).encode()).unwrap();
            match back {
                Reply::Refused(e) => {
                    assert_eq!(e.to_string(), err.to_string());
                    assert_eq!(
                        std::mem::discriminant(&e),
                        std::mem::discriminant(&err),
                        "{e:?}"
                    );
                }
                other => panic!("{other:?}"),
            }
        }
        // What has no kind of its own reaches the joiner as a protocol error with its words.
        let io = RendezvousError::io("accept", std::io::Error::other("gone"));
        match Reply::decode(&Reply::Refused(io.clone()).encode()).unwrap() {
            Reply::Refused(RendezvousError::Protocol(m)) => assert!(m.contains("accept: gone")),
            other => panic!("{other:?}"),
        }
        let idle = Reply::Idle {
            live_epoch: Some(3),
            last_failure: None,
        };
        assert!(matches!(
            Reply::decode(&idle.encode()).unwrap(),
            Reply::Idle {
                live_epoch: Some(3),
                last_failure: None
            }
        ));
    }

    /// What a formed group speaks, pinned to the protocol number: ranks of one protocol must
    /// agree on all of it, and the version string (the crate's, `0.1.0` since the start) does
    /// not tell builds apart. Changing any of these values means bumping [`PROTOCOL`] and
    /// this pin together (the plan digest's seed once changed without it: ranks of the two
    /// builds formed a group and disagreed at every gate).
    #[test]
    fn the_wire_of_this_protocol_is_pinned() {
        use crate::gate::{GATE_MAGIC, GATE_WORD, LOOKUP_DIGEST_SEED, LOOKUP_WORD};
        let wire = (
            PROTOCOL,
            crate::PLAN_DIGEST_SEED,
            LOOKUP_DIGEST_SEED,
            GATE_MAGIC,
            GATE_WORD,
            LOOKUP_WORD,
            crate::status::MAGIC,
        );
        let pinned = (
            8,
            0x6b76_6c69_6e6b_0002,
            0x6b76_6c69_6e6b_0001 ^ 0x6c6f_6f6b,
            b"KVG3",
            344,
            24,
            0x5a,
        );
        assert_eq!(
            wire, pinned,
            "the group's wire changed: bump PROTOCOL, then this pin"
        );
        // The layout too, not only the sizes: one gate word's bytes, and how many status
        // kinds a peer can name.
        let mut word = crate::GateWord {
            digest: [7; 16],
            batch: 3,
            count: 2,
            proposal: 1 | (1 << 63),
            last_batch_us: 812_345,
            alone: Default::default(),
        };
        word.alone.settled(1, true);
        assert_eq!(
            xxhash_rust::xxh3::xxh3_64(&word.encode()),
            0x0e82_b059_4cc4_17bf,
            "the gate word's layout changed: bump PROTOCOL, then this pin"
        );
        // Kinds appended are read as "other" by an older peer: no bump needed, only this pin
        // (a kind removed or moved changes the wire: bump).
        assert_eq!(
            crate::status::KIND_NAMES.len(),
            25,
            "status kinds changed: update this pin (bump PROTOCOL unless only appended)"
        );
    }

    /// A joiner reading rank 0's reply from a build of another protocol: a refusal (retrying
    /// cannot cure it), as rank 0's own answer to such a hello is; it read as a garbled
    /// message before (`Protocol`, not a refusal: the linker retried it as an outage).
    #[test]
    fn a_reply_of_another_protocol_is_a_version_mismatch_refusal() {
        let idle = Reply::Idle {
            live_epoch: None,
            last_failure: None,
        };
        let mut bytes = idle.encode();
        bytes[4..8].copy_from_slice(&(PROTOCOL + 1).to_le_bytes());
        let err = Reply::decode_for(&bytes, &hello(3)).unwrap_err();
        assert!(
            matches!(&err, RendezvousError::VersionMismatch { rank: 3, expected, .. }
                if expected.contains(&(PROTOCOL + 1).to_string())),
            "{err:?}"
        );
        assert!(err.is_refusal());
        // Garbage and this protocol's replies decode as before.
        assert!(matches!(
            Reply::decode_for(b"nonsense", &hello(3)),
            Err(RendezvousError::Protocol(_))
        ));
        assert!(matches!(
            Reply::decode_for(&idle.encode(), &hello(3)),
            Ok(Reply::Idle { .. })
        ));
    }

    #[test]
    fn a_hello_of_another_protocol_is_a_version_mismatch_naming_its_rank() {
        let mut h = hello(2);
        h.protocol = PROTOCOL + 1;
        h.version = "9.9.9".into();
        let err = Hello::decode(&h.encode(), "0.1.0").unwrap_err();
        assert!(
            matches!(&err, RendezvousError::VersionMismatch { rank: 2, got, .. } if got.contains("9.9.9")),
            "{err:?}"
        );
        // Garbage is a protocol error, truncation too.
        assert!(matches!(
            Hello::decode(b"nonsense", "0.1.0"),
            Err(RendezvousError::Protocol(_))
        ));
        let bytes = hello(1).encode();
        assert!(Hello::decode(&bytes[..bytes.len() - 3], "0.1.0").is_err());
    }

    /// An epoch past `MAX_EPOCH` is a malformed hello.
    #[test]
    fn an_epoch_past_the_last_one_is_malformed() {
        let mut h = hello(1);
        h.last_epoch = MAX_EPOCH + 1;
        assert!(matches!(
            Hello::decode(&h.encode(), "0.1.0"),
            Err(RendezvousError::Protocol(_))
        ));
        h.last_epoch = MAX_EPOCH;
        assert_eq!(Hello::decode(&h.encode(), "0.1.0").unwrap(), h);
    }

    /// A version or host string past the bound is a malformed hello (refused to its sender
    /// alone). Before, it went whole into the refusal rank 0 sends every member, which a
    /// megabyte string pushed past the frame limit: no member was told.
    #[test]
    fn a_hello_with_a_huge_version_or_host_is_malformed() {
        let mut other = hello(2);
        other.protocol = PROTOCOL + 1;
        other.version = "9".repeat(MAX_PEER_TEXT + 1);
        assert!(matches!(
            Hello::decode(&other.encode(), "0.1.0"),
            Err(RendezvousError::Protocol(_))
        ));
        let mut far = hello(1);
        far.endpoint.host = "h".repeat(MAX_PEER_TEXT + 1);
        assert!(matches!(
            Hello::decode(&far.encode(), "0.1.0"),
            Err(RendezvousError::Protocol(_))
        ));
        // An endpoint's names too: each goes into the welcome every rank reads. Before, a unix
        // name of a frame's size made rank 0's welcome too large for a frame: every rank was
        // refused (`Config`).
        let mut far = hello(1);
        far.endpoint.unix = Some("u".repeat(MAX_PEER_TEXT + 1));
        assert!(matches!(
            Hello::decode(&far.encode(), "0.1.0"),
            Err(RendezvousError::Protocol(_))
        ));
        let mut e = Encoder::default();
        e.opt_str(Some(&"1".repeat(MAX_PEER_TEXT + 1)))
            .opt_str(None)
            .str("h");
        assert!(read_endpoint(&mut Decoder::new(&e.0)).is_err());
        // At the bound both still decode.
        let mut long = hello(1);
        long.version = "9".repeat(MAX_PEER_TEXT);
        long.endpoint.host = "h".repeat(MAX_PEER_TEXT);
        assert_eq!(Hello::decode(&long.encode(), "0.1.0").unwrap(), long);
    }
}
