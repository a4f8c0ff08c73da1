//! The dashboard: a static page (`assets/dashboard`, with uPlot vendored under
//! `assets/vendor`) built into the binary and served at `/dashboard`. It reads the REST API
//! from the browser: the runs list, and per run live plots of reward, loss, KL, validation
//! accuracy and the step-time breakdown, with a sample browser. `/` redirects to it.

use axum::Router;
use axum::extract::Path;
use axum::http::{StatusCode, header};
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

pub fn routes() -> Router {
    Router::new()
        .route("/", get(|| async { Redirect::temporary("/dashboard") }))
        .route("/dashboard", get(index))
        .route("/dashboard/", get(index))
        .route("/dashboard/{*path}", get(asset))
}

async fn index() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-cache")], INDEX).into_response()
}

async fn asset(Path(path): Path<String>) -> Response {
    match ASSETS.iter().find(|(name, _, _)| *name == path) {
        Some((_, content_type, body)) => {
            ([(header::CONTENT_TYPE, *content_type), (header::CACHE_CONTROL, "no-cache")], *body).into_response()
        }
        None => keel_service::ApiError {
            status: StatusCode::NOT_FOUND,
            error_type: "not_found",
            message: format!("no dashboard asset `{path}`"),
        }
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
            let response = routes().oneshot(Request::get(path).body(Body::empty()).unwrap()).await.unwrap();
            assert_eq!(response.status().as_u16(), status, "{path}");
        }
    }
}
