//! Path normalisation and prefix matching: a route's limits must not be skipped by
//! spelling its path differently.
//!
//! Rule (RFC 3986 section 6.2.2, plus collapsing empty segments):
//! 1. percent-encoded unreserved characters (`A-Z a-z 0-9 - . _ ~`) are decoded
//!    (`/%61pi` is `/api`), other escapes are kept with upper-case hex digits, and raw
//!    non-ASCII bytes are percent-encoded (`/café` is `/caf%C3%A9`, one spelling for one
//!    path); a `\`, raw or encoded, an encoded `/` (`%2F`) or a broken escape is rejected
//!    with 400, since upstreams disagree on whether they separate segments;
//! 2. empty segments are dropped (`//api` is `/api`);
//! 3. `.` segments are dropped and `..` removes the segment before it, never going above
//!    the root (`/api/../api`, `/../api` and `/./api` are `/api`);
//! 4. a trailing `/` is kept (`/api/` stays `/api/`).
//!
//! Matching is case-sensitive and on whole segments: `/api` matches `/api`, `/api/` and
//! `/api/x`, never `/apix`.

use std::{borrow::Cow, fmt};

/// Why a request path was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PathError {
    /// Not an absolute path (`*`, or an authority-form target).
    NotAbsolute,
    /// `%` not followed by two hex digits.
    BadEscape,
    /// `%2F`, `%5C` or a raw `\`: a separator some upstreams see and others do not.
    EncodedSeparator,
}

impl fmt::Display for PathError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotAbsolute => "the path must start with /",
            Self::BadEscape => "% must be followed by two hex digits",
            Self::EncodedSeparator => "\\ and encoded / or \\ (%2F, %5C) are not allowed in paths",
        })
    }
}

impl std::error::Error for PathError {}

/// The normalised form of `raw` (a request path, without the query).
pub(crate) fn normalize(raw: &str) -> Result<String, PathError> {
    normalized(raw).map(Cow::into_owned)
}

/// [`normalize`], borrowing `raw` when it is its own normal form (most paths are): no
/// copy per request.
pub(crate) fn normalized(raw: &str) -> Result<Cow<'_, str>, PathError> {
    if !raw.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    if is_normal(raw) {
        return Ok(Cow::Borrowed(raw));
    }
    normalize_fully(raw).map(Cow::Owned)
}

/// [`normalize`] without its shortcut for a path that is its own normal form.
fn normalize_fully(raw: &str) -> Result<String, PathError> {
    let decoded = decode_unreserved(raw)?;
    let mut segments: Vec<&str> = Vec::new();
    let mut trailing_slash = false;
    for segment in decoded[1..].split('/') {
        // Whether the path ends in a directory: `/a/`, `/a/.` and `/a/..` all do.
        trailing_slash = matches!(segment, "" | "." | "..");
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            segment => segments.push(segment),
        }
    }
    let mut path = String::with_capacity(decoded.len());
    for segment in &segments {
        path.push('/');
        path.push_str(segment);
    }
    if trailing_slash || segments.is_empty() {
        path.push('/');
    }
    Ok(path)
}

/// Whether `raw` (starting with `/`) is its own normal form, as most request paths are:
/// nothing to decode (no `%`, `\\` or non-ASCII byte) and no empty, `.` or `..` segment
/// but a last empty one (a trailing slash).
fn is_normal(raw: &str) -> bool {
    if raw
        .bytes()
        .any(|byte| byte == b'%' || byte == b'\\' || !byte.is_ascii())
    {
        return false;
    }
    let mut segments = raw[1..].split('/').peekable();
    while let Some(segment) = segments.next() {
        let last = segments.peek().is_none();
        match segment {
            "." | ".." => return false,
            "" if !last => return false,
            _ => {}
        }
    }
    true
}

fn decode_unreserved(raw: &str) -> Result<String, PathError> {
    let bytes = raw.as_bytes();
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        if byte == b'\\' {
            return Err(PathError::EncodedSeparator);
        }
        if !byte.is_ascii() {
            // Upstreams decode `%C3%A9` and a raw `é` alike: keep one spelling.
            push_escaped(&mut out, byte);
            i += 1;
            continue;
        }
        if byte != b'%' {
            out.push(char::from(byte));
            i += 1;
            continue;
        }
        let (Some(hi), Some(lo)) = (
            bytes.get(i + 1).and_then(|b| hex(*b)),
            bytes.get(i + 2).and_then(|b| hex(*b)),
        ) else {
            return Err(PathError::BadEscape);
        };
        let value = hi << 4 | lo;
        match value {
            b'/' | b'\\' => return Err(PathError::EncodedSeparator),
            v if v.is_ascii_alphanumeric() || matches!(v, b'-' | b'.' | b'_' | b'~') => {
                out.push(char::from(v));
            }
            v => push_escaped(&mut out, v),
        }
        i += 3;
    }
    Ok(out)
}

fn push_escaped(out: &mut String, byte: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(char::from(HEX[usize::from(byte >> 4)]));
    out.push(char::from(HEX[usize::from(byte & 0xf)]));
}

fn hex(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        b'A'..=b'F' => Some(byte - b'A' + 10),
        _ => None,
    }
}

/// Whether the normalised `path` is under the route `prefix` (itself normalised, without
/// a trailing slash unless it is `/`), on a segment boundary.
pub(crate) fn matches_prefix(prefix: &str, path: &str) -> bool {
    if prefix == "/" {
        return true;
    }
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || rest.starts_with('/'),
        None => false,
    }
}

/// A route's `path` from the config in the form [`matches_prefix`] expects.
pub(crate) fn normalize_prefix(path: &str) -> Result<String, PathError> {
    let mut normalized = normalize(path)?;
    if normalized.len() > 1 && normalized.ends_with('/') {
        normalized.pop();
    }
    Ok(normalized)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn norm(raw: &str) -> String {
        normalize(raw).unwrap()
    }

    #[test]
    fn collapses_slashes_and_dot_segments() {
        assert_eq!(norm("/"), "/");
        assert_eq!(norm("//api"), "/api");
        assert_eq!(norm("///api//v1///x"), "/api/v1/x");
        assert_eq!(norm("/api/../api"), "/api");
        assert_eq!(norm("/./api"), "/api");
        assert_eq!(norm("/../../api"), "/api");
        assert_eq!(norm("/a/b/../../api/x"), "/api/x");
        assert_eq!(norm("/api/"), "/api/");
        assert_eq!(norm("/api/."), "/api/");
        assert_eq!(norm("/api/x/.."), "/api/");
        assert_eq!(norm("/.."), "/");
        assert_eq!(norm("/..."), "/...");
    }

    #[test]
    fn decodes_unreserved_only() {
        assert_eq!(norm("/%61pi"), "/api");
        assert_eq!(norm("/%41%50%49"), "/API");
        assert_eq!(norm("/%2e%2e/api"), "/api");
        assert_eq!(norm("/api/%2E"), "/api/");
        assert_eq!(norm("/a%7e%5f%2d"), "/a~_-");
        assert_eq!(norm("/a%20b%3f"), "/a%20b%3F");
        assert_eq!(norm("/caf%C3%A9"), "/caf%C3%A9");
    }

    #[test]
    fn rejects_encoded_separators_and_broken_escapes() {
        assert_eq!(normalize("/api%2Fx"), Err(PathError::EncodedSeparator));
        assert_eq!(normalize("/api%2fx"), Err(PathError::EncodedSeparator));
        assert_eq!(normalize("/api%5Cx"), Err(PathError::EncodedSeparator));
        assert_eq!(normalize("/api%2"), Err(PathError::BadEscape));
        assert_eq!(normalize("/api%zz"), Err(PathError::BadEscape));
        assert_eq!(normalize("*"), Err(PathError::NotAbsolute));
        assert_eq!(normalize(""), Err(PathError::NotAbsolute));
    }

    proptest::proptest! {
        /// The shortcut for a path already normal changes no answer: any path of slashes,
        /// dots, escapes and letters normalises as without it.
        #[test]
        fn a_normal_path_is_kept_as_the_full_normalisation_would(
            raw in "/[a./%2Ef_\\\\-]{0,12}"
        ) {
            proptest::prop_assert_eq!(normalize(&raw), normalize_fully(&raw));
            if is_normal(&raw) {
                proptest::prop_assert_eq!(normalize_fully(&raw), Ok(raw.clone()));
            }
        }
    }

    #[test]
    fn prefixes_match_whole_segments() {
        assert!(matches_prefix("/api", "/api"));
        assert!(matches_prefix("/api", "/api/"));
        assert!(matches_prefix("/api", "/api/x"));
        assert!(!matches_prefix("/api", "/apix"));
        assert!(!matches_prefix("/api", "/ap"));
        assert!(matches_prefix("/", "/anything"));
        assert_eq!(normalize_prefix("/api/").unwrap(), "/api");
        assert_eq!(normalize_prefix("//api/./v1/").unwrap(), "/api/v1");
        assert_eq!(normalize_prefix("/").unwrap(), "/");
    }
}
