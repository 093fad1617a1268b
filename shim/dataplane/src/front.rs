//! The harness-facing side of the shim, compiled: a call on a ticket from its request to its answer.
//!
//! Per request on a harness connection (a thread each, blocking I/O):
//!   - the fast path, when the request is a POST to a known route with a Content-Length body, carries the local
//!     token, is a JSON object with a model, and a ticket the control plane lent covers it (its request bytes and
//!     max_tokens at most the ticket's): the model pinned, the call announced (`begin`), the request sent on
//!     with the real key; a non-stream 200 passed on whole; a stream's head passed on at once and its events held
//!     back until the first content event, then relayed as they arrive; the outcome reported (`end`) with the
//!     events that carry usage, for the control plane to meter, book and record;
//!   - a fast-path attempt that fails in a way that may be retried (a non-200, an unreachable upstream, a body
//!     that broke, a stream that failed before content) is handed to the Python shim as a *resume*: the request
//!     with the failed attempt in `x-evalplane-resume`; the Python shim retries, answers and records the call
//!     (for a stream whose head the harness has, its answer's head is dropped here and its events follow);
//!   - a call no lent ticket covers asks the control plane for one (`ask`): it makes the Valkey round trip the
//!     Python shim's own path would (the budget hold and the pool booking) and answers with a ticket, or with
//!     `no` (a budget or turn cap that refuses it, shutting down), and then the call goes to the Python shim;
//!   - anything else (bad requests, other routes, status, chunked or compressed bodies, Expect) goes to the
//!     Python shim as it came, and its answer back as it came: the Python shim is the reference, and this file
//!     only takes the common case off it.
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::{json, Value};

use crate::http::{
    self, chunk, chunk_ready, client_gone, down_headers, next_chunk, read_body, response_framing, Conn, Framing, Head,
    CLIENT_GONE,
};
use crate::scan;
use crate::sse::{self, Meter};

pub struct Config {
    pub python: SocketAddr,
    pub upstream: String, // host:port
    pub host_header: String,
    pub base_path: String,
    pub model: String,
    pub token: String,
    pub key: String,
    pub secret: String,
    pub max_body: usize,
    pub read_timeout: Duration,
    pub connect_timeout: Duration,
    pub max_stream_buffer: usize,
    pub default_max_out: u64,
}

impl Config {
    pub fn from_json(v: &Value) -> Result<Config, String> {
        let s = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string).ok_or(format!("missing {k}"));
        let n = |k: &str| v.get(k).and_then(|x| x.as_f64()).ok_or(format!("missing {k}"));
        Ok(Config {
            python: s("python")?.parse().map_err(|_| "bad python address".to_string())?,
            upstream: s("upstream")?,
            host_header: s("host_header")?,
            base_path: s("base_path")?,
            model: s("model")?,
            token: s("token")?,
            key: s("key")?,
            secret: s("secret")?,
            max_body: n("max_body_bytes")? as usize,
            read_timeout: Duration::from_secs_f64(n("read_timeout_s")?.max(0.001)),
            connect_timeout: Duration::from_secs_f64(n("connect_timeout_s")?.max(0.001)),
            max_stream_buffer: n("max_stream_buffer_bytes")? as usize,
            default_max_out: n("default_max_out")? as u64,
        })
    }
}

struct Ticket {
    id: String,
    call: String,
    bytes: u64,
    max_out: u64,
    start_at: Instant,
    usable_until: Instant,
    waited_ms: f64, // the pacer wait the control plane already spent on it (an asked ticket booked late)
}

impl Ticket {
    fn from_msg(msg: &Value) -> Ticket {
        let f = |k: &str| msg.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
        let s = |k: &str| msg.get(k).and_then(|v| v.as_str()).unwrap_or("").to_string();
        let now = Instant::now();
        let ttl = Duration::from_secs_f64(f("ttl_ms").max(0.0) / 1000.0);
        Ticket {
            id: s("id"),
            call: s("call"),
            bytes: f("bytes") as u64,
            max_out: f("max_out") as u64,
            start_at: now + Duration::from_secs_f64(f("wait_ms").max(0.0) / 1000.0),
            usable_until: now + ttl.saturating_sub(TICKET_MARGIN),
            waited_ms: f("waited_ms"),
        }
    }
}

/// The messages for the control plane, written by `run` on a thread of its own: a write waits after the first
/// message it carries and takes all that came meanwhile, unless a message is urgent (it goes at once, with those
/// before it). Why the wait: a call's `end` wakes the Python shim, and on a task's one or two vCPUs that was just
/// when the harness, woken by the answer, wanted the CPU (shim/server.py waits likewise before a call's
/// bookkeeping); and while calls overlap, several calls' messages cost the Python shim one wake-up. How long:
/// `batch` if a message is `short` (a lone call's: the Python shim's own wait, finish_delay_s, is the one that
/// counts), else `batch_long` (calls overlap: ShimConfig.end_batch_s). A message that comes while a write waits
/// does not wake the writer (unless it shortens the wait).
pub struct Outbox {
    state: Mutex<Pending>,
    cv: Condvar,
}

struct Pending {
    buf: Vec<u8>,
    urgent: bool,
    short: bool,
    closed: bool,
}

impl Outbox {
    pub fn new() -> Outbox {
        let p = Pending { buf: Vec::new(), urgent: false, short: false, closed: false };
        Outbox { state: Mutex::new(p), cv: Condvar::new() }
    }

    pub fn push(&self, line: &[u8], urgent: bool, short: bool) {
        let mut p = self.state.lock().unwrap();
        if p.closed {
            return;
        }
        let wake = p.buf.is_empty() || (urgent && !p.urgent) || (short && !p.short);
        p.buf.extend_from_slice(line);
        p.urgent |= urgent;
        p.short |= short;
        drop(p);
        if wake {
            self.cv.notify_one();
        }
    }

    /// No more messages: `run` returns once it has written what it has.
    pub fn close(&self) {
        self.state.lock().unwrap().closed = true;
        self.cv.notify_one();
    }

    pub fn run(&self, mut out: UnixStream, batch: Duration, batch_long: Duration) {
        let mut p = self.state.lock().unwrap();
        loop {
            while p.buf.is_empty() && !p.closed {
                p = self.cv.wait(p).unwrap();
            }
            if p.buf.is_empty() {
                return; // closed, all written
            }
            let first = Instant::now();
            while !p.urgent && !p.closed {
                let deadline = first + if p.short { batch } else { batch_long };
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                p = self.cv.wait_timeout(p, left).unwrap().0;
            }
            let buf = std::mem::take(&mut p.buf);
            p.urgent = false;
            p.short = false;
            drop(p);
            if out.write_all(&buf).is_err() {
                self.close();
                return;
            }
            p = self.state.lock().unwrap();
        }
    }
}

pub struct Front {
    cfg: Config,
    model_json: Vec<u8>,
    tickets: Mutex<VecDeque<Ticket>>,
    asks: Mutex<HashMap<u64, mpsc::Sender<Option<Ticket>>>>, // calls waiting for the control plane's answer
    next_ask: AtomicU64,
    control: Arc<Outbox>,
    pub stopping: AtomicBool,
    lost: AtomicBool,
    cutting: AtomicBool,
    ups: Mutex<HashMap<thread::ThreadId, TcpStream>>, // each connection thread's upstream socket (for `cut`)
    pub in_flight: AtomicUsize,
    discover: AtomicBool,
    started: Instant,
    overlap_ms: AtomicU64, // when a call last began beside another (ms after `started`, plus one; 0: never)
}

/// Calls that overlapped within this long count as overlapping: their `end` lines wait the longer batch.
const OVERLAP_MS: u64 = 1000;

/// A ticket is not used in its last second: the control plane gives it back when its time is up.
const TICKET_MARGIN: Duration = Duration::from_secs(1);
/// How long a call waits for the answer to its `ask` before it goes to the Python shim as it came (the control
/// plane answers every ask; this is for one that is stuck).
const ASK_TIMEOUT: Duration = Duration::from_secs(30);

enum Route {
    Messages,
    Chat,
}

/// How a fast-path attempt failed (what the Python shim is told when it takes the call over).
enum Failed {
    Status { status: u16, headers: Vec<(String, String)>, body: Vec<u8> },
    Unreachable(String),
    Body(String),
    StreamEarly { failure: String, meter: Meter },
    StreamError { meter: Meter },
}

fn error_name(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => "TimeoutError".into(),
        io::ErrorKind::ConnectionRefused => "ConnectionRefusedError".into(),
        io::ErrorKind::ConnectionReset => "ConnectionResetError".into(),
        io::ErrorKind::InvalidData => "UpstreamPayloadError".into(),
        _ => "UpstreamError".into(),
    }
}

fn now_s() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// A line of JSON for the control plane, written as it goes: a call's `end` lines, without building a map of
/// values first (that was a fifth of this process's user time in `perf`: allocations, map inserts, formatting).
struct Line(Vec<u8>);

impl Line {
    fn new() -> Line {
        let mut b = Vec::with_capacity(512);
        b.push(b'{');
        Line(b)
    }

    fn key(&mut self, k: &str) -> &mut Vec<u8> {
        if self.0.len() > 1 {
            self.0.push(b',');
        }
        self.0.push(b'"');
        self.0.extend_from_slice(k.as_bytes()); // keys are this file's own: nothing to escape
        self.0.extend_from_slice(b"\":");
        &mut self.0
    }

    /// Any value serde can write (a str, a number, a bool, an Option, a serde_json Value).
    fn val<T: Serialize + ?Sized>(mut self, k: &str, v: &T) -> Line {
        let _ = serde_json::to_writer(self.key(k), v);
        self
    }

    /// `v`: JSON already written (another Line's `done`, less its newline)
    fn raw(mut self, k: &str, v: &[u8]) -> Line {
        self.key(k).extend_from_slice(v);
        self
    }

    fn done(mut self) -> Vec<u8> {
        self.0.push(b'}');
        self.0
    }
}

fn meter_json(m: &Meter) -> Value {
    let usage = if m.saw_usage { Value::Object(m.usage.clone()) } else { Value::Null };
    let error = m.error.as_ref().map(|e| String::from_utf8_lossy(e).into_owned());
    json!({"usage": usage, "error": error, "meaningful": m.meaningful, "done": m.done,
           "delta_tokens": m.delta_tokens, "error_before_content": m.error_before_content})
}

/// Python's `x or y` then `isinstance(x, int) and x > 0` on a JSON value's text (True counts as 1).
fn max_out_of(a: Option<&[u8]>, b: Option<&[u8]>, default: u64) -> u64 {
    let falsy = |v: &[u8]| matches!(v, b"0" | b"null" | b"false" | b"\"\"" | b"[]" | b"{}") || v.starts_with(b"-0");
    let v = match a {
        Some(v) if !falsy(v) => Some(v),
        _ => b,
    };
    match v {
        Some(b"true") => 1,
        Some(v) if !v.is_empty() && v.iter().all(|c| c.is_ascii_digit()) => {
            std::str::from_utf8(v).ok().and_then(|s| s.parse().ok()).filter(|&n| n > 0).unwrap_or(default)
        }
        _ => default,
    }
}

impl Front {
    /// `control`: where messages go (its `run` on a thread of its own writes them).
    pub fn new(cfg: Config, control: Arc<Outbox>) -> Front {
        let model_json = Value::String(cfg.model.clone()).to_string().into_bytes();
        Front {
            cfg,
            model_json,
            tickets: Mutex::new(VecDeque::new()),
            asks: Mutex::new(HashMap::new()),
            next_ask: AtomicU64::new(1),
            control,
            stopping: AtomicBool::new(false),
            lost: AtomicBool::new(false),
            cutting: AtomicBool::new(false),
            ups: Mutex::new(HashMap::new()),
            in_flight: AtomicUsize::new(0),
            discover: AtomicBool::new(true),
            started: Instant::now(),
            overlap_ms: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64 + 1
    }

    /// A call's `end` line (batched: Outbox; the longer wait while calls overlap).
    fn send_end(&self, line: Line) {
        let at = self.overlap_ms.load(Ordering::Relaxed);
        let lone = at == 0 || self.now_ms().saturating_sub(at) > OVERLAP_MS;
        let mut line = line.done();
        line.push(b'\n');
        self.control.push(&line, false, lone);
    }

    /// The start of a call's `end` line: what the control plane is told of the call, and when it ended.
    fn end_line(&self, call: &[u8], t0: Instant, waited: f64) -> Line {
        Line::new().val("t", "end").raw("call", call).val("latency_ms", &(t0.elapsed().as_secs_f64() * 1000.0))
            .val("pacer_wait_ms", &waited)
    }

    fn others_in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed) as u64 - 1
    }

    /// One message to the control plane that goes at once, with those waiting before it.
    pub fn send_now(&self, msg: &Value) {
        self.post(msg, true, true)
    }

    fn post(&self, msg: &Value, urgent: bool, short: bool) {
        let mut line = msg.to_string().into_bytes();
        line.push(b'\n');
        self.control.push(&line, urgent, short);
    }

    /// No more messages: the writer ends once it has written what it has.
    pub fn close(&self) {
        self.control.close();
    }

    /// The control plane is gone: no ask will be answered (the calls waiting go to the Python shim, which is
    /// gone too: they fail as any call to it would).
    pub fn lost(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.lost.store(true, Ordering::SeqCst);
        self.asks.lock().unwrap().clear();
    }

    /// A message from the control plane.
    pub fn on_control(&self, msg: &Value) {
        match msg.get("t").and_then(|t| t.as_str()) {
            Some("ticket") => {
                let t = Ticket::from_msg(msg);
                // an ask's answer goes to the call that asked; one that stopped waiting leaves it to the next call
                if let Some(asker) = msg.get("for").and_then(|v| v.as_u64()) {
                    if let Some(tx) = self.asks.lock().unwrap().remove(&asker) {
                        if let Err(mpsc::SendError(Some(t))) = tx.send(Some(t)) {
                            self.tickets.lock().unwrap().push_back(t);
                        }
                        return;
                    }
                }
                self.tickets.lock().unwrap().push_back(t);
            }
            Some("no") => {
                if let Some(asker) = msg.get("for").and_then(|v| v.as_u64()) {
                    if let Some(tx) = self.asks.lock().unwrap().remove(&asker) {
                        let _ = tx.send(None);
                    }
                }
            }
            Some("recall") => {
                // the control plane takes back those of `ids` not used yet (it gives them back to Valkey); a
                // used one is in a call, whose `end` or resume names it
                let ids: Vec<&str> = msg.get("ids").and_then(|v| v.as_array()).map_or(Vec::new(), |a| {
                    a.iter().filter_map(|v| v.as_str()).collect()
                });
                let mut q = self.tickets.lock().unwrap();
                let mut back = Vec::new();
                q.retain(|t| {
                    let recalled = ids.contains(&t.id.as_str());
                    if recalled {
                        back.push(Value::String(t.id.clone()));
                    }
                    !recalled
                });
                drop(q);
                self.send_now(&json!({"t": "recalled", "ids": back}));
            }
            Some("sync") => {
                // the calls in flight, behind every `end` line waiting in the Outbox (it goes urgent, after them):
                // a call's `end` is queued before it stops counting, so the control plane, once it reads this,
                // has read every call not counted here
                let n = self.in_flight.load(Ordering::SeqCst);
                self.send_now(&json!({"t": "synced", "id": msg.get("id"), "in_flight": n}));
            }
            Some("discover") => self.discover.store(true, Ordering::Relaxed),
            Some("stop") => self.stopping.store(true, Ordering::SeqCst),
            _ => {}
        }
    }

    fn take_ticket(&self) -> Option<Ticket> {
        let mut q = self.tickets.lock().unwrap();
        let now = Instant::now();
        while let Some(t) = q.pop_front() {
            if now < t.usable_until {
                return Some(t);
            }
            // expired here: the control plane gives it back at its time
        }
        None
    }

    /// A ticket for a call of `bytes` and `max_out` from the control plane (`back`: one taken that does not
    /// cover it, for the control plane to give back), or None: the call goes to the Python shim.
    fn ask(&self, bytes: usize, max_out: u64, back: Option<String>) -> Option<Ticket> {
        let id = self.next_ask.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        self.asks.lock().unwrap().insert(id, tx);
        if self.lost.load(Ordering::SeqCst) {
            self.asks.lock().unwrap().remove(&id);
            return None;
        }
        self.send_now(&json!({"t": "ask", "id": id, "bytes": bytes, "max_out": max_out, "back": back}));
        let got = rx.recv_timeout(ASK_TIMEOUT);
        self.asks.lock().unwrap().remove(&id);
        got.ok().flatten()
    }

    /// Shutdown, after the calls in flight had their time: their upstream connections are cut, and each call
    /// reports what it had (its `end`: cut, or cancelled before its answer was committed), as the Python shim's
    /// own calls are cancelled at shutdown.
    pub fn cut(&self) {
        self.cutting.store(true, Ordering::SeqCst);
        for s in self.ups.lock().unwrap().values() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    pub fn serve(self: &Arc<Self>, s: TcpStream) {
        self.serve_conn(s);
        self.ups.lock().unwrap().remove(&thread::current().id());
    }

    fn serve_conn(self: &Arc<Self>, s: TcpStream) {
        let _ = s.set_nodelay(true);
        let mut down = Conn::new(s);
        let mut py: Option<Conn> = None;
        let mut up: Option<Conn> = None;
        loop {
            let n = match down.head() {
                Ok(Some(n)) => n,
                Ok(None) => return,
                Err(_) => return self.tunnel(down), // a head it cannot read: the Python shim answers it
            };
            let head = match Head::parse(&down.buf[..n]) {
                Some(h) => h,
                None => return self.tunnel(down),
            };
            let (count, len) = head.content_length();
            let len = match (count, len) {
                (0, _) => 0,
                (_, Some(len)) => len,
                _ => return self.tunnel(down),
            };
            if head.first[2] != "HTTP/1.1" || head.has("transfer-encoding") || head.has("expect") || len > self.cfg.max_body
            {
                return self.tunnel(down); // framing this file does not do: the rest of the connection is Python's
            }
            match down.fill(n + len) {
                Ok(true) => {}
                _ => return,
            }
            let raw = down.take(n + len);
            let keep = head.keep_alive();
            let t0 = Instant::now();
            let result = match self.fast(&head, &raw[n..]) {
                Some((kind, payload, ticket, max_out, stream)) => {
                    if self.in_flight.fetch_add(1, Ordering::SeqCst) > 0 {
                        self.overlap_ms.store(self.now_ms(), Ordering::Relaxed);
                    }
                    let r =
                        self.call(&mut down, &mut up, &mut py, &head, kind, payload, ticket, max_out, stream, t0);
                    self.in_flight.fetch_sub(1, Ordering::SeqCst);
                    r
                }
                None => self.to_python(&mut down, &mut py, &raw[..n], &raw[n..], "", false, head.first[0] == "HEAD"),
            };
            match result {
                Ok(true) if keep => continue,
                _ => {
                    let _ = down.s.shutdown(Shutdown::Both);
                    return;
                }
            }
        }
    }

    /// Whether the request goes on the fast path: (route, the payload to send, its ticket, max_tokens, stream).
    fn fast(&self, head: &Head, body: &[u8]) -> Option<(Route, Vec<u8>, Ticket, u64, bool)> {
        if head.first[0] != "POST" || self.stopping.load(Ordering::Relaxed) || head.has("content-encoding") {
            return None;
        }
        let kind = match head.first[1].as_str() {
            "/v1/messages" | "/messages" => Route::Messages,
            "/v1/chat/completions" | "/chat/completions" => Route::Chat,
            _ => return None,
        };
        let token = head.get("x-api-key").filter(|t| !t.is_empty()).or_else(|| {
            head.get("authorization")
                .filter(|a| a.len() > 7 && a[..7].eq_ignore_ascii_case("bearer "))
                .map(|a| a[7..].trim())
        });
        if token != Some(self.cfg.token.as_str()) {
            return None;
        }
        let members = scan::members(body)?;
        let last = |name: &str| members.iter().rev().find(|m| m.name == name).map(|m| &body[m.value.clone()]);
        let model = last("model")?;
        if model.first() != Some(&b'"') || model == b"\"\"" {
            return None;
        }
        let stream = last("stream") == Some(b"true");
        let mut inject = false;
        if matches!(kind, Route::Chat) && stream {
            match last("stream_options") {
                None => inject = true,
                Some(so) => {
                    let ok = scan::members(so).map_or(false, |m| {
                        m.iter().rev().find(|m| m.name == "include_usage").map_or(false, |m| {
                            !matches!(&so[m.value.clone()], b"false" | b"null" | b"0" | b"\"\"" | b"[]" | b"{}")
                        })
                    });
                    if !ok {
                        return None;
                    }
                }
            }
        }
        let max_out = max_out_of(last("max_tokens"), last("max_completion_tokens"), self.cfg.default_max_out);
        let models = members.iter().filter(|m| m.name == "model").count();
        let mut payload = if models == 1 && model == self.model_json.as_slice() {
            body.to_vec()
        } else {
            scan::pinned(body, &members, &self.cfg.model)
        };
        if inject {
            let end = payload.iter().rposition(|&b| b == b'}').expect("an object");
            let empty = members.is_empty() && models == 0;
            let member: &[u8] =
                if empty { b"\"stream_options\":{\"include_usage\":true}" } else { b",\"stream_options\":{\"include_usage\":true}" };
            payload.splice(end..end, member.iter().copied());
        }
        let ticket = match self.take_ticket() {
            Some(t) if payload.len() as u64 <= t.bytes && max_out <= t.max_out => t,
            other => self.ask(payload.len(), max_out, other.map(|t| t.id))?,
        };
        Some((kind, payload, ticket, max_out, stream))
    }

    /// The upstream request's head: the harness's headers less hop-by-hop, auth, cookies and encodings, with
    /// the real key (shim/server.py Shim._upstream_headers).
    fn upstream_head(&self, head: &Head, kind: &Route, len: usize) -> Vec<u8> {
        const DROP: [&str; 20] = [
            "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
            "transfer-encoding", "upgrade", "content-length", "host", "date", "server", "authorization", "x-api-key",
            "accept-encoding", "cookie", "content-encoding", "expect", "content-type",
        ];
        let route = match kind {
            Route::Messages => "/v1/messages",
            Route::Chat => "/v1/chat/completions",
        };
        let mut out = format!("POST {}{} HTTP/1.1\r\nHost: {}\r\n", self.cfg.base_path, route, self.cfg.host_header)
            .into_bytes();
        for (n, v) in &head.headers {
            if !DROP.iter().any(|d| n.eq_ignore_ascii_case(d)) {
                out.extend_from_slice(format!("{n}: {v}\r\n").as_bytes());
            }
        }
        out.extend_from_slice(b"Accept-Encoding: identity\r\nContent-Type: application/json\r\n");
        if !self.cfg.key.is_empty() {
            match kind {
                Route::Messages => out.extend_from_slice(format!("x-api-key: {}\r\n", self.cfg.key).as_bytes()),
                Route::Chat => out.extend_from_slice(format!("Authorization: Bearer {}\r\n", self.cfg.key).as_bytes()),
            }
        }
        out.extend_from_slice(format!("Content-Length: {len}\r\n\r\n").as_bytes());
        out
    }

    fn connect_upstream(&self) -> io::Result<Conn> {
        let addr = self
            .cfg
            .upstream
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address"))?;
        let s = TcpStream::connect_timeout(&addr, self.cfg.connect_timeout)?;
        s.set_nodelay(true)?;
        if let Ok(handle) = s.try_clone() {
            self.ups.lock().unwrap().insert(thread::current().id(), handle);
            if self.cutting.load(Ordering::SeqCst) {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        let mut c = Conn::new(s);
        c.set_read_timeout(self.cfg.read_timeout)?;
        Ok(c)
    }

    /// The request sent upstream and the answer's head read (a kept-alive connection that turns out stale is
    /// replaced once).
    fn exchange(&self, up: &mut Option<Conn>, request: &[u8], payload: &[u8]) -> io::Result<(Head, usize)> {
        for fresh in [false, true] {
            let reused = up.is_some() && !fresh;
            if !reused {
                *up = Some(self.connect_upstream()?);
            }
            let c = up.as_mut().unwrap();
            let sent = c.write2(request, payload);
            let got = sent.and_then(|_| c.head());
            match got {
                Ok(Some(n)) => {
                    let head = Head::parse(&c.buf[..n]).ok_or_else(|| http::bad("bad response head"))?;
                    c.buf.drain(..n);
                    return Ok((head, n));
                }
                Ok(None) if reused => continue, // closed while idle
                Err(e) if reused && c.buf.is_empty() && e.kind() != io::ErrorKind::TimedOut
                    && e.kind() != io::ErrorKind::WouldBlock => continue,
                Ok(None) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed before a response")),
                Err(e) => return Err(e),
            }
        }
        unreachable!()
    }

    #[allow(clippy::too_many_arguments)]
    fn call(
        &self,
        down: &mut Conn,
        up: &mut Option<Conn>,
        py: &mut Option<Conn>,
        head: &Head,
        kind: Route,
        payload: Vec<u8>,
        ticket: Ticket,
        max_out: u64,
        stream: bool,
        t0: Instant,
    ) -> io::Result<bool> {
        // what the control plane is told of the call with its outcome (`end`, or a resume)
        let call = Line::new().val("call", &ticket.call).val("ticket", &ticket.id).val("route", &head.first[1])
            .val("kind", &if matches!(kind, Route::Messages) { "messages" } else { "chat" }).val("stream", &stream)
            .val("bytes", &(payload.len() as u64)).val("max_out", &max_out).val("started_at", &now_s()).done();
        let now = Instant::now();
        if ticket.start_at > now {
            thread::sleep(ticket.start_at - now); // the pool's booked slot
        }
        let waited = ticket.waited_ms + (Instant::now() - now).as_secs_f64() * 1000.0;
        let request = self.upstream_head(head, &kind, payload.len());
        let failed = match self.exchange(up, &request, &payload) {
            Err(e) => {
                *up = None;
                Failed::Unreachable(error_name(&e))
            }
            Ok((uh, _)) => {
                let c = up.as_mut().unwrap();
                let reusable = uh.keep_alive();
                let status = uh.status().unwrap_or(0);
                let framing = match response_framing(&uh, false) {
                    Ok(f) => f,
                    Err(e) => {
                        *up = None;
                        return self.resume(down, py, head, &payload, &call, waited, false, Failed::Body(error_name(&e)));
                    }
                };
                let limits = self.rate_limits(&uh);
                if status != 200 {
                    let body = read_body(c, framing);
                    if body.is_err() || !reusable || framing == Framing::UntilClose {
                        *up = None;
                    }
                    Failed::Status { status, headers: uh.headers.clone(), body: body.unwrap_or_default() }
                } else if !stream {
                    match read_body(c, framing) {
                        Err(e) => {
                            *up = None;
                            Failed::Body(error_name(&e))
                        }
                        Ok(body) => {
                            if !reusable || framing == Framing::UntilClose {
                                *up = None;
                            }
                            let mut out = format!("HTTP/1.1 200 OK\r\n").into_bytes();
                            out.extend_from_slice(&down_headers(&uh));
                            out.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
                            out.extend_from_slice(&body);
                            let answered = down.write(&out).is_ok();
                            let usage = scan::members(&body).and_then(|m| {
                                m.iter().rev().find(|m| m.name == "usage").map(|m| {
                                    String::from_utf8_lossy(&body[m.value.clone()]).into_owned()
                                })
                            });
                            self.send_end(self.end_line(&call, t0, waited).val("usage", &usage.as_deref())
                                .val("limits", &limits).val("in_flight", &self.others_in_flight()));
                            return Ok(answered);
                        }
                    }
                } else {
                    let mut out = format!("HTTP/1.1 200 OK\r\n").into_bytes();
                    out.extend_from_slice(&down_headers(&uh));
                    out.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
                    let _ = down.write(&out); // a harness gone is found at the first event's write
                    let k = if matches!(kind, Route::Messages) { sse::ANTHROPIC } else { sse::OPENAI };
                    match self.relay(down, c, framing, k) {
                        Relayed::Early { failure, meter } => {
                            *up = None;
                            Failed::StreamEarly { failure, meter }
                        }
                        Relayed::Error { meter, clean } => {
                            if !clean || !reusable {
                                *up = None;
                            }
                            Failed::StreamError { meter }
                        }
                        Relayed::Committed { meter, outcome, failure, answer_ended, clean } => {
                            if !clean || !reusable {
                                *up = None;
                            }
                            let mut harness_ok = failure.as_deref() != Some(CLIENT_GONE);
                            if !answer_ended && harness_ok {
                                let mut tail = Vec::new();
                                if let Some(f) = failure.as_deref() {
                                    tail = chunk(&sse::error_event(k, f));
                                } else if !meter.done && meter.error.is_none() {
                                    tail = chunk(&sse::error_event(k, "upstream stream ended early"));
                                }
                                tail.extend_from_slice(b"0\r\n\r\n");
                                harness_ok = down.write(&tail).is_ok();
                            }
                            self.send_end(self.end_line(&call, t0, waited).val("meter", &meter_json(&meter))
                                .val("outcome", &outcome).val("failure", &failure.as_deref())
                                .val("limits", &limits).val("in_flight", &self.others_in_flight()));
                            return Ok(harness_ok);
                        }
                    }
                }
            }
        };
        if self.cutting.load(Ordering::SeqCst) {
            let meter = match &failed {
                Failed::StreamEarly { meter, .. } | Failed::StreamError { meter } => meter_json(meter),
                _ => Value::Null,
            };
            self.send_end(self.end_line(&call, t0, waited).val("cancelled", &true).val("meter", &meter)
                .val("in_flight", &self.others_in_flight()));
            return Ok(false);
        }
        let head_sent = stream && matches!(failed, Failed::StreamEarly { .. } | Failed::StreamError { .. });
        self.resume(down, py, head, &payload, &call, waited, head_sent, failed)
    }

    /// Rate-limit headers, at most once a minute (or on a 429) as the control plane asks.
    fn rate_limits(&self, h: &Head) -> Value {
        let due = h.status() == Some(429) || self.discover.swap(false, Ordering::Relaxed);
        if !due {
            return Value::Null;
        }
        let found: Vec<Value> = h
            .headers
            .iter()
            .filter(|(n, _)| {
                let n = n.to_ascii_lowercase();
                n.starts_with("x-ratelimit-") || n.starts_with("anthropic-ratelimit-") || n.contains("retry-after")
            })
            .map(|(n, v)| json!([n, v]))
            .collect();
        Value::Array(found)
    }

    /// A stream held back until its first content event, then relayed as it arrives. A stream that is not
    /// chunked (rare: a provider streams chunked) is read whole and taken as one piece.
    fn relay(&self, down: &mut Conn, up: &mut Conn, framing: Framing, kind: u8) -> Relayed {
        up.watch = Some(down.s.as_raw_fd()); // the harness leaving ends the wait for the next event
        let r = self.relay_events(down, up, framing, kind);
        up.watch = None;
        r
    }

    fn relay_events(&self, down: &mut Conn, up: &mut Conn, framing: Framing, kind: u8) -> Relayed {
        let mut meter = Meter::new(kind);
        let mut held: Vec<u8> = Vec::new();
        let mut committed = false;
        let mut answer_ended = false;
        let mut whole = None;
        let mut out: Vec<u8> = Vec::new(); // for the harness: events already read go together (one write)
        if framing != Framing::Chunked {
            match read_body(up, framing) {
                Ok(body) => whole = Some(body),
                Err(e) => return self.broke(meter, false, false, &e),
            }
        }
        loop {
            let piece = if framing == Framing::Chunked { next_chunk(up, None) } else { Ok(whole.take()) };
            let piece = match piece {
                Ok(Some(p)) => p,
                Ok(None) => {
                    let clean = framing != Framing::UntilClose;
                    return self.ended(meter, committed, answer_ended, clean);
                }
                Err(e) => return self.broke(meter, committed, answer_ended, &e),
            };
            meter.feed(&piece);
            if answer_ended {
                continue; // read for the meter only
            }
            let data = if committed {
                piece
            } else {
                held.extend_from_slice(&piece);
                if meter.error_before_content && meter.retryable_error() {
                    let clean = framing == Framing::Chunked && self.drain(up);
                    return Relayed::Error { meter, clean };
                }
                if !(meter.error_before_content || meter.meaningful || meter.done || held.len() > self.cfg.max_stream_buffer)
                {
                    continue;
                }
                committed = true;
                std::mem::take(&mut held)
            };
            out.extend_from_slice(&chunk(&data));
            let last = meter.done || meter.error.is_some();
            if last {
                out.extend_from_slice(b"0\r\n\r\n"); // the final or error event ends the answer
            } else if framing == Framing::Chunked && chunk_ready(up) {
                continue; // the next event is here already: it goes with this one
            }
            let written = down.write(&out);
            out.clear();
            if written.is_err() {
                // the harness went away: stop reading (the provider stops), meter what came
                let failure = Some(CLIENT_GONE.to_string());
                return Relayed::Committed { meter, outcome: "cut".into(), failure, answer_ended, clean: false };
            }
            answer_ended = last;
            if last {
                up.watch = None; // the harness has its answer: it may go, the rest is read for the meter
            }
        }
    }

    fn ended(&self, meter: Meter, committed: bool, answer_ended: bool, clean: bool) -> Relayed {
        if !committed {
            return Relayed::Early { failure: "upstream stream ended before any content".into(), meter };
        }
        let (outcome, failure) = if answer_ended {
            ("ended", None)
        } else {
            ("cut", Some("upstream stream ended early".to_string()))
        };
        Relayed::Committed { meter, outcome: outcome.into(), failure, answer_ended, clean }
    }

    fn broke(&self, meter: Meter, committed: bool, answer_ended: bool, e: &io::Error) -> Relayed {
        if client_gone(e) {
            // the harness went away while the stream was waited for: stop reading, meter what came
            let failure = Some(CLIENT_GONE.to_string());
            return Relayed::Committed { meter, outcome: "cut".into(), failure, answer_ended, clean: false };
        }
        let failure = format!("upstream stream failed: {}", error_name(e));
        if !committed {
            return Relayed::Early { failure, meter };
        }
        if answer_ended {
            // the harness has the whole answer; the rest was read for the meter only
            return Relayed::Committed { meter, outcome: "ended".into(), failure: None, answer_ended, clean: false };
        }
        Relayed::Committed { meter, outcome: "cut".into(), failure: Some(failure), answer_ended, clean: false }
    }

    /// Reads the rest of a chunked body (to keep the connection): whether it ended cleanly.
    fn drain(&self, up: &mut Conn) -> bool {
        loop {
            match next_chunk(up, None) {
                Ok(Some(_)) => continue,
                Ok(None) => return true,
                Err(_) => return false,
            }
        }
    }

    /// The call handed to the Python shim after a fast-path attempt failed: it retries, answers, records.
    #[allow(clippy::too_many_arguments)]
    fn resume(
        &self,
        down: &mut Conn,
        py: &mut Option<Conn>,
        head: &Head,
        payload: &[u8],
        call: &[u8],
        waited: f64,
        head_sent: bool,
        failed: Failed,
    ) -> io::Result<bool> {
        let attempt = match failed {
            Failed::Status { status, headers, body } => {
                let h: Vec<Value> = headers.iter().map(|(n, v)| json!([n, v])).collect();
                json!({"how": "status", "status": status, "headers": h, "body": String::from_utf8_lossy(&body)})
            }
            Failed::Unreachable(name) => json!({"how": "unreachable", "error": name}),
            Failed::Body(name) => json!({"how": "body", "error": name}),
            Failed::StreamEarly { failure, meter } => {
                json!({"how": "stream_early", "failure": failure, "meter": meter_json(&meter)})
            }
            Failed::StreamError { meter } => json!({"how": "stream_error", "meter": meter_json(&meter)}),
        };
        let call: Value = serde_json::from_slice(call).unwrap_or(Value::Null);
        let info = json!({"secret": self.cfg.secret, "call": call, "pacer_wait_ms": waited, "head_sent": head_sent,
                          "attempt": attempt});
        let mut rhead = format!("{} {} {}\r\n", head.first[0], head.first[1], head.first[2]).into_bytes();
        for (n, v) in &head.headers {
            if !n.eq_ignore_ascii_case("content-length") {
                rhead.extend_from_slice(format!("{n}: {v}\r\n").as_bytes());
            }
        }
        rhead.extend_from_slice(format!("Content-Length: {}\r\n\r\n", payload.len()).as_bytes());
        let extra = format!("x-evalplane-resume: {info}\r\n");
        self.to_python(down, py, &rhead, payload, &extra, head_sent, false)
    }

    fn connect_python(&self) -> io::Result<Conn> {
        let s = TcpStream::connect(self.cfg.python)?;
        s.set_nodelay(true)?;
        Ok(Conn::new(s))
    }

    /// A request sent to the Python shim as it came (`extra` header lines added), and its answer passed back as
    /// it arrives (`strip_head`: less its head, which the harness already has). Whether the harness connection
    /// can take another request.
    #[allow(clippy::too_many_arguments)]
    fn to_python(
        &self,
        down: &mut Conn,
        py: &mut Option<Conn>,
        head: &[u8],
        body: &[u8],
        extra: &str,
        strip_head: bool,
        head_request: bool,
    ) -> io::Result<bool> {
        let mut request = head[..head.len() - 2].to_vec();
        request.extend_from_slice(extra.as_bytes());
        request.extend_from_slice(b"\r\n");
        request.extend_from_slice(body);
        let mut n = 0;
        for fresh in [false, true] {
            let reused = py.is_some() && !fresh;
            if !reused {
                *py = Some(self.connect_python()?);
            }
            let c = py.as_mut().unwrap();
            match c.s.write_all(&request).and_then(|_| c.head()) {
                Ok(Some(len)) => {
                    n = len;
                    break;
                }
                Ok(None) | Err(_) if reused && c.buf.is_empty() => continue,
                Ok(None) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "python closed")),
                Err(e) => return Err(e),
            }
        }
        let c = py.as_mut().unwrap();
        c.watch = Some(down.s.as_raw_fd()); // the harness leaving closes this connection: Python sees it at once
        let r = Self::pass_back(down, c, n, strip_head, head_request);
        c.watch = None;
        if !matches!(r, Ok(true)) {
            *py = None;
        }
        r
    }

    /// A response read from `c` (its head `n` bytes long) passed to the harness as it arrives. Whether the
    /// harness connection can take another request.
    fn pass_back(down: &mut Conn, c: &mut Conn, n: usize, strip_head: bool, head_request: bool) -> io::Result<bool> {
        let ph = Head::parse(&c.buf[..n]).ok_or_else(|| http::bad("bad head from python"))?;
        let framing = response_framing(&ph, head_request)?;
        let raw_head = c.take(n);
        if !strip_head {
            down.write(&raw_head)?;
        }
        match framing {
            Framing::None => {}
            Framing::Length(mut left) => {
                while left > 0 {
                    if c.buf.is_empty() && !c.more()? {
                        return Err(http::bad("python closed within a body"));
                    }
                    let k = c.buf.len().min(left);
                    let data = c.take(k);
                    down.write(&data)?;
                    left -= k;
                }
            }
            Framing::Chunked => {
                let mut raw = Vec::new();
                loop {
                    raw.clear();
                    let more = next_chunk(c, Some(&mut raw))?;
                    down.write(&raw)?;
                    if more.is_none() {
                        break;
                    }
                }
            }
            Framing::UntilClose => {
                down.write(&std::mem::take(&mut c.buf))?;
                while c.more()? {
                    down.write(&std::mem::take(&mut c.buf))?;
                }
                return Ok(false);
            }
        }
        Ok(ph.keep_alive())
    }

    /// The rest of a connection relayed to the Python shim byte for byte, both ways (what was read of it first).
    fn tunnel(&self, down: Conn) {
        let mut py = match TcpStream::connect(self.cfg.python) {
            Ok(s) => s,
            Err(_) => return,
        };
        let _ = py.set_nodelay(true);
        if py.write_all(&down.buf).is_err() {
            return;
        }
        let (mut d_read, mut p_write) = match (down.s.try_clone(), py.try_clone()) {
            (Ok(a), Ok(b)) => (a, b),
            _ => return,
        };
        let upward = thread::spawn(move || {
            let _ = io::copy(&mut d_read, &mut p_write);
            let _ = p_write.shutdown(Shutdown::Write);
        });
        let mut d_write = down.s;
        let mut buf = vec![0u8; 65536];
        loop {
            match py.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if d_write.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = d_write.shutdown(Shutdown::Both);
        let _ = upward.join();
    }
}

enum Relayed {
    /// failed before any content: retried by the Python shim
    Early { failure: String, meter: Meter },
    /// an error event worth retrying before any content
    Error { meter: Meter, clean: bool },
    /// the harness has (some of) the answer
    Committed { meter: Meter, outcome: String, failure: Option<String>, answer_ended: bool, clean: bool },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_out_as_python() {
        assert_eq!(max_out_of(Some(b"100"), None, 7), 100);
        assert_eq!(max_out_of(Some(b"0"), Some(b"50"), 7), 50);
        assert_eq!(max_out_of(Some(b"null"), None, 7), 7);
        assert_eq!(max_out_of(Some(b"1.5"), None, 7), 7);
        assert_eq!(max_out_of(Some(b"true"), None, 7), 1);
        assert_eq!(max_out_of(Some(b"-3"), None, 7), 7);
        assert_eq!(max_out_of(None, None, 7), 7);
    }

    #[test]
    fn a_line_is_the_json_a_map_would_have_made() {
        let call = Line::new().val("call", "c\"1\\\n").val("stream", &true).val("bytes", &12).done();
        let line = Line::new().val("t", "end").raw("call", &call).val("latency_ms", &1.25).val("usage", &None::<&str>)
            .val("failure", &Some("cut \u{1}")).val("limits", &Value::Null).done();
        let got: Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(got, json!({"t": "end", "call": {"call": "c\"1\\\n", "stream": true, "bytes": 12},
                               "latency_ms": 1.25, "usage": null, "failure": "cut \u{1}", "limits": null}));
    }

    #[test]
    fn an_outbox_waits_the_long_batch_unless_a_line_is_short_or_urgent() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        theirs.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let outbox = Arc::new(Outbox::new());
        let o = Arc::clone(&outbox);
        let writer = thread::spawn(move || o.run(ours, Duration::from_millis(1), Duration::from_secs(60)));
        let mut lines = std::io::BufReader::new(theirs);
        let mut got = String::new();
        outbox.push(b"long\n", false, false); // would wait a minute alone
        thread::sleep(Duration::from_millis(50));
        outbox.push(b"short\n", false, true); // a lone call's: the wait is the short one again
        let t = Instant::now();
        std::io::BufRead::read_line(&mut lines, &mut got).unwrap();
        std::io::BufRead::read_line(&mut lines, &mut got).unwrap();
        assert_eq!(got, "long\nshort\n");
        assert!(t.elapsed() < Duration::from_secs(5));
        outbox.push(b"long\n", false, false);
        outbox.push(b"ask\n", true, true);
        got.clear();
        std::io::BufRead::read_line(&mut lines, &mut got).unwrap();
        std::io::BufRead::read_line(&mut lines, &mut got).unwrap();
        assert_eq!(got, "long\nask\n");
        outbox.close();
        writer.join().unwrap();
    }
}
