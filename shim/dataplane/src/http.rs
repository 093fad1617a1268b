//! HTTP/1.1 framing over blocking sockets: a connection with its read buffer, message heads, Content-Length and
//! chunked bodies. Only what the data plane's fast path needs; anything else is the Python shim's (front.rs).
use std::io::{self, Write};
use std::net::TcpStream;
use std::os::unix::io::{AsRawFd, RawFd};

use memchr::memmem;

pub const MAX_HEAD: usize = 64 * 1024;

/// A socket and what has been read from it but not consumed.
pub struct Conn {
    pub s: TcpStream,
    pub buf: Vec<u8>,
    /// while set, a read that has to wait also watches this socket (the harness's) and fails with CLIENT_GONE
    /// as soon as its peer closes it: a relay blocked on its source learns at once that no one is listening
    pub watch: Option<RawFd>,
    timeout_ms: i32, // the socket's read timeout, for poll (-1: none)
}

pub const CLIENT_GONE: &str = "client disconnected";

pub fn client_gone(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::BrokenPipe && e.to_string() == CLIENT_GONE
}

pub fn bad(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.to_string())
}

impl Conn {
    pub fn new(s: TcpStream) -> Conn {
        Conn { s, buf: Vec::with_capacity(64 * 1024), watch: None, timeout_ms: -1 }
    }

    pub fn set_read_timeout(&mut self, d: std::time::Duration) -> io::Result<()> {
        self.s.set_read_timeout(Some(d))?;
        self.timeout_ms = d.as_millis().clamp(1, i32::MAX as u128) as i32;
        Ok(())
    }

    /// Until this socket is readable (its read timeout applies), or the watched one's peer has closed it.
    fn wait(&self, watch: RawFd) -> io::Result<()> {
        let timeout = self.timeout_ms;
        let mut fds = [
            libc::pollfd { fd: self.s.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: watch, events: libc::POLLRDHUP, revents: 0 },
        ];
        loop {
            // SAFETY: two valid pollfd structs, for the length given
            let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if r == 0 {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "read timed out"));
            }
            if fds[1].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
                return Err(io::Error::new(io::ErrorKind::BrokenPipe, CLIENT_GONE));
            }
            if fds[0].revents != 0 {
                return Ok(());
            }
        }
    }

    /// Reads more into the buffer: false at EOF.
    pub fn more(&mut self) -> io::Result<bool> {
        if let Some(w) = self.watch {
            self.wait(w)?;
        }
        // read into the buffer's spare capacity as it is (zeroing 64 KiB per read was ~7% of this process's CPU)
        let len = self.buf.len();
        self.buf.reserve(65536);
        let room = self.buf.capacity() - len;
        let n = loop {
            // SAFETY: the kernel writes at most `room` bytes into the spare capacity past `len`, which the
            // vector owns; only the `n` bytes written are then counted as its contents
            let r = unsafe { libc::read(self.s.as_raw_fd(), self.buf.as_mut_ptr().add(len).cast(), room) };
            if r >= 0 {
                break r as usize;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        // SAFETY: `n` <= `room` bytes past `len` were just written by read(2)
        unsafe { self.buf.set_len(len + n) };
        Ok(n > 0)
    }

    /// Until the buffer holds `need` bytes: false at EOF.
    pub fn fill(&mut self, need: usize) -> io::Result<bool> {
        while self.buf.len() < need {
            if !self.more()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Until the buffer holds a whole head: its length (the blank line included), or None at EOF with nothing
    /// read. An error for a head over MAX_HEAD or EOF within one.
    pub fn head(&mut self) -> io::Result<Option<usize>> {
        let mut from = 0;
        loop {
            if let Some(i) = memmem::find(&self.buf[from..], b"\r\n\r\n") {
                return Ok(Some(from + i + 4));
            }
            if self.buf.len() > MAX_HEAD {
                return Err(bad("head too large"));
            }
            from = self.buf.len().saturating_sub(3);
            if !self.more()? {
                return if self.buf.is_empty() { Ok(None) } else { Err(bad("connection closed within a head")) };
            }
        }
    }

    pub fn take(&mut self, n: usize) -> Vec<u8> {
        self.buf.drain(..n).collect()
    }

    pub fn write(&mut self, data: &[u8]) -> io::Result<()> {
        self.s.write_all(data)
    }

    /// `a` then `b` in one system call where the socket takes them (a head and a body, without copying).
    pub fn write2(&mut self, a: &[u8], b: &[u8]) -> io::Result<()> {
        let total = a.len() + b.len();
        let mut done = 0;
        while done < total {
            let r = if done < a.len() {
                self.s.write_vectored(&[io::IoSlice::new(&a[done..]), io::IoSlice::new(b)])
            } else {
                self.s.write(&b[done - a.len()..])
            };
            match r {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "wrote nothing")),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// A parsed head: its first line's three parts and its headers (names as sent).
pub struct Head {
    pub first: [String; 3],
    pub headers: Vec<(String, String)>,
}

impl Head {
    pub fn parse(raw: &[u8]) -> Option<Head> {
        let text = std::str::from_utf8(raw).ok()?;
        let mut lines = text.trim_end_matches("\r\n").split("\r\n");
        let mut parts = lines.next()?.splitn(3, ' ');
        let first = [parts.next()?.to_string(), parts.next()?.to_string(), parts.next().unwrap_or("").to_string()];
        let mut headers = Vec::new();
        for line in lines {
            let (n, v) = line.split_once(':')?;
            if n.is_empty() || n.contains(' ') || n.contains('\t') {
                return None;
            }
            headers.push((n.to_string(), v.trim().to_string()));
        }
        Some(Head { first, headers })
    }

    /// The last value of header `name` (any case).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.headers.iter().rev().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn has(&self, name: &str) -> bool {
        self.headers.iter().any(|(n, _)| n.eq_ignore_ascii_case(name))
    }

    /// How many Content-Length headers, and the value if there is exactly one and it parses.
    pub fn content_length(&self) -> (usize, Option<usize>) {
        let values: Vec<&str> = self
            .headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("content-length"))
            .map(|(_, v)| v.as_str())
            .collect();
        let one = if values.len() == 1 && values[0].bytes().all(|b| b.is_ascii_digit()) && !values[0].is_empty() {
            values[0].parse().ok()
        } else {
            None
        };
        (values.len(), one)
    }

    pub fn chunked(&self) -> bool {
        self.get("transfer-encoding").map_or(false, |v| v.to_ascii_lowercase().contains("chunked"))
    }

    pub fn status(&self) -> Option<u16> {
        self.first[1].parse().ok()
    }

    /// Whether the connection stays open after this message.
    pub fn keep_alive(&self) -> bool {
        let conn = self.get("connection").map(|v| v.to_ascii_lowercase()).unwrap_or_default();
        if self.first[0] == "HTTP/1.0" || self.first[2] == "HTTP/1.0" {
            conn.contains("keep-alive")
        } else {
            !conn.contains("close")
        }
    }
}

/// How a response's body is framed.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Framing {
    None,
    Length(usize),
    Chunked,
    UntilClose,
}

/// A response's framing (RFC 9112 6.3): `head_request`: it answers a HEAD.
pub fn response_framing(head: &Head, head_request: bool) -> io::Result<Framing> {
    let status = head.status().ok_or_else(|| bad("bad status line"))?;
    if head_request || status < 200 || status == 204 || status == 304 {
        return Ok(Framing::None);
    }
    if head.chunked() {
        return Ok(Framing::Chunked);
    }
    match head.content_length() {
        (0, _) => Ok(Framing::UntilClose),
        (_, Some(n)) => Ok(Framing::Length(n)),
        _ => Err(bad("bad content-length")),
    }
}

/// A chunked body's decoder over a Conn: each call gives the next chunk's data, None after the last one (its
/// trailers read and dropped). `raw`, if given, gets the bytes exactly as they were framed.
/// A chunk-size line's size (extensions after `;` ignored), or None if it is not one.
fn chunk_size(line: &[u8]) -> Option<usize> {
    let line = std::str::from_utf8(line).ok()?;
    usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16).ok()
}

/// Whether `next_chunk` would return at once: the buffer holds a whole chunk (or a bad size line, which it
/// reports as soon). A last chunk counts when its blank line is in (trailers are rare enough to wait for).
pub fn chunk_ready(c: &Conn) -> bool {
    let i = match memmem::find(&c.buf, b"\r\n") {
        Some(i) => i,
        None => return false,
    };
    let size = match chunk_size(&c.buf[..i]) {
        Some(n) => n,
        None => return true,
    };
    if size == 0 {
        return c.buf[i..].starts_with(b"\r\n\r\n");
    }
    c.buf.len() >= i + 4 + size
}

pub fn next_chunk(c: &mut Conn, mut raw: Option<&mut Vec<u8>>) -> io::Result<Option<Vec<u8>>> {
    loop {
        if let Some(i) = memmem::find(&c.buf, b"\r\n") {
            let size = chunk_size(&c.buf[..i]).ok_or_else(|| bad("bad chunk size"))?;
            if size == 0 {
                // trailers, then the blank line
                let mut at = i + 2;
                loop {
                    while memmem::find(&c.buf[at..], b"\r\n").is_none() {
                        if !c.more()? {
                            return Err(bad("connection closed within a chunked body"));
                        }
                    }
                    let j = at + memmem::find(&c.buf[at..], b"\r\n").unwrap();
                    let empty = j == at;
                    at = j + 2;
                    if empty {
                        break;
                    }
                }
                let framed = c.take(at);
                if let Some(r) = raw.as_deref_mut() {
                    r.extend_from_slice(&framed);
                }
                return Ok(None);
            }
            if !c.fill(i + 2 + size + 2)? {
                return Err(bad("connection closed within a chunk"));
            }
            if &c.buf[i + 2 + size..i + 4 + size] != b"\r\n" {
                return Err(bad("bad chunk end"));
            }
            let data = c.buf[i + 2..i + 2 + size].to_vec();
            let framed = c.take(i + 4 + size);
            if let Some(r) = raw.as_deref_mut() {
                r.extend_from_slice(&framed);
            }
            return Ok(Some(data));
        }
        if c.buf.len() > MAX_HEAD {
            return Err(bad("bad chunk size line"));
        }
        if !c.more()? {
            return Err(bad("connection closed within a chunked body"));
        }
    }
}

/// A whole body by its framing.
pub fn read_body(c: &mut Conn, framing: Framing) -> io::Result<Vec<u8>> {
    match framing {
        Framing::None => Ok(Vec::new()),
        Framing::Length(n) => {
            if !c.fill(n)? {
                return Err(bad("connection closed within a body"));
            }
            Ok(c.take(n))
        }
        Framing::Chunked => {
            let mut body = Vec::new();
            while let Some(piece) = next_chunk(c, None)? {
                body.extend_from_slice(&piece);
            }
            Ok(body)
        }
        Framing::UntilClose => {
            while c.more()? {}
            Ok(std::mem::take(&mut c.buf))
        }
    }
}

/// One chunk as framed on the wire (nothing for empty data: that would end the body).
pub fn chunk(data: &[u8]) -> Vec<u8> {
    let mut out = format!("{:x}\r\n", data.len()).into_bytes();
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    out
}

/// A response's head lines for the harness: the upstream's, less hop-by-hop and framing headers.
pub fn down_headers(head: &Head) -> Vec<u8> {
    const HOP: [&str; 13] = [
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
        "transfer-encoding", "upgrade", "content-length", "host", "date", "server",
    ];
    let mut out = Vec::new();
    for (n, v) in &head.headers {
        if !HOP.iter().any(|h| n.eq_ignore_ascii_case(h)) {
            out.extend_from_slice(n.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(v.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_heads_and_framing() {
        let h = Head::parse(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            .unwrap();
        assert_eq!(h.status(), Some(200));
        assert_eq!(response_framing(&h, false).unwrap(), Framing::Chunked);
        assert_eq!(response_framing(&h, true).unwrap(), Framing::None);
        let h = Head::parse(b"HTTP/1.1 429 Too Many\r\ncontent-length: 12\r\nConnection: close\r\n\r\n").unwrap();
        assert_eq!(response_framing(&h, false).unwrap(), Framing::Length(12));
        assert!(!h.keep_alive());
        let h = Head::parse(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n").unwrap();
        assert!(response_framing(&h, false).is_err());
        assert!(Head::parse(b"POST / HTTP/1.1\r\nbad header\r\n\r\n").is_none());
        let down = down_headers(&Head::parse(b"HTTP/1.1 200 OK\r\nDate: x\r\nX-Request-Id: 7\r\n\r\n").unwrap());
        assert_eq!(down, b"X-Request-Id: 7\r\n");
    }
}
