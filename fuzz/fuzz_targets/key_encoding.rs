//! `Key::new` on arbitrary bytes: never panics, at most `MAX_KEY_LEN` bytes, only safe
//! characters, and injective: the input is split in two, and two different halves never
//! give one key (unless both were hashed, where equal keys would be a SHA-256 collision).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tollgate::key::{Key, MAX_KEY_LEN};

/// The bytes a key that was not hashed stands for (`~` is the empty key).
fn decode(key: &str) -> Option<Vec<u8>> {
    if key.starts_with('#') {
        return None;
    }
    if key == "~" {
        return Some(Vec::new());
    }
    let bytes = key.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
            out.push(u8::from_str_radix(hex, 16).unwrap());
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(out)
}

fn check(input: &[u8]) -> Key {
    let key = Key::new(input);
    let s = key.as_str();
    assert!(!s.is_empty());
    assert!(s.len() <= MAX_KEY_LEN, "{} bytes: {s:?}", s.len());
    assert!(
        s.bytes()
            .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}'),
        "unsafe byte in {s:?}"
    );
    match decode(s) {
        // Readable keys decode back to the input: that is what makes them injective.
        Some(decoded) => assert_eq!(decoded, input, "{s:?}"),
        None => {
            assert_eq!(s.len(), 33, "{s:?}");
            assert!(s[1..].bytes().all(|b| b.is_ascii_hexdigit()), "{s:?}");
            // Hashed only when the readable form would be too long.
            assert!(
                input.len() * 3 > MAX_KEY_LEN,
                "{} input bytes hashed",
                input.len()
            );
        }
    }
    // Deterministic.
    assert_eq!(Key::new(input), key);
    key
}

fuzz_target!(|data: &[u8]| {
    let whole = check(data);
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    let at = usize::from(split).min(rest.len());
    let (a, b) = rest.split_at(at);
    let (ka, kb) = (check(a), check(b));
    let hashed = |k: &Key| k.as_str().starts_with('#');
    if a != b && !(hashed(&ka) && hashed(&kb)) {
        assert_ne!(ka, kb, "{a:?} and {b:?} share a key");
    }
    if data != rest && !(hashed(&whole) && hashed(&check(rest))) {
        assert_ne!(whole, check(rest));
    }
});
