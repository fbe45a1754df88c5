//! What a normalised path is, checked alike by `gateway/tests/hostile.rs` and the fuzz target
//! `path_normalise` (each includes this file with `#[path]`).

/// A normalised gateway path: starts with `/`, a fixed point of `normalize`, no empty,
/// `.` or `..` segment, escapes upper-case and never of a character it decodes.
#[track_caller]
pub(crate) fn check_normal<E: std::fmt::Debug + PartialEq>(
    normal: &str,
    normalize: impl Fn(&str) -> Result<String, E>,
) {
    assert!(normal.starts_with('/'), "{normal:?}");
    assert_eq!(
        normalize(normal).as_ref().map(String::as_str),
        Ok(normal),
        "not idempotent"
    );
    // No empty, `.` or `..` segment anywhere (the last one may be empty: a trailing `/`).
    let segments: Vec<&str> = normal[1..].split('/').collect();
    for (i, segment) in segments.iter().enumerate() {
        let last = i + 1 == segments.len();
        assert!(!segment.is_empty() || last, "empty segment in {normal:?}");
        assert!(
            *segment != "." && *segment != "..",
            "dot segment in {normal:?}"
        );
    }
    for bad in ["//", "/./", "/../"] {
        assert!(!normal.contains(bad), "{bad} in {normal:?}");
    }
    assert!(
        !normal.ends_with("/.") && !normal.ends_with("/.."),
        "{normal:?}"
    );
    // Escapes are upper-case and never of an unreserved character.
    let bytes = normal.as_bytes();
    for (i, _) in normal.match_indices('%') {
        let hex = &bytes[i + 1..i + 3];
        assert!(
            hex.iter()
                .all(|b| b.is_ascii_digit() || (b'A'..=b'F').contains(b))
        );
        let value = u8::from_str_radix(std::str::from_utf8(hex).unwrap(), 16).unwrap();
        assert!(
            !(value.is_ascii_alphanumeric() || matches!(value, b'-' | b'.' | b'_' | b'~')),
            "undecoded %{value:02X} in {normal:?}"
        );
        assert!(value != b'/' && value != b'\\');
    }
}
