//! Loading the Mooncake store library at run time.
//!
//! # Trust
//! Loading a shared library runs its code (its initialisers) and then calls its functions
//! through the types of csrc/kvlink_mooncake.h: no check can make that sound for an arbitrary
//! file. The library a path, a name or the environment ([`ENV_LIBRARY`], [`ENV_DIR`]) names is
//! therefore trusted to be the kvlink shim that scripts/mooncake-build-shim.sh builds, as the
//! dynamic loader's own search path is trusted to name the C library: the deployment chooses
//! it. What can be checked is: the shim's ABI report (version and struct layouts) and every
//! symbol are checked before a call, so a stale shim or another library exporting none of them
//! is refused. The report describes the shim as it was built, not the wheel's `store.so` it
//! resolves at run time (through its `RPATH`): a wheel changed in place under a built shim is
//! not detected (its structs may differ from the shim's); keep the shim and the wheel it was
//! built against together. [`Library::open`] and [`Library::load_default`] stay safe functions on that
//! assumption, as CUDA bindings load libcuda by name; point them only at a shim you built or
//! trust the same way.

use std::ffi::{c_char, CStr, OsStr};
use std::mem::ManuallyDrop;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error::{MooncakeError, Result};
use crate::sys::{self, symbols};

/// File name of the kvlink shim built by `scripts/mooncake-build-shim.sh`.
pub const SHIM_FILE_NAME: &str = "libkvlink_mooncake.so";
/// File name of upstream's C-API library (`cmake -DWITH_STORE_C_SHARED=ON`). Not loaded:
/// without kvlink's ABI report its struct layouts (which differ between upstream revisions)
/// cannot be checked, so [`Library::open`] refuses it.
pub const UPSTREAM_FILE_NAME: &str = "libmooncake_store.so";
/// Environment variable naming the library to load (a path, or a name for the system's search).
pub const ENV_LIBRARY: &str = "MOONCAKE_STORE_LIBRARY";
/// Environment variable naming the directory the build script fills (`<repo>/.mooncake`).
pub const ENV_DIR: &str = "KVLINK_MOONCAKE_DIR";

/// The `store_c.h` functions (present in every candidate library).
#[derive(Clone, Copy)]
pub(crate) struct Core {
    pub create: sys::FnCreate,
    pub destroy: sys::FnDestroy,
    pub health_check: sys::FnHealthCheck,
    pub put: sys::FnPut,
    pub put_from: sys::FnPutFrom,
    pub batch_put_from: sys::FnBatchPutFrom,
    pub get_into: sys::FnGetInto,
    pub batch_get_into: sys::FnBatchGetInto,
    pub is_exist: sys::FnIsExist,
    pub batch_is_exist: sys::FnBatchIsExist,
    pub get_size: sys::FnGetSize,
    pub get_hostname: sys::FnGetHostname,
    pub remove: sys::FnRemove,
    pub remove_by_regex: sys::FnRemoveByRegex,
    pub remove_all: sys::FnRemoveAll,
    pub register_buffer: sys::FnRegisterBuffer,
    pub unregister_buffer: sys::FnUnregisterBuffer,
}

/// The kvlink extensions (`kvlink_mc_*`), present in the kvlink shim only.
#[derive(Clone, Copy)]
pub(crate) struct Extensions {
    pub error_name: sys::FnErrorName,
    pub last_error: sys::FnLastError,
    pub batch_get_ranges: sys::FnBatchGetRanges,
    pub batch_get_session_start: sys::FnBatchGetSessionStart,
    pub batch_get_session_end: sys::FnBatchGetSessionEnd,
    pub batch_upsert_from: sys::FnBatchUpsertFrom,
    pub setup: sys::FnMcSetup,
}

/// What the shim reports about the ABI it was compiled against (`kvlink_mc_abi_info`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbiInfo {
    /// `KVLINK_MC_ABI_VERSION` of the shim.
    pub abi_version: u32,
    /// The wheel version the shim was built for.
    pub wheel_version: String,
    /// `sizeof(mooncake::ReplicateConfig)` in the shim.
    pub replicate_config_size: u64,
    /// Offsets of soft_pin_action, soft_pin_ttl_ms, with_hard_pin, preferred_segments,
    /// preferred_segment, host_id, group_ids in the shim's `ReplicateConfig`.
    pub replicate_config_offsets: [u64; 7],
}

/// A loaded Mooncake store library: the kvlink shim (a library without its ABI report, such
/// as upstream's `libmooncake_store.so`, is refused).
///
/// The library is never unloaded: Mooncake's client starts background threads and registers
/// `atexit` handlers inside it, so `dlclose` while the process runs would be unsound. Dropping a
/// `Library` therefore leaves the code mapped.
pub struct Library {
    path: PathBuf,
    pub(crate) core: Core,
    pub(crate) ext: Option<Extensions>,
    abi: Option<AbiInfo>,
    // Keeps the handle for the life of the process (never dlclose'd; see above).
    _handle: ManuallyDrop<libloading::Library>,
}

impl std::fmt::Debug for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Library")
            .field("path", &self.path)
            .field("extensions", &self.ext.is_some())
            .field("abi", &self.abi)
            .finish()
    }
}

impl Library {
    /// Loads the library at `path` (a path, or a bare file name looked up by the system's
    /// dynamic loader), resolves its symbols, and checks the shim's ABI report. `path` must
    /// name the kvlink shim (see the module's [trust](self#trust) note: loading runs the
    /// library's code).
    pub fn open(path: impl AsRef<Path>) -> Result<Arc<Self>> {
        let path = path.as_ref().to_path_buf();
        let handle = load(&path).map_err(|reason| MooncakeError::LibraryNotFound {
            attempts: vec![(path.clone(), reason)],
        })?;
        Self::from_handle(path, handle).map(Arc::new)
    }

    /// Loads the library from `MOONCAKE_STORE_LIBRARY` when it is set (and only from there), or
    /// else from the first of [`Library::candidates`] that loads. Successful loads are cached
    /// for the process.
    ///
    /// A candidate that loads but is refused (a stale shim of another ABI, a missing symbol)
    /// ends the search, since what it loaded stays loaded: its refusal, or, when candidates
    /// before it did not load, [`MooncakeError::LibraryNotFound`] naming every attempt with why.
    pub fn load_default() -> Result<Arc<Self>> {
        static DEFAULT: Mutex<Option<Arc<Library>>> = Mutex::new(None);
        let mut cached = DEFAULT
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(lib) = cached.as_ref() {
            return Ok(Arc::clone(lib));
        }
        let lib = Arc::new(Self::load_first(Self::candidates())?);
        *cached = Some(Arc::clone(&lib));
        Ok(lib)
    }

    /// The first of `candidates` that loads, if it is accepted. A candidate that loads but is
    /// refused ends the search: its initialisers have run and its dependencies (the wheel's
    /// `store.so`, which has no SONAME) stay loaded, so a later candidate's `store.so` would
    /// bind to that stale copy. The refusal itself when it is the first attempt; otherwise every
    /// attempt with why it failed.
    fn load_first(candidates: impl IntoIterator<Item = PathBuf>) -> Result<Self> {
        let mut attempts = Vec::new();
        for candidate in candidates {
            match load(&candidate) {
                Ok(handle) => {
                    return match Self::from_handle(candidate.clone(), handle) {
                        Ok(lib) => Ok(lib),
                        Err(refusal) if attempts.is_empty() => Err(refusal),
                        Err(refusal) => {
                            // The path is in the refusal's own words.
                            attempts.push((candidate, refusal.to_string()));
                            Err(MooncakeError::LibraryNotFound { attempts })
                        }
                    };
                }
                Err(reason) => attempts.push((candidate, reason)),
            }
        }
        Err(MooncakeError::LibraryNotFound { attempts })
    }

    /// Where [`Library::load_default`] looks, in order:
    /// 1. `$MOONCAKE_STORE_LIBRARY` — when set, the only candidate;
    /// 2. `$KVLINK_MOONCAKE_DIR/lib/libkvlink_mooncake.so`;
    /// 3. `.mooncake/lib/libkvlink_mooncake.so` in the directories above the running executable
    ///    (a `target/` inside the repository finds the repository's `.mooncake/`);
    /// 4. `<workspace>/.mooncake/lib/libkvlink_mooncake.so` of the source tree this crate was
    ///    compiled from;
    ///
    ///    (3 and 4 are found, not chosen: each is taken only when the file, its `lib/` and its
    ///    `.mooncake/` are owned by this process's user or root and not writable by all users
    ///    (group-writable is allowed: private user groups), so that no other user can plant a
    ///    library there, e.g. a `/tmp/.mooncake` above an executable under `/tmp`; one that is
    ///    not taken is left out of the list, and of the error when nothing loads;)
    /// 5. `libkvlink_mooncake.so` through the system's search path.
    ///
    /// ```
    /// use mooncake_sys::library::{Library, UPSTREAM_FILE_NAME};
    /// // Upstream's library is never tried: its layouts cannot be checked.
    /// assert!(!Library::candidates().iter().any(|p| p.ends_with(UPSTREAM_FILE_NAME)));
    /// ```
    pub fn candidates() -> Vec<PathBuf> {
        if let Some(explicit) = std::env::var_os(ENV_LIBRARY).filter(|v| !v.is_empty()) {
            return vec![PathBuf::from(explicit)];
        }
        let in_dir = |dir: &Path| dir.join("lib").join(SHIM_FILE_NAME);
        let mut out = Vec::new();
        if let Some(dir) = std::env::var_os(ENV_DIR).filter(|v| !v.is_empty()) {
            out.push(in_dir(Path::new(&dir)));
        }
        if let Ok(exe) = std::env::current_exe() {
            for dir in exe.ancestors().skip(1) {
                let candidate = in_dir(&dir.join(".mooncake"));
                if candidate.is_file() && not_plantable(&candidate) {
                    out.push(candidate);
                    break;
                }
            }
        }
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let built = in_dir(&workspace.join(".mooncake"));
        if !built.exists() || not_plantable(&built) {
            out.push(built);
        }
        out.push(PathBuf::from(SHIM_FILE_NAME));
        let mut seen = std::collections::HashSet::new();
        out.retain(|p| seen.insert(p.clone()));
        out
    }

    fn from_handle(path: PathBuf, handle: libloading::Library) -> Result<Self> {
        // Never dlclose'd, refused or not: the library's initialisers have run by now (they
        // may have started threads or registered handlers inside it).
        let handle = ManuallyDrop::new(handle);
        let core = Core {
            create: symbol(&handle, &path, symbols::CREATE)?,
            destroy: symbol(&handle, &path, symbols::DESTROY)?,
            health_check: symbol(&handle, &path, symbols::HEALTH_CHECK)?,
            put: symbol(&handle, &path, symbols::PUT)?,
            put_from: symbol(&handle, &path, symbols::PUT_FROM)?,
            batch_put_from: symbol(&handle, &path, symbols::BATCH_PUT_FROM)?,
            get_into: symbol(&handle, &path, symbols::GET_INTO)?,
            batch_get_into: symbol(&handle, &path, symbols::BATCH_GET_INTO)?,
            is_exist: symbol(&handle, &path, symbols::IS_EXIST)?,
            batch_is_exist: symbol(&handle, &path, symbols::BATCH_IS_EXIST)?,
            get_size: symbol(&handle, &path, symbols::GET_SIZE)?,
            get_hostname: symbol(&handle, &path, symbols::GET_HOSTNAME)?,
            remove: symbol(&handle, &path, symbols::REMOVE)?,
            remove_by_regex: symbol(&handle, &path, symbols::REMOVE_BY_REGEX)?,
            remove_all: symbol(&handle, &path, symbols::REMOVE_ALL)?,
            register_buffer: symbol(&handle, &path, symbols::REGISTER_BUFFER)?,
            unregister_buffer: symbol(&handle, &path, symbols::UNREGISTER_BUFFER)?,
        };
        // The extensions are all-or-nothing: a library exporting `kvlink_mc_abi_info` must be a
        // complete kvlink shim. One without it (upstream's store_c.h library) is refused: the
        // layouts this crate passes (`ReplicateConfig`) differ between upstream revisions, and
        // only the shim's ABI report lets them be checked.
        let abi_info = match symbol::<sys::FnAbiInfo>(&handle, &path, symbols::ABI_INFO) {
            Err(_) => {
                return Err(MooncakeError::AbiMismatch {
                    path,
                    detail: "no kvlink_mc_abi_info (not the kvlink shim): its struct layouts cannot be checked; build the shim with scripts/mooncake-build-shim.sh".into(),
                })
            }
            Ok(abi_info) => abi_info,
        };
        // The report first: a shim of another ABI lacks symbols of this one (ABI 1 had no
        // `kvlink_mc_setup`), and must be refused as such (rebuild it), not as a missing symbol.
        let abi = Some(check_abi(&path, abi_info)?);
        let ext = Some(Extensions {
            error_name: symbol(&handle, &path, symbols::ERROR_NAME)?,
            last_error: symbol(&handle, &path, symbols::LAST_ERROR)?,
            batch_get_ranges: symbol(&handle, &path, symbols::BATCH_GET_RANGES)?,
            batch_get_session_start: symbol(&handle, &path, symbols::BATCH_GET_SESSION_START)?,
            batch_get_session_end: symbol(&handle, &path, symbols::BATCH_GET_SESSION_END)?,
            batch_upsert_from: symbol(&handle, &path, symbols::BATCH_UPSERT_FROM)?,
            setup: symbol(&handle, &path, symbols::MC_SETUP)?,
        });
        Ok(Self {
            path,
            core,
            ext,
            abi,
            _handle: handle,
        })
    }

    /// The path (or name) the library was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the kvlink extensions (ranged reads, read sessions, upsert) are available:
    /// always, since a library without them is refused when opened.
    pub fn has_extensions(&self) -> bool {
        self.ext.is_some()
    }

    /// The shim's ABI report, checked against this crate's expectations when the library was
    /// opened (always `Some`: a library without one is refused).
    pub fn abi_info(&self) -> Option<&AbiInfo> {
        self.abi.as_ref()
    }

    /// The name the *loaded wheel* gives to an error code (its own `mooncake::toString`), for
    /// checking [`crate::sys::codes`] against a new wheel. `None` without the extensions.
    pub fn wheel_error_name(&self, code: i32) -> Option<String> {
        let ext = self.ext.as_ref()?;
        // SAFETY: `kvlink_mc_error_name` takes any i32 and returns a non-null pointer to a
        // NUL-terminated string with static storage (the header's contract); it is copied
        // before returning.
        let name = unsafe { CStr::from_ptr((ext.error_name)(code)) };
        Some(name.to_string_lossy().into_owned())
    }

    /// The message of the last C++ exception the shim caught on this thread, if any.
    pub(crate) fn last_error(&self) -> Option<String> {
        let ext = self.ext.as_ref()?;
        let mut buf = vec![0 as c_char; 512];
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes; the shim writes at most that
        // many, NUL-terminated.
        let n = unsafe { (ext.last_error)(buf.as_mut_ptr(), buf.len()) };
        if n == 0 {
            return None;
        }
        if n >= buf.len() {
            // Longer than the buffer (the return is its full length): ask again with room for
            // all of it, up to 64 KiB (the message stays until this thread's next error; a
            // longer one is cut).
            buf = vec![0 as c_char; n.saturating_add(1).min(LAST_ERROR_MAX)];
            // SAFETY: as above, for the larger buffer.
            unsafe { (ext.last_error)(buf.as_mut_ptr(), buf.len()) };
        }
        // Read within `buf` whatever the shim wrote: up to its first NUL, or all of it.
        let bytes: Vec<u8> = buf.iter().map(|&c| c as u8).collect();
        let msg = CStr::from_bytes_until_nul(&bytes)
            .map(|m| m.to_string_lossy().into_owned())
            .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
        Some(msg)
    }

    pub(crate) fn extensions(&self, operation: &'static str) -> Result<&Extensions> {
        self.ext.as_ref().ok_or_else(|| MooncakeError::Unsupported {
            path: self.path.clone(),
            operation,
        })
    }
}

fn check_abi(path: &Path, abi_info: sys::FnAbiInfo) -> Result<AbiInfo> {
    let mismatch = |detail: String| MooncakeError::AbiMismatch {
        path: path.to_path_buf(),
        detail,
    };
    // A shim of another ABI version may write a larger report than this crate's struct: the
    // call gets a zeroed area far larger than any report, and the struct is read out of it
    // only once its size checked.
    const ROOM: usize = 4096;
    #[repr(C, align(8))]
    struct Room([u8; ROOM]);
    let mut room = Room([0; ROOM]);
    // SAFETY: `room` is valid for writes of ROOM bytes, 8-aligned (as the report's u64
    // fields need), and far larger than any version's report (the shim writes its own
    // `sizeof(kvlink_mc_abi_info_t)`, which it reports in `info_size`).
    let rc = unsafe { abi_info(room.0.as_mut_ptr().cast::<sys::KvlinkMcAbiInfo>()) };
    if rc != 0 {
        return Err(mismatch(format!("kvlink_mc_abi_info returned {rc}")));
    }
    const _: () = assert!(std::mem::size_of::<sys::KvlinkMcAbiInfo>() <= ROOM);
    // SAFETY: `room` holds at least one `KvlinkMcAbiInfo` (asserted above), 8-aligned, zeroed
    // and then filled by the shim; all bit patterns are valid for this plain-old-data struct.
    let raw = unsafe { std::ptr::read(room.0.as_ptr().cast::<sys::KvlinkMcAbiInfo>()) };
    if raw.abi_version != sys::KVLINK_MC_ABI_VERSION
        || raw.info_size as usize != std::mem::size_of::<sys::KvlinkMcAbiInfo>()
    {
        return Err(mismatch(format!(
            "shim ABI version {} (info size {}), this crate speaks version {} (info size {})",
            raw.abi_version,
            raw.info_size,
            sys::KVLINK_MC_ABI_VERSION,
            std::mem::size_of::<sys::KvlinkMcAbiInfo>()
        )));
    }
    let version_bytes: Vec<u8> = raw
        .wheel_version
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    let info = AbiInfo {
        abi_version: raw.abi_version,
        wheel_version: String::from_utf8_lossy(&version_bytes).into_owned(),
        replicate_config_size: raw.replicate_config_size,
        replicate_config_offsets: [
            raw.off_soft_pin_action,
            raw.off_soft_pin_ttl_ms,
            raw.off_with_hard_pin,
            raw.off_preferred_segments,
            raw.off_preferred_segment,
            raw.off_host_id,
            raw.off_group_ids,
        ],
    };
    if info.wheel_version != sys::EXPECTED_WHEEL_VERSION {
        return Err(mismatch(format!(
            "shim built for wheel {}, this crate expects {}",
            info.wheel_version,
            sys::EXPECTED_WHEEL_VERSION
        )));
    }
    if info.replicate_config_size != sys::EXPECTED_REPLICATE_CONFIG_SIZE
        || info.replicate_config_offsets != sys::EXPECTED_REPLICATE_CONFIG_OFFSETS
    {
        return Err(mismatch(format!(
            "ReplicateConfig compiled as size {} offsets {:?}, expected size {} offsets {:?}",
            info.replicate_config_size,
            info.replicate_config_offsets,
            sys::EXPECTED_REPLICATE_CONFIG_SIZE,
            sys::EXPECTED_REPLICATE_CONFIG_OFFSETS
        )));
    }
    Ok(info)
}

fn load(path: &Path) -> std::result::Result<libloading::Library, String> {
    #[cfg(unix)]
    {
        use libloading::os::unix::{Library as UnixLibrary, RTLD_LOCAL, RTLD_NOW};
        // A bare name goes to the dynamic loader's search; anything with a '/' is a path.
        let name: &OsStr = path.as_os_str();
        // SAFETY: loading runs the library's initialisers; the library named is trusted to be
        // the kvlink shim (the module's trust note: the deployment names it). For the shim these
        // are store.so's C++ static constructors and the shim's own (which only promotes the
        // already loaded libpython to global scope); they are what every Mooncake user runs on
        // import.
        // RTLD_NOW reports unresolved symbols (e.g. a missing libibverbs) here as an error
        // instead of at a later call.
        unsafe { UnixLibrary::open(Some(name), RTLD_NOW | RTLD_LOCAL) }
            .map(libloading::Library::from)
            .map_err(|e| e.to_string())
    }
    #[cfg(not(unix))]
    {
        // SAFETY: as above; the library's initialisers are Mooncake's own.
        unsafe { libloading::Library::new(path.as_os_str()) }.map_err(|e| e.to_string())
    }
}

fn symbol<T: Copy>(handle: &libloading::Library, path: &Path, name: &[u8]) -> Result<T> {
    // SAFETY: every `T` used with this function is the `sys::Fn*` type that mirrors the C
    // declaration of `name` in csrc/kvlink_mooncake.h (one to one, checked by review; the shim
    // and this crate share the ABI version checked in `check_abi`), in a library trusted to be
    // the kvlink shim (the module's trust note). The pointer stays valid for
    // the life of the process because the library is never unloaded (`ManuallyDrop`).
    unsafe { handle.get::<T>(name) }
        .map(|s| *s)
        .map_err(|e| MooncakeError::MissingSymbol {
            path: path.to_path_buf(),
            symbol: String::from_utf8_lossy(name.strip_suffix(b"\0").unwrap_or(name)).into_owned(),
            reason: e.to_string(),
        })
}

/// The longest last-error message read from the shim (bytes, with its NUL).
const LAST_ERROR_MAX: usize = 64 * 1024;

/// Whether no user but this process's and root (and its group's, where the group may write)
/// could have put `library` where it is: it, its directory and that directory's parent are
/// each owned by the effective user or root and not writable by all users (a directory every
/// user can write, like `/tmp`, may hold only what another user made there, which the owner
/// check refuses).
fn not_plantable(library: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let lib_dir = library.parent();
    let top = lib_dir.and_then(Path::parent);
    [Some(library), lib_dir, top].into_iter().all(|p| {
        p.and_then(|p| std::fs::metadata(p).ok())
            .is_some_and(|m| (m.uid() == me || m.uid() == 0) && m.mode() & 0o002 == 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shim of a later ABI version whose report is 200 bytes.
    unsafe extern "C" fn report_v2(out: *mut sys::KvlinkMcAbiInfo) -> std::ffi::c_int {
        let mut v2 = [0u8; 200];
        v2[..4].copy_from_slice(&2u32.to_le_bytes());
        v2[4..8].copy_from_slice(&200u32.to_le_bytes());
        // SAFETY: the caller's contract (kvlink_mc_abi_info) is room for the shim's own report.
        unsafe { std::ptr::copy_nonoverlapping(v2.as_ptr(), out.cast::<u8>(), v2.len()) };
        0
    }

    /// A library that loads but is not the shim: the C library every process already has.
    const NOT_THE_SHIM: &str = "libc.so.6";

    /// A library someone else could have put in place (its file or a directory above it
    /// writable by others) is not taken from a `.mooncake/` found above the executable.
    /// Before, any `.mooncake/lib/libkvlink_mooncake.so` there was loaded, e.g. one planted in
    /// `/tmp/.mooncake` above an executable under `/tmp`.
    #[test]
    fn a_library_others_could_have_planted_is_not_found() {
        use std::os::unix::fs::PermissionsExt;
        let top = std::env::temp_dir().join(format!("kvlink-plant-{}", std::process::id()));
        let lib = top.join(".mooncake").join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        let file = lib.join(SHIM_FILE_NAME);
        std::fs::write(&file, b"not a library").unwrap();
        let mode = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        for p in [&top.join(".mooncake"), &lib] {
            mode(p, 0o755);
        }
        mode(&file, 0o644);
        assert!(not_plantable(&file));
        mode(&file, 0o666);
        assert!(!not_plantable(&file), "a file others can write");
        mode(&file, 0o644);
        mode(&top.join(".mooncake"), 0o777);
        assert!(!not_plantable(&file), "a directory others can write");
        mode(&top.join(".mooncake"), 0o755);
        assert!(!not_plantable(&top.join("missing.so")), "nothing there");
        std::fs::remove_dir_all(&top).unwrap();
    }

    #[test]
    fn every_failed_candidate_is_named_with_its_reason() {
        let missing = PathBuf::from("/nonexistent/libkvlink_mooncake.so");
        let refused = PathBuf::from(NOT_THE_SHIM);
        let err = Library::load_first([missing.clone(), refused.clone()]).unwrap_err();
        let MooncakeError::LibraryNotFound { attempts } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(attempts.len(), 2, "{err}");
        assert_eq!(attempts[0].0, missing);
        assert_eq!(attempts[1].0, refused);
        // The refused library names what it lacks, not a loader error.
        assert!(
            attempts[1].1.contains("missing symbol"),
            "{}",
            attempts[1].1
        );
        let words = err.to_string();
        assert!(
            words.contains("/nonexistent/") && words.contains(NOT_THE_SHIM),
            "{words}"
        );
        // A refusal as the first attempt is that refusal, typed.
        let err = Library::load_first([refused.clone()]).unwrap_err();
        assert!(
            matches!(err, MooncakeError::MissingSymbol { .. }),
            "{err:?}"
        );
    }

    /// What a refused library loaded stays loaded (a stale shim's `store.so` would serve the
    /// next shim): the search ends there, even with a good shim after it.
    #[test]
    #[allow(clippy::print_stderr)] // the skip message is the point
    fn a_refused_candidate_ends_the_search() {
        // The shim, where this machine has one built (CI installs it); else nothing to find.
        let Some(shim) = Library::candidates()
            .into_iter()
            .find(|p| p.is_file() && load(p).is_ok())
        else {
            let required = std::env::var_os("KVLINK_REQUIRE_MOONCAKE").is_some_and(|v| v == "1");
            assert!(
                !required,
                "KVLINK_REQUIRE_MOONCAKE=1 but no kvlink shim loads here"
            );
            eprintln!("SKIP: no kvlink shim built here");
            return;
        };
        let err = Library::load_first([PathBuf::from(NOT_THE_SHIM), shim]).unwrap_err();
        assert!(
            matches!(err, MooncakeError::MissingSymbol { .. }),
            "{err:?}"
        );
    }

    #[test]
    fn a_larger_report_of_another_abi_version_is_refused_not_overrun() {
        let got = check_abi(Path::new("fake"), report_v2);
        match got {
            Err(MooncakeError::AbiMismatch { detail, .. }) => {
                assert!(detail.contains("version 2 (info size 200)"), "{detail}")
            }
            other => panic!("{other:?}"),
        }
    }
}
