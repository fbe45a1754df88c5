//! The rule for a key prefix, shared by `RedisStore::with_prefix` and configs that are
//! checked before any store is connected.

use crate::ConfigError;

/// Checks `prefix` by the rule `RedisStore::with_prefix` applies: 1 to 64 bytes of
/// ASCII letters, digits and `-_.:/`.
///
/// Braces would change a key's hash tag (its Redis Cluster slot) and spaces or control
/// bytes would make keys hard to read back, so they are refused. Call it when loading a
/// config, so that a bad prefix fails there and not after connecting.
///
/// # Errors
///
/// A [`ConfigError`] for the field `prefix` that shows the value.
///
/// ```
/// assert!(tollgate::store::validate_prefix("myapp:v2").is_ok());
/// assert!(tollgate::store::validate_prefix("{myapp}").is_err());
/// ```
pub fn validate_prefix(prefix: &str) -> Result<(), ConfigError> {
    // Empty would leave keys starting with `:`, under no prefix of their own.
    let valid = (1..=64).contains(&prefix.len())
        && prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':' | b'/'));
    if valid {
        Ok(())
    } else {
        Err(ConfigError::new(
            "prefix",
            format!("must be 1 to 64 of A-Z a-z 0-9 - _ . : / (got {prefix:?})"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::validate_prefix;

    #[test]
    fn letters_digits_and_separators_up_to_64_bytes() {
        for ok in ["tollgate", "my-app_v2.prod:eu/1", &"p".repeat(64)] {
            assert!(validate_prefix(ok).is_ok(), "{ok:?}");
        }
        for bad in [
            "",
            "{tg}",
            "a}",
            "a b",
            "a+b",
            "x\u{e9}",
            "a\n",
            &"p".repeat(65),
        ] {
            let error = validate_prefix(bad).unwrap_err();
            assert_eq!(error.field(), "prefix");
            assert!(error.to_string().contains(&format!("{bad:?}")), "{error}");
        }
    }
}
