//! Request bodies: a body that is not JSON at all is told apart from one that does not fit
//! its type, and the latter's message names the field path (`samples[0].messages: ...`).

use serde::de::DeserializeOwned;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("the body is not JSON: {0}")]
    NotJson(String),
    #[error("{0}")]
    Invalid(String),
}

/// Decodes `bytes` as a `T`.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, BodyError> {
    if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
        return Err(BodyError::NotJson(e.to_string()));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        BodyError::Invalid(if path == "." { inner.to_string() } else { format!("{path}: {inner}") })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Outer {
        items: Vec<Inner>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        size: u32,
    }

    #[test]
    fn errors_tell_not_json_from_misfit_and_name_the_path() {
        assert!(matches!(parse::<Outer>(b"{oops"), Err(BodyError::NotJson(_))));
        let err = parse::<Outer>(br#"{"items": [{"size": 1}, {"size": "big"}]}"#).unwrap_err().to_string();
        assert!(err.starts_with("items[1].size: "), "{err}");
        let err = parse::<Outer>(br#"{"items": [], "extra": 1}"#).unwrap_err().to_string();
        assert!(err.contains("extra"), "{err}");
        assert_eq!(parse::<Outer>(br#"{"items": [{"size": 2}]}"#).unwrap().items.len(), 1);
    }
}
