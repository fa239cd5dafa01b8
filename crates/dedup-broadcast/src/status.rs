//! The per-layer status exchange: after each layer, every rank all-gathers one status word
//! (ok, or failed with a small code), and folds the gathered words into a [`GroupStatus`].
//! Every rank folds the same words in the same order, so every rank reaches the same verdict:
//! the batch failed at the first failing (layer, rank), or it loaded.
//!
//! A word is `magic (8 bits) | tag (8 bits) | code (16 bits) | layer (32 bits)` (high to low;
//! code 0 = ok). The tag names the batch the word belongs to (the linker uses the low bits of
//! its gate count, so two consecutive batches never share a tag); untagged words carry 0.
//! A word that does not decode, names another layer or carries another batch's tag counts as
//! a failure ([`CODE_MALFORMED`], [`CODE_LAYER_MISMATCH`], [`CODE_OUT_OF_STEP`]), so a garbled
//! or shifted exchange never passes as ok, and [`GroupStatus::out_of_step`] tells the caller
//! that the ranks' collectives no longer line up (the group must be re-formed).

use std::time::Instant;

use kv_loader::{BatchId, KvLoadError};

use crate::{Collective, CollectiveError};

pub(crate) const MAGIC: u64 = 0x5a;

/// Codes 1..=25 are the kinds of [`KvLoadError`], in this order (`KvLoadError::kind_name`);
/// new kinds are appended, so a code never changes meaning.
pub(crate) const KIND_NAMES: [&str; 25] = [
    "invalid_plan",
    "store_not_found",
    "store_no_space",
    "store_transfer",
    "store_lease",
    "store_rpc_timeout",
    "store_invalid_argument",
    "store_unavailable",
    "store_short_read",
    "store_other",
    "timeout",
    "cancelled",
    "peer_failed",
    "collective",
    "device",
    "stale_ticket",
    "busy",
    "closed",
    "geometry",
    "config",
    "duplicate_batch",
    "bad_object",
    "slots_held",
    "internal",
    "group_down",
];

/// A failure with no more specific code.
pub const CODE_OTHER: u16 = 0x100;
/// A gathered word that does not decode.
pub const CODE_MALFORMED: u16 = 0x101;
/// A gathered word that names a different layer than the one exchanged.
pub const CODE_LAYER_MISMATCH: u16 = 0x102;
/// A gathered word that carries another batch's tag (the ranks are out of step).
pub const CODE_OUT_OF_STEP: u16 = 0x103;

/// True for the codes that mean the ranks' exchanges no longer line up (not a failure of a
/// rank, but of the group's order): malformed words, another layer, another batch.
pub fn is_out_of_step(code: u16) -> bool {
    matches!(
        code,
        CODE_MALFORMED | CODE_LAYER_MISMATCH | CODE_OUT_OF_STEP
    )
}

/// The code of a [`KvLoadError`]: its kind (never 0).
pub fn fail_code(err: &KvLoadError) -> u16 {
    let kind = err.kind_name();
    KIND_NAMES
        .iter()
        .position(|k| *k == kind)
        .map_or(CODE_OTHER, |i| i as u16 + 1)
}

/// A short name for a code (the [`KvLoadError`] kind name where it is one).
///
/// ```
/// use dedup_broadcast::{code_name, fail_code};
/// use kv_loader::KvLoadError;
/// assert_eq!(code_name(fail_code(&KvLoadError::Closed)), "closed");
/// assert_eq!(code_name(0), "ok");
/// ```
pub fn code_name(code: u16) -> &'static str {
    match code {
        0 => "ok",
        CODE_OTHER => "other",
        CODE_MALFORMED => "malformed_status",
        CODE_LAYER_MISMATCH => "layer_mismatch",
        CODE_OUT_OF_STEP => "out_of_step",
        c => KIND_NAMES
            .get(usize::from(c) - 1)
            .copied()
            .unwrap_or("unknown"),
    }
}

/// One rank's status for one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerStatus {
    /// The layer is in this rank's pool (or this rank's part of it went out).
    Ok,
    /// It failed; `code` (never 0) says how ([`fail_code`]).
    Failed {
        /// What kind of failure.
        code: u16,
    },
}

impl LayerStatus {
    /// A failure with `code` (a code of 0 becomes [`CODE_OTHER`]).
    pub fn failed(code: u16) -> Self {
        LayerStatus::Failed {
            code: if code == 0 { CODE_OTHER } else { code },
        }
    }

    /// The failure of `err`.
    pub fn from_error(err: &KvLoadError) -> Self {
        LayerStatus::failed(fail_code(err))
    }

    /// True for [`LayerStatus::Ok`].
    pub fn is_ok(self) -> bool {
        matches!(self, LayerStatus::Ok)
    }

    /// The code: 0 for ok; a failure built with code 0 (the field is public) reads as
    /// [`CODE_OTHER`], so that it is never sent, nor taken, as ok.
    pub fn code(self) -> u16 {
        match self {
            LayerStatus::Ok => 0,
            LayerStatus::Failed { code: 0 } => CODE_OTHER,
            LayerStatus::Failed { code } => code,
        }
    }

    /// The status word for layer `layer`.
    ///
    /// ```
    /// use dedup_broadcast::LayerStatus;
    /// let w = LayerStatus::failed(7).encode(12);
    /// assert_eq!(LayerStatus::decode(w), Some((12, LayerStatus::Failed { code: 7 })));
    /// assert_eq!(LayerStatus::decode(0), None);
    /// ```
    pub fn encode(self, layer: u32) -> u64 {
        self.encode_tagged(layer, 0)
    }

    /// The status word for layer `layer` of the batch tagged `tag`.
    ///
    /// ```
    /// use dedup_broadcast::{LayerStatus, CODE_OUT_OF_STEP};
    /// let w = LayerStatus::Ok.encode_tagged(3, 9);
    /// assert_eq!(LayerStatus::decode_for_tagged(w, 3, 9), LayerStatus::Ok);
    /// assert_eq!(LayerStatus::decode_for_tagged(w, 3, 8).code(), CODE_OUT_OF_STEP);
    /// ```
    pub fn encode_tagged(self, layer: u32, tag: u8) -> u64 {
        (MAGIC << 56) | (u64::from(tag) << 48) | (u64::from(self.code()) << 32) | u64::from(layer)
    }

    /// The tag, layer and status of a word, or `None` when it is not a status word.
    pub fn decode_tagged(word: u64) -> Option<(u8, u32, LayerStatus)> {
        if word >> 56 != MAGIC {
            return None;
        }
        let code = ((word >> 32) & 0xffff) as u16;
        let status = if code == 0 {
            LayerStatus::Ok
        } else {
            LayerStatus::Failed { code }
        };
        Some((((word >> 48) & 0xff) as u8, word as u32, status))
    }

    /// The layer and status of an untagged word, or `None` when it is not one.
    pub fn decode(word: u64) -> Option<(u32, LayerStatus)> {
        match LayerStatus::decode_tagged(word)? {
            (0, layer, status) => Some((layer, status)),
            _ => None,
        }
    }

    /// The status an untagged word gives layer `layer`: a word that does not decode, or
    /// names another layer, is a failure.
    pub fn decode_for(word: u64, layer: u32) -> LayerStatus {
        match LayerStatus::decode(word) {
            None => LayerStatus::failed(CODE_MALFORMED),
            Some((l, _)) if l != layer => LayerStatus::failed(CODE_LAYER_MISMATCH),
            Some((_, s)) => s,
        }
    }

    /// The status a word gives layer `layer` of the batch tagged `tag`: a word that does not
    /// decode, names another layer or carries another tag is a failure.
    pub fn decode_for_tagged(word: u64, layer: u32, tag: u8) -> LayerStatus {
        match LayerStatus::decode_tagged(word) {
            None => LayerStatus::failed(CODE_MALFORMED),
            Some((t, _, _)) if t != tag => LayerStatus::failed(CODE_OUT_OF_STEP),
            Some((_, l, _)) if l != layer => LayerStatus::failed(CODE_LAYER_MISMATCH),
            Some((_, _, s)) => s,
        }
    }
}

/// Every rank's status for layer `layer`, in rank order: one all-gather of a status word.
pub fn exchange_status(
    coll: &dyn Collective,
    layer: u32,
    status: LayerStatus,
    deadline: Instant,
) -> Result<Vec<LayerStatus>, CollectiveError> {
    let words = coll.all_gather_u64(status.encode(layer), deadline)?;
    Ok(words
        .into_iter()
        .map(|w| LayerStatus::decode_for(w, layer))
        .collect())
}

/// The group's verdict on a batch so far, folded from every layer's gathered statuses.
///
/// ```
/// use dedup_broadcast::{GroupStatus, LayerStatus};
/// let mut g = GroupStatus::default();
/// g.record(0, &[LayerStatus::Ok, LayerStatus::Ok]);
/// g.record(1, &[LayerStatus::Ok, LayerStatus::failed(9)]);
/// g.record(2, &[LayerStatus::failed(3), LayerStatus::failed(9)]);
/// assert_eq!(g.first_failed, Some((1, 1)));   // rank 1 at layer 1
/// assert_eq!(g.code, 9);
/// assert!(!g.is_ok());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupStatus {
    /// The first failure, as (rank, layer): the lowest layer with a failure, and its lowest
    /// failing rank. `None` while every status recorded is ok.
    pub first_failed: Option<(u32, u32)>,
    /// That failure's code (0 while none).
    pub code: u16,
    /// Some gathered word was malformed, named another layer or carried another batch's tag
    /// ([`is_out_of_step`]): the ranks' exchanges no longer line up.
    pub out_of_step: bool,
}

impl GroupStatus {
    /// Folds in layer `layer`'s statuses, in rank order. Returns true when all were ok.
    pub fn record(&mut self, layer: u32, statuses: &[LayerStatus]) -> bool {
        let mut all_ok = true;
        for (rank, s) in statuses.iter().enumerate() {
            if !s.is_ok() {
                // `code()`: a failure built with code 0 counts as `CODE_OTHER`, never as ok.
                let code = s.code();
                all_ok = false;
                self.out_of_step |= is_out_of_step(code);
                let here = (rank as u32, layer);
                let earlier = self
                    .first_failed
                    .is_some_and(|(r, l)| (l, r) <= (here.1, here.0));
                if !earlier {
                    self.first_failed = Some(here);
                    self.code = code;
                }
            }
        }
        all_ok
    }

    /// Folds in layer `layer`'s gathered status words (see [`LayerStatus::decode_for`]).
    pub fn record_words(&mut self, layer: u32, words: &[u64]) -> bool {
        let statuses: Vec<LayerStatus> = words
            .iter()
            .map(|&w| LayerStatus::decode_for(w, layer))
            .collect();
        self.record(layer, &statuses)
    }

    /// Exchanges this rank's `status` for layer `layer` ([`exchange_status`]) and folds the
    /// result in. Returns true when the layer is ok on every rank.
    pub fn exchange(
        &mut self,
        coll: &dyn Collective,
        layer: u32,
        status: LayerStatus,
        deadline: Instant,
    ) -> Result<bool, CollectiveError> {
        let statuses = exchange_status(coll, layer, status, deadline)?;
        Ok(self.record(layer, &statuses))
    }

    /// Exchanges this rank's `status` for layer `layer` of the batch tagged `tag` (every rank
    /// gives the same tag; a word with another one is [`CODE_OUT_OF_STEP`]) and folds the
    /// result in. Returns true when the layer is ok on every rank.
    pub fn exchange_tagged(
        &mut self,
        coll: &dyn Collective,
        layer: u32,
        status: LayerStatus,
        tag: u8,
        deadline: Instant,
    ) -> Result<bool, CollectiveError> {
        let words = coll.all_gather_u64(status.encode_tagged(layer, tag), deadline)?;
        Ok(self.record_tagged(layer, tag, words))
    }

    /// [`exchange_tagged`](Self::exchange_tagged) for the batch's verdict, the exchange no
    /// later operation settles: through [`Collective::all_gather_u64_settled`], so that `Ok`
    /// on one rank means every rank has every word (a rank that gave up fails the others
    /// too, rather than leaving them to report the batch loaded).
    pub fn exchange_verdict_tagged(
        &mut self,
        coll: &dyn Collective,
        layer: u32,
        status: LayerStatus,
        tag: u8,
        deadline: Instant,
    ) -> Result<bool, CollectiveError> {
        let words = coll.all_gather_u64_settled(status.encode_tagged(layer, tag), deadline)?;
        Ok(self.record_tagged(layer, tag, words))
    }

    /// Folds in every rank's tagged word for `layer`; true when the layer is ok on every rank.
    fn record_tagged(&mut self, layer: u32, tag: u8, words: Vec<u64>) -> bool {
        let statuses: Vec<LayerStatus> = words
            .into_iter()
            .map(|w| LayerStatus::decode_for_tagged(w, layer, tag))
            .collect();
        self.record(layer, &statuses)
    }

    /// True while no failure has been recorded.
    pub fn is_ok(&self) -> bool {
        self.first_failed.is_none()
    }

    /// The error every rank reports for `batch` when it failed:
    /// [`KvLoadError::PeerFailed`] naming the first failing rank and layer.
    pub fn to_error(&self, batch: BatchId) -> Option<KvLoadError> {
        let (rank, layer) = self.first_failed?;
        Some(KvLoadError::PeerFailed {
            batch,
            rank,
            layer,
            detail: code_name(self.code).to_string(),
        })
    }
}
