//! The HTTP side of `--listen`: `GET /metrics` (Prometheus text format 0.0.4) and `GET /healthz`
//! on hyper's HTTP/1 server, one task per connection on the session's own runtime; for the
//! daemon, `POST /flight-recording[?pid=N]` asks for flight recordings, from the node itself only
//! (a loopback peer, or one at the address it reached the daemon at): a recording writes files
//! on the node, not something for the network to ask.
//!
//! The listener must never cost the trace anything: unbounded, ~20,000 idle connections used up
//! the tracer's file descriptors (no new job could be recorded) and its memory. So at most
//! [`MAX_CONNECTIONS`] are served at once (one more is closed as soon as it is accepted), a
//! request's header must arrive within [`HEADER_WAIT`], and a connection lives at most
//! [`CONNECTION_LIFETIME`] (Prometheus opens a new one when its keep-alive one is gone).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Connections served at once: scrapers are a few; the rest is a client gone wrong.
pub const MAX_CONNECTIONS: usize = 32;
/// How long a client has to send a request's header.
const HEADER_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// How long any connection is kept, however busy.
pub const CONNECTION_LIFETIME: std::time::Duration = std::time::Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error(
        "cannot listen on {addr}: {source} (another process may hold the port: pick another with --listen, \
         e.g. --listen 127.0.0.1:0 for any free one)"
    )]
    Bind { addr: SocketAddr, source: std::io::Error },
}

/// The bound socket, before it serves (so a bad address fails the trace before it starts).
pub struct Listener {
    listener: TcpListener,
    pub addr: SocketAddr,
}

pub async fn bind(addr: SocketAddr) -> Result<Listener, ListenError> {
    let listener = TcpListener::bind(addr).await.map_err(|source| ListenError::Bind { addr, source })?;
    let addr = listener.local_addr().map_err(|source| ListenError::Bind { addr, source })?;
    Ok(Listener { listener, addr })
}

/// Told of each accepted `POST /flight-recording`: the pid asked for, or `None` for every job.
pub type FlightAsk = Arc<dyn Fn(Option<u32>) + Send + Sync>;

impl Listener {
    /// Serves until the runtime ends (the trace's end).
    pub fn serve(self, registry: Registry, flight: Option<FlightAsk>) {
        let registry = Arc::new(registry);
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        tokio::spawn(async move {
            loop {
                // A failed accept (out of descriptors) is the client's loss, not the trace's; the
                // pause keeps a lasting one from spinning.
                let Ok((stream, peer)) = self.listener.accept().await else {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                };
                // Over the bound: closed at once (dropped), so it holds no descriptor.
                let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else { continue };
                let registry = Arc::clone(&registry);
                // From the node itself: a loopback peer, or one at the address it connected to
                // (a process beside the daemon, in its pod, reaching it at the pod's IP).
                let local = stream.local_addr().ok().map(|a| a.ip());
                let flight = flight.clone().filter(|_| peer.ip().is_loopback() || Some(peer.ip()) == local);
                tokio::spawn(async move {
                    let service = service_fn(move |req| answer(req, Arc::clone(&registry), flight.clone()));
                    let connection = hyper::server::conn::http1::Builder::new()
                        .timer(hyper_util::rt::TokioTimer::new())
                        .header_read_timeout(HEADER_WAIT)
                        .serve_connection(TokioIo::new(stream), service);
                    // A client that hangs up mid-answer, or stays too long, ends only its own
                    // connection.
                    let _ = tokio::time::timeout(CONNECTION_LIFETIME, connection).await;
                    drop(slot);
                });
            }
        });
    }
}

fn text(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

const PLAIN: &str = "text/plain; charset=utf-8";

async fn answer(
    req: Request<Incoming>,
    registry: Arc<Registry>,
    flight: Option<FlightAsk>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(match (req.method(), req.uri().path()) {
        (&Method::POST, "/flight-recording") => flight_recording(req.uri().query(), flight.as_ref()),
        (&Method::GET, "/metrics") => {
            let mut body = String::new();
            match prometheus_text::encode(&mut body, &registry) {
                Ok(()) => text(StatusCode::OK, prometheus_text::CONTENT_TYPE, body),
                Err(_) => text(StatusCode::INTERNAL_SERVER_ERROR, PLAIN, "cannot encode the metrics\n".into()),
            }
        }
        (&Method::GET, "/healthz") => text(StatusCode::OK, PLAIN, "ok\n".into()),
        (_, path) => text(StatusCode::NOT_FOUND, PLAIN, format!("no {path} here: GET /metrics or /healthz\n")),
    })
}

/// `POST /flight-recording[?pid=N]`: asked of the daemon, from a loopback address.
fn flight_recording(query: Option<&str>, flight: Option<&FlightAsk>) -> Response<Full<Bytes>> {
    let Some(ask) = flight else {
        return text(
            StatusCode::FORBIDDEN,
            PLAIN,
            "flight recordings are asked for by the daemon's own node: POST from a loopback address\n".into(),
        );
    };
    let pid = match query.map(|q| q.split('&').find_map(|kv| kv.strip_prefix("pid="))) {
        None | Some(None) => None,
        Some(Some(v)) => match v.parse::<u32>() {
            Ok(pid) => Some(pid),
            Err(_) => return text(StatusCode::BAD_REQUEST, PLAIN, format!("pid={v} is not a process id\n")),
        },
    };
    ask(pid);
    let what = pid.map_or("every job".to_owned(), |p| format!("job {p}"));
    text(
        StatusCode::ACCEPTED,
        PLAIN,
        format!("flight recording of {what} asked for: the daemon's log names each folder\n"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read as _, Write as _};

    /// Connections the server holds open on `port`: the kernel's TCP table lists a socket with
    /// its inode once a process has it (accepted), and with inode 0 while it waits in the accept
    /// queue or after it was closed. Counted there, not in this process's descriptors, which the
    /// tests running beside this one change too.
    fn held_by_server(port: u16) -> usize {
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        table
            .lines()
            .skip(1)
            .filter(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let local_port = f[1].rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
                // State 0A is the listening socket itself.
                local_port == Some(port) && f[3] != "0A" && f[9] != "0"
            })
            .count()
    }

    /// A request from a plain blocking client (off the runtime's threads): its whole answer.
    async fn request(addr: SocketAddr, method: &'static str, target: &'static str) -> String {
        tokio::task::spawn_blocking(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            write!(s, "{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                .unwrap();
            let mut text = String::new();
            s.read_to_string(&mut text).unwrap();
            text
        })
        .await
        .unwrap()
    }

    async fn healthz(addr: SocketAddr) -> String {
        request(addr, "GET", "/healthz").await
    }

    async fn post(addr: SocketAddr, target: &'static str) -> String {
        request(addr, "POST", target).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_connections_are_bounded_and_timed_out_and_scrapes_come_back() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.addr;
        listener.serve(Registry::default(), None);
        assert!(healthz(addr).await.ends_with("ok\n"));
        // 300 clients that connect and say nothing (the sweep used 20,000).
        let idle: Vec<std::net::TcpStream> = (0..300).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let held = held_by_server(addr.port());
        assert!(held <= MAX_CONNECTIONS, "{held} connections held for idle clients");
        assert!(held > 0, "the count sees the connections the server took");
        // Past the header wait the idle ones are closed, and a scrape is answered again.
        tokio::time::sleep(HEADER_WAIT + std::time::Duration::from_secs(1)).await;
        let closed = idle
            .iter()
            .filter(|s| {
                s.set_nonblocking(true).unwrap();
                matches!((&**s).read(&mut [0u8; 1]), Ok(0))
            })
            .count();
        assert!(closed >= MAX_CONNECTIONS, "the server closed the idle connections it served ({closed})");
        drop(idle);
        assert!(healthz(addr).await.ends_with("ok\n"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn flight_recordings_are_asked_for_from_loopback_and_a_bad_pid_is_refused() {
        let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = Arc::clone(&asked);
        let ask: FlightAsk = Arc::new(move |pid| sink.lock().unwrap().push(pid));
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.addr;
        listener.serve(Registry::default(), Some(ask));
        assert!(post(addr, "/flight-recording?pid=42").await.starts_with("HTTP/1.1 202"));
        assert!(post(addr, "/flight-recording").await.contains("of every job asked for"));
        let bad = post(addr, "/flight-recording?pid=x").await;
        assert!(bad.starts_with("HTTP/1.1 400") && bad.contains("pid=x is not a process id"), "{bad}");
        assert_eq!(*asked.lock().unwrap(), [Some(42), None]);
        // A server not told to take them (`trace --listen`) refuses.
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.addr;
        listener.serve(Registry::default(), None);
        assert!(post(addr, "/flight-recording").await.starts_with("HTTP/1.1 403"));
    }
}
