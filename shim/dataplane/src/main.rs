//! The shim's data plane, compiled: started by the Python shim (shim/front.py), which is its control plane.
//!
//!     shim_dataplane --control-fd N   (N: a Unix socket to the control plane, inherited)
//!
//! The control plane writes one line of JSON first: the config (listen address, the Python shim's own address,
//! upstream, model, the local token, the real key: never on the command line or in the environment). This
//! process answers {"t":"ready","port":N} once it listens, then takes `ticket`, `no`, `recall`, `discover` and
//! `stop` lines, and writes `ask`, `end`, `recalled` and `bye` lines (front.rs). It exits when told to stop (after the calls
//! in flight, up to `shutdown_timeout_s`) or when the control plane goes away.
use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::os::unix::io::FromRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

mod front;
mod http;
mod scan;
mod sse;

fn fail(why: &str) -> ! {
    eprintln!("shim_dataplane: {why}");
    std::process::exit(2)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let fd: i32 = match args.as_slice() {
        [_, flag, n] if flag == "--control-fd" => n.parse().unwrap_or_else(|_| fail("--control-fd takes a number")),
        _ => fail("usage: shim_dataplane --control-fd N"),
    };
    // SAFETY: the fd is the control socket the parent passed for this (its only use)
    let control = unsafe { UnixStream::from_raw_fd(fd) };
    let mut lines = BufReader::new(control.try_clone().unwrap_or_else(|_| fail("no control socket on that fd")));
    let mut first = String::new();
    if lines.read_line(&mut first).unwrap_or(0) == 0 {
        fail("no config on the control socket");
    }
    let v: serde_json::Value = serde_json::from_str(&first).unwrap_or_else(|_| fail("config is not JSON"));
    let cfg = front::Config::from_json(&v).unwrap_or_else(|e| fail(&e));
    let host = v.get("listen_host").and_then(|h| h.as_str()).unwrap_or("127.0.0.1").to_string();
    let port = v.get("listen_port").and_then(|p| p.as_u64()).unwrap_or(0) as u16;
    let shutdown = Duration::from_secs_f64(v.get("shutdown_timeout_s").and_then(|s| s.as_f64()).unwrap_or(5.0));
    let listener = TcpListener::bind((host.as_str(), port)).unwrap_or_else(|e| fail(&format!("cannot listen: {e}")));
    let addr = listener.local_addr().unwrap_or_else(|e| fail(&format!("no local address: {e}")));
    let secs = |k: &str, or: f64| Duration::from_secs_f64(v.get(k).and_then(|s| s.as_f64()).unwrap_or(or).max(0.0));
    let batch = secs("batch_s", 0.0);
    let batch_long = secs("batch_long_s", batch.as_secs_f64());
    let outbox = Arc::new(front::Outbox::new());
    let out = Arc::clone(&outbox);
    let writer = thread::spawn(move || out.run(control, batch, batch_long));
    let front = Arc::new(front::Front::new(cfg, outbox));
    front.send_now(&serde_json::json!({"t": "ready", "port": addr.port()}));

    // the control plane's lines; its going away ends this process too
    let f = Arc::clone(&front);
    thread::spawn(move || {
        let mut line = String::new();
        loop {
            line.clear();
            match lines.read_line(&mut line) {
                Ok(0) | Err(_) => {
                    f.lost();
                    let _ = TcpStream::connect(addr); // wakes the accept loop
                    return;
                }
                Ok(_) => {
                    if let Ok(msg) = serde_json::from_str::<serde_json::Value>(&line) {
                        let stop = msg.get("t").and_then(|t| t.as_str()) == Some("stop");
                        f.on_control(&msg);
                        if stop {
                            let _ = TcpStream::connect(addr);
                        }
                    }
                }
            }
        }
    });

    for conn in listener.incoming() {
        if front.stopping.load(Ordering::SeqCst) {
            break;
        }
        if let Ok(s) = conn {
            let f = Arc::clone(&front);
            thread::spawn(move || f.serve(s));
        }
    }
    drop(listener);
    // the calls in flight finish (their `end` lines written), up to the timeout; then they are cut, and report
    // what they had; idle connections close with us
    let wait = |until: Instant| {
        while front.in_flight.load(Ordering::SeqCst) > 0 && Instant::now() < until {
            thread::sleep(Duration::from_millis(5));
        }
    };
    wait(Instant::now() + shutdown);
    if front.in_flight.load(Ordering::SeqCst) > 0 {
        front.cut();
        wait(Instant::now() + Duration::from_secs(1));
    }
    front.send_now(&serde_json::json!({"t": "bye", "in_flight": front.in_flight.load(Ordering::SeqCst)}));
    front.close();
    let _ = writer.join(); // what it has is written
    std::process::exit(0)
}
