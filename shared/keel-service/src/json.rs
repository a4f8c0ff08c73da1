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

/// The path (`info.loss`, `metrics.reward`) of the first number in `value` that Postgres's
/// `jsonb` would store but not give back: it keeps a number as an exact decimal and writes
/// it out in full (`-1.7976931348623157e308` comes back as 309 digits), which a JSON reader
/// may then find out of range. A request holding one is refused before it is written.
pub fn unstorable_number(value: &serde_json::Value, at: &str) -> Option<String> {
    use serde_json::Value;
    let join = |key: &str| if at.is_empty() { key.to_string() } else { format!("{at}.{key}") };
    match value {
        Value::Number(n) => {
            let plain = plain_decimal(&n.to_string());
            serde_json::from_str::<serde_json::Number>(&plain).is_err().then(|| at.to_string())
        }
        Value::Array(items) => items.iter().enumerate().find_map(|(i, v)| unstorable_number(v, &format!("{at}[{i}]"))),
        Value::Object(map) => map.iter().find_map(|(k, v)| unstorable_number(v, &join(k))),
        _ => None,
    }
}

/// A JSON number's text (`-1.5e3`) written out without an exponent (`-1500`), as Postgres
/// writes a `numeric`.
fn plain_decimal(text: &str) -> String {
    let (sign, unsigned) = text.strip_prefix('-').map_or(("", text), |rest| ("-", rest));
    let (mantissa, exponent) = match unsigned.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.trim_start_matches('+').parse::<i64>().unwrap_or(0)),
        None => (unsigned, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{whole}{fraction}");
    let point = whole.len() as i64 + exponent;
    let body = if point <= 0 {
        format!("0.{}{digits}", "0".repeat((-point) as usize))
    } else if point as usize >= digits.len() {
        format!("{digits}{}", "0".repeat(point as usize - digits.len()))
    } else {
        format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
    };
    let body = body.trim_start_matches('0');
    let body = if body.is_empty() || body.starts_with('.') { format!("0{body}") } else { body.to_string() };
    format!("{sign}{body}")
}

/// A JSON value read from any format, refused with an error as soon as it holds more than
/// `budget` units (a value is one unit, a string or key one more per byte). For a format with
/// aliases (YAML's `&anchor`/`*alias`), whose few kilobytes of text can stand for gigabytes of
/// values: with a budget of the text's own length, no document written out in full is
/// refused, and one that aliases expand costs at most about that much.
pub fn bounded_value<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
    budget: usize,
) -> Result<serde_json::Value, D::Error> {
    use serde::de::DeserializeSeed;
    let left = std::cell::Cell::new(budget);
    Bounded { left: &left, budget }.deserialize(deserializer)
}

#[derive(Clone, Copy)]
struct Bounded<'a> {
    left: &'a std::cell::Cell<usize>,
    budget: usize,
}

impl Bounded<'_> {
    fn spend<E: serde::de::Error>(&self, units: usize) -> Result<(), E> {
        match self.left.get().checked_sub(units) {
            Some(left) => {
                self.left.set(left);
                Ok(())
            }
            None => Err(E::custom(format!(
                "the document expands to more than {} units (aliases repeating what they name?): write it out \
                 without anchors and aliases",
                self.budget
            ))),
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for Bounded<'_> {
    type Value = serde_json::Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

/// A map key: a string, or a scalar written as one.
struct Key<'a>(Bounded<'a>);

impl<'de> serde::de::DeserializeSeed<'de> for Key<'_> {
    type Value = String;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        match self.0.deserialize(deserializer)? {
            serde_json::Value::String(key) => Ok(key),
            serde_json::Value::Number(n) => Ok(n.to_string()),
            serde_json::Value::Bool(b) => Ok(b.to_string()),
            other => Err(serde::de::Error::custom(format!("a key must be a string, not {other}"))),
        }
    }
}

impl<'de> serde::de::Visitor<'de> for Bounded<'_> {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
        self.spend(1)?;
        Ok(v.into())
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
        self.spend(1)?;
        Ok(v.into())
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
        self.spend(1)?;
        Ok(v.into())
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
        self.spend(1)?;
        Ok(serde_json::Number::from_f64(v).map_or(serde_json::Value::Null, serde_json::Value::Number))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        self.spend(1 + v.len())?;
        Ok(v.into())
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        self.spend(1)?;
        Ok(serde_json::Value::Null)
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        self.visit_unit()
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        serde::de::DeserializeSeed::deserialize(self, deserializer)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        self.spend(1)?;
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self)? {
            items.push(item);
        }
        Ok(serde_json::Value::Array(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        self.spend(1)?;
        let mut object = serde_json::Map::new();
        while let Some(key) = map.next_key_seed(Key(self))? {
            let value = map.next_value_seed(self)?;
            object.insert(key, value);
        }
        Ok(serde_json::Value::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The number a fuzzer sent as a checkpoint's `info` (Postgres stored it, then could not
    /// give it back) is found by its path; ordinary numbers, tiny ones and large ones that
    /// read back are not.
    #[test]
    fn numbers_postgres_cannot_give_back_are_found() {
        assert_eq!(plain_decimal("-1.5e3"), "-1500");
        assert_eq!(plain_decimal("2.5e-3"), "0.0025");
        assert_eq!(plain_decimal("12.75"), "12.75");
        assert_eq!(plain_decimal("0"), "0");
        let bad: serde_json::Value = serde_json::from_str(r#"{"a": [1, {"b": -1.7976931348623157e308}]}"#).unwrap();
        assert_eq!(unstorable_number(&bad, "info").as_deref(), Some("info.a[1].b"));
        let fine: serde_json::Value = serde_json::from_str(r#"{"a": [1, 2.5, 1e300, 5e-324, -3]}"#).unwrap();
        assert_eq!(unstorable_number(&fine, "info"), None);
    }

    /// A YAML alias bomb (each level names the one below nine times) is refused once it
    /// expands past the budget, long before it is built; the same document written out is
    /// read whole.
    #[test]
    fn aliases_cannot_expand_past_the_budget() {
        let mut bomb = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x]\n");
        for level in 1..12 {
            let below = format!("*a{}", level - 1);
            bomb.push_str(&format!("a{level}: &a{level} [{}]\n", vec![below; 9].join(", ")));
        }
        let error = bounded_value(serde_yaml_ng::Deserializer::from_str(&bomb), bomb.len()).unwrap_err();
        assert!(error.to_string().contains("without anchors and aliases"), "{error}");
        let plain = "name: run\nsizes: [1, 2.5, -3]\nnested: {a: [true, null, \"s\"]}\n1: one\n";
        let value = bounded_value(serde_yaml_ng::Deserializer::from_str(plain), plain.len()).unwrap();
        assert_eq!(value["nested"]["a"][2], "s");
        assert_eq!(value["1"], "one");
        let json = r#"{"a": [1, 2, {"b": "c"}], "d": 1.5}"#;
        let value = bounded_value(&mut serde_json::Deserializer::from_str(json), json.len()).unwrap();
        assert_eq!(value, serde_json::from_str::<serde_json::Value>(json).unwrap());
    }

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
