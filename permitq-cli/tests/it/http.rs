//! A minimal blocking HTTP/1.1 client for the tests (one request per connection), enough for
//! the status server and chromedriver's WebDriver endpoints.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStderr, Command, Stdio};
use std::time::Duration;

/// Sends one request; returns (status, body).
pub(crate) fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, String) {
    let (status, _, body) = request_with(addr, method, path, body, &[]);
    (status, body)
}

/// `GET path` with extra header lines (`Authorization: Bearer x`); (status, head, body).
pub(crate) fn get_with(addr: SocketAddr, path: &str, headers: &[&str]) -> (u16, String, String) {
    request_with(addr, "GET", path, None, headers)
}

/// Sends one request with extra header lines; returns (status, head, body).
fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[&str],
) -> (u16, String, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let body = body.unwrap_or("");
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{extra}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Read the head, then exactly the body (some servers keep the connection open anyway).
    let mut reader = BufReader::new(stream);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "connection closed mid-head"
        );
        if line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status code");
    let header = |name: &str| {
        head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    };
    let body = if let Some(length) = header("content-length") {
        let mut body = vec![0u8; length.parse().expect("a length")];
        reader.read_exact(&mut body).unwrap();
        body
    } else if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        let mut raw = Vec::new();
        reader.read_to_end(&mut raw).unwrap();
        unchunk(&String::from_utf8_lossy(&raw)).into_bytes()
    } else {
        let mut raw = Vec::new();
        reader.read_to_end(&mut raw).unwrap();
        raw
    };
    (status, head, String::from_utf8_lossy(&body).to_string())
}

fn unchunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// `GET path`; (status, body).
pub(crate) fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    request(addr, "GET", path, None)
}

/// [`get`] from async code: on a blocking thread, so that the runtime's workers keep serving.
pub(crate) async fn get_async(addr: SocketAddr, path: &'static str) -> (u16, String) {
    tokio::task::spawn_blocking(move || get(addr, path))
        .await
        .expect("the GET thread panicked")
}

/// Starts `permitq <args>` (which must print `serving http://ADDR/` on stderr) and returns the
/// process and the address it bound. The rest of its stderr is drained on a thread.
#[allow(
    clippy::zombie_processes,
    reason = "the caller owns the child and waits for it"
)]
pub(crate) fn spawn_server(url: &str, args: &[&str]) -> (Server, SocketAddr) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_permitq"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "permitq=info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn permitq");
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        if stderr.read_line(&mut line).unwrap_or(0) == 0 {
            let status = child.wait();
            panic!("permitq exited before serving: {status:?}");
        }
        if let Some(rest) = line.split("serving http://").nth(1) {
            let addr = rest
                .trim()
                .trim_end_matches('/')
                .split_whitespace()
                .next()
                .unwrap();
            let addr = addr.trim_end_matches('/').parse().expect("an address");
            let rest = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
            let kept = rest.clone();
            std::thread::spawn(move || drain(stderr, &kept));
            return (Server(child, rest), addr);
        }
    }
}

/// A spawned `permitq serve` or `worker`: killed when dropped, so a failing test leaves no
/// server behind. Keeps what it writes on stderr after its `serving` line.
pub(crate) struct Server(Child, std::sync::Arc<std::sync::Mutex<String>>);

impl Server {
    /// What the server wrote on stderr after its `serving` line, so far.
    pub(crate) fn stderr_after_serving(&self) -> String {
        self.1.lock().unwrap().clone()
    }
}

impl std::ops::Deref for Server {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Server {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn drain(mut stderr: BufReader<ChildStderr>, kept: &std::sync::Mutex<String>) {
    let mut line = Vec::new();
    while stderr.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
        let mut kept = kept.lock().unwrap();
        // Bounded: a long-running server's debug log is not kept whole.
        if kept.len() < 1 << 20 {
            kept.push_str(&String::from_utf8_lossy(&line));
        }
        line.clear();
    }
}
