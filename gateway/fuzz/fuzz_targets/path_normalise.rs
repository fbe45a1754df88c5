//! The gateway's path normaliser (`path::normalize`) on arbitrary paths.
//!
//! Never panics; what it returns starts with `/`, is a fixed point
//! (`normalize(normalize(p)) == normalize(p)`), has no empty, `.` or `..` segment, and no
//! escape of a character it decodes; a route prefix matches it exactly when it matches the
//! normalised form of the prefix's own spelling.
#![no_main]

#[allow(dead_code)]
#[path = "../../src/path.rs"]
mod path;

#[path = "../../tests/common/normal.rs"]
mod normal;

use libfuzzer_sys::fuzz_target;

fn check_normal(normal: &str) {
    normal::check_normal(normal, path::normalize);
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
