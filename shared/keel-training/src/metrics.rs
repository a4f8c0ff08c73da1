//! Metrics of a training step, accumulated over its microbatches. A mean whose sum was
//! divided by a global count adds up; a min or max combines as such; a count of the global
//! batch is the same in every microbatch.

use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Stat {
    Sum(f64),
    Min(f64),
    Max(f64),
    Global(f64),
}

impl Stat {
    fn merge(self, other: Stat) -> Stat {
        match (self, other) {
            (Stat::Sum(a), Stat::Sum(b)) => Stat::Sum(a + b),
            (Stat::Min(a), Stat::Min(b)) => Stat::Min(a.min(b)),
            (Stat::Max(a), Stat::Max(b)) => Stat::Max(a.max(b)),
            (_, other) => other,
        }
    }

    fn value(self) -> f64 {
        match self {
            Stat::Sum(v) | Stat::Min(v) | Stat::Max(v) | Stat::Global(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics(BTreeMap<String, Stat>);

impl Metrics {
    fn put(&mut self, name: &str, stat: Stat) {
        let merged = match self.0.get(name) {
            Some(old) => old.merge(stat),
            None => stat,
        };
        self.0.insert(name.to_string(), merged);
    }

    /// A part of a sum over microbatches (a mean already divided by a global count).
    pub fn sum(&mut self, name: &str, value: f64) {
        self.put(name, Stat::Sum(value));
    }

    pub fn min(&mut self, name: &str, value: f64) {
        self.put(name, Stat::Min(value));
    }

    pub fn max(&mut self, name: &str, value: f64) {
        self.put(name, Stat::Max(value));
    }

    /// A value of the global batch, the same in every microbatch.
    pub fn global(&mut self, name: &str, value: f64) {
        self.put(name, Stat::Global(value));
    }

    pub fn merge(&mut self, other: Metrics) {
        for (name, stat) in other.0 {
            self.put(&name, stat);
        }
    }

    pub fn get(&self, name: &str) -> Option<f64> {
        self.0.get(name).map(|s| s.value())
    }

    pub fn into_map(self) -> BTreeMap<String, f64> {
        self.0.into_iter().map(|(k, v)| (k, v.value())).collect()
    }

    /// The metrics as bytes that [`Metrics::from_bytes`] reads back exactly (to combine the
    /// data-parallel ranks' metrics): one `kind name value-bits` line per metric.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = String::new();
        for (name, stat) in &self.0 {
            let kind = match stat {
                Stat::Sum(_) => 's',
                Stat::Min(_) => 'n',
                Stat::Max(_) => 'x',
                Stat::Global(_) => 'g',
            };
            out.push_str(&format!("{kind} {name} {:x}\n", stat.value().to_bits()));
        }
        out.into_bytes()
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let mut metrics = Self::default();
        for line in std::str::from_utf8(bytes).ok()?.lines() {
            let mut parts = line.splitn(3, ' ');
            let (kind, name, bits) = (parts.next()?, parts.next()?, parts.next()?);
            let value = f64::from_bits(u64::from_str_radix(bits, 16).ok()?);
            let stat = match kind {
                "s" => Stat::Sum(value),
                "n" => Stat::Min(value),
                "x" => Stat::Max(value),
                "g" => Stat::Global(value),
                _ => return None,
            };
            metrics.0.insert(name.to_string(), stat);
        }
        Some(metrics)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn microbatch_metrics_combine_by_kind() {
        let mut a = Metrics::default();
        a.sum("loss", 0.25);
        a.min("ratio_min", 0.9);
        a.max("ratio_max", 1.1);
        a.global("num_valid_samples", 4.0);
        let mut b = Metrics::default();
        b.sum("loss", 0.5);
        b.min("ratio_min", 0.8);
        b.max("ratio_max", 1.05);
        b.global("num_valid_samples", 4.0);
        a.merge(b);
        let m = a.into_map();
        assert_eq!((m["loss"], m["ratio_min"], m["ratio_max"], m["num_valid_samples"]), (0.75, 0.8, 1.1, 4.0));
    }

    #[test]
    fn metrics_survive_bytes_exactly() {
        let mut a = Metrics::default();
        a.sum("loss", 0.1 + 0.2);
        a.min("ratio_min", -0.0);
        a.max("ratio_max", f64::INFINITY);
        a.global("global_valid_tokens", 17.0);
        assert_eq!(Metrics::from_bytes(&a.to_bytes()), Some(a));
        assert_eq!(Metrics::from_bytes(b"q loss 0"), None);
    }
}
