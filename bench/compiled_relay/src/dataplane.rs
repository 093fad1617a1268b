//! A prototype of a compiled shim's data plane, for the bench only: what the shim does on a call's path, compiled,
//! and nothing off it. Per request on a kept-alive harness connection: the local token checked, the body checked
//! and its model pinned (`scan::members`), `stream` and `max_tokens` read, the request sent on with the real key
//! (from $DATAPLANE_UPSTREAM_KEY, never argv) on a kept-alive upstream connection; a non-stream answer read whole
//! and passed on, then its usage read; a stream's head passed on at once, its events (chunked upstream) held back
//! until the first content event, then relayed as they arrive, re-chunked, with the usage of `message_start` and
//! `message_delta` read; then a call record (status, stream, max_tokens, tokens, microseconds) written as one line
//! to $DATAPLANE_RECORDS if set (the shim writes its ledger row with one write(2)).
//!
//! Left out, being off the path or not on the bench's: tickets and everything the control plane does (holds,
//! pacing, settles, the ledger's queue, progress), retries, the OpenAI wire, chunked or compressed request bodies,
//! Expect, pipelining, TLS. Anthropic messages only.
use std::fs::File;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::Instant;

use crate::scan;

pub struct DataPlane {
    pub upstream: String,
    pub model: String,
    pub token: String,
    pub key: String,
    pub records: Option<Mutex<File>>,
}

const HOP: [&str; 11] = [
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "host",
    "x-api-key",
    "authorization",
    "accept-encoding",
    "expect",
    "te",
    "upgrade",
];

/// Reads into `buf` until it holds `need` bytes; false at EOF.
fn fill(s: &mut TcpStream, buf: &mut Vec<u8>, need: usize) -> io::Result<bool> {
    let mut chunk = [0u8; 65536];
    while buf.len() < need {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Ok(false);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(true)
}

/// Reads into `buf` until it holds a whole message head; its end (the blank line's start), or None at EOF.
fn head_end(s: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<Option<usize>> {
    let mut from = 0;
    loop {
        if let Some(i) = memchr::memmem::find(&buf[from..], b"\r\n\r\n") {
            return Ok(Some(from + i));
        }
        from = buf.len().saturating_sub(3);
        if !fill(s, buf, buf.len() + 1)? {
            return Ok(None);
        }
    }
}

/// A head's first line and its headers (names lower-cased).
fn parse_head(head: &[u8]) -> Option<(&str, Vec<(String, &str)>)> {
    let text = std::str::from_utf8(head).ok()?;
    let mut lines = text.split("\r\n");
    let first = lines.next()?;
    let headers = lines
        .map(|l| {
            l.split_once(':')
                .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim()))
        })
        .collect::<Option<Vec<_>>>()?;
    Some((first, headers))
}

fn header<'a>(headers: &'a [(String, &str)], name: &str) -> Option<&'a str> {
    headers.iter().rev().find(|(n, _)| n == name).map(|(_, v)| *v)
}

fn reply(down: &mut TcpStream, status: &str, body: &str) -> io::Result<()> {
    let msg = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nx-should-retry: false\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    down.write_all(msg.as_bytes())
}

/// Token counts by Anthropic's names: input, cache reads, cache writes, output.
#[derive(Default)]
struct Usage([u64; 4]);

const USAGE_NAMES: [&str; 4] = [
    "input_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
    "output_tokens",
];

impl Usage {
    /// Takes what a `usage` object holds (a later event's counts replace an earlier one's).
    fn take(&mut self, usage: &serde_json::Value) {
        for (slot, name) in self.0.iter_mut().zip(USAGE_NAMES) {
            if let Some(n) = usage.get(name).and_then(|v| v.as_u64()) {
                *slot = n;
            }
        }
    }
}

impl DataPlane {
    pub fn serve(&self, mut down: TcpStream) -> io::Result<()> {
        down.set_nodelay(true)?;
        let mut buf = Vec::with_capacity(256 * 1024);
        let mut up: Option<(TcpStream, Vec<u8>)> = None;
        while let Some(end) = head_end(&mut down, &mut buf)? {
            let t0 = Instant::now();
            let (first, headers) = match parse_head(&buf[..end]) {
                Some(h) => h,
                None => return reply(&mut down, "400 Bad Request", r#"{"error":"bad head"}"#),
            };
            let size: usize = header(&headers, "content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let path = first.split(' ').nth(1).unwrap_or("/").to_string();
            let bearer = header(&headers, "authorization").and_then(|v| v.strip_prefix("Bearer "));
            let authorized = header(&headers, "x-api-key").or(bearer) == Some(self.token.as_str());
            let passed: Vec<u8> = headers
                .iter()
                .filter(|(n, _)| !HOP.contains(&n.as_str()))
                .flat_map(|(n, v)| [n.as_bytes(), b": ", v.as_bytes(), b"\r\n"].concat())
                .collect();
            if !fill(&mut down, &mut buf, end + 4 + size)? {
                return Ok(());
            }
            let body = &buf[end + 4..end + 4 + size];
            if !authorized {
                reply(&mut down, "401 Unauthorized", r#"{"error":"invalid local token"}"#)?;
            } else if let Some(members) = scan::members(body) {
                let value = |name: &str| {
                    members
                        .iter()
                        .rev()
                        .find(|m| m.name == name)
                        .map(|m| &body[m.value.clone()])
                };
                let stream = value("stream") == Some(b"true");
                let max_tokens: u64 = value("max_tokens")
                    .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
                    .unwrap_or(0);
                let pinned = scan::pinned(body, &members, &self.model);
                let mut request = format!(
                    "POST {path} HTTP/1.1\r\nhost: {}\r\nx-api-key: {}\r\ncontent-length: {}\r\n",
                    self.upstream,
                    self.key,
                    pinned.len()
                )
                .into_bytes();
                request.extend_from_slice(&passed);
                request.extend_from_slice(b"\r\n");
                request.extend_from_slice(&pinned);
                if up.is_none() {
                    let s = TcpStream::connect(&self.upstream)?;
                    s.set_nodelay(true)?;
                    up = Some((s, Vec::with_capacity(64 * 1024)));
                }
                let (ups, ubuf) = up.as_mut().unwrap();
                ups.write_all(&request)?;
                let (status, usage) = self.answer(&mut down, ups, ubuf)?;
                self.record(status, stream, max_tokens, &usage, t0);
            } else {
                reply(
                    &mut down,
                    "400 Bad Request",
                    r#"{"error":"request body is not a JSON object"}"#,
                )?;
            }
            buf.drain(..end + 4 + size);
        }
        Ok(())
    }

    /// The upstream's answer passed on to the harness: (its status, the usage read from it).
    fn answer(&self, down: &mut TcpStream, up: &mut TcpStream, ubuf: &mut Vec<u8>) -> io::Result<(u16, Usage)> {
        let bad = || io::Error::new(io::ErrorKind::InvalidData, "bad upstream answer");
        let end = head_end(up, ubuf)?.ok_or_else(bad)?;
        let (first, headers) = parse_head(&ubuf[..end]).ok_or_else(bad)?;
        let status: u16 = first.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(bad)?;
        let chunked = header(&headers, "transfer-encoding").map_or(false, |v| v.eq_ignore_ascii_case("chunked"));
        let sse = header(&headers, "content-type").map_or(false, |v| v.starts_with("text/event-stream"));
        let length: Option<usize> = header(&headers, "content-length").and_then(|v| v.parse().ok());
        let mut head = format!("{first}\r\n").into_bytes();
        for (n, v) in headers.iter().filter(|(n, _)| !HOP.contains(&n.as_str())) {
            head.extend_from_slice(format!("{n}: {v}\r\n").as_bytes());
        }
        ubuf.drain(..end + 4);
        let mut usage = Usage::default();
        if sse && chunked {
            head.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n");
            down.write_all(&head)?; // a stream's head goes on at once
            self.relay_events(down, up, ubuf, &mut usage)?;
            return Ok((status, usage));
        }
        let body = if chunked {
            let mut body = Vec::new();
            while let Some(piece) = next_chunk(up, ubuf)? {
                body.extend_from_slice(&piece);
            }
            body
        } else {
            let size = length.ok_or_else(bad)?;
            if !fill(up, ubuf, size)? {
                return Err(bad());
            }
            ubuf.drain(..size).collect()
        };
        head.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
        head.extend_from_slice(&body);
        down.write_all(&head)?;
        if let Some(members) = scan::members(&body) {
            if let Some(m) = members.iter().find(|m| m.name == "usage") {
                if let Ok(u) = serde_json::from_slice::<serde_json::Value>(&body[m.value.clone()]) {
                    usage.take(&u);
                }
            }
        }
        Ok((status, usage))
    }

    /// A chunked SSE body: events held back until the first content event, then passed on as they arrive.
    fn relay_events(
        &self,
        down: &mut TcpStream,
        up: &mut TcpStream,
        ubuf: &mut Vec<u8>,
        usage: &mut Usage,
    ) -> io::Result<()> {
        let mut events: Vec<u8> = Vec::new(); // decoded, not yet split into whole events
        let mut out: Vec<u8> = Vec::new(); // whole events not yet passed on
        let mut content = false;
        loop {
            let piece = next_chunk(up, ubuf)?;
            let done = piece.is_none();
            if let Some(piece) = piece {
                events.extend_from_slice(&piece);
            }
            let mut start = 0;
            while let Some(i) = memchr::memmem::find(&events[start..], b"\n\n") {
                let event = &events[start..start + i + 2];
                for line in event.split(|&b| b == b'\n') {
                    if let Some(data) = line.strip_prefix(b"data: ") {
                        if !content && memchr::memmem::find(data, b"content_block_delta").is_some() {
                            content = true;
                        }
                        if memchr::memmem::find(data, b"\"usage\"").is_some() {
                            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
                                let u = v.get("usage").or_else(|| v.get("message").and_then(|m| m.get("usage")));
                                if let Some(u) = u {
                                    usage.take(u);
                                }
                            }
                        }
                    }
                }
                out.extend_from_slice(event);
                start += i + 2;
            }
            events.drain(..start);
            if (content || done) && !out.is_empty() {
                let mut chunk = format!("{:x}\r\n", out.len()).into_bytes();
                chunk.extend_from_slice(&out);
                chunk.extend_from_slice(b"\r\n");
                if done {
                    chunk.extend_from_slice(b"0\r\n\r\n");
                }
                down.write_all(&chunk)?;
                out.clear();
            } else if done {
                down.write_all(b"0\r\n\r\n")?;
            }
            if done {
                return Ok(());
            }
        }
    }

    fn record(&self, status: u16, stream: bool, max_tokens: u64, usage: &Usage, t0: Instant) {
        if let Some(file) = &self.records {
            let [input, cached, written, output] = usage.0;
            let line = format!(
                "{{\"status\":{status},\"stream\":{stream},\"max_tokens\":{max_tokens},\"input_tokens\":{input},\
                 \"cached_tokens\":{cached},\"cache_write_tokens\":{written},\"output_tokens\":{output},\"us\":{}}}\n",
                t0.elapsed().as_micros()
            );
            let _ = file.lock().unwrap().write_all(line.as_bytes());
        }
    }
}

/// The next chunk of a chunked body (None after the last), read from `up` through `ubuf`.
fn next_chunk(up: &mut TcpStream, ubuf: &mut Vec<u8>) -> io::Result<Option<Vec<u8>>> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "bad chunk");
    loop {
        if let Some(i) = memchr::memmem::find(ubuf, b"\r\n") {
            let line = std::str::from_utf8(&ubuf[..i]).map_err(|_| bad())?;
            let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16).map_err(|_| bad())?;
            if size == 0 {
                if !fill(up, ubuf, i + 4)? {
                    return Err(bad());
                }
                ubuf.drain(..i + 4); // no trailers
                return Ok(None);
            }
            if !fill(up, ubuf, i + 2 + size + 2)? {
                return Err(bad());
            }
            let piece = ubuf[i + 2..i + 2 + size].to_vec();
            ubuf.drain(..i + 2 + size + 2);
            return Ok(Some(piece));
        }
        if !fill(up, ubuf, ubuf.len() + 1)? {
            return Err(bad());
        }
    }
}
