//! [`MooncakeConfig`]: a typed builder, and the environment the way SGLang reads it.

use std::path::PathBuf;
use std::time::Duration;

use mooncake_sys::ReplicateConfig;

use crate::store::StoreError;

/// Where [`MooncakeConfig::from_env`] could not use a variable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MooncakeConfigError {
    /// A required variable is unset or empty.
    #[error("{var} is not set (the Mooncake master's address, e.g. 127.0.0.1:50051)")]
    Missing {
        /// The variable.
        var: &'static str,
    },
    /// A variable's value cannot be used.
    #[error("{var}={value:?}: {reason}")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// Why.
        reason: String,
    },
}

/// How to reach and join a Mooncake Store.
///
/// Build it with [`MooncakeConfig::new`] and the setters, or read it with
/// [`MooncakeConfig::from_env`]:
///
/// | variable | setter | default | meaning |
/// |---|---|---|---|
/// | `MOONCAKE_MASTER` | [`new`](Self::new) | (required) | master RPC address, `host:port` |
/// | `MOONCAKE_PROTOCOL` | [`protocol`](Self::protocol) | `tcp` | transport: `tcp` or `rdma` |
/// | `MOONCAKE_DEVICE` | [`device`](Self::device) | empty | RDMA device name(s); empty for TCP |
/// | `MOONCAKE_TE_META_DATA_SERVER` | [`metadata_server`](Self::metadata_server) | `P2PHANDSHAKE` | transfer-engine metadata: `P2PHANDSHAKE`, `http://…`, `etcd://…` |
/// | `MOONCAKE_GLOBAL_SEGMENT_SIZE` | [`global_segment_size`](Self::global_segment_size) | 4 GiB | RAM this process lends to the pool (`0`: pure client); bytes or `4gb`, `512MB`, `1 GB` (1024-based) |
/// | `MOONCAKE_LOCAL_BUFFER_SIZE` (else `SGLANG_MOONCAKE_LOCAL_BUFFER_SIZE`) | [`local_buffer_size`](Self::local_buffer_size) | 16 MiB | the client's staging buffer for copying puts/gets |
/// | `MOONCAKE_LOCAL_HOSTNAME` (else `LOCAL_HOSTNAME`) | [`local_hostname`](Self::local_hostname) | `localhost` | address other clients reach this one at |
/// | `MOONCAKE_TENANT_ID` | [`tenant`](Self::tenant) | [`DEFAULT_TENANT`] | the Mooncake tenant (key space) objects are put and found in, as the wheel and SGLang read it |
/// | `MOONCAKE_STORE_LIBRARY` | [`library`](Self::library) | search (mooncake-sys) | the store library (kvlink shim) to load |
/// | `KVLINK_MOONCAKE_READ_STREAMS` | [`read_streams`](Self::read_streams) | [`auto_read_streams`] | concurrent calls one ranged read is split into (kvlink's own) |
/// | `KVLINK_MOONCAKE_STAGED_MERGE` | [`staged_merge`](Self::staged_merge) | on for `tcp` (not used over other protocols) | read a key's ranges that continue in the object as one range through scratch (kvlink's own; `0`/`1`) |
///
/// Differences from SGLang: the protocol defaults to `tcp` (SGLang's newest default is `rdma`),
/// and `MOONCAKE_DEVICE` must be a device name (SGLang also accepts a JSON map by TP rank).
///
/// Variables read by the Mooncake client itself (not through this type): `MC_TCP_LANES_PER_PEER`
/// (TCP connections per storage node, default 4: more read streams than this queue behind
/// each other), `MC_TCP_BIND_ADDRESS`
/// (the address advertised to peers; needed where no non-loopback NIC exists), `MC_LOG_LEVEL`,
/// and `MC_STORE_CLIENT_SETUP_RETRIES` (default 20): with the master unreachable,
/// [`MooncakeStore::connect`](super::MooncakeStore::connect) fails only after all retries,
/// about 90 s with the default (measured); lower it to fail fast.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MooncakeConfig {
    master: String,
    protocol: String,
    device: String,
    metadata_server: String,
    global_segment_size: u64,
    local_buffer_size: u64,
    local_hostname: String,
    library: Option<PathBuf>,
    replicate: ReplicateConfig,
    lease: Duration,
    read_streams: usize,
    staged_merge: Option<bool>,
    registered_only: bool,
    tenant: String,
}

/// The Mooncake tenant a client joins unless told otherwise (the wheel's default).
pub const DEFAULT_TENANT: &str = "default";

/// SGLang's default global segment: "4gb".
pub const DEFAULT_GLOBAL_SEGMENT_SIZE: u64 = 4 << 30;
/// SGLang's default local buffer: 16 MiB.
pub const DEFAULT_LOCAL_BUFFER_SIZE: u64 = 16 << 20;
/// The master's default read lease (`--default_kv_lease_ttl`, 10 s).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);
/// The shortest read lease [`MooncakeStore::connect`](super::MooncakeStore::connect) takes
/// ([`MooncakeConfig::lease`], 100 ms): the linker renews a session at most every 50 ms, and
/// the store drops its record of a session at twice the lease, so a shorter one ends the
/// sessions a load still reads under (a zero one, every session at the next start). This is a
/// floor against nonsense, not a fit: the lease must outlast each store call (the master's
/// default is 10 s).
pub const MIN_LEASE: Duration = Duration::from_millis(100);
/// The most read streams [`MooncakeConfig::read_streams`] takes (the wheel's ceiling on TCP
/// connections per storage node, `MC_TCP_LANES_PER_PEER`, is 16).
pub const MAX_READ_STREAMS: usize = 16;

/// The default number of read streams on a machine with `cores` CPUs: one per four cores,
/// from 2 to 4 (1 on a single core).
///
/// Each stream is a thread waiting inside the wheel's call, which polls for completion every
/// 10 µs, so streams cost CPU beside the transfer threads. They pay anyway from two cores up:
/// on the 2-core VM, in four runs reading a 32K-token GLM-5.2 prefix (docs/benchmarks.md,
/// "Two read streams on two cores"), 2 streams read every call size faster than 1 (the
/// store's 78-layer call 924–1231 ms against 1105–1450; one layer per call, in the three runs
/// that had it, 2407–2535 against 2916–3384), and the linker's load with no compute took
/// 932–1191 against 1087–1298 ms (many concurrent one-layer *calls*, `read_parallelism`, are
/// what lost there).
///
/// On the 16-core GPU host a client's read of one storage node runs against one transfer
/// thread of the node, at about a full core during any large read (docs/benchmarks.md, "What
/// bounds one client").
/// Reading a 32K-token GLM-5.2 prefix (all 78 layers per call), 4 streams were ahead of 8 by
/// 2–12 % in six runs and level in one (the store's read, or the linker's load: 630 against
/// 658 ms in the last); at TP 8, with eight clients on the host, the two were within the runs'
/// spread of each other. The store's own 8- and 26-layer calls, outside the linker, read
/// faster with 8 (730 against 824 ms; 585 against 601).
///
/// ```
/// use mooncake_linker::store::mooncake::auto_read_streams;
/// assert_eq!(auto_read_streams(0), 1);
/// assert_eq!(auto_read_streams(1), 1);
/// assert_eq!(auto_read_streams(2), 2);
/// assert_eq!(auto_read_streams(12), 3);
/// assert_eq!(auto_read_streams(16), 4);
/// assert_eq!(auto_read_streams(64), 4);
/// ```
pub fn auto_read_streams(cores: usize) -> usize {
    (cores / 4).clamp(2, 4).min(cores.max(1))
}

fn default_read_streams() -> usize {
    auto_read_streams(std::thread::available_parallelism().map_or(1, usize::from))
}

impl MooncakeConfig {
    /// Defaults (see the table) for a master at `master` (`host:port`).
    pub fn new(master: impl Into<String>) -> Self {
        Self {
            master: master.into(),
            protocol: "tcp".into(),
            device: String::new(),
            metadata_server: "P2PHANDSHAKE".into(),
            global_segment_size: DEFAULT_GLOBAL_SEGMENT_SIZE,
            local_buffer_size: DEFAULT_LOCAL_BUFFER_SIZE,
            local_hostname: "localhost".into(),
            library: None,
            replicate: ReplicateConfig::default(),
            lease: DEFAULT_LEASE,
            read_streams: default_read_streams(),
            staged_merge: None,
            registered_only: false,
            tenant: DEFAULT_TENANT.into(),
        }
    }

    /// Reads the process environment (see the table).
    pub fn from_env() -> Result<Self, MooncakeConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`from_env`](Self::from_env), reading variables through `get` (for tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, MooncakeConfigError> {
        let var = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        let master = var("MOONCAKE_MASTER").ok_or(MooncakeConfigError::Missing {
            var: "MOONCAKE_MASTER",
        })?;
        let mut cfg = Self::new(master.trim());
        if let Some(p) = var("MOONCAKE_PROTOCOL") {
            cfg.protocol = p.trim().to_owned();
        }
        if let Some(d) = get("MOONCAKE_DEVICE") {
            let d = d.trim();
            if d.starts_with('{') {
                return Err(MooncakeConfigError::Invalid {
                    var: "MOONCAKE_DEVICE",
                    value: d.to_owned(),
                    reason: "per-rank JSON device maps are not supported; give the device name(s)"
                        .into(),
                });
            }
            cfg.device = d.to_owned();
        }
        if let Some(m) = var("MOONCAKE_TE_META_DATA_SERVER") {
            cfg.metadata_server = m.trim().to_owned();
        }
        if let Some(v) = var("MOONCAKE_GLOBAL_SEGMENT_SIZE") {
            cfg.global_segment_size = size_var("MOONCAKE_GLOBAL_SEGMENT_SIZE", &v)?;
        }
        if let Some((name, v)) = var("MOONCAKE_LOCAL_BUFFER_SIZE")
            .map(|v| ("MOONCAKE_LOCAL_BUFFER_SIZE", v))
            .or_else(|| {
                var("SGLANG_MOONCAKE_LOCAL_BUFFER_SIZE")
                    .map(|v| ("SGLANG_MOONCAKE_LOCAL_BUFFER_SIZE", v))
            })
        {
            cfg.local_buffer_size = size_var(name, &v)?;
        }
        if let Some(h) = var("MOONCAKE_LOCAL_HOSTNAME").or_else(|| var("LOCAL_HOSTNAME")) {
            cfg.local_hostname = h.trim().to_owned();
        }
        if let Some(t) = var("MOONCAKE_TENANT_ID") {
            cfg.tenant = t.trim().to_owned();
        }
        if let Some(l) = var("MOONCAKE_STORE_LIBRARY") {
            cfg.library = Some(PathBuf::from(l));
        }
        if let Some(v) = var("KVLINK_MOONCAKE_READ_STREAMS") {
            cfg.read_streams = match v.trim().parse::<usize>() {
                Ok(n) if (1..=MAX_READ_STREAMS).contains(&n) => n,
                _ => {
                    return Err(MooncakeConfigError::Invalid {
                        var: "KVLINK_MOONCAKE_READ_STREAMS",
                        value: v,
                        reason: format!("expected 1 to {MAX_READ_STREAMS}"),
                    })
                }
            };
        }
        if let Some(v) = var("KVLINK_MOONCAKE_STAGED_MERGE") {
            cfg.staged_merge = match v.trim() {
                "1" | "true" | "on" => Some(true),
                "0" | "false" | "off" => Some(false),
                _ => {
                    return Err(MooncakeConfigError::Invalid {
                        var: "KVLINK_MOONCAKE_STAGED_MERGE",
                        value: v,
                        reason: "expected 0 or 1".into(),
                    })
                }
            };
        }
        Ok(cfg)
    }

    /// Transport: `tcp` or `rdma`.
    pub fn protocol(mut self, protocol: impl Into<String>) -> Self {
        self.protocol = protocol.into();
        self
    }

    /// RDMA device name(s) (empty for TCP).
    pub fn device(mut self, device: impl Into<String>) -> Self {
        self.device = device.into();
        self
    }

    /// Transfer-engine metadata service.
    pub fn metadata_server(mut self, metadata_server: impl Into<String>) -> Self {
        self.metadata_server = metadata_server.into();
        self
    }

    /// Bytes of this process's RAM mounted into the pool (0: a pure client).
    pub fn global_segment_size(mut self, bytes: u64) -> Self {
        self.global_segment_size = bytes;
        self
    }

    /// Bytes of the client's local staging buffer.
    pub fn local_buffer_size(mut self, bytes: u64) -> Self {
        self.local_buffer_size = bytes;
        self
    }

    /// Address other clients reach this one at.
    pub fn local_hostname(mut self, hostname: impl Into<String>) -> Self {
        self.local_hostname = hostname.into();
        self
    }

    /// The Mooncake tenant whose key space this client puts and finds objects in: servers
    /// that share a cache (kvlink's and SGLang's alike) name the same one, and tenants
    /// meant to be apart name different ones. Tenants have key spaces of their own on a
    /// master in strict multi-tenant mode (`--enable_multi_tenants`, tenants registered in
    /// its quota policy), where an unregistered tenant's puts fail
    /// (`TENANT_NOT_REGISTERED`); without it the pinned wheel's master keeps one key space
    /// for every tenant (measured).
    pub fn tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = tenant.into();
        self
    }

    /// The store library to load (default: mooncake-sys's search).
    pub fn library(mut self, path: impl Into<PathBuf>) -> Self {
        self.library = Some(path.into());
        self
    }

    /// Replication of puts (default: one replica, no pinning).
    pub fn replicate(mut self, replicate: ReplicateConfig) -> Self {
        self.replicate = replicate;
        self
    }

    /// The master's read lease (`--default_kv_lease_ttl`), reported in read sessions so that
    /// callers renew in time. Under [`MIN_LEASE`] the store refuses to connect.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Concurrent calls one ranged read is split into, by bytes (clamped to
    /// 1..=[`MAX_READ_STREAMS`]; reads under 4 MiB per stream are not split). Default:
    /// [`auto_read_streams`] of this machine's cores.
    pub fn read_streams(mut self, streams: usize) -> Self {
        self.read_streams = streams.clamp(1, MAX_READ_STREAMS);
        self
    }

    /// Whether a key's ranges that continue each other in the object but not in memory (several
    /// layers of a page into a layer-major pool) are read as one range into the store's scratch
    /// and copied out: one round trip instead of one per range, for a memory copy. TCP only:
    /// the scratch is not registered for RDMA (whose transport does not serialise ranges
    /// anyway), so over any other protocol the setting is not used (the store logs a warning
    /// when it is on there). Default: on for `tcp`.
    pub fn staged_merge(mut self, on: bool) -> Self {
        self.staged_merge = Some(on);
        self
    }

    /// Whether the store treats memory as it must over RDMA whatever the protocol: only
    /// memory registered with it moves in place; a read into other memory goes through the
    /// store's registered bounce, a put from it through the client's copying put, and no
    /// staged merge is used (its scratch is not registered). Over RDMA this is always so; set
    /// it over TCP to run those paths where no RDMA device is. Default: off.
    pub fn registered_only(mut self, on: bool) -> Self {
        self.registered_only = on;
        self
    }

    /// Whether any memory moves in place: over TCP (whose sender and receiver need no
    /// registration), unless [`registered_only`](Self::registered_only) is set.
    pub(crate) fn any_memory_in_place(&self) -> bool {
        self.protocol.eq_ignore_ascii_case("tcp") && !self.registered_only
    }

    /// The master's address.
    pub fn master_addr(&self) -> &str {
        &self.master
    }

    /// See [`protocol`](Self::protocol).
    pub fn protocol_name(&self) -> &str {
        &self.protocol
    }

    /// See [`device`](Self::device).
    pub fn device_name(&self) -> &str {
        &self.device
    }

    /// See [`metadata_server`](Self::metadata_server).
    pub fn metadata_server_addr(&self) -> &str {
        &self.metadata_server
    }

    /// See [`global_segment_size`](Self::global_segment_size).
    pub fn global_segment_bytes(&self) -> u64 {
        self.global_segment_size
    }

    /// See [`local_buffer_size`](Self::local_buffer_size).
    pub fn local_buffer_bytes(&self) -> u64 {
        self.local_buffer_size
    }

    /// See [`local_hostname`](Self::local_hostname).
    pub fn hostname(&self) -> &str {
        &self.local_hostname
    }

    /// See [`tenant`](Self::tenant).
    pub fn tenant_id(&self) -> &str {
        &self.tenant
    }

    /// See [`library`](Self::library).
    pub fn library_path(&self) -> Option<&std::path::Path> {
        self.library.as_deref()
    }

    /// See [`replicate`](Self::replicate).
    pub fn replicate_config(&self) -> &ReplicateConfig {
        &self.replicate
    }

    /// See [`lease`](Self::lease).
    pub fn lease_duration(&self) -> Duration {
        self.lease
    }

    /// A lease under [`MIN_LEASE`] is an `InvalidArgument`.
    pub(crate) fn check_lease(&self) -> Result<(), StoreError> {
        if self.lease >= MIN_LEASE {
            return Ok(());
        }
        Err(StoreError::InvalidArgument {
            key: "<config>".into(),
            detail: format!(
                "a read lease of {:?} is under the shortest taken ({MIN_LEASE:?}; the linker \
                 renews at most every 50 ms): set MooncakeConfig::lease to the master's \
                 --default_kv_lease_ttl",
                self.lease
            ),
        })
    }

    /// See [`read_streams`](Self::read_streams).
    pub fn read_streams_count(&self) -> usize {
        self.read_streams
    }

    /// See [`staged_merge`](Self::staged_merge): whether the protocol is `tcp` and the merge
    /// is not set off.
    pub fn staged_merge_enabled(&self) -> bool {
        self.any_memory_in_place() && self.staged_merge.unwrap_or(true)
    }

    /// Whether a multi-part object, gathered into a buffer of the store's own, is put
    /// zero-copy: over TCP only, whose sender needs no registration; over RDMA the wheel reads
    /// a zero-copy put's sources through their registration, so such objects go through the
    /// client's copying put.
    pub(crate) fn gathered_puts_zero_copy(&self) -> bool {
        self.any_memory_in_place()
    }

    /// True when the staged merge is set on for a protocol it is not used over (see
    /// [`staged_merge`](Self::staged_merge)).
    pub(super) fn staged_merge_refused(&self) -> bool {
        self.staged_merge == Some(true) && !self.staged_merge_enabled()
    }

    pub(super) fn setup_args(&self) -> mooncake_sys::SetupArgs {
        mooncake_sys::SetupArgs {
            local_hostname: self.local_hostname.clone(),
            metadata_server: self.metadata_server.clone(),
            global_segment_size: self.global_segment_size,
            local_buffer_size: self.local_buffer_size,
            protocol: self.protocol.clone(),
            device_name: self.device.clone(),
            master_server_addr: self.master.clone(),
            tenant_id: self.tenant.clone(),
        }
    }
}

fn size_var(var: &'static str, value: &str) -> Result<u64, MooncakeConfigError> {
    parse_size(value).ok_or_else(|| MooncakeConfigError::Invalid {
        var,
        value: value.to_owned(),
        reason: "expected bytes or a size like 4gb, 512MB, 1 GB".into(),
    })
}

/// Parses `"4294967296"`, `"4gb"`, `"4 GB"`, `"512mb"`, `"16MiB"`, `"64k"` (1024-based, like
/// SGLang's `"Ngb"` and Mooncake's `"1 GB"`).
pub fn parse_size(value: &str) -> Option<u64> {
    let v = value.trim();
    let split = v
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(v.len());
    let (number, unit) = v.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let shift = match unit.as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    if number.contains('.') {
        let x: f64 = number.parse().ok()?;
        let bytes = x * (1u64 << shift) as f64;
        (bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64).then_some(bytes as u64)
    } else {
        number.parse::<u64>().ok()?.checked_mul(1u64 << shift)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    /// `registered_only` applies RDMA's memory rules over TCP: nothing unregistered moves in
    /// place, gathered puts are copied, no staged merge.
    #[test]
    fn registered_only_applies_rdmas_memory_rules_over_tcp() {
        let tcp = MooncakeConfig::new("m:1");
        assert!(tcp.any_memory_in_place() && tcp.gathered_puts_zero_copy());
        let only = tcp.registered_only(true);
        assert!(!only.any_memory_in_place());
        assert!(!only.gathered_puts_zero_copy());
        assert!(!only.staged_merge_enabled());
        assert_eq!(only.protocol_name(), "tcp");
    }

    /// A lease under the shortest taken (100 ms) is refused at connect
    /// (it was taken: a zero one dropped every open session at each start).
    #[test]
    fn a_lease_under_the_shortest_is_refused() {
        let c = MooncakeConfig::new("m:1");
        assert!(c.check_lease().is_ok(), "the default");
        assert!(c.clone().lease(MIN_LEASE).check_lease().is_ok());
        let zero = c.lease(Duration::ZERO).check_lease();
        assert!(
            matches!(&zero, Err(StoreError::InvalidArgument { detail, .. }) if detail.contains("lease")),
            "{zero:?}"
        );
    }

    /// The tenant is the wheel's: `MOONCAKE_TENANT_ID`, else `default`, and goes to setup.
    /// Before, every kvlink client joined `default` whatever the deployment said.
    #[test]
    fn the_tenant_is_read_and_set_up() {
        let plain = MooncakeConfig::from_lookup(lookup(&[("MOONCAKE_MASTER", "h:1")])).unwrap();
        assert_eq!(plain.tenant_id(), DEFAULT_TENANT);
        let vars = [
            ("MOONCAKE_MASTER", "h:1"),
            ("MOONCAKE_TENANT_ID", " tenant-a "),
        ];
        let cfg = MooncakeConfig::from_lookup(lookup(&vars)).unwrap();
        assert_eq!(cfg.tenant_id(), "tenant-a");
        assert_eq!(cfg.setup_args().tenant_id, "tenant-a");
        assert_eq!(cfg.tenant("b").setup_args().tenant_id, "b");
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4gb"), Some(4 << 30));
        assert_eq!(parse_size("1 GB"), Some(1 << 30));
        assert_eq!(parse_size("512MB"), Some(512 << 20));
        assert_eq!(parse_size("16MiB"), Some(16 << 20));
        assert_eq!(parse_size("1234"), Some(1234));
        assert_eq!(parse_size("1.5g"), Some(3 << 29));
        assert_eq!(parse_size("lots"), None);
        assert_eq!(parse_size("4 parsecs"), None);
        assert_eq!(parse_size("99999999999999t"), None);
    }

    #[test]
    fn from_env_defaults_and_overrides() {
        assert_eq!(
            MooncakeConfig::from_lookup(lookup(&[])),
            Err(MooncakeConfigError::Missing {
                var: "MOONCAKE_MASTER"
            })
        );
        let cfg =
            MooncakeConfig::from_lookup(lookup(&[("MOONCAKE_MASTER", "10.0.0.1:50051")])).unwrap();
        assert_eq!(cfg, MooncakeConfig::new("10.0.0.1:50051"));
        assert_eq!(cfg.global_segment_bytes(), 4 << 30);
        assert_eq!(cfg.local_buffer_bytes(), 16 << 20);
        assert_eq!(cfg.metadata_server_addr(), "P2PHANDSHAKE");

        let cfg = MooncakeConfig::from_lookup(lookup(&[
            ("MOONCAKE_MASTER", "127.0.0.1:1"),
            ("MOONCAKE_PROTOCOL", "rdma"),
            ("MOONCAKE_DEVICE", "mlx5_0"),
            (
                "MOONCAKE_TE_META_DATA_SERVER",
                "http://127.0.0.1:8080/metadata",
            ),
            ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "2gb"),
            ("SGLANG_MOONCAKE_LOCAL_BUFFER_SIZE", "32mb"),
            ("LOCAL_HOSTNAME", "node7"),
            ("MOONCAKE_STORE_LIBRARY", "/opt/lib.so"),
            ("KVLINK_MOONCAKE_READ_STREAMS", "3"),
        ]))
        .unwrap();
        assert_eq!(cfg.read_streams_count(), 3);
        // rdma: gathered puts are copied by the client (a gathered buffer is not registered).
        assert!(!cfg.gathered_puts_zero_copy());
        assert!(MooncakeConfig::new("m:1").gathered_puts_zero_copy());
        // rdma: no staged merge, even when asked for (its scratch is not registered there).
        assert!(!cfg.staged_merge_enabled() && !cfg.staged_merge_refused());
        let asked = cfg.clone().staged_merge(true);
        assert!(!asked.staged_merge_enabled() && asked.staged_merge_refused());
        assert!(MooncakeConfig::new("m:1").staged_merge_enabled());
        assert!(!MooncakeConfig::new("m:1")
            .staged_merge(true)
            .staged_merge_refused());
        let off = MooncakeConfig::from_lookup(lookup(&[
            ("MOONCAKE_MASTER", "m:1"),
            ("KVLINK_MOONCAKE_STAGED_MERGE", "0"),
        ]))
        .unwrap();
        assert!(!off.staged_merge_enabled());
        assert_eq!(cfg.protocol_name(), "rdma");
        assert_eq!(cfg.device_name(), "mlx5_0");
        assert_eq!(cfg.metadata_server_addr(), "http://127.0.0.1:8080/metadata");
        assert_eq!(cfg.global_segment_bytes(), 2 << 30);
        assert_eq!(cfg.local_buffer_bytes(), 32 << 20);
        assert_eq!(cfg.hostname(), "node7");
        assert_eq!(
            cfg.library_path(),
            Some(std::path::Path::new("/opt/lib.so"))
        );

        let err = MooncakeConfig::from_lookup(lookup(&[
            ("MOONCAKE_MASTER", "m:1"),
            ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "huge"),
        ]))
        .unwrap_err();
        assert!(matches!(
            err,
            MooncakeConfigError::Invalid {
                var: "MOONCAKE_GLOBAL_SEGMENT_SIZE",
                ..
            }
        ));
        for bad in ["0", "17", "many"] {
            let err = MooncakeConfig::from_lookup(lookup(&[
                ("MOONCAKE_MASTER", "m:1"),
                ("KVLINK_MOONCAKE_READ_STREAMS", bad),
            ]))
            .unwrap_err();
            assert!(matches!(
                err,
                MooncakeConfigError::Invalid {
                    var: "KVLINK_MOONCAKE_READ_STREAMS",
                    ..
                }
            ));
        }
        assert_eq!(
            MooncakeConfig::new("m:1")
                .read_streams(0)
                .read_streams_count(),
            1
        );
        assert_eq!(
            MooncakeConfig::new("m:1")
                .read_streams(99)
                .read_streams_count(),
            MAX_READ_STREAMS
        );
        let err = MooncakeConfig::from_lookup(lookup(&[
            ("MOONCAKE_MASTER", "m:1"),
            ("MOONCAKE_DEVICE", "{\"0\": \"mlx5_0\"}"),
        ]))
        .unwrap_err();
        assert!(matches!(
            err,
            MooncakeConfigError::Invalid {
                var: "MOONCAKE_DEVICE",
                ..
            }
        ));
    }
}
