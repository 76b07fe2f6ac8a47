//! The HTTP layer under the API: the accept loop (HTTP/1 with a header-read timeout),
//! the loading phase (the port answers before the model is loaded), one log line per
//! request, JSON bodies for every error status (axum's own 405 and 413 included), and CORS.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tower::ServiceExt;
use tower_http::cors::{AllowOrigin, Any, CorsLayer};

use crate::error::ApiError;

/// How long a client may take to send a request's headers.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a streaming response waits for a client that stopped reading before it
/// cancels the generation.
pub const STALLED_CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Token counts a handler reports for the request's log line (a response extension).
#[derive(Debug, Default)]
pub struct TokenCounts {
    pub prompt: AtomicUsize,
    pub completion: AtomicUsize,
}

/// The application, set once the model is loaded; until then every route answers 503
/// (`/health` with `{"status": "loading"}`).
pub type AppSlot = Arc<OnceLock<Router>>;

/// Serves `app` on `listener` until `shutdown` resolves: HTTP/1 connections, each with a
/// [`HEADER_READ_TIMEOUT`].
pub async fn serve_slot(
    listener: tokio::net::TcpListener,
    app: AppSlot,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                // Out of file descriptors and the like: keep serving the others.
                Err(e) => {
                    eprintln!("kestrel-server: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let app = app.clone();
        let service = tower::service_fn(move |req: Request<hyper::body::Incoming>| {
            let app = app.clone();
            async move {
                let req = req.map(Body::new);
                match app.get() {
                    Some(router) => router.clone().oneshot(req).await,
                    None => Ok(loading(req.uri().path())),
                }
            }
        });
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
            // Errors here are the client's (reset, timeout): nothing to answer.
            let _ = conn.await;
        });
    }
}

fn loading(path: &str) -> Response {
    if path == "/health" {
        let body = serde_json::json!({"status": "loading"});
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    }
    ApiError::unavailable("the model is loading").into_response()
}

/// Middleware: logs `method route status tokens-in tokens-out time` once the response's
/// body is done, and gives every 4xx/5xx without a JSON body (axum's 405, 413, ...) one.
pub async fn log_and_json_errors(req: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let resp = next.run(req).await;
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    let mut resp = if (status.is_client_error() || status.is_server_error()) && !is_json {
        let message = match status {
            StatusCode::METHOD_NOT_ALLOWED => format!("method {method} is not allowed on {path}"),
            StatusCode::PAYLOAD_TOO_LARGE => "the request body is too large".to_string(),
            s => s.canonical_reason().unwrap_or("error").to_string(),
        };
        let mut e = ApiError::invalid(message, None).with_status(status);
        if status.is_server_error() {
            e.kind = "server_error";
        }
        e.into_response()
    } else {
        resp
    };
    let counts = resp.extensions_mut().remove::<Arc<TokenCounts>>();
    let log = LogOnDrop {
        line: format!("{method} {path} {}", status.as_u16()),
        counts,
        started,
    };
    let (parts, body) = resp.into_parts();
    let body = body.into_data_stream().map(move |chunk| {
        let _ = &log;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(body))
}

/// Writes a request's log line when its response body is dropped (sent or abandoned).
struct LogOnDrop {
    line: String,
    counts: Option<Arc<TokenCounts>>,
    started: Instant,
}

impl Drop for LogOnDrop {
    fn drop(&mut self) {
        let (p, c) = match &self.counts {
            Some(c) => (
                c.prompt.load(Ordering::Relaxed).to_string(),
                c.completion.load(Ordering::Relaxed).to_string(),
            ),
            None => ("-".into(), "-".into()),
        };
        eprintln!(
            "{} in {p} out {c} {:.1} ms",
            self.line,
            self.started.elapsed().as_secs_f64() * 1e3
        );
    }
}

/// CORS for `origin` (`*` for any).
pub fn cors(origin: &str) -> Result<CorsLayer, String> {
    let allow = if origin == "*" {
        AllowOrigin::any()
    } else {
        let v = HeaderValue::from_str(origin).map_err(|_| format!("bad CORS origin '{origin}'"))?;
        // Echoed only to that origin: other origins get no CORS header at all.
        AllowOrigin::list([v])
    };
    Ok(CorsLayer::new()
        .allow_origin(allow)
        .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
        .allow_headers(Any))
}
