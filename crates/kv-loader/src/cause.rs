//! A failure's words with the typed error behind it, cheap to clone (a `KvLoadError` is
//! copied to every rank and waiter of a failed batch).

use std::error::Error;
use std::fmt;
use std::sync::Arc;

/// A failure's words and, where one exists, the typed error they came from, kept as the
/// [`source`](Error::source) so an engine can walk the chain or downcast it.
///
/// The words are complete: they include the typed error's own words, so an error holding a
/// `Cause` reads whole in one line (`{}`). The source is for typed access; a reporter that
/// prints every error of the chain (`anyhow`'s `{:#}`) repeats those words.
///
/// ```
/// use kv_loader::Cause;
/// #[derive(Debug, thiserror::Error)]
/// #[error("pool full")]
/// struct PoolFull;
/// let c = Cause::with_source("batch 3: landing: pool full", PoolFull);
/// assert_eq!(c.to_string(), "batch 3: landing: pool full");
/// assert!(c.downcast_ref::<PoolFull>().is_some());
/// assert!(std::error::Error::source(&c).is_some());
/// let words = Cause::from("no typed error behind these words");
/// assert!(std::error::Error::source(&words).is_none());
/// ```
#[derive(Clone)]
pub struct Cause {
    detail: String,
    source: Option<Arc<dyn Error + Send + Sync + 'static>>,
}

impl Cause {
    /// Words with no typed error behind them.
    pub fn new(detail: impl Into<String>) -> Self {
        Cause {
            detail: detail.into(),
            source: None,
        }
    }

    /// `detail` (which says what failed, including `source`'s words) and the typed error.
    pub fn with_source(
        detail: impl Into<String>,
        source: impl Error + Send + Sync + 'static,
    ) -> Self {
        Cause {
            detail: detail.into(),
            source: Some(Arc::new(source)),
        }
    }

    /// The typed error, its words as the detail.
    pub fn from_error(source: impl Error + Send + Sync + 'static) -> Self {
        Cause::with_source(source.to_string(), source)
    }

    /// The words of a panic's payload (the `&str` or `String` a `panic!` carries; "a panic
    /// with no message" for any other payload), for a caught panic that becomes an error.
    ///
    /// ```
    /// use kv_loader::Cause;
    /// let caught = std::panic::catch_unwind(|| panic!("slot {} out of range", 9)).unwrap_err();
    /// assert_eq!(Cause::from_panic(caught.as_ref()).detail(), "slot 9 out of range");
    /// ```
    pub fn from_panic(payload: &(dyn std::any::Any + Send)) -> Self {
        let words = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic with no message".into());
        Cause::new(words)
    }

    /// The same cause, its words prefixed with `context` ("context: words"); the typed error
    /// is kept.
    pub fn context(self, context: impl std::fmt::Display) -> Self {
        Cause {
            detail: format!("{context}: {}", self.detail),
            source: self.source,
        }
    }

    /// The words.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The typed error behind the words, if it is a `T`.
    pub fn downcast_ref<T: Error + 'static>(&self) -> Option<&T> {
        self.source.as_deref()?.downcast_ref::<T>()
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)
    }
}

impl fmt::Debug for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            None => fmt::Debug::fmt(&self.detail, f),
            Some(s) => f
                .debug_struct("Cause")
                .field("detail", &self.detail)
                .field("source", s)
                .finish(),
        }
    }
}

/// Two causes are equal when their words are (whatever typed errors stand behind them):
/// what an error's equality in a test or a retry decision can compare.
impl PartialEq for Cause {
    fn eq(&self, other: &Self) -> bool {
        self.detail == other.detail
    }
}

impl Eq for Cause {}

impl Error for Cause {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn Error + 'static))
    }
}

impl From<String> for Cause {
    fn from(detail: String) -> Self {
        Cause::new(detail)
    }
}

impl From<&str> for Cause {
    fn from(detail: &str) -> Self {
        Cause::new(detail)
    }
}

impl std::ops::Deref for Cause {
    type Target = str;

    /// The words, so that a `Cause` reads like the string it replaces.
    fn deref(&self) -> &str {
        &self.detail
    }
}
