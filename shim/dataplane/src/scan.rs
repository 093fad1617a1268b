//! A JSON object's top-level members, found by a scanner made for the one question a pinning proxy asks: where
//! are the top-level keys and values? The whole text is checked as JSON (RFC 8259: UTF-8, no control characters
//! in strings, valid escapes and numbers, nothing after the object); strings, most of a prompt's bytes, are
//! skipped with memchr, and nothing is built but the list of members.
use std::borrow::Cow;
use std::ops::Range;

/// One top-level member: its key unescaped, and the byte ranges of its key (quotes included) and value.
pub struct Member<'a> {
    pub name: Cow<'a, str>,
    pub key: Range<usize>,
    pub value: Range<usize>,
}

const MAX_DEPTH: usize = 128;

/// A JSON object's text from its `members` (found in `body`) with "model" first and set to `model`, every other
/// member as it was (a repeated "model", however spelled, left out).
pub fn pinned(body: &[u8], members: &[Member], model: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + model.len() + 16);
    out.extend_from_slice(b"{\"model\":");
    serde_json::to_writer(&mut out, model).expect("a string serialises");
    for m in members.iter().filter(|m| m.name != "model") {
        out.push(b',');
        out.extend_from_slice(&body[m.key.clone()]);
        out.push(b':');
        out.extend_from_slice(&body[m.value.clone()]);
    }
    out.push(b'}');
    out
}

/// The members of a JSON text that is an object, in order (a repeated key appears each time), or None if it is
/// not valid JSON or not an object.
pub fn members(b: &[u8]) -> Option<Vec<Member<'_>>> {
    std::str::from_utf8(b).ok()?;
    let mut out = Vec::new();
    let mut i = ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i = ws(b, i + 1);
    if b.get(i) == Some(&b'}') {
        return (ws(b, i + 1) == b.len()).then_some(out);
    }
    loop {
        let key_end = string(b, i)?;
        let raw = &b[i + 1..key_end - 1];
        let name = if raw.contains(&b'\\') {
            Cow::Owned(serde_json::from_slice::<String>(&b[i..key_end]).ok()?)
        } else {
            Cow::Borrowed(std::str::from_utf8(raw).ok()?)
        };
        let key = i..key_end;
        i = ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        let start = ws(b, i + 1);
        let end = value(b, start, 1)?;
        out.push(Member {
            name,
            key,
            value: start..end,
        });
        i = ws(b, end);
        match b.get(i) {
            Some(b',') => i = ws(b, i + 1),
            Some(b'}') => return (ws(b, i + 1) == b.len()).then_some(out),
            _ => return None,
        }
    }
}

fn ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// The end (after its closing quote) of the string starting at b[i].
fn string(b: &[u8], i: usize) -> Option<usize> {
    if b.get(i) != Some(&b'"') {
        return None;
    }
    let mut j = i + 1;
    loop {
        let k = j + memchr::memchr2(b'"', b'\\', &b[j..])?;
        if b[j..k].iter().fold(false, |bad, &c| bad | (c < 0x20)) {
            return None;
        }
        if b[k] == b'"' {
            return Some(k + 1);
        }
        match b.get(k + 1)? {
            b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => j = k + 2,
            b'u' if b.get(k + 2..k + 6)?.iter().all(u8::is_ascii_hexdigit) => j = k + 6,
            _ => return None,
        }
    }
}

/// The end of the JSON value starting at b[i].
fn value(b: &[u8], i: usize, depth: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => string(b, i),
        b'{' | b'[' if depth >= MAX_DEPTH => None,
        b'{' => {
            let mut i = ws(b, i + 1);
            if b.get(i) == Some(&b'}') {
                return Some(i + 1);
            }
            loop {
                i = ws(b, string(b, i)?);
                if b.get(i) != Some(&b':') {
                    return None;
                }
                i = ws(b, value(b, ws(b, i + 1), depth + 1)?);
                match b.get(i)? {
                    b',' => i = ws(b, i + 1),
                    b'}' => return Some(i + 1),
                    _ => return None,
                }
            }
        }
        b'[' => {
            let mut i = ws(b, i + 1);
            if b.get(i) == Some(&b']') {
                return Some(i + 1);
            }
            loop {
                i = ws(b, value(b, i, depth + 1)?);
                match b.get(i)? {
                    b',' => i = ws(b, i + 1),
                    b']' => return Some(i + 1),
                    _ => return None,
                }
            }
        }
        b't' => b[i..].starts_with(b"true").then_some(i + 4),
        b'f' => b[i..].starts_with(b"false").then_some(i + 5),
        b'n' => b[i..].starts_with(b"null").then_some(i + 4),
        b'-' | b'0'..=b'9' => number(b, i),
        _ => None,
    }
}

fn digits(b: &[u8], mut i: usize) -> usize {
    while b.get(i).map_or(false, u8::is_ascii_digit) {
        i += 1;
    }
    i
}

fn number(b: &[u8], mut i: usize) -> Option<usize> {
    if b[i] == b'-' {
        i += 1;
    }
    match b.get(i)? {
        b'0' => i += 1,
        b'1'..=b'9' => i = digits(b, i),
        _ => return None,
    }
    if b.get(i) == Some(&b'.') {
        let j = digits(b, i + 1);
        if j == i + 1 {
            return None;
        }
        i = j;
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        let j = digits(b, i);
        if j == i {
            return None;
        }
        i = j;
    }
    Some(i)
}

#[cfg(test)]
mod tests {
    use super::members;

    /// The scanner's verdict against serde_json's (a strict RFC 8259 reader) on every one-byte mutation of a
    /// document: deleting each byte, replacing it and inserting before it each byte that matters to JSON.
    #[test]
    fn agrees_with_serde_json_on_mutations() {
        let doc = br#"{"model": "a\"b\\c\u00e9", "n": [-1.5e+3, 0, 12, true, false, null, {}], "o": {"k": [[]]},
            "s": "tab\there \ud83d\ude00", "e": {}, "f": 0.25E-2}"#;
        // values kept as raw text, as the scanner does not decode them (a lone surrogate escape is valid to both)
        type Raw = std::collections::BTreeMap<String, Box<serde_json::value::RawValue>>;
        let oracle = |b: &[u8]| serde_json::from_slice::<Raw>(b).is_ok();
        let bytes = b"\"\\{}[],:0123456789-+eE.tfnu \t\n\x01\x7f\xc3ax";
        let (mut checked, mut valid) = (0, 0);
        let mut check = |b: &[u8]| {
            let ours = members(b).is_some();
            assert_eq!(ours, oracle(b), "{:?}", String::from_utf8_lossy(b));
            checked += 1;
            valid += ours as usize;
        };
        check(doc);
        for i in 0..doc.len() {
            let mut d = doc.to_vec();
            d.remove(i);
            check(&d);
            for &c in bytes.iter() {
                let mut r = doc.to_vec();
                r[i] = c;
                check(&r);
                let mut ins = doc.to_vec();
                ins.insert(i, c);
                check(&ins);
            }
        }
        assert!(checked > 10_000 && valid > 500, "{checked} checked, {valid} valid");
    }

    #[test]
    fn finds_every_top_level_member_and_unescapes_keys() {
        let doc = br#" {"model": "x", "mod\u0065l": {"model": 1}, "m": [1, {"model": 2}] , "model": null} "#;
        let m = members(doc).unwrap();
        let names: Vec<&str> = m.iter().map(|m| m.name.as_ref()).collect();
        assert_eq!(names, ["model", "model", "m", "model"]);
        assert_eq!(&doc[m[1].key.clone()], br#""mod\u0065l""#);
        assert_eq!(&doc[m[1].value.clone()], br#"{"model": 1}"#);
        assert_eq!(&doc[m[3].value.clone()], b"null");
        for bad in [
            &b"[1]"[..],
            b"{}x",
            b"{\"a\":1,}",
            b"{\"a\":01}",
            b"{\"a\":\"\x1f\"}",
            b"\"s\"",
            b"",
        ] {
            assert!(members(bad).is_none(), "{:?}", String::from_utf8_lossy(bad));
        }
        assert!(members(b"{}").unwrap().is_empty());
    }
}
