//! The HTTP side of `--listen`: `GET /metrics` (Prometheus text format 0.0.4) and `GET /healthz`
//! on hyper's HTTP/1 server, one task per connection on the session's own runtime.

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

impl Listener {
    /// Serves until the runtime ends (the trace's end).
    pub fn serve(self, registry: Registry) {
        let registry = Arc::new(registry);
        tokio::spawn(async move {
            loop {
                // A failed accept (out of descriptors) is the client's loss, not the trace's; the
                // pause keeps a lasting one from spinning.
                let Ok((stream, _)) = self.listener.accept().await else {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                };
                let registry = Arc::clone(&registry);
                tokio::spawn(async move {
                    let service = service_fn(move |req| answer(req, Arc::clone(&registry)));
                    // A client that hangs up mid-answer ends only its own connection.
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
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

async fn answer(req: Request<Incoming>, registry: Arc<Registry>) -> Result<Response<Full<Bytes>>, Infallible> {
    const PLAIN: &str = "text/plain; charset=utf-8";
    Ok(match (req.method(), req.uri().path()) {
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
