//! The dashboard: a static page (`assets/dashboard`, with uPlot vendored under
//! `assets/vendor`) built into the binary and served at `/dashboard`. It reads the REST API
//! from the browser: the runs list, and per run live plots of reward, loss, KL, validation
//! accuracy and the step-time breakdown, with a sample browser. `/` redirects to it.

use axum::Router;
use axum::extract::{Path, Request};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;

/// (path under `/dashboard/`, content type, body)
const ASSETS: [(&str, &str, &str); 5] = [
    ("dashboard.js", "text/javascript; charset=utf-8", include_str!("../assets/dashboard/dashboard.js")),
    ("dashboard.css", "text/css; charset=utf-8", include_str!("../assets/dashboard/dashboard.css")),
    (
        "vendor/uplot/uPlot.iife.min.js",
        "text/javascript; charset=utf-8",
        include_str!("../assets/vendor/uplot/uPlot.iife.min.js"),
    ),
    ("vendor/uplot/uPlot.min.css", "text/css; charset=utf-8", include_str!("../assets/vendor/uplot/uPlot.min.css")),
    ("vendor/uplot/LICENSE", "text/plain; charset=utf-8", include_str!("../assets/vendor/uplot/LICENSE")),
];

const INDEX: &str = include_str!("../assets/dashboard/index.html");

/// The dashboard's routes; with an API token, the page and its assets want it too: opened
/// as `/dashboard?token=<token>`, the page sets an HTTP-only cookie and goes on without the
/// token in its address; without it, a short page says how to open it.
pub fn routes(token: Option<String>) -> Router {
    let token = std::sync::Arc::new(token);
    Router::new()
        .route("/", get(|| async { Redirect::temporary("/dashboard") }))
        .route("/dashboard", get(index))
        .route("/dashboard/", get(index))
        .route("/dashboard/{*path}", get(asset))
        .route_layer(axum::middleware::from_fn(move |request: Request, next: Next| {
            let token = token.clone();
            async move { guard(token.as_deref(), request, next).await }
        }))
}

async fn guard(token: Option<&str>, request: Request, next: Next) -> Response {
    let Some(token) = token else { return next.run(request).await };
    let query = request.uri().query().unwrap_or_default();
    let given = query.split('&').filter_map(|pair| pair.split_once('=')).find(|(k, _)| *k == "token").map(|(_, v)| v);
    if let Some(given) = given {
        if !keel_service::token_matches(given, token) {
            return refused();
        }
        // The token leaves the address (and the history); the cookie carries it from now on.
        let rest: Vec<&str> = query.split('&').filter(|pair| !pair.starts_with("token=")).collect();
        let path = request.uri().path();
        let location = if rest.is_empty() { path.to_string() } else { format!("{path}?{}", rest.join("&")) };
        let cookie = format!("{}={given}; HttpOnly; SameSite=Strict; Path=/", crate::api::TOKEN_COOKIE);
        return (StatusCode::SEE_OTHER, [(header::LOCATION, location), (header::SET_COOKIE, cookie)]).into_response();
    }
    if crate::api::authorized(&request, Some(token)) { next.run(request).await } else { refused() }
}

/// The page a browser without the token gets: how to open the dashboard and where an
/// operator finds the setting, never a token.
fn refused() -> Response {
    let page = "<!doctype html><title>Keel: token needed</title>\
                <h1>This dashboard needs the API token</h1>\
                <p>Open it as <code>/dashboard?token=&lt;token&gt;</code>; the token is then kept in a cookie \
                and leaves the address.</p>\
                <p>The token is the orchestrator's <code>KEEL_API_TOKEN</code> setting: ask whoever runs this \
                Keel, or read it where they set it (<code>.env</code> beside compose.yaml, the \
                <code>keel-secrets</code> Secret on Kubernetes, the shell that started the local stack).</p>";
    (StatusCode::UNAUTHORIZED, [(header::CONTENT_TYPE, "text/html; charset=utf-8")], page).into_response()
}

async fn index() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-cache")], INDEX).into_response()
}

async fn asset(Path(path): Path<String>) -> Response {
    match ASSETS.iter().find(|(name, _, _)| *name == path) {
        Some((_, content_type, body)) => {
            ([(header::CONTENT_TYPE, *content_type), (header::CACHE_CONTROL, "no-cache")], *body).into_response()
        }
        None => keel_service::ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no dashboard asset `{path}`"))
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    #[tokio::test]
    async fn every_asset_the_page_links_is_served() {
        for (name, _, _) in ASSETS.iter().filter(|(name, _, _)| !name.ends_with("LICENSE")) {
            assert!(INDEX.contains(&format!("/dashboard/{name}")), "index.html links {name}");
        }
        for (path, status) in [
            ("/dashboard", 200),
            ("/dashboard/dashboard.js", 200),
            ("/dashboard/vendor/uplot/uPlot.min.css", 200),
            ("/dashboard/nope.js", 404),
            ("/", 307),
        ] {
            let response = routes(None).oneshot(Request::get(path).body(Body::empty()).unwrap()).await.unwrap();
            assert_eq!(response.status().as_u16(), status, "{path}");
        }
    }

    /// With an API token, the page and its assets want it: `?token=` sets the cookie and
    /// sends the browser on without the token in the address; the cookie then opens
    /// everything; a wrong token or none gets the page that says how to open it.
    #[tokio::test]
    async fn with_a_token_the_dashboard_opens_by_its_cookie() {
        let app = routes(Some("s3cret".into()));
        let get = |path: &str, cookie: Option<&str>| {
            let mut request = Request::get(path);
            if let Some(cookie) = cookie {
                request = request.header(header::COOKIE, cookie);
            }
            app.clone().oneshot(request.body(Body::empty()).unwrap())
        };
        for path in ["/dashboard", "/dashboard/dashboard.js"] {
            assert_eq!(get(path, None).await.unwrap().status(), StatusCode::UNAUTHORIZED, "{path}");
            assert_eq!(get(path, Some("keel_token=guess")).await.unwrap().status(), StatusCode::UNAUTHORIZED);
        }
        let refused = get("/dashboard?token=guess", None).await.unwrap();
        assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
        let page = axum::body::to_bytes(refused.into_body(), 1 << 16).await.unwrap();
        let page = String::from_utf8_lossy(&page);
        for says in ["/dashboard?token=", "KEEL_API_TOKEN", ".env", "keel-secrets"] {
            assert!(page.contains(says), "the 401 page says where the token comes from ({says}): {page}");
        }
        for secret in keel_service::PUBLISHED_SECRETS.iter().filter(|s| s.starts_with("keel-")).chain(["s3cret"].iter())
        {
            assert!(!page.contains(secret), "the 401 page names a token ({secret}): {page}");
        }
        let opened = get("/dashboard?token=s3cret&view=runs", None).await.unwrap();
        assert_eq!(opened.status(), StatusCode::SEE_OTHER);
        assert_eq!(opened.headers()[header::LOCATION], "/dashboard?view=runs");
        let cookie = opened.headers()[header::SET_COOKIE].to_str().unwrap();
        assert!(cookie.starts_with("keel_token=s3cret;") && cookie.contains("HttpOnly"), "{cookie}");
        for path in ["/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css"] {
            let response = get(path, Some("other=1; keel_token=s3cret")).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK, "{path}");
        }
    }
}
