//! The example gateway's path normaliser (`path::normalize`) on arbitrary paths.
//!
//! Never panics; what it returns starts with `/`, is a fixed point
//! (`normalize(normalize(p)) == normalize(p)`), has no empty, `.` or `..` segment, and no
//! escape of a character it decodes; a route prefix matches it exactly when it matches the
//! normalised form of the prefix's own spelling.
#![no_main]

#[allow(dead_code)]
#[path = "../../examples/gateway/path.rs"]
mod path;

use libfuzzer_sys::fuzz_target;

fn check_normal(normal: &str) {
    assert!(normal.starts_with('/'), "{normal:?}");
    assert_eq!(
        path::normalize(normal).as_deref(),
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

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    // Half the inputs as paths, the other half split into a route prefix and a path.
    let (prefix, raw) = match text.split_once('\n') {
        Some((prefix, raw)) => (Some(prefix), raw),
        None => (None, &*text),
    };
    let Ok(normal) = path::normalize(raw) else {
        return;
    };
    check_normal(&normal);
    // The same path spelled with a leading `/`: never a different answer.
    if let Ok(again) = path::normalize(&format!("/{raw}")) {
        assert_eq!(again, normal, "a leading // changed {raw:?}");
    }
    let Some(Ok(prefix)) = prefix.map(path::normalize_prefix) else {
        return;
    };
    check_normal(&prefix);
    assert!(prefix == "/" || !prefix.ends_with('/'));
    // Matching is on whole segments: the route matches the path, or a segment differs.
    if path::matches_prefix(&prefix, &normal) {
        let rest = &normal[prefix.len()..];
        assert!(prefix == "/" || rest.is_empty() || rest.starts_with('/'));
    } else {
        assert!(prefix != "/");
        let p: Vec<&str> = prefix[1..].split('/').collect();
        let n: Vec<&str> = normal[1..].split('/').collect();
        assert!(
            n.len() < p.len() || p.iter().zip(&n).any(|(a, b)| a != b),
            "{prefix:?} should match {normal:?}"
        );
    }
});
