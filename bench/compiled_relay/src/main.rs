//! bench/tcp_relay.py compiled: a TCP relay, a thread per direction of each connection, std I/O.
//!
//!     compiled_relay UPSTREAM_HOST UPSTREAM_PORT [--pin MODEL | --scan-pin MODEL]   (prints its port)
//!
//! Bare: bytes in, bytes out, no parsing. --pin MODEL: each request is read whole (head, Content-Length body),
//! its body parsed as a JSON object (serde_json; the top-level values kept as raw text, every one of them checked
//! as JSON), written again with "model" first and set to MODEL (every "model" key the request had, however
//! spelled, left out) and sent on with its new Content-Length; responses pass through as bytes. A body that is
//! not a JSON object closes the connection. --scan-pin MODEL: the same, with the body checked and split by
//! `scan::members` (strings skipped with memchr) instead of serde_json: what a scanner made for this costs.
//!
//! Why: bench_shim.py prints the Python relays' added latency as floors for the shim; this one says how much of
//! such a floor is the interpreter, i.e. what a compiled shim could reach on the same machine.
use std::borrow::Cow;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::thread;

use memchr::memmem::find;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

mod dataplane;
mod scan;

/// A JSON object's members in order, each value as its raw text.
struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut m: M) -> Result<Members<'de>, M::Error> {
                let mut out = Vec::new();
                while let Some(member) = m.next_entry::<Cow<'de, str>, &'de RawValue>()? {
                    out.push(member);
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// A request head's Content-Length: (its value, where its header line starts and ends in the head).
fn content_length(head: &[u8]) -> Option<(usize, usize, usize)> {
    let start = find(&head.to_ascii_lowercase(), b"\r\ncontent-length:")? + 2;
    let end = find(&head[start..], b"\r\n").map_or(head.len(), |j| start + j);
    let value = std::str::from_utf8(&head[start + 15..end]).ok()?.trim().parse().ok()?;
    Some((value, start, end))
}

/// The body with its model pinned, or None if it is not a JSON object.
fn pinned(body: &[u8], model: &str) -> Option<Vec<u8>> {
    let members: Members = serde_json::from_slice(body).ok()?;
    let mut out = Vec::with_capacity(body.len() + model.len() + 16);
    out.extend_from_slice(b"{\"model\":");
    serde_json::to_writer(&mut out, model).ok()?;
    for (key, value) in members.0.iter().filter(|(k, _)| k != "model") {
        out.push(b',');
        serde_json::to_writer(&mut out, key).ok()?;
        out.push(b':');
        out.extend_from_slice(value.get().as_bytes());
    }
    out.push(b'}');
    Some(out)
}

/// `pinned`, with the body checked and split by the scanner.
fn scan_pinned(body: &[u8], model: &str) -> Option<Vec<u8>> {
    Some(scan::pinned(body, &scan::members(body)?, model))
}

/// Requests from the harness, each pinned and sent on once it is whole.
fn pin_requests(mut down: TcpStream, mut up: TcpStream, model: &str, scanner: bool) {
    let mut buf: Vec<u8> = Vec::with_capacity(256 * 1024);
    let mut chunk = vec![0u8; 256 * 1024];
    'read: loop {
        let n = match down.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        while let Some(end) = find(&buf, b"\r\n\r\n") {
            let cl = content_length(&buf[..end]);
            let size = cl.map_or(0, |c| c.0);
            if buf.len() < end + 4 + size {
                break;
            }
            let request = &buf[end + 4..end + 4 + size];
            let body = match if scanner {
                scan_pinned(request, model)
            } else {
                pinned(request, model)
            } {
                Some(body) => body,
                None => break 'read,
            };
            let mut out = Vec::with_capacity(end + 64 + body.len());
            match cl {
                Some((_, s, e)) => {
                    out.extend_from_slice(&buf[..s]);
                    out.extend_from_slice(format!("Content-Length: {}", body.len()).as_bytes());
                    out.extend_from_slice(&buf[e..end + 4]);
                }
                None => out.extend_from_slice(&buf[..end + 4]),
            }
            out.extend_from_slice(&body);
            if up.write_all(&out).is_err() {
                break 'read;
            }
            buf.drain(..end + 4 + size);
        }
    }
    let _ = up.shutdown(Shutdown::Both);
    let _ = down.shutdown(Shutdown::Both);
}

fn copy(mut from: TcpStream, mut to: TcpStream) {
    let mut chunk = vec![0u8; 256 * 1024];
    loop {
        let n = match from.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&chunk[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

fn serve(down: TcpStream, upstream: &str, pin: Option<(&str, bool)>) -> std::io::Result<()> {
    let up = TcpStream::connect(upstream)?;
    down.set_nodelay(true)?; // as uvloop's transports (bench/tcp_relay.py) and the shim's
    up.set_nodelay(true)?;
    let (down2, up2) = (down.try_clone()?, up.try_clone()?);
    thread::spawn(move || copy(up2, down2));
    match pin {
        Some((model, scanner)) => pin_requests(down, up, model, scanner),
        None => copy(down, up),
    }
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: compiled_relay UPSTREAM_HOST UPSTREAM_PORT [--pin MODEL | --scan-pin MODEL]");
        std::process::exit(2);
    }
    let upstream = format!("{}:{}", args[1], args[2]);
    if let Some(i) = args.iter().position(|a| a == "--dataplane") {
        match (args.get(i + 1).cloned(), args.get(i + 2).cloned()) {
            (Some(model), Some(token)) => return dataplane_main(upstream, model, token),
            _ => {
                eprintln!("usage: compiled_relay UPSTREAM_HOST UPSTREAM_PORT --dataplane MODEL LOCAL_TOKEN");
                std::process::exit(2);
            }
        }
    }
    let pin = args
        .iter()
        .position(|a| a == "--pin" || a == "--scan-pin")
        .and_then(|i| Some((args.get(i + 1)?.clone(), args[i] == "--scan-pin")));
    listen(move |down| serve(down, &upstream, pin.as_ref().map(|(m, s)| (m.as_str(), *s))));
}

/// Listens on a free loopback port, prints it, and runs `handle` on each connection in a thread of its own.
fn listen(handle: impl Fn(TcpStream) -> std::io::Result<()> + Send + Sync + 'static) {
    let handle = std::sync::Arc::new(handle);
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
    println!("{}", listener.local_addr().expect("local address").port());
    for down in listener.incoming().flatten() {
        let handle = handle.clone();
        thread::spawn(move || {
            if let Err(e) = handle(down) {
                eprintln!("compiled_relay: {e}");
            }
        });
    }
}

/// --dataplane MODEL LOCAL_TOKEN: the data plane prototype (src/dataplane.rs), a thread per harness connection.
fn dataplane_main(upstream: String, model: String, token: String) {
    let key = std::env::var("DATAPLANE_UPSTREAM_KEY").unwrap_or_default();
    let records = std::env::var_os("DATAPLANE_RECORDS").map(|p| {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .expect("DATAPLANE_RECORDS");
        std::sync::Mutex::new(file)
    });
    let plane = dataplane::DataPlane {
        upstream,
        model,
        token,
        key,
        records,
    };
    listen(move |down| plane.serve(down));
}
