//! `HeaderKey` over arbitrary header names, values and repetitions.
//!
//! Never panics; exactly one non-empty value gives that value's key in the namespace
//! `header:<name>`, whatever the case of the name it was sent under; none, an empty one, or
//! a repeated header gives no key; the key is bounded and safe.
#![no_main]

#[path = "../../tests/oracles/mod.rs"]
mod oracles;

use arbitrary::Arbitrary;
use http::{HeaderName, HeaderValue, Request};
use libfuzzer_sys::fuzz_target;
use oracles::check_header_key;
use tollgate::key::{HeaderKey, KeyExtractor};

#[derive(Arbitrary, Debug)]
struct Input {
    /// The configured name, or `x-api-key` when it is not a valid one.
    name: String,
    /// Values under the configured name (in random letter case) or under another name.
    values: Vec<(bool, u8, Vec<u8>)>,
}

fn flip_case(name: &str, seed: u8) -> String {
    name.chars()
        .enumerate()
        .map(|(i, c)| {
            if (usize::from(seed) >> (i % 8)) & 1 == 1 {
                c.to_ascii_uppercase()
            } else {
                c
            }
        })
        .collect()
}

fuzz_target!(|input: Input| {
    let extractor =
        HeaderKey::new(&input.name).unwrap_or_else(|_| HeaderKey::new("x-api-key").unwrap());
    let name = extractor.name().clone();
    let other = if name == "x-other" {
        "x-different"
    } else {
        "x-other"
    };

    let mut req = Request::new(());
    let mut ours: Vec<Vec<u8>> = Vec::new();
    for (same, seed, bytes) in &input.values {
        let Ok(value) = HeaderValue::from_bytes(bytes) else {
            continue;
        };
        let sent = if *same {
            flip_case(name.as_str(), *seed)
        } else {
            other.to_owned()
        };
        let sent =
            HeaderName::from_bytes(sent.as_bytes()).expect("a case change keeps a name valid");
        if sent == name {
            ours.push(bytes.clone());
        }
        req.headers_mut().append(sent, value);
    }

    let result = extractor.extract(&req);
    match ours.as_slice() {
        [one] if !one.is_empty() => {
            let key = result.expect("one non-empty value is a key");
            check_header_key(&key, name.as_str(), one);
        }
        _ => assert!(result.is_err(), "{} values gave a key", ours.len()),
    }
});
