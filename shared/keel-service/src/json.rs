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

/// Decodes `bytes` as a `T`. A number with a zero fraction (`2.0`, `1e3`) is taken where an
/// integer is expected, as JSON Schema's `integer` allows: a body refused only for such a
/// number is decoded again with them as integers ([`integral_numbers`]).
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, BodyError> {
    if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
        return Err(BodyError::NotJson(e.to_string()));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let refused = match serde_path_to_error::deserialize(&mut deserializer) {
        Ok(value) => return Ok(value),
        Err(e) => e,
    };
    if let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(bytes)
        && integral_numbers(&mut value)
        && let Ok(decoded) = serde_path_to_error::deserialize(value)
    {
        return Ok(decoded);
    }
    let path = refused.path().to_string();
    let inner = refused.into_inner();
    Err(BodyError::Invalid(if path == "." { inner.to_string() } else { format!("{path}: {inner}") }))
}

/// Writes every number of `value` that has a zero fraction and fits a 64-bit integer (`2.0`,
/// `-3.0`, `1e3`) as that integer; whether there was one. Serde refuses `2.0` for a `u32`
/// where JSON Schema's `integer` takes it; a number meant as a float reads the same either
/// way.
pub fn integral_numbers(value: &mut serde_json::Value) -> bool {
    use serde_json::Value;
    match value {
        Value::Number(n) if n.is_f64() => {
            let Some(f) = n.as_f64() else { return false };
            if f.fract() != 0.0 || !f.is_finite() {
                return false;
            }
            // 2^64 and -2^63: the bounds of u64 and i64 as exact floats.
            *n = if (0.0..18_446_744_073_709_551_616.0).contains(&f) {
                (f as u64).into()
            } else if (-9_223_372_036_854_775_808.0..0.0).contains(&f) {
                (f as i64).into()
            } else {
                return false;
            };
            true
        }
        Value::Array(items) => items.iter_mut().fold(false, |found, v| integral_numbers(v) | found),
        Value::Object(map) => map.values_mut().fold(false, |found, v| integral_numbers(v) | found),
        _ => false,
    }
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

    #[derive(Debug, PartialEq, serde::Deserialize)]
    struct Numbers {
        count: u32,
        offset: i64,
        ratio: f64,
        free: serde_json::Value,
    }

    /// `2.0` where an integer is expected, as JSON Schema allows; a true fraction, a value out
    /// of range or a misfit elsewhere still refused, with its own message.
    #[test]
    fn integers_may_be_written_with_a_zero_fraction() {
        let parsed: Numbers = parse(br#"{"count": 2.0, "offset": -3.0, "ratio": 1.0, "free": 1e3}"#).unwrap();
        assert_eq!(parsed, Numbers { count: 2, offset: -3, ratio: 1.0, free: serde_json::json!(1000) });
        // A body that decodes as it is keeps its numbers as sent.
        let parsed: Numbers = parse(br#"{"count": 2, "offset": 0, "ratio": 1.0, "free": 1.0}"#).unwrap();
        assert_eq!(parsed.free, serde_json::json!(1.0));
        let err = parse::<Numbers>(br#"{"count": 2.5, "offset": 0, "ratio": 1, "free": null}"#).unwrap_err();
        assert!(err.to_string().starts_with("count: invalid type: floating point `2.5`"), "{err}");
        let err = parse::<Numbers>(br#"{"count": 5e9, "offset": 0, "ratio": 1, "free": null}"#).unwrap_err();
        assert!(err.to_string().starts_with("count: "), "{err}");
        let err = parse::<Numbers>(br#"{"count": 2.0, "offset": "x", "ratio": 1, "free": null}"#).unwrap_err();
        assert!(err.to_string().starts_with("count: "), "the first refusal is reported: {err}");
        let mut big = serde_json::json!([1e19, -1e300, 1e300, 0.5]);
        assert!(integral_numbers(&mut big));
        assert_eq!(big, serde_json::json!([10_000_000_000_000_000_000u64, -1e300, 1e300, 0.5]));
    }
}
