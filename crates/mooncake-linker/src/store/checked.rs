//! A store's per-key answer, checked against the keys it was asked about.

use super::StoreError;

/// The results of one batched store call over `keys`, in key order, made safe to index: a
/// store that answered with more or fewer results than keys (a broken store or decorator)
/// cannot be matched to its keys at all, so every key gets a
/// [`StoreError::ResultCount`] instead. Everything that indexes a store's results by key
/// goes through this first; then `results[i]` is key `i`'s, always.
///
/// ```
/// use mooncake_linker::store::{checked_results, StoreError};
/// let ok = checked_results(&["a", "b"], vec![Ok(1u64), Ok(2)]);
/// assert_eq!(ok, vec![Ok(1), Ok(2)]);
/// let extra = checked_results(&["a"], vec![Ok(1u64), Ok(2)]);
/// assert!(matches!(&extra[..], [Err(StoreError::ResultCount { expected: 1, got: 2, .. })]));
/// ```
pub fn checked_results<T>(
    keys: &[&str],
    results: Vec<Result<T, StoreError>>,
) -> Vec<Result<T, StoreError>> {
    if results.len() == keys.len() {
        return results;
    }
    let got = results.len();
    tracing::warn!(
        expected = keys.len(),
        got,
        "the store answered with a wrong number of results; failing every key"
    );
    keys.iter()
        .map(|k| {
            Err(StoreError::ResultCount {
                key: (*k).to_owned(),
                expected: keys.len(),
                got,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_and_extra_results_fail_every_key_by_name() {
        let fewer = checked_results::<bool>(&["a", "b", "c"], vec![Ok(true)]);
        assert_eq!(fewer.len(), 3);
        for (r, k) in fewer.iter().zip(["a", "b", "c"]) {
            assert_eq!(
                r,
                &Err(StoreError::ResultCount {
                    key: k.into(),
                    expected: 3,
                    got: 1
                })
            );
        }
        assert!(checked_results::<()>(&[], vec![Ok(())]).is_empty());
        assert_eq!(checked_results::<()>(&[], vec![]), vec![]);
    }
}
