//! `Key::new` on arbitrary bytes: never panics, at most `MAX_KEY_LEN` bytes, only safe
//! characters, and injective: the input is split in two, and two different halves never
//! give one key (unless both were hashed, where equal keys would be a SHA-256 collision).
#![no_main]

#[path = "../../tests/oracles/mod.rs"]
mod oracles;

use libfuzzer_sys::fuzz_target;
use oracles::{check_key as check, is_hashed};

fuzz_target!(|data: &[u8]| {
    let whole = check(data);
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    let at = usize::from(split).min(rest.len());
    let (a, b) = rest.split_at(at);
    let (ka, kb) = (check(a), check(b));
    if a != b && !(is_hashed(&ka) && is_hashed(&kb)) {
        assert_ne!(ka, kb, "{a:?} and {b:?} share a key");
    }
    if data != rest && !(is_hashed(&whole) && is_hashed(&check(rest))) {
        assert_ne!(whole, check(rest));
    }
});
