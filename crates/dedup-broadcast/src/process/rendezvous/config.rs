//! What a rank brings to a rendezvous: its rank, the world size, where to meet, and what the
//! group checks (geometry, version) and carries (NCCL, attributes). Built in code or read
//! from the environment in the style of engine launchers.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use kv_geometry::{GeometryFingerprint, KvGeometry};

use super::message::TransportChoice;
use super::{KeyValueExchange, RendezvousError};
use crate::process::socket_collective::Algorithm;

/// The kvlink version every rank of a group must share.
pub const KVLINK_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Where the ranks of a group meet.
#[derive(Clone)]
pub enum MeetingPoint {
    /// Rank 0 listens at `host:port`; the other ranks connect to it.
    Tcp(String),
    /// The engine's own key-value exchange (a store it already runs), keys under `prefix`.
    Exchange {
        /// The exchange.
        exchange: Arc<dyn KeyValueExchange>,
        /// Keys this group uses start with it (one prefix per group).
        prefix: String,
    },
}

impl std::fmt::Debug for MeetingPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MeetingPoint::Tcp(a) => write!(f, "Tcp({a})"),
            MeetingPoint::Exchange { prefix, .. } => write!(f, "Exchange({prefix})"),
        }
    }
}

/// One rank's rendezvous settings.
///
/// ```
/// use std::time::Duration;
/// use dedup_broadcast::{MeetingPoint, RendezvousConfig};
/// use kv_geometry::{KvGeometry, ModelKvSpec};
/// let geometry = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 4, 2).unwrap();
/// let config = RendezvousConfig::new(2, 4, MeetingPoint::Tcp("127.0.0.1:29600".into()))
///     .geometry(&geometry)
///     .timeout(Duration::from_secs(30));
/// assert_eq!((config.rank, config.world), (2, 4));
///
/// // The same from a launcher's environment (torch's names work as fallbacks).
/// let vars = [("RANK", "2"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")];
/// let env = RendezvousConfig::from_vars(|k| {
///     vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
/// })
/// .unwrap();
/// assert!(matches!(env.meet, MeetingPoint::Tcp(ref a) if a == "10.0.0.1:29500"));
/// ```
#[derive(Debug, Clone)]
pub struct RendezvousConfig {
    /// This rank, `0..world`. Rank 0 leads every formation.
    pub rank: u32,
    /// Ranks in the group (at most 65,536).
    pub world: u32,
    /// Where to meet.
    pub meet: MeetingPoint,
    /// The geometry every rank must share ([`KvGeometry::group_fingerprint`]); all zero
    /// when not set (then only other all-zero ranks match).
    pub fingerprint: GeometryFingerprint,
    /// kvlink's version ([`KVLINK_VERSION`]); ranks of another version are refused.
    pub version: String,
    /// Whether the group shares over NCCL: rank 0 then makes two unique ids (data, control)
    /// and ships them.
    pub nccl: bool,
    /// How long one formation may take, on every rank.
    pub timeout: Duration,
    /// Unix sockets or TCP for the socket collective (rank 0's choice wins).
    pub transport: TransportChoice,
    /// How the socket collective moves rows (rank 0's choice wins).
    pub algorithm: Algorithm,
    /// The IP this rank's collective listens on when the meeting point does not tell (a
    /// key-value exchange); defaults to loopback. Over TCP, the interface that reaches rank
    /// 0 is used.
    pub host_ip: Option<IpAddr>,
    /// Rank 0's attributes reach every rank (e.g. the address of a store it serves); other
    /// ranks' are not sent.
    pub attributes: BTreeMap<String, String>,
}

/// The most ranks a process group may have (a TP group is 8, 16 at most today).
pub(crate) const MAX_WORLD: u32 = 1 << 16;

impl RendezvousConfig {
    /// Rank `rank` of `world`, meeting at `meet`; a 60 s timeout, this build's version, no
    /// NCCL, automatic transport, the ring algorithm.
    pub fn new(rank: u32, world: u32, meet: MeetingPoint) -> Self {
        RendezvousConfig {
            rank,
            world,
            meet,
            fingerprint: GeometryFingerprint([0; 32]),
            version: KVLINK_VERSION.to_string(),
            nccl: false,
            timeout: Duration::from_secs(60),
            transport: TransportChoice::Auto,
            algorithm: Algorithm::Ring,
            host_ip: None,
            attributes: BTreeMap::new(),
        }
    }

    /// Checks this geometry with every rank (its [`KvGeometry::group_fingerprint`]).
    pub fn geometry(mut self, geometry: &KvGeometry) -> Self {
        self.fingerprint = geometry.group_fingerprint();
        self
    }

    /// Checks this fingerprint with every rank.
    pub fn fingerprint(mut self, fingerprint: GeometryFingerprint) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    /// Reports this version instead of the build's (tests; a launcher that pins builds).
    pub fn version(mut self, version: impl Into<String>) -> Self {
        self.version = version.into();
        self
    }

    /// Asks for NCCL unique ids.
    pub fn nccl(mut self, nccl: bool) -> Self {
        self.nccl = nccl;
        self
    }

    /// How long a formation may take.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The transport of the socket collective.
    pub fn transport(mut self, transport: TransportChoice) -> Self {
        self.transport = transport;
        self
    }

    /// The socket collective's algorithm.
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// The IP to listen on when the meeting point does not tell.
    pub fn host_ip(mut self, ip: IpAddr) -> Self {
        self.host_ip = Some(ip);
        self
    }

    /// An attribute rank 0 ships to every rank.
    pub fn attribute(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.attributes.insert(key.into(), value.into());
        self
    }

    /// From the process environment; see [`from_vars`](Self::from_vars).
    pub fn from_env() -> Result<Self, RendezvousError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// From variables, in the style of engine launchers (each `KVLINK_` name first, then the
    /// name torch's launchers set):
    ///
    /// | setting | variable | fallback |
    /// |---|---|---|
    /// | rank | `KVLINK_RANK` | `RANK` |
    /// | world size | `KVLINK_WORLD_SIZE` | `WORLD_SIZE` |
    /// | meeting point | `KVLINK_RENDEZVOUS` (`host:port`) | `MASTER_ADDR`:`MASTER_PORT` |
    /// | timeout, seconds | `KVLINK_RENDEZVOUS_TIMEOUT` | 60 |
    /// | transport | `KVLINK_TRANSPORT` (`auto`, `tcp`, `unix`) | `auto` |
    /// | algorithm | `KVLINK_COLLECTIVE` (`ring`, `direct`) | `ring` |
    ///
    /// In a process where torch itself already listens on `MASTER_PORT` (its own store), set
    /// `KVLINK_RENDEZVOUS` to another port. A variable set to nothing counts as unset.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, RendezvousError> {
        // A variable set to nothing (or blanks) counts as unset, as the Mooncake settings'
        // reader takes it: `KVLINK_RANK=` falls back to `RANK`, not to an error.
        let var = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        let pick = |a: &str, b: &str| var(a).or_else(|| var(b));
        let num = |a: &str, b: &str| -> Result<u32, RendezvousError> {
            let v = pick(a, b)
                .ok_or_else(|| RendezvousError::Config(format!("neither {a} nor {b} is set")))?;
            v.trim()
                .parse()
                .map_err(|_| RendezvousError::Config(format!("{a}/{b}: {v:?} is not a number")))
        };
        let rank = num("KVLINK_RANK", "RANK")?;
        let world = num("KVLINK_WORLD_SIZE", "WORLD_SIZE")?;
        let meet = match var("KVLINK_RENDEZVOUS") {
            Some(a) => a,
            None => match (var("MASTER_ADDR"), var("MASTER_PORT")) {
                (Some(h), Some(p)) => format!("{h}:{p}"),
                _ => {
                    return Err(RendezvousError::Config(
                        "set KVLINK_RENDEZVOUS=host:port (or MASTER_ADDR and MASTER_PORT)".into(),
                    ))
                }
            },
        };
        let mut config = RendezvousConfig::new(rank, world, MeetingPoint::Tcp(meet));
        if let Some(t) = var("KVLINK_RENDEZVOUS_TIMEOUT") {
            let secs: f64 = t.trim().parse().map_err(|_| {
                RendezvousError::Config(format!("KVLINK_RENDEZVOUS_TIMEOUT: {t:?} is not seconds"))
            })?;
            config.timeout = Duration::try_from_secs_f64(secs).map_err(|_| {
                RendezvousError::Config(format!("KVLINK_RENDEZVOUS_TIMEOUT: {t:?} is not seconds"))
            })?;
        }
        if let Some(t) = var("KVLINK_TRANSPORT") {
            config.transport = TransportChoice::parse(&t).ok_or_else(|| {
                RendezvousError::Config(format!("KVLINK_TRANSPORT: {t:?} (auto, tcp or unix)"))
            })?;
        }
        if let Some(a) = var("KVLINK_COLLECTIVE") {
            config.algorithm = Algorithm::parse(&a).ok_or_else(|| {
                RendezvousError::Config(format!("KVLINK_COLLECTIVE: {a:?} (ring or direct)"))
            })?;
        }
        Ok(config)
    }

    /// Refuses settings that cannot work, before any I/O.
    pub(crate) fn validate(&self) -> Result<(), RendezvousError> {
        if self.world == 0 || self.rank >= self.world {
            return Err(RendezvousError::Config(format!(
                "rank {} of a group of {}",
                self.rank, self.world
            )));
        }
        // The transport's rank arithmetic stays in `u32` well below this.
        if self.world > MAX_WORLD {
            return Err(RendezvousError::Config(format!(
                "a group of {} ranks: at most {MAX_WORLD}",
                self.world
            )));
        }
        if self.timeout.is_zero() {
            return Err(RendezvousError::Config("a zero rendezvous timeout".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(list: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            list.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn kvlink_names_win_over_torch_names() {
        let c = RendezvousConfig::from_vars(vars(&[
            ("KVLINK_RANK", "1"),
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("KVLINK_RENDEZVOUS", "h:1"),
            ("MASTER_ADDR", "x"),
            ("MASTER_PORT", "2"),
            ("KVLINK_RENDEZVOUS_TIMEOUT", "2.5"),
            ("KVLINK_TRANSPORT", "TCP"),
            ("KVLINK_COLLECTIVE", "direct"),
        ]))
        .unwrap();
        assert_eq!((c.rank, c.world), (1, 8));
        assert!(matches!(c.meet, MeetingPoint::Tcp(ref a) if a == "h:1"));
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(c.transport, TransportChoice::Tcp);
        assert_eq!(c.algorithm, Algorithm::Direct);
    }

    /// A variable set to nothing counts as unset: the torch names behind it are taken.
    #[test]
    fn empty_kvlink_variables_fall_back_to_torch_names() {
        let c = RendezvousConfig::from_vars(vars(&[
            ("KVLINK_RANK", ""),
            ("RANK", "1"),
            ("KVLINK_WORLD_SIZE", " "),
            ("WORLD_SIZE", "2"),
            ("KVLINK_RENDEZVOUS", ""),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "7"),
            ("KVLINK_RENDEZVOUS_TIMEOUT", ""),
        ]))
        .unwrap();
        assert_eq!((c.rank, c.world), (1, 2));
        assert!(matches!(c.meet, MeetingPoint::Tcp(ref a) if a == "h:7"));
        assert_eq!(
            c.timeout,
            RendezvousConfig::new(0, 1, c.meet.clone()).timeout
        );
    }

    #[test]
    fn missing_or_bad_variables_are_config_errors() {
        for bad in [
            &[("RANK", "0")][..],
            &[
                ("RANK", "x"),
                ("WORLD_SIZE", "2"),
                ("KVLINK_RENDEZVOUS", "h:1"),
            ],
            &[("RANK", "0"), ("WORLD_SIZE", "2")],
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("KVLINK_RENDEZVOUS", "h:1"),
                ("KVLINK_TRANSPORT", "pigeon"),
            ],
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("KVLINK_RENDEZVOUS", "h:1"),
                ("KVLINK_RENDEZVOUS_TIMEOUT", "-1"),
            ],
        ] {
            let list: &'static [(&'static str, &'static str)] =
                Box::leak(bad.to_vec().into_boxed_slice());
            let e = RendezvousConfig::from_vars(vars(list)).unwrap_err();
            assert!(matches!(e, RendezvousError::Config(_)), "{bad:?}: {e:?}");
        }
        let c = RendezvousConfig::new(2, 2, MeetingPoint::Tcp("h:1".into()));
        assert!(matches!(c.validate(), Err(RendezvousError::Config(_))));
        // Past the bound, the transport's rank arithmetic could overflow.
        let c = RendezvousConfig::new(0, MAX_WORLD + 1, MeetingPoint::Tcp("h:1".into()));
        assert!(matches!(c.validate(), Err(RendezvousError::Config(_))));
        let c = RendezvousConfig::new(0, MAX_WORLD, MeetingPoint::Tcp("h:1".into()));
        assert!(c.validate().is_ok());
    }
}
