//! Query strings: axum's `Query`, its rejection answered as the JSON error body
//! (`invalid_request`, 400) every other error of a Keel service has, not plain text.

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::ApiError;

/// A query string decoded as `T`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Query<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(Self(value)),
            Err(rejection) => Err(ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", rejection.body_text())),
        }
    }
}
